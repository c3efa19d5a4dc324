"""Where LockedTask's worker-side time goes: Celery's tracer and hooks called directly, no broker, no pool.

``celery.app.trace.build_tracer`` builds exactly the function a worker runs for a task (prerun, ``before_start``,
``__call__``, result handling, postrun); here it is called in a loop with a worker-like request dict
(``is_eager=False``, ``ignore_result``), against throwaway redis-servers on 127.0.0.1 (lock nodes; the result
backend is db 1 of the first), placed on CPUs by ``--pin`` (default ``split``: this process on one CPU, the servers
on the other; see bench_hotpath.py). Paths, per task:

traced (the tracer)
  * ``plain Task``                        a no-op ``celery.Task``
  * ``LockedTask executed``               a unique argument per call: acquire in ``before_start``, the body, release
                                          (``finish``: release + done marker) in ``__call__``; 2 round trips
  * ``LockedTask skipped duplicate``      the key held by ANOTHER JOB (a running task's holder record): one refused
                                          acquire, decided SKIP; ignore_result, so nothing is stored
hooks (the same without the tracer: ``push_request``, ``before_start``, ``__call__``, ``pop_request``; plain:
``push_request``, ``run``, ``pop_request``). Hooks(LockedTask) - hooks(plain) is LockedTask's per-task lock work.
floors (``benchmarks/_floors.py``: redis-py ``Connection.send_command``/``read_response``, persistent connections;
fanned out with ``--nodes 3``)
  * ``floor str``    SET NX PX + EVALSHA compare-and-delete (the classic 2-round-trip floor)
  * ``floor hash``   EVALSHA hash acquire (EXISTS/HSET/PEXPIRE) + EVALSHA release (HGET/DEL): a holder-record lock
  * ``floor task``   the hash floor with LockedTask's record fields and its release setting the done marker
  * ``refused str``  SET NX PX GET on a held key (Redis >= 7.0); ``refused hash``: the hash acquire, refused
  * plus redis-py's high-level str floor and PINGs, for reference

Measured per (repetition, path): ``--calls`` calls, the wall time of each (p50, mean) and the process's CPU time
(``time.process_time``) per call. This machine's speed jumps between states within seconds, so the repetitions are
short (a few hundred calls per path) and many, the paths interleaved, the order rotating each repetition; tables
show medians over repetitions and ratios are medians of per-repetition paired ratios. With ``--pieces`` also the
hot path's pieces one by one; with ``--cprofile`` cProfile's top functions (tottime, µs per task, and tottime by
package) of the executed and skip paths; with ``--callgrind`` valgrind's instruction counts per task
(deterministic: a steady figure on a noisy machine) and the top C functions, from one child process run under
``valgrind --tool=callgrind``.

    python benchmarks/profile_task.py                               # ~1 min: 40 repetitions x 250 calls x 14 paths
    python benchmarks/profile_task.py --nodes 3                     # LockedTask and the floors on 3 nodes
    python benchmarks/profile_task.py --cprofile --pieces
    python benchmarks/profile_task.py --callgrind --reps 10         # + ~20-60 s under valgrind
    python benchmarks/profile_task.py --log-info                    # with a worker's INFO line per task
"""

from __future__ import annotations

import argparse
import cProfile
import functools
import json
import operator
import os
import pstats
import re
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from typing import Any

import _common  # benchmarks/_common.py: run as `python benchmarks/<script>.py`
import _floors
import harness
from bench_task import load_apps

TTL_MS = 60_000

PLAIN_T, EXEC_T, SKIP_T = "plain Task, traced", "LockedTask executed, traced", "LockedTask skipped duplicate, traced"
PLAIN_H, EXEC_H, SKIP_H = "plain Task, hooks", "LockedTask executed, hooks", "LockedTask skipped duplicate, hooks"
FLOOR_STR, FLOOR_HASH, FLOOR_TASK = "floor str (low-level)", "floor hash (low-level)", "floor task (low-level)"
REFUSED_STR, REFUSED_HASH = "refused str: SET NX PX GET (low-level)", "refused hash (low-level)"
REDIS_PY_FLOOR, PING_LL, PING_PY = "floor str, redis-py client", "PING (low-level)", "PING (redis-py client)"
CALLGRIND_PATHS = (PLAIN_T, EXEC_T, SKIP_T, PLAIN_H, EXEC_H, SKIP_H, FLOOR_STR, FLOOR_HASH, FLOOR_TASK, REFUSED_HASH)


