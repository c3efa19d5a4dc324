"""AsyncRedlock on real redis-servers: exclusion with itself and with the sync Redlock, one fencing sequence, a quorum
with a node down or paused that never blocks the event loop, renewal, cancel on loss, a cancelled release, and a
history under random faults checked by check_history.

Each test runs its own event loop in debug mode (``asyncio.run(..., debug=True)``) with a small
``slow_callback_duration``: a callback that blocks the loop longer is logged by asyncio as ``Executing ... took``.
Every wait is bounded (``asyncio.wait_for``); no test asserts an upper bound on elapsed time.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import random
import re
import threading
import time
import traceback
import uuid
from collections.abc import Awaitable, Callable, Iterator, Sequence
from typing import Any, TypeVar

import pytest
import redis.asyncio as aioredis
import worker_cluster as wc
from celery.signals import before_task_publish
from topologies import Cluster, SentinelSet

from celery_singleton_lock import AsyncRedlock, LockLostError, LockUnavailableError, Redlock
from celery_singleton_lock.errors import ConfigurationError
from celery_singleton_lock.lock.aio import _background, aclose
from celery_singleton_lock.task import _enqueue as enqueue
from celery_singleton_lock.testing import RedisServer, wait_for
from celery_singleton_lock.testing.faults import FaultProxy
from celery_singleton_lock.testing.history import Acquisition, FaultInjector, History, run_lock_client

T = TypeVar("T")
SLOW = 0.1  # slow_callback_duration: a callback holding the loop longer than this is logged by asyncio
#: What "the loop was blocked" means in a test's verdict: a callback held it longer than this. Just under the paused
#: node's socket_timeout (0.5 s) these tests give their clients, so a sync call waiting on a paused node is always
#: over it, while a busy shared machine's scheduling (a report over SLOW) is not taken for blocking. A bound.
BLOCKED = 0.4


def arun(make: Callable[[], Awaitable[T]], timeout: float = 60.0, *, debug: bool = True) -> T:
    """Run ``make()`` on a fresh debug-mode loop, bounded by ``timeout``; the loop's shared clients are closed."""

    async def main() -> T:
        asyncio.get_running_loop().slow_callback_duration = SLOW
        try:
            return await asyncio.wait_for(make(), timeout)
        finally:
            await aclose()

    return asyncio.run(main(), debug=debug)


def slow_callbacks(caplog: pytest.LogCaptureFixture) -> list[str]:
    """asyncio's debug-mode reports of callbacks that held the loop longer than ``slow_callback_duration``."""
    return [r.getMessage() for r in caplog.records if r.name == "asyncio" and "took" in r.getMessage()]


def urls_of(servers: Sequence[RedisServer]) -> list[str]:
    return [s.url for s in servers]


def keys_on(servers: Sequence[RedisServer], name: str) -> list[bool]:
    """Whether each server holds the key ``name``."""
    out = []
    for s in servers:
        c = s.client(socket_timeout=5)
        try:
            out.append(bool(c.exists(name)))
        finally:
            c.close()
    return out


def delete_on(servers: Sequence[RedisServer], name: str) -> None:
    for s in servers:
        c = s.client(socket_timeout=5)
        try:
            c.delete(name)
        finally:
            c.close()


@pytest.fixture(params=[1, 3], ids=["1node", "3nodes"])
def nodes(request: pytest.FixtureRequest, redis_node: RedisServer, redis_trio: list[RedisServer]) -> list[str]:
    """The shared servers as a 1-node or a 3-node lock."""
    return [redis_node.url] if request.param == 1 else urls_of(redis_trio)


