"""``lock_on_duplicate="cancel"`` (newest wins, also while it runs): a newer call of a key that is running asks the
running job to stop, and runs after it has stopped, never beside it.

The whole of it, in the order it happens::

    newer call's delivery   its acquire is refused (held by job A, running): it asks A to stop (``ask``: cancel.lua
      |                     writes the record's ``cancel`` field, the newer call's task id, on every node), then
      |                     waits in the key's line as with "replace": the newest waiting call keeps its place,
      |                     the ones in between are superseded (REVOKED, "superseded by"). A call older than the
      |                     running one's (the record's ``since``; one that waited while a newer call found the key
      |                     free) asks nothing: cancel.lua answers "newer", and it is superseded by the run
    A's watchdog            its next renewal's answer carries the request (extend.lua answers the field's value in
      |                     place of EXTENDED: the same round trip, nothing more for a lease nobody asked): the run
      |                     is told (``seen``), and its body is interrupted with JobCancelledError the way
      |                     ``lock_on_lost="interrupt"`` does (prefork and solo: a signal to the main thread;
      |                     gevent: thrown into the body's greenlet)
    A's body ends           ``stopped``: REVOKED, "cancelled by a newer call, task <id>"; counted ``cancelled``; A's
      |                     release HANDS the lock to the newest waiting call W (hand_on.lua: ``state`` handed,
      |                     ``job`` W, on a quorum; A's done marker in the same step) and wakes it: W's copy takes
      |                     it over and runs, with its own arguments. The lock is never free in between: a call
      |                     reaching a worker meanwhile meets it held by W, a duplicate, and parks as with
      |                     "replace" (older than W: superseded by W; newer: W is superseded, and W's copy, taking
      |                     the lock over, hands it on to the newest waiter in turn, and so on). Nobody waiting, the
      |                     line's node down, fewer than a quorum reached, or W cancelled by task id meanwhile: the
      |                     release frees the lock as before. A run that ends by itself after the request (before a
      |                     renewal saw it) hands its lock on the same way (unless a cooldown follows)
    a body that goes on     (C code, a swallowed exception) one renewal interval of grace, then its lease is no
                            longer renewed: it ends by itself, and the newer call runs then, with a greater fencing
                            token than A's (a store that checks tokens refuses A's late writes)

Threads and eventlet pools: Python cannot raise in another thread, so the body is not interrupted there (a warning,
as for ``lock_on_lost="interrupt"``); ``self.check_lock()`` raises JobCancelledError once the request was seen (the
body's flag to check), and the grace above still keeps the newer call from ever running beside it. Not refused at
registration: the pool is the worker's, not the task's (unknown when the task is registered).

The durable cancel of one job, for any LockedTask (:func:`cancel_job`: ``LockedTask.cancel``,
``LockedTask.cancel_task_id``, ``celery -A app locks cancel``), reuses both ends of the above::

    cancel_job.lua      on every node: the job's done marker is written with the value 'cancel:<who> at <when>',
      |                 living the cancel's TTL; a running record of the job gets the same 'cancel' field (its
      |                 watchdog stops the body as above); a record of the job not running (a queue-scope
      |                 reservation, a retry's hand-over) is deleted: the key is free
    a copy arriving     (any worker, later: also one offline at the cancel, or restarted since) its acquire answers
                        DONE (the marker), as for a finished job: nothing new on the hot path. Only the DONE path
                        reads the marker's value, and a cancel ends the message REVOKED "cancelled (by ...)"

A job whose done marker says it finished is not touched (ENDED). Durable on a quorum: a copy that reaches a node
holding the marker is dropped (one node's DONE refuses the acquire), so a cancel written on a quorum outlives any
minority of nodes restarted empty; written on fewer, it is reported as not durable (it still stops a run that one
of those nodes' renewals answers, and drops copies while those nodes keep the marker).
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from ..errors import JobCancelledError
from ..lock.record import DURABLE, cancels_key_for, done_key_for, durable_marker, pending_cancels, slot_keys
from ..lock.scripts import CANCEL, CANCEL_JOB
from .replace import Replace

if TYPE_CHECKING:
    from ..lock.nodes import NodeSet
    from . import Duplicate
    from .facts import Decision

__all__ = [
    "DURABLE",
    "Asked",
    "Cancel",
    "CancelReport",
    "ask",
    "cancel_job",
    "describe",
    "error_for",
    "hand_over_for",
    "pending",
    "read_marker",
]

#: A durable cancel's mark (the done marker's value, the record's ``cancel`` field): 'cancel:<who> at <when>'. A
#: newer call's request (``lock_on_duplicate="cancel"``) is its task id, never starting so.
#: A durable cancel's default lifetime (s): how long a queued copy of the job is still dropped when it arrives.
DEFAULT_TTL = 86400.0
#: The done marker a newer call's request leaves on the job it stops (after DURABLE, before the newer call's id).
NEWER = "a newer call, task "

#: The shortest a stopped run's lock stays handed to the newest waiting call (s): its woken copy may wait behind a
#: queue's backlog (a longer lock_ttl gives 3 ttl). A copy that never comes (its messages lost) holds the key that
#: long at most; any copy of it (woken, or its fallback) takes it over.
HAND_OVER_MIN = 30.0

#: How much later (s) a running call must have first reached a worker than the call meeting it, for that one to be
#: superseded by it instead of asking it to stop: the workers' clocks stamp both, and a call sent just after another
#: must not lose to it by their skew (the cases this is for are seconds apart: a call that waited through a cooldown,
#: or through a hand-over that could not be made, and a newer one that found the key free meanwhile).
CLOCK_MARGIN = 1.0
CLOCK_MS = int(CLOCK_MARGIN * 1000)

#: cancel.lua's answers per node (0: no running record of the holder, nothing changed).
MARKED, HOLDER_NEWER = 1, 2
#: What asking a holder to stop did (:func:`ask`).
Asked = Literal["asked", "newer", "none"]

#: cancel_job.lua's answers per node.
ENDED, RUNNING, FREED, PENDING = 0, 1, 2, 3
Outcome = Literal["running", "freed", "pending", "ended", "unknown"]

logger = logging.getLogger("celery_singleton_lock.task")


class Cancel(Replace):
    name: ClassVar[str] = "cancel"
    hands_on: ClassVar[bool] = True

    def act(self, duplicate: Duplicate, decision: Decision) -> None:
        # Also from a woken copy (another job took the lock first): an older holder is asked to stop, and a newer
        # one (a call that found the key free meanwhile) supersedes this call, never the other way round.
        if duplicate.stop_holder() == "newer":
            duplicate.superseded()
            return
        super().act(duplicate, decision)


def hand_over_for(ttl: float) -> float:
    """How long a stopped run's lock stays handed to the newest waiting call (hand_on.lua) for a ``ttl`` s lease."""
    return max(3 * ttl, HAND_OVER_MIN)