def request_for(task_id: str, name: str) -> dict[str, Any]:
    """What a worker hands the tracer (fast_trace_task), minus what a no-op does not read."""
    return {
        "id": task_id,
        "task": name,
        "hostname": "profile@localhost",
        "is_eager": False,
        "delivery_info": {"exchange": "", "routing_key": "celery", "priority": 0, "redelivered": False},
        "ignore_result": True,
        "reply_to": None,
        "correlation_id": task_id,
        "retries": 0,
    }


class Bench:
    """Everything the paths need, built once: the app, the tracers, the held key, the floors."""

    def __init__(self, urls: list[str], log_info: bool = False) -> None:
        url = urls[0]
        apps, _ = load_apps(url, urls)
        from celery.app.trace import build_tracer  # noqa: PLC0415 - after the environment the app reads

        self.app = app = apps.app
        app.finalize()
        if log_info:
            # As a worker run with -l INFO: Celery's handler and format on a stream (a worker's stderr), here
            # /dev/null. Before the tracers are built (a tracer reads whether INFO is enabled when it is built).
            self.log_stream = open(os.devnull, "w", encoding="utf-8")  # noqa: SIM115 - lives as long as the app
            app.log.setup(loglevel="INFO", logfile=self.log_stream)
        self.plain, self.locked = plain, locked = apps.plain, apps.locked
        self.trace_plain = build_tracer(plain.name, plain, app=app, hostname="profile@localhost")
        self.trace_locked = build_tracer(locked.name, locked, app=app, hostname="profile@localhost")
        self.options = locked._options()
        self.nodes = self.options.settings.nodes
        self.serial = iter(range(10**12))
        ports = [int(u.rsplit(":", 1)[1].split("/")[0]) for u in urls]
        self.ports = ports

        # The skip path: the key of locked(held_arg) is held, for the whole run, by ANOTHER JOB's record, written as
        # LockedTask writes it for a running task (a record of no job would be deferred, not skipped).
        self.held_arg = -1 - os.getpid()
        self.held_key = locked.lock_key_for(self.held_arg)
        self.blocker = locked.lock_context().new_lock(self.held_key, f"holder-{uuid.uuid4()}", 0)
        if not self.blocker.acquire(blocking=False):
            raise RuntimeError(f"could not take {self.held_key}")

        self.conns = [_floors.connect(p) for p in ports]
        sfx = uuid.uuid4().hex[:8]
        self.held_str = f"profile:held:str:{sfx}"
        for conn in self.conns:
            conn.send_command("SET", self.held_str, "someone-else:0123456789abcdef", "PX", 3_600_000)
            conn.read_response()
        self.nx_get = _floors.supports_set_nx_get(ports[0])
        fields = _floors.task_fields(str(uuid.uuid4()), locked.name)
        self.floors: dict[str, Callable[[], None]] = {
            FLOOR_STR: _floors.str_cycle(self.conns, f"profile:fs:{sfx}", TTL_MS),
            FLOOR_HASH: _floors.hash_cycle(self.conns, f"profile:fh:{sfx}", TTL_MS),
            FLOOR_TASK: _floors.hash_cycle(
                self.conns, f"{{profile:ft:{sfx}}}", TTL_MS, fields, done_key=f"{{profile:ft:{sfx}}}:done:x"
            ),
            REFUSED_HASH: _floors.hash_skip(self.conns, self.held_key, TTL_MS),
        }
        if self.nx_get:
            self.floors[REFUSED_STR] = _floors.str_skip(self.conns, self.held_str, TTL_MS)
        import redis  # noqa: PLC0415

        self.client = redis.Redis.from_url(url)
        self.release_sha = self.client.script_load(_floors.STR_RELEASE)
        ping_conn = self.conns[0]

        def ping_ll() -> None:
            ping_conn.send_command("PING")
            ping_conn.read_response()

        self.ping_ll = ping_ll
        self.skip_reason_checked = False

    # --- whole paths ------------------------------------------------------------------------------------------------

    def run_plain(self, i: int) -> None:
        tid = str(uuid.uuid4())
        self.trace_plain(tid, (i,), {}, request_for(tid, self.plain.name))

    def run_executed(self, i: int) -> None:
        n = next(self.serial)
        tid = str(uuid.uuid4())
        r = self.trace_locked(tid, (n,), {}, request_for(tid, self.locked.name))
        if r.retval is not None:
            raise RuntimeError(f"executed path did not run the body: {r.retval}")

    def run_skip(self, i: int) -> None:
        tid = str(uuid.uuid4())
        r = self.trace_locked(tid, (self.held_arg,), {}, request_for(tid, self.locked.name))
        if r.retval is None:
            raise RuntimeError("skip path ran the body")

    def hooks_plain(self, i: int) -> None:
        tid = str(uuid.uuid4())
        task = self.plain
        task.push_request(request_for(tid, task.name), args=(i,), kwargs={}, called_directly=False)
        try:
            task.run(i)
        finally:
            task.pop_request()

    def _hooks_locked(self, arg: int) -> Any:
        tid = str(uuid.uuid4())
        task = self.locked
        task.push_request(request_for(tid, task.name), args=(arg,), kwargs={}, called_directly=False)
        try:
            task.before_start(tid, (arg,), {})
            return task(arg)
        finally:
            task.pop_request()

    def hooks_executed(self, i: int) -> None:
        if self._hooks_locked(next(self.serial)) is not None:
            raise RuntimeError("executed path (hooks) did not run the body")

    def hooks_skip(self, i: int) -> None:
        if self._hooks_locked(self.held_arg) is None:
            raise RuntimeError("skip path (hooks) ran the body")

    def check_skip(self) -> str:
        """The skip path's outcome must be a skip as another job's duplicate (not a re-send, not a run)."""
        tid = str(uuid.uuid4())
        r = self.trace_locked(tid, (self.held_arg,), {}, request_for(tid, self.locked.name))
        reason = getattr(r.retval, "reason", "")
        if not reason.startswith("duplicate of"):
            raise RuntimeError(f"the skip path is not a duplicate skip: {r.retval!r}")
        return str(reason)

    def redis_py_floor(self, i: int) -> None:
        key = f"floor:{next(self.serial)}"
        self.client.set(key, "tok", nx=True, px=TTL_MS)
        self.client.evalsha(self.release_sha, 1, key, "tok")

    def paths(self) -> dict[str, Callable[[int], Any]]:
        out: dict[str, Callable[[int], Any]] = {
            PLAIN_T: self.run_plain,
            EXEC_T: self.run_executed,
            SKIP_T: self.run_skip,
            PLAIN_H: self.hooks_plain,
            EXEC_H: self.hooks_executed,
            SKIP_H: self.hooks_skip,
        }
        for name, floor in self.floors.items():
            out[name] = lambda i, floor=floor: floor()
        if len(self.conns) == 1:
            out[REDIS_PY_FLOOR] = self.redis_py_floor
        out[PING_LL] = lambda i: self.ping_ll()
        out[PING_PY] = lambda i: self.client.ping()
        return out

    # --- pieces of the hot path, each on its own ----------------------------------------------------------------

    def pieces(self) -> dict[str, Callable[[int], Any]]:
        from celery_singleton_lock.lock.redlock import Redlock  # noqa: PLC0415
        from celery_singleton_lock.lock.renewal import watchdog  # noqa: PLC0415
        from celery_singleton_lock.policies.decision import decide  # noqa: PLC0415
        from celery_singleton_lock.task import signals  # noqa: PLC0415

        locked, options, nodes, serial = self.locked, self.options, self.nodes, self.serial
        blocker, held_key = self.blocker, self.held_key
        ctx = locked.lock_context()  # the rooms' seam (issue 31): its lock factory and counting
        failed = ctx.new_lock(held_key, str(uuid.uuid4()), 0)
        if failed.acquire(blocking=False):
            raise RuntimeError("the held key was free")

        def p_key(i: int) -> None:
            locked.lock_key_for(i)

        def p_new_lock(i: int) -> None:
            ctx.new_lock("singleton_lock:bench.locked:abc", "0c8a6e8e-1f7b-4a0c-9b1e-6d7f3c2a9e11", 0)

        def p_redlock(i: int) -> None:
            Redlock(nodes, "singleton_lock:bench.locked:abc", ttl=60.0, token="t")

        def p_acquire_release(i: int) -> None:
            lock = Redlock(nodes, f"piece:{next(serial)}", ttl=60.0)
            lock.acquire(blocking=False)
            lock.release()

        def p_acquire_finish(i: int) -> None:  # LockedTask's own lock: record fields, job, done marker
            lock = ctx.new_lock(f"piece:{next(serial)}", str(uuid.uuid4()), 0)
            lock.acquire(blocking=False)
            lock.finish(done_for=options.done_window_short, waited_for=options.done_window)

        def p_acquire_release_nofence(i: int) -> None:
            lock = Redlock(nodes, f"piece:{next(serial)}", ttl=60.0, fencing=False)
            lock.acquire(blocking=False)
            lock.release()

        def p_watchdog(i: int) -> None:
            wd = watchdog()
            wd.unregister(wd.register(blocker, 20.0))

        def p_signals(i: int) -> None:
            signals.lock_acquired.send(sender=locked, key="k", task_id="t", fencing_token=1)
            signals.lock_released.send(sender=locked, key="k", task_id="t", held=True)

        def p_count(i: int) -> None:
            ctx.count("acquired")
            ctx.count("released")

        def p_failed_acquire(i: int) -> None:
            ctx.new_lock(held_key, "0c8a6e8e-1f7b-4a0c-9b1e-6d7f3c2a9e11", 0).acquire(blocking=False)

        try:  # the delivery room (since the redesign); before it, a method of LockedTask
            from celery_singleton_lock.task._delivery import gather  # noqa: PLC0415

            facts_of: Any = functools.partial(gather, locked)
        except ImportError:
            facts_of = locked._facts

        def p_decide(i: int) -> None:
            decide(facts_of(failed, False, "0c8a6e8e-1f7b-4a0c-9b1e-6d7f3c2a9e11", False, options))

        # What the tracer does with a skip's outcome in a worker: its repr (sent to the main process as the result),
        # and its INFO line (rewritten by the package's log filter, where it has one). With --log-info only, the
        # line is formatted and written (else the logger is not enabled for INFO, as in a -l WARNING worker).
        from celery.app import trace  # noqa: PLC0415
        from celery.utils.saferepr import saferepr  # noqa: PLC0415

        from celery_singleton_lock import task as task_module  # noqa: PLC0415

        tid = "0c8a6e8e-1f7b-4a0c-9b1e-6d7f3c2a9e11"
        holder = f"holder-{uuid.uuid4()}"
        skipped = task_module.Skipped(
            f"duplicate of {locked.name} skipped: lock {held_key} held by task {holder}", held_key, holder
        )
        skipped_repr = saferepr(skipped, 1024)

        def success_line(value: str) -> None:
            trace.logger.info(
                trace.LOG_SUCCESS,
                {
                    "id": tid,
                    "name": locked.name,
                    "return_value": value,
                    "runtime": 0.0012,
                    "args": "(-7,)",
                    "kwargs": "{}",
                },
            )

        def p_line_plain(i: int) -> None:
            success_line("None")

        def p_line_skip(i: int) -> None:
            success_line(skipped_repr)

        def p_repr(i: int) -> None:
            saferepr(
                task_module.Skipped(
                    f"duplicate of {locked.name} skipped: lock {held_key} held by task {holder}", held_key, holder
                ),
                1024,
            )

        def p_duplicate_line(i: int) -> None:  # before d2ab1d1: LockedTask's own INFO line per skip
            task_module.logger.info(
                "Task %s[%s] is a duplicate: lock %s %s (%s)",
                locked.name,
                tid,
                held_key,
                f"held by task {holder}",
                "skip",
            )

        parse = getattr(task_module, "parse_skipped", None)

        def p_parse(i: int) -> None:  # the main process's LockedRequest.send_event, since d2ab1d1
            if parse is not None:
                parse(skipped_repr)

        return {
            "lock_key_for (signature bind + canonical encoding + hash)": p_key,
            "LockedTask._new_lock (Redlock + holder record fields)": p_new_lock,
            "Redlock(NodeSet, ...) constructor": p_redlock,
            "Redlock acquire+release (no record, fencing on)": p_acquire_release,
            "Redlock acquire+release, fencing=False": p_acquire_release_nofence,
            "_new_lock + acquire + finish (LockedTask's lock calls)": p_acquire_finish,
            "watchdog register+unregister": p_watchdog,
            "2 signals sent, no receivers": p_signals,
            "2 x _count (watchdog mutex + Counter)": p_count,
            "skip: _new_lock + refused acquire (1 EVALSHA + record parse)": p_failed_acquire,
            "skip: _facts + decide": p_decide,
            "skip: saferepr(Skipped(...)) (the tracer's result repr)": p_repr,
            "tracer INFO line, plain result (--log-info)": p_line_plain,
            "tracer INFO line, Skipped result (+ the filter since d2ab1d1; --log-info)": p_line_skip,
            "LockedTask's own 'is a duplicate' INFO line (before d2ab1d1; --log-info)": p_duplicate_line,
            "main process: parse_skipped(repr) (LockedRequest.send_event, since d2ab1d1)": p_parse,
        }

    def close(self) -> None:
        self.blocker.release()
        for conn in self.conns:
            conn.send_command("DEL", self.held_str)
            conn.read_response()
            conn.disconnect()
        self.client.close()


