"""Regressions found reviewing the move of LockedTask's code into rooms (b253139): behaviour the old task.py had."""

from __future__ import annotations

import uuid
from typing import Any

from celery import Celery, Task

from celery_singleton_lock import LockedTask


class _Stamping(Task):  # type: ignore[misc]
    """A user's own base class with the common ``apply_async(args, kwargs, **options)`` signature."""

    def apply_async(self, args: Any = None, kwargs: Any = None, **options: Any) -> Any:
        headers = dict(options.pop("headers", None) or {})
        headers["stamped"] = "1"
        return super().apply_async(args, kwargs, headers=headers, **options)


class _LockedStamping(LockedTask, _Stamping):  # type: ignore[misc]
    """LockedTask first in the MRO: its apply_async calls the user's base class next."""


def test_a_base_class_after_lockedtask_in_the_mro_gets_apply_async_s_options_by_name(app: Celery) -> None:
    """delay() of a task whose bases are (LockedTask, a Task subclass with apply_async(args, kwargs, **options))
    sends the message: LockedTask passes task_id, producer, link, ... on by name (a positional call raised
    TypeError, which also broke the worker's re-sends of a rescheduled duplicate and self.retry())."""

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
