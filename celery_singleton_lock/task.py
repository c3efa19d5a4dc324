"""LockedTask: a Celery ``Task`` base class that runs each job at most once at a time.

::

    @app.task(base=LockedTask, lock_ttl=30)
    def rebuild_report(account_id: int, month: str = "current") -> None: ...

Life of one delivery (the tracer calls ``before_start``, then ``__call__``, then stores the result)::

    before_start   key = prefix + task name + hash(bound arguments); one acquire round trip to every node at once
      |- acquired ..................... run: the watchdog renews the lease every ttl/3 while the body runs
      |- held by a different job ...... duplicate: skip (REVOKED at once, naming the holder) / fail / reschedule
      |- held by this same task id .... a redelivery (acks_late, visibility timeout): never skipped, never run
      |                                 beside its live twin: re-sent with a countdown of the remaining lease
      |- handed over by self.retry() .. this is the retry: take the lock over atomically and run
      '- no quorum answered ........... retry with back-off (default) / fail / run unguarded
    __call__       the body runs; its ``finally`` releases the lock (owner-checked) BEFORE the tracer stores
                   the result, so a caller who waits for the result and re-enqueues at once is never skipped

Deciding in ``before_start`` and returning early from ``__call__`` costs about as much as a no-op task; raising
``Ignore`` or ``Reject`` from ``before_start`` costs ~35-47x that (the tracer builds and formats a traceback), and
a duplicate storm is all skips. A delivery that does not run therefore returns a :class:`Skipped` marker from
``__call__`` with ``request.ignore_result`` set, so the tracer stores nothing over the outcome we stored (or over
the twin's), and its callbacks, chain and chord are cleared (the re-sent copy carries them). Celery still
logs it as "succeeded" with the marker as return value and sends ``task_success``; use our signals instead.
"""

from __future__ import annotations

import datetime as dt
import functools
import inspect
import logging
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, cast

from billiard.exceptions import TimeLimitExceeded
from celery import Task, bootsteps
from celery.exceptions import Retry
from celery.signals import worker_process_shutdown

from . import signals
from .config import DuplicatePolicy, LockSettings, UnavailablePolicy, check_policy, check_ttl, settings_for
from .errors import ConfigurationError, DuplicateTaskError, LockLostError, LockUnavailableError
from .keys import custom_key, holder_token, lock_key, parse_holder
from .redlock import Redlock
from .renewal import Lease, flush_stats, watchdog

__all__ = ["HANDOVER", "LockedTask", "Skipped"]

logger = logging.getLogger("celery_singleton_lock.task")

#: The ``worker`` field of a token that reserves a lock for the next delivery of a retried task.
HANDOVER = "retry"
#: The ``worker`` field of the token that ends the lease of a run killed by a hard time limit.
ENDING = "ending"
_END_LEASE = 1.0
#: The ``worker`` field of the token a run that succeeded leaves behind (for a ttl): a copy of the same task id
#: that was waiting for it (a redelivery) stops on it; any other job takes it over in its acquire round trip.
DONE = "done"
#: The ``worker`` field of the token that keeps a job locked for ``lock_cooldown`` after its success.
COOLDOWN = "cooldown"
_SPLIT_RETRIES = 3
# apply_async options under which the enqueue check stands aside: the message must go out as asked.
_DEFERRED_OR_GROUPED = frozenset({"countdown", "eta", "chord", "group_id", "chain"})
_ATTEMPT_HEADER = "singleton_lock_attempt"
_REDELIVERY_HEADER = "singleton_lock_waited"
_SUCCESS = "SUCCESS"


@dataclass(frozen=True)
class Skipped:
    """What ``__call__`` returns for a delivery that did not run the body (duplicate, or deferred)."""

    reason: str
    key: str
    holder_task_id: str | None

    def __repr__(self) -> str:
        return f"<Skipped: {self.reason}>"


