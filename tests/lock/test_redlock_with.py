"""``with Redlock(...)``: the lease is renewed by the process's watchdog while the block runs (``auto_renewal``), and a
loss is told to the block: ``lost``, an ``on_lost`` callback, and with ``interrupt_on_loss`` LockLostError raised
inside the block (the main thread: a signal, as ``lock_on_lost="interrupt"``).

Real redis-servers (the shared trio); the loss is made by deleting the lock's key on every node. No timing
assertions: every wait is a bounded poll.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from collections.abc import Sequence
from types import FrameType

import pytest

from celery_singleton_lock import LockLostError, Redlock
from celery_singleton_lock.errors import ConfigurationError
from celery_singleton_lock.lock import interrupt
from celery_singleton_lock.lock.interrupt import INTERRUPT_SIGNAL, Target
from celery_singleton_lock.testing import RedisServer, wait_for

WAIT = 20.0  # seconds any single outcome may take on a loaded machine


def urls_of(servers: Sequence[RedisServer]) -> list[str]:
    return [s.url for s in servers]


def delete_on(servers: Sequence[RedisServer], name: str) -> None:
    for s in servers:
        c = s.client(socket_timeout=5)
        try:
            c.delete(name)
        finally:
            c.close()


def test_with_renews_the_lease_while_the_block_runs(redis_trio: list[RedisServer], name: str) -> None:
    """A 1.5 s lease held by a block for 3.5 s (more than two ttls) still refuses a contender at the end of the block,
    and is free once the block has left; ``auto_renewal=False`` lets the contender in after the ttl."""
    urls = urls_of(redis_trio)
    with Redlock(urls, name, ttl=1.5) as lock:  # seconds: a renewal slowed by a loaded machine still comes in time
        time.sleep(3.5)
        assert not Redlock(urls, name).acquire(blocking=False)
        assert lock.owned() and not lock.lost
    assert Redlock(urls, name).acquire(blocking=False)

    other = f"{name}:unrenewed"
    with Redlock(urls, other, ttl=0.3, auto_renewal=False):
        contender = Redlock(urls, other, ttl=5.0)
        assert contender.acquire(blocking=True, timeout=5.0)
        contender.release()


def test_a_lost_lease_interrupts_the_block(redis_trio: list[RedisServer], name: str) -> None:
    """``interrupt_on_loss=True``: keys deleted on every node mid-block; the renewal finds the lease lost and
    LockLostError is raised inside the block's sleep (the code after it never runs); ``on_lost`` is called once."""
    urls = urls_of(redis_trio)
    reached: list[str] = []
    told: list[Redlock] = []
    lock = Redlock(urls, name, ttl=0.6, interrupt_on_loss=True, on_lost=told.append)
    with pytest.raises(LockLostError, match="lost while the block ran"):  # noqa: PT012 - the block is interrupted
        with lock:
            delete_on(redis_trio, name)
            for _ in range(int(WAIT / 0.1)):
                time.sleep(0.1)
            reached.append("after the loss")  # pragma: no cover - must never run
    assert reached == []
    assert lock.lost and told == [lock]
    assert not lock.release()  # after the loss: nothing to give up, no error
    time.sleep(0.05)  # a second signal, had one been sent, would raise here
    assert lock.validity == 0.0


def test_a_lost_lease_without_interrupt_lets_the_block_finish(redis_trio: list[RedisServer], name: str) -> None:
    """Without ``interrupt_on_loss`` the block runs to its end; ``lost`` and ``on_lost`` tell it."""
    urls = urls_of(redis_trio)
    told = threading.Event()
    with Redlock(urls, name, ttl=0.6, on_lost=lambda _lock: told.set()) as lock:
        delete_on(redis_trio, name)
        assert wait_for(lambda: lock.lost, WAIT)
        assert told.wait(WAIT)
    assert lock.lost


def test_a_released_block_is_no_loss(redis_trio: list[RedisServer], name: str) -> None:
    """Many short blocks in a row with ``interrupt_on_loss``: leaving the block is never taken for a loss (nothing
    is raised after it, ``lost`` stays False)."""
    urls = urls_of(redis_trio)
    lock = Redlock(urls, name, ttl=2.0, interrupt_on_loss=True)  # no loss of its own under load
    for _ in range(20):
        with lock:
            time.sleep(0.02)
        assert not lock.lost
    time.sleep(0.8)  # one renewal interval after the last block: no late interrupt


