"""Kept for the code that imports this path: the module is ``celery_singleton_lock.lock.lease``."""

from .lock.lease import (
    Fanout,
)

__all__ = [
    "Fanout",
]
