"""Lock cycle benchmark: our Redlock against the raw redis-py floor and other Python Redis locks.

One acquire + release cycle, single client, one thread, on loopback, no contention: what a lock costs when it is
free. Contenders:

* ``floor``: redis-py ``SET key tok NX PX`` then ``EVALSHA`` compare-and-delete (2 round trips), a fresh random
  token per cycle, plain ``redis.Redis`` client. Nothing correct can do fewer round trips.
* ``ours 1-node`` / ``ours 3-node``: ``Redlock(url(s), name, ttl=10)``, ``acquire(blocking=False)`` then
  ``release()``, one instance reused (fencing tokens on, the default).
* ``redis-py Lock``: ``client.lock(name, timeout=10, blocking=False)``, one instance reused.
* ``python-redis-lock``: ``redis_lock.Lock(client, name, expire=10)``, one instance reused (note: its acquire
  checks ownership with a GET first, so it is 3 round trips).
* ``pottery 1-node`` / ``pottery 3-node``: ``pottery.Redlock(key=..., masters={...}, auto_release_time=10)``,
  ``acquire(blocking=False)`` then ``release()`` (it fans out through a thread pool per call).

Three throwaway redis-servers on 127.0.0.1 (``celery_singleton_lock.testing.redis_servers(3)``); 1-node contenders
use server 0. The machine is usually shared, so the contenders are interleaved: every round runs each contender for
``--seconds`` (capped at ``--max-cycles``), round-robin, the starting contender rotating each round; the table shows
the median over rounds of each round's cycles/s, p50 and p99. Ratios are medians of per-round *paired* ratios
(contender vs floor, or vs our 1-node, measured in the same round), which cancels slow drifts in background load.

The per-cycle client CPU, the floors written on redis-py's low-level ``Connection`` and the skip path's refused
acquire are measured by ``bench_hotpath.py``.

    python benchmarks/bench_lock.py                      # ~2.5 min: 8 rounds x 2 s x 7 contenders
    python benchmarks/bench_lock.py --seconds 1 --rounds 5 --json /tmp/bench.json
"""

from __future__ import annotations

import argparse
import gc
import json
import secrets
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import _common  # benchmarks/_common.py: run as `python benchmarks/<script>.py`
import redis

from celery_singleton_lock.redlock import Redlock
from celery_singleton_lock.testing import redis_servers

FLOOR_RELEASE_LUA = "if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end return 0"
TTL_S = 10
TTL_MS = TTL_S * 1000
WARMUP_SECONDS = 0.3
WARMUP_CYCLES = 5_000

FLOOR = "floor (SET NX PX + EVALSHA del)"
OURS_1 = "ours Redlock 1-node"
OURS_3 = "ours Redlock 3-node"


class CycleFailedError(RuntimeError):
    """A cycle that should have acquired (no contention) did not: the benchmark is measuring the wrong thing."""


@dataclass
class Sample:
    """One contender's slice in one round."""

    round: int
    cycles: int
    seconds: float
    cycles_per_s: float
    p50_us: float
    p99_us: float


@dataclass
class Result:
    name: str
    samples: list[Sample] = field(default_factory=list)
    cycles_per_s: float = 0.0
    p50_us: float = 0.0
    p99_us: float = 0.0
    cycles_per_s_min: float = 0.0
    cycles_per_s_max: float = 0.0
    ratio_to_floor: float = 0.0  # median over rounds of (cycles/s / floor's cycles/s in the same round)
    p50_ratio_to_ours_1: float = 0.0  # median over rounds of (p50 / our 1-node p50 in the same round)


def run_slice(cycle: Callable[[], None], seconds: float, max_cycles: int) -> tuple[int, float, list[int]]:
    """Run ``cycle`` until ``seconds`` pass or ``max_cycles`` ran; (count, elapsed s, per-cycle ns)."""
    clock = time.perf_counter_ns
    latencies: list[int] = []
    append = latencies.append
    gc.collect()
    start = clock()
    deadline = start + int(seconds * 1e9)
    now = start
    count = 0
    while count < max_cycles and now < deadline:
        cycle()
        end = clock()
        append(end - now)
        now = end
        count += 1
    return count, (now - start) / 1e9, latencies


# --- contenders: each factory returns a zero-argument callable doing one acquire + release ----------------------


