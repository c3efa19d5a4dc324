"""``lock_rate``: never more than N starts of a rate key in any window of a given length, across every worker.

The rate is a policy of its own, beside the duplicate policies: it decides whether a delivery that may run (its lock
is ours, or it has none: ``lock_limit=None``) may *start now*. What an over-the-rate delivery does is
``lock_on_rate_limit``: ``"wait"`` (default: re-sent for the moment the window allows, never early, never dropped),
``"skip"`` (REVOKED) or ``"fail"`` (FAILURE with :class:`~celery_singleton_lock.errors.RateLimitedError`).

How a start is counted (lua/rate.lua): each node keeps a sliding log of the starts of the last window, a sorted set
scored by the node's own clock (Redis ``TIME``). A start takes one of N *slots* and holds it for one window from its
start; a slot is free again once its start left the window. N + 1 starts within one window would need N + 1 slots
at once, so a log never holds more than N starts of any window.

Across nodes it is the lock's quorum: a start is counted when a majority of the nodes gave it **the same slot**. Each
slot is then a Redlock of its own with a lease of one window that nobody renews or releases, and two starts that
hold one slot on two majorities meet on a node, which refused the later one until the earlier one's window had
passed there. That is why slots, not counts: with counts alone, 3 nodes and N = 2, starts counted on nodes {A, B},
{B, C} and {A, C} leave each node seeing 2, yet 3 starts ran. A failed attempt is undone on the nodes that counted
it (lua/rate_undo.lua, also written behind a timed-out call on its connection); contenders that split the free slots
try again at once, the second time asking for the slot most nodes gave.

One feature behind the port (:class:`RateFeature`, ``RATE_FEATURE``): its options' checks, the rate key of a call,
and its hooks: ``after_lock`` (the delivery asks for its share: :func:`take`, then carries the verdict out through the
:class:`~celery_singleton_lock.policies.port.Delivery` it is handed) and ``body_skipped`` (a share counted for a
body that does not start after all is given back). It imports nothing of Celery.
"""

from __future__ import annotations

import logging
import math
import random
import re
import secrets
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

from ..config import did_you_mean
from ..errors import ConfigurationError, LockUnavailableError, RateLimitedError
from ..keys import lock_key
from ..nodes import NodeSet
from ..scripts import RATE, RATE_RESTAMP, RATE_UNDO
from .port import Delivery, Feature, check_names, parameters

__all__ = [
    "ON_RATE_LIMIT",
    "RATE_FEATURE",
    "RATE_HEADER",
    "RATE_MAX_COUNTDOWN",
    "Rate",
    "RateFeature",
    "RateLimitPolicy",
    "Share",
    "Verdict",
    "parse_rate",
    "take",
    "undo",
]

RateLimitPolicy = Literal["wait", "skip", "fail"]
#: The values of ``lock_on_rate_limit``.
ON_RATE_LIMIT: tuple[RateLimitPolicy, ...] = ("wait", "skip", "fail")

logger = logging.getLogger("celery_singleton_lock.task")

_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0}
_NOTATION = re.compile(r"^\s*(\d+)\s*/\s*([smh])\s*$")
#: Attempts of one decision when contenders split the free slots between the nodes.
_SPLIT_ATTEMPTS = 3
#: Seconds a decision may take before its grant is restamped (lua/rate_restamp.lua): a body begins when the quorum's
#: answers are back, so a start whose answers came back late (a slow reply, a paused node waited for) would begin that
#: much later than the nodes counted it, and may then begin within a window of its slot's next start.
LATE = 0.05


@dataclass(frozen=True)
class Rate:
    """At most ``limit`` starts in any window of ``period`` seconds."""

    limit: int
    period: float

    @property
    def window_us(self) -> int:
        return round(self.period * 1_000_000)

    def __str__(self) -> str:
        return f"{self.limit} per {self.period:g} s"


def parse_rate(value: Any, where: str) -> Rate:
    """``"N/s"``, ``"N/m"``, ``"N/h"`` (Celery's notation) or ``(N, seconds)``; ConfigurationError naming ``where``."""
    if isinstance(value, str):
        match = _NOTATION.match(value)
        if match and int(match.group(1)) >= 1:
            return Rate(int(match.group(1)), _UNITS[match.group(2)])
    elif isinstance(value, Sequence) and len(value) == 2:
        limit, period = value
        if (
            isinstance(limit, int)
            and not isinstance(limit, bool)
            and 1 <= limit <= 10_000
            and isinstance(period, int | float)
            and not isinstance(period, bool)
            and math.isfinite(period)
            and 0.001 <= period <= 30 * 86400
        ):
            return Rate(limit, float(period))
    raise ConfigurationError(
        f"{where} must be 'N/s', 'N/m', 'N/h' or (N, seconds) with N a whole number from 1 to 10000 and seconds "
        f"from 0.001 to 30 days, got {value!r}"
    )


