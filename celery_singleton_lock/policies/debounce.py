"""``lock_debounce=S`` (and ``lock_debounce_max=M``): a burst of calls of one job runs once, S s after its last
call, with the last call's arguments; BullMQ's debounce mode (delay + extend + replace) is the model.

The burst lives on the lock nodes, never only in a process (docs/protocol.md, "Debounce"):

* at ``apply_async`` (the front door, :func:`send`: the feature's ``at_send``): one round trip
  (``lua/debounce_join``) starts the key's burst, whose job is this call's task id (its message is published with
  a countdown of S), or joins the burst under way (its due time moves to S from now, at most M after its first
  call; its arguments become this call's; nothing is published, and the call gets the burst's ``AsyncResult``);
* at the worker: the job's message takes the key's lock as any run does (a run of the previous burst still
  running holds it: the job waits in the key's line, as ``reschedule``), then claims its burst
  (``lua/debounce_claim``) in two steps: ``check`` (not due yet on a quorum: due within ``HOLD_MAX``, it waits for
  it in the worker, lock held, and asks again; due later, it gives the lock back and is re-sent for the due time,
  carrying the newest arguments), then ``claim`` (due on a quorum: the burst ends on every node
  and the job runs with its last call's arguments). A node alone, due early or running a check late (paused), ends
  nothing. A call from then on starts a new
  burst, which runs after this run (never beside it: the lock). A job refused by its rate (``lock_on_rate_limit``
  skip or fail) or revoked or expired ends its burst too: every way a burst's run ends, a call from then on starts
  a new burst.

Each call is a *version* of its burst (named by its own task id, kept on each node it reached). Promises, with one
lock node out at a time (paused, or restarted empty):

* every call's arguments run at least once: as its burst's last call (the newest version a quorum of the nodes
  holds, or one holds confirmed: a call that joined on a quorum (more than one node) confirms its version there,
  so two nodes restarted empty one after the other lose no call), or on its own when no quorum agreed on a burst
  at its call (it then takes its version back from every node: the burst never runs it too);
* no version runs twice (a SIGKILLed run's redelivery aside: the lock's at-least-once);
* a run carries only a call whose caller was given its task id;
* older versions never run after a newer one: a delivery about to run whose version is older than the key's newest
  run is REVOKED, "superseded by task <the job that ran the newer one>" (the burst's last call's arguments did run:
  a newer call's); a job's burst is then not run at all, which debounce allows (the last call's arguments run);
* ``expires`` counts from the call whose arguments a message carries (a burst re-sent for its due time carries its
  newest version's call's expiry; its first message, the first call's).

Why the order holds (docs/protocol.md, "Debounce", Order): each call is stamped by the nodes' clocks when they take
it (its stamp: the earliest a node gave it), so a call made after another returned has the larger stamp, as far as
the nodes' clocks agree (within a burst the nodes' own orders choose the newest version, free of their skew:
:func:`choose`; between runs, two calls closer than the skew can be ordered the wrong way round). Every
debounced delivery, holding the lock, writes its version's stamp as the key's newest run on every node that
answers (``lua/debounce_claim``, ``ran``) unless one has a larger one there: then a newer version ran and this one
is superseded. One node's note suffices (only a run that started writes one), and a note written under the lock is
on a quorum but the node out, which any later check (a quorum answers) meets. A claim that finds no version a
quorum holds while a node did not answer asks again rather than run the message's older arguments; a burst's job
that fails for want of a quorum (``lock_on_unavailable="fail"``) ends its burst.

This module is the whole feature (:class:`Debounce`, ``DEBOUNCE_FEATURE``): its options' check, how the nodes'
answers are counted, the front door (:func:`send`, its ``at_send`` hook) and the worker's claim (:func:`claim`, its
``before_body`` hook), and the ends of a burst (``at_fail``, ``may_refuse``, ``at_revoke``). It imports nothing of
Celery: what it needs of it comes through the :class:`~celery_singleton_lock.policies.port.Call` and
:class:`~celery_singleton_lock.policies.port.Delivery` the rooms hand its hooks.
"""

from __future__ import annotations

import datetime as dt
import logging
import math
import time
from collections import Counter
from collections.abc import Sequence
from typing import Any, ClassVar, NamedTuple

