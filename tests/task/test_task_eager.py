"""LockedTask through Celery's tracer in this process (``apply()``), against a throwaway redis-server.

No worker and no result backend: what these tests see is decided by the lock alone.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

import pytest
from celery import Celery, Task

from celery_singleton_lock import ConfigurationError, LockedTask, Skipped
from celery_singleton_lock.lock.redlock import done_key_for
from celery_singleton_lock.testing import RedisServer


def test_a_copy_of_a_job_that_just_succeeded_stops_on_the_done_marker(app: Celery, redis_node: RedisServer) -> None:
    """Right after a success (before any result could be read), a copy with the same task id does not run again,
    while a different job with the same arguments runs at once (the marker is the task id's, not the lock's)."""
    runs: list[str] = []

    @app.task(shared=False, base=LockedTask, bind=True)
    def job(self: Any, n: int) -> int:
        runs.append(self.request.id)
        return n

    first = job.apply(args=(1,), task_id="job-1")
    assert first.get() == 1
    key = job.lock_key_for(1)
    assert redis_node.client().exists(key) == 0
    assert redis_node.client().exists(done_key_for(key, "job-1")) == 1

    again = job.apply(args=(1,), task_id="job-1")
    assert isinstance(again.get(), Skipped)
    assert again.get().reason == "already ran"

    other = job.apply(args=(1,), task_id="job-2")
    assert other.get() == 1
    assert runs == ["job-1", "job-2"]


def test_a_failed_run_frees_its_lock_and_its_copies_stop(app: Celery, redis_node: RedisServer) -> None:
    """A run that raises has ended its job (issue 19): the lock is free for other jobs, the task id's done marker is
    set, a copy of the same task id stops as "already ran", and another task id runs."""

    runs: list[str] = []

    @app.task(shared=False, base=LockedTask, bind=True)
    def boom(self: Any, n: int) -> None:
        runs.append(self.request.id)
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError):
        boom.apply(args=(2,), task_id="boom-1").get()
    key = boom.lock_key_for(2)
    client = redis_node.client()
    assert client.exists(key) == 0
    assert client.exists(done_key_for(key, "boom-1")) == 1
    again = boom.apply(args=(2,), task_id="boom-1").get()
    assert isinstance(again, Skipped) and again.reason == "already ran", again
    with pytest.raises(RuntimeError):  # another job of the same key runs: the lock was freed
        boom.apply(args=(2,), task_id="boom-2").get()
    assert runs == ["boom-1", "boom-2"]


def test_lock_key_binds_defaults_and_keywords(app: Celery) -> None:
    """f(1), f(1, 'current') and f(account_id=1) are one key; a different argument is another key."""

    @app.task(shared=False, base=LockedTask)
    def report(account_id: int, month: str = "current") -> None: ...

    keys = {report.lock_key_for(1), report.lock_key_for(1, "current"), report.lock_key_for(account_id=1)}
    assert len(keys) == 1
    assert report.lock_key_for(2) not in keys


def test_cooldown_keeps_a_finished_job_locked_then_frees_it(app: Celery, redis_node: RedisServer) -> None:
    """With lock_cooldown, the same job sent right after a success is skipped as a duplicate of the finished run;
    after the cooldown it runs again. A failure does not hold the lock."""
    runs: list[str] = []

    @app.task(shared=False, base=LockedTask, bind=True, lock_cooldown=0.6)
    def refresh(self: Any, n: int, fail: bool = False) -> int:
        runs.append(self.request.id)
        if fail:
            raise RuntimeError("failing on purpose")
        return n

    assert refresh.apply(args=(3,), task_id="r-1").get() == 3
    skipped = refresh.apply(args=(3,), task_id="r-2").get()
    assert isinstance(skipped, Skipped)
    assert skipped.holder_task_id == "r-1"
    deadline = time.monotonic() + 5
    while redis_node.client().exists(refresh.lock_key_for(3)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert refresh.apply(args=(3,), task_id="r-3").get() == 3
    assert runs == ["r-1", "r-3"]

    with pytest.raises(RuntimeError):
        refresh.apply(args=(4, True), task_id="f-1").get()
    assert refresh.apply(args=(4,), task_id="f-2").get() == 4


def test_a_bad_cooldown_is_refused_at_registration(app: Celery) -> None:
    """lock_cooldown must be a number of seconds >= 0: anything else fails when the task class is bound to the app
    (what app.task does when it registers a task)."""
    bad = type("Bad", (LockedTask,), {"name": "eager.bad", "lock_cooldown": -1, "run": lambda self: None})
    with pytest.raises(ConfigurationError, match=r"lock_cooldown of eager\.bad"):
        bad.bind(app)


def test_eager_reschedule_names_the_real_holder(app: Celery, redis_node: RedisServer) -> None:
    """Eager mode cannot wait: a rescheduled duplicate fails at once with DuplicateTaskError naming the holder (it
    used to name itself)."""
    from celery_singleton_lock import DuplicateTaskError, Redlock  # noqa: PLC0415

    @app.task(base=LockedTask, lock_on_duplicate="reschedule", shared=False)
    def job(n: int) -> int:
        return n

    holder = Redlock([redis_node.url], job.lock_key_for(1), ttl=30, job="HOLDER-ID", record={"state": "run"})
    assert holder.acquire(blocking=False)
    try:
        with pytest.raises(DuplicateTaskError) as info:
            job.apply(args=(1,), task_id="DUPLICATE-ID").get()
        assert info.value.holder_task_id == "HOLDER-ID"
    finally:
        holder.release()


def test_eager_no_quorum_names_the_nodes_and_waits_for_nothing(app: Celery, caplog: pytest.LogCaptureFixture) -> None:
    """Eager mode with no lock node answering: LockUnavailableError naming the node's error, and no "waits" line."""
    from celery_singleton_lock import LockUnavailableError  # noqa: PLC0415
    from celery_singleton_lock.testing import free_port  # noqa: PLC0415

    app.conf.singleton_lock_urls = [f"redis://127.0.0.1:{free_port()}/0"]

    @app.task(base=LockedTask, shared=False)
    def job(n: int) -> int:
        return n

    with pytest.raises(LockUnavailableError) as info:
        job.apply(args=(1,)).get()
    assert info.value.node_errors
    assert "waits" not in caplog.text


