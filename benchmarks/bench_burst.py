"""Burst benchmark: 1,000 identical ``delay()`` calls, and ``lock_limit=4`` under a burst, with real workers.

Part 1, dedup. For each contender (plain Task, ours in run scope, ours in queue scope, celery-once, celery-singleton)
and each body (no-op, 20 ms, and 1 s, which outlasts the whole burst): a worker (``-P prefork -c 2``, the
machine's 2 cores) consumes a queue of its own;
the client then makes ``--calls`` identical ``delay(key, duration)`` calls in a tight loop, one key per (contender,
body, round), and waits until every published message has an outcome. Counted:

* ``published``   messages the client really published (Celery's ``before_task_publish`` signal in the client);
* ``runs``        bodies that ran (each records itself);
* ``usable``      calls whose returned ``AsyncResult`` gives the job's value on ``get()`` (a duplicate's caller
                  handed the running or queued job's result counts; an empty or REVOKED one does not);
* ``client CPU``  the client's CPU time per call (``time.process_time``, all its threads), over all calls, and
                  for the deduplicated calls alone (the calls that published nothing: median of per-call times).

Part 2, limit. ``--limit-calls`` calls of one key with *distinct* task ids (each a job of its own, all must run),
20 ms bodies, on one worker ``-P prefork -c 8``: ``lock_limit=4`` (reschedule: the others wait in line) against a
plain Task. Counted: the most runs of the key at once (from the recorded [start, end] windows), and the time from
the first call to the last result, as jobs per second.

Contenders and rounds are interleaved (order rotating each round); the table shows medians over rounds.

    python benchmarks/bench_burst.py                       # ~3 min: 3 rounds
    python benchmarks/bench_burst.py --rounds 1 --calls 200 --json /tmp/burst.json
"""

from __future__ import annotations

import importlib
import json
import os
import statistics
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
BODIES = {"no-op": 0.0, "20 ms": 0.02, "1 s": 1.0}  # 1 s outlasts the whole burst (plain Task not run there)


