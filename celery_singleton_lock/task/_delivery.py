"""The delivery: a message reaches a worker; gather the facts, let :func:`~celery_singleton_lock.decision.decide`
choose, act. And its end: the release, after a success or a failure.

Life of one delivery (the tracer calls ``before_start``, then ``__call__``, then stores the result)::

    start          key = prefix + task name + hash(bound arguments); one acquire round trip to every node at once;
                   the lock's value is a holder record (owner, fence, state, job = task id, name, worker, at)
      |- acquired ..................... run: the watchdog renews the lease every ttl/3 while the body runs
      |- this task id is done ......... (its done marker exists) stop: never run a finished job again
      |- held by a different job ...... duplicate: the task's policy (skip, fail, reschedule, replace)
      |- held by this same task id .... a redelivery (acks_late, visibility timeout): never skipped, never run
      |                                 beside its live twin: re-sent with a countdown of the remaining lease
      |- handed over by self.retry() .. this is the retry: take the lock over atomically and run
      |- split vote ................... retried at once with jitter, then re-sent soon: never a duplicate
      '- no quorum answered ........... retry with back-off (default) / fail / run unguarded
    release        the body's ``finally`` releases the lock (owner-checked) BEFORE the tracer stores the result, so a
                   caller who waits for the result and re-enqueues at once is never skipped; the job's end (a
                   success or a failure) also leaves the task id's done marker, in the same round trip
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import functools
import logging
import random
import time
from typing import Any, NoReturn

from celery.states import READY_STATES

from ..errors import DuplicateTaskError, LockUnavailableError
from ..lock.config import UnavailablePolicy
from ..lock.interrupt import Target
from ..lock.record import COOLDOWN, HANDED, QUEUED, SENDING, limits_key_for
from ..lock.redlock import Redlock
from ..lock.renewal import watchdog
from ..policies import cancel, policy_for
from ..policies.decision import SPLIT_RETRIES, Act, Decision, Facts, Outcome, decide, duplicate_policy
from ..policies.facts import facts_of
from ..policies.limit import LIMIT
from . import _line as line
from . import _resend as resend
from . import signals
from ._run import (
    ATTEMPT_HEADER,
    PARKED_HEADER,
    REDELIVERY_HEADER,
    RESERVED_HEADER,
    RESUMED_HEADER,
    SETTLE_HEADER,
    SINCE_HEADER,
    WOKEN_HEADER,
    Context,
    Options,
    Run,
    Skipped,
    since,
    try_of,
)

__all__ = ["SETTLE_GRACE", "release", "start"]

logger = logging.getLogger("celery_singleton_lock.task")

#: Seconds a copy that found its job done, but no result stored, waits before saying so (see settle_done).
SETTLE_GRACE = 10.0


def start(ctx: Context, task_id: str, args: Any, kwargs: Any) -> None:
    """Gather the facts of this delivery, let :func:`~celery_singleton_lock.decision.decide` choose, act."""
    request = ctx.request
    options = ctx.options
    key = ctx.key(args, kwargs)
    retries = int(request.retries or 0)
    run = Run(key, task_id, retries, ctx=ctx)
    request._singleton_lock = run
    if options.policy.replaces and getattr(request, SINCE_HEADER, None):
        # A waiting job's copy: a newer one may have taken its place in the line meanwhile.
        newer = line.superseded_by(ctx, key, task_id, options)
        if newer is not None:
            if options.policy.hands_on:
                # "cancel": a stopped run may have handed its lock to this call. Any copy of it passes the lock on to
                # the newest waiting call, never free in between: the woken copy that follows every hand-over, or
                # the fallback copy when that one is lost or late (a worker SIGKILLed holding it), which would
                # otherwise leave the newer call waiting for the hand-over to expire.
                pass_on(ctx, run, options)
            line.replaced(ctx, run, task_id, newer)
            return
    run.limit = ctx.limit_for(args, kwargs)
    gates = options.hooks.after_lock
    if run.limit is None:
        # No lock at all (lock_limit=None): the features alone decide (the rate). Nothing to hold, release or mark.
        if gates:
            after_lock(ctx, run, None, args, kwargs)
        return
    redelivered = bool(getattr(request, REDELIVERY_HEADER, None) or (request.delivery_info or {}).get("redelivered"))
    run.redelivered = redelivered
    scan = slots_to_scan(ctx, options, run.limit, redelivered or retries > 0) if LIMIT.varies(ctx.cls) else 0
    lock = ctx.new_lock(key, task_id, retries, run.limit, scan)
    acquired = lock.acquire(blocking=False)
    reserved = ctx.options.scope == "queue" and bool(getattr(request, RESERVED_HEADER, None))
    if acquired and not redelivered and not reserved:
        # The common case, without building the facts: decide(Facts("acquired", ...)) is RUN (tested).
        if not gates or after_lock(ctx, run, lock, args, kwargs):
            hold(ctx, run, lock, options, request)
        return
    facts = gather(ctx, lock, acquired, task_id, redelivered, options)
    if reserved:  # rare (a queue-scope job's first delivery): a copy of the facts costs more than gathering them
        facts = dataclasses.replace(facts, reserved=True)
    handed = False  # took over the lock a stopped run handed to this waiting call ("cancel", hand_on.lua)
    for _ in range(2 * SPLIT_RETRIES + 4):  # each act below changes the facts; a few steps always settle
        decision = decide(facts)
        act = decision.act
        if act is Act.RUN:
            if handed and superseded_meanwhile(ctx, run, lock, options):
                return
            if not gates or after_lock(ctx, run, lock, args, kwargs):
                hold(ctx, run, lock, options, request)
            return
        if act is Act.LOOK_UP:
            facts = dataclasses.replace(facts, ended=already_ended(ctx, task_id))
            continue
        if act is Act.RETRY_NOW:
            # Contenders that arrived together split the nodes and nobody got a quorum (or the attempt that
            # sent this retry is still ending): try again after a jittered pause (Redlock's rule for a split),
            # instead of skipping every contender as the others' duplicate, or waiting a whole interval.
            time.sleep(random.uniform(0.005, 0.05))  # noqa: S311 - jitter
            acquired = lock.acquire(blocking=False)
            facts = gather(ctx, lock, acquired, task_id, redelivered, options, facts)
            facts = dataclasses.replace(facts, split_retries=facts.split_retries + 1)
            continue
        if act is Act.TAKE_OVER:
            # Our own retry's hand-over, or our queue-scope reservation: take it over atomically (a fresh owner
            # token, like every attempt). A reservation marked sent by its client in between has a new owner
            # token: take that over (a few times at most).
            handed = facts.holder_state == HANDED
            for _ in range(3):
                holder_owner = lock.held_by
                lock = ctx.new_lock(key, task_id, retries, run.limit, scan)
                lock.replaces = holder_owner
                acquired = lock.acquire(blocking=False)
                record = lock.holder_record or {}
                if acquired or record.get("job") != task_id or record.get("state") not in (QUEUED, SENDING):
                    break
            facts = gather(ctx, lock, acquired, task_id, redelivered, options, facts)
            facts = dataclasses.replace(facts, took_over=True)
            continue
        if act is Act.DEFER and decision.reason == "duplicate" and not run.parked and options.waits_in_line:
            # Wait in the key's line, to be woken when the holder releases; then look once more, since the
            # holder may have released (and found nobody waiting) just before this job joined the line.
            run.parked = line.park(ctx, run, task_id, options)
            if run.line_full is not None:  # lock_max_waiting: the line is full, this new duplicate is skipped
                if acquired:
                    lock.release()
                line.full(ctx, run, task_id, facts.holder_job, options)
                return
            if run.superseded_by is not None:
                line.replaced(ctx, run, task_id, run.superseded_by)
                return
            if run.parked:
                acquired = lock.acquire(blocking=False)
                facts = gather(ctx, lock, acquired, task_id, redelivered, options, facts)
                continue
        if acquired:
            lock.release()  # DONE after a redelivery got the lock: give it back at once
        carry_out(ctx, run, decision, facts, lock, options)
        return
    raise AssertionError(f"no decision settled for {ctx.name}[{task_id}]: {facts}")  # pragma: no cover


#: Per process: the highest callable ``lock_limit`` this process wrote to the nodes lately, and when (monotonic), by
#: limits key.
_limits_noted: dict[str, tuple[int, float]] = {}


def slots_to_scan(ctx: Context, options: Options, limit: int, copy: bool) -> int:  # noqa: FBT001
    """A callable ``lock_limit``: how many slots this delivery's acquire looks at for its own job's record.

    Timeline of what it prevents: a run takes slot 2 under a limit of 3; the function then answers 1; the run's
    redelivery (a visibility timeout, the run still alive) would look at slot 0 only, find it free and run the job a
    second time beside the live run. So every limit used is noted on the nodes before a slot is taken under it (once
    per process and limit: no round trip after the first), and a copy of a job (redelivered, re-sent as one, a
    retry) looks at every slot the highest one noted may have given it (one more round trip, for copies only).
    A note is written again once it is a lease old: lock nodes restarted empty one at a time (a quorum up
    throughout) would otherwise wear it off every node while this process still trusts it.
    """
    settings = options.settings
    space = limits_key_for(settings.prefix, ctx.task.lock_group or ctx.name)
    noted_limit, noted_at = _limits_noted.get(space, (1, 0.0))
    now = time.monotonic()
    if limit > noted_limit or (limit > 1 and now - noted_at >= options.ttl):
        # Written again, it is the highest this process used: a limit lowered since must not wear off the higher one
        # a run of this process may still hold a slot under.
        limit_noted = max(limit, noted_limit)
        noted = 0
        for client in settings.nodes.clients:
            try:
                client.zadd(space, {str(limit_noted): limit_noted})
                noted += 1
            except Exception:  # a node that missed it: the others still say it (the highest of any node counts)
                logger.debug("could not note limit %d of %s", limit_noted, ctx.name, exc_info=True)
        if noted:
            _limits_noted[space] = (limit_noted, now)
    if not copy:
        return 0
    highest = limit
    for client in settings.nodes.clients:
        try:
            top = client.zrange(space, -1, -1, withscores=True)
        except Exception:  # cannot tell from this node: the others answer
            logger.debug("could not read the limits of %s", ctx.name, exc_info=True)
            continue
        if top:
            highest = max(highest, int(top[0][1]))
    return highest


def gather(
    ctx: Context,
    lock: Redlock,
    acquired: bool,  # noqa: FBT001
    task_id: str,
    redelivered: bool,  # noqa: FBT001
    options: Options,
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
        "holder_try": try_of(record),
        "jitter": random.random(),  # noqa: S311 - jitter, not crypto
    }
    if previous is not None:
        return dataclasses.replace(previous, **seen)
    request = ctx.request
    settings = options.settings
    seen["task_id"] = task_id
    seen["redelivered"] = redelivered
    seen["retries"] = int(request.retries or 0)
    seen["in_chord"] = bool(request.chord)
    seen["resumed"] = bool(getattr(request, RESUMED_HEADER, None))
    seen["on_duplicate"] = options.on_duplicate
    seen["on_unavailable"] = options.on_unavailable
    seen["attempt"] = int(getattr(request, ATTEMPT_HEADER, 0) or 0)
    seen["max_retries"] = settings.max_retries
    seen["ttl"] = options.ttl
    seen["interval"] = options.interval
    seen["retry_delay"] = settings.retry_delay
    seen["retry_max_delay"] = settings.retry_max_delay
    seen["max_countdown"] = options.max_countdown
    return facts_of(seen)  # Facts(**seen) without the frozen __init__'s 24 object.__setattr__ calls


def carry_out(ctx: Context, run: Run, decision: Decision, facts: Facts, lock: Redlock, options: Options) -> None:
    """Carry out an action that does not run the body under the lock."""
    act = decision.act
    task_id = facts.task_id
    if act is Act.DONE:
        by = cancel.read_marker(options.settings.nodes, run.key, task_id)
        if by is not None:  # a durable cancel (LockedTask.cancel, locks cancel), not a finished run
            dropped(ctx, run, by)
            return
        request = ctx.request
        if getattr(request, PARKED_HEADER, None):
            # A copy from the key's line of a job that ran while its leaving the line was lost (the line's node
            # unreachable then): its place is given up, and a woken copy passes its wake on to the next waiter.
            line.unpark(ctx, run.key, task_id, options)
            if getattr(request, WOKEN_HEADER, None) and options.waits_in_line:
                line.wake_next(ctx, run.key, options, run.limit)
        if not settle_done(ctx, run, task_id):
            resend.skip_quietly(ctx, run, Skipped("already ran", run.key, task_id, "done"))
    elif act is Act.RUN_UNGUARDED:
        unavailable(ctx, run, lock, task_id, options, "run")
    elif act is Act.FAIL_UNAVAILABLE:
        unavailable(ctx, run, lock, task_id, options, "fail")
        _Delivery(ctx, run, lock, (), {}).failed()  # each feature's end of it (debounce: the next call starts a burst)
        errors = [str(e) for e in lock.node_errors] or [f"held by {lock.held_by!r}, a record of no task"]
        raise LockUnavailableError(run.key, node_errors=errors)
    elif act is Act.DEFER and decision.reason == "unavailable":
        unavailable(ctx, run, lock, task_id, options, "retry", decision.countdown, facts.attempt + 1)
    elif act is Act.DEFER and decision.reason == "unknown holder":
        resend.defer(ctx, run, decision.countdown, decision.reason, {ATTEMPT_HEADER: facts.attempt + 1})
    elif act is Act.DEFER and decision.reason in ("redelivered", "split vote", "predecessor", "sending"):
        resend.defer(ctx, run, decision.countdown, decision.reason, {})
    else:  # SKIP, FAIL_DUPLICATE, DEFER of a duplicate
        duplicate(ctx, run, decision, facts)


def settle_done(ctx: Context, run: Run, task_id: str) -> bool:
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
    request = ctx.request
    if request.is_eager or ctx.task.ignore_result or request.ignore_result:
        return False
    try:
        if ctx.task.backend.get_state(task_id) in READY_STATES:
            return False
        if not getattr(request, SETTLE_HEADER, None):
            resend.defer(ctx, run, SETTLE_GRACE, "settling", {SETTLE_HEADER: 1})
            return True
        reason = (
            f"{ctx.name}[{task_id}] already ran (lock {run.key}), but the run that ended stored no "
            "result: it was killed after the job finished"
        )
        ctx.task.backend.mark_as_revoked(task_id, reason, request=None)
    except Exception:  # no usable result backend: nobody can wait on it either
        logger.debug("cannot settle the state of %s", task_id, exc_info=True)
        return False
    resend.skip_quietly(ctx, run, Skipped(reason, run.key, task_id, "settled"))
    return True


def before_body(ctx: Context, run: Run, lock: Redlock, request: Any) -> bool:
    """About to hold the lock for the body: each active feature's ``before_body`` (debounce claims its burst, and may
    swap the body's arguments: ``run.body_args``). False: a feature stopped the delivery."""
    delivery = _Delivery(ctx, run, lock, request.args, request.kwargs)
    return all(feature.before_body(delivery) for feature in ctx.options.hooks.before_body)


