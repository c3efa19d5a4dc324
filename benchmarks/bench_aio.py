"""AsyncRedlock benchmark: the async lock cycle against redis-py's async Lock and our sync Redlock, and 1,000
coroutines contending on 100 names.

Part 1, one acquire + release cycle, one client, no contention, on loopback, interleaved in rounds:

* ``ours AsyncRedlock 1-node`` / ``3-node``: ``AsyncRedlock(url(s), name, ttl=10)``, ``await acquire(blocking=False)``
  then ``await release()``, one instance reused, measured inside one event loop (no ``run_until_complete`` per
  cycle);
* ``ours AsyncRedlock 3-node, sequential``: the same, its nodes asked one after the other (a reference for what
  the concurrent fan-out gains);
* ``redis-py async Lock``: ``redis.asyncio.Redis(...).lock(name, timeout=10, blocking=False)``, one node, reused;
* ``ours Redlock 1-node`` / ``3-node``: the sync lock, ``acquire(blocking=False)`` + ``release()``.

Ratios are medians of per-round paired ratios: AsyncRedlock 1-node against redis-py's async Lock and against the
sync Redlock 1-node, AsyncRedlock 3-node against the sync Redlock 3-node and against its sequential self.

Part 2, throughput under contention: 1,000 coroutines in one loop, each looping ``async with`` on one of 100 names
(``i % 100``, so 10 per name), the critical section one ``await asyncio.sleep(0)``, for ``--seconds``: completed
critical sections per second (and a check that no two holders of a name overlapped). Contenders: AsyncRedlock on 1
and 3 nodes, redis-py's async Lock (``blocking_timeout=None``, its ``sleep=0.005`` to poll as often as our back-off).

    python benchmarks/bench_aio.py                       # ~2 min
    python benchmarks/bench_aio.py --quick               # a smoke run
    python benchmarks/bench_aio.py --json /tmp/aio.json
"""

from __future__ import annotations

import asyncio
import gc
import secrets
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any

import _common  # benchmarks/_common.py
import _floors  # benchmarks/_floors.py
import harness  # benchmarks/harness.py: run as `python benchmarks/<script>.py`
import redis.asyncio as aioredis

from celery_singleton_lock.lock.aio import AsyncNodes, AsyncRedlock, aclose
from celery_singleton_lock.lock.redlock import Redlock
from celery_singleton_lock.testing import redis_servers

TTL_S = 10
A1, A3 = "ours AsyncRedlock 1-node", "ours AsyncRedlock 3-node"
A3S = "ours AsyncRedlock 3-node, sequential"
RP = "redis-py async Lock 1-node"
S1, S3 = "ours Redlock 1-node", "ours Redlock 3-node"


class SequentialNodes(AsyncNodes):
    """AsyncNodes asking its nodes one after the other (each call awaited before the next is sent): the reference
    that tells what the concurrent fan-out (``asyncio.gather``) gains."""

    async def run(self, script, keys, args, nodes=None, undo_on_timeout=None):  # type: ignore[no-untyped-def]
        clients = self.clients()
        indices = range(len(clients)) if nodes is None else list(nodes)
        results: list[Any] = [None] * len(clients)
        for i in indices:
            results[i] = await self._call(clients[i], script, keys, args, undo_on_timeout)
        return results


async def atimed(cycle: Callable[[], Awaitable[None]], seconds: float, max_ops: int) -> harness.Sample:
    """``harness.timed`` inside the loop: ``await cycle()`` until ``seconds`` pass or ``max_ops`` ran."""
    gc.collect()
    clock = time.perf_counter_ns
    walls: list[int] = []
    cpu0 = _common.CpuStamp.now()
    start = now = clock()
    deadline = start + int(seconds * 1e9)
    count = 0
    while count < max_ops and now < deadline:
        await cycle()
        end = clock()
        walls.append(end - now)
        now = end
        count += 1
    return harness._timed_sample(walls, (now - start) / 1e9, _common.CpuStamp.now() - cpu0, None)


def ours_cycle(lock: AsyncRedlock) -> Callable[[], Awaitable[None]]:
    async def cycle() -> None:
        if not await lock.acquire(blocking=False):
            raise _floors.FloorFailedError(f"{lock!r}: acquire failed: {lock.node_errors}")
        if not await lock.release():
            raise _floors.FloorFailedError(f"{lock!r}: release failed")

    return cycle


def redis_py_cycle(lock: Any) -> Callable[[], Awaitable[None]]:
    async def cycle() -> None:
        if not await lock.acquire(blocking=False):
            raise _floors.FloorFailedError("redis-py async Lock: acquire failed")
        await lock.release()

    return cycle


async def contention(make: Callable[[str], Any], names: list[str], seconds: float) -> harness.Sample:
    """1,000 coroutines on ``names`` for ``seconds``: critical sections completed, overlaps counted."""
    inside: dict[str, int] = dict.fromkeys(names, 0)
    overlaps = 0
    done = 0
    deadline = time.monotonic() + seconds

    async def worker(i: int) -> None:
        nonlocal overlaps, done
        name = names[i % len(names)]
        lock = make(name)
        for _ in range(1_000_000):
            if time.monotonic() >= deadline:
                return
            async with lock:
                inside[name] += 1
                overlaps += inside[name] > 1
                await asyncio.sleep(0)
                inside[name] -= 1
            done += 1

    gc.collect()
    start = time.perf_counter()
    await asyncio.wait_for(asyncio.gather(*(worker(i) for i in range(1000))), seconds + 60)
    elapsed = time.perf_counter() - start
    return harness.Sample(ops=done, seconds=elapsed, values={"ops_per_s": done / elapsed, "overlaps": overlaps})


