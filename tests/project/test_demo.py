"""The README's first command: the demo runs on its own servers and workers and reports what it promises."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

DEMO = Path(__file__).resolve().parent.parent.parent / "examples" / "demo.py"


def test_demo_skips_every_duplicate_and_runs_every_distinct_job() -> None:
    """`python examples/demo.py` exits 0: the double click charged once, 24 of 25 rebuilds skipped, thumbnails and
    the later rebuild ran, and it prints the report and the timeline."""
    proc = subprocess.run(
        [sys.executable, str(DEMO)], capture_output=True, text=True, timeout=240, check=False, cwd=DEMO.parent.parent
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    assert "Every duplicate was skipped and every distinct job ran." in out
    assert "  charge                      2    1        1" in out
    assert "  rebuild_report             25    1       24" in out
    assert "REVOKED: duplicate of demo_tasks.charge skipped" in out
    assert "Timeline" in out
