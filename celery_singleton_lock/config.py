"""Kept for the code that imports this path: the module is ``celery_singleton_lock.lock.config``."""

from .lock.config import (
    DEFAULT_TTL,
    DuplicatePolicy,
    LockSettings,
    LostPolicy,
    UnavailablePolicy,
    settings_for,
)

__all__ = [
    "DEFAULT_TTL",
    "DuplicatePolicy",
    "LockSettings",
    "LostPolicy",
    "UnavailablePolicy",
    "settings_for",
]
