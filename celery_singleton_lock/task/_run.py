"""A delivery's own state, a task's resolved options, the context the rooms take, and the headers of re-sent copies.

The lowest room of the Celery side: every other one (enqueue, delivery, line, hand-over) reads these, and this
module reads nothing of theirs. :class:`Context` is the seam between ``LockedTask`` (the table of contents: Celery's
hooks and the options) and the rooms that do the work: ``LockedTask`` builds one per call (``apply_async``) and per
delivery (``before_start``), and the rooms take it; they never import the task module nor call its private methods.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from celery.states import READY_STATES
from celery.utils import uuid
from kombu.utils import json as kombu_json

from ..errors import LockLostError
from ..lock.config import DuplicatePolicy, LockSettings, LostPolicy, UnavailablePolicy
from ..lock.keys import Binder, custom_key, lock_key
from ..lock.record import RUNNING
from ..lock.redlock import Redlock
from ..lock.renewal import watchdog
from ..policies import FEATURES
from ..policies.cancel import describe, error_for
from ..policies.limit import LIMIT
from ..policies.port import Hooks
from . import signals

if TYPE_CHECKING:
    from ..lock.interrupt import Target
    from ..lock.renewal import Lease
    from ..policies import Policy

__all__ = [
    "ATTEMPT_HEADER",
    "DONE_MARGIN",
    "END_LEASE",
    "HOST",
    "OWN_HEADERS",
    "PARKED_HEADER",
    "REDELIVERY_HEADER",
    "RESERVED_HEADER",
    "RESUMED_HEADER",
    "SETTLE_HEADER",
    "SINCE_HEADER",
    "SKIP_MARK",
    "WOKEN_HEADER",
    "Context",
    "Options",
    "Run",
    "Skipped",
    "is_locked_task",
    "mark_joined",
    "since",
    "text",
    "try_of",
    "worker_id",
]

logger = logging.getLogger("celery_singleton_lock.task")

#: Seconds of the lease that ends a killed or revoked run's hold (nobody renews it).
END_LEASE = 1.0
HOST = socket.gethostname()
_worker = f"{os.getpid()}@{HOST}"


def _after_fork() -> None:
    global _worker  # noqa: PLW0603 - one per process
    _worker = f"{os.getpid()}@{HOST}"


os.register_at_fork(after_in_child=_after_fork)


def worker_id() -> str:
    """The holder record's ``worker`` field: this process (a prefork child, not the parent that imported us)."""
    return _worker


ATTEMPT_HEADER = "singleton_lock_attempt"  # earlier re-sends of this delivery for want of a quorum
REDELIVERY_HEADER = "singleton_lock_waited"  # a copy of a job that may have run: it asks before it runs
SETTLE_HEADER = "singleton_lock_settle"  # the second look of a copy that found its job done and no result stored
# A rescheduled duplicate's copies: the fallback re-send ("parked") and the copy a releasing holder wakes ("woken").
PARKED_HEADER = "singleton_lock_parked"
WOKEN_HEADER = "singleton_lock_woken"
SINCE_HEADER = "singleton_lock_since"  # when a call first reached a worker (ms): "replace" keeps the newest
RESERVED_HEADER = "singleton_lock_reserved"  # queue scope: published under a reservation made at apply_async
RESUMED_HEADER = "singleton_lock_resumed"  # a copy of a call whose body started (SlowDown): waits as a duplicate
#: A retry is a new attempt: it inherits none of these (see LockedTask.retry).
OWN_HEADERS = frozenset(
    {
        ATTEMPT_HEADER,
        REDELIVERY_HEADER,
        SETTLE_HEADER,
        PARKED_HEADER,
        WOKEN_HEADER,
        SINCE_HEADER,
        RESERVED_HEADER,
        RESUMED_HEADER,
    }
    | {header for feature in FEATURES for header in feature.headers}
)
#: A finished job's done marker outlives the longest wait we create (a ttl), or the broker's visibility timeout,
#: by this margin: a copy that starts this much later than it was due may run the job again (without a backend).
DONE_MARGIN = 300.0


#: How a Skipped's repr begins: what a worker's main process (which sees only the repr) and the log filter look for.
SKIP_MARK = "<celery_singleton_lock.Skipped:"


