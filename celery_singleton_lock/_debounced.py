"""Debounce's rooms at ``apply_async`` and at the worker (``lock_debounce``; the policy: policies/debounce.py).

The front door (:func:`send`) starts or joins the key's burst in one round trip to every lock node and publishes
the job's message only for the call that started the burst; the worker (:func:`claim`) asks the burst, once its
job holds the lock, whether it runs now and with which arguments. Both vote over the nodes as the lock does: an
answer counts when a quorum of nodes gave it.
"""

from __future__ import annotations

import datetime as dt
import logging
import math
import time
from collections.abc import Callable
from typing import Any

from celery.signals import task_revoked
from celery.states import READY_STATES
from celery.utils import uuid
from kombu.utils import json as kombu_json

from . import _resend as resend
from . import signals
from ._run import (
    CLAIM_HEADER,
    DEBOUNCE_HEADER,
    REDELIVERY_HEADER,
    VERSION_HEADER,
    Context,
    Options,
    Run,
    Skipped,
    is_locked_task,
    mark_joined,
    text,
)
from .policies.debounce import (
    CLAIM_GONE,
    CLAIM_LATER,
    CLAIM_START,
    CLAIM_SUPERSEDED,
    JOIN_STANDIN,
    Version,
    choose,
    majority,
    stamp,
)
from .record import burst_key_for, claimed_key_for, newest_run_key_for
from .scripts import DEBOUNCE_CLAIM, DEBOUNCE_JOIN

__all__ = [
    "CLAIM_RETRY",
    "CLAIM_SLACK",
    "CLAIM_TRIES",
    "OVERDUE_AFTER",
    "STANDIN_AFTER",
    "claim",
    "drop",
    "failed",
    "newest",
    "rate_refused",
    "send",
    "undo",
]

logger = logging.getLogger("celery_singleton_lock.task")

#: How early (s) a job may claim its burst: a timer's and the nodes' clocks' slack.
CLAIM_SLACK = 0.1
#: A claim that found no version a quorum holds while a node did not answer is re-sent this long (s) later, doubled
#: each time, at most CLAIM_TRIES times (about 30 s in all); then it runs with its message's arguments.
CLAIM_RETRY, CLAIM_TRIES = 0.5, 6
#: After how long (s) a burst whose message was never marked sent gets a stand-in publish from a later call: at once,
#: since a call that joined it must not depend on a call after it (its starter may have died before publishing, or
#: its publish raised after this call joined); at most one copy per burst, racing a live starter's publish.
STANDIN_AFTER = 0.0
#: An overdue burst (its job has not claimed it) gets a stand-in after a lease, at least this long (s).
OVERDUE_AFTER = 2.0
# apply_async options under which a call is not debounced: sent as a call of its own, guarded at the worker.
_STANDS_ASIDE = frozenset({"chord", "group_id", "chain"})


def _countdown(options_: Options, seconds: float) -> float:
    """A countdown the broker takes: whole seconds >= 1 where delays go through native delayed delivery; at most
    half the broker's visibility timeout (a message held longer is restored, and exists twice: the job, arriving
    early, is re-sent for its due time again)."""
    if options_.max_countdown is not None:
        seconds = min(seconds, options_.max_countdown)
    if options_.whole_seconds:
        return float(max(1, math.ceil(seconds)))
    return max(0.0, seconds)