from ..errors import ConfigurationError
from ..lock.record import burst_key_for, claimed_key_for, newest_run_key_for
from ..lock.scripts import DEBOUNCE_CLAIM, DEBOUNCE_JOIN
from .port import Call, Delivery, Feature

__all__ = [
    "CLAIM_GONE",
    "CLAIM_HEADER",
    "CLAIM_LATER",
    "CLAIM_RETRY",
    "CLAIM_SLACK",
    "CLAIM_START",
    "CLAIM_SUPERSEDED",
    "CLAIM_TRIES",
    "DEBOUNCE_FEATURE",
    "DEBOUNCE_HEADER",
    "HOLD_MAX",
    "JOIN_STANDIN",
    "JOIN_STARTED",
    "OVERDUE_AFTER",
    "STANDIN_AFTER",
    "VERSION_HEADER",
    "Debounce",
    "Version",
    "check_debounce",
    "choose",
    "claim",
    "confirm",
    "drop",
    "majority",
    "newest",
    "send",
    "stamp",
    "undo",
]

logger = logging.getLogger("celery_singleton_lock.task")

#: debounce_join's first answer: this call started the burst / joined it and publishes a stand-in copy.
JOIN_STARTED, JOIN_STANDIN = 1, 2
#: debounce_claim's first answer (claim; SUPERSEDED: 'ran', a newer version ran).
CLAIM_GONE, CLAIM_START, CLAIM_LATER, CLAIM_SUPERSEDED = 0, 1, 2, 3


def _seconds(value: object) -> bool:
    return not isinstance(value, bool) and isinstance(value, int | float) and value > 0


def check_debounce(cls: Any, settings: Any = None) -> None:
    """Validate ``lock_debounce`` and ``lock_debounce_max`` of a LockedTask class (ConfigurationError naming the first
    bad one, in one line). What they cannot be combined with is the options matrix's (``policies.matrix``)."""
    name = cls.name
    debounce, most = cls.lock_debounce, cls.lock_debounce_max
    if debounce is None:
        if most is not None:
            raise ConfigurationError(f"lock_debounce_max of {name} needs lock_debounce (the quiet period, seconds)")
        return
    if not _seconds(debounce):
        raise ConfigurationError(f"lock_debounce of {name} must be a number of seconds > 0, e.g. 5, got {debounce!r}")
    if most is not None and (not _seconds(most) or most < debounce):
        raise ConfigurationError(
            f"lock_debounce_max of {name} must be a number of seconds >= lock_debounce ({debounce}), got {most!r}"
        )
    serializer = getattr(cls, "serializer", None)
    app = getattr(cls, "_app", None)
    if serializer is None and app is not None:
        serializer = app.conf.task_serializer
    if serializer not in (None, "json"):
        raise ConfigurationError(
            f"lock_debounce of {name} needs the json serializer (the burst keeps its last call's arguments as "
            f"JSON on the lock nodes), got serializer={serializer!r}"
        )


def majority(answers: Sequence[Any], quorum: int, key: Any) -> tuple[Any, list[Any]] | None:
    """The value of ``key(answer)`` that at least ``quorum`` answers share, and those answers; None when none does.

    ``answers`` holds one entry per node: an exception (a node that did not answer) counts for nothing."""
    values = [key(a) for a in answers if not isinstance(a, BaseException) and a is not None]
    if not values:
        return None
    value, count = Counter(values).most_common(1)[0]
    if count < quorum:
        return None
    return value, [a for a in answers if not isinstance(a, BaseException) and a is not None and key(a) == value]


class Version(NamedTuple):
    """One call of a burst as a node keeps it: its number on that node, its task id (the version's name), its
    arguments (JSON ``[args, kwargs]``), the burst's due time after it (node ms), its expiry (Unix ms, 0: none), its
    stamp (when the node took the call, its clock's µs; 0: unknown, a version written before stamps) and whether its
    call confirmed it (it joined the burst on a quorum of the nodes: its caller was given the burst's job)."""

    n: int
    call: str
    args: str
    due: int
    expires: int
    at: int = 0
    confirmed: bool = False