class Room:
    """A critical section shared by threads and coroutines: records who is inside and the fencing tokens in order
    of entry, and any overlap."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.inside = 0
        self.overlaps = 0
        self.fences: list[int] = []

    def enter(self, fence: int) -> None:
        with self._lock:
            self.inside += 1
            if self.inside > 1:
                self.overlaps += 1
            self.fences.append(fence)

    def leave(self) -> None:
        with self._lock:
            self.inside -= 1


def test_async_holders_exclude_each_other(nodes: list[str], name: str) -> None:
    """Concurrent ``async with`` holders of one name never overlap, and their fencing tokens grow in entry order."""
    room = Room()

    async def worker() -> None:
        for _ in range(5):
            async with AsyncRedlock(nodes, name, ttl=5.0, timeout=20.0) as lock:
                room.enter(lock.fencing_token)
                await asyncio.sleep(0.002)
                room.leave()

    arun(lambda: asyncio.gather(*(worker() for _ in range(8))))
    assert room.overlaps == 0
    assert len(room.fences) == 40
    assert room.fences == sorted(room.fences) and len(set(room.fences)) == 40


def test_async_and_sync_holders_exclude_each_other(nodes: list[str], name: str) -> None:
    """Sync Redlock holders in threads and AsyncRedlock holders in a loop never overlap on one name, and share one
    strictly growing fencing sequence."""
    room = Room()
    errors: list[str] = []

    def sync_worker() -> None:
        try:
            for _ in range(8):
                with Redlock(nodes, name, ttl=5.0, timeout=20.0) as lock:
                    room.enter(lock.fencing_token)
                    time.sleep(0.002)
                    room.leave()
        except Exception:
            errors.append(traceback.format_exc())

    async def async_worker() -> None:
        for _ in range(8):
            async with AsyncRedlock(nodes, name, ttl=5.0, timeout=20.0) as lock:
                room.enter(lock.fencing_token)
                await asyncio.sleep(0.002)
                room.leave()

    threads = [threading.Thread(target=sync_worker, daemon=True) for _ in range(3)]
    for t in threads:
        t.start()
    try:
        arun(lambda: asyncio.gather(*(async_worker() for _ in range(4))))
    finally:
        for t in threads:
            t.join(60)
    assert not errors, errors[0]
    assert not any(t.is_alive() for t in threads)
    assert room.overlaps == 0
    assert len(room.fences) == 56
    assert room.fences == sorted(room.fences) and len(set(room.fences)) == 56


def test_sync_holder_refuses_async_and_back(redis_trio: list[RedisServer], name: str) -> None:
    """A sync holder refuses an async acquire (contended, named holder) and vice versa; tokens alternate upward."""
    urls = urls_of(redis_trio)
    tokens: list[int] = []

    async def scenario() -> None:
        sync = Redlock(urls, name, ttl=10.0)
        assert await asyncio.to_thread(sync.acquire, blocking=False)
        tokens.append(sync.fencing_token)
        lock = AsyncRedlock(urls, name, ttl=10.0)
        assert not await lock.acquire(blocking=False)
        assert lock.contended and not lock.split and lock.held_by == sync.token
        await asyncio.to_thread(sync.release)
        assert await lock.acquire(blocking=False)
        tokens.append(lock.fencing_token)
        assert await lock.owned()
        assert not await asyncio.to_thread(Redlock(urls, name).acquire, blocking=False)
        assert await lock.release()
        assert not await lock.release()  # idempotent
        assert await asyncio.to_thread(sync.acquire, blocking=False)
        tokens.append(sync.fencing_token)
        await asyncio.to_thread(sync.release)

    arun(scenario)
    assert tokens[0] < tokens[1] < tokens[2]


def test_nodes_behind_on_the_fencing_counter_are_raised(fresh_trio: list[RedisServer], name: str) -> None:
    """Nodes whose counters diverged: the async acquire returns the max and raises the nodes behind to it, so a
    later sync acquire without the node that was ahead still gets a larger token."""
    urls = urls_of(fresh_trio)
    c = fresh_trio[0].client(socket_timeout=5)
    try:
        c.set(f"{{{name}}}:fence", 100)  # fence_key_for(name): node 0 is ahead (a failed attempt reached it)
    finally:
        c.close()

    async def scenario() -> int:
        lock = AsyncRedlock(urls, name, ttl=10.0)
        assert await lock.acquire(blocking=False)
        assert await lock.release()
        return lock.fencing_token

    token = arun(scenario)
    assert token == 101
    fresh_trio[0].stop()
    later = Redlock(urls, name, ttl=10.0, socket_timeout=0.5)
    assert later.acquire(blocking=False)
    assert later.fencing_token > token
    later.release()


def test_a_node_that_timed_out_gets_the_undo_on_the_same_connection(fresh_trio: list[RedisServer], name: str) -> None:
    """A node paused past socket_timeout during a won acquire runs the attempt's undo right after it when it
    resumes: it holds no stray key for a ttl."""
    urls = urls_of(fresh_trio)

    async def scenario() -> None:
        lock = AsyncRedlock(urls, name, ttl=60.0, socket_timeout=0.3)
        # Connections made while every node answers (retried: a first connect on a loaded box can pass 0.3 s).
        assert await lock.acquire(timeout=20.0)
        await lock.release()
        fresh_trio[0].pause()
        try:
            assert await lock.acquire(blocking=False)  # the two others make the quorum
        finally:
            fresh_trio[0].resume()
        assert await asyncio.to_thread(wait_for, lambda: keys_on(fresh_trio, name)[0] is False, 3.0)
        assert keys_on(fresh_trio, name)[1:] == [True, True]
        assert await lock.release()

    arun(scenario, timeout=30.0)


def test_quorum_with_a_paused_node_never_blocks_the_loop(
    fresh_trio: list[RedisServer], name: str, caplog: pytest.LogCaptureFixture
) -> None:
    """With one of three nodes paused (SIGSTOP) the lease is taken, extended and released on the other two, and the
    loop is never held (no slow-callback report); with two paused, the attempt is refused as unavailable."""
    caplog.set_level(logging.WARNING, logger="asyncio")
    urls = urls_of(fresh_trio)
    ticks = 0

    async def ticker(stop: asyncio.Event) -> None:
        nonlocal ticks
        while not stop.is_set():
            ticks += 1
            await asyncio.sleep(0.01)

    async def scenario() -> None:
        stop = asyncio.Event()
        tick = asyncio.ensure_future(ticker(stop))
        lock = AsyncRedlock(urls, name, ttl=10.0, socket_timeout=0.5)
        # Connections made while every node answers (retried: a first connect on a loaded box can pass 0.3 s).
        assert await lock.acquire(timeout=20.0)
        await lock.release()
        fresh_trio[0].pause()
        try:
            for _ in range(3):
                assert await lock.acquire(blocking=False)
                assert await lock.extend()
                assert await lock.release()
            fresh_trio[1].pause()
            other = AsyncRedlock(urls, name, ttl=10.0, socket_timeout=0.5, timeout=0.0)
            with pytest.raises(LockUnavailableError):
                async with other:
                    pass  # pragma: no cover - never entered
            assert not other.contended and len(other.node_errors) == 2
        finally:
            for s in fresh_trio:
                s.resume()
            stop.set()
            await tick
        # One node down (stopped) instead: still a quorum.
        await asyncio.to_thread(fresh_trio[2].stop)
        assert await lock.acquire(blocking=False)
        assert await lock.release()

    arun(scenario)
    assert ticks > 0
    assert held_longer_than(caplog, BLOCKED) == []


def test_the_slow_callback_detector_sees_a_sync_lock_on_the_loop(
    fresh_trio: list[RedisServer], name: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The detector of the test above works: a sync Redlock called on the loop with a node paused is reported."""
    caplog.set_level(logging.WARNING, logger="asyncio")
    urls = urls_of(fresh_trio)

    async def scenario() -> None:
        lock = Redlock(urls, name, ttl=10.0, socket_timeout=0.5)
        fresh_trio[0].pause()
        try:
            assert lock.acquire(blocking=False)  # blocks the loop for up to socket_timeout: what we must never do
            lock.release()
        finally:
            fresh_trio[0].resume()

    arun(scenario)
    assert slow_callbacks(caplog)


