"""Regression tests for the review's defects, through Celery's tracer in this process (``apply()``).

Each test failed on the code before its fix (see the CHANGELOG entry). Real redis-server, no worker, and no
result backend unless a test says so: what they see is decided by the lock alone.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from celery import Celery

from celery_singleton_lock import LockedTask, Skipped
from celery_singleton_lock.errors import DuplicateTaskError
from celery_singleton_lock.redlock import NodeSet, Redlock, done_key_for
from celery_singleton_lock.task import DONE_MARGIN, _visibility_timeout
from celery_singleton_lock.testing import RedisServer


@pytest.fixture
def app(redis_node: RedisServer) -> Iterator[Celery]:
    app = Celery(f"hard-{uuid.uuid4().hex[:8]}", broker="memory://", set_as_current=False)
    app.conf.singleton_lock_urls = [redis_node.url]
    app.conf.singleton_lock_prefix = f"hard-{uuid.uuid4().hex[:8]}:"
    yield app
    app.close()


@pytest.mark.parametrize("holder_id", ["nightly|done|1", "|done|", "done", "x|retry|y", "a|b|c|d|123|e"])
def test_a_holder_whose_id_looks_like_a_marker_still_excludes_others(app: Celery, holder_id: str) -> None:
    """A live holder whose task id contains '|done|' (or any separator soup) is a holder like any other: another
    job with the same arguments is skipped as its duplicate, never run beside it."""
    seen: list[Any] = []

    @app.task(base=LockedTask, bind=True)
    def nightly(self: Any, n: int) -> str:
        if self.request.id == holder_id:
            seen.append(nightly.apply(args=(n,), task_id=f"other-{uuid.uuid4().hex[:6]}").get())
        return self.request.id

    assert nightly.apply(args=(1,), task_id=holder_id).get() == holder_id
    assert len(seen) == 1
    assert isinstance(seen[0], Skipped)
    assert seen[0].holder_task_id == holder_id


@pytest.mark.parametrize("task_id", ["done", "|done|", "job|done|7"])
def test_a_task_id_that_looks_like_a_marker_is_an_ordinary_job(app: Celery, task_id: str) -> None:
    """After another job succeeded, a job whose id reads 'done' runs (it is not that job's done marker); once it
    succeeded, a copy of the same id stops as already succeeded and a new id runs."""
    runs: list[str] = []

    @app.task(base=LockedTask, bind=True)
    def job(self: Any, n: int) -> str:
        runs.append(self.request.id)
        return self.request.id

    assert job.apply(args=(5,), task_id="first").get() == "first"
    assert job.apply(args=(5,), task_id=task_id).get() == task_id
    again = job.apply(args=(5,), task_id=task_id).get()
    assert isinstance(again, Skipped)
    assert again.reason == "already succeeded"
    assert job.apply(args=(5,), task_id="last").get() == "last"
    assert runs == ["first", task_id, "last"]


def test_a_late_copy_of_a_finished_job_never_runs_it_again(app: Celery, redis_node: RedisServer) -> None:
    """With no result backend the done marker is the only memory of a success: a copy of the same task id that
    starts several ttls later (a busy pool, a long countdown) still stops, as already succeeded."""
    runs: list[str] = []

    @app.task(base=LockedTask, bind=True, lock_ttl=0.3, ignore_result=True)
    def job(self: Any, n: int) -> None:
        runs.append(self.request.id)

    job.apply(args=(1,), task_id="late-1").get()
    time.sleep(1.0)  # over 3 ttls: the old marker (ttl + 0.5 s) was gone by now
    late = job.apply(args=(1,), task_id="late-1").get()
    assert isinstance(late, Skipped)
    assert late.reason == "already succeeded"
    assert runs == ["late-1"]
    marker = redis_node.client().pttl(done_key_for(job.lock_key_for(1), "late-1"))
    assert marker > 50_000  # at least a minute after the success, whatever the ttl


def test_a_copy_waiting_for_its_twin_keeps_the_done_marker_for_the_whole_window(
    app: Celery, redis_node: RedisServer
) -> None:
    """A copy of the same task id that arrived while its twin ran (and was sent to wait) marks the twin's record
    'waiting'; the twin's success then keeps the done marker for the documented window (longest wait we create,
    or the broker's visibility timeout, plus a margin), not the short default."""

    @app.task(base=LockedTask, bind=True, lock_ttl=2)
    def job(self: Any, n: int) -> None:
        with pytest.raises(DuplicateTaskError):  # eager: a copy that would be re-sent to wait raises instead
            job.apply(args=(n,), task_id=self.request.id, throw=True).get()
        assert redis_node.client().hget(job.lock_key_for(n), "waiting") == b"1"

    job.apply(args=(2,), task_id="twin-1", throw=True).get()
    marker = redis_node.client().pttl(done_key_for(job.lock_key_for(2), "twin-1"))
    window = job._options().done_window
    assert window >= DONE_MARGIN
    assert (window - 5) * 1000 < marker <= window * 1000


def test_the_visibility_timeout_cap_uses_kombu_s_default(redis_node: RedisServer) -> None:
    """A Redis broker with no visibility_timeout set has kombu's 3600 s: re-sent copies are capped at half of it
    (they used to be uncapped, so a lock_ttl >= 3600 let waiting copies multiply); AMQP has none; an explicit
    value wins."""
    redis_app = Celery("vt", broker=redis_node.url, set_as_current=False)
    assert _visibility_timeout(redis_app) == 3600.0
    redis_app.conf.singleton_lock_urls = [redis_node.url]

    @redis_app.task(base=LockedTask, lock_ttl=7200)
    def slow() -> None: ...

    assert slow._options().max_countdown == 1800.0
    assert slow._options().done_window >= 3600.0
    explicit = Celery("vt2", broker=redis_node.url, set_as_current=False)
    explicit.conf.broker_transport_options = {"visibility_timeout": 120}
    assert _visibility_timeout(explicit) == 120.0
    amqp = Celery("vt3", broker="amqp://guest:guest@127.0.0.1:5672//", set_as_current=False)
    assert _visibility_timeout(amqp) is None


def test_the_enqueue_check_sends_a_call_with_its_own_task_id(app: Celery, redis_node: RedisServer) -> None:
    """With lock_enqueue_check, a call without a task id returns the running run's result; a call that names its own
    task id is sent as asked (its caller waits on that id, which another run's result would leave PENDING)."""

    @app.task(base=LockedTask, lock_enqueue_check=True)
    def charge(order: int) -> None: ...

    holder = Redlock(app.conf.singleton_lock_urls, charge.lock_key_for(7), ttl=10, job="running-1")
    assert holder.acquire(blocking=False)
    try:
        assert charge.delay(7).id == "running-1"
        assert charge.apply_async((7,), task_id="mine").id == "mine"
    finally:
        holder.release()


def test_lock_held_turns_false_from_the_local_deadline_without_renewal(app: Celery) -> None:
    """A body that starves the watchdog (CPU-bound under gevent) sees lock_held() turn False once the lease's
    local deadline passes, with no I/O: simulated by taking the lease away from the watchdog."""
    from celery_singleton_lock.renewal import watchdog  # noqa: PLC0415

    observed: list[bool] = []

    @app.task(base=LockedTask, bind=True, lock_ttl=0.4)
    def busy(self: Any) -> None:
        run = self._current()
        watchdog().unregister(run.lease)  # as if the watchdog never got to run
        observed.append(self.lock_held())
        time.sleep(0.5)
        observed.append(self.lock_held())

    busy.apply().get()
    assert observed == [True, False]


class _FailingSend(redis.Connection):
    """A connection whose first script call fails to write, as a socket reset mid-write would."""

    failures = 1

    def send_packed_command(self, command: Any, check_health: bool = True) -> None:
        if _FailingSend.failures > 0 and b"EVALSHA" in b"".join(command if isinstance(command, list) else [command]):
            _FailingSend.failures -= 1
            raise OSError("connection reset while writing (injected)")
        super().send_packed_command(command, check_health=check_health)


def test_a_failed_write_returns_the_connection_to_a_caller_s_pool(redis_node: RedisServer, name: str) -> None:
    """A client passed in with a bounded blocking pool gets its connection back when writing a command fails: the
    next lock call finds one instead of waiting for a connection that leaked."""
    pool = redis.BlockingConnectionPool(
        connection_class=_FailingSend, host="127.0.0.1", port=redis_node.port, max_connections=1, timeout=0.5
    )
    client = redis.Redis(connection_pool=pool)
    nodes = NodeSet([client])
    lock = Redlock(nodes, name, ttl=5)
    assert not lock.acquire(blocking=False)
    assert lock.node_errors
    assert lock.acquire(blocking=False), lock.node_errors
    assert lock.release()
