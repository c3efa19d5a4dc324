"""Kept for the code that imports this path: the module is ``celery_singleton_lock.lock.renewal``."""

from .lock.renewal import (
    Lease,
    Renewable,
    Watchdog,
    flush_stats,
    start_liveness,
    watchdog,
)

__all__ = [
    "Lease",
    "Renewable",
    "Watchdog",
    "flush_stats",
    "start_liveness",
    "watchdog",
]
