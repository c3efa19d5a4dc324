"""locked_app plus the few tasks tests/testing/test_promises_e2e.py needs (configured from the same environment).

Importing locked_app registers its tasks on the same app; the worker runs ``-A promises_app``.
"""

from __future__ import annotations

from typing import Any

from locked_app import _run, app, record

from celery_singleton_lock import LockedTask

__all__ = ["app"]


@app.task(shared=False)
def mark(tag: str) -> str:
    """A link, errback or chain member that only records that it ran."""
    record.rpush("marks", tag)
    return tag


@app.task(shared=False, base=LockedTask, bind=True, lock_unique_on=["key"], lock_on_duplicate="fail")
def work_fail(self: Any, key: str, duration: float = 0.0) -> str:
    """Run scope, lock_on_duplicate="fail": a duplicate ends in FAILURE (DuplicateTaskError)."""
    _run(self, key, duration)
    return key


@app.task(shared=False, base=LockedTask, bind=True, lock_unique_on=["key"], lock_scope="queue", lock_queue_ttl=1.0)
def q_short(self: Any, key: str, duration: float = 0.0) -> str:
    """Queue scope whose reservation waits only 1 s for its message to start (lock_queue_ttl=1)."""
    _run(self, key, duration)
    return key
