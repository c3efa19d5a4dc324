"""The key ratios of the lock's cost, printed beside the previous release's (``make bench-check``): a printout for a
person reading a CI log or a pull request, not a timing assertion (nothing here fails on a figure).

One interleaved run (benchmarks/harness.py: round-robin slices, the first contender rotating each round, ratios the
medians of per-round paired ratios), one throwaway redis-server, this process pinned away from it (``--pin split``,
as bench_hotpath.py). Contenders:

* ``floor str``             SET NX PX + EVALSHA compare-and-delete on one persistent redis-py ``Connection``
                            (``_floors.str_cycle``): the least a correct lock does
* ``lock per use``          ``Redlock(url, key)`` built per cycle from the URL string, ``acquire(blocking=False)`` +
                            ``release()``: the lock as a ``with Redlock(url, ...)`` user builds it
* ``plain Task``            a no-op ``celery.Task`` through Celery's tracer (``build_tracer``: what a worker runs
                            per task), no broker, no pool
* ``LockedTask executed``   the same no-op as a ``LockedTask``, a unique argument per call (acquire, body, release)
* ``LockedTask skipped``    a ``LockedTask`` call whose key another job holds (a running task's holder record):
                            a duplicate skipped in the tracer (the path of thread, gevent and RabbitMQ workers)

Ratios (client CPU is this process's ``time.process_time``; p50 over every call of the run):

* lock per use / floor str: p50 and CPU (the goal: <= 1.15x)
* LockedTask executed / plain Task: CPU (the worker-side cost of the lock in the tracer)
* LockedTask skipped / LockedTask executed: CPU (a skip should cost less than a run: <= 0.7x)

``benchmarks/release_figures.json`` holds the same ratios measured on earlier code (its ``references``: a release,
or the commit a regression was measured against), each with its date, machine and command; ``--save PATH`` writes
this run's figures in that form (to add the next release's). The ratios move with the machine's load (this 2-vCPU
VM is shared): compare ranges, and re-run before believing a change of a few percent. Runs against any checkout
whose ``Redlock(url, name, ttl=...)`` and ``LockedTask`` exist (0.1.0 on): ``PYTHONPATH=<checkout> python
benchmarks/bench_check.py``.

    make bench-check                                                 # ~40 s
    PYTHONPATH=$PWD python benchmarks/bench_check.py --rounds 60 --save /tmp/figures.json
"""

from __future__ import annotations

import importlib
import json
import os
import secrets
import sys
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import _common  # benchmarks/_common.py: run as `python benchmarks/<script>.py`
import _floors
import harness

FIGURES = Path(__file__).with_name("release_figures.json")
FLOOR, PER_USE, PLAIN, EXECUTED, SKIPPED = (
    "floor str",
    "lock per use",
    "plain Task",
    "LockedTask executed",
    "LockedTask skipped",
)
#: (label, contender, reference, metric)
RATIOS = (
    ("lock per use / floor str, p50", PER_USE, FLOOR, "p50_us"),
    ("lock per use / floor str, CPU", PER_USE, FLOOR, "cpu_us"),
    ("LockedTask executed / plain Task, CPU", EXECUTED, PLAIN, "cpu_us"),
    ("LockedTask skipped / executed, CPU", SKIPPED, EXECUTED, "cpu_us"),
)


def request_for(task_id: str, name: str) -> dict[str, Any]:
    """What a worker hands the tracer, minus what a no-op does not read (as profile_task.py)."""
    return {
        "id": task_id,
        "task": name,
        "hostname": "check@localhost",
        "is_eager": False,
        "delivery_info": {"exchange": "", "routing_key": "celery", "priority": 0, "redelivered": False},
        "ignore_result": True,
        "reply_to": None,
        "correlation_id": task_id,
        "retries": 0,
    }


def task_paths(
    url: str, package: str = "celery_singleton_lock"
) -> tuple[dict[str, Callable[[], Any]], Callable[[], None]]:
    """The three tracer paths on a fresh app locking on ``url``, and a function that frees the held key.

    ``package``: the checkout's package as imported (bench_task_ab.py loads two checkouts under other names)."""
    from celery import Celery, Task  # noqa: PLC0415 - only this part needs Celery
    from celery.app.trace import build_tracer  # noqa: PLC0415

    base: Any = importlib.import_module(package).LockedTask
    Redlock: Any = importlib.import_module(f"{package}.lock.redlock").Redlock
    if package != "celery_singleton_lock":

        class Renamed(base):  # type: ignore[misc,valid-type]
            abstract = True
            Request = f"{package}.task:LockedRequest"  # the checkout's own (bind checks it)

        base = Renamed

    app = Celery(f"check-{secrets.token_hex(4)}", broker="memory://", set_as_current=False)
    app.conf.update(singleton_lock_urls=[url], task_ignore_result=True)

    @app.task(name=f"{package}.plain", base=Task)  # type: ignore[misc]
    def plain(x: int) -> None:
        return None

    @app.task(name=f"{package}.locked", base=base)  # type: ignore[misc]
    def locked(x: int) -> None:
        return None

    app.finalize()
    # The registry's objects, as a worker builds its tracers (``app.tasks[name]``): the names the decorator returns
    # are Celery's PromiseProxy, through which every attribute the hooks read costs a proxy lookup (more on the
    # skip path, which reads more of them) that no worker pays.
    plain, locked = app.tasks[plain.name], app.tasks[locked.name]
    trace_plain = build_tracer(plain.name, plain, app=app, hostname="check@localhost")
    trace_locked = build_tracer(locked.name, locked, app=app, hostname="check@localhost")
    held = -1 - os.getpid()
    # Another job's holder record, as LockedTask writes it for a running task (a record of no job is deferred).
    key = locked.lock_key_for(held)
    try:
        blocker = Redlock(
            url,
            key,
            ttl=3600,
            job=f"holder-{uuid.uuid4()}",
            record={"state": "run", "name": locked.name, "worker": "1@check", "at": "1763800000000", "try": "0"},
        )
    except TypeError:  # 0.1.0: no job nor record (any holder makes a duplicate)
        blocker = Redlock(url, key, ttl=3600)
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

    def cleanup() -> None:
        blocker.release()

    return {PLAIN: run_plain, EXECUTED: run_executed, SKIPPED: run_skipped}, cleanup