# --- report ---------------------------------------------------------------------------------------------------------


def ratios(results: harness.Results, nodes: int) -> list[str]:
    """Medians over repetitions of each repetition's ratios and differences between paths (``Results.across``)."""
    paired = results.across

    def delta(rep: dict[str, harness.Sample], a: str, b: str, attr: str) -> float:
        return float(rep[a][attr] - rep[b][attr])

    out = []
    skip_cpu = paired(lambda r: r[SKIP_T]["cpu_us"] / r[EXEC_T]["cpu_us"])
    skip_wall = paired(lambda r: r[SKIP_T]["p50_us"] / r[EXEC_T]["p50_us"])
    out.append(
        f"- traced skip / traced executed: CPU {skip_cpu:.2f}x (goal <= 0.6x: {'met' if skip_cpu <= 0.6 else 'missed'})"
        f", wall p50 {skip_wall:.2f}x"
    )
    for label, a, b in (("traced", EXEC_T, PLAIN_T), ("hooks", EXEC_H, PLAIN_H)):
        cpu = paired(lambda r, a=a, b=b: delta(r, a, b, "cpu_us"))
        wall = paired(lambda r, a=a, b=b: delta(r, a, b, "p50_us"))
        out.append(f"- executed lock work ({label}: LockedTask - plain): +{cpu:.1f} µs CPU, +{wall:.1f} µs wall p50")
        for floor in (FLOOR_STR, FLOOR_HASH, FLOOR_TASK):
            c = paired(lambda r, a=a, b=b, floor=floor: delta(r, a, b, "cpu_us") / r[floor]["cpu_us"])
            w = paired(lambda r, a=a, b=b, floor=floor: delta(r, a, b, "p50_us") / r[floor]["p50_us"])
            goal = f" (goal <= 1.3x: {'met' if c <= 1.3 and w <= 1.3 else 'missed'})" if floor == FLOOR_STR else ""
            out.append(f"  - vs {floor}: CPU {c:.2f}x, wall p50 {w:.2f}x{goal}")
    for label, a, b in (("traced", SKIP_T, PLAIN_T), ("hooks", SKIP_H, PLAIN_H)):
        cpu = paired(lambda r, a=a, b=b: delta(r, a, b, "cpu_us"))
        wall = paired(lambda r, a=a, b=b: delta(r, a, b, "p50_us"))
        out.append(f"- skip lock work ({label}: LockedTask skip - plain): +{cpu:.1f} µs CPU, +{wall:.1f} µs wall p50")
        for floor in (REFUSED_STR, REFUSED_HASH):
            if floor not in results.samples:
                continue
            c = paired(lambda r, a=a, b=b, floor=floor: delta(r, a, b, "cpu_us") / r[floor]["cpu_us"])
            w = paired(lambda r, a=a, b=b, floor=floor: delta(r, a, b, "p50_us") / r[floor]["p50_us"])
            out.append(f"  - vs {floor}: CPU {c:.2f}x, wall p50 {w:.2f}x")
    out.append(f"(floors on {nodes} node(s){', fanned out' if nodes > 1 else ''})")
    return out


