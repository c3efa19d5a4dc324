"""Kept for the code that imports this path: the module is ``celery_singleton_lock.task.beat``."""

from typing import Any

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


def __getattr__(name: str) -> Any:
    """What the module builds on first use (``SingletonDatabaseScheduler``, for ``beat -S
    celery_singleton_lock.beat:SingletonDatabaseScheduler``), from ``celery_singleton_lock.task.beat``."""
    from .task import beat  # noqa: PLC0415 - only when asked: it may need django-celery-beat

    return getattr(beat, name)
