"""Kept for the code that imports this path: the module is ``celery_singleton_lock.policies.facts``."""

from .policies.facts import (
    Act,
    Decision,
    Facts,
    Outcome,
    defer,
)

__all__ = [
    "Act",
    "Decision",
    "Facts",
    "Outcome",
    "defer",
]