def _ready(results: list[Any], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    for r in results:
        r.get(timeout=max(1.0, deadline - time.monotonic()), propagate=False)


def dedup(mod: Any, record: redis.Redis, label: str, duration: float, calls: int) -> dict[str, Any]:
    from celery import signals  # noqa: PLC0415

    task = mod.TASKS[label]
    key = f"k-{uuid.uuid4().hex[:10]}"
    queue = f"q-{label}".replace(" ", "").replace(",", "")
    published: list[str] = []

    def count(sender: Any = None, headers: Any = None, **_: Any) -> None:
        if sender == task.name:
            published.append((headers or {}).get("id", ""))

    signals.before_task_publish.connect(count, weak=False)
    try:
        out = []
        deduplicated: list[float] = []
        clock = time.process_time
        start = clock()
        for _ in range(calls):
            before, sent = clock(), len(published)
            out.append(task.apply_async((key, duration), queue=queue))
            if len(published) == sent:
                deduplicated.append(clock() - before)
        cpu = clock() - start
    finally:
        signals.before_task_publish.disconnect(count)
    real = [r for r in out if r is not None and getattr(r, "id", None)]
    by_id = {r.id: r for r in real}
    _ready(list(by_id.values()), timeout=300)
    values = {i: r.get(timeout=5, propagate=False) for i, r in by_id.items()}
    usable = sum(1 for r in real if values.get(r.id) == key)
    return {
        "published": len(published),
        "runs": record.llen(f"burst:runs:{key}"),
        "usable": usable,
        "client_cpu_us": cpu / calls * 1e6,
        "dedup_cpu_us": statistics.median(deduplicated) * 1e6 if deduplicated else float("nan"),
    }


def limit_burst(mod: Any, record: redis.Redis, name: str, calls: int) -> dict[str, Any]:
    task = getattr(mod, name)
    key = f"l-{uuid.uuid4().hex[:10]}"
    start = time.monotonic()
    results = [task.apply_async((key, 0.02, i), queue="limit") for i in range(calls)]
    _ready(results, timeout=300)
    elapsed = time.monotonic() - start
    states = [r.state for r in results]
    windows = [json.loads(x) for x in record.lrange(f"burst:runs:{key}", 0, -1)]
    events = sorted([(s, 1) for s, _ in windows] + [(e, -1) for _, e in windows])
    current = peak = 0
    for _, step in events:
        current += step
        peak = max(peak, current)
    return {
        "runs": len(windows),
        "succeeded": states.count("SUCCESS"),
        "peak_concurrent": peak,
        "jobs_per_s": calls / elapsed,
    }


def main(argv: list[str] | None = None) -> int:
    parser = harness.Cli(__doc__, quick={"rounds": 1, "calls": 10, "limit_calls": 8})
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--calls", type=int, default=1000)
    parser.add_argument("--limit-calls", type=int, default=200)
    args = parser.parse(argv)
    env = harness.start("burst benchmark", "celery", "kombu", "celery-once", "celery-singleton")
    tmp = tempfile.mkdtemp(prefix="bench-burst-")
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
        mod = importlib.import_module("burst_apps")
        record = redis.Redis.from_url(wenv["BURST_RECORD"])
        labels = list(mod.TASKS)
        queues = ",".join(f"q-{label}".replace(" ", "").replace(",", "") for label in labels)
        worker = CeleryWorker(
            "burst_apps", "burst", cwd=str(HERE), log_path=f"{tmp}/burst.log", concurrency=2, env=wenv,
            extra=["-Q", queues],
        ).start()  # fmt: skip
        limit_worker = CeleryWorker(
            "burst_apps", "limit", cwd=str(HERE), log_path=f"{tmp}/limit.log", concurrency=8, env=wenv,
            extra=["-Q", "limit"],
        ).start()  # fmt: skip
        # Part 1: every (contender, body) but plain Task with the 1 s body; part 2: the limit and its reference.
        dedups = [
            harness.Contender(f"{label} / {body}", dedup, info={"label": label, "body": body, "duration": duration})
            for body, duration in BODIES.items()
            for label in labels
            if not (label == "plain" and duration >= 1)
        ]
        limits = [harness.Contender(name, limit_burst) for name in ("limited", "unlimited")]

        def measure(c: harness.Contender, _rnd: int) -> harness.Sample:
            if c in limits:
                return harness.Sample(ops=args.limit_calls, values=limit_burst(mod, record, c.name, args.limit_calls))
            return harness.Sample(ops=args.calls, values=dedup(mod, record, c["label"], c["duration"], args.calls))

        try:
            mod.plain.apply_async(("warm-up", 0.0), queue=f"q-{labels[0]}").get(timeout=30)  # connections, not counted
            results = harness.interleave(
                dedups + limits,
                args.rounds,
                measure,
                on_round=lambda rnd, _r: print(f"round {rnd + 1}/{args.rounds} done", file=sys.stderr),
            )
        finally:
            worker.stop()
            limit_worker.stop()
    rows = []
    for c in dedups:
        row: dict[str, Any] = {"contender": c["label"], "body": c["body"]}
        for field in ("published", "runs", "usable", "client_cpu_us", "dedup_cpu_us"):
            row[field] = results.median(c.name, field)
        rows.append(row)
    limit_rows = []
    for c in limits:
        row = {"contender": "lock_limit=4" if c.name == "limited" else "plain Task (no limit)"}
        for field in ("runs", "succeeded", "peak_concurrent", "jobs_per_s"):
            row[field] = results.median(c.name, field)
        row["peak_max"] = results.spread(c.name, "peak_concurrent")[1]
        limit_rows.append(row)
    print(f"\n{args.calls} identical delay() calls, median of {args.rounds} rounds ({env['date_utc']}, "
          f"{env['nproc']} cores, {env['cpu_model']})")  # fmt: skip
    print(
        harness.markdown(
            ["contender", "body", "published", "bodies run", "usable results", "client CPU per call (µs)",
             "per deduplicated call"],
            [
                [row["contender"], row["body"], *(f"{row[f]:.0f}" for f in ("published", "runs", "usable",
                                                                           "client_cpu_us", "dedup_cpu_us"))]
                for row in rows
            ],
            align="llrrrrr",
        )
    )  # fmt: skip
    print(f"\n{args.limit_calls} jobs of one key (distinct task ids), 20 ms bodies, prefork -c 8")
    print(
        harness.markdown(
            ["contender", "runs", "succeeded", "most at once (median / max)", "jobs/s"],
            [
                [row["contender"], f"{row['runs']:.0f}", f"{row['succeeded']:.0f}",
                 f"{row['peak_concurrent']:.0f} / {row['peak_max']:.0f}", f"{row['jobs_per_s']:.0f}"]
                for row in limit_rows
            ],
        )
    )  # fmt: skip
    harness.save(args, env, dedup=rows, limit=limit_rows, samples=results.record())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
