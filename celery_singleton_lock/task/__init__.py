"""LockedTask: a Celery ``Task`` base class that runs each job at most once at a time.

::

    @app.task(base=LockedTask, lock_ttl=30)
    def rebuild_report(account_id: int, month: str = "current") -> None: ...

This module holds Celery's hooks and the public options only; each hook hands its work to a room of its own:

=====================  ==================================================================================
``apply_async``        the enqueue side (``_enqueue``): queue-scope reservations, the enqueue check
``before_start``       the delivery (``_delivery``): facts -> :func:`~celery_singleton_lock.decision.decide` -> act;
                       a duplicate follows its policy (``policies``); waiting duplicates join the key's line (``_line``)
                       a delivery about to run asks its active features (``policies``: rate, debounce, ...)
``__call__``           the body, then the release or the retry's hand-over (``_delivery``, ``_handover``)
``retry``              the hand-over of the lock to the retry (``_handover``)
``Request``            what monitors see of a delivery that did not run (``_monitoring``)
``bind``               the start checks (``_startup``), shared with beat and the doctor
=====================  ==================================================================================

The protocol these rooms speak with the lock nodes (keys, holder records, states) is written down in
docs/protocol.md.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import inspect
import logging
from collections.abc import Callable, Sequence
from typing import Any, ClassVar, cast

from celery import Task
from celery.exceptions import Ignore, Reject, Retry
from celery.states import READY_STATES

from ..errors import ConfigurationError, JobCancelledError, LockLostError, SlowDown
from ..lock.config import DuplicatePolicy, LostPolicy, UnavailablePolicy, settings_for
from ..lock.interrupt import outside_body
from ..lock.keys import Binder
from ..policies import FEATURES, SENDING, conf_of, hooks_of, policy_for
from ..policies.cancel import DEFAULT_TTL as DEFAULT_CANCEL_TTL
from ..policies.cancel import CancelReport, cancel_job
from ..policies.limit import LIMIT
from ..policies.rate import RATE_FEATURE, Rate, RateLimitPolicy
from ..policies.waiting import WAITING
from . import _delivery as delivery
from . import _enqueue as enqueue
from . import _handover as handover
from ._brokers import native_delayed_delivery, visibility_timeout
from ._enqueue import DEFAULT_QUEUE_TTL
from ._monitoring import SKIP_MARK, LockedRequest, Skipped, parse_skipped
from ._run import DONE_MARGIN, Context, Options, Run, mark_joined
from ._startup import (
    SettingsStep,
    StartError,
    StartProblem,
    check_group,
    check_matrix,
    check_options,
    check_start,
    start_problems,
)

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
        (like reschedule, but a newer duplicate takes the waiting one's place: keep-latest) or ``"cancel"`` (like
        replace, and the running job is asked to stop: it ends REVOKED and the newest call runs after it, never
        beside it; see ``policies/cancel.py``). Chord members always
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
        ``None``: no lock at all (no concurrency limit, no duplicate check): for a task with a ``lock_rate`` only.
        A function: called like ``lock_key``, with the task's arguments as given, where the key is built, it returns
        the limit of that call's key (premium customers 10 at once, others 1); a changed answer applies to runs that
        start after the change (a lowered one: as the runs holding the higher slots end).
    ``lock_rate``
        ``"N/s"``, ``"N/m"``, ``"N/h"``, ``"N/d"`` or ``(N, seconds)``: never more than N starts of one rate key in
        any window of that length (a sliding window), counted across every worker and host on the lock's nodes
        (their clock). A start counts when the body really starts: after the lock is taken, in one more round trip.
        A list of limits (each one of those, or ``Rate("60/m", on=["tenant_id"])`` with its own arguments) is
        stacked: a start needs a share of every one, all or none, in that same one round trip.
    ``lock_rate_cost``
        the units a start takes of each limit (default 1): a number, or a function called like ``lock_key``; the
        body may report the real cost with ``self.rate_spent(n)`` (docs/rate.md says what is promised).
    ``lock_rate_on``
        the arguments that share one rate (default: one rate for the whole task); separate from the job's identity.
    ``lock_on_rate_limit``
        ``"wait"`` (default: re-sent for the moment the window lets it in; never dropped, never early), ``"skip"``
        (REVOKED) or ``"fail"`` (FAILURE with :class:`RateLimitedError`).
    ``lock_group``
        a name shared by several tasks: it takes the task name's place in their keys, so equal identifying arguments
        are one key across the group, and their ``lock_limit``, cooldown, line and rate count runs of all of them
        together. Every task of a group must agree on what shares a key (policy, limit, rate, cooldown, cap, the job's
        argument names), and a group has no queue scope, enqueue check or debounce (checked at registration, at
        worker start and by the doctor: docs/options.md, the options matrix).
    ``lock_on_lost``
        what the body does when its lock is lost while it runs (renewal refused, or no quorum for one interval):
        ``"continue"`` (default: it goes on; ``self.check_lock()`` raises from then on) or ``"interrupt"``:
        :class:`LockLostError` is raised inside the body, in the prefork and solo pools (through a signal to the
        main thread, like the soft time limit) and gevent (thrown into the greenlet); not in the threads or eventlet
        pool (a warning says so). Best effort: code blocked in C sees it when it returns to Python.

    ``lock_max_waiting``
        with ``"reschedule"``, ``"replace"`` or ``lock_limit``: at most this many duplicates wait in a key's line; a
        new duplicate that finds it full is skipped at once (REVOKED, saying the line of its key is full). A
        waiting call's own re-sends and wake-ups never count as new. Default None: no cap.
    ``lock_fair_on``
        with ``"reschedule"`` and a key shared by several values of these arguments (``lock_unique_on`` without
        them, or a ``lock_group``): the key's waiting line is served round-robin across their values, so one
        tenant's flood delays another's calls by a bounded number of turns (docs/policies.md, "Fair turns").
    ``lock_debounce`` / ``lock_debounce_max``
        a burst of calls of one job runs once, ``lock_debounce`` s after its last call, with the last call's
        arguments; every call gets the burst's ``AsyncResult``; ``lock_debounce_max`` bounds the delay from the
        burst's first call (see :mod:`celery_singleton_lock.policies.debounce`).

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
    lock_limit: ClassVar[int | Callable[..., int] | None] = 1
    lock_on_lost: ClassVar[LostPolicy] = "continue"
    lock_max_waiting: ClassVar[int | None] = None
    lock_fair_on: ClassVar[Sequence[str] | None] = None
    lock_debounce: ClassVar[float | None] = None
    lock_debounce_max: ClassVar[float | None] = None
    lock_rate: ClassVar[str | tuple[int, float] | Rate | Sequence[str | tuple[int, float] | Rate] | None] = None
    lock_rate_cost: ClassVar[float | Callable[..., float] | None] = None
    lock_rate_on: ClassVar[Sequence[str] | None] = None
    lock_on_rate_limit: ClassVar[RateLimitPolicy] = "wait"
    lock_group: ClassVar[str | None] = None
    Request = "celery_singleton_lock.task:LockedRequest"
    _singleton_lock_task: ClassVar[bool] = True  # what _run.is_locked_task looks for

    _lock_options: Options | None = None
    _lock_sends: bool | None = None  # a feature answers this task's calls at send (read once)

    # -- registration ------------------------------------------------------------------------------------------

    @classmethod
    def bind(cls, app: Any) -> Any:
        """Validate the task's ``lock_*`` options at registration (Celery binds a decorated task when the app is
        finalized: at worker or beat start, or at the first ``app.tasks``); the settings are checked at start."""
        bound = super().bind(app)  # applies task_annotations first: they are options too
        try:
            check_options(cls)
            registered = app._tasks.values()  # noqa: SLF001 - the tasks registered so far (app.tasks finalizes)
            check_group(cls, [t for t in registered if t.name != cls.name])
        except ConfigurationError as exc:
            raise StartError(str(exc)) from None
        steps = app.steps["worker"]
        if SettingsStep not in steps:
            steps.add(SettingsStep)
        return bound

    def _options(self) -> Options:
        options = self._lock_options
        if options is None:
            settings = settings_for(self.app)
            ttl = float(self.lock_ttl) if self.lock_ttl is not None else settings.ttl
            try:
                binder: Binder | None = Binder(inspect.signature(self.run))
            except (TypeError, ValueError):
                binder = None
            visibility = visibility_timeout(self.app)
            hooks = hooks_of(FEATURES, self.__class__)
            # A feature may impose what a duplicate does (debounce: a job that finds the previous burst's run still
            # running waits for it, never beside it).
            imposed = next((f.duplicates for f in hooks.features if f.duplicates), None)
            on_duplicate = cast("DuplicatePolicy", imposed or self.lock_on_duplicate or settings.on_duplicate)
            check_matrix(self, settings)  # what only the settings make invalid (a lock_limit with a default 'replace')
            options = Options(
                settings=settings,
                ttl=ttl,
                interval=ttl * settings.renew_fraction,
                on_duplicate=on_duplicate,
                policy=policy_for(on_duplicate),
                on_unavailable=self.lock_on_unavailable or settings.on_unavailable,
                on_lost=self.lock_on_lost,
                binder=binder,
                # A message held unacked past the visibility timeout (a countdown waiting in the worker) is restored
                # by the broker and then exists twice: a copy re-sent every time it waits would multiply.
                max_countdown=visibility / 2 if visibility else None,
                done_window=max(2 * ttl, visibility or 0.0) + DONE_MARGIN,
                done_window_short=max(2 * ttl, 60.0),
                whole_seconds=native_delayed_delivery(self.app),
                max_waiting=WAITING.cap(self),
                space=self.lock_group or self.name,
                key_fn=type(self).lock_key,
                unique_on=self.lock_unique_on,
                scope=self.lock_scope,
                queue_ttl=float(self.lock_queue_ttl),
                hooks=hooks,
                conf=conf_of(hooks.features, self),
            )
            self._lock_options = options
        return options

    def _sends(self) -> bool:
        """A feature of this task answers its calls at ``apply_async`` (its ``at_send``): read once, from the class
        alone (the settings are not read for a plain call)."""
        sends = self._lock_sends = any(f.active(self.__class__) for f in SENDING)
        return sends

    def lock_options(self) -> Options:
        """This task's resolved options (the app's settings overlaid with its ``lock_*`` attributes), read once."""
        return self._lock_options or self._options()

    def lock_context(self) -> Context:
        """The seam the Celery-side rooms take: this task's options, key builder, lock factory, counting and loss
        hooks (see :class:`celery_singleton_lock.task._run.Context`). Built once per call and once per delivery."""
        return Context(self, self._options())

    def lock_key_for(self, *args: Any, **kwargs: Any) -> str:
        """The lock key of a call with these arguments (what ``celery locks`` lists)."""
        return self.lock_context().key(args, kwargs)

    def lock_rate_key_for(self, *args: Any, **kwargs: Any) -> str | None:
        """The rate key of a call with these arguments (None: the task has no ``lock_rate``)."""
        return RATE_FEATURE.key_for(self.lock_context(), args, kwargs)

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
        (see :func:`celery_singleton_lock.task._enqueue.reserve`); with ``lock_enqueue_check``, a call whose job is
        running returns that run."""
        publish = super().apply_async
        sends = self._lock_sends
        if sends is None:
            sends = self._sends()
        if self.lock_scope != "queue" and not self.lock_enqueue_check and not sends:
            # By name, as every path here: a base class after LockedTask in the MRO may take only
            # apply_async(args, kwargs, **options).
            sent = publish(
                args,
                kwargs,
                task_id=task_id,
                producer=producer,
                link=link,
                link_error=link_error,
                shadow=shadow,
                **options,
            )
            return mark_joined(sent, None)

        def publish_as(args_: Any, kwargs_: Any, **more: Any) -> Any:
            return publish(args_, kwargs_, producer=producer, link=link, link_error=link_error, shadow=shadow, **more)

        return enqueue.send(
            self.lock_context(), publish_as, args, kwargs, task_id, options, linked=bool(link or link_error)
        )

    async def aapply_async(
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
        """``apply_async`` for ``async def`` callers: the same call and result, never blocking the event loop.

        With ``lock_scope="queue"`` the reservation is taken on AsyncRedlock (its round trips awaited) and the
        publish runs in a worker thread (kombu has no asyncio publish); a caller cancelled after its publish
        started does not cancel it, and its reservation is settled when it ends. Anything else (run scope,
        ``lock_enqueue_check``, a feature answering at send (``lock_debounce``), lock nodes given as
        ``redis.Redis`` clients) runs the sync ``apply_async`` whole in a worker thread. See
        :func:`celery_singleton_lock.task._enqueue.asend`.
        """
        publish = super().apply_async

        def publish_as(args_: Any, kwargs_: Any, **more: Any) -> Any:
            return publish(args_, kwargs_, producer=producer, link=link, link_error=link_error, shadow=shadow, **more)

        # A task's first call resolves its settings (Celery's app finalized) off the loop.
        options_ = self._lock_options
        if options_ is None:
            options_ = await asyncio.to_thread(self._options)
        return await enqueue.asend(
            Context(self, options_), publish_as, args, kwargs, task_id, options, linked=bool(link or link_error)
        )

    async def adelay(self, *args: Any, **kwargs: Any) -> Any:
        """``delay`` for ``async def`` callers: ``await charge.adelay(7)`` (see :meth:`aapply_async`)."""
        return await self.aapply_async(args, kwargs)

    def revoke_queued(self, task_id: str, *args: Any, **kwargs: Any) -> bool:
        """Revoke a queue-scope job's message and free its reservation now (``args``/``kwargs``: the call's).

        ``AsyncResult.revoke()`` alone frees the reservation only when a worker meets the revoked message (at its
        countdown, or when it reaches the front of the queue). True when a reservation was freed and the message
        revoked; False when there was none (a worker had taken the job over already: it runs, or ran, and is left
        alone).
        """
        return enqueue.revoke_queued(self.lock_context(), task_id, *args, **kwargs)

    def cancel(self, *args: Any, **kwargs: Any) -> CancelReport:
        """Cancel the job these arguments name: the one holding their lock (running, or reserved by
        ``lock_scope="queue"``), durably for one day (see :meth:`cancel_task_id`). A queued message of a run-scope
        call holds nothing yet: cancel it by its task id. Returns what was found and done (``outcome``)."""
        ctx = self.lock_context()
        key = ctx.key(args, kwargs)
        from ..lock.inventory import show_lock  # noqa: PLC0415 - the CLI's read, only here

        info, _ = show_lock(ctx.options.settings, key).value
        if info is None or not info.task_id:
            nodes = ctx.options.settings.nodes
            return CancelReport(key, "-", "unknown", 0, len(nodes), nodes.quorum)
        return self.cancel_task_id(info.task_id, args, kwargs)

    def cancel_task_id(
        self,
        task_id: str,
        args: Sequence[Any] | None = None,
        kwargs: dict[str, Any] | None = None,
        *,
        ttl: float = DEFAULT_CANCEL_TTL,
        by: str = "task.cancel",
    ) -> CancelReport:
        """Cancel job ``task_id`` (``args``/``kwargs``: its call's, which name its lock; None: looked up among the
        locks held), written on the lock nodes for ``ttl`` s: a running body is stopped within one renewal interval
        (ends REVOKED "cancelled (by ...)"), its queued copies are dropped when they reach any worker (also one that
        was offline, or restarted since), and a queue-scope reservation is freed. A job that already ended is left
        alone (``outcome == "ended"``). A call made afterwards is a new job and runs. ``report.durable``: written on a
        quorum of the nodes."""
        ctx = self.lock_context()
        settings = ctx.options.settings
        nodes = settings.nodes
        key: str | None = None
        limit = LIMIT.static(self)
        if args is not None or kwargs is not None:
            call_args, call_kwargs = tuple(args or ()), dict(kwargs or {})
            key = ctx.key(call_args, call_kwargs)
            limit = ctx.limit_for(call_args, call_kwargs) or 1
        else:
            from ..lock.inventory import list_locks  # noqa: PLC0415 - the CLI's scan, only here

            held = [i for i in list_locks(settings).value if i.task_id == task_id and i.kind == "task"]
            if held:
                key = held[0].lock_key or held[0].key
        if key is None:
            return CancelReport("-", task_id, "unknown", 0, len(nodes), nodes.quorum)
        try:
            ended = self.backend.get_state(task_id) in READY_STATES
        except Exception:  # no usable result backend: the done marker alone tells
            ended = False
        if ended:
            return CancelReport(key, task_id, "ended", 0, len(nodes), nodes.quorum)
        return cancel_job(nodes, settings.prefix, key, task_id, by=by, ttl=ttl, limit=limit)

    # -- a delivery ----------------------------------------------------------------------------------------------

    def before_start(self, task_id: str, args: Any, kwargs: Any) -> None:
        """Gather the facts of this delivery, let :func:`~celery_singleton_lock.decision.decide` choose, act."""
        delivery.start(Context(self, self._options()), task_id, args, kwargs)

    def lock_limit_for(self, *args: Any, **kwargs: Any) -> int | None:
        """The ``lock_limit`` of a call with these arguments: the option, or a function's answer for them."""
        return self.lock_context().limit_for(args, kwargs)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        run: Run | None = self.request.__dict__.get("_singleton_lock")
        if run is None or run.entered:
            # Called directly (not through a worker or apply()), or by its own body: a plain call, no lock of its
            # own (and it must not release the lock of the run it is called from).
            return super().__call__(*args, **kwargs)
        if run.outcome is not None:
            return run.outcome
        run.entered = True
        ctx = run.ctx
        assert ctx is not None  # set with the Run by the delivery
        ctx.count("started")
        succeeded = ended = False
        if run.body_args is not None:  # a feature swapped them (debounce: the burst's last call's arguments)
            args, kwargs = run.body_args
        try:
            result = self.run(*args, **kwargs)
            succeeded = ended = True
        except (Retry, Ignore):  # not an end of the job: a retry follows, or the message is dropped unrecorded
            raise
        except Reject:
            # Not an end either way: requeued, it runs again; rejected, a dead-letter exchange may bring it back
            # (the retry-queue pattern Celery documents), and it must run then.
            raise
        except JobCancelledError as exc:  # lock_on_duplicate="cancel": stopped for a newer call, REVOKED
            ended = True
            result = delivery.cancelled(ctx, run, exc.cancelled_by)
        except SlowDown as exc:  # the API said "slow down": the rate pauses, the call is re-sent for after it
            result = delivery.slowed(ctx, run, exc.retry_after, exc.limit)
            if result is None:  # no rate to pause (or an eager call): the call fails with it
                ended = True
                raise
        except Exception:
            ended = True  # FAILURE: the job ran to its end; a copy of it (a waiting call, a redelivery) must not run
            raise
        finally:
            # Before the tracer stores the result: a caller who waits for it and re-enqueues is never skipped.
            if run.handover_ttl is not None:
                # self.retry() sent the retry: now that the body has ended (unwound, or returned after
                # retry(throw=False)), the job is the retry's. Not before: the body was still inside the job.
                handover.hand_over(ctx, run, run.handover_ttl)
            else:
                delivery.release(ctx, run, done=ended, succeeded=succeeded)
        return result

    # -- exits -------------------------------------------------------------------------------------------------

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
        redelivery mark, a booked slot), with or without a lock: it is a new attempt.

        ``exc`` a :class:`SlowDown` in a run of a task that a feature can pause (one with a ``lock_rate``; Celery's
        ``autoretry_for`` hands every exception it catches to this method): the SlowDown is raised instead, as if the
        body had raised it (the rate pauses, the call is re-sent for after it); no retry is sent or spent.
        """
        run: Run | None = self.request.__dict__.get("_singleton_lock")
        pausing = run.ctx if run is not None and not self.request.is_eager else None
        if isinstance(exc, SlowDown) and pausing is not None and pausing.options.hooks.slowed:
            raise exc
        if run is None or run.lock is None or self.request.is_eager:
            if run is not None:  # no lock to hand over (lock_limit=None): still a new attempt, without our headers
                handover.drop_own_headers(self.request, options)
            sent = super().retry(args, kwargs, exc, throw, eta, countdown, max_retries, **options)
            if run is not None:
                run.retry_sent = True  # throw=False: sent, and the body goes on
            return sent
        # Anything but Retry raised (MaxRetriesExceededError, the exception re-raised, Reject for a failed
        # publish): nothing was sent, nothing is handed over.
        lease_for = handover.retry_lease(run.ctx or self.lock_context(), eta, countdown, options)
        try:
            sent = super().retry(args, kwargs, exc, throw, eta, countdown, max_retries, **options)
        except Retry:
            run.handover_ttl = lease_for
            raise
        run.handover_ttl = lease_for  # throw=False: sent, and the body goes on
        run.retry_sent = True
        return sent

    # -- what the body can ask -----------------------------------------------------------------------------------

    def _current(self) -> Run | None:
        return cast("Run | None", self.request.__dict__.get("_singleton_lock"))

    def lock_held(self) -> bool:
        """True while this run's lock is ours (not lost, valid by our clock). No I/O: cheap in a loop."""
        run = self._current()
        return run is not None and run.lease is not None and run.lease.held()

    def check_lock(self) -> None:
        """Raise :class:`LockLostError` if this run no longer holds its lock. Call it before side effects."""
        run = self._current()
        if run is None:
            raise LockLostError(f"{self.name} holds no lock here (not running under a worker)")
        if run.cancelled_by is not None:  # lock_on_duplicate="cancel": a newer call asked this run to stop
            raise JobCancelledError(run.key, run.cancelled_by, self.name)
        if run.lease is None or not run.lease.held():
            reason = run.lease.reason if run.lease else "not held"
            raise LockLostError(f"lock {run.key} of {self.name} lost: {reason}", key=run.key)

    @property
    def fencing_token(self) -> int | None:
        """This run's fencing token (pass it to stores that reject stale writers); None when not held."""
        run = self._current()
        return run.lock.fencing_token if run is not None and run.lock is not None else None

    @property
    def rate_started_at(self) -> float | None:
        """``lock_rate``: when this run's start was counted (Unix seconds, by the clock of a lock node that counted
        it); None without a rate or outside a run."""
        run = self._current()
        return RATE_FEATURE.started_at(run) if run is not None else None

    def rate_spent(self, units: float, limit: int | str | tuple[int, float] | None = None) -> int:
        """``lock_rate``: this run's start really cost ``units`` (an LLM call's tokens, known after the call): the
        windows are corrected on the nodes that counted it, a refund or an extra charge (docs/rate.md, Costs). Which
        limits: ``limit`` names one (an index in ``lock_rate`` or a notation such as ``"90000/m"``, as ``SlowDown``);
        without it, those whose cost is a function (an estimate), or every limit when none is. Returns the units
        added to the first limit corrected (< 0: given back); 0 outside a counted run."""
        run = self._current()
        return RATE_FEATURE.spent(self.lock_context(), run, units, limit) if run is not None else 0

    # -- plumbing ----------------------------------------------------------------------------------------------

    def _count(self, event: str) -> None:
        """Count one outcome for this task (see :meth:`Context.count`)."""
        self.lock_context().count(event)


outside_body(LockedTask.__call__)  # lock_on_lost="interrupt": a signal handled in __call__'s own code is not the body's