def make_floor(client: redis.Redis, key: str) -> Callable[[], None]:
    sha = client.script_load(FLOOR_RELEASE_LUA)
    token_hex = secrets.token_hex

    def cycle() -> None:
        token = token_hex(16)
        if not client.set(key, token, nx=True, px=TTL_MS):
            raise CycleFailedError(f"floor: SET NX failed on {key}")
        if client.evalsha(sha, 1, key, token) != 1:
            raise CycleFailedError(f"floor: release did not delete {key}")

    return cycle


def make_ours(urls: str | list[str], name: str) -> Callable[[], None]:
    lock = Redlock(urls, name, ttl=TTL_S)

    def cycle() -> None:
        if not lock.acquire(blocking=False):
            raise CycleFailedError(f"ours: acquire failed on {name}: {lock.node_errors}")
        if not lock.release():
            raise CycleFailedError(f"ours: release failed on {name}")

    return cycle


def make_redis_py(client: redis.Redis, name: str) -> Callable[[], None]:
    lock = client.lock(name, timeout=TTL_S, blocking=False)

    def cycle() -> None:
        if not lock.acquire(blocking=False):
            raise CycleFailedError(f"redis-py Lock: acquire failed on {name}")
        lock.release()  # raises LockNotOwnedError when it was not ours

    return cycle


def make_python_redis_lock(client: redis.Redis, name: str) -> Callable[[], None]:
    import redis_lock  # noqa: PLC0415 - optional bench dependency

    lock = redis_lock.Lock(client, name, expire=TTL_S)

    def cycle() -> None:
        if not lock.acquire(blocking=False):
            raise CycleFailedError(f"python-redis-lock: acquire failed on {name}")
        lock.release()  # raises NotAcquired when it was not ours

    return cycle


def make_pottery(clients: list[redis.Redis], name: str) -> Callable[[], None]:
    from pottery import Redlock as PotteryRedlock  # noqa: PLC0415 - optional bench dependency

    lock = PotteryRedlock(key=name, masters=set(clients), auto_release_time=TTL_S)

    def cycle() -> None:
        if not lock.acquire(blocking=False):
            raise CycleFailedError(f"pottery: acquire failed on {name}")
        lock.release()  # raises ReleaseUnlockedLock when a quorum did not release

    return cycle


# --- environment --------------------------------------------------------------------------------------------------


def environment() -> dict[str, Any]:
    return _common.environment("pottery", "python-redis-lock")


# --- main ---------------------------------------------------------------------------------------------------------


def summarise(results: list[Result]) -> None:
    by_name = {r.name: r for r in results}
    floor, ours_1 = by_name[FLOOR], by_name[OURS_1]
    floor_by_round = {s.round: s for s in floor.samples}
    ours_by_round = {s.round: s for s in ours_1.samples}
    for r in results:
        rates = [s.cycles_per_s for s in r.samples]
        r.cycles_per_s = statistics.median(rates)
        r.cycles_per_s_min, r.cycles_per_s_max = min(rates), max(rates)
        r.p50_us = statistics.median(s.p50_us for s in r.samples)
        r.p99_us = statistics.median(s.p99_us for s in r.samples)
        r.ratio_to_floor = statistics.median(s.cycles_per_s / floor_by_round[s.round].cycles_per_s for s in r.samples)
        r.p50_ratio_to_ours_1 = statistics.median(s.p50_us / ours_by_round[s.round].p50_us for s in r.samples)