def test_renewal_keeps_the_lease_while_the_block_runs(redis_trio: list[RedisServer], name: str) -> None:
    """``async with`` renews a short lease: a contender is still refused after several ttls; with
    ``auto_renewal=False`` it gets in once the ttl ran out."""
    urls = urls_of(redis_trio)

    async def scenario() -> None:
        async with AsyncRedlock(urls, name, ttl=1.5) as lock:  # seconds: a renewal slowed by load still comes in time
            await asyncio.sleep(3.5)  # more than two ttls
            assert not await AsyncRedlock(urls, name).acquire(blocking=False)
            assert await lock.owned() and not lock.lost
        assert await AsyncRedlock(urls, name).acquire(blocking=False)

    async def unrenewed() -> None:
        other = f"{name}:unrenewed"
        async with AsyncRedlock(urls, other, ttl=0.3, auto_renewal=False):
            contender = AsyncRedlock(urls, other, ttl=5.0)
            assert await contender.acquire(blocking=True, timeout=5.0)
            await contender.release()

    arun(scenario)
    arun(unrenewed)


def test_cancel_on_loss_cancels_the_block(redis_trio: list[RedisServer], name: str) -> None:
    """Keys deleted on every node mid-block: the renewal finds the lease lost, the block is cancelled at its await
    (the code after it never runs), ``async with`` raises LockLostError, and the task is not left cancelled."""
    urls = urls_of(redis_trio)
    reached: list[str] = []

    async def scenario() -> None:
        lock = AsyncRedlock(urls, name, ttl=0.6, cancel_on_loss=True)
        with pytest.raises(LockLostError):  # noqa: PT012 - the block is what is cancelled
            async with lock:
                await asyncio.to_thread(delete_on, redis_trio, name)
                await asyncio.sleep(10)
                reached.append("after the loss")  # pragma: no cover - must never run
        assert lock.lost
        assert not await lock.release()  # after the loss: nothing to give up, no error
        await asyncio.sleep(0.01)  # the task is usable: our cancel was taken back
        task = asyncio.current_task()
        assert task is not None and getattr(task, "cancelling", lambda: 0)() == 0
        reached.append("after the block")
        # The renewal found the key missing and repaired it; the lost lease is taken back off the nodes.
        assert keys_on(redis_trio, name) == [False, False, False]

    arun(scenario, timeout=20.0)
    assert reached == ["after the block"]


def test_loss_without_cancel_on_loss_lets_the_block_finish(redis_trio: list[RedisServer], name: str) -> None:
    """Without ``cancel_on_loss`` a lost lease sets ``lost`` and the block runs to its end."""
    urls = urls_of(redis_trio)

    async def scenario() -> bool:
        async with AsyncRedlock(urls, name, ttl=0.3) as lock:
            for s in redis_trio:
                c = aioredis.Redis(port=s.port)
                await c.hset(name, mapping={"owner": "someone-else", "fence": "0"})
                await c.aclose()
            for _ in range(100):
                if lock.lost:
                    break
                await asyncio.sleep(0.05)
        return lock.lost

    assert arun(scenario, timeout=20.0)
    delete_on(redis_trio, name)


def test_a_release_inside_the_block_is_no_loss(redis_trio: list[RedisServer], name: str) -> None:
    """A block that releases its lock itself while the renewal waits for its turn (an extend of the block's own in
    flight) is not cancelled: giving the lease up is no loss.

    The block holds the mutex only until the renewal is seen waiting for it, with a lease of seconds: the lease must
    still be valid when released whatever the acquire and the loop's load cost (it used to hold a 0.3 s lease's
    mutex for a fixed 0.2 s, and on a loaded machine the acquire alone took 0.15 s: the lease ran out first).
    """
    urls = urls_of(redis_trio)

    async def scenario() -> tuple[bool, bool]:
        async with AsyncRedlock(urls, name, ttl=3.0, cancel_on_loss=True) as lock:
            mutex = lock._lock()
            async with mutex:  # what an extend() of the block holds while its round trip is in flight
                for _ in range(500):  # the renewal wakes (after ttl / 3) and waits for the mutex
                    if mutex._waiters:
                        break
                    await asyncio.sleep(0.01)
                assert mutex._waiters, "the renewal never waited for the mutex"
                assert lock.validity > 0
                release = asyncio.ensure_future(lock.release())
                await asyncio.sleep(0)
            released = await release
            renewer = lock._renewer
            assert renewer is not None
            await asyncio.wait_for(asyncio.shield(renewer), 10.0)  # the renewal ran and stopped by itself
            return released, lock.lost

    assert arun(scenario, timeout=30.0) == (True, False)
    assert keys_on(redis_trio, name) == [False, False, False]


def test_a_caller_cancelled_in_release_still_frees_the_lock(fresh_trio: list[RedisServer], name: str) -> None:
    """The task awaiting ``release()`` is cancelled while every node is paused: after they resume the lock is free
    (it was sent again from a background task), well before its ttl; with the nodes paused longer, the release gives up
    (never stuck) and the lease is left to expire."""
    urls = urls_of(fresh_trio)

    async def scenario() -> None:
        lock = AsyncRedlock(urls, name, ttl=60.0, socket_timeout=1.0)
        assert await lock.acquire(blocking=False)
        for s in fresh_trio:
            s.pause()
        try:
            task = asyncio.ensure_future(lock.release())
            await asyncio.sleep(0.1)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
        finally:
            for s in fresh_trio:
                s.resume()
        assert await asyncio.to_thread(wait_for, lambda: keys_on(fresh_trio, name) == [False] * 3, 5.0)
        assert await AsyncRedlock(urls, name).acquire(blocking=False)

    async def stuck_nodes() -> None:
        other = f"{name}:stuck"
        lock = AsyncRedlock(urls, other, ttl=60.0, socket_timeout=0.2)
        assert await lock.acquire(blocking=False)
        for s in fresh_trio:
            s.pause()
        try:
            task = asyncio.ensure_future(lock.release())
            await asyncio.sleep(0.05)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            # The background release ends by itself (each node's exchange bounded by socket_timeout).
            from celery_singleton_lock.lock import aio  # noqa: PLC0415

            await asyncio.wait_for(asyncio.gather(*aio._background, return_exceptions=True), 5.0)
            assert lock.token is None and lock.validity == 0.0
        finally:
            for s in fresh_trio:
                s.resume()

    arun(scenario, timeout=30.0)
    arun(stuck_nodes, timeout=30.0)