def after_lock(ctx: Context, run: Run, lock: Redlock | None, args: Any, kwargs: Any) -> bool:
    """The lock is taken (or the task has none): each active feature's ``after_lock`` in turn (the rate asks for its
    share). True: the body may start; False: a feature stopped the delivery (deferred, skipped; it raises: failed)."""
    delivery = _Delivery(ctx, run, lock, args, kwargs)
    return all(feature.after_lock(delivery) for feature in ctx.options.hooks.after_lock)


class _Delivery:
    """The delivery's side of a feature's hooks (:class:`~celery_singleton_lock.policies.port.Delivery`)."""

    __slots__ = ("args", "ctx", "kwargs", "lock", "run")
    attempt_header = ATTEMPT_HEADER

    def __init__(self, ctx: Context, run: Run, lock: Redlock | None, args: Any, kwargs: Any) -> None:
        self.ctx, self.run, self.lock, self.args, self.kwargs = ctx, run, lock, args, kwargs

    @property
    def attempt(self) -> int:
        return int(getattr(self.ctx.request, ATTEMPT_HEADER, 0) or 0)

    @property
    def woken(self) -> bool:
        return bool(getattr(self.ctx.request, WOKEN_HEADER, None))

    def give_back(self) -> None:
        give_back(self.ctx, self.run, self.lock, self.ctx.options)

    def wait_turn(self, *, wake: bool) -> bool:
        return wait_turn(self.ctx, self.run, self.lock, self.ctx.options, wake=wake)

    def wait_out(self, countdown: float, reason: str, headers: dict[str, Any], detail: str = "") -> None:
        wait_out(self.ctx, self.run, self.lock, self.ctx.options, countdown, reason, headers, detail)

    def resend(self, headers: dict[str, Any], countdown: float, **options: Any) -> None:
        resend.copy(self.ctx, headers, countdown=countdown, **options).apply_async()

    def skip(self, reason: str, holder_id: str | None, kind: str = "duplicate") -> None:
        resend.skip_quietly(self.ctx, self.run, Skipped(reason, self.run.key, holder_id, kind))

    def failed(self) -> None:
        for feature in self.ctx.options.hooks.at_fail:
            feature.at_fail(self)

    def may_refuse(self) -> bool:
        return all(feature.may_refuse(self) for feature in self.ctx.options.hooks.may_refuse)