def table(results: list[Result]) -> str:
    lines = [
        "| contender | cycles/s | p50 µs | p99 µs | cycles/s vs floor | p50 vs ours 1-node | cycles/s min-max |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    lines += [
        f"| {r.name} | {r.cycles_per_s:,.0f} | {r.p50_us:.1f} | {r.p99_us:.1f} | {r.ratio_to_floor:.2f}x "
        f"| {r.p50_ratio_to_ours_1:.2f}x | {r.cycles_per_s_min:,.0f}-{r.cycles_per_s_max:,.0f} |"
        for r in results
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=2.0, help="time per contender per round (default 2)")
    parser.add_argument("--rounds", type=int, default=8, help="interleaved rounds (default 8)")
    parser.add_argument("--max-cycles", type=int, default=200_000, help="cap on cycles per slice (default 200000)")
    parser.add_argument("--json", metavar="PATH", help="also write the environment, per-round samples and summary")
    args = parser.parse_args(argv)
    if args.seconds <= 0 or args.rounds < 1 or args.max_cycles < 1:
        parser.error("--seconds must be > 0, --rounds and --max-cycles >= 1")

    env = environment()
    total = args.rounds * args.seconds * 7 + 7 * WARMUP_SECONDS
    print(f"# lock cycle benchmark, {env['date_utc']}", file=sys.stderr)
    print(f"# {json.dumps(env)}", file=sys.stderr)
    print(f"# {args.rounds} rounds x {args.seconds} s x 7 contenders: about {total:.0f} s", file=sys.stderr)

    with redis_servers(3) as servers:
        urls = [s.url for s in servers]
        # Plain clients for the floor and the peers: redis-py defaults, like a user would build them.
        plain = [redis.Redis(host="127.0.0.1", port=s.port) for s in servers]
        suffix = secrets.token_hex(4)
        contenders: list[tuple[str, Callable[[], None]]] = [
            (FLOOR, make_floor(plain[0], f"bench:floor:{suffix}")),
            (OURS_1, make_ours(urls[0], f"bench:ours1:{suffix}")),
            (OURS_3, make_ours(urls, f"bench:ours3:{suffix}")),
            ("redis-py Lock", make_redis_py(plain[0], f"bench:redispy:{suffix}")),
        ]
        peers: list[tuple[str, Callable[[], Callable[[], None]]]] = [
            ("python-redis-lock", lambda: make_python_redis_lock(plain[0], f"bench:prl:{suffix}")),
            ("pottery Redlock 1-node", lambda: make_pottery(plain[:1], f"bench:pottery1:{suffix}")),
            ("pottery Redlock 3-node", lambda: make_pottery(plain, f"bench:pottery3:{suffix}")),
        ]
        for name, make in peers:
            try:
                contenders.append((name, make()))
            except ImportError as exc:  # the `bench` extra is not installed
                print(f"# {name}: left out ({exc}; pip install -e '.[bench]')", file=sys.stderr)
        results = {name: Result(name) for name, _ in contenders}

        for name, cycle in contenders:  # connections, script caches, thread pools, code paths
            run_slice(cycle, WARMUP_SECONDS, WARMUP_CYCLES)
            print(f"# warmed up {name}", file=sys.stderr)

        for rnd in range(args.rounds):
            shift = rnd % len(contenders)
            for name, cycle in contenders[shift:] + contenders[:shift]:
                count, elapsed, latencies = run_slice(cycle, args.seconds, args.max_cycles)
                latencies.sort()
                sample = Sample(
                    round=rnd,
                    cycles=count,
                    seconds=elapsed,
                    cycles_per_s=count / elapsed,
                    p50_us=_common.percentile(latencies, 0.50) / 1000,
                    p99_us=_common.percentile(latencies, 0.99) / 1000,
                )
                results[name].samples.append(sample)
                print(
                    f"# round {rnd + 1}/{args.rounds} {name}: {sample.cycles_per_s:,.0f}/s "
                    f"p50 {sample.p50_us:.1f} µs p99 {sample.p99_us:.1f} µs",
                    file=sys.stderr,
                )

        # Every release must have deleted its key. pottery's release returns once a quorum answered and lets the
        # last node's thread finish in the background: give it a moment. Fencing counters and python-redis-lock's
        # signal lists are meant to stay.
        time.sleep(0.5)
        leftovers = [
            k
            for c in plain
            for k in c.keys(f"*{suffix}")
            if not k.endswith(b":fence") and not k.startswith(b"lock-signal:")
        ]
        for c in plain:
            c.close()
    # pottery's acquire also returns on a quorum, so its SET on the last node can land after the release that
    # followed: a stray key on a minority node until its ttl ends. That is pottery's design, so only reported;
    # a key left by any other contender is a failed release and fails the run.
    strays = [k for k in leftovers if k.startswith(b"redlock:")]
    failures = [k for k in leftovers if k not in strays]
    if strays:
        print(f"# note: pottery left {len(strays)} stray minority key(s) (early bail-out): {strays}", file=sys.stderr)
    if failures:
        print(f"# ERROR: lock keys left behind: {failures}", file=sys.stderr)

    ordered = [results[name] for name, _ in contenders]
    summarise(ordered)
    print(table(ordered))
    print(
        f"\nmedians over {args.rounds} interleaved rounds of {args.seconds:g} s per contender; ratios are medians of "
        "per-round paired ratios"
    )
    if args.json:
        _common.write_json(
            args.json,
            env,
            args,
            results=[asdict(r) for r in ordered],
            leftover_keys=[k.decode() for k in failures],
            pottery_stray_keys=[k.decode() for k in strays],
        )
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
