"""Kept for the code that imports this path: the module is ``celery_singleton_lock.ops.explain``."""

from .ops.explain import (
    Explanation,
    explain,
    explain_key,
    explanation_facts,
    format_explanation,
    lock_of_key,
)

__all__ = [
    "Explanation",
    "explain",
    "explain_key",
    "explanation_facts",
    "format_explanation",
    "lock_of_key",
]
