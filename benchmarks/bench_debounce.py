"""Debounce benchmark (issue 21): a burst of 1,000 calls of one key with ``lock_debounce=1``, against queue scope's
figures in the same run.

One worker (``-P prefork -c 2``, the machine's 2 cores) on a Redis broker, one lock node. Each round, per contender,
the client makes ``--calls`` calls ``apply_async((key, 0, version))`` of one key (``lock_unique_on=["key"]``,
``version`` = 0..calls-1) in a tight loop, then waits for every result. Counted:

* ``published``     messages the client published (Celery's ``before_task_publish`` signal in the client);
* ``delivered``     messages of the key the worker received (Celery's ``task_received`` in the worker): what the
                    broker carried, a job's re-sent copies included (a debounced job arriving before its burst's due
                    time, more than ``HOLD_MAX`` early, is re-sent for it);
* ``runs``          bodies that ran;
* ``last version``  the version the (last) run carried: debounce runs the burst's last call, queue scope its first;
* ``usable``        calls whose ``AsyncResult.get()`` gave a run's value;
* ``client CPU``    the client's CPU time per call (``time.process_time``), over the burst;
* ``burst ms``      how long the burst's calls took (wall).

Contenders are interleaved (order rotating each round); the table shows medians over rounds.

    python benchmarks/bench_debounce.py                  # ~1 min: 3 rounds
    python benchmarks/bench_debounce.py --quick
"""

from __future__ import annotations

import importlib
import os
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import harness
import redis

from celery_singleton_lock.testing import CeleryWorker, redis_servers

HERE = Path(__file__).resolve().parent
CONTENDERS = {"queue scope": "queue_keyed", "debounce 1 s": "debounced"}


def burst(mod: Any, record: redis.Redis, name: str, calls: int) -> dict[str, Any]:
    from celery import signals  # noqa: PLC0415

    task = getattr(mod, name)
    key = f"d-{uuid.uuid4().hex[:10]}"
    published: list[str] = []

    def count(sender: Any = None, **_: Any) -> None:
        if sender == task.name:
            published.append(sender)

    signals.before_task_publish.connect(count, weak=False)
    try:
        clock = time.process_time
        start, wall = clock(), time.monotonic()
        out = [task.apply_async((key, 0.0, version), queue="debounce") for version in range(calls)]
        cpu, wall = clock() - start, time.monotonic() - wall
    finally:
        signals.before_task_publish.disconnect(count)
    by_id = {r.id: r for r in out}
    deadline = time.monotonic() + 120
    values = {i: r.get(timeout=max(1.0, deadline - time.monotonic()), propagate=False) for i, r in by_id.items()}
    for _ in range(40):  # a late second run (bounded look)
        time.sleep(0.05)
    return {
        "published": len(published),
        "delivered": int(record.get(f"burst:delivered:{key}") or 0),
        "runs": record.llen(f"burst:runs:{key}"),
        "last_version": max(v for v in values.values() if isinstance(v, int)),
        "usable": sum(1 for r in out if isinstance(values.get(r.id), int)),
        "client_cpu_us": cpu / calls * 1e6,
        "burst_ms": wall * 1000,
    }


def main(argv: list[str] | None = None) -> int:
    parser = harness.Cli(__doc__, quick={"rounds": 1, "calls": 50})
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--calls", type=int, default=1000)
    args = parser.parse(argv)
    env = harness.start("debounce benchmark", "celery", "kombu")
    tmp = tempfile.mkdtemp(prefix="bench-debounce-")
    with redis_servers(2) as (broker, lock):
        base = broker.url.rsplit("/", 1)[0]
        wenv = {
            "BURST_BROKER": broker.url,
            "BURST_BACKEND": base + "/1",
            "BURST_LOCK_URL": lock.url,
            "BURST_RECORD": base + "/2",
        }
        os.environ.update(wenv)
        sys.path.insert(0, str(HERE))
        mod = importlib.import_module("debounce_apps")
        record = redis.Redis.from_url(wenv["BURST_RECORD"])
        worker = CeleryWorker(
            "debounce_apps", "debounce", cwd=str(HERE), log_path=f"{tmp}/debounce.log", concurrency=2, env=wenv,
            extra=["-Q", "debounce"],
        ).start()  # fmt: skip
        contenders = [harness.Contender(label, burst, info={"task": name}) for label, name in CONTENDERS.items()]

        def measure(c: harness.Contender, _rnd: int) -> harness.Sample:
            return harness.Sample(ops=args.calls, values=burst(mod, record, c["task"], args.calls))

        try:
            mod.queue_keyed.apply_async(("warm-up", 0.0, 0), queue="debounce").get(timeout=30)  # not counted
            results = harness.interleave(
                contenders,
                args.rounds,
                measure,
                on_round=lambda rnd, _r: print(f"round {rnd + 1}/{args.rounds} done", file=sys.stderr),
            )
        finally:
            worker.stop()
    fields = ("published", "delivered", "runs", "last_version", "usable", "client_cpu_us", "burst_ms")
    rows = [{"contender": c.name, **{f: results.median(c.name, f) for f in fields}} for c in contenders]
    queue_cpu = rows[0]["client_cpu_us"]
    print(f"\n{args.calls} calls of one key, median of {args.rounds} rounds ({env['date_utc']}, {env['nproc']} cores, "
          f"{env['cpu_model']})")  # fmt: skip
    print(
        harness.markdown(
            ["contender", "published", "delivered", "runs", "version run", "usable results",
             "client CPU per call (µs)", "vs queue scope", "burst ms"],
            [
                [r["contender"], f"{r['published']:.0f}", f"{r['delivered']:.0f}", f"{r['runs']:.0f}",
                 f"{r['last_version']:.0f}", f"{r['usable']:.0f}", f"{r['client_cpu_us']:.0f}",
                 f"{r['client_cpu_us'] / queue_cpu:.2f}x", f"{r['burst_ms']:.0f}"]
                for r in rows
            ],
            align="lrrrrrrrr",
        )
    )  # fmt: skip
    harness.save(args, env, rows=rows, samples=results.record())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
