"""What a LockedTask delivery does: one pure function of the facts gathered in ``before_start``.

``task.py`` gathers facts (the acquire's outcome, the holder record, the request) and carries out the action;
every rule lives here, with no I/O, no Celery and no clock, so the whole table is tested exhaustively
(tests/test_decision.py). The rules, in order:

=============================  =====================================================================================
outcome of the acquire          action
=============================  =====================================================================================
acquired                        RUN; a redelivered first attempt LOOKs UP the result backend, DONE if it holds a final
                                state (SUCCESS, FAILURE, REVOKED: the job ran to an end, whichever)
                                (a retry never asks: the backend's state may be its predecessor's, after
                                retry(throw=False); for a retry the done marker alone says "finished")
done (the job's done marker)    DONE: this task id already ran to an end, success or failure (however late this copy
                                starts)
split vote                      RETRY_NOW a few times with jitter, then DEFER soon: never skipped as a duplicate
no quorum answered              policy: DEFER with back-off (retry), FAIL_UNAVAILABLE (fail), RUN_UNGUARDED (run)
held by this task id, queued    TAKE_OVER the reservation ``lock_scope="queue"`` made at ``apply_async`` (a first try;
  or sending                    also while the client is still marking it sent)
held by this task id, retry     TAKE_OVER the hand-over of our own ``self.retry()`` (once; only by a later try)
held by this task id, cooldown  DONE: it finished and is cooling down
held by this id's earlier try   the attempt that sent this retry is ending: RETRY_NOW a few times, then DEFER ~1 s
held by this task id, other     a redelivery beside a live twin: LOOK UP; DONE if final, else DEFER until the
                                twin's lease would end (never skipped as its own duplicate, never run beside it)
held by another job             duplicate: SKIP (skip), FAIL_DUPLICATE (fail), DEFER (reschedule, replace; chord members
                                always): when the holder's lease would end (its release wakes it before that)
held by another job, sending    DEFER after at most one renewal interval: its message may never be sent
held by a record of no job      DEFER after at most one renewal interval (not a LockedTask's record: nothing says
                                it is another job, so this one is never dropped as its duplicate), up to
                                ``max_retries`` times, then FAIL_UNAVAILABLE
=============================  =====================================================================================
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Literal

from .config import DuplicatePolicy, UnavailablePolicy

# The holder record's states (defined with the record; imported here too, so ``decision.RUNNING`` etc. keep working).
from .record import COOLDOWN, ENDING, HANDOVER, QUEUED, RUNNING, SENDING

__all__ = [
    "COOLDOWN",
    "ENDING",
    "HANDOVER",
    "QUEUED",
    "RUNNING",
    "SENDING",
    "SPLIT_RETRIES",
    "Act",
    "Decision",
    "Facts",
    "Outcome",
    "decide",
]

Outcome = Literal["acquired", "held", "done", "split", "unavailable"]

#: Immediate retries of a split vote before the delivery is re-sent instead.
SPLIT_RETRIES = 3


class Act(enum.Enum):
    RUN = "run"  #: the lock is ours: run the body
    LOOK_UP = "look up"  #: read the result backend's state of this task id, then decide again
    TAKE_OVER = "take over"  #: acquire again, taking over the holder (our own retry's hand-over)
    RETRY_NOW = "retry now"  #: acquire again after a short jittered pause (split vote)
    DONE = "done"  #: this task id already ran to an end: do not run, store nothing
    SKIP = "skip"  #: a duplicate of another job: store REVOKED naming the holder, do not run
    FAIL_DUPLICATE = "fail duplicate"  #: a duplicate: fail with DuplicateTaskError
    DEFER = "defer"  #: re-send this delivery (same task id) to run after ``countdown`` s
    FAIL_UNAVAILABLE = "fail unavailable"  #: no quorum: fail with LockUnavailableError
    RUN_UNGUARDED = "run unguarded"  #: no quorum, policy "run": run without the lock, loudly


@dataclass(frozen=True)
class Facts:
    """Everything a delivery's decision depends on."""

    outcome: Outcome
    task_id: str
    holder_job: str | None = None  #: the holder record's task id (None: unknown, e.g. not a LockedTask record)
    holder_state: str | None = None  #: the holder record's state (RUNNING, HANDOVER, ENDING, COOLDOWN, ...)
    holder_remaining: float | None = None  #: seconds left on the holder's lease
    redelivered: bool = False  #: the broker says so, or we re-sent it to wait for its twin
    retries: int = 0  #: this delivery's ``request.retries``
    holder_try: int | None = None  #: the holder record's ``try`` (its delivery's retries), None: unknown
    #: the result backend holds a final state (SUCCESS, FAILURE, REVOKED) for this id: the job ran to an end, and a
    #: copy of it must not run it again, whichever end it was; None: not looked up (yet)
    ended: bool | None = None
    in_chord: bool = False
    on_duplicate: DuplicatePolicy = "skip"
    on_unavailable: UnavailablePolicy = "retry"
    split_retries: int = 0  #: RETRY_NOWs already done in this delivery
    took_over: bool = False  #: a TAKE_OVER was tried already in this delivery
    attempt: int = 0  #: earlier re-sends of this delivery for want of a quorum
    max_retries: int | None = None  #: of those re-sends (None: unbounded)
    ttl: float = 60.0
    interval: float = 20.0  #: the renewal interval
    retry_delay: float = 1.0
    retry_max_delay: float = 60.0
    max_countdown: float | None = None  #: the longest countdown we may re-send with (broker visibility timeout)
    jitter: float = 0.5  #: a random draw in [0, 1)