@dataclass
class Verdict:
    """What the nodes said of one start."""

    outcome: Literal["granted", "limited", "unavailable"]
    wait: float = 0.0  #: limited: seconds until the window lets a start in on a quorum of the nodes
    token: str = ""  #: granted: the owner token of the counted start (for :func:`undo`)
    slot: int = -1  #: granted: the slot it holds
    at: float = 0.0  #: granted: when it was counted, by the clock of a node that counted it (Unix seconds)
    #: granted: when each node that holds it counted it (node index -> Unix seconds, by that node's clock)
    times: dict[int, float] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)  #: the nodes that failed, redacted
    #: limited: not over the rate, as far as the nodes said, but contenders kept splitting the free slots between the
    #: nodes: ask again shortly (never skip or fail a call for it)
    contended: bool = False


def take(nodes: NodeSet, key: str, rate: Rate) -> Verdict:
    """Count one start under ``key`` if the window allows it on a quorum of the nodes (one round trip; a split of
    the free slots between contenders costs one more each time, at most :data:`_SPLIT_ATTEMPTS`)."""
    preferred = ""
    verdict = Verdict("limited", wait=0.0)
    for attempt in range(_SPLIT_ATTEMPTS):
        token = secrets.token_hex(16)
        began = time.monotonic()
        # After a split, the nodes also say when each slot is free there: the next attempt asks for a slot free on
        # a quorum, or the wait is the moment one is.
        detail = "1" if attempt else ""
        answers = nodes.run(
            RATE,
            [key],
            [token, rate.limit, rate.window_us, preferred, detail],
            undo_on_timeout=(RATE_UNDO, [key], [token]),
        )
        granted: dict[int, int] = {}
        moments: dict[int, float] = {}
        waits: list[float] = []
        errors: list[str] = []
        slot_frees: list[list[float]] = []
        for i, answer in enumerate(answers):
            if isinstance(answer, BaseException):
                errors.append(str(nodes.error(i, answer)))
                continue
            if int(answer[0]) == 1:
                granted[i] = int(answer[1])
                moments[i] = int(answer[2]) / 1_000_000
            else:
                waits.append(max(0, int(answer[1])) / 1_000_000)
            if detail and len(answer) == 3 + rate.limit:
                slot_frees.append([max(0, int(x)) / 1_000_000 for x in answer[3:]])
        slot, count = Counter(granted.values()).most_common(1)[0] if granted else (-1, 0)
        if count >= nodes.quorum:
            strays = [i for i, s in granted.items() if s != slot]
            if strays:
                undo(nodes, key, token, strays)
            times = {i: moments[i] for i, s in granted.items() if s == slot}
            if time.monotonic() - began <= LATE:
                return Verdict("granted", token=token, slot=slot, at=min(times.values()), times=times)
            restamped = _restamp(nodes, key, rate, token, slot, times)
            if restamped is not None:
                return restamped
            # Late again: uncounted. Ask afresh; after the last attempt the nodes are too slow to tell.
            verdict = Verdict("unavailable", errors=[f"the nodes answered later than {LATE:g} s, {attempt + 1} times"])
            continue
        if granted:
            undo(nodes, key, token, granted)
        answered = len(nodes) - len(errors)
        if answered < nodes.quorum:
            return Verdict("unavailable", errors=errors)
        if answered - len(waits) < nodes.quorum:
            # Refused by too many nodes for a quorum now: the window is full. It lets a start in when a quorum of
            # the nodes that answered has a free slot: those that counted us have one now, the others when their
            # oldest start leaves the window.
            frees = sorted([0.0] * len(granted) + waits)
            return Verdict("limited", wait=frees[nodes.quorum - 1])
        if len(slot_frees) == answered:
            # Per slot, the moment a quorum of the answering nodes has it free; the earliest slot decides.
            best, at = min(
                ((s, sorted(f[s] for f in slot_frees)[nodes.quorum - 1]) for s in range(rate.limit)),
                key=lambda pair: pair[1],
            )
            if at > 0:
                # No slot is free on a quorum: the free slots are split between the nodes (starts that hold
                # different majorities), not taken by contenders that undo them: wait for that moment, no polling.
                return Verdict("limited", wait=at)
            slot = best
        # Contenders split the free slots between the nodes: ask again, for the slot most nodes gave (or one free
        # on a quorum, as the nodes said).
        preferred = str(slot)
        verdict = Verdict("limited", wait=0.005 + 0.045 * random.random(), contended=True)  # noqa: S311 - jitter
        if attempt + 1 < _SPLIT_ATTEMPTS:
            time.sleep(verdict.wait * random.random())  # noqa: S311 - jitter
    return verdict