@dataclass(frozen=True)
class Skipped:
    """What ``__call__`` returns for a delivery that did not run the body.

    ``kind`` is ``"duplicate"`` (skipped: another job holds the lock, or replaced it in line), ``"deferred"`` (re-sent
    to run later: reschedule, replace, an outage back-off, a split vote), ``"done"`` (a copy of a job that already
    succeeded), ``"waiting"`` (a copy of a job re-sent to wait for its twin), or ``"settled"`` (a copy of a job whose
    successful run was killed before it stored its result: REVOKED is stored for it). Celery's events report
    duplicate and settled as ``task-revoked`` and deferred as ``task-retried``, and nothing for done and waiting
    (their task id's own run reports it), never ``task-succeeded``; the worker's log line says what happened.
    """

    reason: str
    key: str
    holder_task_id: str | None
    kind: str = "duplicate"

    def __repr__(self) -> str:
        # The main process parses this (see LockedRequest.send_event): kind, the holder's id with its length (a task
        # id may hold any character), then the reason. No space before the holder: Celery cuts a long repr short
        # (Task.resultrepr_maxsize), and what survives must still name the kind.
        holder = self.holder_task_id or ""
        return f"{SKIP_MARK}{self.kind}:{len(holder)}:{holder} {self.reason}>"


def is_locked_task(task: Any) -> bool:
    """``task`` is a LockedTask (told without importing the task module, which imports the rooms that ask)."""
    return getattr(task, "_singleton_lock_task", False) is True


@dataclass
class Run:
    """Per-delivery state, kept on the request (one Task instance serves every thread of a process)."""

    key: str
    task_id: str = ""
    retries: int = 0  # the request's retries (read once: each ``self.request`` is a thread-local stack lookup)
    lock: Redlock | None = None
    lease: Lease | None = None
    outcome: Skipped | None = None
    entered: bool = False
    redelivered: bool = False  # the broker redelivered it, or we re-sent it to wait for its twin
    handover_ttl: float | None = None  # retry(throw=False): hand over when the body ends, for this long
    retry_sent: bool = False  # retry(throw=False) sent the call's retry: the body's end re-sends nothing more
    parked: bool = False  # this delivery's job waits in the key's waiting line (see _line.park)
    superseded_by: str | None = None  # "replace": the newer job that took this one's place in the line
    interrupt: Target | None = None  # lock_on_lost="interrupt": the body to interrupt when the lock is lost
    line_full: int | None = None  # lock_max_waiting: the length of the full line this new duplicate found
    body_args: tuple[Any, Any] | None = None  # the (args, kwargs) the body runs with, when a feature swapped them
    state: dict[str, Any] | None = None  # the active features' per-delivery state, by feature name (policies.port)
    limit: int | None = 1  # the run's lock_limit (a callable's answer for this call); None: no lock, a rate only
    cancelled_by: str | None = None  # lock_on_duplicate="cancel": the newer call that asked this run to stop
    ctx: Context | None = None  # the delivery's context (what __call__ hands the release or the hand-over)


@dataclass(frozen=True)
class Options:
    """A task's resolved options: the app's settings overlaid with the task's ``lock_*`` attributes."""

    settings: LockSettings
    ttl: float
    interval: float
    on_duplicate: DuplicatePolicy
    policy: Policy  # what a duplicate of this task does: the policy called on_duplicate
    on_unavailable: UnavailablePolicy
    on_lost: LostPolicy
    binder: Binder | None  # the body's signature, ready to bind calls to (None: no usable signature)
    max_countdown: float | None  # half the broker's visibility timeout, if it has one
    done_window: float  # how long a finished job's done marker lives when a copy of it is known to wait
    done_window_short: float  # ... and when none is
    whole_seconds: bool  # countdowns go through native delayed delivery (RabbitMQ quorum queues): whole seconds >= 1
    max_waiting: int | None = None  # lock_max_waiting: at most this many new duplicates wait in the key's line
    hooks: Hooks = field(default_factory=Hooks)  # the active features, per hook (policies.port): once per task
    conf: Mapping[str, Any] = field(default_factory=dict)  # each active feature's resolved options, by name
    space: str = ""  # what the keys are named after: the task's lock_group, or its name
    key_fn: Callable[..., str] | None = None  # lock_key: the key's distinguishing part from the arguments
    unique_on: Sequence[str] | None = None  # lock_unique_on
    scope: str = "run"  # lock_scope
    queue_ttl: float = 600.0  # lock_queue_ttl

    @property
    def waits_in_line(self) -> bool:
        """A duplicate waits in its key's line, woken by a holder's release (only these policies' holders wake it)."""
        return self.policy.waits_in_line


