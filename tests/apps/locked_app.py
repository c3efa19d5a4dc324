"""The Celery app the LockedTask tests run in real worker processes.

Configured from the environment (the test writes it): CSL_BROKER, CSL_LOCK_URLS (comma-separated), CSL_RECORD
(a Redis URL where runs are recorded), CSL_TTL. Every run records ``[key, task_id, pid, start, end]`` so the test
can check, after the fact, that no two runs of one key overlapped in time.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import redis
from celery import Celery

from celery_singleton_lock import LockedTask

app = Celery("locked_app", broker=os.environ["CSL_BROKER"], backend=os.environ["CSL_BROKER"].rsplit("/", 1)[0] + "/1")
app.conf.update(
    singleton_lock_urls=os.environ["CSL_LOCK_URLS"].split(","),
    singleton_lock_ttl=float(os.environ.get("CSL_TTL", "5")),
    singleton_lock_retry_delay=0.5,
    singleton_lock_retry_max_delay=2.0,
    task_acks_late=True,
    task_reject_on_worker_lost=True,
    worker_prefetch_multiplier=1,
    broker_connection_retry_on_startup=True,
    broker_transport_options={"visibility_timeout": float(os.environ.get("CSL_VISIBILITY", "3600"))},
    result_expires=600,
    worker_max_tasks_per_child=int(os.environ.get("CSL_MAX_TASKS_PER_CHILD", "0")) or None,
)
record = redis.Redis.from_url(os.environ["CSL_RECORD"])


def _run(task: Any, key: str, duration: float) -> None:
    start = time.time()
    record.rpush("started", json.dumps([key, task.request.id, os.getpid(), start]))
    end_by = time.monotonic() + duration
    while time.monotonic() < end_by:  # bounded by duration
        time.sleep(min(0.05, max(0.0, end_by - time.monotonic())))
    record.rpush("runs", json.dumps([key, task.request.id, os.getpid(), start, time.time()]))


@app.task(base=LockedTask, bind=True, lock_unique_on=["key"])
def work(self: Any, key: str, duration: float = 0.0, fail: bool = False) -> str:
    """Hold ``key`` for ``duration`` seconds, record the run, optionally fail."""
    _run(self, key, duration)
    if fail:
        raise RuntimeError("failing on purpose")
    return key


@app.task(base=LockedTask, bind=True, lock_ttl=0.6, lock_unique_on=["key"])
def long_work(self: Any, key: str, duration: float) -> list[bool]:
    """Run 10x past a short ttl, checking the lock at every step."""
    held = []
    start = time.time()
    record.rpush("started", json.dumps([key, self.request.id, os.getpid(), start]))
    end_by = time.monotonic() + duration
    while time.monotonic() < end_by:
        held.append(self.lock_held())
        time.sleep(0.1)
    record.rpush("runs", json.dumps([key, self.request.id, os.getpid(), start, time.time()]))
    return [all(held), self.fencing_token is not None]


@app.task(base=LockedTask, bind=True, max_retries=3, lock_unique_on=["key"])
def flaky(self: Any, key: str, failures: int, countdown: float) -> int:
    """Retry ``failures`` times with ``countdown``, then succeed."""
    _run(self, key, 0.1)
    if self.request.retries < failures:
        raise self.retry(countdown=countdown)
    return self.request.retries


@app.task(base=LockedTask, bind=True, soft_time_limit=1.0, time_limit=2.0, lock_unique_on=["key"])
def overrun(self: Any, key: str, duration: float, ignore_soft: bool = False) -> None:
    """Run past the time limits (soft: SoftTimeLimitExceeded unless swallowed; hard: the child is killed)."""
    from celery.exceptions import SoftTimeLimitExceeded  # noqa: PLC0415

    try:
        _run(self, key, duration)
    except SoftTimeLimitExceeded:
        if not ignore_soft:
            raise
        _run(self, key, duration)


@app.task(base=LockedTask, bind=True)
def echo(self: Any, account_id: int, month: str = "current") -> int:
    """Defaults and keyword calls map to one key."""
    _run(self, f"echo:{account_id}:{month}", 0.5)
    return account_id
