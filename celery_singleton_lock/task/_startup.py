"""Start checks: every check a worker runs before it takes a message, one function that the worker's start step,
``celery beat -S singleton`` and ``celery locks doctor`` all run, so what one refuses the others refuse too."""

from __future__ import annotations

import difflib
import inspect
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final

import click
from celery import bootsteps, signals
from kombu.utils.imports import symbol_by_name

from ..errors import ConfigurationError
from ..lock.config import (
    DuplicatePolicy,
    LockSettings,
    LostPolicy,
    UnavailablePolicy,
    check_policy,
    check_ttl,
    did_you_mean,
    settings_for,
)
from ..lock.renewal import start_liveness
from ..policies import FEATURES, matrix
from ..policies.debounce import check_debounce
from ..policies.port import check_names
from . import _preskip as preskip
from . import _reach
from ._brokers import broker_findings
from ._monitoring import LockedRequest
from ._run import is_locked_task

__all__ = [
    "ConfigurationRefusedError",
    "SettingsStep",
    "StartError",
    "StartProblem",
    "check_group",
    "check_matrix",
    "check_options",
    "check_start",
    "did_you_mean",
    "start_problems",
]

logger = logging.getLogger("celery_singleton_lock.task")

_SCOPES = ("run", "queue")


class ConfigurationRefusedError(ConfigurationError, click.ClickException):  # type: ignore[misc]
    """Invalid configuration refused where it is checked: when a task is registered (the app is finalized: at
    worker or beat start, or at the first ``delay()`` of a producer), by the worker's start checks, or by
    ``celery locks doctor``. A :class:`ConfigurationError` (``except ConfigurationError`` catches it), and a
    ``click.ClickException``, so any ``celery`` command (``worker``, ``beat``, ``locks``) prints one line,
    ``Error: celery_singleton_lock: ...``, and exits with status 1 instead of a traceback.

    Defined on the Celery side (the lock core imports no click) and shown where it is imported from: the package.
    """

    __module__ = "celery_singleton_lock"

    def __init__(self, message: str) -> None:
        click.ClickException.__init__(self, message)
        self.key = None  # as every LockError has

    def format_message(self) -> str:
        return f"celery_singleton_lock: {self.message}"


#: The name the Celery side knew it by.
StartError = ConfigurationRefusedError


def _check_names(cls: Any, option: str, names: Sequence[str]) -> None:
    """``lock_unique_on`` names parameters of the task's signature (see :func:`policies.port.check_names`)."""
    check_names(cls, option, names, matrix.parameters(cls))


def _group_members(task: Any, others: Any) -> list[Any]:
    cls: Any = task if isinstance(task, type) else type(task)
    return [
        o
        for o in others
        if is_locked_task(o) and getattr(o, "lock_group", None) == cls.lock_group and o.name != cls.name
    ]


def check_group(task: Any, others: Any, settings: LockSettings | None = None) -> None:
    """``lock_group`` of a LockedTask (class or instance): a non-empty string, and the task agrees with the tasks of
    ``others`` in the same group on everything that shares a key (:func:`matrix.check_group`: ConfigurationError
    naming both tasks)."""
    cls: Any = task if isinstance(task, type) else type(task)
    group = cls.lock_group
    if group is None:
        return
    if not isinstance(group, str) or not group or any(ch.isspace() or ch in "{}" for ch in group):
        raise ConfigurationError(
            f"lock_group of {cls.name} must be a non-empty name without spaces or braces, got {group!r}"
        )
    for other in _group_members(cls, others):
        refused = matrix.check_group([other, cls], settings)
        if refused:
            raise ConfigurationError(refused[0].line)


def check_matrix(task: Any, settings: LockSettings | None = None) -> None:
    """The options matrix's verdict on a task's combination of options (ConfigurationError: the first refusal)."""
    cls: Any = task if isinstance(task, type) else type(task)
    refused = matrix.refusals(matrix.facets(cls, settings), cls.name)
    if refused:
        raise ConfigurationError(refused[0].line)


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