def give_back(ctx: Context, run: Run, lock: Redlock | None, options: Options) -> None:
    """A delivery whose body does not start after all gives its lock back at once, leaves the line, wakes it."""
    if lock is None:
        return
    try:
        lock.release()
    except Exception:  # it expires within its ttl
        logger.debug("releasing lock %s after a refused start failed", run.key, exc_info=True)
    if run.parked or getattr(ctx.request, PARKED_HEADER, None):
        line.unpark(ctx, run.key, run.task_id, options)
    if options.waits_in_line:
        line.wake_next(ctx, run.key, options, run.limit)


def wait_turn(ctx: Context, run: Run, lock: Redlock | None, options: Options, *, wake: bool) -> bool:
    """lock_fair_on: this delivery took a free slot, but it is not its turn. It waits in the key's line (parked at
    its value's turn, or keeping its place), gives the slot back, wakes the head when ``wake`` (no woken call is on
    its way for the slot), and its fallback copy is re-sent for when a holder's lease would end. False when it
    could not park because the line is full (lock_max_waiting): it runs on the slot it holds."""
    parked = line.park(ctx, run, run.task_id, options) or run.parked
    if run.line_full is not None:
        run.line_full = None
        return False
    run.parked = parked
    if lock is not None:
        try:
            lock.release()
        except Exception:  # it expires within its ttl
            logger.debug("releasing lock %s for the line's turn failed", run.key, exc_info=True)
    if wake:
        line.wake_next(ctx, run.key, options, run.limit)
    headers: dict[str, Any] = {PARKED_HEADER: 1, REDELIVERY_HEADER: 1} if parked else {}
    countdown = options.ttl + 0.05 + 0.2 * random.random()  # noqa: S311 - jitter
    resend.defer(ctx, run, countdown, "duplicate", headers, f"lock {run.key}: waiting for its fair turn")
    return True


