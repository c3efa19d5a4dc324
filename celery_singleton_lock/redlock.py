"""Kept for the code that imports this path: the module is ``celery_singleton_lock.lock.redlock``."""

from .lock.redlock import (
    NodeSet,
    Redlock,
    done_key_for,
    fence_key_for,
    record_of,
    redact_url,
    sibling_key,
    slot_keys,
)

__all__ = [
    "NodeSet",
    "Redlock",
    "done_key_for",
    "fence_key_for",
    "record_of",
    "redact_url",
    "sibling_key",
    "slot_keys",
]
