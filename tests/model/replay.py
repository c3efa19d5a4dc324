"""Replay a failing schedule written by the model-based suite: ``python -m tests.model.replay FILE.json``.

Starts the deployment's servers and workers afresh, runs the schedule ``--times`` times (3) and prints the broken
promises of each run; exit status 1 when any run broke one.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for worker_cluster

from tests.model.suite import Deployment, bench, check_schedule


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("file")
    parser.add_argument("--times", type=int, default=3)
    args = parser.parse_args(argv)
    data = json.loads(Path(args.file).read_text())
    d = Deployment(**data["deployment"])
    broken = 0
    with tempfile.TemporaryDirectory() as tmp, bench(Path(tmp), d) as b:
        for i in range(args.times):
            _, violations = check_schedule(b, data["steps"])
            print(f"run {i + 1}: {len(violations)} broken promise(s)")
            for v in violations:
                print("  " + v)
            broken += bool(violations)
    return 1 if broken else 0


if __name__ == "__main__":
    sys.exit(main())