def ask(nodes: NodeSet, key: str, holder: str, by: str, done_for: float, since: int | None = None) -> Asked:
    """Ask job ``holder``, running under ``key``, to stop for task ``by``, whose call first reached a worker at
    ``since`` (ms): "asked" when a node marked its record; "newer" when the holder's call is the newer one (its
    record's ``since`` is later by more than CLOCK_MARGIN: nothing is marked, ``by`` is superseded by it); "none"
    otherwise.

    The job's done marker says so for ``done_for`` s (unless it is set): a copy of it that comes back (redelivered
    after its pool child died before it saw the request, or its body's retry) is dropped, never run after ``by``.

    Written on every node that answers (a request, not a vote: the holder acts on one node's word); a node that does
    not answer loses nothing but speed (the others carry it). Never raises: a request that reached no node leaves
    the newer call waiting for the holder's end, as "replace" would."""
    try:
        mark = f"{DURABLE}{NEWER}{by}"
        answers = nodes.run(
            CANCEL,
            (key, done_key_for(key, holder)),
            (holder, by, mark, max(1, int(done_for * 1000)), "" if since is None else str(since + CLOCK_MS)),
        )
    except Exception:
        logger.debug("asking %s to stop failed", holder, exc_info=True)
        return "none"
    codes = [a for a in answers if not isinstance(a, BaseException)]
    if MARKED in codes:
        return "asked"
    return "newer" if HOLDER_NEWER in codes else "none"


def describe(by: str) -> str:
    """Who stopped a run, for its REVOKED reason: a durable cancel's ``cancel:<who> at <when>`` or a newer call's id."""
    if by.startswith(DURABLE + NEWER):  # a copy of a job a newer call stopped (cancel.lua's done marker)
        by = by[len(DURABLE + NEWER) :]
    elif by.startswith(DURABLE):
        return f"cancelled (by {by[len(DURABLE) :]})"
    return f"cancelled by a newer call, task {by}"


