"""LockedTask: a Celery ``Task`` base class that runs each job at most once at a time.

::

    @app.task(base=LockedTask, lock_ttl=30)
    def rebuild_report(account_id: int, month: str = "current") -> None: ...

Life of one delivery (the tracer calls ``before_start``, then ``__call__``, then stores the result)::

    before_start   key = prefix + task name + hash(bound arguments); one acquire round trip to every node at once;
                   the lock's value is a holder record (owner, fence, state, job = task id, name, worker, at)
      |- acquired ..................... run: the watchdog renews the lease every ttl/3 while the body runs
      |- this task id is done ......... (its done marker exists) stop: never run a finished job again
      |- held by a different job ...... duplicate: skip (REVOKED at once, naming the holder) / fail / reschedule
      |- held by this same task id .... a redelivery (acks_late, visibility timeout): never skipped, never run
      |                                 beside its live twin: re-sent with a countdown of the remaining lease
      |- handed over by self.retry() .. this is the retry: take the lock over atomically and run
      |- split vote ................... retried at once with jitter, then re-sent soon: never a duplicate
      '- no quorum answered ........... retry with back-off (default) / fail / run unguarded
    __call__       the body runs; its ``finally`` releases the lock (owner-checked) BEFORE the tracer stores
                   the result, so a caller who waits for the result and re-enqueues at once is never skipped; a
                   success also leaves the task id's done marker, in the same round trip

Which branch is taken is decided by one pure function, :func:`celery_singleton_lock.decision.decide`, from the
facts gathered here; this module only gathers facts and carries the action out.

Deciding in ``before_start`` and returning early from ``__call__`` costs about as much as a no-op task; raising
``Ignore`` or ``Reject`` from ``before_start`` costs ~35-47x that (the tracer builds and formats a traceback), and
a duplicate storm is all skips. A delivery that does not run therefore returns a :class:`Skipped` marker from
``__call__`` with ``request.ignore_result`` set, so the tracer stores nothing over the outcome we stored (or over
the twin's), and its callbacks, chain and chord are cleared (the re-sent copy carries them). Celery still
logs it as "succeeded" with the marker as return value and sends ``task_success``; use our signals instead.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import difflib
import functools
import inspect
import logging
import math
import os
import random
import socket
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Final, cast

import click
from celery import Task, bootsteps
from celery.exceptions import Ignore, Reject, Retry
from celery.signals import task_revoked, worker_process_shutdown
from celery.states import READY_STATES
from celery.utils import uuid
from celery.worker.request import Request
from kombu.utils import json as kombu_json
from kombu.utils.imports import symbol_by_name

from . import signals
from .config import DuplicatePolicy, LockSettings, LostPolicy, UnavailablePolicy, check_policy, check_ttl, settings_for
from .decision import (
    SPLIT_RETRIES,
    Act,
    Decision,
    Facts,
    Outcome,
    decide,
)
from .errors import ConfigurationError, DuplicateTaskError, LockLostError, LockUnavailableError
from .interrupt import Target, outside_body
from .keys import Binder, custom_key, lock_key
from .record import COOLDOWN, ENDING, HANDOVER, QUEUED, RUNNING, SENDING, sibling_key
from .redlock import Redlock
from .renewal import Lease, flush_stats, watchdog

# The waiting line's scripts (lua/pop_waiter.lua, lua/park_replacing.lua), run with EVAL by their code.
from .scripts import PARK_REPLACING_CODE as _PARK_REPLACING
from .scripts import POP_WAITER_CODE as _POP_WAITER

__all__ = [
    "SKIP_MARK",
    "LockedRequest",
    "LockedTask",
    "Skipped",
    "StartProblem",
    "check_start",
    "parse_skipped",
    "start_problems",
]

logger = logging.getLogger("celery_singleton_lock.task")

_END_LEASE = 1.0
_HOST = socket.gethostname()
#: The holder record's ``worker`` field: this process (a prefork child, not the parent that imported us).
_worker = f"{os.getpid()}@{_HOST}"


def _after_fork() -> None:
    global _worker  # noqa: PLW0603 - one per process
    _worker = f"{os.getpid()}@{_HOST}"


os.register_at_fork(after_in_child=_after_fork)
# apply_async options under which the enqueue check stands aside: the message must go out as asked.
_DEFERRED_OR_GROUPED = frozenset({"countdown", "eta", "chord", "group_id", "chain"})
_ATTEMPT_HEADER = "singleton_lock_attempt"
_REDELIVERY_HEADER = "singleton_lock_waited"
_SETTLE_HEADER = "singleton_lock_settle"
# A rescheduled duplicate's copies: the fallback re-send ("parked") and the copy a releasing holder wakes ("woken").
_PARKED_HEADER = "singleton_lock_parked"
_WOKEN_HEADER = "singleton_lock_woken"
_SINCE_HEADER = "singleton_lock_since"  # when a waiting call first reached a worker (ms): "replace" keeps the newest
# A retry is a new attempt: it inherits none of these (see LockedTask.retry).
_OWN_HEADERS = frozenset(
    {_ATTEMPT_HEADER, _REDELIVERY_HEADER, _SETTLE_HEADER, _PARKED_HEADER, _WOKEN_HEADER, _SINCE_HEADER}
)
#: How long a key's waiting line outlives its last change, at least (each park refreshes it).
WAITERS_TTL = 600.0
#: Queue scope: seconds a reservation waits for its message to start, beyond its countdown (``lock_queue_ttl``).
DEFAULT_QUEUE_TTL = 600.0
#: Queue scope: how long a duplicate call waits for another call's publish under way before it sends a copy of that
#: call's job (same task id; see LockedTask._reserve).
SENDING_WAIT = 2.0
_SCOPES = ("run", "queue")
# apply_async options whose messages are reserved at the worker only (a chord counts its members' own ids).
_GROUPED = frozenset({"chord", "group_id", "chain"})
#: Seconds a copy that found its job done, but no result stored, waits before saying so (see _settle_done).
SETTLE_GRACE = 10.0


#: How a Skipped's repr begins: what a worker's main process (which sees only the repr) and the log filter look for.
SKIP_MARK = "<celery_singleton_lock.Skipped:"
#: The Celery event a worker sends for each kind of Skipped, instead of task-succeeded (None: no event at all).
_KIND_EVENT: dict[str, str | None] = {
    "duplicate": "task-revoked",  # another job holds the lock: REVOKED
    "settled": "task-revoked",  # a copy of a job whose run succeeded but was killed before storing its result
    "deferred": "task-retried",  # a first delivery re-sent to run later (reschedule, replace, outage back-off, ...)
    # A copy of a job that succeeded, or one waiting for its twin: the task id's state is its twin's, so nothing is
    # said (a task-retried after the twin's task-succeeded would turn SUCCESS into RETRY in Celery's event state).
    "done": None,
    "waiting": None,
}


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


def parse_skipped(text: str) -> tuple[str, str | None, str] | None:
    """``(kind, holder task id, reason)`` from a :class:`Skipped` repr (what the worker's main process sees).

    A repr cut short keeps its kind; the holder is None when its id was cut, and the reason is what is left.
    """
    if not text.startswith(SKIP_MARK):
        return None
    kind, colon, rest = text[len(SKIP_MARK) :].partition(":")
    if kind not in _KIND_EVENT or not colon:
        return None
    size, colon, rest = rest.partition(":")
    if not colon or not size.isdigit() or len(rest) < int(size):
        return kind, None, ""
    holder, reason = rest[: int(size)], rest[int(size) + 1 :]
    return kind, holder or None, reason.removesuffix(">")


class _SkipLogFilter(logging.Filter):
    """Rewrite Celery's "Task x[id] succeeded in ...: <Skipped ...>" line to say what happened instead."""

    _SAYS: ClassVar[dict[str, str]] = {
        "duplicate": "skipped duplicate",
        "done": "skipped: already done",
        "settled": "skipped: already done, result lost",
        "deferred": "deferred",
        "waiting": "deferred",
    }

    def filter(self, record: logging.LogRecord) -> bool:
        data = record.args
        if isinstance(data, dict):
            value = data.get("return_value")
            if isinstance(value, str) and value.startswith(SKIP_MARK):
                parsed = parse_skipped(value)
                if parsed is not None:
                    kind, _, reason = parsed
                    record.msg = "Task %(name)s[%(id)s] " + self._SAYS[kind] + " in %(runtime)ss: %(reason)s"
                    record.args = {**data, "reason": reason}
        return True


# Celery's tracer logs a task's success through this logger (celery/app/trace.py, LOG_SUCCESS).
logging.getLogger("celery.app.trace").addFilter(_SkipLogFilter())


@dataclass
class _Run:
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
    parked: bool = False  # this delivery's job waits in the key's waiting line (see LockedTask._park)
    superseded_by: str | None = None  # "replace": the newer job that took this one's place in the line
    interrupt: Target | None = None  # lock_on_lost="interrupt": the body to interrupt when the lock is lost


@dataclass(frozen=True)
class _Options:
    """A task's resolved options: the app's settings overlaid with the task's ``lock_*`` attributes."""

    settings: LockSettings
    ttl: float
    interval: float
    on_duplicate: DuplicatePolicy
    on_unavailable: UnavailablePolicy
    on_lost: LostPolicy
    binder: Binder | None  # the body's signature, ready to bind calls to (None: no usable signature)
    max_countdown: float | None  # half the broker's visibility timeout, if it has one
    done_window: float  # how long a finished job's done marker lives when a copy of it is known to wait
    done_window_short: float  # ... and when none is
    whole_seconds: bool  # countdowns go through native delayed delivery (RabbitMQ quorum queues): whole seconds >= 1

    @property
    def waits_in_line(self) -> bool:
        """A duplicate waits in its key's line, woken by a holder's release (only these policies' holders wake it)."""
        return self.on_duplicate in ("reschedule", "replace")


#: A finished job's done marker outlives the longest wait we create (a ttl), or the broker's visibility timeout,
#: by this margin: a copy that starts this much later than it was due may run the job again (without a backend).
DONE_MARGIN = 300.0


def _visibility_timeout(app: Any) -> float | None:
    """The broker's effective visibility timeout in seconds (Redis, SQS), or None for brokers without one.

    An explicit ``broker_transport_options["visibility_timeout"]`` wins; otherwise the transport's own default
    (kombu: 3600 s for Redis, 1800 s for SQS), read from its channel class without connecting.
    """
    explicit = (app.conf.broker_transport_options or {}).get("visibility_timeout")
    if isinstance(explicit, int | float) and not isinstance(explicit, bool) and explicit > 0:
        return float(explicit)
    try:
        channel = getattr(app.connection_for_write().transport, "Channel", None)
    except Exception:  # an unknown or unimportable transport: no visibility timeout we could know of
        logger.debug("cannot read the broker transport's visibility timeout", exc_info=True)
        return None
    for attr in ("visibility_timeout", "default_visibility_timeout"):
        value = getattr(channel, attr, None)
        if isinstance(value, int | float) and not isinstance(value, bool) and value > 0:
            return float(value)
    return None


def _native_delayed_delivery(app: Any) -> bool:
    """True when Celery sends countdowns through RabbitMQ's native delayed delivery (quorum queues, Celery 5.5+).

    Celery then rounds a countdown down to whole seconds, and kombu raises ValueError for one below 1 s.
    """
    try:
        from celery.utils.quorum_queues import detect_quorum_queues  # noqa: PLC0415 - Celery >= 5.5 only

        driver = app.connection_for_write().transport.driver_type
        return bool(detect_quorum_queues(app, driver)[0])
    except Exception:  # older Celery, or a transport we cannot inspect: no native delayed delivery
        logger.debug("cannot tell whether quorum queues are used", exc_info=True)
        return False


def _delay_of(options: dict[str, Any]) -> float:
    """Seconds until a message sent with these options is due (its countdown or ETA), 0 when due now."""
    countdown, eta = options.get("countdown"), options.get("eta")
    if eta is not None:
        if isinstance(eta, str):
            eta = dt.datetime.fromisoformat(eta)
        aware = eta if eta.tzinfo is not None else eta.replace(tzinfo=dt.timezone.utc)
        return max(0.0, (aware - dt.datetime.now(dt.timezone.utc)).total_seconds())
    return max(0.0, float(countdown or 0))


def _expires_in(expires: Any) -> float | None:
    """Seconds until a message with this ``expires`` option expires (None: it does not)."""
    if expires is None:
        return None
    if isinstance(expires, dt.datetime):
        aware = expires if expires.tzinfo is not None else expires.replace(tzinfo=dt.timezone.utc)
        return (aware - dt.datetime.now(dt.timezone.utc)).total_seconds()
    if isinstance(expires, str):
        return _expires_in(dt.datetime.fromisoformat(expires))
    return float(expires)


@task_revoked.connect(weak=False)  # type: ignore[untyped-decorator]
def _free_revoked_reservation(sender: Any = None, request: Any = None, **_: Any) -> None:
    """A worker met a revoked or expired message of a queue-scope job: free the job's reservation at once."""
    # Celery sends the task as sender and the delivery's Context as request (whose "task" is only a name).
    task = sender
    if not isinstance(task, LockedTask) or task.lock_scope != "queue" or request is None:
        return
    try:
        key = task.lock_key_for(*(request.args or ()), **(request.kwargs or {}))
        task._free_reservation(request.id, key)  # noqa: SLF001
    except Exception:  # the reservation still ends with its lease
        logger.warning("could not free the reservation of %s[%s]", task.name, request.id, exc_info=True)


def _since(request: Any) -> int:
    """When this call first reached a worker (ms), carried by its re-sent copies; now for a first delivery."""
    since = getattr(request, _SINCE_HEADER, None)
    return int(since) if isinstance(since, int | str) and str(since).isdigit() else int(time.time() * 1000)


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _try_of(record: dict[str, str]) -> int | None:
    """The holder record's ``try`` (its delivery's retries), None when absent or not a plain decimal number."""
    value = record.get("try", "")
    return int(value) if value.isascii() and value.isdigit() else None


class _StartError(ConfigurationError, click.ClickException):  # type: ignore[misc]
    """Invalid configuration found by a check of :func:`start_problems` or at a task's registration: still a
    ConfigurationError for code that starts workers or registers tasks itself (``app.Worker()``, ``start_worker``,
    pytest), and a ClickException, so any ``celery`` command (``worker``, ``beat``, ``locks``) prints one line,
    ``Error: celery_singleton_lock: ...``, and exits with status 1 instead of a traceback through Celery's app
    finalization or bootsteps."""

    def __init__(self, message: str) -> None:
        click.ClickException.__init__(self, message)
        self.key = None  # as every LockError has

    def format_message(self) -> str:
        return f"celery_singleton_lock: {self.message}"


def _check_limit(name: str, limit: int, on_duplicate: str) -> None:
    if limit > 1 and on_duplicate == "replace":
        raise ConfigurationError(
            f"lock_limit of {name} cannot be used with lock_on_duplicate='replace' (keep-latest means one run of a "
            "key): use 'reschedule', 'skip' or 'fail'"
        )


# Options of other libraries that fall into our namespace: a task migrating from them is told what to use.
_PEER_OPTIONS: Final = {"lock_expiry": "lock_ttl (celery-singleton's lock_expiry; ours is renewed while it runs)"}


def _known_options(cls: type) -> set[str]:
    """The ``lock_*`` options of ``cls``: every ``lock_*`` name annotated on it or a base (LockedTask's own, and a
    subclass's that declares more the same way, ``lock_x: ClassVar[int] = 0``)."""
    return {
        name
        for klass in cls.__mro__
        for name in vars(klass).get("__annotations__", {})
        if isinstance(name, str) and name.startswith("lock_")
    }


def _unknown_options(cls: type) -> list[str]:
    """``lock_*`` attributes of ``cls`` that are no option: misspelt or unsupported options.

    Celery passes ``@app.task(...)`` options (and ``task_annotations``) as class attributes of a generated class,
    which it marks ``_decorated``: every ``lock_*`` name there is an option. In a class written as a class body, a
    ``lock_*`` method or property is the subclass's own (a helper); a plain value is meant as an option.
    """
    known = _known_options(cls)
    unknown: list[str] = []
    for name in sorted(n for n in dir(cls) if n.startswith("lock_") and n not in known):
        owner = next((k for k in cls.__mro__ if name in vars(k)), None)
        if owner is None:
            continue
        value = vars(owner)[name]
        generated = vars(owner).get("_decorated") is True
        if generated or not (inspect.isroutine(value) or isinstance(value, staticmethod | classmethod | property)):
            unknown.append(name)
    return unknown


def _check_options(task: Any, settings: LockSettings | None = None) -> None:
    """Validate a LockedTask's ``lock_*`` options (a class or an instance); raises ConfigurationError naming the first
    bad one. With ``settings``, also what only they make invalid (a ``lock_limit`` with a default of 'replace')."""
    cls: Any = task if isinstance(task, type) else type(task)
    name = cls.name
    unknown = _unknown_options(cls)
    if unknown:
        known = sorted(_known_options(cls))
        hints = []
        for option in unknown:
            if option in _PEER_OPTIONS:
                hints.append(f"{option}: use {_PEER_OPTIONS[option]}")
            else:
                # Compared without the shared "lock_", which alone would make every name look close.
                close = difflib.get_close_matches(option[5:], [k[5:] for k in known], n=1)
                hints.append(f"{option} (did you mean lock_{close[0]}?)" if close else option)
        raise ConfigurationError(
            f"unknown option(s) of {name}: {', '.join(hints)}; LockedTask's options are {', '.join(known)}"
        )
    if isinstance(cls.lock_cooldown, bool) or not isinstance(cls.lock_cooldown, int | float) or cls.lock_cooldown < 0:
        raise ConfigurationError(f"lock_cooldown of {name} must be a number of seconds >= 0, got {cls.lock_cooldown!r}")
    if cls.lock_ttl is not None:
        check_ttl(cls.lock_ttl, f"lock_ttl of {name}")
    if cls.lock_scope not in _SCOPES:
        raise ConfigurationError(f"lock_scope of {name} must be 'run' or 'queue', got {cls.lock_scope!r}")
    check_ttl(cls.lock_queue_ttl, f"lock_queue_ttl of {name}")
    limit = cls.lock_limit
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
        raise ConfigurationError(f"lock_limit of {name} must be a whole number >= 1, got {limit!r}")
    if limit > 1 and cls.lock_scope != "run":
        raise ConfigurationError(f"lock_limit of {name} works with lock_scope='run' only: remove one of them")
    if limit > 1 and cls.lock_enqueue_check:
        raise ConfigurationError(
            f"lock_limit of {name} cannot be used with lock_enqueue_check (N runs of a key are allowed)"
        )
    if cls.lock_on_duplicate is not None:
        check_policy(cls.lock_on_duplicate, DuplicatePolicy, f"lock_on_duplicate of {name}")
    if cls.lock_on_unavailable is not None:
        check_policy(cls.lock_on_unavailable, UnavailablePolicy, f"lock_on_unavailable of {name}")
    check_policy(cls.lock_on_lost, LostPolicy, f"lock_on_lost of {name}")
    if cls.lock_key is not None and not callable(cls.lock_key):
        raise ConfigurationError(f"lock_key of {name} must be a function returning a string")
    if cls.lock_unique_on is not None and (
        isinstance(cls.lock_unique_on, str) or not all(isinstance(n, str) for n in cls.lock_unique_on)
    ):
        raise ConfigurationError(f"lock_unique_on of {name} must be a list of argument names")
    request_cls = cls.Request
    if isinstance(request_cls, str):
        request_cls = symbol_by_name(request_cls)  # type: ignore[no-untyped-call]
    if not (isinstance(request_cls, type) and issubclass(request_cls, LockedRequest)):
        raise ConfigurationError(
            f"Request of {name} must subclass celery_singleton_lock.LockedRequest (it reports skipped "
            f"duplicates to monitors as REVOKED, not as successes), got {cls.Request!r}"
        )
    on_duplicate = cls.lock_on_duplicate or (settings.on_duplicate if settings is not None else None)
    if on_duplicate is not None:
        _check_limit(name, limit, on_duplicate)


@dataclass(frozen=True)
class StartProblem:
    """One reason a worker refuses to start: an invalid setting, or a LockedTask's invalid option."""

    subject: str  #: ``settings``, ``task <name>``, or ``tasks`` (a registration refused, its task not registered)
    message: str  #: what is wrong and what to change, one line

    @property
    def code(self) -> str:
        """The doctor's finding code: ``settings`` or ``task-options``."""
        return "settings" if self.subject == "settings" else "task-options"


def start_problems(app: Any) -> list[StartProblem]:
    """Every check a worker runs at start, in order: the ``singleton_lock_*`` settings, then each registered
    LockedTask's options, alone and with the settings. Empty when the worker may start.

    The worker's start step (first problem: one line, exit 1), ``celery beat -S singleton`` and ``locks doctor``
    (every problem: an error finding) all run this one function, so what one refuses the others refuse too. Reads
    ``app.tasks``, which finalizes the app and so registers (binds) its pending tasks: a task refused there is a
    problem too, and the tasks it kept from registering are not checked.
    """
    problems: list[StartProblem] = []
    try:
        settings: LockSettings | None = settings_for(app)
    except ConfigurationError as exc:
        settings = None
        problems.append(StartProblem("settings", str(exc)))
    refused: str | None = None
    try:
        tasks = dict(app.tasks)
    except ConfigurationError as exc:  # a task's registration refused it; the tasks finalized so far stay registered
        refused = str(exc)
        tasks = dict(app.tasks)
    for name in sorted(tasks):
        task = tasks[name]
        if not isinstance(task, LockedTask):
            continue
        try:
            _check_options(task, settings)
        except ConfigurationError as exc:
            problems.append(StartProblem(f"task {name}", str(exc)))
    if refused is not None and refused not in {p.message for p in problems}:
        problems.append(StartProblem("tasks", refused))
    return problems


def check_start(app: Any) -> LockSettings:
    """:func:`start_problems`, raising the first as a one-line error (``Error: celery_singleton_lock: ...`` under
    the ``celery`` command); the app's settings when there is none."""
    problems = start_problems(app)
    if problems:
        raise _StartError(problems[0].message)
    return settings_for(app)


class _SettingsStep(bootsteps.Step):  # type: ignore[misc]
    """Worker bootstep: run :func:`start_problems` at worker start, so bad settings or task options stop the worker
    at once with one line."""

    name = "celery_singleton_lock.settings"

    def __init__(self, parent: Any, **kwargs: Any) -> None:
        try:
            settings = check_start(parent.app)
        except _StartError as exc:
            if getattr(parent, "logfile", None):
                # A detached worker (celery multi, --detach) sends stderr to /dev/null: say it in its logfile too.
                logger.error("%s", exc.format_message())  # noqa: TRY400 - one line, no traceback
            raise
        logger.info("celery_singleton_lock: %s", settings.describe())
        _warn_about_broker(parent.app)
        _warn_about_pool(parent)
        super().__init__(parent, **kwargs)


def _warn_about_broker(app: Any) -> None:
    """Log, once at worker start, each broker setting that weakens a guarantee (the doctor's Celery-side checks)."""
    try:
        from .doctor import broker_findings  # noqa: PLC0415 - the doctor imports this module

        findings = broker_findings(app)
    except Exception:  # a check that cannot run must never stop the worker
        logger.debug("broker checks failed", exc_info=True)
        return
    for finding in findings:
        if finding.level in ("error", "warning"):
            logger.warning("celery_singleton_lock: %s: %s; %s", finding.subject, finding.message, finding.fix)


# Pools whose bodies run in threads of one process (eventlet's green threads included): nothing can raise in them.
_THREAD_POOLS = frozenset({"celery.concurrency.thread", "celery.concurrency.eventlet"})


def _warn_about_pool(worker: Any) -> None:
    """Say at worker start which lock_on_lost='interrupt' tasks this pool cannot interrupt.

    A warning, not a refusal: one app is often served by several workers with different pools and queues, and a
    threads worker that never receives those tasks is fine; a body that does run there warns again when it starts.
    """
    pool = getattr(getattr(worker, "pool_cls", None), "__module__", None)
    if pool not in _THREAD_POOLS:
        return
    names = sorted(
        t.name for t in list(worker.app.tasks.values()) if isinstance(t, LockedTask) and t.lock_on_lost == "interrupt"
    )
    if names:
        logger.warning(
            "celery_singleton_lock: lock_on_lost='interrupt' of %s cannot work in the %s pool (a body in a thread "
            "cannot be interrupted): use the prefork, solo or gevent pool for them",
            ", ".join(names),
            pool.rsplit(".", 1)[-1],
        )


@worker_process_shutdown.connect(weak=False)  # type: ignore[untyped-decorator]
def _flush_stats_at_exit(**_: Any) -> None:
    """A pool child exits (worker_max_tasks_per_child, shutdown) with up to 5 s of unflushed counters: flush them."""
    try:
        flush_stats()
    except Exception:  # never block a child's exit; the counters are only statistics
        logger.debug("flushing lock counters at exit failed", exc_info=True)


class LockedRequest(Request):  # type: ignore[misc]
    """The worker's request for a LockedTask: after a hard time limit, end the killed run's lease within ~1 s.

    Celery handles a hard time limit in the worker's main process (``Request.on_timeout``), where this request
    knows the pool child that ran the task (``worker_pid``); ``after_return`` there is given no request, so it
    could not tell the killed run from another delivery of the same task id. A SIGKILLed or OOM-killed child gets
    no such call: its lease simply runs out, within ttl. A task that names its own ``Request`` class must subclass
    this one.
    """

    def send_event(self, type_: str, **fields: Any) -> None:
        """Report a delivery that returned a :class:`Skipped` marker as what it was, not as a success.

        The pool child's tracer hands the main process only the repr of the return value, and the main process
        sends ``task-succeeded`` from there (``Request.on_success``): a skip becomes ``task-revoked`` (REVOKED in
        Flower and ``celery events``) and a re-send ``task-retried`` (RETRY, until the re-sent copy's own events),
        each with ``reason``, ``holder`` (the holder's task id, when there is one) and ``lock_skip`` (the kind).
        """
        if type_ == "task-succeeded":
            result = fields.get("result")
            if isinstance(result, str) and result.startswith(SKIP_MARK):
                parsed = parse_skipped(result)
                if parsed is not None:
                    kind, holder, reason = parsed
                    event = _KIND_EVENT[kind]
                    if event is None:
                        return
                    extra = {"reason": reason, "holder": holder, "lock_skip": kind}
                    if event == "task-retried":
                        fields = {"exception": reason, "traceback": "", **extra}
                    else:
                        # Flower shows only Celery's own task fields: the reason goes in "exception" too.
                        fields = {"terminated": False, "signum": None, "expired": False, "exception": reason, **extra}
                    type_ = event
        super().send_event(type_, **fields)

    def on_timeout(self, soft: bool, timeout: float) -> None:  # noqa: FBT001 - Celery's signature
        super().on_timeout(soft, timeout)
        task = self.task
        if soft or not isinstance(task, LockedTask) or not self.worker_pid:
            return
        try:
            key = task.lock_key_for(*(self.args or ()), **(self.kwargs or {}))
            task._end_lease_of(self.id, key, f"{self.worker_pid}@{_HOST}")  # noqa: SLF001
        except Exception:
            logger.exception("could not end the lease of %s[%s]", task.name, self.id)


class LockedTask(Task):  # type: ignore[misc]
    """A task that runs at most once at a time per (task name, arguments).

    Options (on the decorator, ``@app.task(base=LockedTask, lock_ttl=30)``, or as class attributes):

    ``lock_ttl``
        lease in seconds (default ``singleton_lock_ttl``, 60). Renewed every ``ttl * renew_fraction`` while the
        body runs, so a task may run far longer than its ttl; a holder that dies frees the lock within ttl.
    ``lock_unique_on``
        names of the arguments that make two calls the same job (default: all of them).
    ``lock_key``
        a function taking the task's arguments and returning the key's distinguishing part (a string).
    ``lock_on_duplicate``
        ``"skip"`` (REVOKED at once, naming the holder), ``"fail"`` (FAILURE with DuplicateTaskError),
        ``"reschedule"`` (wait in the key's line, woken by the holder's release; run after it) or ``"replace"``
        (like reschedule, but a newer duplicate takes the waiting one's place: keep-latest). Chord members always
        reschedule: a skipped member would fail the chord, and one that stored nothing would hang it.
    ``lock_on_unavailable``
        when no quorum of Redis nodes answers: ``"retry"`` with back-off (default: never unguarded, never
        dropped), ``"fail"`` (FAILURE with LockUnavailableError), or ``"run"`` unguarded with a warning.
    ``lock_enqueue_check``
        ``True``: ``apply_async``/``delay`` first look (one round trip) whether a run of the same job holds the lock
        right now, and then return *that run's* ``AsyncResult`` instead of sending a duplicate (celery-singleton's
        behaviour, and no queue pile-up while a job runs). Not for calls with a countdown/eta, links, groups or
        chords, and never a guarantee: the run-time check in the worker stays the guard. Default False.
    ``lock_cooldown``
        seconds the job stays locked after a *success* (default 0): the same job sent meanwhile is a duplicate of
        the finished run ("at most once per cooldown", sidekiq's until_expired, celery-once's hold-until-timeout).
        A failure never holds the lock.

    ``lock_scope``
        ``"run"`` (default): the job is locked while it runs: never two at once. ``"queue"``: the job is also
        reserved from ``apply_async``/``delay`` until it runs (through countdown, ETA and queue wait): a duplicate
        call meanwhile publishes nothing and returns the *queued or running job's* ``AsyncResult`` (or raises
        DuplicateTaskError under ``lock_on_duplicate="fail"``). The worker that runs the message takes the
        reservation over as the same task id. Group, chain and chord members are reserved at the worker only.
    ``lock_queue_ttl``
        queue scope: how long a reservation waits for its message to start, beyond its countdown/ETA (default
        600 s). Too short, and a backlog longer than that lets a second copy be published (the worker's run-time
        check still never runs two at once); too long, and a message lost by the broker blocks the job for that
        long (``revoke_queued`` frees it at once).
    ``lock_limit``
        at most this many runs of one key at once (default 1: never two at once). ``lock_limit=4`` with a key of
        the tenant (``lock_unique_on=["tenant_id"]``) runs up to 4 jobs per tenant at a time; a run that finds all
        4 slots held follows ``lock_on_duplicate`` (``"reschedule"``: it waits in line for a free slot). Each run
        holds one slot with everything a plain lock gives (renewal, loss detection, fencing token, release; a dead
        holder's slot frees within ttl), on the same quorum. A redelivered or retried job never takes a second
        slot. Run scope only, and not with ``"replace"`` or ``lock_enqueue_check`` (both mean "one of this job").
    ``lock_on_lost``
        what the body does when its lock is lost while it runs (renewal refused, or no quorum for one interval):
        ``"continue"`` (default: it goes on; ``self.check_lock()`` raises from then on) or ``"interrupt"``:
        :class:`LockLostError` is raised inside the body, in the prefork and solo pools (through a signal to the
        main thread, like the soft time limit) and gevent (thrown into the greenlet); not in the threads or eventlet
        pool (a warning says so). Best effort: code blocked in C sees it when it returns to Python.

    Inside the body, ``self.lock_held()`` (no I/O) says whether the lock is still ours, ``self.check_lock()``
    raises :class:`LockLostError` if not, and ``self.fencing_token`` is this run's fencing token.
    """

    lock_ttl: ClassVar[float | None] = None
    lock_unique_on: ClassVar[Sequence[str] | None] = None
    lock_key: ClassVar[Callable[..., str] | None] = None
    lock_on_duplicate: ClassVar[DuplicatePolicy | None] = None
    lock_on_unavailable: ClassVar[UnavailablePolicy | None] = None
    lock_enqueue_check: ClassVar[bool] = False
    lock_cooldown: ClassVar[float] = 0.0
    lock_scope: ClassVar[str] = "run"
    lock_queue_ttl: ClassVar[float] = DEFAULT_QUEUE_TTL
    lock_limit: ClassVar[int] = 1
    lock_on_lost: ClassVar[LostPolicy] = "continue"
    Request = "celery_singleton_lock.task:LockedRequest"

    _lock_options: _Options | None = None

    # -- registration ------------------------------------------------------------------------------------------

    @classmethod
    def bind(cls, app: Any) -> Any:
        """Validate the task's ``lock_*`` options at registration (Celery binds a decorated task when the app is
        finalized: at worker or beat start, or at the first ``app.tasks``); the settings are checked at start."""
        bound = super().bind(app)  # applies task_annotations first: they are options too
        try:
            _check_options(cls)
        except ConfigurationError as exc:
            raise _StartError(str(exc)) from None
        steps = app.steps["worker"]
        if _SettingsStep not in steps:
            steps.add(_SettingsStep)
        return bound

    def _options(self) -> _Options:
        options = self._lock_options
        if options is None:
            settings = settings_for(self.app)
            ttl = float(self.lock_ttl) if self.lock_ttl is not None else settings.ttl
            try:
                binder: Binder | None = Binder(inspect.signature(self.run))
            except (TypeError, ValueError):
                binder = None
            visibility = _visibility_timeout(self.app)
            on_duplicate = self.lock_on_duplicate or settings.on_duplicate
            _check_limit(self.name, self.lock_limit, on_duplicate)
            options = _Options(
                settings=settings,
                ttl=ttl,
                interval=ttl * settings.renew_fraction,
                on_duplicate=on_duplicate,
                on_unavailable=self.lock_on_unavailable or settings.on_unavailable,
                on_lost=self.lock_on_lost,
                binder=binder,
                # A message held unacked past the visibility timeout (a countdown waiting in the worker) is restored
                # by the broker and then exists twice: a copy re-sent every time it waits would multiply.
                max_countdown=visibility / 2 if visibility else None,
                done_window=max(2 * ttl, visibility or 0.0) + DONE_MARGIN,
                done_window_short=max(2 * ttl, 60.0),
                whole_seconds=_native_delayed_delivery(self.app),
            )
            self._lock_options = options
        return options

    def lock_key_for(self, *args: Any, **kwargs: Any) -> str:
        """The lock key of a call with these arguments (what ``celery locks`` lists)."""
        return self._key(self._options(), args, kwargs)

    def _key(self, options: _Options, args: Sequence[Any], kwargs: Mapping[str, Any]) -> str:
        prefix = options.settings.prefix
        key_fn = type(self).lock_key
        if key_fn is not None:
            return custom_key(prefix, self.name, key_fn, args, kwargs)
        return lock_key(prefix, self.name, options.binder, args, kwargs, unique_on=self.lock_unique_on)

    # -- the client side -----------------------------------------------------------------------------------------

    def apply_async(
        self,
        args: Any = None,
        kwargs: Any = None,
        task_id: str | None = None,
        producer: Any = None,
        link: Any = None,
        link_error: Any = None,
        shadow: str | None = None,
        **options: Any,
    ) -> Any:
        """Celery's apply_async; with ``lock_scope="queue"`` a call whose job is queued or running returns that job
        (see :meth:`_reserve`); with ``lock_enqueue_check``, a call whose job is running returns that run."""
        if (
            self.lock_scope == "queue"
            and not self.app.conf.task_always_eager
            and not _GROUPED.intersection(options)
            # A re-send of the delivery running here (self.retry(), a deferred copy): it is the job already.
            and not (task_id is not None and task_id == self.request.id)
        ):
            own_id = task_id is not None
            task_id = task_id or uuid()
            existing, lock, lease, stand_in = self._reserve(args or (), kwargs or {}, task_id, options, own_id=own_id)
            if existing is not None:
                return existing
            if stand_in is not None:
                # Another call's publish of this job is still under way (slow), or its producer died after it: its
                # message may exist or never will. This call sends a copy of THAT job (its task id, marked as a
                # copy): whichever arrives first runs it; the other finds the job held or done by its own id and
                # stops (one run). Never a second job: that is what ran a job twice.
                headers = {**(options.pop("headers", None) or {}), _REDELIVERY_HEADER: 1}
                sent = super().apply_async(
                    args,
                    kwargs,
                    task_id=stand_in,
                    producer=producer,
                    link=link,
                    link_error=link_error,
                    shadow=shadow,
                    headers=headers,
                    **options,
                )
                if self._options().on_duplicate == "fail":  # the job exists now, for sure: this call was its duplicate
                    raise DuplicateTaskError(
                        self.lock_key_for(*(args or ()), **(kwargs or {})), task_name=self.name, holder_task_id=stand_in
                    )
                return sent
            try:
                sent = super().apply_async(
                    args,
                    kwargs,
                    task_id=task_id,
                    producer=producer,
                    link=link,
                    link_error=link_error,
                    shadow=shadow,
                    **options,
                )
            except BaseException:
                if lock is not None:  # nothing was sent: nothing may stay reserved
                    lock.release()
                raise
            if lock is not None:
                # Sent: now a duplicate may be told to wait on it. (Refused when a worker took it over already.)
                lock.transfer(lease, {"state": QUEUED})
            return sent
        if self.lock_enqueue_check and not (
            link or link_error or self.app.conf.task_always_eager or _DEFERRED_OR_GROUPED.intersection(options)
        ):
            running = self._running_run(args or (), kwargs or {}, task_id)
            if running is not None:
                return running
        return super().apply_async(
            args, kwargs, task_id=task_id, producer=producer, link=link, link_error=link_error, shadow=shadow, **options
        )

    def _reserve(
        self, args: Any, kwargs: Any, task_id: str, options: dict[str, Any], *, own_id: bool
    ) -> tuple[Any, Redlock | None, float, str | None]:
        """Queue scope: reserve this call's job for ``task_id`` before it is published.

        Returns ``(existing, None, 0, None)`` when the job is already queued, running, being retried or cooling down
        (its ``AsyncResult``: nothing is to be sent), and ``(None, lock, lease, None)`` when this call reserved it.
        The reservation is "sending" until the message was published, then "queued"; it lasts ``lease`` s either
        way, and is released if the publish raises. A duplicate that finds it "sending" waits up to SENDING_WAIT
        for the publish; when it is still "sending" then (a slow publish, or a producer that died between its
        publish and marking it sent), ``(None, None, 0, holder)``: this call sends a copy of the holder's job under
        the holder's task id, never a job of its own, and never hands its caller the id of a message that may not
        exist without sending one. When Redis cannot tell (no quorum, a split that persists, an unknown holder),
        ``(None, None, 0, None)``: the message is sent, and the worker's run-time check is the guard.
        """
        key = self.lock_key_for(*args, **kwargs)
        options_ = self._options()
        wait = _delay_of(options)
        lease = wait + float(self.lock_queue_ttl)
        expires = _expires_in(options.get("expires"))
        if expires is not None:  # a message that expires unseen frees its job when it would have expired
            lease = min(lease, max(expires, 0.0) + 1.0)
        lease = max(lease, 0.01)
        lock = Redlock(
            options_.settings.nodes,
            key,
            # "sending" lasts the whole lease, not a few seconds: a producer that dies between its publish and
            # marking the reservation sent leaves a message that may wait in the queue for as long (a busy worker),
            # and the job must stay reserved for it. A producer that died before its publish leaves no message:
            # the next call's copy (see the stand-in above) runs the job under the reservation's id.
            ttl=lease,
            fencing=False,
            job=task_id,
            record={
                "state": SENDING,
                "name": self.name,
                "worker": _worker,
                "at": str(int(time.time() * 1000)),
                "open": "1",
            },
        )
        try:
            splits, deadline = 0, time.monotonic() + SENDING_WAIT
            for _ in range(int(SENDING_WAIT / 0.005) + SPLIT_RETRIES + 2):  # bounded in count and in time
                if lock.acquire(blocking=False):
                    return None, lock, lease, None
                if lock.split and splits < SPLIT_RETRIES:
                    # Contenders that split the nodes try again after a jittered pause.
                    splits += 1
                    time.sleep(random.uniform(0.005, 0.05))  # noqa: S311 - jitter
                    continue
                sending = (lock.holder_record or {}).get("state") == SENDING
                if not (lock.contended and sending) or time.monotonic() >= deadline:
                    break
                # Another call of the job is publishing right now (a double click): wait the few ms until its message
                # is sent (then this call gets it) or its publish failed (then this call reserves the job itself).
                time.sleep(0.005)
        except Exception:  # at enqueue, when in doubt, send: the worker's check is the guard
            logger.warning(
                "%s: could not reserve lock %s; sending (checked at the worker)", self.name, key, exc_info=True
            )
            return None, None, 0.0, None
        if lock.done:  # this very task id already ran
            return self.AsyncResult(task_id), None, 0.0, None
        record = lock.holder_record or {}
        holder, state = record.get("job"), record.get("state")
        policy = options_.on_duplicate
        if not lock.contended or holder is None or state in (ENDING, None):
            # Not a job that exists for sure (a run being ended, a record of no job): sent.
            return None, None, 0.0, None
        if state == SENDING and policy in ("reschedule", "replace"):
            return None, None, 0.0, None  # a job of its own, meant to run after the holder: sent, waits at the worker
        if holder == task_id and state != SENDING:  # sent again with its own id while queued or running: enough
            return self.AsyncResult(task_id), None, 0.0, None
        if holder == self.request.id and state == RUNNING:
            # The running job sends itself again from its body (its next run): sent, as in run scope; the worker
            # skips it if it arrives while this run still holds the job.
            return None, None, 0.0, None
        if policy in ("reschedule", "replace"):  # it runs after the holder: sent, and waits at the worker
            return None, None, 0.0, None
        signals.duplicate_skipped.send(sender=self, key=key, task_id=task_id, holder_task_id=holder, policy="queue")
        if policy == "fail" and state != SENDING:
            raise DuplicateTaskError(key, task_name=self.name, holder_task_id=holder)
        if state == SENDING:
            reason = f"duplicate of {self.name} sent as a copy of task {holder} (lock {key}: its publish is under way)"
        else:
            reason = f"duplicate of {self.name} not sent: lock {key} held by task {holder} ({state})"
        logger.debug("%s", reason)
        if own_id and holder != task_id and not self.ignore_result:
            # The caller chose this id and may wait on it: say at once what became of it (as a skip at the worker
            # would), not PENDING forever. The call still returns the existing job's result.
            try:
                self.backend.mark_as_revoked(task_id, reason, request=None)
            except Exception:
                logger.debug("could not store the duplicate state of %s", task_id, exc_info=True)
        if state == SENDING:
            return None, None, 0.0, holder
        return self.AsyncResult(holder), None, 0.0, None

    def revoke_queued(self, task_id: str, *args: Any, **kwargs: Any) -> bool:
        """Revoke a queue-scope job's message and free its reservation now (``args``/``kwargs``: the call's).

        ``AsyncResult.revoke()`` alone frees the reservation only when a worker meets the revoked message (at its
        countdown, or when it reaches the front of the queue). True when a reservation was freed and the message
        revoked; False when there was none (a worker had taken the job over already: it runs, or ran, and is left
        alone).
        """
        freed = self._free_reservation(task_id, self.lock_key_for(*args, **kwargs))
        if freed:  # revoked only while still queued: a running job is left alone (a revoke would mark it REVOKED)
            self.app.control.revoke(task_id)
        return freed

    def _free_reservation(self, task_id: str, key: str) -> bool:
        """Delete the queue-scope reservation of ``task_id`` on ``key``, if it is still one (not yet taken over)."""
        # While this holds the key (one round trip), its record says "ending": a duplicate sent meanwhile is sent.
        lock = Redlock(
            self._options().settings.nodes,
            key,
            ttl=_END_LEASE,
            fencing=False,
            job=task_id,
            record={"state": ENDING, "name": self.name},
        )
        if lock.acquire(blocking=False):  # nothing held it
            lock.release()
            return False
        record = lock.holder_record or {}
        if not (lock.contended and record.get("job") == task_id and record.get("state") == QUEUED):
            return False
        lock.replaces = lock.held_by  # atomic: only if the reservation's owner still holds it
        if lock.acquire(blocking=False):
            lock.release()
            return True
        return False

    def _running_run(self, args: Any, kwargs: Any, task_id: str | None) -> Any:
        """The AsyncResult of the run holding this call's lock right now, or None (also when Redis cannot tell).

        A call with its own ``task_id`` is always sent: its caller waits on that id, which another run's result
        would leave PENDING forever.
        """
        if task_id is not None:
            return None
        try:
            key = self.lock_key_for(*args, **kwargs)
            record = Redlock(self._options().settings.nodes, key).holder()
        except Exception:  # the worker's check is the guard; at enqueue, when in doubt, send
            logger.debug("enqueue check of %s failed; sending", self.name, exc_info=True)
            return None
        holder_id = record.get("job") if record else None
        if record is None or holder_id is None or record.get("state") in (ENDING, COOLDOWN):
            return None
        signals.duplicate_skipped.send(sender=self, key=key, task_id=None, holder_task_id=holder_id, policy="enqueue")
        logger.info("%s not sent: the same job is running as task %s (lock %s)", self.name, holder_id, key)
        return self.AsyncResult(holder_id)

    # -- the hot path --------------------------------------------------------------------------------------------

    def before_start(self, task_id: str, args: Any, kwargs: Any) -> None:
        """Gather the facts of this delivery, let :func:`~celery_singleton_lock.decision.decide` choose, act."""
        request = self.request
        options = self._options()
        key = self._key(options, args, kwargs)
        retries = int(request.retries or 0)
        run = _Run(key, task_id, retries)
        request._singleton_lock = run  # noqa: SLF001 - Celery's Context is our per-delivery state holder
        if options.on_duplicate == "replace" and getattr(request, _SINCE_HEADER, None):
            # A waiting job's copy: a newer one may have taken its place in the line meanwhile.
            newer = self._superseded_by(key, task_id, options)
            if newer is not None:
                self._replaced(run, task_id, newer)
                return
        lock = self._new_lock(key, task_id, options, retries)
        acquired = lock.acquire(blocking=False)
        redelivered = bool(
            getattr(request, _REDELIVERY_HEADER, None) or (request.delivery_info or {}).get("redelivered")
        )
        run.redelivered = redelivered
        if acquired and not redelivered:
            # The common case, without building the facts: decide(Facts("acquired", ...)) is RUN (tested).
            self._hold(run, lock, options, request)
            return
        facts = self._facts(lock, acquired, task_id, redelivered, options)
        for _ in range(2 * SPLIT_RETRIES + 4):  # each act below changes the facts; a few steps always settle
            decision = decide(facts)
            act = decision.act
            if act is Act.RUN:
                self._hold(run, lock, options, request)
                return
            if act is Act.LOOK_UP:
                facts = dataclasses.replace(facts, ended=self._already_ended(task_id))
                continue
            if act is Act.RETRY_NOW:
                # Contenders that arrived together split the nodes and nobody got a quorum (or the attempt that
                # sent this retry is still ending): try again after a jittered pause (Redlock's rule for a split),
                # instead of skipping every contender as the others' duplicate, or waiting a whole interval.
                time.sleep(random.uniform(0.005, 0.05))  # noqa: S311 - jitter
                acquired = lock.acquire(blocking=False)
                facts = self._facts(lock, acquired, task_id, redelivered, options, facts)
                facts = dataclasses.replace(facts, split_retries=facts.split_retries + 1)
                continue
            if act is Act.TAKE_OVER:
                # Our own retry's hand-over, or our queue-scope reservation: take it over atomically (a fresh owner
                # token, like every attempt). A reservation marked sent by its client in between has a new owner
                # token: take that over (a few times at most).
                for _ in range(3):
                    reserved = lock.held_by
                    lock = self._new_lock(key, task_id, options, retries)
                    lock.replaces = reserved
                    acquired = lock.acquire(blocking=False)
                    record = lock.holder_record or {}
                    if acquired or record.get("job") != task_id or record.get("state") not in (QUEUED, SENDING):
                        break
                facts = self._facts(lock, acquired, task_id, redelivered, options, facts)
                facts = dataclasses.replace(facts, took_over=True)
                continue
            if act is Act.DEFER and decision.reason == "duplicate" and not run.parked and options.waits_in_line:
                # Wait in the key's line, to be woken when the holder releases; then look once more, since the
                # holder may have released (and found nobody waiting) just before this job joined the line.
                run.parked = self._park(run, task_id, options)
                if run.superseded_by is not None:
                    self._replaced(run, task_id, run.superseded_by)
                    return
                if run.parked:
                    acquired = lock.acquire(blocking=False)
                    facts = self._facts(lock, acquired, task_id, redelivered, options, facts)
                    continue
            if acquired:
                lock.release()  # DONE after a redelivery got the lock: give it back at once
            self._carry_out(run, decision, facts, lock, options)
            return
        raise AssertionError(f"no decision settled for {self.name}[{task_id}]: {facts}")  # pragma: no cover

    def _facts(
        self,
        lock: Redlock,
        acquired: bool,  # noqa: FBT001
        task_id: str,
        redelivered: bool,  # noqa: FBT001
        options: _Options,
        previous: Facts | None = None,
    ) -> Facts:
        """The facts of this delivery after ``lock``'s last attempt."""
        outcome: Outcome
        if acquired:
            outcome = "acquired"
        elif lock.done:
            outcome = "done"
        elif lock.split:
            outcome = "split"
        elif not lock.contended:
            outcome = "unavailable"
        else:
            outcome = "held"
        record = lock.holder_record or {}
        # What this attempt saw; everything else about the delivery stays as it was in ``previous``.
        seen: dict[str, Any] = {
            "outcome": outcome,
            "holder_job": record.get("job"),
            "holder_state": record.get("state"),
            "holder_remaining": lock.held_for,
            "holder_try": _try_of(record),
            "jitter": random.random(),  # noqa: S311 - jitter, not crypto
        }
        if previous is not None:
            return dataclasses.replace(previous, **seen)
        request = self.request
        settings = options.settings
        return Facts(
            **seen,
            task_id=task_id,
            redelivered=redelivered,
            retries=int(request.retries or 0),
            in_chord=bool(request.chord),
            on_duplicate=options.on_duplicate,
            on_unavailable=options.on_unavailable,
            attempt=int(getattr(request, _ATTEMPT_HEADER, 0) or 0),
            max_retries=settings.max_retries,
            ttl=options.ttl,
            interval=options.interval,
            retry_delay=settings.retry_delay,
            retry_max_delay=settings.retry_max_delay,
            max_countdown=options.max_countdown,
        )

    def _carry_out(self, run: _Run, decision: Decision, facts: Facts, lock: Redlock, options: _Options) -> None:
        """Carry out an action that does not run the body under the lock."""
        act = decision.act
        task_id = facts.task_id
        if act is Act.DONE:
            if not self._settle_done(run, task_id):
                self._skip_quietly(run, Skipped("already ran", run.key, task_id, "done"))
        elif act is Act.RUN_UNGUARDED:
            self._unavailable(run, lock, task_id, options, "run")
        elif act is Act.FAIL_UNAVAILABLE:
            self._unavailable(run, lock, task_id, options, "fail")
            errors = [str(e) for e in lock.node_errors] or [f"held by {lock.held_by!r}, a record of no task"]
            raise LockUnavailableError(run.key, node_errors=errors)
        elif act is Act.DEFER and decision.reason == "unavailable":
            self._unavailable(run, lock, task_id, options, "retry", decision.countdown, facts.attempt + 1)
        elif act is Act.DEFER and decision.reason == "unknown holder":
            self._defer(run, decision.countdown, decision.reason, {_ATTEMPT_HEADER: facts.attempt + 1})
        elif act is Act.DEFER and decision.reason in ("redelivered", "split vote", "predecessor", "sending"):
            self._defer(run, decision.countdown, decision.reason, {})
        else:  # SKIP, FAIL_DUPLICATE, DEFER of a duplicate
            self._duplicate(run, decision, facts)

    def _settle_done(self, run: _Run, task_id: str) -> bool:
        """A copy of a finished job stops: make sure whoever waits on the task id learns something.

        The done marker is written in the release round trip, before the tracer stores the result: a run killed in
        between (a pool child SIGKILLed, a node slow to answer the release) finished the job but stored nothing, and
        its redelivered copy stops here. Its caller would wait forever, and so would every caller of a duplicate
        skipped in its favour. But a live twin may be just about to store its SUCCESS (the same gap, seen from the
        other side), and REVOKED stored first would reach a waiter before it (the Redis backend publishes every
        state) or even overwrite it (the backend's read-then-set is not atomic). So when the backend holds no final
        state, this copy is re-sent once, SETTLE_GRACE s later, and only that second look stores REVOKED, if the
        state is still not final then. True when this copy has its outcome already (re-sent, or REVOKED stored).
        """
        request = self.request
        if request.is_eager or self.ignore_result or request.ignore_result:
            return False
        try:
            if self.backend.get_state(task_id) in READY_STATES:
                return False
            if not getattr(request, _SETTLE_HEADER, None):
                self._defer(run, SETTLE_GRACE, "settling", {_SETTLE_HEADER: 1})
                return True
            reason = (
                f"{self.name}[{task_id}] already ran (lock {run.key}), but the run that ended stored no "
                "result: it was killed after the job finished"
            )
            self.backend.mark_as_revoked(task_id, reason, request=None)
        except Exception:  # no usable result backend: nobody can wait on it either
            logger.debug("cannot settle the state of %s", task_id, exc_info=True)
            return False
        self._skip_quietly(run, Skipped(reason, run.key, task_id, "settled"))
        return True

    def _new_lock(self, key: str, task_id: str, options: _Options, retries: int) -> Redlock:
        settings = options.settings
        return Redlock(
            settings.nodes,
            key,
            ttl=options.ttl,
            fence_key=settings.fence_key,
            job=task_id,
            limit=self.lock_limit,
            record={
                "state": RUNNING,
                "name": self.name,
                "worker": _worker,
                "at": str(int(time.time() * 1000)),
                "try": str(retries),
            },
        )

    def _hold(self, run: _Run, lock: Redlock, options: _Options, request: Any) -> None:
        task_id = run.task_id
        if run.parked or getattr(request, _PARKED_HEADER, None):
            self._unpark(run.key, task_id, options)
        run.lock = lock
        target = Target() if options.on_lost == "interrupt" else None
        run.lease = watchdog().register(lock, options.interval, functools.partial(self._on_lost, task_id, target))
        self._count("acquired", options)
        signals.lock_acquired.send(sender=self, key=run.key, task_id=task_id, fencing_token=lock.fencing_token)
        if target is not None:  # last: the body runs next, in this thread or greenlet
            self._arm(run, target)

    def _already_ended(self, task_id: str) -> bool:
        """The result backend holds a final state for ``task_id``: success, failure or revoke, its job ran to an end
        (a copy of it never runs it again, whichever end it was)."""
        try:
            return self.backend.get_state(task_id) in READY_STATES
        except Exception:  # no usable result backend: we cannot tell, so run (at least once beats lost)
            logger.debug("cannot read the state of %s: running it", task_id, exc_info=True)
            return False

    def _duplicate(self, run: _Run, decision: Decision, facts: Facts) -> None:
        request = self.request
        task_id, holder_id = facts.task_id, facts.holder_job
        policy: DuplicatePolicy = {Act.SKIP: "skip", Act.FAIL_DUPLICATE: "fail"}.get(decision.act, "reschedule")  # type: ignore[assignment]
        if policy == "reschedule" and self._options().on_duplicate == "replace" and not facts.in_chord:
            policy = "replace"
        self._count("skipped")
        signals.duplicate_skipped.send(
            sender=self, key=run.key, task_id=task_id, holder_task_id=holder_id, policy=policy
        )
        if facts.holder_state == COOLDOWN:
            until = dt.datetime.now(dt.timezone.utc) + dt.timedelta(seconds=facts.holder_remaining or 0)
            held = f"task {holder_id} finished; cooling down until {until.isoformat(timespec='seconds')}"
        elif self.lock_limit > 1 and holder_id != task_id:
            held = f"at its limit of {self.lock_limit} runs (one by task {holder_id})"
        else:
            held = f"held by task {holder_id}"
        # Celery's own line for this delivery says "skipped duplicate" or "deferred" with the same words (see
        # _SkipLogFilter): one INFO line per skip, not two.
        logger.debug("Task %s[%s] is a duplicate: lock %s %s (%s)", self.name, task_id, run.key, held, policy)
        if policy == "fail":
            raise DuplicateTaskError(run.key, task_name=self.name, holder_task_id=holder_id)
        if policy in ("reschedule", "replace"):
            if run.parked and getattr(request, _WOKEN_HEADER, None):
                # Woken, but another job took the lock first: back in the line. The job's fallback copy (sent when
                # it first waited) is still on its way, so nothing is re-sent.
                said = f"waiting in line for lock {run.key} {held}"
                self._skip_quietly(run, Skipped(said, run.key, holder_id, "deferred"))
                return
            # The fallback: woken early by the holder's release when it waits in line, else when a dead holder's
            # lease must have ended (a live holder's renewals keep it ~ttl away).
            headers = {_PARKED_HEADER: 1, _REDELIVERY_HEADER: 1} if run.parked else {}
            self._defer(run, decision.countdown, "duplicate", headers, f"lock {run.key} {held}", holder_id)
            return
        reason = f"duplicate of {self.name} skipped: lock {run.key} {held}"
        # Storing REVOKED costs a read and a write on the result backend, most of a skip's cost: only for a caller
        # who can read it (ignore_result on the task or the message means nobody will).
        if not (request.is_eager or self.ignore_result or request.ignore_result):
            self.backend.mark_as_revoked(task_id, reason, request=None)
        self._skip_quietly(run, Skipped(reason, run.key, holder_id))

    def _unavailable(
        self,
        run: _Run,
        lock: Redlock,
        task_id: str,
        options: _Options,
        policy: UnavailablePolicy,
        countdown: float = 0.0,
        attempt: int = 0,
    ) -> None:
        errors = [str(e) for e in lock.node_errors]
        self._count("unavailable")
        signals.lock_unavailable.send(sender=self, key=run.key, task_id=task_id, policy=policy, errors=errors)
        if policy == "run":
            logger.warning(
                "Task %s[%s] runs UNGUARDED (singleton_lock_on_unavailable='run'): lock %s unavailable: %s",
                self.name,
                task_id,
                run.key,
                "; ".join(errors),
            )
        elif policy == "retry":
            if self.request.is_eager:  # nothing can wait in eager mode: the caller is told at once
                raise LockUnavailableError(run.key, node_errors=errors)
            logger.warning(
                "Task %s[%s] waits %.1fs: no quorum for lock %s (attempt %d): %s",
                self.name,
                task_id,
                countdown,
                run.key,
                attempt,
                "; ".join(errors),
            )
            self._defer(run, countdown, "unavailable", {_ATTEMPT_HEADER: attempt})

    def _defer(
        self,
        run: _Run,
        countdown: float,
        reason: str,
        headers: dict[str, Any],
        detail: str = "",
        holder_id: str | None = None,
    ) -> None:
        """Re-send this delivery (same task id, same options) to run after ``countdown`` s; this one does not run."""
        request = self.request
        if request.is_eager:  # nothing can wait in eager mode: the caller is told at once
            if reason == "unavailable":
                raise LockUnavailableError(run.key)
            raise DuplicateTaskError(run.key, task_name=self.name, holder_task_id=holder_id)
        # Every copy carries when its call first reached a worker: "replace" orders calls by first arrival, and a
        # first delivery re-sent for any reason (no quorum, a split vote, a "sending" holder) is still that call.
        headers = {_SINCE_HEADER: _since(request), **headers}
        if run.redelivered or reason == "redelivered":
            # Another copy of this message may exist (or will: the broker's own redelivery): the copy sent here
            # keeps saying so, so that when it runs it asks whether the job already succeeded, and its success
            # keeps the job's done marker for the whole window.
            headers = {**headers, _REDELIVERY_HEADER: 1}
        if self._options().whole_seconds:
            # Native delayed delivery (quorum queues) takes whole seconds, and kombu refuses a countdown below 1 s.
            countdown = float(max(1, math.ceil(countdown)))
        self._copy(headers, countdown=countdown).apply_async()
        signals.lock_waiting.send(sender=self, key=run.key, task_id=request.id, countdown=countdown, reason=reason)
        said = f"re-sent to run in {countdown:.1f}s ({reason})" + (f": {detail}" if detail else "")
        logger.debug("Task %s[%s] %s: lock %s", self.name, request.id, said, run.key)
        # A copy of a job that may have run already (a redelivery, a settling look) says nothing to monitors: its
        # task id's state is its twin's (see _KIND_EVENT). A duplicate's job never ran: its acquire says DONE if so.
        waiting = reason in ("redelivered", "settling") or (run.redelivered and reason != "duplicate")
        self._skip_quietly(run, Skipped(said, run.key, holder_id, "waiting" if waiting else "deferred"))

    def _copy(self, headers: dict[str, Any], **options: Any) -> Any:
        """A signature re-sending this delivery (same task id and options) with our ``headers`` added.

        RabbitMQ's x-death headers are dropped from the copy (as Celery does for retry()): RabbitMQ < 4.0.1 drops a
        message it sees cycling through dead-lettering, and quorum queues' delayed delivery dead-letters.
        """
        request = self.request
        merged = {k: v for k, v in (request.headers or {}).items() if not str(k).startswith("x-death")}
        merged.update(headers)
        return self.signature_from_request(request, headers=merged, **options)

    # -- the waiting line of a key (lock_on_duplicate="reschedule") ---------------------------------------------------

    def _waiters(self, key: str, options: _Options) -> tuple[Any, str, str]:
        """The client holding ``key``'s waiting line (the first lock node), and the line's two keys."""
        return options.settings.nodes.clients[0], sibling_key(key, ":waiters"), sibling_key(key, ":parked")

    def _park(self, run: _Run, task_id: str, options: _Options) -> bool:
        """Put this rescheduled duplicate in its key's waiting line, with the message that wakes it.

        The line (a sorted set of task ids by arrival, and each one's message) lives on the first lock node: it only
        makes waiting faster. The holder's release wakes the oldest waiter at once; without the line (the node is
        down, the message cannot be encoded) every waiter still has its fallback copy. False when not parked.
        """
        request = self.request
        if request.is_eager or (self.serializer or self.app.conf.task_serializer) != "json":
            # Eager: nothing waits. Another serializer: the line stores JSON, which would change the arguments (int
            # dict keys, tuples): such a waiter has its fallback copy only.
            return False
        replace = options.on_duplicate == "replace"
        if replace and request.chord:
            return False  # a chord member must run: never in a line where a newer call could replace it
        try:
            since = _since(request)
            woken = dict(self._copy({_PARKED_HEADER: 1, _WOKEN_HEADER: 1, _REDELIVERY_HEADER: 1, _SINCE_HEADER: since}))
            message = kombu_json.dumps(woken)  # type: ignore[no-untyped-call]
            client, line, messages = self._waiters(run.key, options)
            expire_ms = int(max(WAITERS_TTL, 3 * options.ttl) * 1000)
            now_ms = since
            if replace:
                answer = client.eval(
                    _PARK_REPLACING,
                    2,
                    line,
                    messages,
                    task_id,
                    since,
                    message,
                    expire_ms,
                    sibling_key(run.key, ":superseded:"),
                )
                self._superseded(run, task_id, [_text(x) for x in answer or ()])
                return True
            pipe = client.pipeline(transaction=False)
            pipe.zadd(line, {task_id: now_ms}, nx=True)  # a job re-parked keeps its place
            pipe.hset(messages, task_id, message)
            pipe.pexpire(line, expire_ms)
            pipe.pexpire(messages, expire_ms)
            pipe.execute()
        except Exception:  # the fallback copy still wakes it
            logger.debug("could not park %s[%s] in line for %s", self.name, task_id, run.key, exc_info=True)
            return False
        return True

    def _superseded(self, run: _Run, task_id: str, answer: list[str]) -> None:
        """Tell the callers of the jobs a "replace" park took out of the line (``answer``: see _PARK_REPLACING)."""
        if answer[:1] == ["self"]:
            # A newer call waits in line: that one wins. This call's job is marked superseded (its other copy stops
            # on it), and stops here.
            run.superseded_by = answer[1]
            return
        for replaced in answer:
            reason = f"superseded by task {task_id}: a newer {self.name} of lock {run.key} waits in its place"
            signals.duplicate_skipped.send(
                sender=self, key=run.key, task_id=replaced, holder_task_id=task_id, policy="replace"
            )
            if not self.ignore_result:
                try:
                    self.backend.mark_as_revoked(replaced, reason, request=None)
                except Exception:  # its fallback copy says so again when it stops
                    logger.debug("could not store the supersession of %s", replaced, exc_info=True)

    def _replaced(self, run: _Run, task_id: str, newer: str) -> None:
        """This delivery's job was replaced in the line by ``newer`` ("replace"): it does not run."""
        request = self.request
        reason = f"superseded by task {newer}: a newer {self.name} of lock {run.key} runs in its place"
        if not (request.is_eager or self.ignore_result or request.ignore_result):
            self.backend.mark_as_revoked(task_id, reason, request=None)
        self._skip_quietly(run, Skipped(reason, run.key, newer))

    def _superseded_by(self, key: str, task_id: str, options: _Options) -> str | None:
        """The task id that replaced this waiting job ("replace"), or None."""
        try:
            client, _, _ = self._waiters(key, options)
            value = client.get(sibling_key(key, ":superseded:") + task_id)
        except Exception:  # cannot tell: the job runs (at least once beats lost)
            logger.debug("cannot read whether %s was superseded", task_id, exc_info=True)
            return None
        return None if value is None else _text(value)

    def _unpark(self, key: str, task_id: str, options: _Options) -> None:
        """This job got the lock: take it out of the line (a copy woken for it later would only stop on DONE)."""
        try:
            client, line, messages = self._waiters(key, options)
            pipe = client.pipeline(transaction=False)
            pipe.zrem(line, task_id)
            pipe.hdel(messages, task_id)
            pipe.execute()
        except Exception:
            logger.debug("could not unpark %s[%s]", self.name, task_id, exc_info=True)

    def _wake_next(self, key: str, options: _Options) -> None:
        """After a release: send the oldest waiter of ``key`` to run now (it takes the lock, or waits again)."""
        try:
            client, line, messages = self._waiters(key, options)
            message = client.eval(_POP_WAITER, 2, line, messages)
            if message is None:
                return
            woken = self.app.signature(kombu_json.loads(message))  # type: ignore[no-untyped-call]
            woken.apply_async(countdown=None)
        except Exception:  # the waiter's fallback copy still wakes it
            logger.warning("could not wake the next waiter of lock %s", key, exc_info=True)
            return
        logger.debug("woke %s[%s], waiting for lock %s", woken.task, woken.id, key)

    def _skip_quietly(self, run: _Run, outcome: Skipped) -> None:
        """Make the tracer store nothing and dispatch nothing for this delivery (see the module docstring)."""
        request = self.request
        run.outcome = outcome
        request.ignore_result = True
        request.chord = None
        request.callbacks = None
        request.chain = None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        run: _Run | None = self.request.__dict__.get("_singleton_lock")
        if run is None or run.entered:
            # Called directly (not through a worker or apply()), or by its own body: a plain call, no lock of its
            # own (and it must not release the lock of the run it is called from).
            return super().__call__(*args, **kwargs)
        if run.outcome is not None:
            return run.outcome
        run.entered = True
        succeeded = ended = False
        try:
            result = self.run(*args, **kwargs)
            succeeded = ended = True
        except (Retry, Ignore):
            raise  # not an end of the job: a retry follows, or the message is dropped unrecorded
        except Reject as exc:
            ended = not exc.requeue  # requeued: the job runs again; not requeued: Celery stores FAILURE
            raise
        except Exception:
            ended = True  # FAILURE: the job ran to its end; a copy of it (a waiting call, a redelivery) must not run
            raise
        finally:
            # Before the tracer stores the result: a caller who waits for it and re-enqueues is never skipped.
            if run.handover_ttl is not None:
                # self.retry() sent the retry: now that the body has ended (unwound, or returned after
                # retry(throw=False)), the job is the retry's. Not before: the body was still inside the job.
                self._hand_over(run, run.handover_ttl)
            else:
                self._release(run, done=ended, succeeded=succeeded)
        return result

    # -- exits -------------------------------------------------------------------------------------------------

    def _release(self, run: _Run, *, done: bool = False, succeeded: bool = False) -> None:
        """Give the lock up; after the job's end (a success or a failure: ``done``), mark this task id done (see
        ``Redlock.finish``) in the same round trip; only a success starts a cooldown.

        Timeline of what the done marker prevents: this run releases, a redelivered copy of the same task id
        (waiting on a countdown, or arriving late) takes the lock, finds no final state stored (not yet, or no result
        backend at all), and runs the job a second time. With the marker, that copy's acquire answers DONE and it
        stops, while a different job is not affected at all (the marker is a key of its own, per task id). A
        failure ends the job as much as a success does: a waiting call's fallback copy that ran it again after a
        FAILURE would run a job twice.
        """
        self._disarm(run)  # first: the body has ended, a loss noticed from now on must not interrupt what follows
        lock, lease = run.lock, run.lease
        run.lock = run.lease = None
        if lease is not None:
            watchdog().unregister(lease)
        if lock is None:
            return
        options = self._options()
        try:
            if done:
                held = lock.finish(
                    # A redelivered run's message may exist twice (a visibility-timeout restore, a re-sent copy):
                    # the other copy can start late, so the marker lasts the whole window.
                    # A retry's marker too: for a retry the marker is the only proof of its success (it never asks
                    # the backend, whose SUCCESS may be its predecessor's), and its message can be restored late.
                    done_for=options.done_window if run.redelivered or run.retries else options.done_window_short,
                    waited_for=options.done_window,
                    cooldown=float(self.lock_cooldown) if succeeded else 0.0,
                )
            else:
                held = lock.release()
        except Exception:  # a release that failed still ends within ttl: log, never mask the task's outcome
            logger.exception("releasing lock %s failed; it expires within its ttl", run.key)
            return
        self._count("released", options)
        signals.lock_released.send(sender=self, key=run.key, task_id=run.task_id, held=held)
        if options.waits_in_line:
            self._wake_next(run.key, options)

    def retry(
        self,
        args: Any = None,
        kwargs: Any = None,
        exc: BaseException | None = None,
        throw: bool = True,  # noqa: FBT001, FBT002 - Celery's signature
        eta: dt.datetime | None = None,
        countdown: float | None = None,
        max_retries: int | None = None,
        **options: Any,
    ) -> Any:
        """Celery's retry, keeping the job protected until the retry runs.

        This run keeps its lock (renewed) until its body ends, however it ends (``raise self.retry()`` unwinding
        through ``with`` blocks, or a body going on after ``retry(throw=False)``); then the lock is handed over to
        the next delivery of this task id (the retry), with a lease covering the countdown plus ttl: a different
        duplicate sent meanwhile is skipped, and the retry takes the lock over atomically. A retry that arrives
        while this body is still ending sees its predecessor (the record's ``try``) and looks again shortly. When
        Celery sends nothing after all (max retries exceeded, the exception re-raised, the publish failed),
        nothing is handed over. The retry does not inherit this delivery's lock headers (its outage attempts, its
        redelivery mark): it is a new attempt.
        """
        run: _Run | None = self.request.__dict__.get("_singleton_lock")
        if run is None or run.lock is None or self.request.is_eager:
            return super().retry(args, kwargs, exc, throw, eta, countdown, max_retries, **options)
        if eta is not None:
            # Celery reads a naive eta as UTC.
            aware = eta if eta.tzinfo is not None else eta.replace(tzinfo=dt.timezone.utc)
            delay = max(0.0, (aware - dt.datetime.now(dt.timezone.utc)).total_seconds())
        else:
            delay = float(countdown if countdown is not None else self.default_retry_delay or 0)
        headers = options.get("headers", self.request.headers) or {}
        options["headers"] = {
            k: v for k, v in headers.items() if k not in _OWN_HEADERS and not str(k).startswith("x-death")
        }
        # Anything but Retry raised (MaxRetriesExceededError, the exception re-raised, Reject for a failed
        # publish): nothing was sent, nothing is handed over.
        lease_for = delay + self._options().ttl
        try:
            sent = super().retry(args, kwargs, exc, throw, eta, countdown, max_retries, **options)
        except Retry:
            run.handover_ttl = lease_for
            raise
        run.handover_ttl = lease_for  # throw=False: sent, and the body goes on
        return sent

    def _hand_over(self, run: _Run, ttl: float) -> None:
        """Reserve the lock for the next delivery of this task id (the retry), which takes it over atomically.

        The record is marked ``open``: the retry's own first acquire, refused by it, does not mark it ``waiting``.
        """
        self._disarm(run)
        if run.lease is not None:
            watchdog().unregister(run.lease)
            run.lease = None
        if run.lock is not None:
            # Not handed over (the lease had run out, too few nodes answered): the retry finds the lock free.
            run.lock.transfer(ttl, {"state": HANDOVER, "open": "1"})

    def _end_lease_of(self, task_id: str, key: str, worker: str) -> None:
        """Take the lock over from the run being killed, with a lease of ~1 s that nobody renews.

        Called in the worker's main process after a hard time limit (see :class:`LockedRequest`), which Celery
        handles there BEFORE billiard kills the child (SIGTERM, then SIGKILL 0.1 s later: billiard/pool.py:755-779):
        capping the lease's expiry alone is not enough, since the child's watchdog can renew in between, back to a
        full ttl. Taking the lock over replaces the owner token, so the dying run's renewals and release no longer
        match; the record names the same task id (state ``ending``), so a redelivery of it waits ~1 s, not a ttl.
        Only a record written by the killed child (``worker``, its pid and host) is taken over: another delivery
        of the same task id (a retry, a redelivered twin) may hold the lock by now, and must keep it.
        """
        lock = Redlock(
            self._options().settings.nodes,
            key,
            ttl=_END_LEASE,
            fencing=False,
            job=task_id,
            limit=self.lock_limit,
            record={"state": ENDING, "name": self.name, "worker": worker, "at": str(int(time.time() * 1000))},
        )
        if lock.acquire(blocking=False):  # nobody held it any more: nothing to end
            lock.release()
            return
        record = lock.holder_record or {}
        if lock.contended and record.get("job") == task_id and record.get("worker") == worker:
            lock.replaces = lock.held_by
            lock.acquire(blocking=False)  # ours for _END_LEASE seconds, then it expires: never extended

    # -- what the body can ask -----------------------------------------------------------------------------------

    def _current(self) -> _Run | None:
        return cast("_Run | None", self.request.__dict__.get("_singleton_lock"))

    def lock_held(self) -> bool:
        """True while this run's lock is ours (not lost, valid by our clock). No I/O: cheap in a loop."""
        run = self._current()
        return run is not None and run.lease is not None and run.lease.held()

    def check_lock(self) -> None:
        """Raise :class:`LockLostError` if this run no longer holds its lock. Call it before side effects."""
        run = self._current()
        if run is None:
            raise LockLostError(f"{self.name} holds no lock here (not running under a worker)")
        if run.lease is None or not run.lease.held():
            reason = run.lease.reason if run.lease else "not held"
            raise LockLostError(f"lock {run.key} of {self.name} lost: {reason}", key=run.key)

    @property
    def fencing_token(self) -> int | None:
        """This run's fencing token (pass it to stores that reject stale writers); None when not held."""
        run = self._current()
        return run.lock.fencing_token if run is not None and run.lock is not None else None

    # -- plumbing ----------------------------------------------------------------------------------------------

    def _on_lost(self, task_id: str, target: Target | None, lease: Lease, reason: str) -> None:
        """Called in the watchdog's thread when renewal fails."""
        self._count("lost")
        signals.lock_lost.send(sender=self, key=lease.lock.name, task_id=task_id, reason=reason)
        logger.warning(
            "Lock %s of %s[%s] LOST while running: %s; %s",
            lease.lock.name,
            self.name,
            task_id,
            reason,
            "interrupting the body (lock_on_lost='interrupt')"
            if target is not None and target.armed
            else "the task should stop before further side effects (self.check_lock() raises from now on)",
        )
        if target is not None:
            target.fire(LockLostError(f"lock {lease.lock.name} of {self.name} lost: {reason}", key=lease.lock.name))

    _uninterruptible_warned: ClassVar[set[str]] = set()

    def _arm(self, run: _Run, target: Target) -> None:
        """lock_on_lost="interrupt": make this run's body interruptible where it runs (see the interrupt module)."""
        if target.arm():
            run.interrupt = target
        elif self.name not in LockedTask._uninterruptible_warned:
            LockedTask._uninterruptible_warned.add(self.name)
            logger.warning(
                "%s has lock_on_lost='interrupt', but its body runs in a thread other than the main one (threads or "
                "eventlet pool, an in-process test worker): it is NOT interrupted when its lock is lost; use the "
                "prefork, solo or gevent pool, or call self.check_lock() before side effects",
                self.name,
            )

    @staticmethod
    def _disarm(run: _Run) -> None:
        if run.interrupt is not None:
            run.interrupt.disarm()
            run.interrupt = None

    def _count(self, event: str, options: _Options | None = None) -> None:
        settings = (options or self._options()).settings
        watchdog().count(settings.nodes, settings.prefix, event)


outside_body(LockedTask.__call__)  # lock_on_lost="interrupt": a signal handled in __call__'s own code is not the body's