def main(argv: list[str] | None = None) -> int:
    parser = harness.Cli(__doc__, quick={"seconds": 0.2, "rounds": 1, "contention_seconds": 1.0})
    parser.add_argument("--seconds", type=float, default=1.5, help="time per contender per round (default 1.5)")
    parser.add_argument("--rounds", type=int, default=8, help="interleaved rounds (default 8)")
    parser.add_argument("--max-cycles", type=int, default=100_000, help="cap on cycles per slice")
    parser.add_argument("--contention-seconds", type=float, default=5.0, help="part 2: seconds per contender")
    args = parser.parse(argv)
    env = harness.start("AsyncRedlock benchmark")
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    with redis_servers(3) as servers:
        urls = [s.url for s in servers]
        sfx = secrets.token_hex(4)
        rp_client = aioredis.Redis(host="127.0.0.1", port=servers[0].port)
        async_cycles = {
            A1: ours_cycle(AsyncRedlock(urls[0], f"bench:a1:{sfx}", ttl=TTL_S)),
            A3: ours_cycle(AsyncRedlock(urls, f"bench:a3:{sfx}", ttl=TTL_S)),
            A3S: ours_cycle(AsyncRedlock(SequentialNodes(urls), f"bench:a3s:{sfx}", ttl=TTL_S)),
            RP: redis_py_cycle(rp_client.lock(f"bench:rp:{sfx}", timeout=TTL_S, blocking=False)),
        }
        sync_cycles = {
            S1: _floors.lock_cycle(Redlock(urls[0], f"bench:s1:{sfx}", ttl=TTL_S), S1),
            S3: _floors.lock_cycle(Redlock(urls, f"bench:s3:{sfx}", ttl=TTL_S), S3),
        }
        contenders = [harness.Contender(n, op) for n, op in {**async_cycles, **sync_cycles}.items()]

        def measure(c: harness.Contender, _rnd: int) -> harness.Sample:
            if c.name in async_cycles:
                return loop.run_until_complete(atimed(c.op, args.seconds, args.max_cycles))
            return harness.timed(c.op, args.seconds, args.max_cycles, collect=True)

        def warmup(c: harness.Contender) -> None:
            if c.name in async_cycles:
                loop.run_until_complete(atimed(c.op, 0.3, 5000))
            else:
                harness.timed(c.op, 0.3, 5000)

        results = harness.interleave(contenders, args.rounds, measure, warmup=warmup)
        rows = [
            [c.name, f"{results.median(c.name, 'ops_per_s'):,.0f}", f"{results.median(c.name, 'p50_us'):.1f}",
             f"{results.median(c.name, 'p99_us'):.1f}", f"{results.median(c.name, 'cpu_us'):.1f}"]
            for c in contenders
        ]  # fmt: skip
        print(harness.markdown(["contender", "cycles/s", "p50 µs", "p99 µs", "client CPU µs"], rows))
        ratios = [
            (f"{A1} / {RP}", results.paired(A1, RP, "ops_per_s"), results.paired(A1, RP, "p50_us")),
            (f"{A1} / {S1}", results.paired(A1, S1, "ops_per_s"), results.paired(A1, S1, "p50_us")),
            (f"{A3} / {S3}", results.paired(A3, S3, "ops_per_s"), results.paired(A3, S3, "p50_us")),
            (f"{A3} / {A3S}", results.paired(A3, A3S, "ops_per_s"), results.paired(A3, A3S, "p50_us")),
        ]
        print()
        print(
            harness.markdown(
                ["pair", "cycles/s ratio", "p50 ratio"], [[n, f"{a:.2f}x", f"{b:.2f}x"] for n, a, b in ratios]
            )
        )

        # Part 2: contention.
        names = [f"bench:c:{sfx}:{i}" for i in range(100)]
        # redis.asyncio's pools lend at most 100 connections by default: 1,000 coroutines get 1,000 on every side.
        big = [f"{u}?max_connections=1000" for u in urls]
        rp_big = aioredis.Redis(host="127.0.0.1", port=servers[0].port, max_connections=1000)
        makers: dict[str, Callable[[str], Any]] = {
            A1: lambda n: AsyncRedlock(big[0], n, ttl=TTL_S, auto_renewal=False),
            A3: lambda n: AsyncRedlock(big, n, ttl=TTL_S, auto_renewal=False),
            RP: lambda n: rp_big.lock(n, timeout=TTL_S, sleep=0.005, blocking_timeout=None),
        }
        crows = []
        for label, make in makers.items():
            sample = loop.run_until_complete(
                contention(make, [f"{n}:{label[:12]}" for n in names], args.contention_seconds)
            )
            crows.append([label, f"{sample['ops_per_s']:,.0f}", str(sample["overlaps"])])
        print()
        print(harness.markdown(["1,000 coroutines on 100 names", "critical sections/s", "overlaps"], crows))
        loop.run_until_complete(rp_client.aclose())
        loop.run_until_complete(rp_big.aclose())
        loop.run_until_complete(aclose())
    loop.close()
    harness.save(args, env, results=results.record(), ratios=[list(r) for r in ratios], contention=crows)
    print("\nmedians over interleaved rounds; ratios are medians of per-round paired ratios", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