@dataclass
class _Run:
    """Per-delivery state, kept on the request (one Task instance serves every thread of a process)."""

    key: str
    lock: Redlock | None = None
    lease: Lease | None = None
    outcome: Skipped | None = None
    retrying: bool = False
    handed_over: bool = False
    entered: bool = False


@dataclass(frozen=True)
class _Options:
    """A task's resolved options: the app's settings overlaid with the task's ``lock_*`` attributes."""

    settings: LockSettings
    ttl: float
    interval: float
    on_duplicate: DuplicatePolicy
    on_unavailable: UnavailablePolicy
    signature: inspect.Signature | None
    max_countdown: float | None  # half the broker's visibility timeout, if one is set


def _max_countdown(app: Any) -> float | None:
    """Half the broker's visibility timeout (Redis, SQS), when one is set: the longest countdown we may re-send with.

    A message with a countdown is held unacked by the worker until it is due; one held past the visibility timeout
    is restored by the broker and then exists twice. A copy that waits for its own earlier delivery's lease (up to
    a ttl) and is doubled every time would multiply while that delivery runs.
    """
    timeout = (app.conf.broker_transport_options or {}).get("visibility_timeout")
    return float(timeout) / 2 if isinstance(timeout, int | float) and timeout > 0 else None


class _SettingsStep(bootsteps.Step):  # type: ignore[misc]
    """Worker bootstep: validate ``singleton_lock_*`` at worker start, so bad settings stop the worker at once."""

    name = "celery_singleton_lock.settings"

    def __init__(self, parent: Any, **kwargs: Any) -> None:
        settings = settings_for(parent.app)  # raises ConfigurationError with what to change
        logger.info("celery_singleton_lock: %s", settings.describe())
        super().__init__(parent, **kwargs)


