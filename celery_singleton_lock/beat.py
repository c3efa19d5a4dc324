"""Kept for the code that imports this path: the module is ``celery_singleton_lock.task.beat``."""

from .task.beat import (
    MIN_CLAIM_TTL,
    SLOT_HEADER,
    SingletonScheduler,
    SingletonSchedulerMixin,
    Slot,
    claim_ttl,
    slot_for,
)

__all__ = [
    "MIN_CLAIM_TTL",
    "SLOT_HEADER",
    "SingletonScheduler",
    "SingletonSchedulerMixin",
    "Slot",
    "claim_ttl",
    "slot_for",
]
