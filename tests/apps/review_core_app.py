"""Tasks for tests/task/test_copies.py, added to ``locked_app``'s app (same env, same run records).

A worker started with ``-A review_core_app`` runs these and every ``locked_app`` task.
"""

from __future__ import annotations

import os
from typing import Any

from celery.exceptions import Reject
from dlx_queues import dlx_queues
from locked_app import _run, app, record

from celery_singleton_lock import LockedTask

if os.environ.get("CSL_DLX"):
    app.conf.task_queues = dlx_queues(os.environ["CSL_DLX"])
    app.conf.task_default_queue = os.environ["CSL_DLX"]


@app.task(shared=False, base=LockedTask, bind=True, lock_unique_on=["key"], lock_scope="queue", time_limit=1.0)
def q_limited(self: Any, key: str, duration: float = 0.0) -> str:
    """Queue scope with a 1 s hard time limit: a run longer than that is killed (FAILURE, TimeLimitExceeded)."""
    _run(self, key, duration)
    return key


@app.task(shared=False, base=LockedTask, bind=True, lock_unique_on=["key"], acks_late=True)
def reject_once(self: Any, key: str) -> str:
    """Run; the first run rejects its message without requeue (RabbitMQ dead-letters it), a later run succeeds."""
    _run(self, key, 0.0)
    if record.incr(f"reject_once:{key}") == 1:
        raise Reject("dead-letter me: retried through the dead-letter exchange", requeue=False)
    return key
