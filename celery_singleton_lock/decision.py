"""Kept for the code that imports this path: the module is ``celery_singleton_lock.policies.decision``."""

from .policies.decision import (
    COOLDOWN,
    ENDING,
    HANDED,
    HANDOVER,
    QUEUED,
    RUNNING,
    SENDING,
    SPLIT_RETRIES,
    Act,
    Decision,
    Facts,
    Outcome,
    decide,
)

__all__ = [
    "COOLDOWN",
    "ENDING",
    "HANDED",
    "HANDOVER",
    "QUEUED",
    "RUNNING",
    "SENDING",
    "SPLIT_RETRIES",
    "Act",
    "Decision",
    "Facts",
    "Outcome",
    "decide",
]
