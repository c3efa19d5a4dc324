"""Kept for the code that imports this path: the module is ``celery_singleton_lock.ops.health``."""

from .ops.health import (
    DEFAULT_GRACE,
    Liveness,
    Readiness,
    liveness,
    readiness,
    route,
    write_heartbeat,
)

__all__ = [
    "DEFAULT_GRACE",
    "Liveness",
    "Readiness",
    "liveness",
    "readiness",
    "route",
    "write_heartbeat",
]