def test_a_cancelled_acquire_leaves_no_lease(fresh_trio: list[RedisServer], name: str) -> None:
    """An acquire cancelled while a node is paused leaves no key behind once the node resumes (its attempt is
    undone), so the name is free long before the attempt's ttl."""
    urls = urls_of(fresh_trio)

    async def scenario() -> None:
        lock = AsyncRedlock(urls, name, ttl=60.0, socket_timeout=2.0)
        assert await lock.acquire(blocking=False)
        await lock.release()
        fresh_trio[0].pause()
        try:
            task = asyncio.ensure_future(lock.acquire(blocking=False))
            await asyncio.sleep(0.2)  # the two live nodes granted; the paused one keeps the attempt waiting
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
        finally:
            fresh_trio[0].resume()
        assert await asyncio.to_thread(wait_for, lambda: keys_on(fresh_trio, name) == [False] * 3, 5.0)

    arun(scenario, timeout=30.0)


def test_scripts_are_loaded_where_a_node_forgot_them(redis_trio: list[RedisServer], name: str) -> None:
    """After SCRIPT FLUSH on a node, EVALSHA's NOSCRIPT is answered by sending the script: acquire still works."""
    urls = urls_of(redis_trio)

    async def scenario() -> None:
        lock = AsyncRedlock(urls, name, ttl=5.0)
        assert await lock.acquire(blocking=False)
        for s in redis_trio[:2]:
            c = aioredis.Redis(port=s.port)
            await c.script_flush()
            await c.aclose()
        assert await lock.extend()
        assert await lock.release()

    arun(scenario)


def test_a_sentinel_url_reaches_the_master_and_excludes_a_sync_holder(name: str) -> None:
    """A ``redis+sentinel://`` URL: the async lease is taken on the Sentinel's master, where a sync Redlock on the
    same URL is refused."""
    with SentinelSet(service="aio") as topology:

        async def scenario() -> None:
            lock = AsyncRedlock(topology.url(), name, ttl=10.0)
            assert await lock.acquire(blocking=False)
            sync = Redlock(topology.url(), name, ttl=10.0)
            assert not await asyncio.to_thread(sync.acquire, blocking=False)
            assert sync.held_by == lock.token
            assert await lock.release()

        arun(scenario, timeout=30.0)


def test_a_cluster_url_is_one_node_shared_with_the_sync_lock(redis_node: RedisServer, name: str) -> None:
    """A ``redis+cluster://`` URL is ONE node of the Redlock, as for the sync lock: an async holder on a real 3-master
    Cluster (with a plain node beside it: a 2-node Redlock) refuses a sync Redlock on the same URLs and back, the
    fencing tokens grow across both, and a shared ``fence_key`` in another slot is kept in the name's slot."""
    with Cluster() as cluster:
        urls = [cluster.url(), redis_node.url]
        shared = f"{name}:fence-shared"

        async def scenario() -> list[int]:
            tokens = []
            lock = AsyncRedlock(urls, name, ttl=10.0, fence_key=shared, socket_timeout=2.0)
            assert lock.fence_key != shared  # kept per slot on a Cluster, as Redlock does
            # Blocking: the Cluster client's first call also reads the slot map, which a loaded machine can make
            # take longer than socket_timeout.
            assert await lock.acquire(blocking=True, timeout=20.0)
            tokens.append(lock.fencing_token)
            sync = Redlock(urls, name, ttl=10.0, fence_key=shared)
            assert sync.fence_key == lock.fence_key
            assert not await asyncio.to_thread(sync.acquire, blocking=False)
            assert sync.held_by == lock.token
            assert await lock.extend() and await lock.owned()
            assert await lock.release()
            assert await asyncio.to_thread(sync.acquire, blocking=False)
            tokens.append(sync.fencing_token)
            assert not await AsyncRedlock(urls, name, fence_key=shared).acquire(blocking=False)
            await asyncio.to_thread(sync.release)
            again = AsyncRedlock(urls, name, ttl=10.0, fence_key=shared)
            assert await again.acquire(blocking=False)
            tokens.append(again.fencing_token)
            assert await again.release()
            return tokens

        tokens = arun(scenario, timeout=60.0)
        assert tokens == sorted(tokens) and len(set(tokens)) == 3


def test_configuration_errors_say_what_to_change() -> None:
    """Bad arguments are refused with one line naming the fix."""
    with pytest.raises(ConfigurationError, match="ttl"):
        AsyncRedlock("redis://127.0.0.1:6379/0", "n", ttl=0)
    with pytest.raises(ConfigurationError, match="twice"):
        AsyncRedlock(["redis://127.0.0.1:6379/0", "redis://127.0.0.1:6379/0"], "n")