def choose(nodes_versions: Sequence[Sequence[Version]], quorum: int) -> Version | None:
    """The newest version that at least ``quorum`` of the nodes hold, or that one of them holds confirmed (its
    call joined the burst on a quorum: the nodes that agreed may have lost it since, restarted empty one after the
    other), one list per node that answered; None when there is none. A version a minority alone holds unconfirmed
    may be a call that found no quorum and runs on its own (its take-back missed that node): never chosen.

    Newest: the one that the nodes holding it and each other one took last, on most of them (each node's own order,
    free of the nodes' clocks' skew: a node whose clock is behind, that missed an earlier call, gives a later call
    an earlier stamp than the others gave the earlier one). On a tie (or no node holding both): the latest stamp
    (the earliest a node that answered took it, see :func:`stamp`: a node that was paused takes the calls it held
    when it resumes, in any order, so its order can say older for newer, its stamps are later but never the
    earliest of a version a quorum took); then the highest number any node gave it; then the larger task id (calls
    that raced), the same on every reader. Its stamp is that earliest one."""
    held: Counter[str] = Counter()
    best: dict[str, Version] = {}
    first: dict[str, int] = {}
    confirmed: set[str] = set()
    orders: list[dict[str, int]] = []
    for versions in nodes_versions:
        order = {v.call: i for i, v in enumerate(versions)}  # oldest first: the order the node took them in
        orders.append(order)
        for v in {v.call: v for v in versions}.values():
            held[v.call] += 1
            if v.call not in best or v.n > best[v.call].n:
                best[v.call] = v
            if v.at > 0:
                first[v.call] = min(first.get(v.call, v.at), v.at)
            if v.confirmed:
                confirmed.add(v.call)
    agreed = [best[c] for c, count in held.items() if count >= quorum or c in confirmed]
    if not agreed:
        return None

    def rank(v: Version) -> tuple[int, int, str]:
        return (first.get(v.call, 0), v.n, v.call)

    def after(x: Version, y: Version) -> bool:
        votes = sum((o[x.call] > o[y.call]) - (o[x.call] < o[y.call]) for o in orders if x.call in o and y.call in o)
        return votes > 0 if votes else rank(x) > rank(y)

    # The version newer than every other; none (the nodes' orders disagree in a cycle): the latest by rank.
    chosen = next(
        (x for x in agreed if all(after(x, y) for y in agreed if y.call != x.call)),
        max(agreed, key=rank),
    )
    return chosen._replace(at=first.get(chosen.call, 0), confirmed=chosen.call in confirmed)


def stamp(times: Sequence[int]) -> int:
    """A call's stamp from the stamps the nodes gave it (their clocks' µs when each took it): the earliest (0: none).

    A call made after another one returned is stamped later on every node, so the earliest of its stamps is later
    than the earliest of the other's (up to the nodes' clocks' skew): the order of calls one after the other."""
    known = [t for t in times if t > 0]
    return min(known) if known else 0


#: How early (s) a job may claim its burst: a timer's and the nodes' clocks' slack.
CLAIM_SLACK = 0.1
#: A burst's job that claims at most this long (s) before its due time (the burst's later calls moved it past the
#: message's countdown) waits for it in the worker, holding its pool slot and the lock, and claims again: a burst
#: shorter than this puts one message on the broker, not two. Longer (or past half the lock's validity), it is
#: re-sent for its due time. A delivery waits this long at most in all.
HOLD_MAX = 2.0
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


def _countdown(options_: Any, seconds: float) -> float:
    """A countdown the broker takes: whole seconds >= 1 where delays go through native delayed delivery; at most
    half the broker's visibility timeout (a message held longer is restored, and exists twice: the job, arriving
    early, is re-sent for its due time again)."""
    if options_.max_countdown is not None:
        seconds = min(seconds, options_.max_countdown)
    if options_.whole_seconds:
        return float(max(1, math.ceil(seconds)))
    return max(0.0, seconds)