def _where(func: tuple[str, int, str]) -> str:
    file, line, name = func
    if file == "~":
        return name
    parts = file.split(os.sep)
    for anchor in ("site-packages", "celery_singleton_lock", "benchmarks"):
        if anchor in parts:
            idx = parts.index(anchor) + (1 if anchor == "site-packages" else 0)
            return f"{'/'.join(parts[idx:])}:{line}({name})"
    return f"{'/'.join(parts[-2:])}:{line}({name})"


_WAITS = ("'recv' of '_socket", "'recv_into' of '_socket", "select.", "'poll' of")


def _waits(func: tuple[str, int, str]) -> bool:
    """A C call that blocks until the server answers: its wall time is mostly waiting, not CPU."""
    return func[0] == "~" and any(w in func[2] for w in _WAITS)


def _bucket(func: tuple[str, int, str]) -> str:
    file, _, name = func
    if file == "~":
        if _waits(func):
            return "socket reads (C; wall time, mostly waiting for the server)"
        return "socket send (C)" if "_socket" in name else "builtins (C)"
    for key, label in (
        ("celery_singleton_lock", "celery_singleton_lock"),
        ("/redis/", "redis-py"),
        ("/celery/", "celery"),
        ("/kombu/", "kombu"),
        ("/billiard/", "billiard"),
        ("/vine/", "vine"),
        ("benchmarks", "benchmark driver"),
    ):
        if key in file:
            return label
    return "stdlib"


