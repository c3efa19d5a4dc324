"""A delivery that does not run: re-sent as a copy to run later (same task id), or stopped quietly."""

from __future__ import annotations

import logging
import math
from typing import Any

from ..errors import DuplicateTaskError, LockUnavailableError
from ..policies.rate.booking import BOOKING_HEADER
from . import signals
from ._run import REDELIVERY_HEADER, SINCE_HEADER, Context, Run, Skipped, since

__all__ = ["copy", "defer", "skip_quietly"]

logger = logging.getLogger("celery_singleton_lock.task")


def defer(
    ctx: Context,
    run: Run,
    countdown: float,
    reason: str,
    headers: dict[str, Any],
    detail: str = "",
    holder_id: str | None = None,
) -> None:
    """Re-send this delivery (same task id, same options) to run after ``countdown`` s; this one does not run."""
    request = ctx.request
    if request.is_eager:  # nothing can wait in eager mode: the caller is told at once
        if reason == "unavailable":
            raise LockUnavailableError(run.key)
        raise DuplicateTaskError(run.key, task_name=ctx.name, holder_task_id=holder_id)
    if run.redelivered or reason == "redelivered":
        # Another copy of this message may exist (or will: the broker's own redelivery): the copy sent here
        # keeps saying so, so that when it runs it asks whether the job already succeeded, and its success
        # keeps the job's done marker for the whole window.
        headers = {**headers, REDELIVERY_HEADER: 1}
    if ctx.options.whole_seconds:
        # Native delayed delivery (quorum queues) takes whole seconds, and kombu refuses a countdown below 1 s.
        countdown = float(max(1, math.ceil(countdown)))
    first = getattr(request, SINCE_HEADER, None) is None  # every re-sent copy carries it: once per call
    copy(ctx, headers, countdown=countdown).apply_async()
    if first:
        ctx.count("deferred")
    signals.lock_waiting.send(sender=ctx.task, key=run.key, task_id=request.id, countdown=countdown, reason=reason)
    said = f"re-sent to run in {countdown:.1f}s ({reason})" + (f": {detail}" if detail else "")
    logger.debug("Task %s[%s] %s: lock %s", ctx.name, request.id, said, run.key)
    # A copy of a job that may have run already (a redelivery, a settling look) says nothing to monitors: its
    # task id's state is its twin's (see KIND_EVENT). A duplicate's job never ran: its acquire says DONE if so.
    waiting = reason in ("redelivered", "settling") or (run.redelivered and reason != "duplicate")
    skip_quietly(ctx, run, Skipped(said, run.key, holder_id, "waiting" if waiting else "deferred"))


def copy(ctx: Context, headers: dict[str, Any], **options: Any) -> Any:
    """A signature re-sending this delivery (same task id and options) with our ``headers`` added.

    Every re-send of a call goes through here (a deferred copy, the message a line wakes, a debounced job's copy for
    its due time), and every copy carries when its call first reached a worker (SINCE_HEADER): the copy is that call
    again, never a new one. "replace" orders calls by first arrival, and ``lock_max_waiting`` counts new duplicates
    only (a re-sent call keeps its place whatever sent it: its rate window, a split vote, no quorum, a twin).

    RabbitMQ's x-death headers are dropped from the copy (as Celery does for retry()): RabbitMQ < 4.0.1 drops a
    message it sees cycling through dead-lettering, and quorum queues' delayed delivery dead-letters.
    """
    request = ctx.request
    merged = {k: v for k, v in (request.headers or {}).items() if not str(k).startswith("x-death")}
    merged[SINCE_HEADER] = since(request)
    if merged.get(BOOKING_HEADER) and (request.delivery_info or {}).get("redelivered"):
        # A broker redelivery may be a run that started on its booking (killed mid-body): its copy, ours, would not
        # say "redelivered" where the rate looks (delivery_info), and would start on that entry again. It books
        # anew (the rate's own re-send of an early redelivery names its booking in ``headers``: kept).
        merged[BOOKING_HEADER] = ""
    merged.update(headers)
    return ctx.task.signature_from_request(request, headers=merged, **options)


def skip_quietly(ctx: Context, run: Run, outcome: Skipped) -> None:
    """Make the tracer store nothing and dispatch nothing for this delivery (see the module docstring)."""
    request = ctx.request
    run.outcome = outcome
    request.ignore_result = True
    request.chord = None
    request.callbacks = None
    request.chain = None
    if signals.delivery_skipped.receivers:  # Celery's send costs a call and its arguments even with none
        signals.delivery_skipped.send(
            sender=ctx.task, key=run.key, task_id=request.id, kind=outcome.kind, holder_task_id=outcome.holder_task_id
        )
