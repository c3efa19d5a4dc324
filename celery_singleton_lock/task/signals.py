"""Celery-style signals sent by LockedTask and the renewal watchdog.

Connect as with Celery's own signals; every signal is sent with the task (or None) as ``sender``::

    from celery_singleton_lock import signals

    @signals.duplicate_skipped.connect
    def count_skip(sender, key, task_id, holder_task_id, policy, **kwargs):
        SKIPPED.labels(sender.name).inc()

Handlers run in the worker's pool process, in the task's thread (``lock_lost``: in the watchdog thread;
``duplicate_skipped`` of a duplicate skipped before the pool: in the worker's main process). A handler
that raises is logged by Celery and does not affect the lock.

================== ==================================================================================
signal             arguments (besides ``sender``)
================== ==================================================================================
lock_acquired      key, task_id, fencing_token
duplicate_skipped  key, task_id, holder_task_id, policy ("skip", "fail", "reschedule"; "enqueue": not sent);
                   ``request`` too (the worker's Request) when skipped before the pool
call_joined        key, task_id, holder_task_id: a call at ``delay()`` whose own task id is already queued,
                   running or done (queue scope): nothing was sent, its caller waits on that job
delivery_skipped   key, task_id, kind, holder_task_id: a delivery in a pool that did not run the body and ends as
                   a success in Celery's tracer (``Skipped.kind``: duplicate, deferred, waiting, done, settled);
                   sent after the decision's own signal, if it has one (done and settled have none)
rate_limited       key (the rate's key), task_id, rate, policy (``lock_on_rate_limit``): once per delivery held
                   back by its rate (a re-sent copy that asks again sends it again)
lock_waiting       key, task_id, countdown, reason ("redelivered" / "unavailable")
lock_unavailable   key, task_id, policy ("retry", "fail" or "run"), errors (redacted node errors)
lock_lost          key, task_id, reason
lock_released      key, task_id, held (True if the lock was still ours when released)
================== ==================================================================================
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from typing import Any

from celery.utils.dispatch import Signal

__all__ = [
    "Receivers",
    "call_joined",
    "delivery_skipped",
    "duplicate_skipped",
    "lock_acquired",
    "lock_lost",
    "lock_released",
    "lock_unavailable",
    "lock_waiting",
    "rate_limited",
]

lock_acquired = Signal(name="lock_acquired", providing_args={"key", "task_id", "fencing_token"})
duplicate_skipped = Signal(name="duplicate_skipped", providing_args={"key", "task_id", "holder_task_id", "policy"})
lock_waiting = Signal(name="lock_waiting", providing_args={"key", "task_id", "countdown", "reason"})
lock_unavailable = Signal(name="lock_unavailable", providing_args={"key", "task_id", "policy", "errors"})
lock_lost = Signal(name="lock_lost", providing_args={"key", "task_id", "reason"})
call_joined = Signal(name="call_joined", providing_args={"key", "task_id", "holder_task_id"})
delivery_skipped = Signal(name="delivery_skipped", providing_args={"key", "task_id", "kind", "holder_task_id"})
rate_limited = Signal(name="rate_limited", providing_args={"key", "task_id", "rate", "policy"})
lock_released = Signal(name="lock_released", providing_args={"key", "task_id", "held"})


class Receivers:
    """Receivers an instrumentation connects together and disconnects together (``otel``, ``sentry``): connected
    once however often it is switched on, and gone at once when switched off."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._connected: list[tuple[Signal, Callable[..., Any]]] = []

    def connect(self, pairs: Iterable[tuple[Signal, Callable[..., Any]]]) -> None:
        """Connect each (signal, receiver) pair, strongly; nothing when they are connected already."""
        with self._lock:
            if self._connected:
                return
            for signal, receiver in pairs:
                signal.connect(receiver, weak=False)
                self._connected.append((signal, receiver))

    def disconnect(self) -> None:
        """Disconnect every receiver: their signals cost a send with no receivers again."""
        with self._lock:
            while self._connected:
                signal, receiver = self._connected.pop()
                signal.disconnect(receiver)

    def __bool__(self) -> bool:
        return bool(self._connected)