def _restamp(nodes: NodeSet, key: str, rate: Rate, token: str, slot: int, times: dict[int, float]) -> Verdict | None:
    """A grant whose answers came back later than :data:`LATE`: move its entry to the nodes' time now on the nodes
    that hold it (no waiting for the others), so the slot's next start comes a window after this moment. Counted
    when a quorum moved it within :data:`LATE`; otherwise uncounted (None), and the caller asks again."""
    member = f"{slot}:{token}"
    for _ in range(2):
        began = time.monotonic()
        try:
            answers = nodes.run(RATE_RESTAMP, [key], [member, rate.window_us], nodes=list(times))
        except Exception:
            break
        moved = {
            i: int(answers[i][1]) / 1_000_000
            for i in times
            if not isinstance(answers[i], BaseException) and answers[i] and int(answers[i][0]) == 1
        }
        if len(moved) < nodes.quorum:
            break
        times = moved
        if time.monotonic() - began <= LATE:
            return Verdict("granted", token=token, slot=slot, at=min(times.values()), times=times)
    undo(nodes, key, token)
    return None


def undo(nodes: NodeSet, key: str, token: str, on: Any = None) -> None:
    """Uncount the start of ``token`` (on the nodes ``on``, default all); best effort: a node that misses it keeps
    one start too many in its log, which only ever delays a later start."""
    try:
        nodes.run(RATE_UNDO, [key], [token], nodes=list(on) if on is not None else None)
    except Exception:
        return


# -- the feature: its options, its key, its hooks ----------------------------------------------------------------

RATE_HEADER = "singleton_lock_rate_waits"  # how many times this call waited for the window
#: The longest countdown a delivery waiting for its rate's window is re-sent with (a longer wait takes several).
RATE_MAX_COUNTDOWN = 900.0


@dataclass(frozen=True)
class Conf:
    """A task's rate options, read once: the rate, what an over-the-rate delivery does, the arguments sharing it."""

    rate: Rate
    on_limit: str
    on: tuple[str, ...]


@dataclass
class Share:
    """The start a delivery counted (``run.state["rate"]``): its rate key, when it was counted (Unix s, a counting
    node's clock), its slot and each holding node's count time, and the owner token that uncounts it."""

    key: str
    at: float | None = None
    slot: tuple[int, dict[int, float]] | None = None
    token: str = ""


