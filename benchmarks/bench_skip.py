"""Skipped duplicate vs no-op in a real worker (issue 9): worker CPU per task, task events off and on, INFO logs.

What a skipped duplicate costs a real ``celery worker``, against a plain no-op task and a LockedTask that runs,
interleaved in the same worker. One broker (a throwaway redis-server; the result backend is its db 1), one lock node
(another), the app module ``benchmarks/bench_apps.py``, and per (round, setting) one fresh worker::

    celery -A bench_apps worker -P prefork -c 1 -Q <queue> -l INFO [-E] --without-gossip --without-mingle
           --without-heartbeat

Paths:

* ``plain no-op``                   ``bench.plain``, a no-op ``celery.Task``, a unique argument per call
* ``plain + 1 refused acquire``     ``bench.floor``, the floor of a skip: a plain no-op whose body does ONE refused
                                    acquire (``_floors``' hash acquire, low-level redis-py) on the skip path's held key
* ``LockedTask executed``           ``bench.locked``, a unique argument per call: acquire, the body, release
* ``LockedTask executed``           ``bench.locked``, a unique argument per call: acquire, the body, release; with
  (pre-check on)                    the pre-check before the pool (issue 26): a key the worker has not seen pays
                                    only the key and the gate
* ``... executed (no pre-check)``   ``bench.locked_child``: the same task with a Request class that skips the
                                    pre-check (``ChildOnlyRequest``: Celery's ``revoked()`` only), as before issue 26
* ``... skipped in the pool child`` ``bench.locked_child`` with ONE argument whose lock another job holds (a holder
                                    record taken by this script before the worker starts, as LockedTask writes it for
                                    a running task): every delivery is skipped as that job's duplicate, in the child
* ``... skipped before the pool``   ``bench.locked`` with that argument (its own held key): skipped in the worker's
                                    main process (the first message of the key in a worker goes to the child: the
                                    gate; it falls in the warm-up cycle)

Settings (one worker each, per round): task events off, and on (``-E``, as Flower users run workers; a subscriber
like Flower's counts the events by type: a skip is ``task-revoked`` since d2ab1d1, ``task-succeeded`` before);
results ignored (``task_ignore_result``: a skip stores nothing) and, with ``--results ignored,stored``, stored (a
skip stores REVOKED, a no-op SUCCESS). The worker logs at INFO: one "received" and one "succeeded" (since d2ab1d1
"skipped duplicate") line per task, plus LockedTask's own "is a duplicate" INFO line per skip before d2ab1d1; the
lines are counted in its log.

Interleaved in one worker. The worker's queue holds blocks of ``--block`` messages, each block one path: a warm-up
cycle (one block of each path, not counted), then ``--cycles`` cycles, each the paths rotated by one more, every
other lap reversed (so each path comes first and last, before and after each other, in turn). The worker measures
itself (``bench_apps``'s block probe, a ``task_postrun`` receiver in the pool child): at the end of every block, the
CPU time of the pool child and of the worker's main process (which reads the messages, logs "received", sends the
events and hears the child's result), summed over their threads from ``/proc/<pid>/task/*/schedstat`` (ns). On this
shared 2-vCPU VM the speed drifts within seconds, so paths measured in blocks of a fraction of a second, side by
side in one worker, compare far more steadily than one worker per path. The main process works up to 4 messages
ahead of the child (the prefetch), so a block boundary lends a few messages' main-process work to a neighbour; the
rotating orders even this out. Per worker: CPU µs per task of each path (child + main, and each alone) and the
ratios to the plain no-op; the table shows medians over rounds (min-max), ratios being medians of per-round
(per-worker) ratios, and of per-cycle ratios (a path's block against the plain block of the same cycle; p25-p75
over all cycles): the steadiest.

The workers import ``celery_singleton_lock`` from ``PYTHONPATH`` when it is set (the benchmark itself too), else
from this checkout: to measure another commit, point ``PYTHONPATH`` at a worktree of it (the output names the
package file the workers imported and its git HEAD)::

    python benchmarks/bench_skip.py                                      # ~5 min: 5 rounds x events off/on
    python benchmarks/bench_skip.py --results ignored,stored --rounds 3  # also with results stored (REVOKED)
    git worktree add /tmp/bench-before ae142af
    PYTHONPATH=/tmp/bench-before python benchmarks/bench_skip.py --json /tmp/skip-before.json
    python benchmarks/bench_skip.py --rounds 1 --profile /tmp/prof      # cProfile per path: not since issue 26
                                                                         #   (a block may end in either process)
"""

