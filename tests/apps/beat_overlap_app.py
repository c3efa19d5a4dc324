"""A beat schedule whose job (2.5 s) is longer than its interval (1 s), under LockedTask.

Configured from the environment: CSL_BROKER, CSL_LOCK_URLS, CSL_RECORD (where runs are recorded), and CSL_SCOPE:
``run`` (default) schedules ``slow_tick``, ``queue`` schedules ``queued_tick`` (the same job under queue scope).
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import redis
from celery import Celery

from celery_singleton_lock import LockedTask

app = Celery("beat_overlap_app", broker=os.environ["CSL_BROKER"])
app.conf.update(
    singleton_lock_urls=os.environ["CSL_LOCK_URLS"].split(","),
    singleton_lock_ttl=5,
    broker_connection_retry_on_startup=True,
    beat_schedule={
        "slow-tick": {
            "task": "beat_overlap_app.queued_tick"
            if os.environ.get("CSL_SCOPE") == "queue"
            else "beat_overlap_app.slow_tick",
            "schedule": 1.0,
        }
    },
    beat_max_loop_interval=0.2,
)
record = redis.Redis.from_url(os.environ["CSL_RECORD"])


@app.task(shared=False, base=LockedTask, bind=True)
def slow_tick(self: Any) -> None:
    """Takes 2.5 s: the next two ticks arrive while it runs and must be skipped."""
    start = time.time()
    time.sleep(2.5)
    record.rpush("runs", json.dumps([self.request.id, start, time.time()]))


@app.task(shared=False, base=LockedTask, bind=True, lock_scope="queue")
def queued_tick(self: Any) -> None:
    """The same 2.5 s job under queue scope: beat's ticks while it is queued or running publish nothing."""
    start = time.time()
    time.sleep(2.5)
    record.rpush("runs", json.dumps([self.request.id, start, time.time()]))
