"""Kept for the code that imports this path: the module is ``celery_singleton_lock.task.sentry``."""

from .task.sentry import (
    MONITOR_HEADERS,
    instrument,
    uninstrument,
)

__all__ = [
    "MONITOR_HEADERS",
    "instrument",
    "uninstrument",
]
