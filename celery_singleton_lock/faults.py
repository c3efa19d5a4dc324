"""Kept for the code that imports this path: the module is ``celery_singleton_lock.testing.faults``."""

from .testing.faults import (
    ConnectionInfo,
    Fault,
    FaultProxy,
    ProxyStats,
)

__all__ = [
    "ConnectionInfo",
    "Fault",
    "FaultProxy",
    "ProxyStats",
]