def profiler_cost() -> float:
    """cProfile's own cost per profiled call (s): a loop of empty calls, profiled and not."""

    def f() -> None:
        pass

    def loop(n: int) -> None:
        for _ in range(n):
            f()

    n = 100_000
    t0 = time.perf_counter()
    loop(n)
    bare = time.perf_counter() - t0
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    loop(n)
    prof.disable()
    return max(0.0, (time.perf_counter() - t0 - bare) / n)


def cprofile_report(label: str, fn: Callable[[int], Any], calls: int, top: int, measured_cpu: float) -> str:
    """cProfile (its default clock: wall time, the cheapest to read) of ``calls`` calls of ``fn``.

    The only calls that block are the socket reads (the server's answer): they are shown apart, not ranked; every
    other function's tottime is time on the CPU. Each profiled call (Python and C) adds ~0.1-0.3 µs, reported as
    an estimate: functions called often look heavier than they are.
    """
    per_call = profiler_cost()
    prof = cProfile.Profile()
    prof.enable()
    for i in range(calls):
        fn(i)
    prof.disable()
    stats = pstats.Stats(prof)
    rows = sorted(stats.stats.items(), key=lambda kv: kv[1][2], reverse=True)  # type: ignore[attr-defined]
    total = sum(v[2] for _, v in rows)
    waits = sum(v[2] for f, v in rows if _waits(f))
    events = sum(v[1] for _, v in rows)
    lines = [
        f"### cProfile, {label}: {calls} calls",
        "",
        f"Per task under the profiler: {total / calls * 1e6:.1f} µs of tottime, of which {waits / calls * 1e6:.1f} µs "
        f"in blocking socket reads (waiting for the server) and ~{events / calls * per_call * 1e6:.0f} µs the "
        f"profiler's own cost ({events / calls:.0f} profiled calls x {per_call * 1e9:.0f} ns); measured without "
        f"the profiler: {measured_cpu:.1f} µs CPU per task.",
        "",
        f"Top {top} by tottime (blocking socket reads left out):",
        "",
        "| function | calls/task | tottime µs/task | cumtime µs/task |",
        "|---|---:|---:|---:|",
    ]
    ranked = [(f, v) for f, v in rows if not _waits(f)]
    for func, (_cc, nc, tt, ct, _callers) in ranked[:top]:
        lines.append(f"| `{_where(func)}` | {nc / calls:.1f} | {tt / calls * 1e6:.2f} | {ct / calls * 1e6:.2f} |")
    buckets: dict[str, tuple[float, int]] = {}
    for func, v in rows:
        tt, n = buckets.get(_bucket(func), (0.0, 0))
        buckets[_bucket(func)] = (tt + v[2], n + v[1])
    lines += ["", "| tottime by package | µs/task | share | calls/task |", "|---|---:|---:|---:|"]
    for name, (tt, n) in sorted(buckets.items(), key=lambda kv: kv[1][0], reverse=True):
        lines.append(f"| {name} | {tt / calls * 1e6:.1f} | {tt / total:.0%} | {n / calls:.0f} |")
    return "\n".join(lines)


