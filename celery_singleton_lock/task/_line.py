"""The waiting line of a key: duplicates that run after the holder (``reschedule``), or the newest of them
(``replace``), woken by the holder's release instead of polling.

The line (a sorted set of task ids by first arrival, and each one's message) lives on the first lock node: it only
makes waiting faster. Every waiter also has a fallback copy (re-sent for when the holder's lease would end), so a
lost line costs time, never a job.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from kombu.utils import json as kombu_json

from ..lock.config import settings_for
from ..lock.record import HANDED, sibling_key
from ..lock.scripts import PARK_CAPPED_CODE as _PARK_CAPPED
from ..lock.scripts import PARK_FAIR_CODE as _PARK_FAIR
from ..lock.scripts import PARK_REPLACING_CODE as _PARK_REPLACING
from ..lock.scripts import POP_WAITER_CODE as _POP_WAITER
from ..lock.scripts import UNPARK_FAIR_CODE as _UNPARK_FAIR
from ..policies.cancel import hand_over_for
from ..policies.fair import FAIR
from ..policies.waiting import WAITING
from . import _resend as resend
from . import signals
from ._run import (
    PARKED_HEADER,
    REDELIVERY_HEADER,
    SINCE_HEADER,
    WOKEN_HEADER,
    Context,
    Options,
    Run,
    Skipped,
    since,
    text,
)

__all__ = [
    "WAITERS_TTL",
    "full",
    "hand_to_newest",
    "park",
    "replaced",
    "supersede",
    "superseded_by",
    "unpark",
    "waiters",
    "wake_next",
]

if TYPE_CHECKING:
    from ..lock.redlock import Redlock

logger = logging.getLogger("celery_singleton_lock.task")

#: How long a key's waiting line outlives its last change, at least (each park refreshes it).
WAITERS_TTL = 600.0
# The line's scripts (lua/pop_waiter.lua, lua/park_replacing.lua), run with EVAL by their code (no header bytes).


def waiters(key: str, options: Options) -> tuple[Any, str, str]:
    """The client holding ``key``'s waiting line (the first lock node), and the line's two keys."""
    return options.settings.nodes.clients[0], sibling_key(key, ":waiters"), sibling_key(key, ":parked")


def park(ctx: Context, run: Run, task_id: str, options: Options) -> bool:
    """Put this rescheduled duplicate in its key's waiting line, with the message that wakes it.

    The line (a sorted set of task ids by arrival, and each one's message) lives on the first lock node: it only
    makes waiting faster. The holder's release wakes the oldest waiter at once; without the line (the node is
    down, the message cannot be encoded) every waiter still has its fallback copy. False when not parked.
    """
    request = ctx.request
    if request.is_eager or (ctx.task.serializer or ctx.task.app.conf.task_serializer) != "json":
        # Eager: nothing waits. Another serializer: the line stores JSON, which would change the arguments (int
        # dict keys, tuples): such a waiter has its fallback copy only.
        return False
    replace = options.policy.replaces
    if replace and request.chord:
        return False  # a chord member must run: never in a line where a newer call could replace it
    try:
        arrived = since(request)
        woken = dict(resend.copy(ctx, {PARKED_HEADER: 1, WOKEN_HEADER: 1, REDELIVERY_HEADER: 1, SINCE_HEADER: arrived}))
        message = kombu_json.dumps(woken)  # type: ignore[no-untyped-call]
        return _enter(ctx, run, task_id, options, arrived, message)
    except Exception:  # the fallback copy still wakes it
        logger.debug("could not park %s[%s] in line for %s", ctx.name, task_id, run.key, exc_info=True)
        return False


def _enter(ctx: Context, run: Run, task_id: str, options: Options, arrived: int, message: str) -> bool:
    """Write the job in its key's line (replacing, fair, capped or plain); False: full (``run.line_full``)."""
    request = ctx.request
    replace = options.policy.replaces
    client, line, messages = waiters(run.key, options)
    expire_ms = int(max(WAITERS_TTL, 3 * options.ttl) * 1000)
    if replace:
        answer = client.eval(
            _PARK_REPLACING,
            2,
            line,
            messages,
            task_id,
            arrived,
            message,
            expire_ms,
            sibling_key(run.key, ":superseded:"),
        )
        superseded(ctx, run, task_id, [text(x) for x in answer or ()])
        return True
    cap = options.max_waiting
    # A call's own re-sent copies (every one carries SINCE_HEADER, see _resend.copy) and the broker's redelivery
    # of a job that was received before are that call again: never new (lock_max_waiting counts new ones).
    new = not (getattr(request, SINCE_HEADER, None) or run.redelivered or request.chord)
    value = FAIR.value(options, request.args, request.kwargs)
    if value is not None:
        # lock_fair_on: the job's place is its value's next turn (lua/park_fair.lua), its cap the whole line's.
        parked, length = client.eval(
            _PARK_FAIR,
            4,
            line,
            messages,
            *FAIR.keys(run.key),
            task_id,
            message,
            expire_ms,
            value,
            "" if cap is None else cap,
            "1" if new else "0",
        )
        if not int(parked):
            run.line_full = int(length)
            return False
        return True
    if cap is not None:
        # lock_max_waiting: a new duplicate that finds the line full is not parked (the caller skips it).
        parked, length = client.eval(
            _PARK_CAPPED, 2, line, messages, task_id, arrived, message, expire_ms, cap, "1" if new else "0"
        )
        if not int(parked):
            run.line_full = int(length)
            return False
        return True
    pipe = client.pipeline(transaction=False)
    pipe.zadd(line, {task_id: arrived}, nx=True)  # a job re-parked keeps its place
    pipe.hset(messages, task_id, message)
    pipe.pexpire(line, expire_ms)
    pipe.pexpire(messages, expire_ms)
    pipe.execute()
    return True


