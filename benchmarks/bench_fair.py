"""Fair turns (``lock_fair_on``): how many turns each tenant's calls wait behind a flood, before and after.

A flood of ``--a`` calls of tenant A, then ``--others`` each of B and C, all sent at once to one key's two shared
slots (tests/apps/locked_app.py: ``arrival_call`` wakes waiters in arrival order, ``fair_call`` has
``lock_fair_on=["tenant"]``), on one prefork worker of 3 processes and three lock nodes. A call's wait in turns is
the number of starts between its arrival at a worker and its own start (tests/policies/test_fair.py's ``turns``)
before, and
as the line's node counts it (from joining the line, ``line_turns``) after. Prints, per tenant, the calls that
waited, the min / median / max turns waited, and the largest excess over the bound 3k + 5 (at most 0: held)::

    PYTHONPATH=$PWD python benchmarks/bench_fair.py                 # 1,000 / 10 / 10
    PYTHONPATH=$PWD python benchmarks/bench_fair.py --a 200         # CI's size
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from test_fair import bound, line_turns, turns  # noqa: E402
from worker_cluster import cluster, new_key, polling  # noqa: E402


def run(c, task, a: int, others: int, duration: float) -> tuple[float, list[tuple[str, int, int]]]:  # type: ignore[no-untyped-def]
    key = new_key("bench-fair")
    start = time.monotonic()
    ids = [task.delay(key, "A", i, duration).id for i in range(a)]
    for i in range(others):
        ids += [task.delay(key, "B", i, duration).id, task.delay(key, "C", i, duration).id]
    for _ in polling(a * 0.5 + 300, 0.2):
        if len({r[1] for r in c.runs(key)}) >= len(ids):
            break
    wall = time.monotonic() - start
    records = [r for r in c.records("fair") if r[0] == key]
    assert len({r[3] for r in records}) == len(ids), "not every call ran"
    return wall, line_turns(records) if records and len(records[0]) > 6 else turns(records)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--a", type=int, default=1000)
    parser.add_argument("--others", type=int, default=10)
    parser.add_argument("--duration", type=float, default=0.01)
    opts = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp, cluster(Path(tmp), ttl=4.0) as c:
        mod = c.app_module()
        c.worker("bench-fair", concurrency=3)
        print(f"flood: A x {opts.a}, then B x {opts.others} and C x {opts.others}; 2 slots; body {opts.duration}s")
        print("| order | tenant | calls | min | median | max turns waited | over 3k+5 | wall s |")
        print("|---|---|---|---|---|---|---|---|")
        for label, task in (("before: arrival", mod.arrival_call), ("after: fair", mod.fair_call)):
            wall, rows = run(c, task, opts.a, opts.others, opts.duration)
            for tenant in "ABC":
                waits = [w for t, _, w in rows if t == tenant] or [0]
                over = max((w - bound(k) for t, k, w in rows if t == tenant), default=0)
                print(
                    f"| {label} | {tenant} | {len(waits)} | {min(waits)} | {statistics.median(waits):.0f} | "
                    f"{max(waits)} | {over} | {wall:.1f} |"
                )


if __name__ == "__main__":
    main()
