"""Two checkouts' lock core interleaved in ONE process: per round each contender runs a short slice on both (the
order alternating), and the per-round paired ratio new/old of wall time and client CPU per cycle is kept.

    git worktree add --detach /tmp/lease-old main      # the code to compare against
    mkdir -p /tmp/lease-ab && ln -sfn /tmp/lease-old/celery_singleton_lock /tmp/lease-ab/csl_old \
        && ln -sfn $PWD/celery_singleton_lock /tmp/lease-ab/csl_new
    PYTHONPATH=$PWD python benchmarks/bench_lease_ab.py 0.1 40     # slice seconds, rounds

The package's modules import each other relatively, so a checkout's package loads under another name (csl_old,
csl_new) beside the other one; both talk to the same three throwaway redis-servers.
"""

from __future__ import annotations

import asyncio
import gc
import secrets
import statistics
import sys
import time

sys.path.insert(0, "/tmp/lease-ab")
import csl_new.aio as new_aio
import csl_new.redlock as new_rl
import csl_old.aio as old_aio
import csl_old.redlock as old_rl

from celery_singleton_lock.testing import redis_servers

SLICE = float(sys.argv[1]) if len(sys.argv) > 1 else 0.15
ROUNDS = int(sys.argv[2]) if len(sys.argv) > 2 else 30


def contenders(rl, aio, urls1, urls3):
    ns1 = rl.NodeSet(urls1)
    ns3 = rl.NodeSet(urls3)
    reused1 = rl.Redlock(urls1, "ab:r1:" + secrets.token_hex(4), ttl=10)
    reused3 = rl.Redlock(urls3, "ab:r3:" + secrets.token_hex(4), ttl=10)
    held1 = rl.Redlock(ns1, "ab:h1:" + secrets.token_hex(4), ttl=3600)
    held3 = rl.Redlock(ns3, "ab:h3:" + secrets.token_hex(4), ttl=3600)
    assert held1.acquire(blocking=False)
    assert held3.acquire(blocking=False)
    ext3 = rl.Redlock(ns3, "ab:e3:" + secrets.token_hex(4), ttl=60)
    assert ext3.acquire(blocking=False)
    a1 = aio.AsyncRedlock(urls1, "ab:a1:" + secrets.token_hex(4), ttl=10)
    a3 = aio.AsyncRedlock(urls3, "ab:a3:" + secrets.token_hex(4), ttl=10)

    def cycle(lock):
        def run():
            assert lock.acquire(blocking=False)
            assert lock.release()

        return run

    def fresh(ns, tag):
        def run():
            lock = rl.Redlock(ns, tag, ttl=10, job="j", record={"state": "run"})
            assert lock.acquire(blocking=False)
            assert lock.release()

        return run

    def fresh_url(url, tag):
        def run():
            lock = rl.Redlock(url, tag, ttl=10)
            assert lock.acquire(blocking=False)
            assert lock.release()

        return run

    def skip(held, ns):
        def run():
            assert not rl.Redlock(ns, held.name, ttl=10).acquire(blocking=False)

        return run

    def extend(lock):
        def run():
            assert lock.extend()

        return run

    def acycle(lock):
        async def run():
            assert await lock.acquire(blocking=False)
            assert await lock.release()

        return run

    return {
        "cycle 1n reused": cycle(reused1),
        "cycle 3n reused": cycle(reused3),
        "cycle 1n fresh+job": fresh(ns1, "ab:f1:" + secrets.token_hex(4)),
        "cycle 3n fresh+job": fresh(ns3, "ab:f3:" + secrets.token_hex(4)),
        "cycle 1n fresh-url": fresh_url(urls1[0], "ab:u1:" + secrets.token_hex(4)),
        "skip 1n": skip(held1, ns1),
        "skip 3n": skip(held3, ns3),
        "extend 3n": extend(ext3),
        "async cycle 1n": acycle(a1),
        "async cycle 3n": acycle(a3),
    }


def timed(fn, loop) -> tuple[float, float]:
    """Wall and CPU seconds per call over one slice."""
    n = 0
    c0 = time.process_time()
    gc.disable()
    try:
        if asyncio.iscoroutinefunction(fn):

            async def many():
                nonlocal n
                end = time.perf_counter() + SLICE
                while time.perf_counter() < end:
                    await fn()
                    n += 1

            t0 = time.perf_counter()
            loop.run_until_complete(many())
            return (time.perf_counter() - t0) / n, (time.process_time() - c0) / n
        end = time.perf_counter() + SLICE
        t0 = time.perf_counter()
        while time.perf_counter() < end:
            fn()
            n += 1
        return (time.perf_counter() - t0) / n, (time.process_time() - c0) / n
    finally:
        gc.enable()


def main() -> None:
    with redis_servers(3) as servers:
        urls3 = [s.url for s in servers]
        urls1 = urls3[:1]
        loop = asyncio.new_event_loop()
        new = contenders(new_rl, new_aio, urls1, urls3)
        old = contenders(old_rl, old_aio, urls1, urls3)
        ratios: dict[str, list[float]] = {k: [] for k in new}
        per: dict[str, list[float]] = {k: [] for k in new}
        cpu: dict[str, list[float]] = {k: [] for k in new}
        per_cpu: dict[str, list[float]] = {k: [] for k in new}
        for name in new:  # warm up
            timed(new[name], loop), timed(old[name], loop)
        for r in range(ROUNDS):
            for name in new:
                if r % 2:
                    tn = timed(new[name], loop)
                    to = timed(old[name], loop)
                else:
                    to = timed(old[name], loop)
                    tn = timed(new[name], loop)
                ratios[name].append(tn[0] / to[0])
                cpu[name].append(tn[1] / to[1])
                per[name].append(to[0])
                per_cpu[name].append(to[1])
        print(f"{ROUNDS} rounds x {SLICE} s per contender and code; ratio = new/old per cycle (< 1: new faster)")
        for label, table, base in (("wall", ratios, per), ("client CPU", cpu, per_cpu)):
            print(f"-- {label}: paired per-round ratios new/old")
            print(f"{'contender':22} {'old us/cycle':>12} {'median':>7} {'p25':>6} {'p75':>6} {'p10':>6} {'p90':>6}")
            for name, rs in table.items():
                q = statistics.quantiles(rs, n=20)
                print(
                    f"{name:22} {statistics.median(base[name]) * 1e6:12.1f} {statistics.median(rs):7.3f} {q[4]:6.3f} "
                    f"{q[14]:6.3f} {q[1]:6.3f} {q[17]:6.3f}"
                )


main()