def send(
    ctx: Context,
    publish: Callable[..., Any],
    args: Any,
    kwargs: Any,
    task_id: str | None,
    options: dict[str, Any],
    *,
    linked: bool,
    delay: float,
) -> Any:
    """``apply_async`` of a task with ``lock_debounce``: start or join the key's burst (see the module); ``delay``:
    the call's own countdown or ETA (s), added to its quiet period."""
    if linked or ctx.task.app.conf.task_always_eager or _STANDS_ASIDE.intersection(options):
        # Links belong to one call, a group's member is its own job: sent as is (the worker's lock guards it).
        return mark_joined(publish(args, kwargs, task_id=task_id, **options), None)
    args, kwargs = args or (), kwargs or {}
    opts = ctx.options
    own_id = task_id is not None
    task_id = task_id or uuid()
    key = ctx.key_for(*args, **kwargs)
    quiet = float(ctx.task.lock_debounce or 0) + delay
    options.pop("countdown", None)
    options.pop("eta", None)
    nodes = opts.settings.nodes
    burst = burst_key_for(key)
    expires = _expiry_ms(options.get("expires"))
    try:
        blob = kombu_json.dumps([list(args), dict(kwargs)])  # type: ignore[no-untyped-call]
        answers = nodes.run(
            DEBOUNCE_JOIN,
            [burst],
            [
                task_id,
                int(quiet * 1000),
                int(float(ctx.task.lock_debounce_max or 0) * 1000),
                blob,
                # The burst outlives its due time by the job's done window at least: a message held back that
                # long (a Redis broker restores an unacked one after its visibility timeout) still finds it.
                int(max(float(ctx.options.queue_ttl), opts.done_window) * 1000),
                ctx.name,
                int(STANDIN_AFTER * 1000),
                # Overdue: its job has not claimed it a lease after its due time, nor since the last publish (a
                # job waiting for a long previous run gets one more copy per lease, a lost one its stand-in).
                int(max(OVERDUE_AFTER, opts.ttl) * 1000),
                expires,
            ],
        )
    except Exception:  # at enqueue, when in doubt, send: the worker's lock is the guard
        logger.warning("%s: could not debounce on lock %s; sending the call alone", ctx.name, key, exc_info=True)
        answers = []
    found = majority(answers, nodes.quorum, key=lambda a: text(a[1]))
    # This call's stamp (see policies.debounce.stamp): the message carrying its arguments carries it, and its run is
    # ordered by it against the key's newest run. No node answered: this process's clock stands in.
    at = stamp([_at(a) for a in answers]) or int(time.time() * 1_000_000)
    if found is None:
        # No quorum agrees on a burst (nodes down, or calls racing on a split): this call runs on its own, after its
        # quiet period, guarded by the lock at the worker (never two at once; each such call runs, unless a
        # newer call's arguments ran first: then it is superseded, see newest()).
        # Its version leaves every burst it joined or started (on the nodes that answered, and those whose answer
        # was lost): a burst's run never carries the arguments of a call that runs on its own.
        undo(ctx, key, task_id)
        logger.warning("%s: no quorum for the burst of lock %s; the call is sent on its own", ctx.name, key)
        headers = {**(options.pop("headers", None) or {}), VERSION_HEADER: at}
        sent = publish(args, kwargs, task_id=task_id, countdown=_countdown(opts, quiet), headers=headers, **options)
        return mark_joined(sent, None)
    job, agreed = found
    due = max(int(a[2]) for a in agreed) / 1000.0
    seq = max(int(a[3]) for a in agreed)
    # A burst on a minority of the nodes that is not the quorum's: this call's own start (nobody publishes it), or,
    # past its due time there, a burst whose job ran while that node missed its claim (paused, late): left, it
    # would split the next bursts' quorum until it expires. End it there. (One still due later may be a live job's
    # that lost the other nodes' copies in a restart: its claim reads its newest arguments there.)
    stale = {
        text(a[1])
        for a in answers
        if not isinstance(a, BaseException) and a is not None and (text(a[1]) == task_id or int(a[4]) >= 0)
    }
    for other in stale - {job}:
        drop(ctx, key, other)
    if job == task_id:  # this call started the burst: its message is the job's
        headers = {**(options.pop("headers", None) or {}), DEBOUNCE_HEADER: seq, VERSION_HEADER: at}
        try:
            sent = publish(args, kwargs, task_id=task_id, countdown=_countdown(opts, due), headers=headers, **options)
        except BaseException:
            drop(ctx, key, task_id)  # nothing was sent: the burst must not wait for a message that never comes
            raise
        try:
            nodes.run(DEBOUNCE_CLAIM, [burst, claimed_key_for(key, job)], ["sent", job])
        except Exception:  # a later call sends a stand-in copy: one more message, never a lost job
            logger.debug("could not mark the burst of %s sent", key, exc_info=True)
        return mark_joined(sent, None)
    signals.duplicate_skipped.send(sender=ctx.task, key=key, task_id=task_id, holder_task_id=job, policy="debounce")
    ctx.count("debounced")
    if sum(1 for a in agreed if int(a[0]) == JOIN_STANDIN) >= nodes.quorum:
        # The burst's starter never said its message was sent (slow, or it died between its join and its publish):
        # this call publishes a copy of the job (its task id, marked as a copy): whichever arrives runs it, once.
        # A quorum must say so: a node that missed the 'sent' mark (paused, a lost reply) alone is no reason.
        # The copy carries this call's arguments, so its expiry too (each call's expires counts for its arguments).
        headers = {**(options.pop("headers", None) or {}), DEBOUNCE_HEADER: seq, REDELIVERY_HEADER: 1}
        headers[VERSION_HEADER] = at
        publish(args, kwargs, task_id=job, countdown=_countdown(opts, due), headers=headers, **options)
    if own_id and not ctx.task.ignore_result:
        # The caller chose this id and may wait on it: say at once that the burst's job runs in its place.
        reason = f"debounced: {ctx.name} of lock {key} runs once as task {job}, with the burst's last arguments"
        try:
            ctx.task.backend.mark_as_revoked(task_id, reason, request=None)
        except Exception:
            logger.debug("could not store the debounced state of %s", task_id, exc_info=True)
    return mark_joined(ctx.task.AsyncResult(job), job)