from __future__ import annotations

import argparse
import base64
import dataclasses
import json
import os
import secrets
import statistics
import sys
import tempfile
import threading
import time
import uuid
from typing import Any

import _common  # benchmarks/_common.py: run as `python benchmarks/<script>.py`
import harness
import redis
from bench_task import Worker, load_apps, wait_for

PATHS = {
    "plain": "plain no-op",
    "floor": "plain + 1 refused acquire (floor)",
    "executed": "LockedTask executed (pre-check on)",
    "executed_child": "LockedTask executed (no pre-check)",
    "skip": "LockedTask skipped in the pool child",
    "preskip": "LockedTask skipped before the pool",
}
#: The task each path sends: ``bench.locked_child`` is ``bench.locked`` without the pre-check before the pool.
TASK_OF = {"plain": "plain", "floor": "floor", "executed": "locked", "preskip": "locked"}
HELD_ARG = -7  # the skip path's one argument: its lock is held by another job for the whole run
HOLD_TTL = 900.0  # the holder's lease, s: longer than any worker's run


@dataclasses.dataclass(frozen=True)
class Setting:
    events: bool
    results: str  # ignored | stored

    @property
    def label(self) -> str:
        return f"events {'on' if self.events else 'off'}, results {self.results}"

    @property
    def slug(self) -> str:
        return f"{'ev' if self.events else 'noev'}-{self.results}"


class EventCounter:
    """A Flower-like event subscriber on the broker: counts task events by type, per worker (its hostname).

    Celery sends events on Redis by PUBLISH to ``/<db>.celeryev/<routing key>``; a worker with an event loop batches
    its task events into ``task.multi`` messages whose body is the list of events. Each event's ``type`` is counted,
    and each message (``messages``: how well Celery batched them).
    """

    def __init__(self, broker_url: str) -> None:
        self.client = redis.Redis.from_url(broker_url)
        self.pubsub = self.client.pubsub(ignore_subscribe_messages=True)
        self.pubsub.psubscribe("/*celeryev*")
        self.counts: dict[str, dict[str, int]] = {}
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._loop, name="event-counter", daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        while not self.stopping.is_set():
            message = self.pubsub.get_message(timeout=0.2)
            if message is None:
                continue
            try:
                envelope = json.loads(message["data"])
                body = envelope["body"]
                if envelope["properties"].get("body_encoding") == "base64":
                    body = base64.b64decode(body)
                decoded = json.loads(body)
            except (ValueError, KeyError, TypeError, AttributeError):
                continue
            events = [e for e in (decoded if isinstance(decoded, list) else [decoded]) if isinstance(e, dict)]
            for i, event in enumerate(events):
                per_host = self.counts.setdefault(str(event.get("hostname", "?")), {})
                kind = str(event.get("type", "?"))
                per_host[kind] = per_host.get(kind, 0) + 1
                if i == 0:
                    per_host["messages"] = per_host.get("messages", 0) + 1

    def of(self, host_prefix: str) -> dict[str, int]:
        out: dict[str, int] = {}
        for host, counts in list(self.counts.items()):
            if host.startswith(host_prefix):
                for kind, n in list(counts.items()):
                    out[kind] = out.get(kind, 0) + n
        return out

    def close(self) -> None:
        self.stopping.set()
        self.thread.join(5)
        self.pubsub.close()
        self.client.close()


LOG_NEEDLES = {
    "received": "] received",
    "succeeded": "] succeeded in ",
    "skipped duplicate": "] skipped duplicate in ",
    "is a duplicate": "] is a duplicate: lock",  # LockedTask's own INFO line per skip, before d2ab1d1
}


def log_counts(path: str) -> dict[str, int]:
    """How many of the worker's INFO lines say what (the log of one worker)."""
    counts = dict.fromkeys(LOG_NEEDLES, 0)
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            if "INFO/" not in line:
                continue
            for name, needle in LOG_NEEDLES.items():
                if needle in line:
                    counts[name] += 1
    return counts