def full(ctx: Context, run: Run, task_id: str, holder_id: str | None, options: Options) -> None:
    """lock_max_waiting: this new duplicate found its key's line full: REVOKED at once, saying so and naming the key."""
    request = ctx.request
    reason = (
        f"duplicate of {ctx.name} skipped: the waiting line of lock {run.key} is full "
        f"{WAITING.full(run.line_full, options.max_waiting)}"
    )
    ctx.count("skipped")
    signals.duplicate_skipped.send(
        sender=ctx.task, key=run.key, task_id=task_id, holder_task_id=holder_id, policy="max_waiting"
    )
    if not (request.is_eager or ctx.task.ignore_result or request.ignore_result):
        ctx.task.backend.mark_as_revoked(task_id, reason, request=None)
    resend.skip_quietly(ctx, run, Skipped(reason, run.key, holder_id))


def superseded(ctx: Context, run: Run, task_id: str, answer: list[str]) -> None:
    """Tell the callers of the jobs a "replace" park took out of the line (``answer``: see _PARK_REPLACING)."""
    if answer[:1] == ["self"]:
        # A newer call waits in line: that one wins. This call's job is marked superseded (its other copy stops
        # on it), and stops here.
        run.superseded_by = answer[1]
        ctx.count("replaced")
        return
    for replaced in answer:
        ctx.count("replaced")
        reason = f"superseded by task {task_id}: a newer {ctx.name} of lock {run.key} waits in its place"
        signals.duplicate_skipped.send(
            sender=ctx.task, key=run.key, task_id=replaced, holder_task_id=task_id, policy="replace"
        )
        if not ctx.task.ignore_result:
            try:
                ctx.task.backend.mark_as_revoked(replaced, reason, request=None)
            except Exception:  # its fallback copy says so again when it stops
                logger.debug("could not store the supersession of %s", replaced, exc_info=True)


def replaced(ctx: Context, run: Run, task_id: str, newer: str) -> None:
    """This delivery's job was replaced in the line by ``newer`` ("replace"): it does not run."""
    request = ctx.request
    reason = f"superseded by task {newer}: a newer {ctx.name} of lock {run.key} runs in its place"
    if not (request.is_eager or ctx.task.ignore_result or request.ignore_result):
        ctx.task.backend.mark_as_revoked(task_id, reason, request=None)
    resend.skip_quietly(ctx, run, Skipped(reason, run.key, newer))


def supersede(ctx: Context, key: str, task_id: str, newer: str, options: Options) -> None:
    """``task_id`` met ``newer``'s run, a newer call of the key ("cancel"): it leaves the line and is marked superseded
    by it (as park_replacing.lua marks a waiting call), so that its other copies stop too."""
    try:
        client, line, messages = waiters(key, options)
        expire_ms = int(max(WAITERS_TTL, 3 * options.ttl) * 1000)
        pipe = client.pipeline(transaction=False)
        pipe.set(sibling_key(key, ":superseded:") + task_id, newer, px=expire_ms)
        pipe.zrem(line, task_id)
        pipe.hdel(messages, task_id)
        pipe.execute()
    except Exception:  # its other copies meet the newer run and find it newer again
        logger.debug("could not mark %s[%s] superseded", ctx.name, task_id, exc_info=True)


def superseded_by(ctx: Context, key: str, task_id: str, options: Options) -> str | None:
    """The task id that replaced this waiting job ("replace"), or None."""
    try:
        client, _, _ = waiters(key, options)
        value = client.get(sibling_key(key, ":superseded:") + task_id)
    except Exception:  # cannot tell: the job runs (at least once beats lost)
        logger.debug("cannot read whether %s was superseded", task_id, exc_info=True)
        return None
    return None if value is None else text(value)