def wait_out(
    ctx: Context,
    run: Run,
    lock: Redlock | None,
    options: Options,
    countdown: float,
    reason: str,
    headers: dict[str, Any],
    detail: str = "",
) -> None:
    """Re-send this delivery to ask again in ``countdown`` s (a feature's wait: the rate's window, no quorum for it,
    a body's SlowDown); while it waits it keeps what its call holds against other calls:

    - queue scope: the key stays reserved for this job (the lock handed back to ``queued`` under its task id, as a
      reservation), so a later call of the key gets this job, and this job's copy takes the reservation over;
    - ``replace``: it waits in the key's line (lua/park_replacing.lua), so of the calls waiting for the lock or the
      window only the newest runs: an older one waiting is superseded by it, or it is superseded by a newer one;
    - otherwise the lock is given back (its copy is this call again: it keeps its place, see _resend.copy).
    """
    task_id = run.task_id
    reserved = ctx.options.scope == "queue" and not run.retries  # a retry waits as in run scope (see decide)
    if lock is not None and reserved and keep_reserved(ctx, run, lock, countdown):
        if run.parked or getattr(ctx.request, PARKED_HEADER, None):
            line.unpark(ctx, run.key, task_id, options)
    elif lock is not None and options.policy.replaces and not ctx.request.chord:
        try:
            lock.release()
        except Exception:  # it expires within its ttl
            logger.debug("releasing lock %s after a refused start failed", run.key, exc_info=True)
        run.parked = line.park(ctx, run, task_id, options)
        if run.superseded_by is not None:  # a newer call waits: it runs, this one does not
            line.wake_next(ctx, run.key, options, run.limit)
            line.replaced(ctx, run, task_id, run.superseded_by)
            return
        if run.parked:  # the only one waiting now (park_replacing took every older one out): nobody to wake
            headers = {**headers, PARKED_HEADER: 1}
        else:
            line.wake_next(ctx, run.key, options, run.limit)
    else:
        give_back(ctx, run, lock, options)
    resend.defer(ctx, run, countdown, reason, headers, detail)


