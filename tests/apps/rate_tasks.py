"""``lock_rate`` tasks for tests/test_rate_workers.py, on ``locked_app``'s app (workers import this module with
``-I rate_tasks``; locked_app itself is left alone). Every run records ``[key, task_id, pid, node time of the counted
start, wall start, rate waits, end]`` in the record list ``rate_runs`` (and its start in ``rate_started``)."""

from __future__ import annotations

import json
import os
import time
from typing import Any

from locked_app import app, record

from celery_singleton_lock import LockedTask

STORM_RATE = (10, 1.0)


def _run(task: Any, key: str, duration: float) -> str:
    at = task.rate_started_at
    waits = int(getattr(task.request, "singleton_lock_rate_waits", 0) or 0)
    start = time.time()
    row = [key, task.request.id, os.getpid(), at, start, waits]
    record.rpush("rate_started", json.dumps(row))
    end_by = time.monotonic() + duration
    while time.monotonic() < end_by:  # bounded by duration
        time.sleep(min(0.05, max(0.0, end_by - time.monotonic())))
    record.rpush("rate_runs", json.dumps([*row, time.time()]))
    return key


@app.task(shared=False, base=LockedTask, bind=True, lock_ttl=3, lock_rate=STORM_RATE, lock_rate_on=["key"])
def rated(self: Any, key: str, n: int, duration: float = 0.0) -> str:
    """Each call (``n``) a job of its own; calls of one ``key`` share a rate of 10 per 1 s; over it, they wait."""
    return _run(self, key, duration)


@app.task(shared=False, base=LockedTask, bind=True, lock_limit=None, lock_rate=(3, 1.5), lock_rate_on=["key"])
def rated_unlocked(self: Any, key: str, duration: float = 0.0) -> str:
    """No lock at all (lock_limit=None): equal calls run side by side, but never more than 3 starts per 1.5 s."""
    return _run(self, key, duration)


@app.task(shared=False, base=LockedTask, bind=True, lock_rate="2/m", lock_on_rate_limit="skip", lock_rate_on=["key"])
def rated_skip(self: Any, key: str, n: int) -> str:
    return _run(self, key, 0.0)


@app.task(shared=False, base=LockedTask, bind=True, lock_rate="2/m", lock_on_rate_limit="fail", lock_rate_on=["key"])
def rated_fail(self: Any, key: str, n: int) -> str:
    return _run(self, key, 0.0)


@app.task(shared=False, base=LockedTask, bind=True, lock_rate=(2, 1.0), lock_rate_on=["key"], lock_unique_on=["key"])
def rated_dup(self: Any, key: str, duration: float = 0.0) -> str:
    """One job per key (the lock) and 2 starts per second (the rate): a skipped duplicate uses no share."""
    return _run(self, key, duration)


# -- lock_group: two tasks, one key space (a run of either is a duplicate of the other; one rate for both) ----------


@app.task(shared=False, base=LockedTask, bind=True, lock_group="mailer", lock_unique_on=["domain"], lock_rate=(3, 1.0))
def send_welcome(self: Any, domain: str, duration: float = 0.0) -> str:
    return _run(self, domain, duration)


@app.task(shared=False, base=LockedTask, bind=True, lock_group="mailer", lock_unique_on=["domain"], lock_rate=(3, 1.0))
def send_digest(self: Any, domain: str, duration: float = 0.0) -> str:
    return _run(self, domain, duration)


# -- lock_limit as a function of the call ----------------------------------------------------------------------


def tier_limit(customer: str, duration: float = 0.0, n: int = 0) -> int:
    """Premium customers 2 at once, others 1."""
    return 2 if customer.startswith("premium") else 1


@app.task(shared=False, base=LockedTask, bind=True, lock_limit=tier_limit, lock_unique_on=["customer"])
def per_tier(self: Any, customer: str, duration: float = 0.0, n: int = 0) -> str:
    return _run(self, customer, duration)