def send(call: Call) -> Any:
    """``apply_async`` of a task with ``lock_debounce``: start or join the key's burst (see the module); the call's
    own countdown or ETA (``call.delay``, s) is added to its quiet period."""
    ctx, publish, options, task_id, mark_joined = call.ctx, call.publish, call.options, call.task_id, call.joined
    if call.linked or ctx.task.app.conf.task_always_eager or _STANDS_ASIDE.intersection(options):
        # Links belong to one call, a group's member is its own job: sent as is (the worker's lock guards it).
        return mark_joined(publish(call.args, call.kwargs, task_id=task_id, **options), None)
    args, kwargs, delay = call.args or (), call.kwargs or {}, call.delay
    opts = ctx.options
    own_id = task_id is not None
    task_id = task_id or ctx.new_id()
    key = ctx.key_for(*args, **kwargs)
    quiet = float(ctx.task.lock_debounce or 0) + delay
    options.pop("countdown", None)
    options.pop("eta", None)
    nodes = opts.settings.nodes
    burst = burst_key_for(key)
    expires = _expiry_ms(options.get("expires"))
    try:
        blob = ctx.dumps([list(args), dict(kwargs)])
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
    found = majority(answers, nodes.quorum, key=lambda a: _text(a[1]))
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
        _text(a[1])
        for a in answers
        if not isinstance(a, BaseException) and a is not None and (_text(a[1]) == task_id or int(a[4]) >= 0)
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
    ctx.signal("duplicate_skipped", key=key, task_id=task_id, holder_task_id=job, policy="debounce")
    ctx.count("debounced")
    holders = [i for i, a in enumerate(answers) if not isinstance(a, BaseException) and a and _text(a[1]) == job]
    if len(answers) > 1:
        # Nodes restarted empty one after the other before the claim (on every node it joined, or on the quorum it
        # had when a node missed it) would leave this version on a minority, which a claim ignores. Confirmed on the
        # nodes that agreed, it counts on any one of them (only a call that saw a quorum confirms). One node: a
        # quorum of itself.
        confirm(ctx, key, job, task_id, holders)
    if sum(1 for a in agreed if int(a[0]) == JOIN_STANDIN) >= nodes.quorum:
        # The burst's starter never said its message was sent (slow, or it died between its join and its publish):
        # this call publishes a copy of the job (its task id, marked as a copy): whichever arrives runs it, once.
        # A quorum must say so: a node that missed the 'sent' mark (paused, a lost reply) alone is no reason.
        # The copy carries this call's arguments, so its expiry too (each call's expires counts for its arguments).
        headers = {**(options.pop("headers", None) or {}), DEBOUNCE_HEADER: seq, call.copy_header: 1}
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
    return int(_text(answer[5]))


def drop(ctx: Any, key: str, job: str) -> bool:
    """End ``job``'s burst unrun (its publish failed, it was revoked); True when a quorum of nodes had it."""
    nodes = ctx.options.settings.nodes
    try:
        answers = nodes.run(DEBOUNCE_CLAIM, [burst_key_for(key), claimed_key_for(key, job)], ["drop", job])
    except Exception:
        logger.warning("could not drop the burst of %s[%s] on lock %s", ctx.name, job, key, exc_info=True)
        return False
    return bool(sum(1 for a in answers if not isinstance(a, BaseException) and a == 1) >= nodes.quorum)


def confirm(ctx: Any, key: str, job: str, call: str, on: Sequence[int]) -> None:
    """Mark ``call``'s version of ``job``'s burst confirmed on the nodes ``on`` (it joined there, on a quorum)."""
    nodes = ctx.options.settings.nodes
    try:
        nodes.run(DEBOUNCE_CLAIM, [burst_key_for(key), claimed_key_for(key, job)], ["confirm", job, call], nodes=on)
    except Exception:  # the version is on a quorum still: only a later restart would make the mark count
        logger.debug("could not confirm the call %s[%s] in the burst of %s", ctx.name, call, key, exc_info=True)


def undo(ctx: Any, key: str, call: str) -> None:
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