class RateFeature(Feature):
    """``lock_rate``, ``lock_rate_on``, ``lock_on_rate_limit``: asked after the lock is taken, before the body."""

    name: ClassVar[str] = "rate"
    options: ClassVar[tuple[str, ...]] = ("lock_rate", "lock_rate_on", "lock_on_rate_limit")
    headers: ClassVar[tuple[str, ...]] = (RATE_HEADER,)
    scripts: ClassVar[tuple[str, ...]] = ("rate", "rate_undo", "rate_restamp")

    def check(self, cls: Any) -> None:
        """Each option alone (ConfigurationError); what they need of each other is the matrix's."""
        name = cls.name
        policy = cls.lock_on_rate_limit
        if policy not in ON_RATE_LIMIT:
            raise ConfigurationError(
                f"{self.options[2]} of {name} must be one of {', '.join(map(repr, ON_RATE_LIMIT))}, "
                f"got {policy!r}{did_you_mean(policy, ON_RATE_LIMIT)}"
            )
        on = cls.lock_rate_on
        if on is not None and (isinstance(on, str) or not all(isinstance(n, str) for n in on)):
            raise ConfigurationError(f"{self.options[1]} of {name} must be a list of argument names")
        if cls.lock_rate is None:
            if on is not None:
                raise ConfigurationError(f"{self.options[1]} of {name} needs a {self.options[0]}")
            return
        parse_rate(cls.lock_rate, f"{self.options[0]} of {name}")
        if on:
            check_names(cls, self.options[1], on, parameters(cls))

    def active(self, cls: Any) -> bool:
        return cls.lock_rate is not None

    def resolve(self, task: Any) -> Conf:
        rate = parse_rate(task.lock_rate, f"{self.options[0]} of {task.name}")
        on = tuple(task.lock_rate_on) if task.lock_rate_on is not None else ()
        return Conf(rate, task.lock_on_rate_limit, on)

    def key_for(self, ctx: Any, args: Any, kwargs: Any) -> str | None:
        """The rate key of a call with these arguments (None: the task has no rate)."""
        options = ctx.options
        conf: Conf | None = options.conf.get(self.name)
        if conf is None:
            return None
        prefix = f"{options.settings.prefix}rate:"
        return lock_key(prefix, options.space, options.binder, args, kwargs, unique_on=list(conf.on))

    @staticmethod
    def share(run: Any) -> Share | None:
        """The start ``run`` counted (None: none, or no rate)."""
        found: Share | None = (run.state or {}).get("rate")
        return found

    def started_at(self, run: Any) -> float | None:
        """When ``run``'s start was counted (Unix s, a counting node's clock); None without a rate."""
        share = self.share(run)
        return share.at if share is not None else None

    def after_lock(self, delivery: Delivery) -> bool:
        """Count this start if the window allows it (one more round trip), True then: the body runs.

        Over the rate, ``lock_on_rate_limit`` acts: ``wait`` re-sends this delivery for the moment the window lets a
        start in (never early: that copy asks again; :meth:`Delivery.wait_out` keeps what its call holds meanwhile),
        ``skip`` stores REVOKED, ``fail`` raises RateLimitedError; the lock (if any) is given back at once, as if never
        taken. Without a quorum, ``lock_on_unavailable`` acts (``run``: the body starts uncounted, under its lock).
        """
        ctx, run = delivery.ctx, delivery.run
        options = ctx.options
        conf: Conf = options.conf[self.name]
        rate = conf.rate
        key = self.key_for(ctx, delivery.args, delivery.kwargs)
        assert key is not None  # active: the task has a rate
        share = Share(key)
        if run.state is None:
            run.state = {}
        run.state[self.name] = share
        verdict = take(options.settings.nodes, key, rate)
        if verdict.outcome == "granted":
            share.at, share.slot, share.token = verdict.at, (verdict.slot, verdict.times), verdict.token
            return True
        request = ctx.request
        task_id = run.task_id
        if verdict.outcome == "unavailable":
            policy = options.on_unavailable
            attempt = delivery.attempt
            if not attempt:  # once per call, not per retry
                ctx.count("unavailable")
            ctx.signal("lock_unavailable", key=key, task_id=task_id, policy=policy, errors=verdict.errors)
            if policy == "run":
                logger.warning("Task %s[%s] starts UNCOUNTED: rate %s unavailable", ctx.name, task_id, key)
                return True
            settings = options.settings
            if (
                policy == "fail"
                or request.is_eager
                or (settings.max_retries is not None and attempt + 1 > settings.max_retries)
            ):
                delivery.give_back()
                delivery.failed()  # every feature's end of a delivery that fails before its body
                raise LockUnavailableError(key, node_errors=verdict.errors)
            delay = min(settings.retry_max_delay, settings.retry_delay * 2**attempt)
            countdown = delay * (0.5 + 0.5 * random.random())  # noqa: S311 - jitter
            delivery.wait_out(countdown, "unavailable", {delivery.attempt_header: attempt + 1})
            return False
        waits = int(getattr(request, RATE_HEADER, 0) or 0)
        if not waits:  # once per call: its re-sent copies asking again are the same call
            ctx.count("rate-limited")
        said = f"rate {rate} of {key} reached"
        ctx.signal("rate_limited", key=key, task_id=task_id, rate=str(rate), policy=conf.on_limit)
        # Contenders split the free slots on every attempt: the rate is not known to be reached, so the call is not
        # skipped or failed for it; it asks again shortly (an eager call cannot wait: it is told).
        contended = verdict.contended and not request.is_eager
        if not contended and conf.on_limit != "wait" and not delivery.may_refuse():
            return False  # another feature took it elsewhere (a burst's job not due yet: re-sent for its due time)
        if not contended and (conf.on_limit == "fail" or request.is_eager):
            delivery.give_back()
            raise RateLimitedError(key, task_name=ctx.name, rate=str(rate), wait=verdict.wait)
        if not contended and conf.on_limit == "skip":
            delivery.give_back()
            reason = f"{ctx.name} skipped: {said}"
            if not (ctx.task.ignore_result or request.ignore_result):
                ctx.task.backend.mark_as_revoked(task_id, reason, request=None)
            delivery.skip(reason, None)
            return False
        # wait: for the moment the window lets a start in on a quorum (a few ms after it: never early; that copy asks
        # again, and one that loses the moment to another waiter is re-sent for the next one).
        countdown = verdict.wait + 0.002 + 0.01 * random.random()  # noqa: S311 - jitter
        # A long wait ("5/h") goes in steps: a countdown message waits unacked in a worker, which RabbitMQ's
        # consumer_timeout (30 min by default) and a Redis broker's visibility timeout do not allow for long.
        countdown = min(countdown, RATE_MAX_COUNTDOWN, options.max_countdown or RATE_MAX_COUNTDOWN)
        delivery.wait_out(countdown, "rate", {RATE_HEADER: waits + 1}, said)
        return False

    def body_skipped(self, delivery: Delivery) -> None:
        """Give back the share :meth:`after_lock` counted for this delivery: its body does not start after all."""
        run = delivery.run
        share = self.share(run)
        if share is not None and share.token:
            undo(delivery.ctx.options.settings.nodes, share.key, share.token)
            share.token, share.at, share.slot = "", None, None


RATE_FEATURE = RateFeature()
