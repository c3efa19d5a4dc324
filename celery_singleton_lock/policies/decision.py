"""What a LockedTask delivery does: one pure function of the facts gathered in ``before_start``.

``task.py`` gathers facts (the acquire's outcome, the holder record, the request) and carries out the action;
every rule lives here, with no I/O, no Celery and no clock, so the whole table is tested exhaustively
(tests/policies/test_decision.py). The rules, in order:

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
held by this task id, handed    TAKE_OVER the lock a run stopped for a newer call handed to this waiting call (once)
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

# The holder record's states (defined with the record; imported here too, so ``decision.RUNNING`` etc. keep working).
from ..lock.record import COOLDOWN, ENDING, HANDED, HANDOVER, QUEUED, RUNNING, SENDING
from . import policy_for
from .facts import Act, Decision, Facts, Outcome, defer

__all__ = [
    "COOLDOWN",
    "ENDING",
    "HANDED",
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
    "duplicate_policy",
]

#: Immediate retries of a split vote before the delivery is re-sent instead.
SPLIT_RETRIES = 3


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
        if (f.redelivered or f.reserved) and ended is None:
            # A copy may find its job done by its twin; a reserved message that found no reservation (it took
            # none over) may find its job run by another call's copy (queue scope's stand-in): ask the backend.
            return Decision(Act.LOOK_UP)
        return Decision(Act.RUN)
    if f.outcome == "split":
        if f.split_retries < SPLIT_RETRIES:
            return Decision(Act.RETRY_NOW)
        return defer(f, 0.05 + 0.45 * f.jitter, "split vote")
    if f.outcome == "unavailable":
        if f.on_unavailable == "run":
            return Decision(Act.RUN_UNGUARDED)
        if f.on_unavailable == "fail" or (f.max_retries is not None and f.attempt + 1 > f.max_retries):
            return Decision(Act.FAIL_UNAVAILABLE)
        delay = min(f.retry_max_delay, f.retry_delay * 2**f.attempt)
        return defer(f, delay * (0.5 + 0.5 * f.jitter), "unavailable")
    # Held.
    remaining = f.holder_remaining if f.holder_remaining is not None and f.holder_remaining > 0 else f.ttl
    if f.holder_job == f.task_id:
        if f.holder_state == HANDED and not f.took_over:
            # lock_on_duplicate="cancel": the run a newer call stopped handed its lock to this call, the newest
            # waiting one (hand_on.lua); whichever copy of it comes first (woken, or its fallback) takes it over.
            return Decision(Act.TAKE_OVER)
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
            return defer(f, min(remaining, f.interval, 1.0) + 0.05 + 0.2 * f.jitter, "predecessor")
        # The same job, held by another delivery of it (acks_late after a crash, a visibility-timeout redelivery):
        # look again when its lease would end (a dead holder stops renewing, so at most a ttl away), unless it
        # ended meanwhile.
        if ended is None:
            return Decision(Act.LOOK_UP)
        if ended:
            return Decision(Act.DONE, reason="already ran")
        return defer(f, remaining + 0.05 + 0.2 * f.jitter, "redelivered")
    if f.holder_job is None:
        # Not a LockedTask's record (a plain Redlock, a key of another tool, an old format): nothing says it is a
        # different job, so this one is not dropped as its duplicate: look again after at most one interval, as
        # often as an outage allows (singleton_lock_max_retries).
        if f.max_retries is not None and f.attempt + 1 > f.max_retries:
            return Decision(Act.FAIL_UNAVAILABLE, reason="unknown holder")
        return defer(f, min(remaining, f.interval) + 0.05 + 0.2 * f.jitter, "unknown holder")
    if f.holder_state == SENDING:
        # Another job's reservation whose message may never be sent (its publish failed, its client died): not a
        # job to be skipped for. Look again when it has been sent (QUEUED: a duplicate then) or has expired.
        return defer(f, min(remaining, f.interval) + 0.05 + 0.2 * f.jitter, "sending")
    # Another job holds it: a duplicate, and its task's policy says what it does (chord members always wait: a
    # skipped member would fail the chord, one that stored nothing would hang it).
    return policy_for(duplicate_policy(f)).decide(f, remaining)


def duplicate_policy(f: Facts) -> str:
    """The policy a duplicate acts by: the task's, but chord members and a resumed call (a body's SlowDown: its copy
    runs once after the pause, docs/rate.md) wait instead of being skipped or failed."""
    if f.in_chord or (f.resumed and f.on_duplicate in ("skip", "fail")):
        return "reschedule"
    return f.on_duplicate
