"""Kept for the code that imports this path: the module is ``celery_singleton_lock.lock.nodes``."""

from .lock.nodes import (
    IDLE_MAX,
    NodeError,
    NodeSet,
    Request,
    Steps,
    Undo,
    current_pid,
)

__all__ = [
    "IDLE_MAX",
    "NodeError",
    "NodeSet",
    "Request",
    "Steps",
    "Undo",
    "current_pid",
]
