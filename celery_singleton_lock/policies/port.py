"""The feature port: what a feature is, and the points of a call's and a delivery's life where the rooms call it.

A feature (cooldown, limit, max_waiting, rate, debounce, ...) is one module under ``policies/`` holding one
:class:`Feature`: the ``lock_*`` options it owns and their checks, whether a task's options turn it on, what it
resolves once per task, its headers and scripts, its facets and verdicts in the options matrix, and its *hooks*:

=================  =======================================  ==================================================
hook               called by, when                          answers
=================  =======================================  ==================================================
``at_send``        the enqueue room, at ``apply_async``     :data:`NOT_ANSWERED`, or the call's result (debounce
                                                            joins a burst: nothing published)
``after_lock``     the delivery, once its lock is taken     True: go on; False: the feature stopped the delivery
                   (or when it has none: a rate only)      (deferred, skipped; it may raise: failed)
``before_body``    the delivery, about to hold its lock     True: run; False: stopped (the room gives the lock
                                                            back, and calls ``body_skipped`` of each feature)
``body_skipped``   the delivery, when a body that was let   nothing (rate uncounts its share)
                   in by ``after_lock`` does not start
``at_release``     the release, after the body              seconds the released lock stays held (cooldown)
``at_fail``        the delivery, failing before its body    nothing (debounce ends its burst)
``may_refuse``     a feature about to refuse a delivery     True: refuse; False: another feature took it
                   (rate's skip or fail)                    elsewhere (debounce: not due yet, re-sent)
``at_revoke``      a revoked message met by a worker, or    None: not the feature's; else whether it freed
                   ``revoke_queued``                        what the job held
``slowed``         the body, which raised ``SlowDown``      None: not the feature's (the call fails with it);
                                                            else the seconds until the call is re-sent, and
                                                            the headers its copy carries
=================  =======================================  ==================================================

The rooms call the hooks of a task's *active* features (:meth:`Feature.active`), computed once per task into
:class:`Hooks` (``Options.hooks``), in :data:`~celery_singleton_lock.policies.FEATURES` order; a task with no
feature on pays one empty-tuple test per point. A hook gets what the room of that moment hands it: a :class:`Call`
at send, a :class:`Delivery` at the worker (both implemented by the rooms: a feature imports nothing of Celery),
or the context and the run. A feature's per-delivery state lives in ``run.state[feature.name]``.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

from ..errors import ConfigurationError
from ..lock.config import did_you_mean

__all__ = [
    "HOOKS",
    "NOT_ANSWERED",
    "Call",
    "Delivery",
    "Feature",
    "Hooks",
    "check_names",
    "hooks_of",
    "parameters",
]

#: ``at_send``'s answer when the feature leaves the call to the room (and the features after it).
NOT_ANSWERED: Any = type("NotAnswered", (), {"__repr__": lambda _: "NOT_ANSWERED"})()


class Call(Protocol):
    """A call at ``apply_async``, as a feature's ``at_send`` sees it (implemented by the enqueue room)."""

    ctx: Any  #: the call's context (``_run.Context``): options, key, counting, signals, the task's public API
    args: Any
    kwargs: Any
    task_id: str | None
    options: dict[str, Any]  #: the publish's options (a feature may pop countdown/eta/headers)
    linked: bool  #: the call has link/link_error
    copy_header: str  #: the header of a message that is a copy of another call's job (it asks before it runs)

    @property
    def delay(self) -> float:
        """Seconds until the call is due (its countdown or ETA)."""

    def publish(self, args: Any, kwargs: Any, **options: Any) -> Any:
        """Celery's own publish (``apply_async``'s), by name."""

    def joined(self, result: Any, holder_id: str | None) -> Any:
        """``result`` marked as the call's answer: ``holder_id`` the job it joined (None: a new job)."""


class Delivery(Protocol):
    """A delivery at the worker, as a feature's hooks see it (implemented by the delivery room)."""

    ctx: Any  #: the delivery's context (``_run.Context``)
    run: Any  #: the delivery's ``_run.Run`` (key, task_id, retries, parked, ``state``, ``body_args``)
    lock: Any  #: the lock it holds (a ``Redlock``), None when it has none (``lock_limit=None``)
    args: Any
    kwargs: Any

    @property
    def attempt(self) -> int:
        """How many times this call was re-sent for want of a quorum (its ``attempt_header``)."""

    @property
    def attempt_header(self) -> str:
        """The header that counts those re-sends (a re-send for want of a quorum carries it, plus one)."""

    @property
    def woken(self) -> bool:
        """This delivery is a copy woken from the key's line by a release (it was the line's head then)."""

    def give_back(self) -> None:
        """Give the lock back at once (its body does not start), leave the key's line and wake it."""

    def wait_turn(self, *, wake: bool) -> bool:
        """Not this call's turn (``lock_fair_on``): wait in the key's line (a fallback copy re-sent), give the lock
        back, and wake the line's head when ``wake``. False when it could not wait (a full line: lock_max_waiting),
        and the caller runs it on the slot it holds."""

    def wait_out(self, countdown: float, reason: str, headers: dict[str, Any], detail: str = "") -> None:
        """Re-send this delivery to ask again in ``countdown`` s, keeping what its call holds meanwhile (its
        queue-scope reservation, its place in a replace line); this one stops."""

    def resend(self, headers: dict[str, Any], countdown: float, **options: Any) -> None:
        """Send a copy of this delivery (same task id) with ``headers`` added, in ``countdown`` s."""

    def skip(self, reason: str, holder_id: str | None, kind: str = "duplicate") -> None:
        """Stop quietly: the tracer stores nothing for this delivery (a ``Skipped`` of ``kind``)."""

    def failed(self) -> None:
        """The delivery fails before its body: every active feature's ``at_fail``."""

    def may_refuse(self) -> bool:
        """A feature is about to refuse this delivery: False when another feature's ``may_refuse`` took it."""