def keep_reserved(ctx: Context, run: Run, lock: Redlock, countdown: float) -> bool:
    """Queue scope: hand the lock this delivery took over back to a reservation (``queued``, this task id) for its
    re-sent copy, lasting its countdown plus ``lock_queue_ttl`` (as a reservation made at ``apply_async``)."""
    try:
        return lock.transfer(countdown + float(ctx.options.queue_ttl), {"state": QUEUED, "open": "1"})
    except Exception:  # not kept: released as any refused start (it expires within its ttl otherwise)
        logger.debug("could not keep the reservation of lock %s", run.key, exc_info=True)
        return False


def hold(ctx: Context, run: Run, lock: Redlock, options: Options, request: Any) -> None:
    task_id = run.task_id
    if options.hooks.before_body and not before_body(ctx, run, lock, request):
        # A feature stops it (debounce: not due yet, a later call joined the burst: re-sent for its due time; or
        # superseded, a newer version of the key ran): the lock goes back at once, and what the features let in for it
        # is given back (the rate uncounts its start: the body did not start, a deferred delivery uses no share).
        for feature in options.hooks.body_skipped:
            feature.body_skipped(_Delivery(ctx, run, lock, request.args, request.kwargs))
        lock.release()
        if run.parked or getattr(request, PARKED_HEADER, None):
            line.unpark(ctx, run.key, task_id, options)
        line.wake_next(ctx, run.key, options, run.limit)
        return
    if run.parked or getattr(request, PARKED_HEADER, None):
        line.unpark(ctx, run.key, task_id, options)
    run.lock = lock
    # Every run can be cancelled (a newer call under lock_on_duplicate="cancel", or a durable cancel of any
    # LockedTask: LockedTask.cancel, locks cancel): its renewal answers the request, and the body is interrupted
    # with JobCancelledError. Only lock_on_lost="interrupt" interrupts it for a lost lease.
    target = Target()
    settings = options.settings
    run.lease = watchdog().register(
        lock,
        options.interval,
        functools.partial(ctx.on_lost, task_id, target if options.on_lost == "interrupt" else None),
        (settings.prefix, ctx.name),
        functools.partial(ctx.on_cancel, run, target),
    )
    ctx.count("acquired")
    if getattr(request, SINCE_HEADER, None) is not None:
        # A re-sent copy (deferred, or woken from a line): it waited since its call first reached a worker.
        watchdog().count_wait(settings.nodes, settings.prefix, ctx.name, time.time() - since(request) / 1000.0)
    if signals.lock_acquired.receivers:  # a send, its arguments and the token read cost ~1 µs even with none
        signals.lock_acquired.send(sender=ctx.task, key=run.key, task_id=task_id, fencing_token=lock.fencing_token)
    ctx.arm(run, target)  # last: the body runs next, in this thread or greenlet