def claim(delivery: Delivery, *, runs: bool = True) -> bool:
    """This delivery of a debounced call holds the lock: may it run now? True: run, with ``run.body_args`` (the
    burst's last arguments) if the burst gave them. False: it stops here and the caller gives the lock back: not due
    yet (re-sent for its due time with the newest arguments), or superseded (a newer version of the key ran).

    A burst's job (its message has the debounce header) claims its burst first; then every version about to run
    (a burst's, or a call sent on its own) is held to the key's newest run (:func:`newest`). ``runs`` False: the
    job does not run after all (refused by its rate): its burst ends, and nothing is noted as run."""
    ctx, run = delivery.ctx, delivery.run
    options, request = ctx.options, ctx.request
    at = _header_at(request)
    if getattr(request, DEBOUNCE_HEADER, None):
        nodes = options.settings.nodes
        keys = [burst_key_for(run.key), claimed_key_for(run.key, run.task_id), newest_run_key_for(run.key)]
        held = 0.0  # seconds this delivery waited in the worker for its due time (see HOLD_MAX)
        started: list[Any] = []
        try:
            while True:
                # First ask (nothing changes): a node that alone finds the burst due (it missed the later calls), or
                # that runs the question late (paused, it runs what its socket held when it resumes), must not end
                # a burst a quorum keeps, or the later calls of the burst miss it (a burst of their own there).
                answers = nodes.run(
                    DEBOUNCE_CLAIM,
                    keys,
                    ["check", run.task_id, int(CLAIM_SLACK * 1000), int(options.done_window * 1000)],
                )
                ok = [a for a in answers if not isinstance(a, BaseException) and a]
                later = [a for a in ok if int(a[0]) == CLAIM_LATER]
                started = [a for a in ok if int(a[0]) == CLAIM_START]
                if not (later and len(started) < nodes.quorum):
                    break
                due = max(int(a[1]) for a in later) / 1000.0
                pause = _hold(delivery, due, held) if runs else 0.0
                if pause > 0:
                    # Due soon (the burst's calls moved its due time past this message's): wait for it here, lock
                    # held, and ask again, rather than put a second message on the broker.
                    time.sleep(pause)
                    held += pause
                    continue
                seq = max(int(a[2]) for a in later)
                versions = [_versions(ctx, a[3]) for a in later] + [_versions(ctx, a[2]) for a in started]
                wait(delivery, due, seq, choose(versions, nodes.quorum))
                return False
            if started:
                # Due on a quorum (or nowhere kept later): the burst ends on every node, a minority where it is
                # still pending included (a call joined it there just before, or a node answered late): left, it
                # would split the next bursts' quorum until it expires. The versions read are those it ended with.
                answers = nodes.run(
                    DEBOUNCE_CLAIM,
                    keys,
                    ["claim", run.task_id, int(CLAIM_SLACK * 1000), int(options.done_window * 1000)],
                )
        except Exception:  # the lock is ours: run with the message's arguments (at least once beats lost)
            logger.warning("could not claim the burst of %s[%s]; running", ctx.name, run.task_id, exc_info=True)
            return True
        ok = [a for a in answers if not isinstance(a, BaseException) and a]
        started = [a for a in ok if int(a[0]) == CLAIM_START]
        if started:
            # Only a version a quorum of the nodes holds, or one holds confirmed, runs: one a minority alone holds
            # unconfirmed may be a call that found no quorum and runs on its own (its take-back missed that node).
            # None (nodes out): the
            # message's own arguments, which a quorum agreed on when it was sent (its starter's, or its last
            # re-send's), with the message's stamp.
            chosen = choose([_versions(ctx, a[2]) for a in started], nodes.quorum)
            tries = int(getattr(request, CLAIM_HEADER, 0) or 0)
            if chosen is None and any(isinstance(a, BaseException) for a in answers) and tries < CLAIM_TRIES:
                # A node did not answer (paused, restarting): the versions a quorum holds may be there, newer than
                # the message's (a call that joined after it was sent). This claim ended the burst where it was
                # due; its re-sent copy reads those versions back (claimed) and asks the node again.
                seq = int(getattr(request, DEBOUNCE_HEADER, None) or 1)
                wait(delivery, CLAIM_RETRY * 2**tries, seq, None, {CLAIM_HEADER: tries + 1})
                return False
            if chosen is not None:
                loaded = ctx.loads(chosen.args)
                run.body_args = (tuple(loaded[0]), dict(loaded[1]))
                request.args, request.kwargs = list(run.body_args[0]), run.body_args[1]
                at = chosen.at or at
        elif all(int(a[0]) == CLAIM_GONE for a in ok):
            logger.debug(
                "%s[%s]: no burst on lock %s (revoked, expired or never debounced): running",
                ctx.name,
                run.task_id,
                run.key,
            )
    return not runs or newest(delivery, at)


