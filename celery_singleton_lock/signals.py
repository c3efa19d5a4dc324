"""Kept for the code that imports this path: the module is ``celery_singleton_lock.task.signals``."""

from .task.signals import (
    Receivers,
    call_joined,
    delivery_skipped,
    duplicate_skipped,
    lock_acquired,
    lock_lost,
    lock_released,
    lock_unavailable,
    lock_waiting,
    rate_limited,
)

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