class Feature:
    """One feature behind the port (subclass it; a hook not overridden is not called)."""

    name: ClassVar[str]
    #: The task options it owns (outside its module only task.py's declarations and the matrix name them).
    options: ClassVar[tuple[str, ...]] = ()
    #: The message headers its re-sent copies carry (a retry inherits none: ``_run.OWN_HEADERS``).
    headers: ClassVar[tuple[str, ...]] = ()
    #: Its Lua scripts (under lua/, documented in docs/protocol.md).
    scripts: ClassVar[tuple[str, ...]] = ()
    #: The ``lock_on_duplicate`` a task that turns it on has, whatever the settings say (None: no say).
    duplicates: ClassVar[str | None] = None

    def check(self, cls: Any) -> None:
        """Refuse an invalid value of its options in one line (ConfigurationError), at registration and start."""

    def active(self, cls: Any) -> bool:
        """The task's options turn it on (its hooks are called for the task)."""
        return False

    def resolve(self, task: Any) -> Any:
        """What it reads of a task's options, once per task (``ctx.options.conf[name]``; None: nothing)."""
        return None

    # -- hooks (see the module's table) --------------------------------------------------------------------

    def at_send(self, call: Call) -> Any:
        return NOT_ANSWERED

    def after_lock(self, delivery: Delivery) -> bool:
        return True

    def before_body(self, delivery: Delivery) -> bool:
        return True

    def body_skipped(self, delivery: Delivery) -> None:
        return None

    def at_release(self, ctx: Any, run: Any, *, succeeded: bool) -> float:
        return 0.0

    def at_fail(self, delivery: Delivery) -> None:
        return None

    def may_refuse(self, delivery: Delivery) -> bool:
        return True

    def at_revoke(self, ctx: Any, key: str, task_id: str) -> bool | None:
        return None

    def slowed(self, ctx: Any, run: Any, pause: float, limit: Any) -> tuple[float, dict[str, Any]] | None:
        return None


#: The hooks, in the order of a call's and a delivery's life.
HOOKS: tuple[str, ...] = (
    "at_send",
    "after_lock",
    "before_body",
    "body_skipped",
    "at_release",
    "at_fail",
    "may_refuse",
    "at_revoke",
    "slowed",
)


@dataclass(frozen=True)
class Hooks:
    """A task's active features, and per hook those that have it (each a tuple, empty for most tasks)."""

    features: tuple[Feature, ...] = ()
    at_send: tuple[Feature, ...] = ()
    after_lock: tuple[Feature, ...] = ()
    before_body: tuple[Feature, ...] = ()
    body_skipped: tuple[Feature, ...] = ()
    at_release: tuple[Feature, ...] = ()
    at_fail: tuple[Feature, ...] = ()
    may_refuse: tuple[Feature, ...] = ()
    at_revoke: tuple[Feature, ...] = ()
    slowed: tuple[Feature, ...] = ()


def _has(feature: Feature, hook: str) -> bool:
    return getattr(type(feature), hook) is not getattr(Feature, hook)


def hooks_of(features: Sequence[Feature], cls: Any) -> Hooks:
    """The :class:`Hooks` of a task's class: the features its options turn on, in ``features`` order."""
    on = tuple(f for f in features if f.active(cls))
    return Hooks(on, **{hook: tuple(f for f in on if _has(f, hook)) for hook in HOOKS})


def parameters(task: Any) -> list[inspect.Parameter] | None:
    """The parameters a call of ``task`` (class or instance) binds (a bound task's ``self`` left out); None when
    unreadable."""
    cls: Any = task if isinstance(task, type) else type(task)
    run = inspect.getattr_static(cls, "run", None)
    try:
        params = list(inspect.signature(cls.run).parameters.values())
    except (TypeError, ValueError):
        return None
    if params and not isinstance(run, staticmethod) and inspect.isfunction(run):
        params = params[1:]  # a bound task's run (bind=True, or a class's run method): its first is the task itself
    return params


def check_names(cls: Any, option: str, names: Sequence[str], params: Sequence[Any] | None) -> None:
    """An option naming arguments (``lock_unique_on``, ``lock_rate_on``) names parameters of the task's signature
    (``params``: its parameters, None when unreadable: not checked). A key is built from them: a name that is no
    parameter would fail every call at the worker, and ``**kwargs`` does not help (the key binds named ones)."""
    if params is None:
        return
    known = [p.name for p in params]
    missing = [n for n in names if n not in known]
    if missing:
        hints = "".join(did_you_mean(n, known) for n in missing[:1])
        raise ConfigurationError(
            f"{option} of {cls.name} names unknown argument(s): {missing}{hints}; the task's arguments are "
            f"{', '.join(known) or '(none)'}"
        )


def conf_of(features: Sequence[Feature], task: Any) -> Mapping[str, Any]:
    """Each active feature's resolved options, by name."""
    return {f.name: f.resolve(task) for f in features}
