"""The enqueue side: what ``apply_async`` does before a message is published.

Queue scope (``lock_scope="queue"``) reserves the job for the call's task id before its message is published,
so that a duplicate call publishes nothing and gets the existing job; the enqueue check
(``lock_enqueue_check``) returns a running job's result instead of sending a duplicate of it. The worker's
run-time check (the delivery room) stays the guard of both.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
import threading
import time
from collections.abc import Callable
from typing import Any, NamedTuple

from celery import _state as celery_state
from celery.signals import task_revoked
from celery.utils import uuid

from ..errors import ConfigurationError, DuplicateTaskError
from ..lock.aio import AsyncNodes, AsyncRedlock, _spawn
from ..lock.record import COOLDOWN, ENDING, QUEUED, RUNNING, SENDING
from ..lock.redlock import Redlock
from ..policies import NOT_ANSWERED
from . import signals
from ._handover import ending_lease
from ._pacing import ATTEMPTS, SENDING_WAIT, Pacing
from ._reach import no_quorum_at_producer
from ._run import REDELIVERY_HEADER, RESERVED_HEADER, Context, is_locked_task, mark_joined, worker_id

__all__ = [
    "DEFAULT_QUEUE_TTL",
    "SENDING_WAIT",
    "areserve",
    "asend",
    "free_reservation",
    "reserve",
    "revoke_queued",
    "running_run",
    "send",
]

logger = logging.getLogger("celery_singleton_lock.task")

#: Queue scope: seconds a reservation waits for its message to start, beyond its countdown (``lock_queue_ttl``).
DEFAULT_QUEUE_TTL = 600.0
# apply_async options under which the enqueue check stands aside: the message must go out as asked.
_DEFERRED_OR_GROUPED = frozenset({"countdown", "eta", "chord", "group_id", "chain"})
# apply_async options whose messages are reserved at the worker only (a chord counts its members' own ids).
_GROUPED = frozenset({"chord", "group_id", "chain"})


def send(
    ctx: Context,
    publish: Callable[..., Any],
    args: Any,
    kwargs: Any,
    task_id: str | None,
    options: dict[str, Any],
    *,
    linked: bool,
) -> Any:
    """``apply_async`` of a LockedTask: ``publish(args, kwargs, task_id=..., **options)`` is Celery's own.

    With ``lock_scope="queue"`` a call whose job is queued or running returns that job (see :func:`reserve`);
    with ``lock_enqueue_check``, a call whose job is running returns that run; first, each active feature's
    ``at_send`` may answer the call itself (debounce: a call starts or joins its key's burst).
    """
    features = ctx.options.hooks.at_send
    if features:
        call = _Call(ctx, publish, args, kwargs, task_id, options, linked=linked)
        for feature in features:
            answer = feature.at_send(call)
            if answer is not NOT_ANSWERED:
                return answer
    if _reserves(ctx, task_id, options):
        own_id = task_id is not None
        task_id = task_id or uuid()
        reservation = reserve(ctx, args or (), kwargs or {}, task_id, options, own_id=own_id)
        plan = _plan(ctx, args, kwargs, task_id, options, reservation)
        if plan.existing is not None:
            return mark_joined(plan.existing, plan.existing.id)
        try:
            sent = publish(args, kwargs, task_id=plan.task_id, **plan.options)
        except BaseException:
            if plan.lock is not None:  # nothing was sent: nothing may stay reserved
                plan.lock.release()
            raise
        if plan.duplicate is not None:  # the job exists now, for sure: this call was its duplicate
            raise plan.duplicate
        if plan.lock is not None:
            # Sent: now a duplicate may be told to wait on it. (Refused when a worker took it over already.)
            plan.lock.transfer(plan.lease, {"state": QUEUED})
        return mark_joined(sent, plan.task_id if plan.joined else None)
    if ctx.task.lock_enqueue_check and not (
        linked or ctx.task.app.conf.task_always_eager or _DEFERRED_OR_GROUPED.intersection(options)
    ):
        running = running_run(ctx, args or (), kwargs or {}, task_id)
        if running is not None:
            return mark_joined(running, running.id)
    return mark_joined(publish(args, kwargs, task_id=task_id, **options), None)


class _Call:
    """The enqueue side of a feature's ``at_send`` (:class:`~celery_singleton_lock.policies.port.Call`)."""

    __slots__ = ("args", "ctx", "kwargs", "linked", "options", "publish", "task_id")
    copy_header = REDELIVERY_HEADER  # a message that is a copy of another call's job (it asks before it runs)

    def __init__(
        self,
        ctx: Context,
        publish: Callable[..., Any],
        args: Any,
        kwargs: Any,
        task_id: str | None,
        options: dict[str, Any],
        *,
        linked: bool,
    ) -> None:
        self.ctx, self.publish, self.args, self.kwargs = ctx, publish, args, kwargs
        self.task_id, self.options, self.linked = task_id, options, linked

    @property
    def delay(self) -> float:
        return _delay_of(self.options)

    @staticmethod
    def joined(result: Any, holder_id: str | None) -> Any:
        return mark_joined(result, holder_id)


def _reserves(ctx: Context, task_id: str | None, options: dict[str, Any]) -> bool:
    """Whether this call reserves its job before it is published (queue scope, see :func:`reserve`)."""
    return (
        ctx.options.scope == "queue"
        and not ctx.task.app.conf.task_always_eager
        and not _GROUPED.intersection(options)
        # A re-send of the delivery running here (self.retry(), a deferred copy): it is the job already.
        and not (task_id is not None and task_id == ctx.request.id)
    )


class _Plan(NamedTuple):
    """What a queue-scope call does after its reservation (the steps :func:`send` and :func:`asend` share)."""

    existing: Any  # the job's AsyncResult: nothing is published
    task_id: str  # the id the message is published under
    options: dict[str, Any]  # the publish's options
    lock: Redlock | AsyncRedlock | None  # the reservation: freed if the publish fails, marked queued once it is sent
    lease: float
    duplicate: DuplicateTaskError | None  # raised once the stand-in's publish is done
    joined: bool = False  # the publish is a copy of another call's job (a stand-in): this call joined that job


def _plan(
    ctx: Context,
    args: Any,
    kwargs: Any,
    task_id: str,
    options: dict[str, Any],
    reservation: tuple[Any, Redlock | AsyncRedlock | None, float, str | None],
) -> _Plan:
    """The publish a reservation's outcome asks for (``reservation``: what :func:`reserve` returned)."""
    existing, lock, lease, stand_in = reservation
    if existing is not None:
        return _Plan(existing, "", options, None, 0.0, None)
    if stand_in is not None:
        # Another call's publish of this job is still under way (slow), or its producer died after it: its
        # message may exist or never will. This call sends a copy of THAT job (its task id, marked as a
        # copy): whichever arrives first runs it; the other finds the job held or done by its own id and
        # stops (one run). Never a second job: that is what ran a job twice.
        headers = {**(options.pop("headers", None) or {}), REDELIVERY_HEADER: 1}
        # Not this caller's expiry: an expired copy gets its task id revoked in the worker, and that id is the
        # job's own (its original message would be discarded with it, and the job lost).
        options.pop("expires", None)
        duplicate = None
        if ctx.options.policy.raises:
            key = ctx.key_for(*(args or ()), **(kwargs or {}))
            duplicate = DuplicateTaskError(key, task_name=ctx.name, holder_task_id=stand_in)
        return _Plan(None, stand_in, {**options, "headers": headers}, None, 0.0, duplicate, joined=True)
    if lock is not None:
        # Reserved: a delivery of this message that finds its reservation gone (its job ran as another call's
        # copy, or the reservation ran out) asks the result backend before it runs (see decide).
        options["headers"] = {**(options.get("headers") or {}), RESERVED_HEADER: 1}
    return _Plan(None, task_id, options, lock, lease, None)


def reserve(
    ctx: Context, args: Any, kwargs: Any, task_id: str, options: dict[str, Any], *, own_id: bool
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
    key = ctx.key_for(*args, **kwargs)
    lease, record = _reservation(ctx, options)
    # "sending" lasts the whole lease, not a few seconds: a producer that dies between its publish and marking the
    # reservation sent leaves a message that may wait in the queue for as long (a busy worker), and the job must
    # stay reserved for it. A producer that died before its publish leaves no message: the next call's copy (see
    # the stand-in above) runs the job under the reservation's id.
    lock = Redlock(ctx.options.settings.nodes, key, ttl=lease, fencing=False, job=task_id, record=record)
    try:
        pacing = Pacing(ctx.options.settings.socket_timeout)
        for _ in range(ATTEMPTS):  # bounded in count and in time
            if lock.acquire(blocking=False):
                return None, lock, lease, None
            pause = pacing.next(lock)
            if pause is None:
                break
            time.sleep(pause)
    except Exception:  # at enqueue, when in doubt, send: the worker's check is the guard
        logger.warning("%s: could not reserve lock %s; sending (checked at the worker)", ctx.name, key, exc_info=True)
        return None, None, 0.0, None
    no_quorum_at_producer(ctx.name, lock.nodes, lock.node_errors, "a queue-scope reservation")
    return _verdict(ctx, lock, key, task_id, own_id=own_id)


# -- the async producer (aapply_async) -------------------------------------------------------------------------


async def asend(
    ctx: Context,
    publish: Callable[..., Any],
    args: Any,
    kwargs: Any,
    task_id: str | None,
    options: dict[str, Any],
    *,
    linked: bool,
) -> Any:
    """:func:`send` for ``aapply_async``: the queue scope's reservation on AsyncRedlock (its round trips on the
    loop), the publish in a worker thread (kombu has no asyncio publish), then the same steps (:func:`_plan`).

    Everything else runs :func:`send` whole in a worker thread: run scope (a publish only), the enqueue check,
    a feature that answers at send (debounce: its one round trip to the nodes, sync in that thread: the same burst as
    ``delay``), and lock nodes
    AsyncRedlock cannot reach (``redis.Redis`` clients).

    A caller cancelled while its reservation is being taken leaves none (AsyncRedlock undoes a cancelled
    attempt); once its publish started, the publish and the reservation's settling (queued, or freed if the
    publish failed) run on without it. A loop closed before the publish ended leaves the reservation "sending"
    until its lease ends: a duplicate sends a copy of its job (see :func:`reserve`), never a second job.
    """
    nodes = _async_nodes_cache.get(ctx.task.__dict__.get(_NODES_KEY, ()), _UNKNOWN)
    if nodes is _UNKNOWN:  # a task's first call: its settings resolved (Celery's app finalized) off the loop
        nodes = await asyncio.to_thread(_async_nodes, ctx)
    # What runs in a worker thread runs as in the caller's thread: Celery keeps the running task (a message's parent
    # and root ids) and its request (the re-send check) per thread.
    publish = _as_caller(ctx, publish)
    if ctx.options.hooks.at_send or not isinstance(nodes, AsyncNodes) or not _reserves(ctx, task_id, options):
        return await asyncio.to_thread(
            _as_caller(ctx, send), ctx, publish, args, kwargs, task_id, options, linked=linked
        )
    own_id = task_id is not None
    task_id = task_id or uuid()
    reservation = await areserve(ctx, nodes, args or (), kwargs or {}, task_id, options, own_id=own_id)
    plan = _plan(ctx, args, kwargs, task_id, options, reservation)
    if plan.existing is not None:
        return mark_joined(plan.existing, plan.existing.id)
    lock = plan.lock if isinstance(plan.lock, AsyncRedlock) else None  # areserve's: an AsyncRedlock or None
    # Shielded: a cancelled caller does not cancel the publish (its thread runs on) nor the settling after it.
    publishing = _spawn(_apublish(publish, args, kwargs, plan, lock))
    try:
        return await asyncio.shield(publishing)
    except asyncio.CancelledError:
        publishing.add_done_callback(_retrieved)  # its outcome has no caller left: not "never retrieved"
        raise


def _as_caller(ctx: Context, fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` to be called in another thread as if in this one: with this thread's running task (Celery's current
    task, whose id is a published message's parent id) and the requests of it and of ``ctx.task`` pushed there."""
    current = celery_state.get_current_task()
    requests = [(t, t.request_stack.top) for t in {id(t): t for t in (current, ctx.task) if t is not None}.values()]
    requests = [(t, r) for t, r in requests if r is not None]
    if current is None and not requests:
        return fn

    def as_caller(*args: Any, **kwargs: Any) -> Any:
        if current is not None:
            celery_state.push_current_task(current)
        for t, request in requests:
            t.request_stack.push(request)
        try:
            return fn(*args, **kwargs)
        finally:
            for t, _ in reversed(requests):
                t.request_stack.pop()
            if current is not None:
                celery_state.pop_current_task()

    return as_caller


def _retrieved(done: asyncio.Task[Any]) -> None:
    if not done.cancelled() and done.exception() is not None:
        logger.debug("a cancelled caller's publish failed", exc_info=done.exception())


async def _apublish(publish: Callable[..., Any], args: Any, kwargs: Any, plan: _Plan, lock: AsyncRedlock | None) -> Any:
    """:func:`send`'s publish and settling, for :func:`asend`: the publish in a worker thread."""
    try:
        sent = await asyncio.to_thread(publish, args, kwargs, task_id=plan.task_id, **plan.options)
    except asyncio.CancelledError:
        raise  # the loop is closing: the publish may still succeed, so the reservation stays (see asend)
    except BaseException:
        if lock is not None:  # nothing was sent: nothing may stay reserved
            await lock.release()
        raise
    if plan.duplicate is not None:
        raise plan.duplicate
    if lock is not None:
        await lock.transfer(plan.lease, {"state": QUEUED})
    return mark_joined(sent, plan.task_id if plan.joined else None)


_async_nodes_cache: dict[tuple[Any, ...], AsyncNodes | None] = {}
_async_nodes_lock = threading.Lock()
_NODES_KEY = "_celery_singleton_lock_async_nodes"  # on a task: its key in _async_nodes_cache
_UNKNOWN: Any = object()
_UNSEEN: Any = object()  # _verdict's running task id: not read by the caller


def _async_nodes(ctx: Context) -> AsyncNodes | None:
    """The task's lock nodes for AsyncRedlock, or None when they are not all URLs (a ``redis.Redis`` client)."""
    settings = ctx.options.settings
    cache_key = (settings.urls, settings.socket_timeout)
    ctx.task.__dict__[_NODES_KEY] = cache_key
    with _async_nodes_lock:
        if cache_key not in _async_nodes_cache:
            nodes: AsyncNodes | None = None
            if all(isinstance(u, str) for u in settings.urls):
                try:
                    nodes = AsyncNodes([str(u) for u in settings.urls], socket_timeout=settings.socket_timeout)
                except ConfigurationError:
                    nodes = None
            _async_nodes_cache[cache_key] = nodes
        return _async_nodes_cache[cache_key]


async def areserve(
    ctx: Context, nodes: AsyncNodes, args: Any, kwargs: Any, task_id: str, options: dict[str, Any], *, own_id: bool
) -> tuple[Any, AsyncRedlock | None, float, str | None]:
    """:func:`reserve` on AsyncRedlock: the same attempts, waits and verdict, awaited."""
    key = ctx.key_for(*args, **kwargs)
    lease, record = _reservation(ctx, options)
    lock = AsyncRedlock(nodes, key, ttl=lease, fencing=False, job=task_id, record=record, auto_renewal=False)
    try:
        pacing = Pacing(ctx.options.settings.socket_timeout)
        for _ in range(ATTEMPTS):  # bounded in count and in time
            if await lock.acquire(blocking=False):
                return None, lock, lease, None
            pause = pacing.next(lock)
            if pause is None:
                break
            await asyncio.sleep(pause)
    except Exception:  # at enqueue, when in doubt, send: the worker's check is the guard
        logger.warning("%s: could not reserve lock %s; sending (checked at the worker)", ctx.name, key, exc_info=True)
        return None, None, 0.0, None
    no_quorum_at_producer(ctx.name, lock.nodes, lock.node_errors, "a queue-scope reservation")
    if own_id:  # the verdict may store the duplicate's state in the result backend: off the loop
        # The running task's request as the loop's thread sees it (Celery keeps it per thread: the worker thread
        # has none, and a run sending its next run with its own id would be taken for a duplicate of itself).
        running = ctx.request.id
        return await asyncio.to_thread(_verdict, ctx, lock, key, task_id, own_id=own_id, running=running)
    return _verdict(ctx, lock, key, task_id, own_id=own_id)


def _reservation(ctx: Context, options: dict[str, Any]) -> tuple[float, dict[str, str]]:
    """A reservation's lease (s) and holder record for a call with these ``options``."""
    lease = _delay_of(options) + float(ctx.options.queue_ttl)
    expires = _expires_in(options.get("expires"))
    if expires is not None:  # a message that expires unseen frees its job when it would have expired
        lease = min(lease, max(expires, 0.0) + 1.0)
    record = {
        "state": SENDING,
        "name": ctx.name,
        "worker": worker_id(),
        "at": str(int(time.time() * 1000)),
        "open": "1",
    }
    return max(lease, 0.01), record


def _verdict(
    ctx: Context,
    lock: Redlock | AsyncRedlock,
    key: str,
    task_id: str,
    *,
    own_id: bool,
    running: Any = _UNSEEN,
) -> tuple[Any, None, float, str | None]:
    """What a reservation that was not taken means (see :func:`reserve`), from the lock's findings: no I/O but the
    result backend's, when a caller's own task id turned out a duplicate. ``running``: the id of the task running
    in the caller's thread (read here when not given)."""
    if running is _UNSEEN:
        running = ctx.request.id
    options_ = ctx.options
    if lock.done:  # this very task id already ran
        ctx.count("joined")
        signals.call_joined.send(sender=ctx.task, key=key, task_id=task_id, holder_task_id=task_id)
        return ctx.task.AsyncResult(task_id), None, 0.0, None
    record = lock.holder_record or {}
    holder, state = record.get("job"), record.get("state")
    policy = options_.policy
    if not lock.contended or holder is None or state in (ENDING, None):
        # Not a job that exists for sure (a run being ended, a record of no job): sent.
        logger.debug(
            "%s sent: lock %s not held for sure (contended=%s split=%s node errors=%d)",
            ctx.name,
            key,
            lock.contended,
            lock.split,
            len(lock.node_errors),
        )
        return None, None, 0.0, None
    if state == SENDING and policy.waits_in_line:
        return None, None, 0.0, None  # a job of its own, meant to run after the holder: sent, waits at the worker
    if holder == task_id and state != SENDING:  # sent again with its own id while queued or running: enough
        ctx.count("joined")
        signals.call_joined.send(sender=ctx.task, key=key, task_id=task_id, holder_task_id=task_id)
        return ctx.task.AsyncResult(task_id), None, 0.0, None
    if holder == running and state == RUNNING:
        # The running job sends itself again from its body (its next run): sent, as in run scope; the worker
        # skips it if it arrives while this run still holds the job.
        return None, None, 0.0, None
    if policy.waits_in_line:  # it runs after the holder: sent, and waits at the worker
        return None, None, 0.0, None
    signals.duplicate_skipped.send(sender=ctx.task, key=key, task_id=task_id, holder_task_id=holder, policy="queue")
    ctx.count("failed-duplicate" if policy.raises else "joined")  # a stand-in under "fail" raises after its publish
    if policy.raises and state != SENDING:
        raise DuplicateTaskError(key, task_name=ctx.name, holder_task_id=holder)
    if state == SENDING:
        reason = f"duplicate of {ctx.name} sent as a copy of task {holder} (lock {key}: its publish is under way)"
    else:
        reason = f"duplicate of {ctx.name} not sent: lock {key} held by task {holder} ({state})"
    logger.debug("%s", reason)
    if own_id and holder != task_id and not ctx.task.ignore_result:
        # The caller chose this id and may wait on it: say at once what became of it (as a skip at the worker
        # would), not PENDING forever. The call still returns the existing job's result.
        try:
            ctx.task.backend.mark_as_revoked(task_id, reason, request=None)
        except Exception:
            logger.debug("could not store the duplicate state of %s", task_id, exc_info=True)
    if state == SENDING:
        return None, None, 0.0, holder
    return ctx.task.AsyncResult(holder), None, 0.0, None


def revoke_queued(ctx: Context, task_id: str, *args: Any, **kwargs: Any) -> bool:
    """Revoke a queue-scope job's message and free its reservation now (``args``/``kwargs``: the call's).

    ``AsyncResult.revoke()`` alone frees the reservation only when a worker meets the revoked message (at its
    countdown, or when it reaches the front of the queue). True when a reservation was freed and the message
    revoked; False when there was none (a worker had taken the job over already: it runs, or ran, and is left
    alone).
    """
    key = ctx.key_for(*args, **kwargs)
    freed: bool | None = None
    for feature in ctx.options.hooks.at_revoke:  # a feature's pending job (debounce: the burst ends unrun)
        freed = feature.at_revoke(ctx, key, task_id)
        if freed is not None:
            break
    if freed is None:
        freed = free_reservation(ctx, task_id, key)
    if freed:  # revoked only while still queued: a running job is left alone (a revoke would mark it REVOKED)
        ctx.task.app.control.revoke(task_id)
    return freed


def free_reservation(ctx: Context, task_id: str, key: str) -> bool:
    """Delete the queue-scope reservation of ``task_id`` on ``key``, if it is still one (not yet taken over)."""
    # While this holds the key (one round trip), its record says "ending": a duplicate sent meanwhile is sent.
    lock = ending_lease(ctx, key, task_id)
    if lock.acquire(blocking=False):  # nothing held it
        lock.release()
        return False
    record = lock.holder_record or {}
    if not (lock.contended and record.get("job") == task_id and record.get("state") in (QUEUED, SENDING)):
        return False
    lock.replaces = lock.held_by  # atomic: only if the reservation's owner still holds it
    if lock.acquire(blocking=False):
        lock.release()
        return True
    return False


def running_run(ctx: Context, args: Any, kwargs: Any, task_id: str | None) -> Any:
    """The AsyncResult of the run holding this call's lock right now, or None (also when Redis cannot tell).

    A call with its own ``task_id`` is always sent: its caller waits on that id, which another run's result
    would leave PENDING forever.
    """
    if task_id is not None:
        return None
    try:
        key = ctx.key_for(*args, **kwargs)
        record = Redlock(ctx.options.settings.nodes, key).holder()
    except Exception:  # the worker's check is the guard; at enqueue, when in doubt, send
        logger.debug("enqueue check of %s failed; sending", ctx.name, exc_info=True)
        return None
    holder_id = record.get("job") if record else None
    if record is None or holder_id is None or record.get("state") in (ENDING, COOLDOWN):
        return None
    signals.duplicate_skipped.send(sender=ctx.task, key=key, task_id=None, holder_task_id=holder_id, policy="enqueue")
    ctx.count("joined")
    logger.info("%s not sent: the same job is running as task %s (lock %s)", ctx.name, holder_id, key)
    return ctx.task.AsyncResult(holder_id)


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
    """A worker met a revoked or expired message: each active feature ends what the job held (a burst), and a
    queue-scope job's reservation is freed at once."""
    # Celery sends the task as sender and the delivery's Context as request (whose "task" is only a name).
    if not is_locked_task(sender) or request is None:
        return
    ctx = sender.lock_context()
    for feature in ctx.options.hooks.at_revoke:  # each active feature's end of a revoked job (debounce: its burst)
        try:
            feature.at_revoke(ctx, ctx.key_for(*(request.args or ()), **(request.kwargs or {})), request.id)
        except Exception:  # what it held still ends with its expiry
            logger.warning("could not end the %s of %s[%s]", feature.name, ctx.name, request.id, exc_info=True)
    if ctx.options.scope != "queue":
        return
    try:
        key = ctx.key_for(*(request.args or ()), **(request.kwargs or {}))
        free_reservation(ctx, request.id, key)
    except Exception:  # the reservation still ends with its lease
        logger.warning("could not free the reservation of %s[%s]", ctx.name, request.id, exc_info=True)