@dataclass(frozen=True)
class Decision:
    act: Act
    countdown: float = 0.0  #: DEFER only
    reason: str = ""  #: DEFER: "split vote", "unavailable", "redelivered", "duplicate"; else for people


def decide(f: Facts) -> Decision:
    """The action for a delivery with these facts (see the module's table)."""
    if f.outcome == "done":
        return Decision(Act.DONE, reason="already ran")
    # The result backend speaks for a task id's FIRST attempt only: a body that went on after retry(throw=False)
    # and returned (or raised) stored a final state for the id while its retry is still to run. A retry's only proof
    # of an earlier end is the done marker (outcome "done", checked in the acquire itself).
    ended = f.ended if f.retries == 0 else False
    if f.outcome == "acquired":
        if f.took_over or f.retries > 0:
            # Our own retry's hand-over taken over, or a retry that found the lock free: it runs.
            return Decision(Act.RUN)
        if ended:
            return Decision(Act.DONE, reason="already ran")
        if f.redelivered and ended is None:
            return Decision(Act.LOOK_UP)
        return Decision(Act.RUN)
    if f.outcome == "split":
        if f.split_retries < SPLIT_RETRIES:
            return Decision(Act.RETRY_NOW)
        return _defer(f, 0.05 + 0.45 * f.jitter, "split vote")
    if f.outcome == "unavailable":
        if f.on_unavailable == "run":
            return Decision(Act.RUN_UNGUARDED)
        if f.on_unavailable == "fail" or (f.max_retries is not None and f.attempt + 1 > f.max_retries):
            return Decision(Act.FAIL_UNAVAILABLE)
        delay = min(f.retry_max_delay, f.retry_delay * 2**f.attempt)
        return _defer(f, delay * (0.5 + 0.5 * f.jitter), "unavailable")
    # Held.
    remaining = f.holder_remaining if f.holder_remaining is not None and f.holder_remaining > 0 else f.ttl
    if f.holder_job == f.task_id:
        if f.holder_state in (QUEUED, SENDING) and not f.took_over and f.retries == 0:
            # The reservation apply_async made for this very message (lock_scope="queue"): this delivery is the job.
            return Decision(Act.TAKE_OVER)
        if f.holder_state == HANDOVER and not f.took_over and (f.holder_try is None or f.retries > f.holder_try):
            # Only a later attempt takes a hand-over: a redelivered copy of the attempt that handed over (or of an
            # earlier one) would run that attempt again and fork the retry chain.
            return Decision(Act.TAKE_OVER)
        if f.holder_state == COOLDOWN:
            return Decision(Act.DONE, reason="already ran")
        if f.holder_try is not None and f.holder_try < f.retries:
            # The attempt before this retry still holds the lock: it sent this retry and is ending (unwinding its
            # body, or going on after retry(throw=False)); it hands over when its body ends. Look again soon.
            if f.split_retries < SPLIT_RETRIES:
                return Decision(Act.RETRY_NOW)
            return _defer(f, min(remaining, f.interval, 1.0) + 0.05 + 0.2 * f.jitter, "predecessor")
        # The same job, held by another delivery of it (acks_late after a crash, a visibility-timeout redelivery):
        # look again when its lease would end (a dead holder stops renewing, so at most a ttl away), unless it
        # ended meanwhile.
        if ended is None:
            return Decision(Act.LOOK_UP)
        if ended:
            return Decision(Act.DONE, reason="already ran")
        return _defer(f, remaining + 0.05 + 0.2 * f.jitter, "redelivered")
    if f.holder_job is None:
        # Not a LockedTask's record (a plain Redlock, a key of another tool, an old format): nothing says it is a
        # different job, so this one is not dropped as its duplicate: look again after at most one interval, as
        # often as an outage allows (singleton_lock_max_retries).
        if f.max_retries is not None and f.attempt + 1 > f.max_retries:
            return Decision(Act.FAIL_UNAVAILABLE, reason="unknown holder")
        return _defer(f, min(remaining, f.interval) + 0.05 + 0.2 * f.jitter, "unknown holder")
    if f.holder_state == SENDING:
        # Another job's reservation whose message may never be sent (its publish failed, its client died): not a
        # job to be skipped for. Look again when it has been sent (QUEUED: a duplicate then) or has expired.
        return _defer(f, min(remaining, f.interval) + 0.05 + 0.2 * f.jitter, "sending")
    policy: DuplicatePolicy = "reschedule" if f.in_chord else f.on_duplicate
    if policy == "fail":
        return Decision(Act.FAIL_DUPLICATE)
    if policy in ("reschedule", "replace"):
        # The fallback: a dead holder's lease ends within ``remaining`` (a live one's renewals keep it ~ttl away).
        # The holder's release wakes a waiting duplicate before that (task.py's waiting line): no polling.
        wait = remaining
        if f.on_duplicate not in ("reschedule", "replace"):
            # A chord member of a task whose holders wake no line (skip, fail): nothing wakes it, and a queued
            # holder's lease is its whole queue wait (lock_queue_ttl): look again every renewal interval instead.
            wait = min(remaining, f.interval)
        return _defer(f, wait + 0.05 + 0.2 * f.jitter, "duplicate")
    return Decision(Act.SKIP)


def _defer(f: Facts, countdown: float, reason: str) -> Decision:
    if f.max_countdown is not None:
        countdown = min(countdown, f.max_countdown)
    return Decision(Act.DEFER, countdown=countdown, reason=reason)