@dataclass(frozen=True)
class CancelReport:
    """What a durable cancel of job ``task_id`` (lock ``key``) found and did."""

    key: str
    task_id: str
    #: running: its run is asked to stop; freed: a reservation or hand-over of it deleted; pending: no record of it
    #: (its queued copies are dropped when they arrive); ended: it finished already, nothing changed; unknown: no
    #: job to cancel was found (nothing written)
    outcome: Outcome
    written: int  #: nodes that hold the cancel now
    total: int
    quorum: int
    by: str = ""
    errors: tuple[str, ...] = ()

    @property
    def durable(self) -> bool:
        """Written on a quorum of the nodes (or nothing needed writing: ended, unknown)."""
        return self.outcome in ("ended", "unknown") or self.written >= self.quorum

    def __str__(self) -> str:
        what = {
            "running": "running: asked to stop (its watchdog stops the body within one renewal interval)",
            "freed": "not running: its reservation freed; its queued copies are dropped when they arrive",
            "pending": "not running: its queued copies are dropped when they reach a worker",
            "ended": "already ended: nothing changed",
            "unknown": "no job found to cancel: nothing changed",
        }[self.outcome]
        text = f"task {self.task_id} (lock {self.key}): {what}"
        if self.outcome not in ("ended", "unknown"):
            text += f"; cancel written on {self.written} of {self.total} node(s)"
            if not self.durable:
                text += f", fewer than a quorum ({self.quorum}): NOT durable, a node restarted empty may forget it"
        return text


def cancel_job(
    nodes: NodeSet, prefix: str, key: str, task_id: str, *, by: str, ttl: float = DEFAULT_TTL, limit: int = 1
) -> CancelReport:
    """Cancel job ``task_id`` of lock ``key`` on the lock nodes, durably for ``ttl`` s (see the module docstring).

    ``by`` says who cancels ("locks cancel by alice@host"); the time is added. Never raises for a node that does not
    answer: the report says on how many nodes the cancel is written."""
    when = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
    mark = f"{DURABLE}{by} at {when}"
    ms = max(1, int(ttl * 1000))
    answers = nodes.run(CANCEL_JOB, (done_key_for(key, task_id), *slot_keys(key, max(1, limit))), (task_id, ms, mark))
    codes = [a for a in answers if not isinstance(a, BaseException)]
    errors = tuple(str(a) for a in answers if isinstance(a, BaseException))
    written = sum(1 for c in codes if c != ENDED)
    ended = sum(1 for c in codes if c == ENDED)
    outcome: Outcome
    if ended and ended >= written:
        outcome = "ended"
    elif RUNNING in codes:
        outcome = "running"
    elif FREED in codes:
        outcome = "freed"
    else:
        outcome = "pending"
    if outcome != "ended" and written:
        member = json.dumps([key, task_id, mark])
        expiry = int(time.time() * 1000) + ms
        for client in nodes.clients:
            try:
                client.zadd(cancels_key_for(prefix), {member: expiry})
            except Exception:  # a listing only: the done marker is the cancel
                logger.debug("could not list the cancel of %s", task_id, exc_info=True)
    return CancelReport(key, task_id, outcome, written, len(nodes), nodes.quorum, mark, errors)


def read_marker(nodes: NodeSet, key: str, task_id: str) -> str | None:
    """A DONE answer's reason: the durable cancel (``cancel:...``) a node's done marker of the job holds, else None
    (the job finished). Read only on the DONE path; a node that errs says nothing."""
    return durable_marker(nodes.clients, key, task_id)


def pending(nodes: NodeSet, prefix: str) -> list[tuple[str, str, str, float]]:
    """The durable cancels still pending (see :func:`celery_singleton_lock.record.pending_cancels`)."""
    return pending_cancels(nodes.clients, prefix)


def error_for(key: str, by: str, task_name: str) -> JobCancelledError:
    """The error a cancelled body is interrupted with (and ``check_lock()`` raises)."""
    return JobCancelledError(key, by, task_name)


def reason(task_name: str, key: str, by: str) -> str:
    """What the stopped run's REVOKED state says (Flower, the result backend, ``AsyncResult.get()``)."""
    if by.startswith(DURABLE):
        return f"{describe(by)}: {task_name} of lock {key} stopped"
    return f"cancelled by a newer call, task {by}: {task_name} of lock {key} stopped so that it runs next"


def cancelled_by(exc: BaseException) -> Any:
    """The task id a :class:`JobCancelledError` names, else None (any other exception)."""
    return exc.cancelled_by if isinstance(exc, JobCancelledError) else None
