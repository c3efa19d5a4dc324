"""locked_app plus what tests/task/test_monitoring.py needs (not a test module)."""

from __future__ import annotations

from typing import Any

from locked_app import _run, app, work  # noqa: F401 - the worker imports every locked_app task through this module

from celery_singleton_lock import LockedTask


@app.task(shared=False, base=LockedTask, bind=True, lock_unique_on=["key"], resultrepr_maxsize=64)  # type: ignore[untyped-decorator]
def terse(self: Any, key: str, duration: float = 0.0) -> str:
    """Like locked_app.work, keeping 64 characters of a return value's repr (Celery's Task.resultrepr_maxsize)."""
    _run(self, key, duration)
    return key
