"""Two checkouts' LockedTask in Celery's tracer, interleaved in ONE process (as bench_lease_ab.py does for the lock
core): per round each path (executed, skipped as another job's duplicate) runs a short slice on both checkouts,
the order alternating, and the per-round paired ratios new/old of client CPU per task are kept, with each
checkout's skipped/executed and executed/plain ratios. The tracer is built on the registry's task object
(``app.tasks[name]``) as a worker builds it; a no-op body, ignore_result, one throwaway redis-server.

    mkdir -p /tmp/task-ab && git archive main celery_singleton_lock | tar -x -C /tmp/task-ab \
        && mv /tmp/task-ab/celery_singleton_lock /tmp/task-ab/csl_old \
        && ln -sfn $PWD/celery_singleton_lock /tmp/task-ab/csl_new
    PYTHONPATH=$PWD python benchmarks/bench_task_ab.py 0.1 30     # slice seconds, rounds

Each checkout's package loads under another name (csl_old, csl_new) beside the other one (its modules import each
other relatively); both lock on the same redis-server.
"""

from __future__ import annotations

import gc
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

sys.path.insert(0, "/tmp/task-ab")

from bench_check import EXECUTED, PLAIN, SKIPPED, task_paths  # the same three paths bench-check traces

from celery_singleton_lock.testing import redis_servers

SLICE = float(sys.argv[1]) if len(sys.argv) > 1 else 0.1
ROUNDS = int(sys.argv[2]) if len(sys.argv) > 2 else 30


def cpu_per_op(op: Callable[[], Any], seconds: float) -> float:
    n = 0
    gc.collect()
    c0 = time.process_time()
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        op()
        n += 1
    return (time.process_time() - c0) / n * 1e6


def main() -> int:
    with redis_servers(1) as servers:
        url = servers[0].url
        sides = {name: task_paths(url, name) for name in ("csl_old", "csl_new")}
        for ops, _ in sides.values():
            for op in ops.values():
                for _ in range(300):
                    op()
        cpu: dict[tuple[str, str], list[float]] = {}
        for rnd in range(ROUNDS):
            order = ["csl_old", "csl_new"] if rnd % 2 == 0 else ["csl_new", "csl_old"]
            for path in (PLAIN, EXECUTED, SKIPPED):
                for side in order:
                    cpu.setdefault((side, path), []).append(cpu_per_op(sides[side][0][path], SLICE))
        for _, release in sides.values():
            release()

    def paired(a: tuple[str, str], b: tuple[str, str]) -> tuple[float, float, float]:
        r = sorted(x / y for x, y in zip(cpu[a], cpu[b], strict=True))
        return statistics.median(r), r[len(r) // 10], r[-1 - len(r) // 10]

    print(f"{ROUNDS} rounds x {SLICE:g} s per path and checkout; client CPU per task (median µs) and paired ratios")
    for path in (PLAIN, EXECUTED, SKIPPED):
        old, new = statistics.median(cpu["csl_old", path]), statistics.median(cpu["csl_new", path])
        m, lo, hi = paired(("csl_new", path), ("csl_old", path))
        print(f"{path:9s} old {old:7.1f}  new {new:7.1f}  new/old {m:.3f}x [{lo:.3f}, {hi:.3f}] (10th-90th pct)")
    for side in ("csl_old", "csl_new"):
        s, slo, shi = paired((side, SKIPPED), (side, EXECUTED))
        e, elo, ehi = paired((side, EXECUTED), (side, PLAIN))
        print(
            f"{side}: skipped/executed {s:.3f}x [{slo:.3f}, {shi:.3f}]; executed/plain {e:.2f}x [{elo:.2f}, {ehi:.2f}]"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