def newest(delivery: Delivery, at: int) -> bool:
    """The version stamped ``at`` is about to run (this delivery holds the lock): True when no newer version of the
    key ran (it is noted as the key's newest run, on every node that answers); False when one did: this delivery
    is superseded (REVOKED, naming the newer run's job) and does not run, since older arguments never run after
    newer ones. A node's note is a fact (only a run that started writes it): one node that has a newer one is
    enough. This job's own earlier run of a newer version (a redelivery that chose again with fewer nodes) runs
    that version again."""
    ctx, run = delivery.ctx, delivery.run
    options, request = ctx.options, ctx.request
    if at <= 0:  # a message sent before stamps: nothing to order it by
        return True
    nodes = options.settings.nodes
    keys = [burst_key_for(run.key), claimed_key_for(run.key, run.task_id), newest_run_key_for(run.key)]
    args = run.body_args or (tuple(request.args or ()), dict(request.kwargs or {}))
    blob = ctx.dumps([list(args[0]), dict(args[1])])
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
    top = max(newer, key=lambda a: int(_text(a[2])))
    job = _text(top[1])
    if job == run.task_id:
        loaded = ctx.loads(_text(top[3]))
        run.body_args = (tuple(loaded[0]), dict(loaded[1]))
        request.args, request.kwargs = list(run.body_args[0]), run.body_args[1]
        return True
    reason = (
        f"debounced: {ctx.name}[{run.task_id}] of lock {run.key} is superseded by task {job}: it ran a newer "
        "call's arguments, and older arguments never run after newer ones"
    )
    if not (request.is_eager or ctx.task.ignore_result or request.ignore_result):
        try:  # a copy of a job that did end (its done marker gone) keeps its stored result
            if not ctx.ended(run.task_id):
                ctx.task.backend.mark_as_revoked(run.task_id, reason, request=None)
        except Exception:
            logger.debug("could not store the superseded state of %s", run.task_id, exc_info=True)
    delivery.skip(reason, job)
    return False


def _header_at(request: Any) -> int:
    try:
        return int(getattr(request, VERSION_HEADER, None) or 0)
    except (TypeError, ValueError):
        return 0


def failed(delivery: Delivery) -> None:
    """A burst's job fails before its claim (no quorum for its lock or its rate, ``lock_on_unavailable="fail"`` or
    its retries spent): its burst ends, so a call from now on starts a new burst instead of joining a FAILED job.
    Sent to every node: one that did not answer (paused) holds the command on its connection and runs it when it
    resumes; one restarted empty lost the burst anyway."""
    ctx, run = delivery.ctx, delivery.run
    if getattr(ctx.request, DEBOUNCE_HEADER, None) and not run.retries:
        drop(ctx, run.key, run.task_id)


def rate_refused(delivery: Delivery) -> bool:
    """A burst's job refused by its rate (``lock_on_rate_limit`` skip or fail): its burst ends here as if it ran (the
    claim), so a call from now on starts a new burst instead of joining one whose job is REVOKED or FAILED. False:
    the job was not due yet (a later call joined): it was re-sent for its due time and asks the rate again then."""
    if not getattr(delivery.ctx.request, DEBOUNCE_HEADER, None) or delivery.run.retries:
        return True
    return claim(delivery, runs=False)


def _versions(ctx: Any, raw: Any) -> list[Version]:
    """A node's versions of a burst (its ``hist``, oldest first); a burst written before versions: its arguments."""
    if raw is None:
        return []
    loaded = ctx.loads(_text(raw))
    if len(loaded) == 2 and isinstance(loaded[1], dict):  # [args, kwargs]: claimed before versions existed
        return [Version(0, "", _text(raw), 0, 0)]
    return [
        Version(
            int(v[0]),
            str(v[1]),
            str(v[2]),
            int(v[3]),
            int(v[4] or 0),
            int(v[5]) if len(v) > 5 else 0,
            bool(len(v) > 6 and v[6]),
        )
        for v in loaded
    ]