def unpark(ctx: Context, key: str, task_id: str, options: Options) -> None:
    """This job got the lock: take it out of the line (a copy woken for it later would only stop on DONE)."""
    try:
        client, line, messages = waiters(key, options)
        if FAIR.name in options.conf:  # lock_fair_on: the turns' books too (lua/unpark_fair.lua)
            client.eval(_UNPARK_FAIR, 4, line, messages, *FAIR.keys(key), task_id)
            return
        pipe = client.pipeline(transaction=False)
        pipe.zrem(line, task_id)
        pipe.hdel(messages, task_id)
        pipe.execute()
    except Exception:
        logger.debug("could not unpark %s[%s]", ctx.name, task_id, exc_info=True)


def wake_next(ctx: Context, key: str, options: Options, limit: int | None = 1) -> None:
    """After a release: send the oldest waiter of ``key`` to run now (it takes the lock, or waits again).

    ``limit``: the key's slots (lock_fair_on wakes none while as many woken calls are on their way)."""
    try:
        client, line, messages = waiters(key, options)
        if FAIR.name in options.conf:
            # lock_fair_on: the head is the lowest turn; the turn served moves up to it, and the woken job is
            # awaited for a lease, at most ``limit`` at once (policies/fair.py).
            now = time.time()
            deadline = int((now + options.ttl) * 1000)
            expire_ms = int(max(WAITERS_TTL, 3 * options.ttl) * 1000)
            message = client.eval(
                _POP_WAITER, 4, line, messages, *FAIR.keys(key), deadline, expire_ms, int(now * 1000), limit or 1
            )
        else:
            message = client.eval(_POP_WAITER, 2, line, messages)
        if message is None:
            return
        woken = ctx.task.app.signature(kombu_json.loads(message))  # type: ignore[no-untyped-call]
        woken.apply_async(countdown=None)
    except Exception:  # the waiter's fallback copy still wakes it
        logger.warning("could not wake the next waiter of lock %s", key, exc_info=True)
        return
    logger.debug("woke %s[%s], waiting for lock %s", woken.task, woken.id, key)


def hand_to_newest(ctx: Context, run: Run, lock: Redlock, options: Options) -> bool:
    """lock_on_duplicate="cancel": hand ``lock`` (held by this run, which a newer call stopped or which ended by itself
    while a call waited, or by a waiting call that was superseded meanwhile) to the newest call waiting in the key's
    line, and wake it; True when handed.

    The lock is never free in between (hand_on.lua, on a quorum of the nodes, in place of the release), so a call
    that reaches a worker meanwhile meets it held by that waiter (state ``handed``): a duplicate, which parks in the
    line as with "replace" (older than the waiter: superseded by it; newer: the waiter is superseded, and its copy
    hands the lock on again). The waiter stays in the line until its copy takes the lock over. False (nothing
    changed: the caller releases and wakes the line as before) when nobody waits, or the line's node does not answer;
    also when the hand-over reached fewer than a quorum of the nodes, or the waiting call's job has ended (cancelled
    by task id while it waited): then undone, the lock is free.

    ``singleton_lock_hand_on=False`` (a rolling upgrade from a version without hand-on, which reads a ``handed``
    record as another delivery of its own job and waits the hand-over out): False at once, the lock is freed and the
    line woken, as before hand-on.
    """
    if not settings_for(ctx.task.app).hand_on:
        return False
    try:
        client, line, messages = waiters(run.key, options)
        newest = [(text(x), int(score)) for x, score in client.zrange(line, -1, -1, withscores=True)]
        message = client.hget(messages, newest[0][0]) if newest and newest[0][0] != run.task_id else None
    except Exception:  # the line's node is down: the release frees the lock, the waiters' fallback copies run
        logger.warning("cannot hand lock %s to its newest waiter (line unreachable): released", run.key, exc_info=True)
        return False
    if message is None:
        return False
    waiter, arrived = newest[0]
    # "since": when the waiter's call first reached a worker (its place in the line), as its own run will say.
    record = {"state": HANDED, "job": waiter, "open": "1", "at": str(int(time.time() * 1000)), "since": str(arrived)}
    try:
        if not lock.hand_on(hand_over_for(options.ttl), record, done_for=options.done_window):
            return False
        woken = ctx.task.app.signature(kombu_json.loads(message))  # type: ignore[no-untyped-call]
        woken.apply_async(countdown=None)
    except Exception:  # its message not sent: the hand-over is cancelled (the caller wakes the line)
        logger.warning("could not hand lock %s to %s: released", run.key, waiter, exc_info=True)
        try:
            lock.release()
        except Exception:  # it expires within its lease
            logger.debug("cancelling the hand-over of %s failed", run.key, exc_info=True)
        return False
    logger.debug("handed lock %s to %s[%s], the newest waiting call", run.key, ctx.name, waiter)
    return True