# --- callgrind ------------------------------------------------------------------------------------------------------


def callgrind_child(urls: list[str], calls: int, out: str) -> int:
    """Under valgrind: warm every path up, then run each inside ``operator.call`` (collection and a dump are
    toggled on that C function only), in CALLGRIND_PATHS order: one dump file per path."""
    bench = Bench(urls)
    paths = bench.paths()
    names = [n for n in CALLGRIND_PATHS if n in paths]
    for name in names:
        for i in range(20):
            paths[name](i)
    for name in names:
        fn = paths[name]

        def loop(fn: Callable[[int], Any] = fn) -> None:
            for i in range(calls):
                fn(i)

        operator.call(loop)
    bench.close()
    with open(out, "w", encoding="utf-8") as f:
        json.dump(names, f)
    return 0


def callgrind_self_costs(path: str) -> list[tuple[str, int]]:
    """Self cost (Ir) per function of a callgrind dump, highest first (the cost line after ``calls=`` is a call's
    inclusive cost: not counted as the caller's own)."""
    names: dict[str, str] = {}
    costs: dict[str, int] = {}
    fn = ""
    after_call = False
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            if line.startswith(("fn=", "cfn=")):
                m = re.match(r"c?fn=\((\d+)\)(?: (.*))?", line.rstrip("\n"))
                if m is None:
                    continue
                if m.group(2):
                    names[m.group(1)] = m.group(2)
                if line.startswith("fn="):
                    fn = m.group(1)
            elif line.startswith("calls="):
                after_call = True
            elif line[:1].isdigit() or line[:1] in "+-*":
                if after_call:
                    after_call = False
                    continue
                parts = line.split()
                if len(parts) >= 2:
                    costs[fn] = costs.get(fn, 0) + int(parts[1])
    merged: dict[str, int] = {}
    for k, v in costs.items():
        name = re.sub(r"'\d+$", "", names.get(k, k))  # f'2: f at recursion depth 2
        merged[name] = merged.get(name, 0) + v
    return sorted(merged.items(), key=lambda kv: kv[1], reverse=True)


