"""The Celery app that ``tools/soak.py`` runs in real ``celery worker`` processes (not part of the package).

Configured from the environment, which soak.py writes: SOAK_BROKER, SOAK_BACKEND, SOAK_LOCK_URLS (comma-separated),
SOAK_RECORD (a Redis URL of its own, never faulted), SOAK_TTL, SOAK_VISIBILITY, SOAK_SOCKET_TIMEOUT.

Every delivery that runs the body records, on the record server (RPUSH, JSON):

* ``started``: ``[key, task_id, pid, start, lease_until, fence, retries]`` first thing in the body. ``lease_until``
  is the wall-clock time until which this run's lease is guaranteed by Redlock (the lock's own validity, measured
  from before the acquire was sent, minus clock drift): no other holder can acquire the key before it.
* ``progress`` (a hash, bodies longer than 0.2 s): ``{task_id|start: [now, lease_until]}`` every 0.2 s, the lease
  guaranteed after the watchdog's renewals so far;
* ``ends``: ``[key, task_id, pid, start, end, held, outcome]`` last thing in the body. ``outcome`` is "done",
  "retry" (the body is about to call ``self.retry()``) or "abandoned" (a long body saw its lock lost and stops);
  ``held`` is ``self.lock_held()`` at the end, so a run whose lock was lost while running says it noticed.

The library's signals are recorded too (``lock_waiting`` re-sends, ``lock_lost``, ``lock_released``,
``lock_unavailable``), and Celery's ``task_success`` for deliveries that did not run the body (a ``Skipped``
marker: duplicate, already succeeded, re-sent), so every delivery can be accounted for afterwards.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import redis
from celery import Celery
from celery.signals import task_success

from celery_singleton_lock import LockedTask, Skipped
from celery_singleton_lock.task import signals

app = Celery("soak_app", broker=os.environ["SOAK_BROKER"], backend=os.environ["SOAK_BACKEND"])
_VISIBILITY = float(os.environ.get("SOAK_VISIBILITY", "15"))
app.conf.update(
    singleton_lock_urls=os.environ["SOAK_LOCK_URLS"].split(","),
    singleton_lock_ttl=float(os.environ.get("SOAK_TTL", "3")),
    singleton_lock_socket_timeout=float(os.environ.get("SOAK_SOCKET_TIMEOUT", "0.5")),
    singleton_lock_retry_delay=0.5,
    singleton_lock_retry_max_delay=2.0,
    task_acks_late=True,
    task_reject_on_worker_lost=True,
    worker_prefetch_multiplier=1,
    broker_connection_retry_on_startup=True,
    broker_transport_options={
        "visibility_timeout": _VISIBILITY,
        # Sweep for unacked messages every second (kombu's default is every 100 s), so a message of a killed worker
        # comes back within about visibility_timeout + 1 s.
        "unacked_restore_interval": 1,
        "unacked_restore_throttle": 1,
    },
    result_expires=24 * 3600,
)
record = redis.Redis.from_url(os.environ["SOAK_RECORD"], socket_timeout=10)


def _push(name: str, row: list[Any]) -> None:
    record.rpush(name, json.dumps(row))


@app.task(base=LockedTask, bind=True, max_retries=3, lock_unique_on=["key"])
def job(self: Any, key: str, duration: float, retry_countdown: float = 0.0) -> str:
    """Hold ``key`` for ``duration`` seconds; with ``retry_countdown`` > 0, retry once after that many seconds."""
    start = time.time()
    run = self.request.__dict__.get("_singleton_lock")  # the delivery's lock state (see LockedTask)
    lock = getattr(run, "lock", None)
    lease_until = start + lock.validity if lock is not None else None
    retries = int(self.request.retries or 0)
    _push("started", [key, self.request.id, os.getpid(), start, lease_until, self.fencing_token, retries])
    end_by = time.monotonic() + duration
    next_progress = time.monotonic() + 0.2
    for _ in range(int(duration / 0.005) + 2):  # bounded by count and by duration
        left = end_by - time.monotonic()
        if left <= 0:
            break
        time.sleep(min(0.005, left))
        if lock is not None and time.monotonic() >= next_progress:
            # A long body: the lease now guaranteed (renewals extend it), in case this process is killed next; and
            # what docs/long-tasks.md asks of a long body: stop before further side effects once the lock is lost.
            next_progress = time.monotonic() + 0.2
            record.hset(
                "progress", f"{self.request.id}|{start!r}", json.dumps([time.time(), time.time() + lock.validity])
            )
            if not self.lock_held():
                _push("ends", [key, self.request.id, os.getpid(), start, time.time(), False, "abandoned"])
                self.check_lock()  # raises LockLostError: the run ends FAILURE
    held = self.lock_held()
    if retry_countdown > 0 and retries == 0:
        _push("ends", [key, self.request.id, os.getpid(), start, time.time(), held, "retry"])
        raise self.retry(countdown=retry_countdown)
    _push("ends", [key, self.request.id, os.getpid(), start, time.time(), held, "done"])
    return key


@task_success.connect(weak=False)
def _record_skip(sender: Any = None, result: Any = None, **_: Any) -> None:
    if isinstance(result, Skipped):
        _push("skips", [sender.request.id, os.getpid(), time.time(), result.reason, result.holder_task_id])


@signals.lock_waiting.connect(weak=False)
def _record_wait(sender: Any = None, **kw: Any) -> None:
    _push("waits", [kw.get("key"), kw.get("task_id"), os.getpid(), time.time(), kw.get("countdown"), kw.get("reason")])


@signals.lock_lost.connect(weak=False)
def _record_lost(sender: Any = None, **kw: Any) -> None:
    _push("lost", [kw.get("key"), kw.get("task_id"), os.getpid(), time.time(), kw.get("reason")])


@signals.lock_released.connect(weak=False)
def _record_released(sender: Any = None, **kw: Any) -> None:
    _push("released", [kw.get("key"), kw.get("task_id"), os.getpid(), time.time(), kw.get("held")])


@signals.lock_unavailable.connect(weak=False)
def _record_unavailable(sender: Any = None, **kw: Any) -> None:
    _push("unavailable", [kw.get("key"), kw.get("task_id"), os.getpid(), time.time(), kw.get("policy")])
