"""The demo's Celery app: a payment, a report rebuild and a thumbnail job, all ``base=LockedTask``.

Configured from the environment by ``examples/demo.py`` (DEMO_BROKER, DEMO_LOCK_URLS). Every run and every
skipped duplicate is written to a Redis list (``demo:events``) so the demo can print a timeline afterwards.
"""

from __future__ import annotations

import json
import os
import socket
import time
from typing import Any

import redis
from celery import Celery

from celery_singleton_lock import LockedTask, signals

app = Celery("demo", broker=os.environ["DEMO_BROKER"], backend=os.environ["DEMO_BROKER"].rsplit("/", 1)[0] + "/1")
app.conf.update(
    singleton_lock_urls=os.environ["DEMO_LOCK_URLS"].split(","),  # three independent nodes: a Redlock
    singleton_lock_ttl=10,
    task_acks_late=True,
    task_reject_on_worker_lost=True,
    worker_prefetch_multiplier=1,
    broker_connection_retry_on_startup=True,
)
events = redis.Redis.from_url(os.environ["DEMO_BROKER"].rsplit("/", 1)[0] + "/2")
WORKER = f"{os.environ.get('DEMO_WORKER', 'worker')}/pid {os.getpid()}@{socket.gethostname()}"


def log_event(kind: str, task: Any, **extra: Any) -> None:
    events.rpush(
        "demo:events",
        json.dumps(
            {"t": time.time(), "kind": kind, "task": task.name, "id": task.request.id, "worker": WORKER, **extra}
        ),
    )


@signals.duplicate_skipped.connect
def _skipped(sender: Any, key: str, task_id: str, holder_task_id: str, policy: str, **_: Any) -> None:
    events.rpush(
        "demo:events",
        json.dumps(
            {"t": time.time(), "kind": "skipped", "task": sender.name, "id": task_id, "worker": WORKER,
             "holder": holder_task_id, "policy": policy}
        ),
    )  # fmt: skip


@app.task(base=LockedTask, bind=True, lock_ttl=10)
def charge(self: Any, order_id: int, amount_cents: int) -> str:
    """Charge an order once, however many times the button was clicked."""
    log_event("start", self, args=[order_id, amount_cents], fencing_token=self.fencing_token)
    time.sleep(1.0)  # talking to the payment provider
    log_event("end", self, args=[order_id, amount_cents])
    return f"charged order {order_id}: {amount_cents / 100:.2f}"


@app.task(base=LockedTask, bind=True, lock_ttl=2)
def rebuild_report(self: Any, account_id: int, month: str = "current") -> str:
    """A slow rebuild (3 s) with a short 2 s ttl: the watchdog renews the lock while it runs."""
    log_event("start", self, args=[account_id, month], fencing_token=self.fencing_token)
    time.sleep(3.0)
    log_event("end", self, args=[account_id, month], lock_held=self.lock_held())
    return f"report {account_id}/{month} rebuilt"


@app.task(base=LockedTask, bind=True)
def thumbnail(self: Any, image: str) -> str:
    """Different images are different jobs: they run side by side."""
    log_event("start", self, args=[image])
    time.sleep(0.5)
    log_event("end", self, args=[image])
    return image