def mark_joined(result: Any, holder_id: str | None) -> Any:
    """Say on the ``AsyncResult`` a call returns whether it joined an existing job: ``result.joined`` (bool) and
    ``result.holder_id`` (that job's task id, also ``result.id``; None for a new job). Plain attributes of this one
    object: it stays the app's own ``AsyncResult`` class, pickled and serialized as before (without them)."""
    try:
        result.joined = holder_id is not None
        result.holder_id = holder_id
    except (AttributeError, TypeError):  # a result class of the app's own that takes no attributes: left as it is
        pass
    return result


def since(request: Any) -> int:
    """When this call first reached a worker (ms), carried by its re-sent copies; now for a first delivery."""
    value = getattr(request, SINCE_HEADER, None)
    return int(value) if isinstance(value, int | str) and str(value).isdigit() else int(time.time() * 1000)


def text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def try_of(record: dict[str, str]) -> int | None:
    """The holder record's ``try`` (its delivery's retries), None when absent or not a plain decimal number."""
    value = record.get("try", "")
    return int(value) if value.isascii() and value.isdigit() else None


class Context:
    """The seam: what the Celery-side rooms need of a LockedTask, for one call or one delivery.

    ``task`` is the Celery task (its public API: ``request``, ``backend``, ``app``, ``signature_from_request``, ...);
    everything of the library's own is here: the resolved :class:`Options`, the key builder, the lock factory,
    counting, the loss hooks. Built by ``LockedTask.lock_context()`` (a slotted object: one allocation a delivery).
    """

    __slots__ = ("_request", "cls", "name", "options", "task")

    #: Task names warned once per process that their body cannot be interrupted where it runs.
    uninterruptible_warned: ClassVar[set[str]] = set()

    def __init__(self, task: Any, options: Options) -> None:
        self.task = task
        self.options = options
        self.name: str = task.name
        # ``__class__``, not ``type()``: a task not yet bound to a finalized app is Celery's PromiseProxy, whose
        # ``__class__`` is the task's class (a callable option read on the class is not bound as a method).
        self.cls: Any = task.__class__
        self._request: Any = None

    @property
    def request(self) -> Any:
        """The request of this call or delivery: the task's current one when first read, then kept (a Context lives
        for one call or one delivery, in its thread; each read of ``task.request`` is a thread-local stack lookup
        through three Python calls, and a skip read it four times)."""
        request = self._request
        if request is None:
            request = self._request = self.task.request
        return request

    # -- keys ------------------------------------------------------------------------------------------------

    def key(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> str:
        """The lock key of a call with these arguments."""
        options = self.options
        if options.key_fn is not None:
            return custom_key(options.settings.prefix, options.space, options.key_fn, args, kwargs)
        return lock_key(
            options.settings.prefix, options.space, options.binder, args, kwargs, unique_on=options.unique_on
        )

    def key_for(self, *args: Any, **kwargs: Any) -> str:
        """:meth:`key` of ``f(*args, **kwargs)``."""
        return self.key(args, kwargs)

    def limit_for(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> int | None:
        """How many runs of this call's key may hold it at once (the limit feature's answer for them)."""
        return LIMIT.for_call(self.cls, self.name, args, kwargs)

    # -- the lock ----------------------------------------------------------------------------------------------

    def new_lock(self, key: str, task_id: str, retries: int, limit: int | None = None, scan: int = 0) -> Redlock:
        """A run's lock on ``key``: its holder record says who holds it (this task, worker, try)."""
        options = self.options
        settings = options.settings
        if limit is None:
            limit = LIMIT.static(self.cls)
        record = {
            "state": RUNNING,
            "name": self.name,
            "worker": worker_id(),
            "at": str(int(time.time() * 1000)),
            "try": str(retries),
        }
        if options.policy.hands_on and not retries:
            # "cancel": when this call first reached a worker, so that an older call meeting its run is superseded
            # by it instead of asking it to stop (cancel.lua compares). Not known for a retry or a broker's
            # redelivery (they carry no such header: "now" would make an old call look new): no field, asked as before.
            request = self.request
            if getattr(request, SINCE_HEADER, None) is not None or not (request.delivery_info or {}).get("redelivered"):
                record["since"] = str(since(request))
        return Redlock(
            settings.nodes,
            key,
            ttl=options.ttl,
            fence_key=settings.fence_key,
            job=task_id,
            limit=limit,
            scan=scan,
            record=record,
        )

    # -- what a feature needs of Celery (policies import none of it) -------------------------------------------

    @staticmethod
    def dumps(value: Any) -> str:
        """``value`` as Celery's JSON (kombu's: dates, UUIDs, decimals as a message carries them)."""
        return str(kombu_json.dumps(value))  # type: ignore[no-untyped-call]

    @staticmethod
    def loads(text: str) -> Any:
        """:meth:`dumps`' text read back."""
        return kombu_json.loads(text)  # type: ignore[no-untyped-call]

    @staticmethod
    def new_id() -> str:
        """A new task id (Celery's)."""
        return str(uuid())

    def ended(self, task_id: str) -> bool:
        """The result backend holds a final state for ``task_id`` (raises when it cannot tell)."""
        return self.task.backend.get_state(task_id) in READY_STATES

    def signal(self, name: str, **fields: Any) -> None:
        """Send the package's signal ``name`` (:mod:`celery_singleton_lock.signals`) for this task."""
        getattr(signals, name).send(sender=self.task, **fields)

    def count(self, event: str) -> None:
        """Count one ``event`` (an outcome of :data:`celery_singleton_lock.metrics.OUTCOMES`) for this task: in
        memory, written to Redis by the watchdog (no I/O here)."""
        settings = self.options.settings
        watchdog().count(settings.nodes, settings.prefix, event, self.name)

    # -- loss --------------------------------------------------------------------------------------------------

    def on_lost(self, task_id: str, target: Target | None, lease: Lease, reason: str) -> None:
        """Called in the watchdog's thread when renewal fails."""
        self.count("lost")
        name = self.name
        signals.lock_lost.send(sender=self.task, key=lease.lock.name, task_id=task_id, reason=reason)
        logger.warning(
            "Lock %s of %s[%s] LOST while running: %s; %s",
            lease.lock.name,
            name,
            task_id,
            reason,
            "interrupting the body (lock_on_lost='interrupt')"
            if target is not None and target.armed
            else "the task should stop before further side effects (self.check_lock() raises from now on)",
        )
        if target is not None:
            target.fire(LockLostError(f"lock {lease.lock.name} of {name} lost: {reason}", key=lease.lock.name))

    def on_cancel(self, run: Run, target: Target | None, lease: Lease, by: str) -> None:
        """lock_on_duplicate="cancel": called in the watchdog's thread when a renewal finds the job asked to stop."""
        run.cancelled_by = by
        logger.warning(
            "%s[%s] of lock %s is %s: %s",
            self.name,
            run.task_id,
            lease.lock.name,
            describe(by),
            "interrupting the body" if target is not None and target.armed else "self.check_lock() raises from now on",
        )
        if target is not None:
            target.fire(error_for(lease.lock.name, by, self.name))

    def arm(self, run: Run, target: Target) -> None:
        """lock_on_lost="interrupt": make this run's body interruptible where it runs (see the interrupt module)."""
        if target.arm():
            run.interrupt = target
        elif self.name not in Context.uninterruptible_warned and (
            self.options.on_lost == "interrupt" or self.options.on_duplicate == "cancel"
        ):
            Context.uninterruptible_warned.add(self.name)
            logger.warning(
                "%s has lock_on_lost='interrupt', but its body runs in a thread other than the main one (threads or "
                "eventlet pool, an in-process test worker): it is NOT interrupted when its lock is lost; use the "
                "prefork, solo or gevent pool, or call self.check_lock() before side effects",
                self.name,
            )

    @staticmethod
    def disarm(run: Run) -> None:
        """The body has ended: a loss noticed from now on must not interrupt what follows."""
        if run.interrupt is not None:
            run.interrupt.disarm()
            run.interrupt = None