def _at(answer: Any) -> int:
    """The stamp a node's join answer gave the call (0: none, an error, or a node running an older script)."""
    if isinstance(answer, BaseException) or answer is None or len(answer) < 6:
        return 0
    return int(text(answer[5]))


def drop(ctx: Context, key: str, job: str) -> bool:
    """End ``job``'s burst unrun (its publish failed, it was revoked); True when a quorum of nodes had it."""
    nodes = ctx.options.settings.nodes
    try:
        answers = nodes.run(DEBOUNCE_CLAIM, [burst_key_for(key), claimed_key_for(key, job)], ["drop", job])
    except Exception:
        logger.warning("could not drop the burst of %s[%s] on lock %s", ctx.name, job, key, exc_info=True)
        return False
    return sum(1 for a in answers if not isinstance(a, BaseException) and a == 1) >= nodes.quorum


def undo(ctx: Context, key: str, call: str) -> None:
    """Take ``call``'s version back from the key's burst on every node (it found no quorum and is sent on its own):
    a burst it started there ends, one it joined goes back to its newest version left."""
    nodes = ctx.options.settings.nodes
    try:
        nodes.run(DEBOUNCE_CLAIM, [burst_key_for(key), claimed_key_for(key, call)], ["undo", call])
    except Exception:  # a node that kept it is a minority: the claim runs only a version a quorum holds
        logger.warning("could not take back the call %s[%s] from the burst of %s", ctx.name, call, key, exc_info=True)


def _expiry_ms(expires: Any) -> int:
    """A call's ``expires`` (seconds from now, a datetime or an ISO text) as Unix ms; 0: none."""
    if expires is None:
        return 0
    if isinstance(expires, int | float):
        return int((time.time() + float(expires)) * 1000)
    if isinstance(expires, str):
        expires = dt.datetime.fromisoformat(expires)
    if isinstance(expires, dt.datetime):
        if expires.tzinfo is None:
            expires = expires.replace(tzinfo=dt.timezone.utc)
        return int(expires.timestamp() * 1000)
    return 0


def _expires(ms: int) -> dt.datetime | None:
    return dt.datetime.fromtimestamp(ms / 1000.0, tz=dt.timezone.utc) if ms else None


