"""The app both versions of celery_singleton_lock load in tests/task/test_rolling.py (a rolling upgrade).

Imports only the public API that commit fd86d2e (the last before the package moved into wings) already exported,
so an old worker (the fd86d2e package first on PYTHONPATH) and a new one (this checkout) run the same tasks.
Configured from the environment: CSL_BROKER (also the result backend's and the records' server), CSL_LOCK_URLS,
CSL_TTL, CSL_SIDE (``old``, ``new`` or ``compat``: written into each record), CSL_HAND_ON (``0``: a new
worker with ``singleton_lock_hand_on=False``). Every run records
``[task, key, task_id, side, start, end, extra]`` in the list ``rolling:runs`` (db 2).
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import redis
from celery import Celery

import celery_singleton_lock
from celery_singleton_lock import JobCancelledError, LockedTask

BROKER = os.environ["CSL_BROKER"]
BASE = BROKER.rsplit("/", 1)[0]
SIDE = os.environ.get("CSL_SIDE", "client")
app = Celery("rolling_app", broker=BROKER, backend=BASE + "/1")
app.conf.update(
    singleton_lock_urls=os.environ["CSL_LOCK_URLS"].split(","),
    singleton_lock_ttl=float(os.environ.get("CSL_TTL", "2")),
    singleton_lock_prefix="rolling:",
    singleton_lock_retry_delay=0.2,
    singleton_lock_retry_max_delay=0.5,
    task_acks_late=True,
    worker_prefetch_multiplier=1,
    broker_connection_retry_on_startup=True,
    result_expires=600,
)
if os.environ.get("CSL_HAND_ON") == "0":
    # Only on new workers: fd86d2e refuses a setting it does not know (docs/migration.md, Rolling upgrade).
    app.conf.singleton_lock_hand_on = False
record = redis.Redis.from_url(BASE + "/2")


def _run(name: str, key: str, task_id: str, duration: float, extra: Any = None) -> None:
    start = time.time()
    record.rpush("rolling:started", json.dumps([name, key, task_id, SIDE, start]))
    end_by = time.monotonic() + duration
    for _ in range(int(duration / 0.02) + 2):  # bounded by count and by duration
        if time.monotonic() >= end_by:
            break
        time.sleep(min(0.02, max(0.0, end_by - time.monotonic())))
    record.rpush("rolling:runs", json.dumps([name, key, task_id, SIDE, start, time.time(), extra]))


@app.task(shared=False)
def where() -> list[str]:
    """Which package this worker imported, and the side it was told it is."""
    return [celery_singleton_lock.__file__ or "", SIDE]


@app.task(shared=False)
def relay(task: str, args: list[Any], options: dict[str, Any]) -> str:
    """Send ``task`` from this worker (its version of the package does the send-side work: debounce, queue scope)."""
    return str(app.tasks[task].apply_async(tuple(args), **options).id)


@app.task(shared=False, base=LockedTask, bind=True, lock_unique_on=["key"])
def hold(self: Any, key: str, duration: float) -> str:
    """Skip (the default): a duplicate of a running key is REVOKED."""
    _run("hold", key, self.request.id, duration)
    return SIDE


@app.task(shared=False, base=LockedTask, bind=True, lock_unique_on=["key"], lock_on_duplicate="reschedule")
def later(self: Any, key: str, duration: float) -> str:
    """Reschedule: a duplicate waits in the key's line and runs after the holder."""
    _run("later", key, self.request.id, duration)
    return SIDE


@app.task(shared=False, base=LockedTask, bind=True, lock_unique_on=["key"], lock_limit=2)
def limited(self: Any, key: str, n: int, duration: float) -> str:
    """At most two runs of ``key`` at once; the others skipped."""
    _run("limited", key, self.request.id, duration, n)
    return SIDE


@app.task(shared=False, base=LockedTask, bind=True, lock_limit=None, lock_rate=(3, 4.0), lock_rate_on=["key"])
def rated(self: Any, key: str, n: int) -> str:
    """At most 3 starts of ``key`` per 4 s window; the others wait for the window."""
    _run("rated", key, self.request.id, 0.0, n)
    return SIDE


@app.task(shared=False, base=LockedTask, bind=True, lock_unique_on=["key"], lock_debounce=1.0)
def settle(self: Any, key: str, value: int) -> int:
    """A burst runs once, 1 s after its last call, with the last call's arguments."""
    _run("settle", key, self.request.id, 0.0, value)
    return value


@app.task(shared=False, base=LockedTask, bind=True, lock_unique_on=["key"], lock_scope="queue")
def queued(self: Any, key: str, duration: float) -> str:
    """Queue scope: reserved at send; a duplicate send returns the queued or running job."""
    _run("queued", key, self.request.id, duration)
    return SIDE


@app.task(shared=False, base=LockedTask, bind=True, lock_unique_on=["key"], lock_on_duplicate="cancel", lock_ttl=1.5)
def newest(self: Any, key: str, duration: float) -> str:
    """Cancel: a newer call stops the running one and runs after it; the stopped one records its interruption."""
    start = time.time()
    record.rpush("rolling:started", json.dumps(["newest", key, self.request.id, SIDE, start]))
    try:
        end_by = time.monotonic() + duration
        for _ in range(int(duration / 0.02) + 2):  # bounded
            if time.monotonic() >= end_by:
                break
            time.sleep(0.02)
    except JobCancelledError:
        record.rpush("rolling:runs", json.dumps(["newest", key, self.request.id, SIDE, start, time.time(), "cut"]))
        raise
    record.rpush("rolling:runs", json.dumps(["newest", key, self.request.id, SIDE, start, time.time(), "done"]))
    return SIDE
