"""Tasks for tests/test_review_core.py, added to ``locked_app``'s app (same env, same run records).

A worker started with ``-A review_core_app`` runs these and every ``locked_app`` task.
"""

from __future__ import annotations

import os
from typing import Any

from celery.exceptions import Reject
from kombu import Exchange, Queue
from locked_app import _run, app, record

from celery_singleton_lock import LockedTask

if os.environ.get("CSL_DLX"):
    # RabbitMQ's dead-letter retry (Celery's docs on Reject): a message rejected without requeue from the main queue
    # waits 1 s in a retry queue, then is dead-lettered back to the main queue, the same message again.
    main, retry = os.environ["CSL_DLX"], os.environ["CSL_DLX"] + ".retry"
    app.conf.task_queues = [
        Queue(main, Exchange(main), routing_key=main, queue_arguments={
            "x-dead-letter-exchange": retry, "x-dead-letter-routing-key": retry}),
        Queue(retry, Exchange(retry), routing_key=retry, queue_arguments={
            "x-message-ttl": 1000, "x-dead-letter-exchange": main, "x-dead-letter-routing-key": main}),
    ]  # fmt: skip
    app.conf.task_default_queue = main


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