async def async_lock_client(
    urls: Sequence[str],
    names: Sequence[str],
    history: History,
    *,
    seconds: float,
    client: str,
    seed: int,
    ttl: tuple[float, float] = (0.3, 0.9),
    socket_timeout: float = 0.2,
) -> None:
    """run_lock_client's schedule on AsyncRedlock: acquire (blocking or not), extend at random, release or abandon,
    recording what the client believed."""
    rng = random.Random(seed)  # a reproducible schedule
    deadline = time.monotonic() + seconds
    ttls = [round(rng.uniform(*ttl), 2) for _ in range(3)]
    for _ in range(100_000):
        start = time.monotonic()
        if start >= deadline:
            return
        name, lease = rng.choice(list(names)), rng.choice(ttls)
        lock = AsyncRedlock(urls, name, ttl=lease, socket_timeout=socket_timeout)
        history.count("attempts")
        if rng.random() < 0.5:
            ok = await lock.acquire(blocking=True, timeout=min(rng.uniform(0.05, 1.0), max(0.0, deadline - start)))
        else:
            ok = await lock.acquire(blocking=False)
        if not ok:
            history.count("refused" if lock.contended else "unavailable")
            await asyncio.sleep(rng.uniform(0.0, 0.05))
            continue
        acquired = time.monotonic()
        end = acquired + lock.validity
        owner, fence, extends, released = lock.token or "", lock.fencing_token, 0, False
        hold_until = acquired + lease * (rng.uniform(0.0, 0.15) if rng.random() < 0.85 else rng.uniform(0.5, 1.5))
        for _step in range(1000):
            now = time.monotonic()
            if now >= end:
                history.count("expired")
                break
            if now >= hold_until:
                if rng.random() < 0.9:
                    end = min(end, time.monotonic())
                    await lock.release()
                    released = True
                    history.count("released")
                else:
                    history.count("abandoned")
                break
            await asyncio.sleep(max(0.001, min(hold_until, now + rng.uniform(0.15, 0.6) * lease) - now))
            if time.monotonic() >= min(hold_until, end) or rng.random() < 0.2:
                continue
            if await lock.extend():
                end = time.monotonic() + lock.validity
                extends += 1
                history.count("extended")
            elif lock.validity > 0:
                history.count("extend_undecided")
            else:
                end = min(end, time.monotonic())
                history.count("extend_lost")
                break
        history.add(Acquisition(name, owner, fence, start, acquired, end, client, extends, released))


@contextlib.contextmanager
def proxies_for(servers: Sequence[RedisServer]) -> Iterator[list[FaultProxy]]:
    with contextlib.ExitStack() as stack:
        yield [stack.enter_context(FaultProxy(s.port)) for s in servers]


def test_async_history_under_faults_mixed_with_sync_clients(fresh_trio: list[RedisServer]) -> None:
    """Async clients (one loop) and sync clients (threads) on proxied nodes under random proxy faults and pauses:
    no overlapping validity windows, no fencing inversions."""
    history = History()
    errors: list[str] = []
    label = f"ahist-{uuid.uuid4().hex[:8]}"
    names = [f"{label}:{i}" for i in range(3)]
    seconds = 5.0
    with proxies_for(fresh_trio) as proxies:
        urls = [p.url for p in proxies]
        with FaultInjector(proxies, fresh_trio, seed=7):

            def sync_client(i: int) -> None:
                try:
                    run_lock_client(urls, names, history, seconds=seconds, client=f"s{i}", seed=700 + i)
                except Exception:
                    errors.append(traceback.format_exc())

            threads = [threading.Thread(target=sync_client, args=(i,), daemon=True) for i in range(2)]
            for t in threads:
                t.start()

            async def clients() -> Any:
                return await asyncio.gather(
                    *(
                        async_lock_client(urls, names, history, seconds=seconds, client=f"a{i}", seed=900 + i)
                        for i in range(6)
                    )
                )

            try:
                arun(clients, timeout=seconds + 30)
            finally:
                for t in threads:
                    t.join(seconds + 30)
    assert not errors, errors[0]
    report = history.check()
    report.assert_ok()
    mine = [a for a in history.acquisitions if a.client.startswith("a")]
    assert mine and any(a.client.startswith("s") for a in history.acquisitions)
    assert history.events["attempts"] > 0


def test_many_coroutines_on_one_name_are_refused_as_contended_not_unavailable(
    redis_trio: list[RedisServer], name: str
) -> None:
    """150 coroutines of one loop try one name at once on three healthy nodes: one wins, every other is refused as
    contended, none reports a node error (redis.asyncio's pool refuses more than its max_connections, 100 by default
    in redis-py 8, at once: the attempts beyond it failed at once with MaxConnectionsError and were reported as
    unavailable nodes). A generous socket_timeout: what is tested is the pool's limit, not the loaded loop's speed."""
    urls = urls_of(redis_trio)

    async def scenario() -> tuple[int, int, list[str]]:
        locks = [AsyncRedlock(urls, name, ttl=30.0, socket_timeout=10.0) for _ in range(150)]
        won = await asyncio.gather(*(lock.acquire(blocking=False) for lock in locks))
        errors = [str(e) for lock in locks for e in lock.node_errors]
        contended = sum(1 for lock in locks if lock.contended)
        for lock, ok in zip(locks, won, strict=True):
            if ok:
                await lock.release()
        return sum(won), contended, errors

    won, contended, errors = arun(scenario, debug=False)  # debug mode's bookkeeping would only slow it down
    assert errors == []
    assert won == 1 and contended == 149


def test_an_unrenewed_lease_that_runs_out_cancels_the_block(redis_trio: list[RedisServer], name: str) -> None:
    """Attack: ``auto_renewal=False`` with ``cancel_on_loss``: the validity running out is a loss (the issue's "or the
    validity runs out"): the block is cancelled and ``async with`` raises LockLostError."""
    urls = urls_of(redis_trio)
    reached: list[str] = []

    async def scenario() -> bool:
        lock = AsyncRedlock(urls, name, ttl=0.5, auto_renewal=False, cancel_on_loss=True)
        with pytest.raises(LockLostError):  # noqa: PT012 - the block is what is cancelled
            async with lock:
                await asyncio.sleep(20)
                reached.append("after the loss")  # pragma: no cover - must never run
        return lock.lost

    assert arun(scenario, timeout=30.0)
    assert reached == []


def test_a_loop_ended_with_a_block_holding_the_lock_releases_it(redis_trio: list[RedisServer], name: str) -> None:
    """Attack: ``asyncio.run`` returns while another task is inside ``async with`` (asyncio.run cancels it): the block's
    exit releases the lock before the loop closes; the name is free at once, not after the ttl."""
    urls = urls_of(redis_trio)
    entered = threading.Event()

    async def holder() -> None:
        async with AsyncRedlock(urls, name, ttl=60.0):
            entered.set()
            await asyncio.sleep(60)

    async def scenario() -> None:
        asyncio.ensure_future(holder())  # noqa: RUF006 - left running on purpose: asyncio.run cancels it
        for _ in range(500):
            if entered.is_set():
                return
            await asyncio.sleep(0.01)

    asyncio.run(scenario())
    assert entered.is_set()
    assert keys_on(redis_trio, name) == [False, False, False]