def check_options(task: Any, settings: LockSettings | None = None) -> None:
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
    for feature in FEATURES:
        feature.check(cls)
    if cls.lock_ttl is not None:
        check_ttl(cls.lock_ttl, f"lock_ttl of {name}")
    if cls.lock_scope not in _SCOPES:
        raise ConfigurationError(
            f"lock_scope of {name} must be 'run' or 'queue', got {cls.lock_scope!r}"
            f"{did_you_mean(cls.lock_scope, _SCOPES)}"
        )
    check_ttl(cls.lock_queue_ttl, f"lock_queue_ttl of {name}")
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
    check_debounce(cls, settings)
    if cls.lock_unique_on is not None and cls.lock_key is None:
        _check_names(cls, "lock_unique_on", cls.lock_unique_on)
    check_matrix(cls, settings)


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
        if not is_locked_task(task):
            continue
        try:
            check_options(task, settings)
            check_group(task, [tasks[n] for n in sorted(tasks) if n < name], settings)
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
        raise StartError(problems[0].message)
    return settings_for(app)


class SettingsStep(bootsteps.Step):  # type: ignore[misc]
    """Worker bootstep: run :func:`start_problems` at worker start, so bad settings or task options stop the worker
    at once with one line."""

    name = "celery_singleton_lock.settings"

    def __init__(self, parent: Any, **kwargs: Any) -> None:
        try:
            settings = check_start(parent.app)
        except StartError as exc:
            if getattr(parent, "logfile", None):
                # A detached worker (celery multi, --detach) sends stderr to /dev/null: say it in its logfile too.
                logger.error("%s", exc.format_message())  # noqa: TRY400 - one line, no traceback
            raise
        logger.info("celery_singleton_lock: %s", settings.describe())
        _reach.warn_unreachable(settings.nodes, "worker")
        warn_about_broker(parent.app)
        warn_about_pool(parent)
        preskip.pool_started(parent)
        if settings.liveness_file:
            # At worker_ready, once the pool has forked: the main process's watchdog thread then starts writing.
            path = settings.liveness_file
            signals.worker_ready.connect(lambda **_: start_liveness(path), weak=False, dispatch_uid=f"csl-live:{path}")
            logger.info("celery_singleton_lock: liveness heartbeat in %s", path)
        super().__init__(parent, **kwargs)


def warn_about_broker(app: Any) -> None:
    """Log, once at worker start, each broker setting that weakens a guarantee (the doctor's Celery-side checks)."""
    try:
        findings = broker_findings(app)
    except Exception:  # a check that cannot run must never stop the worker
        logger.debug("broker checks failed", exc_info=True)
        return
    for finding in findings:
        if finding.level in ("error", "warning"):
            logger.warning("celery_singleton_lock: %s: %s; %s", finding.subject, finding.message, finding.fix)


# Pools whose bodies run in threads of one process (eventlet's green threads included): nothing can raise in them.
_THREAD_POOLS = frozenset({"celery.concurrency.thread", "celery.concurrency.eventlet"})


def warn_about_pool(worker: Any) -> None:
    """Say at worker start which lock_on_lost='interrupt' tasks this pool cannot interrupt.

    A warning, not a refusal: one app is often served by several workers with different pools and queues, and a
    threads worker that never receives those tasks is fine; a body that does run there warns again when it starts.
    """
    pool = getattr(getattr(worker, "pool_cls", None), "__module__", None)
    if pool not in _THREAD_POOLS:
        return
    names = sorted(
        t.name for t in list(worker.app.tasks.values()) if is_locked_task(t) and t.lock_on_lost == "interrupt"
    )
    if names:
        logger.warning(
            "celery_singleton_lock: lock_on_lost='interrupt' of %s cannot work in the %s pool (a body in a thread "
            "cannot be interrupted): use the prefork, solo or gevent pool for them",
            ", ".join(names),
            pool.rsplit(".", 1)[-1],
        )