def claim(ctx: Context, run: Run, options: Options, request: Any, *, runs: bool = True) -> bool:
    """This delivery of a debounced call holds the lock: may it run now? True: run, with ``run.debounced`` (the
    burst's last arguments) if the burst gave them. False: it stops here and the caller gives the lock back: not due
    yet (re-sent for its due time with the newest arguments), or superseded (a newer version of the key ran).

    A burst's job (its message has the debounce header) claims its burst first; then every version about to run
    (a burst's, or a call sent on its own) is held to the key's newest run (:func:`newest`). ``runs`` False: the
    job does not run after all (refused by its rate): its burst ends, and nothing is noted as run."""
    at = _header_at(request)
    if getattr(request, DEBOUNCE_HEADER, None):
        nodes = options.settings.nodes
        keys = [burst_key_for(run.key), claimed_key_for(run.key, run.task_id), newest_run_key_for(run.key)]
        try:
            answers = nodes.run(
                DEBOUNCE_CLAIM,
                keys,
                ["claim", run.task_id, int(CLAIM_SLACK * 1000), int(options.done_window * 1000)],
            )
        except Exception:  # the lock is ours: run with the message's arguments (at least once beats lost)
            logger.warning("could not claim the burst of %s[%s]; running", ctx.name, run.task_id, exc_info=True)
            return True
        ok = [a for a in answers if not isinstance(a, BaseException) and a]
        later = [a for a in ok if int(a[0]) == CLAIM_LATER]
        started = [a for a in ok if int(a[0]) == CLAIM_START]
        if later and len(started) < nodes.quorum:
            due = max(int(a[1]) for a in later) / 1000.0
            seq = max(int(a[2]) for a in later)
            versions = [_versions(a[3]) for a in later] + [_versions(a[2]) for a in started]
            wait(ctx, run, options, request, due, seq, choose(versions, nodes.quorum))
            return False
        if started:
            if later:
                # A quorum claimed the burst, but on a minority it is still pending (a call joined it there just
                # before the claim, or a node answered late): end it there too, or it would split the next bursts'
                # quorum until it expires (each call then sent on its own once a node is down).
                drop(ctx, run.key, run.task_id)
            # Only a version a quorum of the nodes holds runs: one a minority alone holds may be a call that found
            # no quorum and runs on its own (its take-back missed that node). No quorum for any (nodes out): the
            # message's own arguments, which a quorum agreed on when it was sent (its starter's, or its last
            # re-send's), with the message's stamp.
            chosen = choose([_versions(a[2]) for a in started], nodes.quorum)
            tries = int(getattr(request, CLAIM_HEADER, 0) or 0)
            if chosen is None and any(isinstance(a, BaseException) for a in answers) and tries < CLAIM_TRIES:
                # A node did not answer (paused, restarting): the versions a quorum holds may be there, newer than
                # the message's (a call that joined after it was sent). This claim ended the burst where it was
                # due; its re-sent copy reads those versions back (claimed) and asks the node again.
                seq = int(getattr(request, DEBOUNCE_HEADER, None) or 1)
                wait(ctx, run, options, request, CLAIM_RETRY * 2**tries, seq, None, {CLAIM_HEADER: tries + 1})
                return False
            if chosen is not None:
                loaded = kombu_json.loads(chosen.args)  # type: ignore[no-untyped-call]
                run.debounced = (tuple(loaded[0]), dict(loaded[1]))
                request.args, request.kwargs = list(run.debounced[0]), run.debounced[1]
                at = chosen.at or at
        elif all(int(a[0]) == CLAIM_GONE for a in ok):
            logger.debug(
                "%s[%s]: no burst on lock %s (revoked, expired or never debounced): running",
                ctx.name,
                run.task_id,
                run.key,
            )
    return not runs or newest(ctx, run, options, request, at)


def newest(ctx: Context, run: Run, options: Options, request: Any, at: int) -> bool:
    """The version stamped ``at`` is about to run (this delivery holds the lock): True when no newer version of the
    key ran (it is noted as the key's newest run, on every node that answers); False when one did: this delivery
    is superseded (REVOKED, naming the newer run's job) and does not run, since older arguments never run after
    newer ones. A node's note is a fact (only a run that started writes it): one node that has a newer one is
    enough. This job's own earlier run of a newer version (a redelivery that chose again with fewer nodes) runs
    that version again."""
    if at <= 0:  # a message sent before stamps: nothing to order it by
        return True
    nodes = options.settings.nodes
    keys = [burst_key_for(run.key), claimed_key_for(run.key, run.task_id), newest_run_key_for(run.key)]
    args = run.debounced or (tuple(request.args or ()), dict(request.kwargs or {}))
    blob = kombu_json.dumps([list(args[0]), dict(args[1])])  # type: ignore[no-untyped-call]
    # Kept while an older version may still reach a worker: a burst pending (its quiet period, at most its max)
    # then as long as its burst or its message's redelivery may wait (docs/protocol.md, Debounce).
    quiet = float(ctx.task.lock_debounce_max or ctx.task.lock_debounce or 0)
    keep = int((max(float(ctx.options.queue_ttl), options.done_window) + quiet) * 1000)
    try:
        answers = nodes.run(DEBOUNCE_CLAIM, keys, ["ran", run.task_id, str(at), keep, blob])
    except Exception:  # the lock is ours: run (at least once beats lost)
        logger.warning("could not note the run of %s[%s]; running", ctx.name, run.task_id, exc_info=True)
        return True
    newer = [a for a in answers if not isinstance(a, BaseException) and a and int(a[0]) == CLAIM_SUPERSEDED]
    if not newer:
        return True
    top = max(newer, key=lambda a: int(text(a[2])))
    job = text(top[1])
    if job == run.task_id:
        loaded = kombu_json.loads(text(top[3]))  # type: ignore[no-untyped-call]
        run.debounced = (tuple(loaded[0]), dict(loaded[1]))
        request.args, request.kwargs = list(run.debounced[0]), run.debounced[1]
        return True
    reason = (
        f"debounced: {ctx.name}[{run.task_id}] of lock {run.key} is superseded by task {job}: it ran a newer "
        "call's arguments, and older arguments never run after newer ones"
    )
    if not (request.is_eager or ctx.task.ignore_result or request.ignore_result):
        try:  # a copy of a job that did end (its done marker gone) keeps its stored result
            if ctx.task.backend.get_state(run.task_id) not in READY_STATES:
                ctx.task.backend.mark_as_revoked(run.task_id, reason, request=None)
        except Exception:
            logger.debug("could not store the superseded state of %s", run.task_id, exc_info=True)
    resend.skip_quietly(ctx, run, Skipped(reason, run.key, job))
    return False


