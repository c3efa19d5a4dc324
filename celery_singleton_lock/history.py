"""Kept for the code that imports this path: the module is ``celery_singleton_lock.testing.history``."""

from .testing.history import (
    Acquisition,
    FaultInjector,
    History,
    HistoryReport,
    check_history,
    lock_client_main,
    run_lock_client,
)

__all__ = [
    "Acquisition",
    "FaultInjector",
    "History",
    "HistoryReport",
    "check_history",
    "lock_client_main",
    "run_lock_client",
]