def test_interrupt_on_loss_outside_the_main_thread_is_refused_before_acquiring(
    redis_trio: list[RedisServer], name: str
) -> None:
    """A thread cannot be interrupted: ``with`` refuses at once in one line naming the option, holding nothing."""
    urls = urls_of(redis_trio)
    errors: list[BaseException] = []

    def run() -> None:
        try:
            with Redlock(urls, name, interrupt_on_loss=True):
                pass  # pragma: no cover - never entered
        except BaseException as exc:
            errors.append(exc)

    t = threading.Thread(target=run)
    t.start()
    t.join(WAIT)
    assert len(errors) == 1 and isinstance(errors[0], ConfigurationError)
    assert "interrupt_on_loss" in str(errors[0]) and "\n" not in str(errors[0])
    assert Redlock(urls, name).acquire(blocking=False)


def test_a_raising_on_lost_callback_still_interrupts_the_block(redis_trio: list[RedisServer], name: str) -> None:
    """Attack: ``on_lost`` raises; the block is interrupted all the same (the callback ran before the interrupt)."""
    urls = urls_of(redis_trio)
    calls: list[str] = []

    def broken(_lock: Redlock) -> None:
        calls.append("called")
        raise RuntimeError("a callback's bug")

    with pytest.raises(LockLostError):  # noqa: PT012 - the block is interrupted
        with Redlock(urls, name, ttl=0.6, interrupt_on_loss=True, on_lost=broken):
            delete_on(redis_trio, name)
            for _ in range(int(WAIT / 0.1)):
                time.sleep(0.1)
    assert calls == ["called"]


def test_an_unrenewed_lease_that_runs_out_interrupts_the_block(redis_trio: list[RedisServer], name: str) -> None:
    """Attack: ``auto_renewal=False`` with ``interrupt_on_loss``: the lease's end by our clock is its loss; the block
    is interrupted then and ``on_lost`` told, rather than running on after another holder may have got in."""
    urls = urls_of(redis_trio)
    told: list[Redlock] = []
    with pytest.raises(LockLostError):  # noqa: PT012 - the block is interrupted
        with Redlock(urls, name, ttl=0.5, auto_renewal=False, interrupt_on_loss=True, on_lost=told.append) as lock:
            for _ in range(int(WAIT / 0.1)):
                time.sleep(0.1)
    assert lock.lost and told == [lock]


def test_a_paused_node_while_the_watchdog_renews_keeps_the_lease(fresh_trio: list[RedisServer], name: str) -> None:
    """Attack: one of three nodes SIGSTOPped for several ttls while the block runs: the two others keep the quorum,
    the block is not interrupted, and the lease is released at the end."""
    urls = urls_of(fresh_trio)
    with Redlock(urls, name, ttl=1.5, socket_timeout=0.3, interrupt_on_loss=True) as lock:
        fresh_trio[0].pause()
        try:
            time.sleep(2.5)
            assert not lock.lost and lock.validity > 0
            assert not Redlock(urls, name, socket_timeout=0.2).acquire(blocking=False)
        finally:
            fresh_trio[0].resume()
    assert Redlock(urls, name).acquire(blocking=False)


def test_many_blocks_on_their_own_locks_are_renewed_in_one_round_trip_with_a_node_paused(
    fresh_trio: list[RedisServer],
) -> None:
    """Attack: 8 threads each in ``with Redlock(urls, own_name, ttl=1.8)`` (each Redlock its own NodeSet on the same
    URLs) while one node is SIGSTOPped for 3 s. The watchdog renews them together, one round trip per tick (bounded
    by socket_timeout); renewed one by one, a tick cost 8 x socket_timeout, longer than the leases, and all were
    lost with a quorum of nodes healthy."""
    urls = urls_of(fresh_trio)
    names = [f"many:{i}:{time.monotonic_ns()}" for i in range(8)]
    entered = threading.Barrier(len(names) + 1, timeout=WAIT)
    leave = threading.Event()
    lost: list[str] = []
    errors: list[BaseException] = []

    def block(name: str) -> None:
        try:
            with Redlock(urls, name, ttl=1.8, socket_timeout=0.3) as lock:
                entered.wait()
                leave.wait(WAIT)
                if lock.lost or lock.validity == 0:
                    lost.append(name)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=block, args=(n,), daemon=True) for n in names]
    for t in threads:
        t.start()
    entered.wait()
    fresh_trio[0].pause()
    try:
        time.sleep(3.0)
    finally:
        fresh_trio[0].resume()
        leave.set()
        for t in threads:
            t.join(WAIT)
    assert errors == []
    assert lost == []


def test_an_unrenewed_lease_extended_by_hand_is_not_taken_for_lost(redis_trio: list[RedisServer], name: str) -> None:
    """Attack: ``auto_renewal=False`` with ``interrupt_on_loss``, the block extending the lease itself: the end told
    as a loss is the extended one, not the first ttl's."""
    urls = urls_of(redis_trio)
    with Redlock(urls, name, ttl=0.6, auto_renewal=False, interrupt_on_loss=True) as lock:
        for _ in range(6):  # 1.5 s: more than two ttls
            time.sleep(0.25)
            assert lock.extend()
        assert not lock.lost


