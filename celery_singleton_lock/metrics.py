"""Kept for the code that imports this path: the module is ``celery_singleton_lock.lock.metrics``."""

from .lock.metrics import (
    KEEP,
    MARK_TTL,
    OUTCOMES,
    WAIT_MS,
    WAITS,
    MetricsReport,
    Outbox,
    minute_key,
    parse_since,
    read_metrics,
    read_minutes,
    total_key,
    write,
)

__all__ = [
    "KEEP",
    "MARK_TTL",
    "OUTCOMES",
    "WAITS",
    "WAIT_MS",
    "MetricsReport",
    "Outbox",
    "minute_key",
    "parse_since",
    "read_metrics",
    "read_minutes",
    "total_key",
    "write",
]