def callgrind_report(urls: list[str], calls: int, top: int) -> str:
    with tempfile.TemporaryDirectory(prefix="profile-cg-") as tmp:
        base = os.path.join(tmp, "cg.out")
        names_file = os.path.join(tmp, "names.json")
        argv = [
            "valgrind", "--tool=callgrind", f"--callgrind-out-file={base}", "--collect-atstart=no",
            "--toggle-collect=_operator_call", "--dump-after=_operator_call",
            sys.executable, os.path.abspath(__file__), "--callgrind-child", names_file,
            "--urls", ",".join(urls), "--calls", str(calls),
        ]  # fmt: skip
        env = {**os.environ, "PYTHONHASHSEED": "0"}
        t0 = time.perf_counter()
        proc = subprocess.run(argv, capture_output=True, text=True, env=env, check=False, timeout=1800)
        if proc.returncode != 0:
            return f"callgrind run failed ({proc.returncode}):\n{proc.stderr[-3000:]}"
        with open(names_file, encoding="utf-8") as f:
            names = json.load(f)
        lines = [
            f"### callgrind: instructions per task (client process, user space; {calls} calls per path, "
            f"{time.perf_counter() - t0:.0f} s under valgrind)",
            "",
            "| path | instructions / task |",
            "|---|---:|",
        ]
        tops = []
        for n, name in enumerate(names, start=1):
            dump = f"{base}.{n}"
            with open(dump, encoding="utf-8") as f:
                total = next(int(line.split()[1]) for line in f if line.startswith("summary:"))
            lines.append(f"| {name} | {total / calls:,.0f} |")
            if name in (EXEC_T, SKIP_T):
                body = [
                    f"| {cost / calls:,.0f} | {cost / total:.1%} | `{fn[:110]}` |"
                    for fn, cost in callgrind_self_costs(dump)[:top]
                ]
                tops.append(
                    f"\n#### callgrind top {top} C functions (self cost), {name}\n\n"
                    "| instr / task | share | function |\n|---:|---:|---|\n" + "\n".join(body)
                )
        return "\n".join(lines) + "\n" + "\n".join(tops)


