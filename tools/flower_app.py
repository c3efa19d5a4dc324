"""The Celery app that ``tools/flower_screenshot.py`` and ``tests/ops/test_flower.py`` run in real workers and in
Flower.

Configured from the environment, which they write: FLOWER_DEMO_BROKER (a RabbitMQ or Redis broker URL) and
FLOWER_DEMO_LOCK_URLS (comma-separated lock node URLs). No result backend: Flower builds its task list from Celery
events alone (the workers run with ``-E``).

Three tasks, one per ``lock_on_duplicate`` policy a monitor tells apart:

* ``charge(order_id)``: the default ``skip``; a run holds its order for ``CHARGE_SECONDS``, so a duplicate that
  arrives meanwhile is skipped (``task-revoked``, REVOKED in Flower);
* ``restock(sku)``: ``reschedule``; a duplicate is re-sent to run after the holder (``task-retried``, RETRY, then the
  copy's own RECEIVED / STARTED / SUCCESS under the same task id);
* ``refund(order_id)``: ``fail``; a duplicate raises DuplicateTaskError (``task-failed``, FAILURE).
"""

from __future__ import annotations

import os
import time

from celery import Celery

from celery_singleton_lock import LockedTask

CHARGE_SECONDS = 3.0
RESTOCK_SECONDS = 1.5

app = Celery("flower_app", broker=os.environ["FLOWER_DEMO_BROKER"])
app.conf.update(
    singleton_lock_urls=os.environ["FLOWER_DEMO_LOCK_URLS"].split(","),
    singleton_lock_ttl=5.0,
    # A worker takes a message only when a pool process is free (late acks keep a running task's message counted
    # against the prefetch window): a duplicate then starts at once, while its holder still runs, and is skipped.
    task_acks_late=True,
    worker_prefetch_multiplier=1,
    broker_connection_retry_on_startup=True,
    task_ignore_result=True,
)


@app.task(name="charge", base=LockedTask, lock_unique_on=["order_id"])
def charge(order_id: str) -> str:
    """Charge an order: one run per order at a time; duplicates are skipped."""
    time.sleep(CHARGE_SECONDS)
    return f"charged {order_id}"


@app.task(name="restock", base=LockedTask, lock_unique_on=["sku"], lock_on_duplicate="reschedule")
def restock(sku: str) -> str:
    """Restock an item: every call runs, one at a time; a duplicate is re-sent to run after the holder."""
    time.sleep(RESTOCK_SECONDS)
    return f"restocked {sku}"


@app.task(name="refund", base=LockedTask, lock_unique_on=["order_id"], lock_on_duplicate="fail")
def refund(order_id: str) -> str:
    """Refund an order: a duplicate while one runs is an error (DuplicateTaskError)."""
    time.sleep(CHARGE_SECONDS)
    return f"refunded {order_id}"
