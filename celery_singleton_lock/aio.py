"""Kept for the code that imports this path: the module is ``celery_singleton_lock.lock.aio``."""

from .lock.aio import (
    AsyncNodes,
    AsyncRedlock,
    aclose,
)

__all__ = [
    "AsyncNodes",
    "AsyncRedlock",
    "aclose",
]
