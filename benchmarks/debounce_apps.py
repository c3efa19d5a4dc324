"""The Celery app that ``bench_debounce.py`` runs in its client and in a real worker.

Configured from the environment: ``BURST_BROKER``, ``BURST_BACKEND``, ``BURST_LOCK_URL`` (one lock node) and
``BURST_RECORD`` (where each body records its run under ``burst:runs:<key>``). Bodies return their ``version``.
"""

from __future__ import annotations

import json
import os
import time

import redis
from celery import Celery, signals

from celery_singleton_lock import LockedTask

app = Celery("debounce_apps", broker=os.environ["BURST_BROKER"], backend=os.environ["BURST_BACKEND"])
app.conf.update(
    singleton_lock_urls=[os.environ["BURST_LOCK_URL"]],
    broker_connection_retry_on_startup=True,
    worker_prefetch_multiplier=1,
    result_expires=3600,
)
record = redis.Redis.from_url(os.environ["BURST_RECORD"])


@signals.task_received.connect
def _delivered(request: object = None, **_: object) -> None:
    """In the worker: every message of a burst task it receives (the broker's deliveries, re-sent copies included),
    counted per key under ``burst:delivered:<key>``."""
    if str(getattr(request, "name", "")).startswith("burst."):
        args = getattr(request, "args", None) or ()
        if args:
            record.incr(f"burst:delivered:{args[0]}")


def _body(key: str, version: int) -> int:
    start = time.time()
    record.rpush(f"burst:runs:{key}", json.dumps([start, time.time()]))
    return version


@app.task(base=LockedTask, name="burst.queue_keyed", lock_scope="queue", lock_unique_on=["key"])
def queue_keyed(key: str, duration: float, version: int) -> int:
    """Queue scope keyed on ``key``: a call while the job is queued or running sends nothing (and gets that job,
    which runs its first call's ``version``)."""
    return _body(key, version)


@app.task(base=LockedTask, name="burst.debounced", lock_debounce=1, lock_unique_on=["key"])
def debounced(key: str, duration: float, version: int) -> int:
    """``lock_debounce=1`` keyed on ``key``: a burst runs once, 1 s after its last call, with its last ``version``."""
    return _body(key, version)
