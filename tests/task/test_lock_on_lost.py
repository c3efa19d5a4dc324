"""lock_on_lost="interrupt": a body whose lock is lost gets LockLostError raised inside it, where the pool allows.

Real workers (prefork, solo, gevent; a threads worker for the warning) on one broker and three lock nodes
(tests/worker_cluster.py); the bodies (tests/apps/locked_app.py) sleep in short steps until their lock is lost, then
a while more, and record whether LockLostError reached them and whether they reached their end. The lock is lost by
deleting its key on every node, or by SIGSTOPping the process that runs the body past the lease's end. The
in-process tests drive the same mechanism through Celery's tracer (``apply()``) in pytest's main thread.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from celery import Celery
from worker_cluster import Cluster, cluster, new_key, polling

from celery_singleton_lock import LockedTask, LockLostError
from celery_singleton_lock.errors import ConfigurationError
from celery_singleton_lock.lock import interrupt
from celery_singleton_lock.lock.interrupt import INTERRUPT_SIGNAL, Target

TTL = 3.0
WAIT = 30.0  # seconds any single outcome may take on a loaded CI machine
POOLS = {"prefork": "q-prefork", "solo": "q-solo", "gevent": "q-gevent"}


@pytest.fixture(scope="module")
def c(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with cluster(tmp_path_factory.mktemp("on_lost"), ttl=TTL) as cl:
        cl.app_module()
        yield cl


@pytest.fixture(scope="module")
def workers(c: Cluster) -> dict[str, Any]:
    """One worker per pool, each on a queue of its own (started once, on first use)."""
    pytest.importorskip("gevent")
    return {pool: c.worker(f"w-{pool}", queues=queue, pool=pool, concurrency=1) for pool, queue in POOLS.items()}


def marks(c: Cluster, name: str, task_id: str) -> list[list[Any]]:
    return [r for r in c.records(name) if r[1] == task_id]


def delete_everywhere(c: Cluster, name: str) -> None:
    for server in c.locks:
        with contextlib.closing(c.lock_client(server)) as client:
            client.delete(name)


@pytest.mark.parametrize("pool", ["prefork", "solo", "gevent"])
def test_a_deleted_key_interrupts_the_body(c: Cluster, workers: dict[str, Any], pool: str) -> None:
    """The lock's key deleted on every node mid-run: the body gets LockLostError (it never reaches its end) and the
    task ends FAILURE with it."""
    mod = c.app_module()
    k = new_key()
    result = mod.interruptible.apply_async((k,), queue=POOLS[pool])
    c.wait_started(k)
    delete_everywhere(c, mod.interruptible.lock_key_for(k))
    with pytest.raises(LockLostError, match="lost: renewal refused"):
        result.get(timeout=WAIT)
    assert result.state == "FAILURE"
    (interrupted,) = marks(c, "interrupted", result.id)
    assert mod.interruptible.lock_key_for(k) in interrupted[2]
    assert marks(c, "ended", result.id) == []
    assert f"interruptible[{result.id}] LOST while running" in workers[pool].log()
    # The same process serves the next job to its end: nothing of the interrupt is left pending for it.
    after = new_key()
    assert mod.work.apply_async((after, 0.3), queue=POOLS[pool]).get(timeout=WAIT) == after


@pytest.mark.parametrize("how", ["sleep", "socket"])
def test_a_loss_breaks_a_blocking_system_call(c: Cluster, workers: dict[str, Any], how: str) -> None:
    """A body blocked in one long system call (a sleep; a read on a socket no data reaches) gets LockLostError when
    its lock is lost: the signal breaks the call (it would block for minutes), it does not wait for it to return."""
    mod = c.app_module()
    k = new_key()
    result = mod.blocked.apply_async((k, how), queue=POOLS["prefork"])
    c.wait_started(k)
    delete_everywhere(c, mod.blocked.lock_key_for(k, how))
    with pytest.raises(LockLostError, match="lost: renewal refused"):
        result.get(timeout=WAIT)  # WAIT is far under the call's block (locked_app.BLOCK)
    (interrupted,) = marks(c, "interrupted", result.id)
    assert mod.blocked.lock_key_for(k, how) in interrupted[2]
    assert marks(c, "ended", result.id) == []


@pytest.mark.parametrize("pool", ["prefork", "solo"])
def test_a_holder_stopped_past_its_lease_is_interrupted_on_resume(
    c: Cluster, workers: dict[str, Any], pool: str
) -> None:
    """The process running the body SIGSTOPped until its lease ran out, then resumed: the watchdog's next renewal
    is refused, and the body is interrupted with LockLostError."""
    mod = c.app_module()
    k = new_key()
    name = mod.interruptible.lock_key_for(k)
    result = mod.interruptible.apply_async((k,), queue=POOLS[pool])
    (started,) = c.wait_started(k)
    pid = started[2]
    os.kill(pid, signal.SIGSTOP)
    try:
        assert c.wait_lock_free(name, WAIT) is not None, "the stopped holder's lease never ran out"
    finally:
        os.kill(pid, signal.SIGCONT)
    with pytest.raises(LockLostError):
        result.get(timeout=WAIT)
    assert len(marks(c, "interrupted", result.id)) == 1
    assert marks(c, "ended", result.id) == []


def test_the_default_keeps_running_to_its_end(c: Cluster, workers: dict[str, Any]) -> None:
    """Without lock_on_lost, a body whose key was deleted runs to its end (lock_held() False there) and succeeds."""
    mod = c.app_module()
    k = new_key()
    result = mod.uninterrupted.apply_async((k, 1.0), queue=POOLS["prefork"])
    c.wait_started(k)
    delete_everywhere(c, mod.uninterrupted.lock_key_for(k))
    assert result.get(timeout=WAIT) == {"held": False}
    assert marks(c, "interrupted", result.id) == []
    assert len(marks(c, "ended", result.id)) == 1
    assert f"uninterrupted[{result.id}] LOST while running" in workers["prefork"].log()


def test_a_threads_worker_warns_that_it_cannot_interrupt(c: Cluster) -> None:
    """A worker of the threads pool starts, and says in one line which tasks it cannot interrupt."""
    worker = c.worker("w-threads", queues="q-threads", pool="threads", concurrency=2)
    try:
        line = next(x for x in worker.log().splitlines() if "lock_on_lost='interrupt'" in x)
    finally:
        worker.stop()
    assert "locked_app.interruptible" in line
    assert "cannot work in the thread pool" in line


# -- in this process: the tracer in pytest's main thread, like the solo pool ----------------------------------------


@pytest.fixture
def lost_tasks(app: Celery) -> Any:
    @app.task(base=LockedTask, bind=True, shared=False, lock_ttl=0.6, lock_on_lost="interrupt")
    def deletes_its_key(self: Any, seen: list[str]) -> str:
        key = self.lock_key_for(seen)
        for node in self.app.conf.singleton_lock_urls:
            client = redis.Redis.from_url(node)
            client.delete(key)
            client.close()
        try:
            for _ in polling(WAIT, 0.02):  # bounded
                pass
        except LockLostError:
            seen.append("interrupted")
            raise
        seen.append("ended")
        return "ended"

    return deletes_its_key


def test_apply_in_the_main_thread_is_interrupted(lost_tasks: Any) -> None:
    """Through Celery's tracer in the main thread (as under the solo pool), the loss of a body's lock raises
    LockLostError inside it, and the outcome is a FAILURE carrying it."""
    seen: list[str] = []
    outcome = lost_tasks.apply(args=(seen,))
    assert outcome.state == "FAILURE"
    assert isinstance(outcome.result, LockLostError)
    assert seen == ["interrupted"]


def fire_and_wait(target: Target, error: LockLostError) -> None:
    target.fire(error)
    for _ in polling(WAIT, 0.01):  # bounded: the handler raises here, or at once in fire()
        pass


def test_an_interrupt_after_the_body_ended_does_nothing() -> None:
    """A loss noticed after the body ended (the target disarmed) raises nothing in the main thread; one noticed
    while it runs raises once."""
    later = Target()
    assert later.arm()
    later.disarm()
    later.fire(LockLostError("too late"))
    for _ in polling(0.3, 0.01):  # the signal, if one were sent, is handled within this loop
        pass
    live = Target()
    assert live.arm()
    with pytest.raises(LockLostError, match="now"):
        fire_and_wait(live, LockLostError("now"))
    live.disarm()


def test_a_signal_handled_in_call_itself_is_dropped(app: Celery) -> None:
    """A loss signalled while LockedTask.__call__'s own code runs (its finally, after the body returned, before the
    release disarms the run) raises nothing there; handled in any other frame (a body's), it raises."""
    frames: list[Any] = []

    @app.task(base=LockedTask, bind=True, shared=False)
    def grab(self: Any) -> None:
        frames.append(sys._getframe(1))  # the frame that called the body

    grab.apply().get()
    (call_frame,) = frames
    assert call_frame.f_code is LockedTask.__call__.__code__
    late = Target()
    assert late.arm()
    late.error = LockLostError("late")  # what fire() sets before it signals
    interrupt._handler(INTERRUPT_SIGNAL or 0, call_frame)
    late.disarm()
    live = Target()
    assert live.arm()
    live.error = LockLostError("in the body")
    with pytest.raises(LockLostError, match="in the body"):
        interrupt._handler(INTERRUPT_SIGNAL or 0, sys._getframe())
    live.disarm()


def test_a_body_off_the_main_thread_is_not_interrupted() -> None:
    """In a thread other than the main one (the threads pool), nothing can raise in the body: arm() says so."""
    armed: list[bool] = []
    thread = threading.Thread(target=lambda: armed.append(Target().arm()))
    thread.start()
    thread.join(10)
    assert armed == [False]


def test_an_unknown_policy_is_refused_at_registration(app: Celery) -> None:
    """lock_on_lost="stop" is refused when the task is defined, in one line naming the options."""

    def bad() -> None: ...

    with pytest.raises(ConfigurationError, match=r"lock_on_lost of .*bad must be one of 'continue', 'interrupt'"):
        app.task(base=LockedTask, shared=False, lock_on_lost="stop")(bad).name  # the first attribute access binds it