def superseded_meanwhile(ctx: Context, run: Run, lock: Redlock, options: Options) -> bool:
    """This call took over the lock a stopped run handed to it ("cancel"): a newer call that parked since (between the
    hand-over and the take-over) superseded it. Then the lock goes on to the newest waiting call, and this one ends
    REVOKED as superseded (True); False: it runs."""
    newer = line.superseded_by(ctx, run.key, run.task_id, options)
    if newer is None:
        return False
    if not line.hand_to_newest(ctx, run, lock, options):
        give_back(ctx, run, lock, options)
    line.replaced(ctx, run, run.task_id, newer)
    return True


def pass_on(ctx: Context, run: Run, options: Options) -> None:
    """A copy (woken, or the fallback) of a superseded call ("cancel"): a lock handed to it (``handed``, its task id)
    is taken over and handed on to the newest waiting call, or freed and the line woken when nobody waits. Anything
    else is left alone."""
    lock = ctx.new_lock(run.key, run.task_id, int(ctx.request.retries or 0), 1, 0)
    try:
        if not lock.acquire(blocking=False):
            if lock.done:
                # This call was cancelled by task id: a lock handed to it was freed then (cancel_job.lua), and the
                # newer call that superseded it waits for a hand-over that will not come: wake it.
                line.wake_next(ctx, run.key, options)
                return
            record = lock.holder_record or {}
            if not (lock.contended and record.get("job") == run.task_id and record.get("state") == HANDED):
                return
            lock.replaces = lock.held_by
            if not lock.acquire(blocking=False):
                return
    except Exception:  # the hand-over expires by itself; the waiters' fallback copies run then
        logger.debug("could not pass lock %s on from %s", run.key, run.task_id, exc_info=True)
        return
    if not line.hand_to_newest(ctx, run, lock, options):
        give_back(ctx, run, lock, options)


def already_ended(ctx: Context, task_id: str) -> bool:
    """The result backend holds a final state for ``task_id``: success, failure or revoke, its job ran to an end
    (a copy of it never runs it again, whichever end it was)."""
    try:
        return ctx.task.backend.get_state(task_id) in READY_STATES
    except Exception:  # no usable result backend: we cannot tell, so run (at least once beats lost)
        logger.debug("cannot read the state of %s: running it", task_id, exc_info=True)
        return False


def duplicate(ctx: Context, run: Run, decision: Decision, facts: Facts) -> None:
    """Another job holds the lock: say so, then let the task's policy act (chord members always reschedule)."""
    task_id, holder_id = facts.task_id, facts.holder_job
    policy = policy_for(duplicate_policy(facts))
    # Counted by what the policy does (_Duplicate): skipped, failed-duplicate; one that waits counts when it runs.
    if signals.duplicate_skipped.receivers:
        signals.duplicate_skipped.send(
            sender=ctx.task, key=run.key, task_id=task_id, holder_task_id=holder_id, policy=policy.name
        )
    if facts.holder_state == COOLDOWN:
        until = dt.datetime.now(dt.timezone.utc) + dt.timedelta(seconds=facts.holder_remaining or 0)
        held = f"task {holder_id} finished; cooling down until {until.isoformat(timespec='seconds')}"
    elif (run.limit or 1) > 1 and holder_id != task_id:
        held = f"at its limit of {run.limit} runs (one by task {holder_id})"
    else:
        held = f"held by task {holder_id}"
    # Celery's own line for this delivery says "skipped duplicate" or "deferred" with the same words (see
    # _SkipLogFilter): one INFO line per skip, not two.
    logger.debug("Task %s[%s] is a duplicate: lock %s %s (%s)", ctx.name, task_id, run.key, held, policy.name)
    policy.act(_Duplicate(ctx, run, holder_id, held), decision)