def per_use(url: str, key: str) -> Callable[[], None]:
    from celery_singleton_lock.lock.redlock import Redlock  # noqa: PLC0415

    def cycle() -> None:
        lock = Redlock(url, key, ttl=10)
        if not lock.acquire(blocking=False) or not lock.release():
            raise RuntimeError(f"lock per use: a cycle failed on {key}")

    return cycle


def references() -> list[dict[str, Any]]:
    if not FIGURES.exists():
        return []
    return list(json.loads(FIGURES.read_text(encoding="utf-8"))["references"])


def report(ratios: dict[str, float], refs: list[dict[str, Any]]) -> str:
    heads = ["ratio", "this run", *(r["label"] for r in refs)]
    rows = []
    for label, *_ in RATIOS:
        row = [label, f"{ratios[label]:.2f}x"]
        for ref in refs:
            then = ref["ratios"].get(label)
            row.append("-" if then is None else f"{then:.2f}x ({ratios[label] / then - 1:+.0%})")
        rows.append(row)
    notes = [f"- {r['label']}: {r['code']}, {r['date']}, {r['machine']}; {r['command']}" for r in refs]
    return harness.markdown(heads, rows) + ("\n\nreferences (change: this run against it):\n" + "\n".join(notes))


def main(argv: list[str] | None = None) -> int:
    parser = harness.Cli(__doc__, quick={"slice": 0.05, "rounds": 2}, pin="split")
    parser.add_argument("--slice", type=float, default=0.1, help="seconds per contender per round (default 0.1)")
    parser.add_argument("--rounds", type=int, default=40, help="interleaved rounds (default 40)")
    parser.add_argument("--save", metavar="PATH", help="write this run's ratios as a reference (release_figures form)")
    parser.add_argument("--label", default="this code", help="the reference's label with --save")
    args = parser.parse(argv)
    env = harness.start("bench-check: the key ratios against the previous release", "celery")
    with _common.pinned_servers(1, args.pin) as servers:
        url, port = servers[0].url, servers[0].port
        conn = _floors.connect(port)
        k = f"check:{secrets.token_hex(4)}"
        tasks, cleanup = task_paths(url)
        ops = {FLOOR: _floors.str_cycle([conn], f"{k}:floor", 10_000), PER_USE: per_use(url, f"{k}:per-use"), **tasks}
        contenders = [harness.Contender(name, op) for name, op in ops.items()]
        results = harness.interleave(
            contenders,
            args.rounds,
            lambda c, _rnd: harness.timed(c.op, args.slice, 100_000, collect=True),
            warmup=lambda c: harness.timed(c.op, 0.2, 2_000),
            collect=True,
        )
        cleanup()
        conn.disconnect()
    ratios = {label: results.paired(name, ref, metric) for label, name, ref, metric in RATIOS}
    print(
        harness.markdown(
            ["contender", "p50 µs", "client CPU µs"],
            [[c.name, f"{results.pooled(c.name, 0.5):.1f}", f"{results.median(c.name, 'cpu_us'):.1f}"]
             for c in contenders],
        )
    )  # fmt: skip
    print()
    print(report(ratios, references()))
    print(
        f"\n{args.rounds} interleaved rounds x {args.slice:g} s per contender; a printout, not an assertion: the "
        "figures move with the machine's load"
    )
    if args.save:
        figure = {
            "label": args.label,
            "code": f"{env.get('git_head', '?')} (package sha256 {env.get('package_sha256', '?')})",
            "date": env.get("date_utc", "?"),
            "machine": f"{env.get('nproc', '?')} vCPU {env.get('cpu_model', '?')}, Python {env.get('python', '?')}, "
            f"redis-py {env.get('redis_py', '?')}",
            "command": f"bench_check.py --rounds {args.rounds} --slice {args.slice:g} --pin {args.pin}",
            "ratios": {label: round(value, 3) for label, value in ratios.items()},
        }
        Path(args.save).write_text(json.dumps(figure, indent=2) + "\n", encoding="utf-8")
    harness.save(args, env, ratios=ratios, samples=results.record())
    return 0


if __name__ == "__main__":
    sys.exit(main())
