"""Where LockedTask's worker-side time goes: the tracer called directly, no broker, no pool, no message decoding.

``celery.app.trace.build_tracer`` builds exactly the function a worker runs for a task (prerun, ``before_start``,
``__call__``, result handling, postrun); here it is called in a loop with a worker-like request dict
(``is_eager=False``), against a throwaway redis-server on 127.0.0.1 (lock node and result backend). Measured, as
median over interleaved repetitions of per-call wall time and CPU time (``time.process_time``):

* the whole traced call: plain Task, LockedTask acquire+release (a unique argument per call), LockedTask skip
  (the key held by someone else: one acquire attempt + REVOKED stored), and the floor of two redis round trips;
* the pieces of the hot path one by one (key, token, Redlock(), acquire, release, watchdog, signals, counters);
* with ``--cprofile``: cProfile's top functions (tottime) for the acquire+release and the skip paths.

    python benchmarks/profile_task.py                 # ~1 min
    python benchmarks/profile_task.py --cprofile --calls 3000
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import importlib
import io
import os
import pstats
import statistics
import sys
import time
import uuid
from collections.abc import Callable
from typing import Any

import redis
from celery.app.trace import build_tracer
from celery.exceptions import TaskRevokedError
from celery.states import REVOKED

from celery_singleton_lock import signals
from celery_singleton_lock.redlock import Redlock
from celery_singleton_lock.renewal import watchdog
from celery_singleton_lock.testing import redis_servers

HERE = os.path.dirname(os.path.abspath(__file__))


def measure(fn: Callable[[int], Any], calls: int) -> tuple[float, float]:
    """(wall µs, CPU µs) per call of ``fn(i)`` over ``calls`` calls."""
    gc.collect()
    wall0, cpu0 = time.perf_counter(), time.process_time()
    for i in range(calls):
        fn(i)
    return (time.perf_counter() - wall0) / calls * 1e6, (time.process_time() - cpu0) / calls * 1e6


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
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=2000, help="calls per measurement (default 2000)")
    parser.add_argument("--reps", type=int, default=7, help="interleaved repetitions (default 7)")
    parser.add_argument("--cprofile", action="store_true", help="also print cProfile's top functions")
    args = parser.parse_args(argv)

    with redis_servers(1) as (server,):
        url = server.url
        os.environ.update(
            {
                "BENCH_BROKER": url,
                "BENCH_BACKEND": url.rsplit("/", 1)[0] + "/1",
                "BENCH_RECORD": url.rsplit("/", 1)[0] + "/2",
                "BENCH_LOCK_URLS": url,
                "BENCH_N": "0",
            }
        )
        sys.path.insert(0, HERE)
        apps = importlib.import_module("bench_apps")
        app = apps.app
        app.finalize()
        plain, locked = apps.plain, apps.locked
        trace_plain = build_tracer(plain.name, plain, app=app, hostname="profile@localhost")
        trace_locked = build_tracer(locked.name, locked, app=app, hostname="profile@localhost")
        options = locked._options()
        nodes = options.settings.nodes
        client = redis.Redis.from_url(url)
        serial = iter(range(10**9))

        # The skip path: the key of locked(-1) is held by a foreign token for the whole run.
        held_key = locked.lock_key_for(-1)
        blocker = Redlock(nodes, held_key, ttl=600)
        assert blocker.acquire(blocking=False)

        def run_plain(i: int) -> None:
            tid = str(uuid.uuid4())
            trace_plain(tid, (i,), {}, request_for(tid, plain.name))

        def run_locked(i: int) -> None:
            n = next(serial)
            tid = str(uuid.uuid4())
            r = trace_locked(tid, (n,), {}, request_for(tid, locked.name))
            assert r.retval is None, r.retval

        def run_skip(i: int) -> None:
            tid = str(uuid.uuid4())
            r = trace_locked(tid, (-1,), {}, request_for(tid, locked.name))
            assert r.retval is not None  # the Skipped marker

        def floor(i: int) -> None:  # the two round trips any correct lock needs: SET NX PX, compare-and-delete
            key = f"floor:{next(serial)}"
            client.set(key, "tok", nx=True, px=60_000)
            client.evalsha(release_sha, 1, key, "tok")

        release_sha = client.script_load(
            "if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end return 0"
        )
        ping = client.ping

        # pieces of before_start / __call__ / _release, each on its own
        def p_key(i: int) -> None:
            locked.lock_key_for(i)

        def p_new_lock(i: int) -> None:
            locked._new_lock("singleton_lock:bench.locked:abc", "0c8a6e8e-1f7b-4a0c-9b1e-6d7f3c2a9e11", options)

        def p_redlock(i: int) -> None:
            Redlock(nodes, "singleton_lock:bench.locked:abc", ttl=60.0, token="t")

        def p_acquire_release(i: int) -> None:
            lock = Redlock(nodes, f"piece:{next(serial)}", ttl=60.0, token="t")
            lock.acquire(blocking=False)
            lock.release()

        def p_acquire_release_nofence(i: int) -> None:
            lock = Redlock(nodes, f"piece:{next(serial)}", ttl=60.0, token="t", fencing=False)
            lock.acquire(blocking=False)
            lock.release()

        def p_watchdog(i: int) -> None:
            wd = watchdog()
            wd.unregister(wd.register(blocker, 20.0))

        def p_signals(i: int) -> None:
            signals.lock_acquired.send(sender=locked, key="k", task_id="t", fencing_token=1)
            signals.lock_released.send(sender=locked, key="k", task_id="t", held=True)

        def p_count(i: int) -> None:
            locked._count("acquired")
            locked._count("released")

        def p_ping(i: int) -> None:
            ping()

        # pieces of the skip path
        def p_failed_acquire(i: int) -> None:
            Redlock(nodes, held_key, ttl=60.0, token="t").acquire(blocking=False)

        reason = f"duplicate of {locked.name} skipped: lock {held_key} is held by task {uuid.uuid4()}"

        def p_revoke(i: int) -> None:
            locked.backend.mark_as_revoked(str(uuid.uuid4()), reason, request=None)

        def p_set_only(i: int) -> None:  # what a store costs without Celery's read-before-write
            backend = locked.backend
            meta = backend._get_result_meta(
                result=backend.encode_result(TaskRevokedError(reason), REVOKED),
                state=REVOKED,
                traceback=None,
                request=None,
            )
            backend._set_with_state(backend.get_key_for_task(str(uuid.uuid4())), backend.encode(meta), REVOKED)

        whole = {
            "plain Task, traced": run_plain,
            "LockedTask acquire+release, traced": run_locked,
            "LockedTask skip (held elsewhere), traced": run_skip,
            "floor: SET NX PX + EVALSHA del (redis-py)": floor,
            "one PING (redis-py round trip)": p_ping,
        }
        pieces = {
            "lock_key_for (signature bind + canonical JSON + sha256)": p_key,
            "LockedTask._new_lock (Redlock + holder record fields)": p_new_lock,
            "Redlock(NodeSet, ...) constructor": p_redlock,
            "Redlock acquire+release (2 EVALSHA, fencing on)": p_acquire_release,
            "Redlock acquire+release, fencing=False": p_acquire_release_nofence,
            "watchdog register+unregister": p_watchdog,
            "2 signals sent, no receivers": p_signals,
            "2 x _count (watchdog mutex + Counter)": p_count,
            "skip: failed acquire attempt (1 EVALSHA)": p_failed_acquire,
            "skip: backend.mark_as_revoked (Celery: GET, then SET+PUBLISH)": p_revoke,
            "skip: the same REVOKED meta stored without the GET": p_set_only,
        }
        everything = {**whole, **pieces}
        for fn in everything.values():  # warm up: scripts loaded, connections open, caches filled
            measure(fn, 200)
        samples: dict[str, list[tuple[float, float]]] = {k: [] for k in everything}
        names = list(everything)
        for rep in range(args.reps):
            shift = rep % len(names)
            for name in names[shift:] + names[:shift]:
                samples[name].append(measure(everything[name], args.calls))

        def row(name: str) -> str:
            wall = statistics.median(s[0] for s in samples[name])
            cpu = statistics.median(s[1] for s in samples[name])
            return f"| {name} | {wall:,.1f} | {cpu:,.1f} |"

        base_wall = statistics.median(s[0] for s in samples["plain Task, traced"])
        base_cpu = statistics.median(s[1] for s in samples["plain Task, traced"])
        print("| traced call | wall µs/call | CPU µs/call |\n|---|---:|---:|")
        print("\n".join(row(n) for n in whole))
        print("\n| piece of the hot path | wall µs/call | CPU µs/call |\n|---|---:|---:|")
        print("\n".join(row(n) for n in pieces))
        for name in ("LockedTask acquire+release, traced", "LockedTask skip (held elsewhere), traced"):
            wall = statistics.median(s[0] for s in samples[name]) - base_wall
            cpu = statistics.median(s[1] for s in samples[name]) - base_cpu
            print(f"\n{name} minus plain: +{wall:,.1f} µs wall, +{cpu:,.1f} µs CPU per call")
        print(f"\nmedians of {args.reps} interleaved repetitions x {args.calls} calls; one redis-server on 127.0.0.1")

        fences = list(client.scan_iter(match="*:fence", count=1000))
        per_key = statistics.median(client.memory_usage(k) or 0 for k in fences[:100]) if fences else 0
        print(
            f"\nlock node after the run: {len(fences):,} fencing counter keys (one per distinct job ever locked, "
            f"never expiring), ~{per_key:.0f} bytes each (MEMORY USAGE)"
        )

        if args.cprofile:
            for label, fn in (("acquire+release", run_locked), ("skip", run_skip)):
                prof = cProfile.Profile()
                prof.enable()
                for i in range(args.calls):
                    fn(i)
                prof.disable()
                out = io.StringIO()
                pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(25)
                print(f"\n## cProfile, LockedTask {label}, {args.calls} calls (tottime)\n{out.getvalue()}")
        blocker.release()
        client.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