class _Stamping(Task):  # type: ignore[misc]
    """A user's own base class with the common ``apply_async(args, kwargs, **options)`` signature."""

    def apply_async(self, args: Any = None, kwargs: Any = None, **options: Any) -> Any:
        headers = dict(options.pop("headers", None) or {})
        headers["stamped"] = "1"
        return super().apply_async(args, kwargs, headers=headers, **options)


class _LockedStamping(LockedTask, _Stamping):  # type: ignore[misc]
    """LockedTask first in the MRO: its apply_async calls the user's base class next."""


def test_a_base_class_after_lockedtask_in_the_mro_gets_apply_async_s_options_by_name(app: Celery) -> None:
    """apply_async() of a task whose bases are (LockedTask, a Task subclass with apply_async(args, kwargs,
    **options)) sends the message through the user's base: LockedTask passes task_id, producer, link, ... on by name
    (a positional call raised TypeError, which also broke the worker's re-sends of a rescheduled duplicate and
    self.retry())."""

    @app.task(shared=False, base=_LockedStamping, bind=True)
    def job(self: Any, n: int) -> int:
        return n  # pragma: no cover - never runs here

    queue = f"stamped-{uuid.uuid4().hex[:8]}"  # kombu's memory transport is one per process: a queue of our own
    sent = job.apply_async((1,), task_id="stamped-1", queue=queue)
    assert sent.id == "stamped-1"
    with app.connection_for_read() as conn:
        message = conn.SimpleQueue(queue, no_ack=True).get(timeout=5)
    assert message.headers["id"] == "stamped-1"
    assert message.headers["stamped"] == "1"
