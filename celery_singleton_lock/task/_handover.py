"""A retry's hand-over, and the end of a killed run's lease: the lock passed on to the next delivery of a job."""

from __future__ import annotations

import datetime as dt
import time
from typing import Any

from ..lock.record import ENDING, HANDOVER
from ..lock.redlock import Redlock
from ..lock.renewal import watchdog
from ..policies.limit import LIMIT
from ._run import END_LEASE, OWN_HEADERS, Context, Run

__all__ = ["drop_own_headers", "end_lease_of", "ending_lease", "hand_over", "retry_lease"]


def retry_lease(ctx: Context, eta: dt.datetime | None, countdown: float | None, options: dict[str, Any]) -> float:
    """How long the hand-over to a retry sent with these options must last (its countdown plus a ttl); drops this
    delivery's own lock headers from the retry's ``options`` (a retry is a new attempt, see LockedTask.retry)."""
    if eta is not None:
        # Celery reads a naive eta as UTC.
        aware = eta if eta.tzinfo is not None else eta.replace(tzinfo=dt.timezone.utc)
        delay = max(0.0, (aware - dt.datetime.now(dt.timezone.utc)).total_seconds())
    else:
        delay = float(countdown if countdown is not None else ctx.task.default_retry_delay or 0)
    drop_own_headers(ctx.request, options)
    return delay + ctx.options.ttl


def drop_own_headers(request: Any, options: dict[str, Any]) -> None:
    """Drop this delivery's own lock headers from a retry's ``options`` (a retry is a new attempt, with or without a
    lock: a booked call's retry carrying its booking would claim the entry its run already counted)."""
    headers = options.get("headers", request.headers) or {}
    options["headers"] = {k: v for k, v in headers.items() if k not in OWN_HEADERS and not str(k).startswith("x-death")}


def hand_over(ctx: Context, run: Run, ttl: float) -> None:
    """Reserve the lock for the next delivery of this task id (the retry), which takes it over atomically.

    The record is marked ``open``: the retry's own first acquire, refused by it, does not mark it ``waiting``.
    """
    ctx.disarm(run)
    if run.lease is not None:
        watchdog().unregister(run.lease)
        run.lease = None
    if run.lock is not None:
        # Not handed over (the lease had run out, too few nodes answered): the retry finds the lock free.
        run.lock.transfer(ttl, {"state": HANDOVER, "open": "1"})


def ending_lease(ctx: Context, key: str, task_id: str, limit: int | None = None, **fields: str) -> Redlock:
    """A lock on ``key`` that ends ``task_id``'s hold: a lease of END_LEASE s that nobody renews, its record saying
    ``ending`` (a duplicate sent meanwhile is sent, a copy of the job waits ~1 s), taken over from the holder."""
    return Redlock(
        ctx.options.settings.nodes,
        key,
        ttl=END_LEASE,
        fencing=False,
        job=task_id,
        limit=limit or LIMIT.static(ctx.cls),
        record={"state": ENDING, "name": ctx.name, **fields},
    )


def end_lease_of(ctx: Context, task_id: str, key: str, worker: str, limit: int | None = None) -> None:
    """Take the lock over from the run being killed, with a lease of ~1 s that nobody renews.

    Called in the worker's main process after a hard time limit (see :class:`LockedRequest`), which Celery
    handles there BEFORE billiard kills the child (SIGTERM, then SIGKILL 0.1 s later: billiard/pool.py:755-779):
    capping the lease's expiry alone is not enough, since the child's watchdog can renew in between, back to a
    full ttl. Taking the lock over replaces the owner token, so the dying run's renewals and release no longer
    match; the record names the same task id (state ``ending``), so a redelivery of it waits ~1 s, not a ttl.
    Only a record written by the killed child (``worker``, its pid and host) is taken over: another delivery
    of the same task id (a retry, a redelivered twin) may hold the lock by now, and must keep it.
    """
    lock = ending_lease(ctx, key, task_id, limit, worker=worker, at=str(int(time.time() * 1000)))
    if lock.acquire(blocking=False):  # nobody held it any more: nothing to end
        lock.release()
        return
    record = lock.holder_record or {}
    if lock.contended and record.get("job") == task_id and record.get("worker") == worker:
        lock.replaces = lock.held_by
        lock.acquire(blocking=False)  # ours for END_LEASE seconds, then it expires: never extended