def test_many_acquires_cancelled_midway_leave_no_key(fresh_trio: list[RedisServer], name: str) -> None:
    """Attack: 150 coroutines acquire one name while a node is paused (some wait for a connection, some for the
    paused node) and are all cancelled midway: once the node resumes and the background undos end, no node holds
    the name."""
    urls = urls_of(fresh_trio)

    async def scenario() -> None:
        warm = AsyncRedlock(urls, name, ttl=60.0, socket_timeout=2.0)
        assert await warm.acquire(blocking=False)  # connections made while every node answers
        await warm.release()
        fresh_trio[0].pause()
        try:
            tasks = [
                asyncio.ensure_future(AsyncRedlock(urls, name, ttl=60.0, socket_timeout=2.0).acquire(blocking=False))
                for _ in range(150)
            ]
            await asyncio.sleep(0.3)
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        finally:
            fresh_trio[0].resume()
        from celery_singleton_lock.lock import aio  # noqa: PLC0415

        await asyncio.wait_for(asyncio.gather(*aio._background, return_exceptions=True), 20.0)
        assert await asyncio.to_thread(wait_for, lambda: keys_on(fresh_trio, name) == [False] * 3, 10.0)

    arun(scenario, timeout=60.0, debug=False)


def test_an_unrenewed_lease_extended_by_hand_is_not_taken_for_lost(redis_trio: list[RedisServer], name: str) -> None:
    """Attack: ``auto_renewal=False`` with ``cancel_on_loss``, the block extending the lease itself: it is not
    cancelled at the first ttl's end."""
    urls = urls_of(redis_trio)

    async def scenario() -> bool:
        async with AsyncRedlock(urls, name, ttl=0.6, auto_renewal=False, cancel_on_loss=True) as lock:
            for _ in range(6):  # 1.5 s: more than two ttls
                await asyncio.sleep(0.25)
                assert await lock.extend()
        return lock.lost

    assert arun(scenario, timeout=30.0) is False


def test_one_lock_used_from_two_event_loops_in_turn(redis_trio: list[RedisServer], name: str) -> None:
    """Attack: an AsyncRedlock acquired and extended in one ``asyncio.run`` (an extend and a renewal waiting on each
    other), then extended and released at once in the next: no "bound to a different event loop" error, and the lock
    is freed (the mutex that orders them belonged to the first loop)."""
    urls = urls_of(redis_trio)
    lock = AsyncRedlock(urls, name, ttl=30.0)

    async def first() -> None:
        assert await lock.acquire(blocking=False)
        assert await asyncio.gather(lock.extend(), lock.extend()) == [True, True]

    async def second() -> list[bool]:
        return list(await asyncio.gather(lock.extend(), lock.release()))

    arun(first)
    assert arun(second) == [True, True]
    assert keys_on(redis_trio, name) == [False, False, False]


def test_a_paused_cluster_master_is_a_node_that_does_not_answer(fresh_trio: list[RedisServer], name: str) -> None:
    """A Cluster node (its master for the name's slot SIGSTOPped) beside two plain nodes: the acquire is won on the
    two others within socket_timeout, the loop is never held, and once the master resumes the attempt's key there is
    taken back or expires (redis-py's Cluster client gives no same-connection undo: see _call_cluster)."""
    from celery_singleton_lock.lock.record import _key_slot  # noqa: PLC0415

    with Cluster() as cluster:
        urls = [cluster.url(), fresh_trio[0].url, fresh_trio[1].url]
        master = cluster.master_of(_key_slot(name))

        async def scenario() -> tuple[bool, bool]:
            lock = AsyncRedlock(urls, name, ttl=3.0, socket_timeout=0.5)
            assert await lock.acquire(blocking=True, timeout=20.0)  # connections and the slot map made while all answer
            assert await lock.release()
            master.pause()
            try:
                won = await lock.acquire(blocking=False)
                errors = [str(e) for e in lock.node_errors]
            finally:
                master.resume()
            released = await lock.release()
            assert errors == [] or all("cluster" in e for e in errors)
            return won, released

        won, released = arun(scenario, timeout=60.0)
        assert won and released
        c = master.client(socket_timeout=5)
        try:
            assert wait_for(lambda: not c.exists(name), 10.0)  # undone, or expired after the 3 s ttl at the latest
        finally:
            c.close()


def test_a_second_cancel_while_the_block_exits_still_frees_the_lock(redis_trio: list[RedisServer], name: str) -> None:
    """The block is cancelled, and cancelled again while ``async with`` waits for its renewal task to end (a TaskGroup
    and a timeout both cancelling): the lock is still freed (from a task of its own), not left to a 60 s ttl."""
    urls = urls_of(redis_trio)
    lock = AsyncRedlock(urls, name, ttl=60.0)

    async def main() -> None:
        entered = asyncio.Event()

        async def body() -> None:
            async with lock:
                entered.set()
                await asyncio.sleep(60)

        task = asyncio.ensure_future(body())
        await asyncio.wait_for(entered.wait(), 20)
        task.cancel()
        await asyncio.sleep(0)  # the block takes the cancel; __aexit__ now waits for the renewal task to end
        task.cancel()  # the second cancel lands in __aexit__
        await asyncio.wait([task], timeout=20)
        assert task.cancelled()
        for _ in range(200):  # bounded: the background release's round trip
            if not _background:
                break
            await asyncio.sleep(0.05)

    arun(main)
    assert lock.validity == 0
    assert wait_for(lambda: not any(keys_on(redis_trio, name)), timeout=20)


