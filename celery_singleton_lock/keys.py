"""Kept for the code that imports this path: the module is ``celery_singleton_lock.lock.keys``."""

from .lock.keys import (
    canonical,
    lock_key,
)

__all__ = [
    "canonical",
    "lock_key",
]