class _Duplicate:
    """The delivery's side of a policy's :meth:`~celery_singleton_lock.policies.Policy.act`."""

    __slots__ = ("ctx", "held", "holder_id", "run")

    def __init__(self, ctx: Context, run: Run, holder_id: str | None, held: str) -> None:
        self.ctx, self.run, self.holder_id, self.held = ctx, run, holder_id, held

    @property
    def woken(self) -> bool:
        return self.run.parked and bool(getattr(self.ctx.request, WOKEN_HEADER, None))

    def revoke(self) -> None:
        ctx, run, request = self.ctx, self.run, self.ctx.request
        reason = f"duplicate of {ctx.name} skipped: lock {run.key} {self.held}"
        # Storing REVOKED costs a read and a write on the result backend, most of a skip's cost: only for a caller
        # who can read it (ignore_result on the task or the message means nobody will).
        if not (request.is_eager or ctx.task.ignore_result or request.ignore_result):
            ctx.task.backend.mark_as_revoked(run.task_id, reason, request=None)
        ctx.count("skipped")
        resend.skip_quietly(ctx, run, Skipped(reason, run.key, self.holder_id))

    def fail(self) -> NoReturn:
        self.ctx.count("failed-duplicate")
        raise DuplicateTaskError(self.run.key, task_name=self.ctx.name, holder_task_id=self.holder_id)

    def wait(self, countdown: float) -> None:
        # The fallback: woken early by the holder's release when it waits in line, else when a dead holder's
        # lease must have ended (a live holder's renewals keep it ~ttl away).
        run = self.run
        # A call that could not park (its line's node unreachable) waits uncapped: its copy is that call again,
        # never a new duplicate for lock_max_waiting (every copy says when its call arrived, see _resend.copy).
        headers: dict[str, Any] = {PARKED_HEADER: 1, REDELIVERY_HEADER: 1} if run.parked else {}
        detail = f"lock {run.key} {self.held}"
        resend.defer(self.ctx, run, countdown, "duplicate", headers, detail, self.holder_id)

    def stop_holder(self) -> str:
        holder = self.holder_id
        if holder is None or holder == self.run.task_id:
            return "none"
        ctx, run = self.ctx, self.run
        options = ctx.options
        return cancel.ask(options.settings.nodes, run.key, holder, run.task_id, options.done_window, since(ctx.request))

    def superseded(self) -> None:
        ctx, run = self.ctx, self.run
        assert self.holder_id is not None
        line.supersede(ctx, run.key, run.task_id, self.holder_id, ctx.options)
        ctx.count("replaced")
        line.replaced(ctx, run, run.task_id, self.holder_id)

    def back_in_line(self) -> None:
        run = self.run
        said = f"waiting in line for lock {run.key} {self.held}"
        resend.skip_quietly(self.ctx, run, Skipped(said, run.key, self.holder_id, "deferred"))


def slowed(ctx: Context, run: Run, pause: float, limit: Any) -> Any:
    """The body raised ``SlowDown``: a feature pauses what it limits (the rate, cluster-wide) and names a countdown;
    this call is re-sent for it (same task id: the call again, never a new one) and this delivery stores nothing.
    Its copy waits as a call waiting for its rate's window does (:func:`wait_out`): in queue scope the lock goes back
    to a reservation for it, with replace / cancel it waits in the key's line (a newer call supersedes it), else the
    lock is given back without a done marker (the job has not run to its end: its copy runs it). The caller's
    release then finds no lock. None: no feature took it (no rate, or an eager call): the SlowDown fails the call."""
    if ctx.request.is_eager:
        return None
    for feature in ctx.options.hooks.slowed:
        answer = feature.slowed(ctx, run, pause, limit)
        if answer is not None:
            countdown, headers = answer
            ctx.count("slowed")
            if run.retry_sent:
                # The body sent its retry (retry(throw=False)) before raising: that retry is the call again, and it
                # asks the rate like any call (the pause holds it). A copy re-sent here too would run it twice.
                said = f"the body raised SlowDown({pause:g} s) after sending its retry"
                resend.skip_quietly(ctx, run, Skipped(said, run.key, None, "deferred"))
                return run.outcome
            ctx.disarm(run)  # the body has ended: a loss noticed from now on must not interrupt what follows
            lock, lease = run.lock, run.lease
            run.lock = run.lease = None
            if lease is not None:
                watchdog().unregister(lease)
            detail = f"the body raised SlowDown({pause:g} s)"
            headers = {**headers, RESUMED_HEADER: 1}  # never skipped or failed as a duplicate: it must run once
            wait_out(ctx, run, lock, ctx.options, countdown, "slowed", headers, detail)
            return run.outcome
    return None


def cancelled(ctx: Context, run: Run, by: str) -> Skipped:
    """The body stopped for a newer call (lock_on_duplicate="cancel"): REVOKED, its reason naming that call, and
    counted; the release that follows frees the lock and wakes the line, where the newer call waits."""
    request = ctx.request
    reason = cancel.reason(ctx.name, run.key, by)
    if not (request.is_eager or ctx.task.ignore_result or request.ignore_result):
        ctx.task.backend.mark_as_revoked(run.task_id, reason, request=None)
    ctx.count("cancelled")
    logger.info("Task %s[%s] %s", ctx.name, run.task_id, reason)
    outcome = Skipped(reason, run.key, by, "cancelled")
    resend.skip_quietly(ctx, run, outcome)
    return outcome