def block_order(paths: list[str], cycles: int) -> list[str]:
    """The warm-up cycle, then ``cycles`` cycles: ``paths`` rotated by one more each cycle, every other lap of
    rotations reversed (so each path comes first, last, before and after each other in turn)."""
    n = len(paths)
    out = list(paths)
    for c in range(cycles):
        order = paths[c % n :] + paths[: c % n]
        out += reversed(order) if (c // n) % 2 else order
    return out


class SkipBench:
    def __init__(self, args: argparse.Namespace, broker: str, lock_urls: list[str], tmp: str) -> None:
        self.args = args
        self.tmp = tmp
        self.nonce = secrets.token_hex(4)
        self.apps, self.base_env = load_apps(broker, lock_urls, BENCH_HELD_ARG=str(HELD_ARG))
        self.backend_url, self.record_url = self.base_env["BENCH_BACKEND"], self.base_env["BENCH_RECORD"]
        self.base_env["BENCH_HELD_KEY"] = self.apps.locked.lock_key_for(HELD_ARG)
        # The client sends; it does not wait on results (a caller who waits would subscribe to each task's result
        # channel: the worker's work is the same either way).
        self.apps.app.backend.on_task_call = lambda *_a, **_k: None
        self.record = redis.Redis.from_url(self.record_url)
        self.broker_client = redis.Redis.from_url(broker)
        self.backend_client = redis.Redis.from_url(self.backend_url)
        self.lock_clients = [redis.Redis.from_url(u) for u in lock_urls]
        self.events = EventCounter(broker)
        self.serial = 0

    def close(self) -> None:
        self.events.close()
        for c in (self.record, self.broker_client, self.backend_client, *self.lock_clients):
            c.close()

    def warm_up_client(self) -> None:
        """First calls build connections, producers and caches."""
        for i in range(200):
            self.apps.plain.apply_async((-100 - i,), queue="bench.warmup")
            self.apps.locked.apply_async((-100 - i,), queue="bench.warmup")

    def hold(self) -> list[Any]:
        """Take the skip paths' locks as ANOTHER JOB does while it runs (a record of no job would be deferred)."""
        blockers = []
        for locked in (self.apps.locked, self.apps.locked_child):
            options = dataclasses.replace(locked._options(), ttl=HOLD_TTL)
            blocker = type(locked.lock_context())(locked, options).new_lock(
                locked.lock_key_for(HELD_ARG), f"holder-{uuid.uuid4()}", 0
            )
            if not blocker.acquire(blocking=False):
                raise RuntimeError(f"could not take {blocker.name}")
            blockers.append(blocker)
        return blockers

    def run(self, setting: Setting, rnd: int, profile: str = "") -> dict[str, Any]:
        """One worker, every path in blocks; per path CPU µs per task (child + main), and what the skips looked like."""
        args = self.args
        self.serial += 1
        run = f"{self.nonce}-{setting.slug}-{rnd}-{self.serial}"
        queue = f"bench.{run}"
        for c in (self.broker_client, *self.lock_clients):
            c.flushall()  # the backend and the record are dbs of the broker's server
        blockers = self.hold()
        order = block_order(args.paths, args.cycles)
        ignore = setting.results == "ignored"
        serial = self.serial * 10_000_000
        for path in order:
            task = getattr(self.apps, TASK_OF.get(path, "locked_child"))
            for _ in range(args.block):
                serial += 1
                held = path in ("skip", "preskip")
                task.apply_async((HELD_ARG if held else serial,), queue=queue, ignore_result=ignore)
        total = len(order) * args.block
        queued = self.broker_client.llen(queue)
        if queued != total:
            raise RuntimeError(f"{setting.label}: {queued} messages queued, expected {total}")
        env = {
            **self.base_env,
            "BENCH_BLOCK": str(args.block),
            "BENCH_BLOCKS": ",".join(order),
            "BENCH_RUN": run,
            "BENCH_STORE_RESULTS": "0" if ignore else "1",
            "BENCH_PROFILE": profile,
            "BENCH_FORCE_PRESKIP": "1" if args.force_preskip else "0",
        }
        log = os.path.join(args.logs or self.tmp, f"{run}.log")
        name = f"bench-{run}"
        worker = Worker(name, env, queue, args.pool, 1, log, loglevel="INFO", events=setting.events)
        t0 = time.monotonic()
        try:
            worker.start()
            raw = wait_for(lambda: self.record.get(f"bench:done:{run}"), 60 + total * 0.02, [worker], setting.label)
            if setting.events:  # the last events: the main process sends them after the child's last postrun
                deadline = time.monotonic() + 5
                while time.monotonic() < deadline and self.events.of(name).get("task-received", 0) < total:
                    time.sleep(0.05)
                time.sleep(0.3)
        finally:
            worker.stop()
        elapsed = time.monotonic() - t0
        report = json.loads(raw)
        released = [b.release() for b in blockers]  # every one, even after a lost one
        if not all(released):
            raise RuntimeError(f"{setting.label}: the holder's lock was lost during the run")
        if report["wrong_count"]:
            raise RuntimeError(f"{setting.label}: {report['wrong_count']} tasks not on their path: {report['wrong']}")
        stored = self.backend_client.dbsize()
        if stored != (0 if ignore else total):
            raise RuntimeError(f"{setting.label}: {stored} results stored, expected {0 if ignore else total}")
        measured = report["blocks"][len(args.paths) :]  # after the warm-up cycle
        per_path: dict[str, dict[str, float]] = {}
        for path in args.paths:
            mine = [b for b in measured if b["path"] == path]
            tasks = len(mine) * report["block"]
            child = sum(b["child_ns"] for b in mine) / tasks / 1000
            main = sum(b["main_ns"] for b in mine) / tasks / 1000
            per_path[path] = {
                "cpu_us": child + main,
                "child_us": child,
                "main_us": main,
                "tasks_per_s": tasks / sum(b["seconds"] for b in mine),
                "blocks_cpu_us": [(b["child_ns"] + b["main_ns"]) / report["block"] / 1000 for b in mine],
            }
        for path in args.paths:  # per cycle: this path's block against the plain block of the same cycle
            cycles = [measured[i : i + len(args.paths)] for i in range(0, len(measured), len(args.paths))]
            per_path[path]["cycle_ratios"] = [
                sum(b["child_ns"] + b["main_ns"] for b in cycle if b["path"] == path)
                / sum(b["child_ns"] + b["main_ns"] for b in cycle if b["path"] == "plain")
                for cycle in cycles
            ]
        skips = (order.count("skip") + order.count("preskip")) * args.block
        return {
            "round": rnd,
            "setting": setting.label,
            "messages": total,
            "seconds": elapsed,
            "paths": per_path,
            "package": report["package"],
            "skip_sample": report["sample"],
            "skips": skips,
            "log": log_counts(log),
            "events": self.events.of(name),
            "results_stored": stored,
            "blocks": report["blocks"],
        }


def quartiles_text(values: list[float]) -> str:
    if len(values) < 4:
        return harness.ratio_text(values)
    q1, q2, q3 = statistics.quantiles(values, n=4)
    return f"{q2:.2f}x ({q1:.2f}-{q3:.2f})"


def us_text(values: list[float]) -> str:
    return f"{statistics.median(values):,.0f} ({min(values):,.0f}-{max(values):,.0f})" if values else "-"


def _ratio(a: float, b: float) -> float:
    return a / b if b else float("nan")


def summary(samples: dict[Setting, list[dict[str, Any]]], paths: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for setting, runs in samples.items():
        rows = {}
        for path in paths:
            rows[path] = {
                "cpu_us": [r["paths"][path]["cpu_us"] for r in runs],
                "child_us": [r["paths"][path]["child_us"] for r in runs],
                "main_us": [r["paths"][path]["main_us"] for r in runs],
                "ratio": [r["paths"][path]["cpu_us"] / r["paths"]["plain"]["cpu_us"] for r in runs],
                # One process (solo, gevent, eventlet): no pool child, all is the main process's.
                "child_ratio": [_ratio(r["paths"][path]["child_us"], r["paths"]["plain"]["child_us"]) for r in runs],
                "main_ratio": [r["paths"][path]["main_us"] / r["paths"]["plain"]["main_us"] for r in runs],
                "cycle_ratios": [x for r in runs for x in r["paths"][path]["cycle_ratios"]],
            }
        out[setting.label] = rows
    return out


def table(samples: dict[Setting, list[dict[str, Any]]], paths: list[str]) -> str:
    rows = []
    for setting, summed in zip(samples, summary(samples, paths).values(), strict=True):
        for path in paths:
            row = summed[path]
            rows.append([
                "on" if setting.events else "off", setting.results, PATHS[path], us_text(row["cpu_us"]),
                harness.ratio_text(row["ratio"]), quartiles_text(row["cycle_ratios"]),
                f"{statistics.median(row['child_us']):,.0f}", f"{statistics.median(row['main_us']):,.0f}",
                f"{statistics.median(row['child_ratio']):.2f}x", f"{statistics.median(row['main_ratio']):.2f}x",
            ])  # fmt: skip
    header = ["events", "results", "path", "worker CPU µs/task (min-max)", "vs plain no-op, per worker (min-max)",
              "vs plain no-op, per cycle (p25-p75)", "pool child µs", "main process µs", "child vs plain",
              "main vs plain"]  # fmt: skip
    return harness.markdown(header, rows, align="lllrrrrrrr")


def skip_shape(samples: dict[Setting, list[dict[str, Any]]]) -> str:
    """What a skip looked like (last worker of each setting): its log lines and its event, per skip."""
    lines = []
    for setting, runs in samples.items():
        if not runs:
            continue
        last = runs[-1]
        skips, total, log, events = last["skips"], last["messages"], last["log"], last["events"]
        said = f"'skipped duplicate' {log['skipped duplicate'] / skips:.2f}"
        said += f", 'is a duplicate' {log['is a duplicate'] / skips:.2f}"
        said += f", 'succeeded' {(log['succeeded'] - (total - skips)) / skips:.2f}"
        text = f"- {setting.label}: INFO lines per skip: {said}"
        if setting.events:
            revoked = events.get("task-revoked", 0) / skips
            succeeded = (events.get("task-succeeded", 0) - (total - skips)) / skips
            text += (
                f"; events per skip: task-revoked {revoked:.2f}, task-succeeded {succeeded:.2f}; "
                f"event messages per task {events.get('messages', 0) / total:.2f} (Celery batches task events)"
            )
        lines.append(text)
    sample = next((r["skip_sample"] for runs in samples.values() for r in runs), None)
    lines.append(f"- a skip's return value (the pool child's repr): {sample}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = harness.Cli(
        __doc__,
        quick={"block": 10, "cycles": 1, "rounds": 1, "events": "off"},
        pin="none",
        pin_help="; the workers inherit the client's CPU (default none: the worker's two processes and the servers "
        "share both CPUs)",
    )
    parser.add_argument("--block", type=int, default=200, help="messages per block (default 200)")
    parser.add_argument("--cycles", type=int, default=8, help="measured cycles per worker, each a block per path (8)")
    parser.add_argument("--rounds", type=int, default=5, help="workers per setting, interleaved (default 5)")
    parser.add_argument(
        "--pool",
        default="prefork",
        choices=("prefork", "solo", "gevent", "eventlet"),
        help="-P, -c 1 (default prefork)",
    )
    parser.add_argument(
        "--force-preskip",
        action="store_true",
        help="turn the pre-check on where the library keeps it off (gevent, eventlet): the 'skipped before the "
        "pool' path then measures it there (else that path is a skip in the pool, like 'skipped in the pool child')",
    )
    parser.add_argument("--events", default="off,on", help="comma-separated: off, on (-E); default off,on")
    parser.add_argument("--results", default="ignored", help="comma-separated: ignored, stored; default ignored")
    parser.add_argument(
        "--paths",
        default="plain,floor,executed,executed_child,skip,preskip",
        help="comma-separated: plain (always), floor, executed, executed_child, skip, preskip",
    )
    parser.add_argument(
        "--profile", metavar="PREFIX", help="after the rounds, one more worker (events on, results ignored) with "
        "cProfile in the pool child, per path: PREFIX.<path>.pstats (its figures are not in the table)"
    )  # fmt: skip
    parser.add_argument("--nodes", type=int, default=1, help="lock nodes (redis-servers), default 1")
    parser.add_argument("--logs", metavar="DIR", help="keep the workers' logs in DIR (default: a temporary directory)")
    args = parser.parse(argv)
    events = [e.strip() for e in args.events.split(",") if e.strip()]
    results_modes = [m.strip() for m in args.results.split(",") if m.strip()]
    args.paths = ["plain", *(p.strip() for p in args.paths.split(",") if p.strip() and p.strip() != "plain")]
    if (
        args.block < 10
        or args.nodes < 1
        or args.cycles < 1
        or args.rounds < 1
        or not events
        or not set(events) <= {"on", "off"}
        or not results_modes
        or not set(results_modes) <= {"ignored", "stored"}
        or not set(args.paths) <= set(PATHS)
    ):
        parser.error("--block >= 10, --cycles >= 1, --rounds >= 1, --events from off,on, --results from "
                     "ignored,stored, --paths from plain,floor,executed,executed_child,skip,preskip")  # fmt: skip
    if args.logs:
        os.makedirs(args.logs, exist_ok=True)

    settings = [Setting(e == "on", m) for m in results_modes for e in events]
    env = harness.start("skip benchmark", "celery", "kombu")
    servers_cm = _common.pinned_servers(1 + args.nodes, args.pin)
    with tempfile.TemporaryDirectory(prefix="bench-skip-") as tmp, servers_cm as servers:
        env["placement"] = _common.placement(servers)
        bench = SkipBench(args, servers[0].url, [x.url for x in servers[1:]], tmp)
        try:
            bench.warm_up_client()

            def measure(c: harness.Contender, rnd: int) -> harness.Sample:
                run = bench.run(c["setting"], rnd)
                return harness.Sample(ops=run["messages"], seconds=run["seconds"], values=run)

            def said(s: harness.Sample) -> None:
                cpu = ", ".join(f"{p} {v['cpu_us']:,.0f}" for p, v in s["paths"].items())
                print(
                    f"# round {s.round + 1}/{args.rounds} {s.contender} ({s.seconds:.0f} s): µs CPU/task "
                    f"{cpu}; log {s['log']}; events {s['events']}",
                    file=sys.stderr,
                )

            contenders = [harness.Contender(s.label, bench.run, info={"setting": s}) for s in settings]
            results = harness.interleave(contenders, args.rounds, measure, catch=(RuntimeError,), on_sample=said)
            if args.profile:
                bench.run(Setting(events=True, results="ignored"), args.rounds, profile=args.profile)
        finally:
            bench.close()
    samples = {s: [x.values for x in results[s.label]] for s in settings}
    failures = [f"{name}: {f}" for name, fs in results.failures.items() for f in fs]
    packages = sorted({s["package"] for runs in samples.values() for s in runs})
    print(f"package imported by the workers: {', '.join(packages)} (git {env['git_head']})")
    print(table(samples, args.paths))
    print(
        f"\nOne worker per round and setting (-P {args.pool} -c 1, -l INFO), {args.rounds} rounds; in each, blocks of "
        f"{args.block} messages per path, {args.cycles} measured cycles (a warm-up cycle not counted). CPU = the pool "
        "child's and the main process's CPU time (every thread) per task; medians over rounds (min-max); ratios are "
        "medians of per-worker ratios to the plain no-op in the same worker, and of per-cycle ratios (a path's "
        "block against the plain block of the same cycle, a few seconds apart; p25-p75 over all cycles of all "
        "workers)."
    )
    if "skip" in args.paths:
        print(skip_shape(samples))
    if args.profile:
        import pstats  # noqa: PLC0415 - only with --profile

        for path in args.paths:
            name = f"{args.profile}.{path}.pstats"
            if os.path.exists(name):
                print(f"# cProfile, pool child, {PATHS[path]} blocks (tottime):", file=sys.stderr)
                pstats.Stats(name, stream=sys.stderr).sort_stats("tottime").print_stats(25)
    harness.save(
        args,
        env,
        packages=packages,
        summary=summary(samples, args.paths),
        samples={s.label: runs for s, runs in samples.items()},
        failures=failures,
    )
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
