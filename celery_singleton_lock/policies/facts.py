"""The vocabulary of a delivery's decision: the facts it depends on, the acts it may choose, the decision.

Pure data, no I/O: :mod:`~celery_singleton_lock.decision` decides from it, and each duplicate policy
(:mod:`~celery_singleton_lock.policies`) decides its own branch from it.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from ..lock.config import DuplicatePolicy, UnavailablePolicy

__all__ = ["Act", "Decision", "Facts", "Outcome", "defer", "facts_of"]

Outcome = Literal["acquired", "held", "done", "split", "unavailable"]


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
    #: queue scope: this message was published under a reservation; finding none, it asks whether its job ran
    reserved: bool = False
    retries: int = 0  #: this delivery's ``request.retries``
    holder_try: int | None = None  #: the holder record's ``try`` (its delivery's retries), None: unknown
    #: the result backend holds a final state (SUCCESS, FAILURE, REVOKED) for this id: the job ran to an end, and a
    #: copy of it must not run it again, whichever end it was; None: not looked up (yet)
    ended: bool | None = None
    in_chord: bool = False
    #: a copy of a call whose body started and must still run (a body's SlowDown): as a chord member, it waits as a
    #: duplicate instead of being skipped or failed (with replace / cancel, its key's line decides as for any call)
    resumed: bool = False
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


def facts_of(values: Mapping[str, Any]) -> Facts:
    """``Facts(**values)`` without the frozen dataclass's ``__init__``, which sets all 24 fields one
    ``object.__setattr__`` at a time (~4 µs, a tenth of a skipped duplicate's own Python): the given fields go into
    the instance's dict and the others are read from the class, where a dataclass keeps each plain default. The
    same object for every use (equality, ``dataclasses.replace``, repr, frozen against assignment); ``values`` must
    name fields only, ``outcome`` and ``task_id`` among them (as ``__init__`` would insist)."""
    facts = object.__new__(Facts)
    facts.__dict__.update(values)
    return facts


@dataclass(frozen=True)
class Decision:
    act: Act
    countdown: float = 0.0  #: DEFER only
    reason: str = ""  #: DEFER: "split vote", "unavailable", "redelivered", "duplicate"; else for people


def defer(f: Facts, countdown: float, reason: str) -> Decision:
    """DEFER after ``countdown`` s, capped by the broker's visibility timeout (``max_countdown``)."""
    if f.max_countdown is not None:
        countdown = min(countdown, f.max_countdown)
    return Decision(Act.DEFER, countdown=countdown, reason=reason)
