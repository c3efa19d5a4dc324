"""locked_app plus what tests/task/test_preskip.py needs (not a test module): every tracer run is recorded.

``CSL_SKIP_BEFORE_POOL=0`` turns the pre-check off (``singleton_lock_skip_before_pool``).
"""

from __future__ import annotations

import os
from typing import Any

from celery.signals import task_prerun
from locked_app import app, record, work, work_later  # noqa: F401 - the worker imports locked_app's tasks through this

if "CSL_SKIP_BEFORE_POOL" in os.environ:  # unset: the default (and an older checkout, which has no such setting)
    app.conf.singleton_lock_skip_before_pool = os.environ["CSL_SKIP_BEFORE_POOL"] == "1"


@task_prerun.connect
def _record_traced(task_id: str = "", **_: Any) -> None:
    """Every delivery a pool child's tracer runs (the pre-check skips a duplicate before any of this)."""
    record.rpush("traced", task_id)