# --- main -----------------------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = harness.Cli(__doc__, quick={"calls": 20, "reps": 2}, pin="split")
    parser.add_argument("--calls", type=int, default=250, help="calls per path per repetition (default 250)")
    parser.add_argument("--reps", type=int, default=40, help="interleaved repetitions (default 40)")
    parser.add_argument("--nodes", type=int, default=1, help="lock nodes for LockedTask and the floors (default 1)")
    parser.add_argument("--pieces", action="store_true", help="also time the hot path's pieces one by one")
    parser.add_argument(
        "--log-info", action="store_true", help="log as a worker at -l INFO does (the tracer's line per task, into "
        "/dev/null through Celery's handler and format)"
    )  # fmt: skip
    parser.add_argument("--cprofile", action="store_true", help="cProfile the executed and skip paths")
    parser.add_argument("--top", type=int, default=15, help="functions shown per profile (default 15)")
    parser.add_argument("--callgrind", action="store_true", help="instruction counts under valgrind (slow)")
    parser.add_argument("--callgrind-calls", type=int, default=200, help="calls per path under valgrind (200)")
    parser.add_argument("--profile-calls", type=int, default=2000, help="calls per path under cProfile (2000)")
    parser.add_argument("--callgrind-child", metavar="OUT", help=argparse.SUPPRESS)
    parser.add_argument("--urls", help=argparse.SUPPRESS)
    args = parser.parse(argv)
    if args.callgrind_child:
        return callgrind_child(args.urls.split(","), args.calls, args.callgrind_child)
    if args.nodes < 1 or args.calls < 10 or args.reps < 1:
        parser.error("--nodes >= 1, --calls >= 10, --reps >= 1")

    env = harness.start("profile_task", "celery", "kombu")
    with _common.pinned_servers(args.nodes, args.pin) as servers:
        env["placement"] = {"pin": args.pin, **_common.placement(servers)}
        print(f"# placement: {json.dumps(env['placement'])}", file=sys.stderr)
        urls = [s.url for s in servers]
        bench = Bench(urls, log_info=args.log_info)
        print(f"# skip path outcome: {bench.check_skip()!r}", file=sys.stderr)
        whole = bench.paths()
        pieces = bench.pieces() if args.pieces else {}
        everything = {**whole, **pieces}
        results = harness.interleave(
            [harness.Contender(name, fn) for name, fn in everything.items()],
            args.reps,
            lambda c, _rep: harness.counted(c.op, args.calls),
            warmup=lambda c: harness.counted(c.op, 200),  # scripts loaded, connections open, caches filled
            collect=True,
            on_round=harness.every(10, args.reps, lambda _rep, _results: ""),
        )
        bench.check_skip()

        def row(name: str) -> list[str]:
            return [name] + [f"{results.median(name, m):,.1f}" for m in ("p50_us", "mean_us", "cpu_us")]

        print(f"## per task, {args.nodes} lock node(s), --pin {args.pin}\n")
        columns = ["wall p50 µs", "wall mean µs", "CPU µs/call"]
        print(harness.markdown(["path", *columns], [row(n) for n in whole]))
        if pieces:
            print("\n" + harness.markdown(["piece of the hot path", *columns], [row(n) for n in pieces]))
        print("\n## ratios (medians of per-repetition paired ratios)\n")
        print("\n".join(ratios(results, args.nodes)))
        print(
            f"\nmedians of {args.reps} interleaved repetitions x {args.calls} calls; redis-server(s) on 127.0.0.1; "
            "CPU = this process (time.process_time, all threads)"
        )
        if args.cprofile:
            for label, fn in ((EXEC_T, bench.run_executed), (SKIP_T, bench.run_skip)):
                print("\n" + cprofile_report(label, fn, args.profile_calls, args.top, results.median(label, "cpu_us")))
        if args.callgrind:
            print("\n" + callgrind_report(urls, args.callgrind_calls, args.top))
        bench.close()
    harness.save(args, env, samples=results.record())
    return 0


if __name__ == "__main__":
    sys.exit(main())
