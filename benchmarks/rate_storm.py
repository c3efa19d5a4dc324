"""A storm for one rate key with real workers: ``--calls`` calls of ``rate_tasks.rated`` at (10, 1.0) on two prefork
workers of 3 processes and three lock nodes (Redis broker). Prints the wall time, the busiest window (by the nodes'
clock: must be <= 10), how many re-sends the waiting cost (``singleton_lock_rate_waits`` summed), and the most any
one call waited, the re-sends per call that waited, and how many calls a call sent after them started more
than a window before (arrival order). The CI test runs 60 calls (tests/policies/test_rate_workers.py); this is the
issue's 1,000-call run::

    PYTHONPATH=$PWD python benchmarks/rate_storm.py --calls 1000      # ~100 s of rate, plus start-up
    PYTHONPATH=$PWD python benchmarks/rate_storm.py --quick           # 40 calls
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from worker_cluster import cluster, new_key  # noqa: E402


def busiest(ats: list[float], period: float, slack: float = 0.01) -> int:
    ats = sorted(ats)
    best = j = 0
    for i, at in enumerate(ats):
        while ats[j] <= at - (period - slack):
            j += 1
        best = max(best, i - j + 1)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=1000)
    parser.add_argument("--quick", action="store_true")
    opts = parser.parse_args()
    calls = 40 if opts.quick else opts.calls
    with tempfile.TemporaryDirectory() as tmp, cluster(Path(tmp), ttl=3.0) as c:
        c.app_module()
        import rate_tasks  # noqa: PLC0415 - with the cluster's env

        for name in ("storm-a", "storm-b"):
            c.worker(name, queues="storm", concurrency=3, extra=["-I", "rate_tasks"])
        key = new_key("storm")
        start = time.monotonic()
        results = [rate_tasks.rated.apply_async((key, n, 0.0), queue="storm") for n in range(calls)]
        for r in results:
            r.get(timeout=calls * 0.5 + 120, propagate=False)
        wall = time.monotonic() - start
        rows = [json.loads(x) for x in c.record.lrange("rate_runs", 0, -1)]
        rows = [r for r in rows if r[0] == key]
        ats = [r[3] for r in rows]
        slots = rate_tasks.slot_rows(key)
        violations = rate_tasks.slot_violations(slots, 1.0)
        spread = max((max(r[3].values()) - min(r[3].values()) for r in slots), default=0.0)
        waits = [r[5] for r in rows]
        sent = {r.id: n for n, r in enumerate(results)}
        order = sorted((sent[r[1]], r[3]) for r in rows if r[1] in sent and r[3] is not None)
        soonest, overtaken = float("inf"), 0
        for _, at in reversed(order):  # a call that a call sent after it started more than a window before
            overtaken += soonest < at - 1.0
            soonest = min(soonest, at)
        waiting = sum(1 for w in waits if w)
        states = [r.state for r in results]
        print(
            json.dumps(
                {
                    "calls": calls,
                    "succeeded": states.count("SUCCESS"),
                    "runs": len(rows),
                    "wall_s": round(wall, 1),
                    "span_of_starts_s": round(max(ats) - min(ats), 2) if ats else None,
                    "busiest_window_earliest_node_time_10ms_slack": busiest(ats, 1.0),
                    "busiest_window_skew_slack": rate_tasks.busiest_window(slots, 1.0),
                    "largest_node_time_spread_of_one_start_ms": round(spread * 1000, 2),
                    "slot_violations": violations[:5],
                    "re_sends_total": sum(waits),
                    "most_waits_of_one_call": max(waits) if waits else 0,
                    "calls_that_waited": waiting,
                    "re_sends_per_waiting_call": round(sum(waits) / waiting, 3) if waiting else 0.0,
                    "calls_a_later_sent_call_started_a_window_before": overtaken,
                }
            )
        )


if __name__ == "__main__":
    main()
