"""Kept for the code that imports this path: the module is ``celery_singleton_lock.task.otel``."""

from .task.otel import (
    NS,
    instrument,
    instrumented,
    key_digest,
    uninstrument,
)

__all__ = [
    "NS",
    "instrument",
    "instrumented",
    "key_digest",
    "uninstrument",
]