def test_a_forked_child_never_frees_the_parents_async_lease(redis_trio: list[RedisServer], name: str) -> None:
    """A process forked while an AsyncRedlock is held: the child's release() (its own loop) forgets the lease and frees
    nothing; the parent still holds the lock."""
    urls = urls_of(redis_trio)
    lock = AsyncRedlock(urls, name, ttl=30.0)
    assert arun(lambda: lock.acquire(blocking=False))
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 1
        try:
            released = asyncio.run(lock.release())
            code = 0 if not released and lock.validity == 0 else 2
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert all(keys_on(redis_trio, name))
    assert arun(lock.owned)
    assert arun(lock.release)


def test_a_name_with_a_lone_surrogate_is_one_lock_with_the_sync_one(redis_trio: list[RedisServer]) -> None:
    """A name holding a lone surrogate (JSON admits "\\ud800": a key built from a request's arguments, a task id) is
    sent as the sync lock sends it (UTF-8, surrogatepass): the async and the sync holder exclude each other."""
    urls = urls_of(redis_trio)
    name = f"test:{uuid.uuid4().hex}:\ud800"
    lock = AsyncRedlock(urls, name, ttl=30.0)
    assert arun(lambda: lock.acquire(blocking=False))
    sync = Redlock(urls, name, ttl=30.0)
    assert not sync.acquire(blocking=False)
    assert arun(lock.release)
    assert sync.acquire(blocking=False)
    assert not arun(lambda: lock.acquire(blocking=False))
    assert sync.release()


# -- the async producers: aapply_async / adelay on real workers ----------------------------------------------------


@pytest.fixture(scope="module")
def c(tmp_path_factory: pytest.TempPathFactory) -> Iterator[wc.Cluster]:
    """One worker (tests/apps/locked_app.py) on a Redis broker and three lock nodes, shared by the adelay tests."""
    with wc.cluster(tmp_path_factory.mktemp("aio-producers"), ttl=3.0) as c:
        c.worker("w1")
        c.app_module()
        yield c


@contextlib.contextmanager
def publish_held(task_name: str, release: threading.Event) -> Iterator[list[bool]]:
    """Every publish of ``task_name`` waits (in its publishing thread, bounded 20 s) until ``release`` is set; the
    list gets, per publish, whether it was released (False: it waited in vain, e.g. it held the loop itself)."""
    seen: list[bool] = []

    def hold(sender: Any = None, **_: Any) -> None:
        if sender == task_name:
            seen.append(release.wait(20))

    before_task_publish.connect(hold, weak=False)
    try:
        yield seen
    finally:
        before_task_publish.disconnect(hold)


@contextlib.contextmanager
def publishes(task_name: str) -> Iterator[list[str]]:
    """The messages of ``task_name`` published meanwhile (their task ids), as Celery's producer sees them."""
    seen: list[str] = []

    def count(sender: Any = None, headers: Any = None, **_: Any) -> None:
        if sender == task_name:
            seen.append((headers or {}).get("id", ""))

    before_task_publish.connect(count, weak=False)
    try:
        yield seen
    finally:
        before_task_publish.disconnect(count)


def consume(c: wc.Cluster, queue: str) -> None:
    """Let the worker consume ``queue`` (the tests' jobs wait unconsumed there until their calls were counted)."""
    mod = c.app_module()
    replies = mod.app.control.add_consumer(queue, destination=[f"w1@{os.uname().nodename}"], reply=True, timeout=5)
    assert replies, f"w1 did not start consuming {queue}"


def held_longer_than(caplog: pytest.LogCaptureFixture, seconds: float) -> list[str]:
    """asyncio's slow-callback reports of callbacks that held the loop longer than ``seconds`` (a paused node's
    socket timeout: far beyond what a busy machine's scheduling adds)."""
    found = re.compile(r"took (\d+\.\d+) seconds")
    return [m for m in slow_callbacks(caplog) if (hit := found.search(m)) and float(hit.group(1)) > seconds]


def reservation(c: wc.Cluster, key: str) -> list[bytes | None]:
    """The reservation's state on each lock node (None where the key is absent)."""
    return c.holder_states(key)


@pytest.mark.slow
def test_adelay_under_queue_scope_publishes_one_message_for_concurrent_calls(
    c: wc.Cluster, caplog: pytest.LogCaptureFixture
) -> None:
    """Ten concurrent ``await q_work.aapply_async(...)`` calls, sent to a queue the worker consumes only afterwards:
    one message (one reservation), every caller gets that job's AsyncResult, the sync call gets it too, the job
    runs once, and the loop is never held for a lock node's timeout."""
    caplog.set_level(logging.WARNING, logger="asyncio")
    mod, k = c.app_module(), wc.new_key()
    queue = "aio-" + k
    with publishes(mod.q_work.name) as published:
        results = arun(lambda: asyncio.gather(*(mod.q_work.aapply_async((k,), queue=queue) for _ in range(10))))
        again = mod.q_work.apply_async((k,), queue=queue)
    assert {r.id for r in results} == {again.id}
    assert published == [again.id]
    consume(c, queue)
    assert results[3].get(timeout=30) == k
    assert [r[1] for r in c.wait_runs(k, 1, 10)] == [again.id]
    assert held_longer_than(caplog, BLOCKED) == []


@pytest.mark.slow
def test_adelay_with_a_lock_node_paused_gets_one_job_without_blocking_the_loop(
    c: wc.Cluster, caplog: pytest.LogCaptureFixture
) -> None:
    """The issue's trial: one of three lock nodes paused, a double click of ``adelay``: the reservation's round
    trips are awaited (the loop is never held by the paused node), both calls get one job, which runs once."""
    caplog.set_level(logging.WARNING, logger="asyncio")
    caplog.set_level(logging.DEBUG, logger="celery_singleton_lock.task")
    mod, k = c.app_module(), wc.new_key()
    assert enqueue._async_nodes(mod.q_work.lock_context()) is not None  # the reservation takes the AsyncRedlock path

    async def scenario() -> list[Any]:
        # Two connections per node made while every node answers (retried: a first connect on a loaded box can
        # pass the 0.5 s socket timeout, and a caller that met it with a node paused could not tell: it sends).
        warm = [AsyncRedlock(c.lock_urls, f"warm-{k}-{i}", ttl=5.0, socket_timeout=0.5) for i in range(2)]
        for lock in warm:
            assert await lock.acquire(timeout=20.0)
        for lock in warm:
            await lock.release()
        await asyncio.to_thread(c.locks[0].pause)
        return list(await asyncio.gather(mod.q_work.adelay(k), mod.q_work.adelay(k)))

    try:
        results = arun(scenario)
        verdicts = [r.getMessage() for r in caplog.records if r.name == "celery_singleton_lock.task"]
        assert len({r.id for r in results}) == 1, verdicts
        assert results[0].get(timeout=30) == k
    finally:
        c.locks[0].resume()
    assert len(c.wait_runs(k, 1, 10)) == 1
    assert held_longer_than(caplog, BLOCKED) == []