def wait(
    delivery: Delivery,
    due: float,
    seq: int,
    version: Version | None,
    more: dict[str, Any] | None = None,
) -> None:
    """Re-send this job's delivery for its due time, carrying the newest version a quorum holds (its arguments and
    its call's expiry; none: the message's own); this one stops."""
    ctx, run = delivery.ctx, delivery.run
    countdown = _countdown(ctx.options, due)
    extra: dict[str, Any] = {}
    if version is not None:
        loaded = ctx.loads(version.args)
        extra = {"args": list(loaded[0]), "kwargs": dict(loaded[1]), "expires": _expires(version.expires)}
    headers: dict[str, Any] = {DEBOUNCE_HEADER: seq, **(more or {})}
    if version is not None and version.at:
        headers[VERSION_HEADER] = version.at
    delivery.resend(headers, countdown, **extra)
    said = f"debounced: re-sent to run in {countdown:.1f}s (its burst's quiet period)"
    logger.debug("Task %s[%s] %s: lock %s", ctx.name, run.task_id, said, run.key)
    delivery.skip(said, run.task_id, "waiting")


# -- the feature ---------------------------------------------------------------------------------------------------

DEBOUNCE_HEADER = "singleton_lock_debounce"  # a burst's job message (the seq of the call it carries)
VERSION_HEADER = "singleton_lock_version"  # the stamp of the call whose arguments a message carries
CLAIM_HEADER = "singleton_lock_debounce_claims"  # claims re-sent for want of the nodes holding versions


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class Debounce(Feature):
    """``lock_debounce`` / ``lock_debounce_max``: a burst runs once, after its last call, with its arguments."""

    name: ClassVar[str] = "debounce"
    options: ClassVar[tuple[str, ...]] = ("lock_debounce", "lock_debounce_max")
    headers: ClassVar[tuple[str, ...]] = (DEBOUNCE_HEADER, VERSION_HEADER, CLAIM_HEADER)
    scripts: ClassVar[tuple[str, ...]] = ("debounce_join", "debounce_claim")
    #: A debounced job that finds the previous burst's run still running waits for it (never beside it).
    duplicates: ClassVar[str | None] = "reschedule"

    def check(self, cls: Any) -> None:
        check_debounce(cls)

    def active(self, cls: Any) -> bool:
        return bool(cls.lock_debounce)

    def at_send(self, call: Call) -> Any:
        """Start or join the key's burst: only the call that started it publishes (:func:`send`)."""
        return send(call)

    def before_body(self, delivery: Delivery) -> bool:
        """A burst's job (or a version sent on its own) holding the lock claims its burst: run now, with which
        arguments (``run.body_args``), or not yet / never (:func:`claim`)."""
        request = delivery.ctx.request
        if delivery.run.retries or not (
            getattr(request, DEBOUNCE_HEADER, None) or getattr(request, VERSION_HEADER, None)
        ):
            return True
        return claim(delivery)

    def at_fail(self, delivery: Delivery) -> None:
        failed(delivery)

    def may_refuse(self, delivery: Delivery) -> bool:
        return rate_refused(delivery)

    def at_revoke(self, ctx: Any, key: str, task_id: str) -> bool | None:
        """A pending burst's job revoked: the burst ends unrun (a later call starts a new one)."""
        return drop(ctx, key, task_id)


DEBOUNCE_FEATURE = Debounce()


def _hold(delivery: Delivery, due: float, held: float) -> float:
    """How long this delivery waits in the worker for its burst's due time, ``due`` s from now, before claiming
    again: all of it when it fits what is left of ``HOLD_MAX`` (``held`` s spent) and half the lock's remaining
    validity (the lease is not renewed before the body starts); else 0: it is re-sent for its due time. Never once
    its rate counted this delivery's start (``lock_rate``, asked before the claim): the body would begin the hold
    later than the count its slot's next start is placed a window after; re-sent, its start is given back and its
    copy asks the rate again when due."""
    lock = delivery.lock
    if lock is None or due <= 0:
        return 0.0
    state: dict[str, Any] = delivery.run.state or {}
    if getattr(state.get("rate"), "token", None):  # policies/rate/conf.py's Share (this module imports no feature)
        return 0.0
    if due > HOLD_MAX - held or due > lock.validity / 2:
        return 0.0
    return due
