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
import importlib
import os
import secrets
import statistics
import sys
import time
import uuid
from collections.abc import Callable
from typing import Any

sys.path.insert(0, "/tmp/task-ab")

from celery import Celery, Task
from celery.app.trace import build_tracer

from celery_singleton_lock.testing import redis_servers

SLICE = float(sys.argv[1]) if len(sys.argv) > 1 else 0.1
ROUNDS = int(sys.argv[2]) if len(sys.argv) > 2 else 30


def request_for(task_id: str, name: str) -> dict[str, Any]:
    return {
        "id": task_id,
        "task": name,
        "hostname": "ab@localhost",
        "is_eager": False,
        "delivery_info": {"exchange": "", "routing_key": "celery", "priority": 0, "redelivered": False},
        "ignore_result": True,
        "reply_to": None,
        "correlation_id": task_id,
        "retries": 0,
    }


def paths(package: str, url: str) -> tuple[dict[str, Callable[[], Any]], Callable[[], None]]:
    module = importlib.import_module(f"{package}.task")

    class Base(module.LockedTask):  # type: ignore[misc,name-defined]
        abstract = True
        Request = f"{package}.task:LockedRequest"  # the checkout's own (bind checks it)

    locked_base = Base
    redlock = importlib.import_module(f"{package}.lock.redlock").Redlock
    app = Celery(f"ab-{package}-{secrets.token_hex(4)}", broker="memory://", set_as_current=False)
    app.conf.update(singleton_lock_urls=[url], task_ignore_result=True)

    @app.task(name=f"{package}.plain", base=Task)  # type: ignore[misc]
    def plain(x: int) -> None:
        return None

    @app.task(name=f"{package}.locked", base=locked_base)  # type: ignore[misc]
    def locked(x: int) -> None:
        return None

    app.finalize()
    plain, locked = app.tasks[plain.name], app.tasks[locked.name]
    trace_plain = build_tracer(plain.name, plain, app=app, hostname="ab@localhost")
    trace_locked = build_tracer(locked.name, locked, app=app, hostname="ab@localhost")
    held = -1 - os.getpid()
    record = {"state": "run", "name": locked.name, "worker": "1@ab", "at": "1763800000000", "try": "0"}
    blocker = redlock(url, locked.lock_key_for(held), ttl=3600, job=f"holder-{uuid.uuid4()}", record=record)
    if not blocker.acquire(blocking=False):
        raise RuntimeError("could not take the held key")
    serial = iter(range(10**12))

    def run_plain() -> None:
        tid = str(uuid.uuid4())
        trace_plain(tid, (0,), {}, request_for(tid, plain.name))

    def run_executed() -> None:
        tid = str(uuid.uuid4())
        if trace_locked(tid, (next(serial),), {}, request_for(tid, locked.name)).retval is not None:
            raise RuntimeError("the executed path did not run the body")

    def run_skipped() -> None:
        tid = str(uuid.uuid4())
        if trace_locked(tid, (held,), {}, request_for(tid, locked.name)).retval is None:
            raise RuntimeError("the skip path ran the body")

    return {"plain": run_plain, "executed": run_executed, "skipped": run_skipped}, blocker.release


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
        sides = {name: paths(name, url) for name in ("csl_old", "csl_new")}
        for ops, _ in sides.values():
            for op in ops.values():
                for _ in range(300):
                    op()
        cpu: dict[tuple[str, str], list[float]] = {}
        for rnd in range(ROUNDS):
            order = ["csl_old", "csl_new"] if rnd % 2 == 0 else ["csl_new", "csl_old"]
            for path in ("plain", "executed", "skipped"):
                for side in order:
                    cpu.setdefault((side, path), []).append(cpu_per_op(sides[side][0][path], SLICE))
        for _, release in sides.values():
            release()

    def paired(a: tuple[str, str], b: tuple[str, str]) -> tuple[float, float, float]:
        r = sorted(x / y for x, y in zip(cpu[a], cpu[b], strict=True))
        return statistics.median(r), r[len(r) // 10], r[-1 - len(r) // 10]

    print(f"{ROUNDS} rounds x {SLICE:g} s per path and checkout; client CPU per task (median µs) and paired ratios")
    for path in ("plain", "executed", "skipped"):
        old, new = statistics.median(cpu["csl_old", path]), statistics.median(cpu["csl_new", path])
        m, lo, hi = paired(("csl_new", path), ("csl_old", path))
        print(f"{path:9s} old {old:7.1f}  new {new:7.1f}  new/old {m:.3f}x [{lo:.3f}, {hi:.3f}] (10th-90th pct)")
    for side in ("csl_old", "csl_new"):
        s, slo, shi = paired((side, "skipped"), (side, "executed"))
        e, elo, ehi = paired((side, "executed"), (side, "plain"))
        print(
            f"{side}: skipped/executed {s:.3f}x [{slo:.3f}, {shi:.3f}]; executed/plain {e:.2f}x [{elo:.2f}, {ehi:.2f}]"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