def _header_at(request: Any) -> int:
    try:
        return int(getattr(request, VERSION_HEADER, None) or 0)
    except (TypeError, ValueError):
        return 0


def failed(ctx: Context, run: Run, request: Any) -> None:
    """A burst's job fails before its claim (no quorum for its lock or its rate, ``lock_on_unavailable="fail"`` or
    its retries spent): its burst ends, so a call from now on starts a new burst instead of joining a FAILED job.
    Sent to every node: one that did not answer (paused) holds the command on its connection and runs it when it
    resumes; one restarted empty lost the burst anyway."""
    if ctx.task.lock_debounce and getattr(request, DEBOUNCE_HEADER, None) and not run.retries:
        drop(ctx, run.key, run.task_id)


def rate_refused(ctx: Context, run: Run, options: Options, request: Any) -> bool:
    """A burst's job refused by its rate (``lock_on_rate_limit`` skip or fail): its burst ends here as if it ran (the
    claim), so a call from now on starts a new burst instead of joining one whose job is REVOKED or FAILED. False:
    the job was not due yet (a later call joined): it was re-sent for its due time and asks the rate again then."""
    if not ctx.task.lock_debounce or not getattr(request, DEBOUNCE_HEADER, None) or run.retries:
        return True
    return claim(ctx, run, options, request, runs=False)


def _versions(raw: Any) -> list[Version]:
    """A node's versions of a burst (its ``hist``, oldest first); a burst written before versions: its arguments."""
    if raw is None:
        return []
    loaded = kombu_json.loads(text(raw))  # type: ignore[no-untyped-call]
    if len(loaded) == 2 and isinstance(loaded[1], dict):  # [args, kwargs]: claimed before versions existed
        return [Version(0, "", text(raw), 0, 0)]
    return [
        Version(int(v[0]), str(v[1]), str(v[2]), int(v[3]), int(v[4] or 0), int(v[5]) if len(v) > 5 else 0)
        for v in loaded
    ]


def wait(
    ctx: Context,
    run: Run,
    options: Options,
    request: Any,
    due: float,
    seq: int,
    version: Version | None,
    more: dict[str, Any] | None = None,
) -> None:
    """Re-send this job's delivery for its due time, carrying the newest version a quorum holds (its arguments and
    its call's expiry; none: the message's own); this one stops."""
    countdown = _countdown(options, due)
    extra: dict[str, Any] = {}
    if version is not None:
        loaded = kombu_json.loads(version.args)  # type: ignore[no-untyped-call]
        extra = {"args": list(loaded[0]), "kwargs": dict(loaded[1]), "expires": _expires(version.expires)}
    headers: dict[str, Any] = {DEBOUNCE_HEADER: seq, **(more or {})}
    if version is not None and version.at:
        headers[VERSION_HEADER] = version.at
    copy = resend.copy(ctx, headers, countdown=countdown, **extra)
    copy.apply_async()
    said = f"debounced: re-sent to run in {countdown:.1f}s (its burst's quiet period)"
    logger.debug("Task %s[%s] %s: lock %s", ctx.name, run.task_id, said, run.key)
    resend.skip_quietly(ctx, run, Skipped(said, run.key, run.task_id, "waiting"))


@task_revoked.connect(weak=False)  # type: ignore[untyped-decorator]
def _drop_revoked_burst(sender: Any = None, request: Any = None, **_: Any) -> None:
    """A worker met a revoked or expired message of a burst's job: the burst ends (a later call starts a new one)."""
    if not is_locked_task(sender) or not getattr(sender, "lock_debounce", None) or request is None:
        return
    ctx = sender.lock_context()
    try:
        key = ctx.key_for(*(request.args or ()), **(request.kwargs or {}))
        drop(ctx, key, request.id)
    except Exception:  # the burst still ends with its expiry
        logger.warning("could not drop the burst of %s[%s]", ctx.name, request.id, exc_info=True)