@pytest.mark.slow
def test_a_caller_cancelled_mid_publish_leaves_its_reservation_settled(c: wc.Cluster) -> None:
    """The caller is cancelled while its publish is under way (held in its thread): the publish goes on, and when
    it ends the reservation is marked queued, so a later ``delay`` gets that job, which runs once."""
    mod, k = c.app_module(), wc.new_key()
    key, queue = mod.q_work.lock_key_for(k), "aio-" + k
    release = threading.Event()

    async def scenario() -> None:
        caller = asyncio.ensure_future(mod.q_work.aapply_async((k,), queue=queue))
        for _ in range(400):  # bounded: until the reservation says "sending" on every node
            if await asyncio.to_thread(reservation, c, key) == [b"sending"] * 3:
                break
            await asyncio.sleep(0.01)
        caller.cancel()
        with pytest.raises(asyncio.CancelledError):
            await caller
        release.set()  # now the publish may end; its settling runs without a caller
        for _ in range(400):
            if await asyncio.to_thread(reservation, c, key) != [b"sending"] * 3:
                break
            await asyncio.sleep(0.01)

    with publish_held(mod.q_work.name, release) as seen:
        arun(scenario)
    assert seen == [True]
    assert c.wait_holder_state(key, "queued"), reservation(c, key)
    again = mod.q_work.apply_async((k,), queue=queue)  # the cancelled caller's job, queued: this call gets it
    consume(c, queue)
    assert again.get(timeout=30) == k
    runs = c.wait_runs(k, 1, 10)
    assert [r[1] for r in runs] == [again.id]


@pytest.mark.slow
def test_a_caller_cancelled_mid_reserve_leaves_no_reservation(c: wc.Cluster) -> None:
    """A lock node paused makes the reservation's round trip last the socket timeout; the caller is cancelled
    meanwhile: no key is left on any node, nothing was published, and the next call reserves the job anew."""
    mod, k = c.app_module(), wc.new_key()
    key = mod.q_work.lock_key_for(k)

    async def scenario() -> None:
        caller = asyncio.ensure_future(mod.q_work.adelay(k))
        await asyncio.sleep(0.1)  # the paused node's reply is awaited for up to the socket timeout
        caller.cancel()
        with pytest.raises(asyncio.CancelledError):
            await caller

    with publishes(mod.q_work.name) as published:
        c.locks[0].pause()
        try:
            arun(scenario)
        finally:
            c.locks[0].resume()
    assert published == []
    assert wait_for(lambda: c.lock_free(key), 10), reservation(c, key)
    fresh = mod.q_work.delay(k)
    assert fresh.get(timeout=30) == k


@pytest.mark.slow
def test_a_failed_publish_frees_the_reservation(c: wc.Cluster) -> None:
    """A publish that raises: the caller gets the error, and nothing stays reserved."""
    mod, k = c.app_module(), wc.new_key()

    def broken(*_: Any, **__: Any) -> Any:
        raise OSError("broker gone")

    with pytest.raises(OSError, match="broker gone"):
        arun(lambda: enqueue.asend(mod.q_work.lock_context(), broken, (k,), {}, None, {}, linked=False))
    assert c.lock_free(mod.q_work.lock_key_for(k))


@pytest.mark.slow
def test_run_scope_adelay_publishes_while_the_loop_keeps_running(
    c: wc.Cluster, caplog: pytest.LogCaptureFixture
) -> None:
    """Run scope: ``adelay`` only publishes, in a worker thread. The publish waits until a coroutine on the loop
    lets it go: it could not if the publish held the loop. The job runs, once."""
    caplog.set_level(logging.WARNING, logger="asyncio")
    mod, k = c.app_module(), wc.new_key()
    release = threading.Event()

    async def scenario() -> Any:
        sending = asyncio.ensure_future(mod.work.adelay(k))
        await asyncio.sleep(0.05)
        release.set()  # runs on the loop while the publish waits for it
        return await sending

    with publish_held(mod.work.name, release) as seen:
        result = arun(scenario)
    assert seen == [True]
    assert result.get(timeout=30) == k
    assert [r[1] for r in c.wait_runs(k, 1, 10)] == [result.id]
    assert held_longer_than(caplog, BLOCKED) == []


@pytest.mark.slow
def test_a_debounced_task_s_adelay_joins_the_burst_as_delay_does(c: wc.Cluster) -> None:
    """``lock_debounce``: concurrent ``adelay`` calls and a sync ``delay`` of one key are one burst (one task id),
    which runs once with the last call's arguments (the async call runs the sync one in a worker thread)."""
    mod, k = c.app_module(), wc.new_key()

    async def scenario() -> list[Any]:
        first = await mod.debounced.adelay(k, 0)
        rest = await asyncio.gather(*(mod.debounced.adelay(k, i) for i in range(1, 4)))
        return [first, *rest]

    results = arun(scenario)
    last = mod.debounced.delay(k, 9)
    assert {r.id for r in results} == {last.id}
    assert last.get(timeout=30) == [k, 9]
    runs = [(r[1], r[2]) for r in c.records("debounced") if r[0] == k]
    assert runs == [(last.id, 9)]
