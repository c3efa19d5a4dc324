"""A beat schedule monitored by Sentry Crons, under the singleton scheduler (not a test module):
tests/task/test_sentry.py.

Configured from the environment: CSL_BROKER, CSL_LOCK_URLS, CSL_RECORD (a Redis URL), CSL_PROC (this process's name
in what it records: ``beat-1``, ``worker``...), CSL_SKIP_BEFORE_POOL, CSL_SENTRY_INSTRUMENT (``0``: without
``celery_singleton_lock.sentry.instrument()``). ``sentry_sdk`` sends nothing over a network: its transport pushes
every envelope item (check-ins, error events) to the Redis list ``envelopes``.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import redis
import sentry_sdk
from celery import Celery
from celery.schedules import schedule
from sentry_sdk.envelope import Envelope
from sentry_sdk.integrations.celery import CeleryIntegration
from sentry_sdk.transport import Transport

import celery_singleton_lock.sentry
from celery_singleton_lock import LockedTask

record = redis.Redis.from_url(os.environ["CSL_RECORD"])
PROC = os.environ.get("CSL_PROC", "worker")


class RecordingTransport(Transport):
    """Every envelope item, with the process that sent it, pushed to ``envelopes``: no network."""

    def capture_envelope(self, envelope: Envelope) -> None:
        for item in envelope.items:
            payload = item.payload.json if item.payload.json is not None else None
            record.rpush(
                "envelopes", json.dumps({"proc": PROC, "pid": os.getpid(), "type": item.type, "payload": payload})
            )

    def flush(self, timeout: float, callback: Any = None) -> None:
        return None


class EveryMinuteForSentry(schedule):  # type: ignore[misc]
    """Runs every ``run_every`` (a few seconds), but tells Sentry Crons "every minute": Crons takes whole minutes
    only, and a test cannot wait for minutes."""

    @property
    def seconds(self) -> float:
        return 60.0


app = Celery("sentry_app", broker=os.environ["CSL_BROKER"], backend=os.environ["CSL_BROKER"].rsplit("/", 1)[0] + "/1")
app.conf.update(
    singleton_lock_urls=os.environ["CSL_LOCK_URLS"].split(","),
    singleton_lock_ttl=5,
    broker_connection_retry_on_startup=True,
    worker_prefetch_multiplier=1,
    beat_max_loop_interval=0.2,
    beat_schedule={
        "report": {"task": "sentry_app.report", "schedule": EveryMinuteForSentry(2.0)},
        "report-later": {"task": "sentry_app.report_later", "schedule": EveryMinuteForSentry(2.0)},
    },
)
if "CSL_SKIP_BEFORE_POOL" in os.environ:
    app.conf.singleton_lock_skip_before_pool = os.environ["CSL_SKIP_BEFORE_POOL"] == "1"

sentry_sdk.init(
    dsn="http://public@127.0.0.1:9/1",  # never used: the transport is ours
    transport=RecordingTransport(),
    integrations=[CeleryIntegration(monitor_beat_tasks=True)],
)
if os.environ.get("CSL_SENTRY_INSTRUMENT", "1") == "1":
    celery_singleton_lock.sentry.instrument()


@app.task(shared=False, base=LockedTask, bind=True)
def report(self: Any) -> None:
    """5 s, every 2 s: the ticks that arrive while it runs are skipped duplicates."""
    record.rpush("runs", json.dumps(["report", self.request.id, time.time()]))
    time.sleep(5.0)


@app.task(shared=False, base=LockedTask, bind=True, lock_on_duplicate="reschedule")
def report_later(self: Any) -> None:
    """2.5 s, every 2 s, rescheduled: a tick that arrives while it runs waits, and runs after it."""
    record.rpush("runs", json.dumps(["report_later", self.request.id, time.time()]))
    time.sleep(2.5)
