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

import secrets
import sys
import time
from collections.abc import Callable

import _floors  # benchmarks/_floors.py
import harness  # benchmarks/harness.py: run as `python benchmarks/<script>.py`
import redis

from celery_singleton_lock.lock.redlock import Redlock
from celery_singleton_lock.testing import redis_servers

TTL_S = 10
TTL_MS = TTL_S * 1000
WARMUP_SECONDS = 0.3
WARMUP_CYCLES = 5_000

FLOOR = "floor (SET NX PX + EVALSHA del)"
OURS_1 = "ours Redlock 1-node"
OURS_3 = "ours Redlock 3-node"


# --- contenders: each factory returns a zero-argument callable doing one acquire + release ----------------------


def make_floor(client: redis.Redis, key: str) -> Callable[[], None]:
    return _floors.redis_py_str_cycle(client, key, TTL_MS)


def make_ours(urls: str | list[str], name: str) -> Callable[[], None]:
    return _floors.lock_cycle(Redlock(urls, name, ttl=TTL_S), f"ours ({name})")


def make_redis_py(client: redis.Redis, name: str) -> Callable[[], None]:
    return _floors.lock_cycle(client.lock(name, timeout=TTL_S, blocking=False), f"redis-py Lock ({name})")


def make_python_redis_lock(client: redis.Redis, name: str) -> Callable[[], None]:
    import redis_lock  # noqa: PLC0415 - optional bench dependency

    return _floors.lock_cycle(redis_lock.Lock(client, name, expire=TTL_S), f"python-redis-lock ({name})")


def make_pottery(clients: list[redis.Redis], name: str) -> Callable[[], None]:
    from pottery import Redlock as PotteryRedlock  # noqa: PLC0415 - optional bench dependency

    lock = PotteryRedlock(key=name, masters=set(clients), auto_release_time=TTL_S)
    return _floors.lock_cycle(lock, f"pottery ({name})")  # its release raises when a quorum did not release


# --- main ---------------------------------------------------------------------------------------------------------


def table(results: harness.Results) -> tuple[str, list[dict[str, float | str]]]:
    """The table (cycles/s and p50/p99: medians over rounds; ratios: paired medians) and its rows for the record."""
    rows: list[dict[str, float | str]] = []
    for c in results.contenders:
        low, high = results.spread(c.name, "ops_per_s")
        rows.append({
            "name": c.name,
            "cycles_per_s": results.median(c.name, "ops_per_s"),
            "p50_us": results.median(c.name, "p50_us"),
            "p99_us": results.median(c.name, "p99_us"),
            "cycles_per_s_min": low,
            "cycles_per_s_max": high,
            "ratio_to_floor": results.paired(c.name, FLOOR, "ops_per_s"),
            "p50_ratio_to_ours_1": results.paired(c.name, OURS_1, "p50_us"),
        })  # fmt: skip
    text = harness.markdown(
        ["contender", "cycles/s", "p50 µs", "p99 µs", "cycles/s vs floor", "p50 vs ours 1-node", "cycles/s min-max"],
        [
            [str(r["name"]), f"{r['cycles_per_s']:,.0f}", f"{r['p50_us']:.1f}", f"{r['p99_us']:.1f}",
             f"{r['ratio_to_floor']:.2f}x", f"{r['p50_ratio_to_ours_1']:.2f}x",
             f"{r['cycles_per_s_min']:,.0f}-{r['cycles_per_s_max']:,.0f}"]
            for r in rows
        ],
    )  # fmt: skip
    return text, rows


def main(argv: list[str] | None = None) -> int:
    parser = harness.Cli(__doc__, quick={"seconds": 0.1, "rounds": 1})
    parser.add_argument("--seconds", type=float, default=2.0, help="time per contender per round (default 2)")
    parser.add_argument("--rounds", type=int, default=8, help="interleaved rounds (default 8)")
    parser.add_argument("--max-cycles", type=int, default=200_000, help="cap on cycles per slice (default 200000)")
    args = parser.parse()
    if args.seconds <= 0 or args.rounds < 1 or args.max_cycles < 1:
        parser.error("--seconds must be > 0, --rounds and --max-cycles >= 1")

    env = harness.start("lock cycle benchmark", "pottery", "python-redis-lock")
    total = args.rounds * args.seconds * 7 + 7 * WARMUP_SECONDS
    print(f"# {args.rounds} rounds x {args.seconds} s x 7 contenders: about {total:.0f} s", file=sys.stderr)

    with redis_servers(3) as servers:
        urls = [s.url for s in servers]
        # Plain clients for the floor and the peers: redis-py defaults, like a user would build them.
        plain = [redis.Redis(host="127.0.0.1", port=s.port) for s in servers]
        suffix = secrets.token_hex(4)
        contenders = [
            harness.Contender(FLOOR, make_floor(plain[0], f"bench:floor:{suffix}")),
            harness.Contender(OURS_1, make_ours(urls[0], f"bench:ours1:{suffix}")),
            harness.Contender(OURS_3, make_ours(urls, f"bench:ours3:{suffix}")),
            harness.Contender("redis-py Lock", make_redis_py(plain[0], f"bench:redispy:{suffix}")),
        ]
        peers: list[tuple[str, Callable[[], Callable[[], None]]]] = [
            ("python-redis-lock", lambda: make_python_redis_lock(plain[0], f"bench:prl:{suffix}")),
            ("pottery Redlock 1-node", lambda: make_pottery(plain[:1], f"bench:pottery1:{suffix}")),
            ("pottery Redlock 3-node", lambda: make_pottery(plain, f"bench:pottery3:{suffix}")),
        ]
        for name, make in peers:
            try:
                contenders.append(harness.Contender(name, make()))
            except ImportError as exc:  # the `bench` extra is not installed
                print(f"# {name}: left out ({exc}; pip install -e '.[bench]')", file=sys.stderr)

        def warmup(c: harness.Contender) -> None:  # connections, script caches, thread pools, code paths
            harness.timed(c.op, WARMUP_SECONDS, WARMUP_CYCLES, collect=True)
            print(f"# warmed up {c.name}", file=sys.stderr)

        def said(s: harness.Sample) -> None:
            print(
                f"# round {s.round + 1}/{args.rounds} {s.contender}: {s['ops_per_s']:,.0f}/s "
                f"p50 {s['p50_us']:.1f} µs p99 {s['p99_us']:.1f} µs",
                file=sys.stderr,
            )

        results = harness.interleave(
            contenders,
            args.rounds,
            lambda c, _rnd: harness.timed(c.op, args.seconds, args.max_cycles, collect=True),
            warmup=warmup,
            on_sample=said,
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

    text, rows = table(results)
    print(text)
    print(
        f"\nmedians over {args.rounds} interleaved rounds of {args.seconds:g} s per contender; ratios are medians of "
        "per-round paired ratios"
    )
    harness.save(
        args,
        env,
        results=rows,
        samples=results.record(),
        leftover_keys=[k.decode() for k in failures],
        pottery_stray_keys=[k.decode() for k in strays],
    )
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