def dropped(ctx: Context, run: Run, by: str) -> None:
    """A copy of a job cancelled durably reached a worker (its done marker holds the cancel): REVOKED naming the
    cancel, counted; a place it held in the key's line is given up (and the next one woken)."""
    request = ctx.request
    reason = f"{cancel.describe(by)}: {ctx.name}[{run.task_id}] of lock {run.key} dropped before it ran"
    if not (request.is_eager or ctx.task.ignore_result or request.ignore_result):
        try:
            ctx.task.backend.mark_as_revoked(run.task_id, reason, request=None)
        except Exception:  # no usable result backend: nobody can wait on it either
            logger.debug("cannot store the cancel of %s", run.task_id, exc_info=True)
    ctx.count("cancelled")
    logger.info("Task %s[%s] %s", ctx.name, run.task_id, reason)
    resend.skip_quietly(ctx, run, Skipped(reason, run.key, by, "cancelled"))
    options = ctx.options
    if getattr(request, PARKED_HEADER, None):
        line.unpark(ctx, run.key, run.task_id, options)
    if options.waits_in_line:
        line.wake_next(ctx, run.key, options, run.limit)


def unavailable(
    ctx: Context,
    run: Run,
    lock: Redlock,
    task_id: str,
    options: Options,
    policy: UnavailablePolicy,
    countdown: float = 0.0,
    attempt: int = 0,
) -> None:
    errors = [str(e) for e in lock.node_errors]
    if not getattr(ctx.request, ATTEMPT_HEADER, None):  # once per call, not per retry
        ctx.count("unavailable")
    signals.lock_unavailable.send(sender=ctx.task, key=run.key, task_id=task_id, policy=policy, errors=errors)
    if policy == "run":
        logger.warning(
            "Task %s[%s] runs UNGUARDED (singleton_lock_on_unavailable='run'): lock %s unavailable: %s",
            ctx.name,
            task_id,
            run.key,
            "; ".join(errors),
        )
    elif policy == "retry":
        if ctx.request.is_eager:  # nothing can wait in eager mode: the caller is told at once
            raise LockUnavailableError(run.key, node_errors=errors)
        logger.warning(
            "Task %s[%s] waits %.1fs: no quorum for lock %s (attempt %d): %s",
            ctx.name,
            task_id,
            countdown,
            run.key,
            attempt,
            "; ".join(errors),
        )
        resend.defer(ctx, run, countdown, "unavailable", {ATTEMPT_HEADER: attempt})


def release(ctx: Context, run: Run, *, done: bool = False, succeeded: bool = False) -> None:
    """Give the lock up; after the job's end (a success or a failure: ``done``), mark this task id done (see
    ``Redlock.finish``) in the same round trip; only a success starts a cooldown.

    Timeline of what the done marker prevents: this run releases, a redelivered copy of the same task id
    (waiting on a countdown, or arriving late) takes the lock, finds no final state stored (not yet, or no result
    backend at all), and runs the job a second time. With the marker, that copy's acquire answers DONE and it
    stops, while a different job is not affected at all (the marker is a key of its own, per task id). A
    failure ends the job as much as a success does: a waiting call's fallback copy that ran it again after a
    FAILURE would run a job twice.
    """
    ctx.disarm(run)  # first: the body has ended, a loss noticed from now on must not interrupt what follows
    lock, lease = run.lock, run.lease
    run.lock = run.lease = None
    if lease is not None:
        watchdog().unregister(lease)
    if lock is None:
        return
    options = ctx.options
    # A feature may keep the lock held a while after the job's end (cooldown, after a success).
    hold_for = 0.0
    if done:
        for feature in options.hooks.at_release:
            hold_for = max(hold_for, feature.at_release(ctx, run, succeeded=succeeded))
    if (
        done
        and options.policy.hands_on
        and (run.cancelled_by is not None or not hold_for)
        and line.hand_to_newest(ctx, run, lock, options)
    ):
        # "cancel": the lock went to the newest waiting call, never free in between. Also when this run ended by
        # itself: a call waits only after asking it to stop, and its request may have come too late to be seen
        # (between two renewals); freed, the key would let a newer call in ahead of the waiting one, which then runs
        # after that newer call, an older call last.
        ctx.count("released")
        signals.lock_released.send(sender=ctx.task, key=run.key, task_id=run.task_id, held=True)
        return
    try:
        if done:
            held = lock.finish(
                # A redelivered run's message may exist twice (a visibility-timeout restore, a re-sent copy):
                # the other copy can start late, so the marker lasts the whole window.
                # A retry's marker too: for a retry the marker is the only proof of its success (it never asks
                # the backend, whose SUCCESS may be its predecessor's), and its message can be restored late.
                done_for=options.done_window if run.redelivered or run.retries else options.done_window_short,
                waited_for=options.done_window,
                cooldown=hold_for,
            )
        else:
            held = lock.release()
    except Exception:  # a release that failed still ends within ttl: log, never mask the task's outcome
        logger.exception("releasing lock %s failed; it expires within its ttl", run.key)
        return
    ctx.count("released")
    if signals.lock_released.receivers:
        signals.lock_released.send(sender=ctx.task, key=run.key, task_id=run.task_id, held=held)
    if options.waits_in_line:
        line.wake_next(ctx, run.key, options, run.limit)
