"""Kept for the code that imports this path: the module is ``celery_singleton_lock.lock.interrupt``."""

from .lock.interrupt import (
    INTERRUPT_SIGNAL,
    Target,
    outside_body,
)

__all__ = [
    "INTERRUPT_SIGNAL",
    "Target",
    "outside_body",
]