@worker_process_shutdown.connect(weak=False)  # type: ignore[untyped-decorator]
def _flush_stats_at_exit(**_: Any) -> None:
    """A pool child exits (worker_max_tasks_per_child, shutdown) with up to 5 s of unflushed counters: flush them."""
    try:
        flush_stats()
    except Exception:  # never block a child's exit; the counters are only statistics
        logger.debug("flushing lock counters at exit failed", exc_info=True)


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
        ``"skip"`` (REVOKED at once, naming the holder), ``"fail"`` (FAILURE with DuplicateTaskError) or
        ``"reschedule"`` (run after the holder's lease). Chord members always reschedule: a skipped member would
        fail the chord, and one that stored nothing would hang it.
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

    _lock_options: _Options | None = None

    # -- registration ------------------------------------------------------------------------------------------

    @classmethod
    def bind(cls, app: Any) -> Any:
        """Validate the task's ``lock_*`` options at registration; settings are checked at worker start."""
        bound = super().bind(app)
        if (
            isinstance(cls.lock_cooldown, bool)
            or not isinstance(cls.lock_cooldown, int | float)
            or cls.lock_cooldown < 0
        ):
            raise ConfigurationError(
                f"lock_cooldown of {cls.name} must be a number of seconds >= 0, got {cls.lock_cooldown!r}"
            )
        if cls.lock_ttl is not None:
            check_ttl(cls.lock_ttl, f"lock_ttl of {cls.name}")
        if cls.lock_on_duplicate is not None:
            check_policy(cls.lock_on_duplicate, DuplicatePolicy, f"lock_on_duplicate of {cls.name}")
        if cls.lock_on_unavailable is not None:
            check_policy(cls.lock_on_unavailable, UnavailablePolicy, f"lock_on_unavailable of {cls.name}")
        if cls.lock_key is not None and not callable(cls.lock_key):
            raise ConfigurationError(f"lock_key of {cls.name} must be a function returning a string")
        if cls.lock_unique_on is not None and (
            isinstance(cls.lock_unique_on, str) or not all(isinstance(n, str) for n in cls.lock_unique_on)
        ):
            raise ConfigurationError(f"lock_unique_on of {cls.name} must be a list of argument names")
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
                signature: inspect.Signature | None = inspect.signature(self.run)
            except (TypeError, ValueError):
                signature = None
            options = _Options(
                settings=settings,
                ttl=ttl,
                interval=ttl * settings.renew_fraction,
                on_duplicate=self.lock_on_duplicate or settings.on_duplicate,
                on_unavailable=self.lock_on_unavailable or settings.on_unavailable,
                signature=signature,
                max_countdown=_max_countdown(self.app),
            )
            self._lock_options = options
        return options

    def lock_key_for(self, *args: Any, **kwargs: Any) -> str:
        """The lock key of a call with these arguments (what ``celery locks`` lists)."""
        options = self._options()
        prefix = options.settings.prefix
        key_fn = type(self).lock_key
        if key_fn is not None:
            return custom_key(prefix, self.name, key_fn, args, kwargs)
        return lock_key(prefix, self.name, options.signature, args, kwargs, unique_on=self.lock_unique_on)

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
        """Celery's apply_async; with ``lock_enqueue_check``, a call whose job is running returns that run."""
        if self.lock_enqueue_check and not (
            link or link_error or self.app.conf.task_always_eager or _DEFERRED_OR_GROUPED.intersection(options)
        ):
            running = self._running_run(args or (), kwargs or {}, task_id)
            if running is not None:
                return running
        return super().apply_async(
            args, kwargs, task_id=task_id, producer=producer, link=link, link_error=link_error, shadow=shadow, **options
        )

    def _running_run(self, args: Any, kwargs: Any, task_id: str | None) -> Any:
        """The AsyncResult of the run holding this call's lock right now, or None (also when Redis cannot tell)."""
        try:
            key = self.lock_key_for(*args, **kwargs)
            holder = parse_holder(Redlock(self._options().settings.nodes, key).holder())
        except Exception:  # the worker's check is the guard; at enqueue, when in doubt, send
            logger.debug("enqueue check of %s failed; sending", self.name, exc_info=True)
            return None
        if holder is None or holder.worker in (DONE, ENDING, COOLDOWN) or holder.task_id == task_id:
            return None
        signals.duplicate_skipped.send(
            sender=self, key=key, task_id=task_id, holder_task_id=holder.task_id, policy="enqueue"
        )
        logger.info("%s not sent: the same job is running as task %s (lock %s)", self.name, holder.task_id, key)
        return self.AsyncResult(holder.task_id)

    # -- the hot path --------------------------------------------------------------------------------------------

    def before_start(self, task_id: str, args: Any, kwargs: Any) -> None:
        request = self.request
        options = self._options()
        key = self.lock_key_for(*args, **kwargs)
        run = _Run(key)
        request._singleton_lock = run  # noqa: SLF001 - Celery's Context is our per-delivery state holder
        lock = self._new_lock(key, task_id, options)
        if lock.acquire(blocking=False):
            self._hold(run, lock, task_id)
            return
        for _ in range(_SPLIT_RETRIES):
            if not lock.split:
                break
            # Contenders that arrived together split the nodes and nobody got a quorum: try again after a jittered
            # pause (Redlock's rule), instead of skipping every one of them as the others' duplicate.
            time.sleep(random.uniform(0.005, 0.05))  # noqa: S311 - jitter
            if lock.acquire(blocking=False):
                self._hold(run, lock, task_id)
                return
        holder = parse_holder(lock.held_by)
        if lock.contended and holder is not None and holder.task_id == task_id:
            if holder.worker in (DONE, COOLDOWN):
                # This very job just succeeded; its result may not be stored yet (see _release).
                self._skip_quietly(run, Skipped("already succeeded", run.key, task_id))
                return
            if holder.worker == HANDOVER:
                # Our own retry's reservation: take it over atomically (a fresh token per attempt).
                reserved = lock.held_by
                lock = self._new_lock(key, task_id, options)
                lock.replaces = reserved
                if lock.acquire(blocking=False):
                    self._hold(run, lock, task_id)
                    return
                holder = parse_holder(lock.held_by)
        if lock.split:
            self._defer(run, random.uniform(0.05, 0.5), "split vote", {})  # noqa: S311 - still split: soon again
        elif not lock.contended:
            self._unavailable(run, lock, task_id, options)
        elif holder is not None and holder.task_id == task_id:
            # The same job, still held by an earlier delivery (acks_late after a crash, a visibility-timeout
            # redelivery): never skipped as its own duplicate, never run beside a live twin. Look again when its
            # lease would end; a dead holder stops renewing, so that is at most one ttl away. Unless the job has
            # succeeded meanwhile: then the holder is another copy checking just that, and this copy is done too
            # (re-sending it would chase that copy's fresh lease, a full ttl, again and again).
            if self._already_succeeded(task_id):
                self._skip_quietly(run, Skipped("already succeeded", run.key, task_id))
                return
            countdown = (lock.held_for or options.ttl) + random.uniform(0.05, 0.25)  # noqa: S311
            self._defer(run, countdown, "redelivered", {_REDELIVERY_HEADER: 1})
        else:
            self._duplicate(run, lock, task_id, holder.task_id if holder else None, options)

    def _new_lock(self, key: str, task_id: str, options: _Options) -> Redlock:
        settings = options.settings
        lock = Redlock(
            settings.nodes, key, ttl=options.ttl, token=holder_token(task_id, self.name), fence_key=settings.fence_key
        )
        # A finished job's "done" marker is taken over in the same round trip, unless it is this very job's.
        lock.replaces_marked = (f"|{DONE}|", f"|{task_id}|")
        return lock

    def _hold(self, run: _Run, lock: Redlock, task_id: str) -> None:
        options = self._options()
        request = self.request
        redelivered = getattr(request, _REDELIVERY_HEADER, None) or (request.delivery_info or {}).get("redelivered")
        # A redelivery that got the lock: if an earlier delivery of this id already succeeded (it was still
        # running when this copy arrived), the job is done; running it again would be a duplicate.
        if redelivered and self._already_succeeded(task_id):
            lock.release()
            self._skip_quietly(run, Skipped("already succeeded", run.key, task_id))
            return
        run.lock = lock
        run.lease = watchdog().register(lock, options.interval, functools.partial(self._on_lost, task_id))
        self._count("acquired")
        signals.lock_acquired.send(sender=self, key=run.key, task_id=task_id, fencing_token=lock.fencing_token)

    def _already_succeeded(self, task_id: str) -> bool:
        try:
            return bool(self.backend.get_state(task_id) == _SUCCESS)
        except Exception:  # no usable result backend: we cannot tell, so run (at least once beats lost)
            logger.debug("cannot read the state of %s: running it", task_id, exc_info=True)
            return False

    def _duplicate(self, run: _Run, lock: Redlock, task_id: str, holder_id: str | None, options: _Options) -> None:
        request = self.request
        policy: DuplicatePolicy = "reschedule" if request.chord else options.on_duplicate
        self._count("skipped")
        signals.duplicate_skipped.send(
            sender=self, key=run.key, task_id=task_id, holder_task_id=holder_id, policy=policy
        )
        logger.info(
            "Task %s[%s] is a duplicate: lock %s is held by task %s (%s)",
            self.name,
            task_id,
            run.key,
            holder_id,
            policy,
        )
        if policy == "fail":
            raise DuplicateTaskError(run.key, task_name=self.name, holder_task_id=holder_id)
        if policy == "reschedule":
            # Look again after one renewal interval at most: a live holder's lease is always ~ttl away (it renews),
            # so waiting for it would let the duplicate run up to a whole ttl after the holder finished.
            countdown = min(lock.held_for or options.ttl, options.interval) + random.uniform(0.05, 0.25)  # noqa: S311
            self._defer(run, countdown, "duplicate", {})
            return
        reason = f"duplicate of {self.name} skipped: lock {run.key} is held by task {holder_id}"
        # Storing REVOKED costs a read and a write on the result backend, most of a skip's cost: only for a caller
        # who can read it (ignore_result on the task or the message means nobody will).
        if not (request.is_eager or self.ignore_result or request.ignore_result):
            self.backend.mark_as_revoked(task_id, reason, request=None)
        self._skip_quietly(run, Skipped(reason, run.key, holder_id))

    def _unavailable(self, run: _Run, lock: Redlock, task_id: str, options: _Options) -> None:
        errors = [str(e) for e in lock.node_errors]
        policy = options.on_unavailable
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
            return
        attempt = int(getattr(self.request, _ATTEMPT_HEADER, 0) or 0) + 1
        settings = options.settings
        if policy == "fail" or (settings.max_retries is not None and attempt > settings.max_retries):
            raise LockUnavailableError(run.key, node_errors=errors)
        delay = min(settings.retry_max_delay, settings.retry_delay * 2 ** (attempt - 1))
        countdown = random.uniform(delay / 2, delay)  # noqa: S311 - jitter, not crypto
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

    def _defer(self, run: _Run, countdown: float, reason: str, headers: dict[str, Any]) -> None:
        """Re-send this delivery (same task id, same options) to run after ``countdown`` s; this one does not run."""
        request = self.request
        max_countdown = self._options().max_countdown
        if max_countdown is not None:
            countdown = min(countdown, max_countdown)
        if request.is_eager:
            raise (
                LockUnavailableError(run.key)
                if reason == "unavailable"
                else DuplicateTaskError(run.key, task_name=self.name, holder_task_id=request.id)
            )
        merged = {**(request.headers or {}), **headers}
        self.signature_from_request(request, countdown=countdown, headers=merged).apply_async()
        signals.lock_waiting.send(sender=self, key=run.key, task_id=request.id, countdown=countdown, reason=reason)
        logger.info(
            "Task %s[%s] re-sent to run in %.1fs (%s): lock %s", self.name, request.id, countdown, reason, run.key
        )
        self._skip_quietly(run, Skipped(f"re-sent to run in {countdown:.1f}s ({reason})", run.key, None))

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
        succeeded = False
        try:
            result = self.run(*args, **kwargs)
            succeeded = True
        except Retry:
            run.retrying = True
            raise
        else:
            return result
        finally:
            # Before the tracer stores the result: a caller who waits for it and re-enqueues is never skipped.
            if not run.handed_over:
                self._release(run, done=succeeded)
            elif not run.retrying and not succeeded:
                self._release(run)  # the retry was never sent (max retries exceeded, publish failed): cancel it

    # -- exits -------------------------------------------------------------------------------------------------

    def _release(self, run: _Run, *, done: bool = False) -> None:
        """Give the lock up; after a success, leave a short ``done`` marker instead of deleting it.

        Timeline of what the marker prevents: this run releases, a redelivered copy of the same task id (waiting
        on a countdown) takes the lock, finds no SUCCESS stored yet, and runs the job a second time; only then
        does the tracer store this run's SUCCESS. With the marker, that copy sees its own task id marked done and
        stops, while a different job takes the marker over at once (one extra round trip), never skipped.
        """
        lock, lease = run.lock, run.lease
        run.lock = run.lease = None
        if lease is not None:
            watchdog().unregister(lease)
        if lock is None:
            return
        try:
            if done and self.lock_cooldown > 0:
                # Not a "done" marker: nobody takes this one over, so the job stays locked for the cooldown.
                held = lock.transfer(holder_token(self.request.id, self.name, COOLDOWN), float(self.lock_cooldown))
            elif done:
                # As long as a waiting copy of this task id can take to come back: it was re-sent with a countdown of
                # at most one ttl (see before_start), so the marker outlives it.
                held = lock.transfer(holder_token(self.request.id, self.name, DONE), self._options().ttl + 0.5)
            else:
                held = lock.release()
        except Exception:  # a release that failed still ends within ttl: log, never mask the task's outcome
            logger.exception("releasing lock %s failed; it expires within its ttl", run.key)
            return
        self._count("released")
        signals.lock_released.send(sender=self, key=run.key, task_id=self.request.id, held=held)

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

        Before the retry message is sent, the lock is handed over to the next delivery of this task id (the
        retry) with a lease covering the countdown plus ttl: a different duplicate sent meanwhile is skipped, and
        the retry takes the lock over atomically. Handing over first matters: the retry can start on another
        worker before this delivery's own cleanup has run.
        """
        run: _Run | None = self.request.__dict__.get("_singleton_lock")
        if run is not None and run.lock is not None and not self.request.is_eager:
            if eta is not None:
                # Celery reads a naive eta as UTC.
                aware = eta if eta.tzinfo is not None else eta.replace(tzinfo=dt.timezone.utc)
                delay = max(0.0, (aware - dt.datetime.now(dt.timezone.utc)).total_seconds())
            else:
                delay = float(countdown if countdown is not None else self.default_retry_delay or 0)
            if run.lease is not None:
                watchdog().unregister(run.lease)
                run.lease = None
            token = holder_token(self.request.id, self.name, HANDOVER)
            run.handed_over = run.lock.transfer(token, delay + self._options().ttl)
        return super().retry(args, kwargs, exc, throw, eta, countdown, max_retries, **options)

    def after_return(self, status: str, retval: Any, task_id: str, args: Any, kwargs: Any, einfo: Any) -> None:
        """In the worker's main process after a hard time limit: end the killed run's lease soon.

        Celery calls after_return in the main process only for a hard time limit (celery/worker/request.py:569),
        not for a child lost to SIGKILL or OOM (WorkerLostError): that run's lease simply runs out, within ttl.
        """
        super().after_return(status, retval, task_id, args, kwargs, einfo)
        if isinstance(retval, TimeLimitExceeded) and task_id:
            try:
                self._end_lease_of(task_id, self.lock_key_for(*(args or ()), **(kwargs or {})))
            except Exception:
                logger.exception("could not end the lease of %s[%s]", self.name, task_id)

    def _end_lease_of(self, task_id: str, key: str) -> None:
        """Take the lock over from the run being killed, with a lease of ~1 s that nobody renews.

        Capping the lease's expiry alone is not enough: Celery calls after_return (celery/worker/request.py:569)
        BEFORE billiard kills the child (SIGTERM, then SIGKILL 0.1 s later: billiard/pool.py:755-779), and the
        child's watchdog can renew in between, back to a full ttl. Taking the lock over (the retry hand-over's
        mechanism) replaces the token, so the dying run's renewals and release no longer match; the new token
        names the same task id, so a redelivery of it waits ~1 s instead of a ttl.
        """
        token = holder_token(task_id, self.name, ENDING)
        lock = Redlock(self._options().settings.nodes, key, ttl=_END_LEASE, token=token, fencing=False)
        if lock.acquire(blocking=False):  # nobody held it any more: nothing to end
            lock.release()
            return
        holder = parse_holder(lock.held_by)
        if lock.contended and holder is not None and holder.task_id == task_id:
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

    def _on_lost(self, task_id: str, lease: Lease, reason: str) -> None:
        """Called in the watchdog's thread when renewal fails."""
        self._count("lost")
        signals.lock_lost.send(sender=self, key=lease.lock.name, task_id=task_id, reason=reason)
        logger.warning(
            "Lock %s of %s[%s] LOST while running: %s; the task should stop before further side effects "
            "(self.check_lock() raises from now on)",
            lease.lock.name,
            self.name,
            task_id,
            reason,
        )

    def _count(self, event: str) -> None:
        settings = self._options().settings
        watchdog().count(settings.nodes, settings.prefix, event)