def test_a_forked_child_leaving_the_block_never_frees_the_lease(redis_trio: list[RedisServer], name: str) -> None:
    """A process forked inside ``with Redlock``: the child leaving the block (its ``__exit__``) or calling ``release()``
    / ``extend()`` frees and renews nothing; the parent still holds the lock and a contender is refused."""
    urls = urls_of(redis_trio)
    with Redlock(urls, name, ttl=30.0) as lock:
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child
            code = 1
            try:
                lock.__exit__(None, None, None)
                code = 0 if not lock.release() and not lock.extend() and lock.validity == 0 else 2
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert lock.owned()
        assert not Redlock(urls, name).acquire(blocking=False)
    assert Redlock(urls, name).acquire(blocking=False)


def test_more_leases_than_one_batch_keep_their_quorum_with_a_node_paused(fresh_trio: list[RedisServer]) -> None:
    """Attack: 450 ``with Redlock`` blocks in one process (three renewal batches of 200) while one of three nodes is
    SIGSTOPped for 3 s. The node that did not answer the first batch is not asked by the next ones, so a renewal
    costs socket_timeout once; asked by each batch in turn, a renewal took 3 x socket_timeout, more than the leases
    had left, and all 450 were lost with two healthy nodes."""
    urls = urls_of(fresh_trio)
    with contextlib.ExitStack() as stack:
        locks = [
            stack.enter_context(Redlock(urls, f"batch:{i}:{time.monotonic_ns()}", ttl=1.5, socket_timeout=0.4))
            for i in range(450)
        ]
        fresh_trio[0].pause()
        try:
            time.sleep(3.0)
        finally:
            fresh_trio[0].resume()
        assert [lock.name for lock in locks if lock.lost or lock.validity == 0] == []


def test_an_interrupt_handled_as_the_exit_disarms_is_dropped(redis_trio: list[RedisServer], name: str) -> None:
    """Attack: the loss signal handled at the first instruction of ``Target.disarm`` (``__exit__`` calls it first: a
    signal that arrived during ``__exit__``'s opening bytecodes is handled there, in disarm's frame, before it clears
    ``armed``). The body has ended: the interrupt is dropped, not raised out of a block that completed (the handler
    is called with disarm's real frame, caught by a trace function: the signal's timing made deterministic)."""
    lock = Redlock(urls_of(redis_trio), name, ttl=30.0, interrupt_on_loss=True)
    raised: list[BaseException] = []

    def tracer(frame: FrameType, event: str, arg: object) -> None:
        if event == "call" and frame.f_code is Target.disarm.__code__:
            try:
                interrupt._handler(INTERRUPT_SIGNAL or 0, frame)
            except LockLostError as exc:
                raised.append(exc)

    previous = sys.gettrace()
    try:
        with lock:
            target = lock._target
            assert target is not None
            target.error = LockLostError("lost", key=name)  # fire()'s first half: the interrupt is on its way
            sys.settrace(tracer)
    finally:
        sys.settrace(previous)
    assert raised == []
    assert lock.validity == 0
    assert Redlock(urls_of(redis_trio), name).acquire(blocking=False)


def test_an_outer_interrupt_handled_as_an_inner_block_exits_is_still_raised(
    redis_trio: list[RedisServer], name: str
) -> None:
    """The same window nested: the outer lock's loss handled in the inner block's disarm is the outer body's (the
    inner block is part of it): raised, while the inner block's own interrupt would be dropped."""
    urls = urls_of(redis_trio)
    outer = Redlock(urls, f"{name}:outer", ttl=30.0, interrupt_on_loss=True)
    inner = Redlock(urls, f"{name}:inner", ttl=30.0, interrupt_on_loss=True)
    raised: list[BaseException] = []

    def tracer(frame: FrameType, event: str, arg: object) -> None:
        if event == "call" and frame.f_code is Target.disarm.__code__ and frame.f_locals["self"] is inner_target:
            try:
                interrupt._handler(INTERRUPT_SIGNAL or 0, frame)
            except LockLostError as exc:
                raised.append(exc)

    previous = sys.gettrace()
    try:
        with outer, inner:
            inner_target, outer_target = inner._target, outer._target
            assert inner_target is not None and outer_target is not None
            inner_target.error = LockLostError("inner lost", key=name)
            outer_target.error = LockLostError("outer lost", key=name)
            sys.settrace(tracer)
    finally:
        sys.settrace(previous)
    assert [str(e) for e in raised] == ["outer lost"]
