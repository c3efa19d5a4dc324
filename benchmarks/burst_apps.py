"""The Celery app that ``bench_burst.py`` runs in its client and in real worker processes.

Configured from the environment: ``BURST_BROKER``, ``BURST_BACKEND``, ``BURST_LOCK_URL`` (one lock node, for us and
the peers alike) and ``BURST_RECORD`` (where each body records its run). Every task has the same body: sleep
``duration`` s, record ``[start, end]`` under ``burst:runs:<key>``, return ``key``; results are stored so a caller
can ``get()`` them.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import redis
from celery import Celery
from celery_once import QueueOnce
from celery_singleton import Singleton

from celery_singleton_lock import LockedTask

LOCK_URL = os.environ["BURST_LOCK_URL"]
app = Celery("burst_apps", broker=os.environ["BURST_BROKER"], backend=os.environ["BURST_BACKEND"])
app.conf.update(
    singleton_lock_urls=[LOCK_URL],
    ONCE={"backend": "celery_once.backends.Redis", "settings": {"url": LOCK_URL, "default_timeout": 3600}},
    singleton_backend_url=LOCK_URL,
    broker_connection_retry_on_startup=True,
    worker_prefetch_multiplier=1,
    result_expires=3600,
)
record = redis.Redis.from_url(os.environ["BURST_RECORD"])


def _body(key: str, duration: float) -> str:
    start = time.time()
    if duration:
        time.sleep(duration)
    record.rpush(f"burst:runs:{key}", json.dumps([start, time.time()]))
    return key


@app.task(name="burst.plain")
def plain(key: str, duration: float) -> str:
    """Plain ``celery.Task``: every call runs."""
    return _body(key, duration)


@app.task(base=LockedTask, name="burst.run_scope")
def run_scope(key: str, duration: float) -> str:
    """LockedTask, default run scope: never two at once; a duplicate delivered while one runs is skipped."""
    return _body(key, duration)


@app.task(base=LockedTask, name="burst.queue_scope", lock_scope="queue")
def queue_scope(key: str, duration: float) -> str:
    """LockedTask, queue scope: a duplicate call while the job is queued or running sends nothing."""
    return _body(key, duration)


@app.task(base=QueueOnce, name="burst.once", once={"graceful": True})
def once(key: str, duration: float) -> str:
    """celery-once ``QueueOnce`` (graceful: a duplicate call returns an empty result instead of raising)."""
    return _body(key, duration)


@app.task(base=Singleton, name="burst.singleton")
def singleton(key: str, duration: float) -> str:
    """celery-singleton ``Singleton``: a duplicate call returns the queued job's AsyncResult."""
    return _body(key, duration)


@app.task(base=LockedTask, name="burst.limited", lock_limit=4, lock_on_duplicate="reschedule", lock_unique_on=["key"])
def limited(key: str, duration: float, n: int) -> str:
    """LockedTask with ``lock_limit=4``: up to 4 runs of ``key`` at once; the others wait in line."""
    return _body(key, duration)


@app.task(name="burst.unlimited")
def unlimited(key: str, duration: float, n: int) -> str:
    """Plain ``celery.Task``, the limit's reference: as many at once as the worker has processes."""
    return _body(key, duration)


TASKS: dict[str, Any] = {
    "plain": plain,
    "ours, run scope": run_scope,
    "ours, queue scope": queue_scope,
    "celery-once": once,
    "celery-singleton": singleton,
}
