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

import inspect
import logging
import math
import random
import re
import secrets
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

from ...errors import ConfigurationError, LockUnavailableError, RateLimitedError
from ...lock.config import did_you_mean
from ...lock.keys import lock_key
from ...lock.nodes import NodeSet
from ...lock.scripts import RATE, RATE_ADJUST, RATE_PAUSE, RATE_RESTAMP, RATE_STACK, RATE_STACK_RESTAMP, RATE_UNDO
from ..port import Delivery, Feature, check_names, parameters
from .booking import BOOKING_HEADER, books, decide_for

__all__ = [
    "ON_RATE_LIMIT",
    "RATE_FEATURE",
    "RATE_HEADER",
    "RATE_MAX_COUNTDOWN",
    "SLOWED_HEADER",
    "Limit",
    "Rate",
    "RateFeature",
    "RateLimitPolicy",
    "Share",
    "Verdict",
    "Window",
    "adjust",
    "parse_limits",
    "parse_rate",
    "take",
    "take_many",
    "undo",
]

RateLimitPolicy = Literal["wait", "skip", "fail"]
#: The values of ``lock_on_rate_limit``.
ON_RATE_LIMIT: tuple[RateLimitPolicy, ...] = ("wait", "skip", "fail")

logger = logging.getLogger("celery_singleton_lock.task")

_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
_NOTATION = re.compile(r"^\s*(\d+)\s*/\s*([smhd])\s*$")
#: Attempts of one decision when contenders split the free slots between the nodes.
_SPLIT_ATTEMPTS = 3
#: Seconds a decision may take before its grant is restamped (lua/rate_restamp.lua): a body begins when the quorum's
#: answers are back, so a start whose answers came back late (a slow reply, a paused node waited for) would begin that
#: much later than the nodes counted it, and may then begin within a window of its slot's next start.
LATE = 0.05


@dataclass(frozen=True)
class Window:
    """At most ``limit`` starts (units) in any window of ``period`` seconds: one parsed limit."""

    limit: int
    period: float

    @property
    def window_us(self) -> int:
        return round(self.period * 1_000_000)

    def __str__(self) -> str:
        return f"{self.limit} per {self.period:g} s"


def parse_rate(value: Any, where: str) -> Window:
    """``"N/s"``, ``"N/m"``, ``"N/h"``, ``"N/d"`` (Celery's notation, and a day) or ``(N, seconds)``;
    ConfigurationError naming ``where``."""
    if isinstance(value, str):
        match = _NOTATION.match(value)
        if match and int(match.group(1)) >= 1:
            return Window(int(match.group(1)), _UNITS[match.group(2)])
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
            return Window(limit, float(period))
    raise ConfigurationError(
        f"{where} must be 'N/s', 'N/m', 'N/h', 'N/d' or (N, seconds) with N a whole number from 1 to 10000 and seconds "
        f"from 0.001 to 30 days, got {value!r}"
    )


@dataclass(frozen=True, init=False)
class Rate:
    """One limit of a task's ``lock_rate`` with its own arguments and cost: ``Rate("60/m", on=["tenant_id"])`` (one
    rate per tenant), ``Rate("3000/m")`` (one for the whole task, or its group), ``Rate("900/m", cost=estimate)``
    (the units a start takes of this limit). ``rate`` is what ``lock_rate`` takes alone; ``on`` names the arguments
    sharing it (default: none, whatever ``lock_rate_on`` says: that is the ``on`` of the list's plain items);
    ``cost`` is a number of units or a function of the call's arguments, like ``lock_rate_cost`` (default None: the
    task's ``lock_rate_cost``, 1 without one)."""

    rate: Any
    on: tuple[str, ...]
    cost: Any

    def __init__(self, rate: Any, on: Sequence[str] | None = None, cost: Any = None) -> None:
        object.__setattr__(self, "rate", rate)
        object.__setattr__(self, "on", on if isinstance(on, str) else tuple(on or ()))
        object.__setattr__(self, "cost", cost)


@dataclass(frozen=True)
class Limit:
    """One limit of a call: its window, the arguments whose values make its key, and its own cost (None: the
    task's ``lock_rate_cost``)."""

    window: Window
    on: tuple[str, ...]
    cost: Any = None


def _one(value: Any) -> bool:
    """``value`` is one plain limit (a notation or ``(N, seconds)``), not a list of limits."""
    return isinstance(value, str) or (
        isinstance(value, Sequence) and len(value) == 2 and not isinstance(value[0], str | Rate | Sequence)
    )


def parse_limits(value: Any, default_on: Sequence[str], where: str) -> tuple[Limit, ...]:
    """``lock_rate``'s limits: one plain limit, a :class:`Rate`, or a list of them (stacked: a start needs a share
    of every one); plain ones are on ``default_on`` (``lock_rate_on``). ConfigurationError naming ``where``."""
    items = [value] if _one(value) or isinstance(value, Rate) else value
    if (
        not isinstance(items, Sequence)
        or isinstance(items, str | bytes)
        or not items
        or not all(isinstance(i, str | Rate) or (isinstance(i, Sequence) and not isinstance(i, bytes)) for i in items)
    ):
        parse_rate(value, where)  # raises: the one-line message of a plain limit
        raise AssertionError  # pragma: no cover - parse_rate refuses what _one does not take
    if len(items) > 8:
        raise ConfigurationError(f"{where} stacks {len(items)} limits: at most 8")
    out: list[Limit] = []
    for item in items:
        if isinstance(item, Rate):
            on = item.on
            if isinstance(on, str) or not all(isinstance(n, str) for n in on):
                raise ConfigurationError(f"{where}: Rate(..., on=) must be a list of argument names, got {on!r}")
            cost = item.cost
            if cost is not None and not callable(cost):
                units_of(cost, f"{where}: Rate(..., cost=)")
            out.append(Limit(parse_rate(item.rate, where), tuple(on), cost))
        else:
            if not _one(item):
                parse_rate(item, f"{where}: each limit")
            out.append(Limit(parse_rate(item, where), tuple(default_on)))
    seen: dict[tuple[float, frozenset[str], int], Limit] = {}
    for limit in out:
        # A limit with a cost of its own has a key of its own (its N in it): it may share a period and arguments
        # with others (3,000 requests and 90,000 tokens a minute).
        same = (limit.window.period, frozenset(limit.on), limit.window.limit if limit.cost is not None else 0)
        if same in seen:
            raise ConfigurationError(
                f"{where} has two limits per {limit.window.period:g} s on the same arguments "
                f"({seen[same].window} and {limit.window}): keep one of them"
            )
        seen[same] = limit
    return tuple(out)


def named_limits(limits: Sequence[Limit], name: Any) -> list[int]:
    """The limits ``name`` names (``SlowDown(limit=)``, ``rate_spent(limit=)``): an index in ``lock_rate``, or a
    notation such as ``"60/m"`` (every limit of that window); empty when it names none."""
    if isinstance(name, int) and not isinstance(name, bool):
        return [name] if 0 <= name < len(limits) else []
    try:
        window = parse_rate(name, "limit=")
    except ConfigurationError:
        return []
    return [i for i, lim in enumerate(limits) if lim.window == window]


def _check_signature(fn: Any, where: str, params: Sequence[Any] | None) -> None:
    """A cost function can be called with the task's arguments: each parameter it needs (no default) is one of
    the task's, or it takes ``*args``/``**kwargs``; ConfigurationError naming ``where`` otherwise."""
    try:
        needs = [
            p.name
            for p in inspect.signature(fn).parameters.values()
            if p.default is p.empty and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY, p.POSITIONAL_ONLY)
        ]
    except (TypeError, ValueError):
        return
    if params is None or any(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in params):
        return
    known = [p.name for p in params]
    missing = [n for n in needs if n not in known]
    if missing:
        raise ConfigurationError(
            f"{where} needs argument(s) {missing} the task does not take; the task's arguments are "
            f"{', '.join(known) or '(none)'} (a cost function is called with the call's arguments, like lock_key)"
        )


def units_of(cost: Any, where: str) -> int:
    """A cost (``lock_rate_cost``, or what a function of it returned) as whole units: a positive number, rounded
    up; ConfigurationError naming ``where``."""
    if isinstance(cost, int | float) and not isinstance(cost, bool) and math.isfinite(cost) and 0 < cost <= 10_000:
        return math.ceil(cost)
    raise ConfigurationError(f"{where} must be a number of units above 0 and at most 10000, got {cost!r}")


@dataclass
class Verdict:
    """What the nodes said of one start."""

    outcome: Literal["granted", "limited", "unavailable", "booked"]
    #: limited: seconds until the window lets a start in on a quorum of the nodes; booked: until its booked moment
    wait: float = 0.0
    token: str = ""  #: granted: the owner token of the counted start (for :func:`undo`)
    slot: int = -1  #: granted: the slot it holds
    at: float = 0.0  #: granted: when it was counted, by the clock of a node that counted it (Unix seconds)
    #: granted: when each node that holds it counted it (node index -> Unix seconds, by that node's clock)
    times: dict[int, float] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)  #: the nodes that failed, redacted
    #: limited: not over the rate, as far as the nodes said, but contenders kept splitting the free slots between the
    #: nodes: ask again shortly (never skip or fail a call for it)
    contended: bool = False
    #: granted by :func:`take_many`: the slots the start holds, per limit
    slots: tuple[tuple[int, ...], ...] = ()


def take(nodes: NodeSet, key: str, rate: Window) -> Verdict:
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


def take_many(nodes: NodeSet, keys: Sequence[str], windows: Sequence[Window], cost: int | Sequence[int] = 1) -> Verdict:
    """Count one start of ``cost`` units (one number for every limit, or one per limit) under every key (one per
    limit, ``windows`` theirs) if every window allows it on a quorum of the nodes, all or none (lua/rate_stack.lua:
    one script call per node with every key, so one round trip; a split costs one more each time, at most
    :data:`_SPLIT_ATTEMPTS`).

    A start takes its cost of each limit in slots of that limit; it is counted when a majority of the nodes gave it
    the same slots of every limit, so each slot of each limit is a lock of its own, as in :func:`take`: no window of
    any limit holds more than its N units. The wait when refused is the moment a quorum has room in every limit (a
    node answers the max over its limiting windows)."""
    keys = list(keys)
    costs = [cost] * len(keys) if isinstance(cost, int) else list(cost)
    preferred = [""] * len(keys)
    verdict = Verdict("limited", wait=0.0)
    head = [",".join(map(str, costs))]
    bounds = [2 + sum(costs[:j]) for j in range(len(keys) + 1)]
    for attempt in range(_SPLIT_ATTEMPTS):
        token = secrets.token_hex(16)
        began = time.monotonic()
        detail = "1" if attempt else ""
        args: list[str | int] = [token, *head, detail]
        for window, pref in zip(windows, preferred, strict=True):
            args += [window.limit, window.window_us, pref]
        answers = nodes.run(RATE_STACK, keys, args, undo_on_timeout=(RATE_UNDO, keys, [token]))
        granted: dict[int, tuple[tuple[int, ...], ...]] = {}
        moments: dict[int, float] = {}
        waits: list[float] = []
        errors: list[str] = []
        frees: list[list[list[float]]] = []
        for i, answer in enumerate(answers):
            if isinstance(answer, BaseException):
                errors.append(str(nodes.error(i, answer)))
                continue
            if int(answer[0]) == 1:
                flat = [int(x) for x in answer]
                granted[i] = tuple(tuple(sorted(flat[bounds[j] : bounds[j + 1]])) for j in range(len(keys)))
                moments[i] = int(answer[1]) / 1_000_000
                rest = answer[bounds[-1] :]
            else:
                waits.append(max(0, int(answer[1])) / 1_000_000)
                rest = answer[3:]
            if detail and len(rest) == sum(w.limit for w in windows):
                per, at = [], 0
                for w in windows:
                    per.append([max(0, int(x)) / 1_000_000 for x in rest[at : at + w.limit]])
                    at += w.limit
                frees.append(per)
        slots, count = Counter(granted.values()).most_common(1)[0] if granted else ((), 0)
        if count >= nodes.quorum:
            strays = [i for i, s in granted.items() if s != slots]
            if strays:
                undo(nodes, keys, token, strays)
            times = {i: moments[i] for i, s in granted.items() if s == slots}
            if time.monotonic() - began <= LATE:
                first = min(times.values())
                return Verdict("granted", token=token, slot=slots[0][0], at=first, times=times, slots=slots)
            restamped = _restamp_many(nodes, keys, windows, token, slots, times)
            if restamped is not None:
                return restamped
            verdict = Verdict("unavailable", errors=[f"the nodes answered later than {LATE:g} s, {attempt + 1} times"])
            continue
        if granted:
            undo(nodes, keys, token, granted)
        answered = len(nodes) - len(errors)
        if answered < nodes.quorum:
            return Verdict("unavailable", errors=errors)
        if answered - len(waits) < nodes.quorum:
            # Refused by too many nodes for a quorum now: the moment a quorum of the answering nodes has room in
            # every limit (each node said the max over its limiting windows).
            return Verdict("limited", wait=sorted([0.0] * len(granted) + waits)[nodes.quorum - 1])
        if len(frees) == answered:
            # Per limit, the ``cost`` slots free soonest on a quorum of the answering nodes; the latest of those
            # moments, over the limits, decides.
            moment, wanted = 0.0, []
            for j, w in enumerate(windows):
                ranked = sorted((sorted(f[j][s] for f in frees)[nodes.quorum - 1], s) for s in range(w.limit))
                ranked = ranked[: costs[j]]
                moment = max(moment, *(at for at, _ in ranked))
                wanted.append(",".join(str(s) for _, s in sorted(ranked, key=lambda pair: pair[1])))
            if moment > 0:
                return Verdict("limited", wait=moment)
            preferred = wanted
        else:
            preferred = [",".join(map(str, s)) for s in slots] if slots else preferred
        verdict = Verdict("limited", wait=0.005 + 0.045 * random.random(), contended=True)  # noqa: S311 - jitter
        if attempt + 1 < _SPLIT_ATTEMPTS:
            time.sleep(verdict.wait * random.random())  # noqa: S311 - jitter
    return verdict


def _restamp_many(
    nodes: NodeSet,
    keys: list[str],
    windows: Sequence[Window],
    token: str,
    slots: tuple[tuple[int, ...], ...],
    times: dict[int, float],
) -> Verdict | None:
    """:func:`_restamp` of a start of several limits or units (lua/rate_stack_restamp.lua)."""
    args: list[str | int] = [token, *(w.window_us for w in windows), *(",".join(map(str, s)) for s in slots)]
    for _ in range(2):
        began = time.monotonic()
        try:
            answers = nodes.run(RATE_STACK_RESTAMP, keys, args, nodes=list(times))
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
            return Verdict("granted", token=token, slot=slots[0][0], at=min(times.values()), times=times, slots=slots)
    undo(nodes, keys, token)
    return None


def adjust(
    nodes: NodeSet, keys: Sequence[str], windows: Sequence[Window], token: str, delta: int | Sequence[int], on: Any
) -> None:
    """Correct a counted start's cost by ``delta`` units (one number for every key, or one per key) on the nodes
    ``on`` (those that counted it): a refund
    (< 0) frees that many of its slots there at once; an extra charge (> 0) is logged there at the nodes' time now
    for one window (lua/rate_adjust.lua). Best effort, like :func:`undo`: a node that misses a refund only delays
    later starts; one that misses an extra charge counts less than was spent (docs/rate.md says what is promised)."""
    deltas = [delta] if isinstance(delta, int) else list(delta)
    if not any(deltas):
        return
    try:
        head = ",".join(map(str, deltas))
        nodes.run(RATE_ADJUST, list(keys), [token, head, *(w.window_us for w in windows)], nodes=list(on))
    except Exception:
        return


def _restamp(nodes: NodeSet, key: str, rate: Window, token: str, slot: int, times: dict[int, float]) -> Verdict | None:
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


def undo(nodes: NodeSet, key: str | Sequence[str], token: str, on: Any = None) -> None:
    """Uncount the start of ``token`` under ``key`` (or every key of a stacked start) on the nodes ``on`` (default
    all); best effort: a node that misses it keeps one start too many in its log, which only ever delays a later
    start."""
    keys = [key] if isinstance(key, str) else list(key)
    try:
        nodes.run(RATE_UNDO, keys, [token], nodes=list(on) if on is not None else None)
    except Exception:
        return


# -- the feature: its options, its key, its hooks ----------------------------------------------------------------

RATE_HEADER = "singleton_lock_rate_waits"  # how many times this call waited for the window
#: A copy of a call whose body raised SlowDown (kept by its later copies): the pause is the call's own, so over the
#: rate it waits for the window, never skipped or failed for it (``lock_on_rate_limit`` is for calls not yet started).
SLOWED_HEADER = "singleton_lock_slowed"
#: The longest countdown a delivery waiting for its rate's window is re-sent with (a longer wait takes several).
RATE_MAX_COUNTDOWN = 900.0


@dataclass(frozen=True)
class Conf:
    """A task's rate options, read once: its limits (each a window and the arguments sharing it), what an
    over-the-rate delivery does, ``lock_rate_on`` (the plain limits' arguments) and the cost of a start."""

    limits: tuple[Limit, ...]
    on_limit: str
    on: tuple[str, ...]
    cost: int | Callable[..., Any] = 1

    @property
    def plain(self) -> bool:
        """Every limit takes 1 unit of a start (no cost anywhere)."""
        return self.cost == 1 and all(limit.cost is None for limit in self.limits)

    @property
    def ones(self) -> tuple[int, ...]:
        return (1,) * len(self.limits)

    def estimated(self) -> list[int]:
        """The limits whose cost is a function (an estimate ``rate_spent`` corrects), by index."""
        return [i for i, lim in enumerate(self.limits) if callable(self.cost if lim.cost is None else lim.cost)]

    @property
    def rate(self) -> Window:
        """The first limit's window (a task of one limit: its rate)."""
        return self.limits[0].window

    @property
    def stacked(self) -> bool:
        return len(self.limits) > 1

    def __str__(self) -> str:
        return " and ".join(str(limit.window) for limit in self.limits)


@dataclass
class Share:
    """The start a delivery counted (``run.state["rate"]``): its rate key (the first limit's; ``keys``: every
    limit's), when it was counted (Unix s, a counting node's clock), its slot and each holding node's count time,
    the owner token that uncounts it, and the units it holds (its cost, as corrected by ``rate_spent``)."""

    key: str
    at: float | None = None
    slot: tuple[int, dict[int, float]] | None = None
    token: str = ""
    keys: tuple[str, ...] = ()
    windows: tuple[Window, ...] = ()
    units: int = 1
    estimate: int = 1
    slots: tuple[tuple[int, ...], ...] = ()  #: the slots it holds, per limit (before any correction)
    per: tuple[int, ...] = ()  #: the units it holds of each limit (its cost per limit, as corrected by ``rate_spent``)


def units_per_limit(conf: Conf, name: str, args: Any, kwargs: Any) -> tuple[int, ...]:
    """The units a start of a call of task ``name`` with these arguments takes of each limit (its ``Rate(cost=)``,
    else ``lock_rate_cost``; 1 without one; a function is called once per call). A function's answer that is no
    positive number, or more than a limit it is the cost of, fails the call (ConfigurationError)."""
    answers: dict[int, int] = {}
    out: list[int] = []
    for limit in conf.limits:
        cost = conf.cost if limit.cost is None else limit.cost
        if not callable(cost):
            out.append(units_of(cost, f"lock_rate of {name}: cost"))
            continue
        where = (
            f"lock_rate_cost of {name}"
            if limit.cost is None
            else f"lock_rate of {name}: Rate({str(limit.window)!r}, cost=)"
        )
        if id(cost) not in answers:
            answers[id(cost)] = units_of(cost(*args, **kwargs), f"{where} (its answer)")
        units = answers[id(cost)]
        if units > limit.window.limit:
            raise ConfigurationError(
                f"{where} answered {units} units, more than the limit's {limit.window.limit}: it could never start"
            )
        out.append(units)
    return tuple(out)


def _check_costs(name: str, cost: Any, limits: Sequence[Limit], params: Sequence[Any] | None) -> None:
    """``lock_rate_cost`` and each ``Rate(cost=)`` of task ``name``: a constant fits the limits it is the cost of,
    a function can be called with the task's arguments; ConfigurationError in one line."""
    if cost is not None and not callable(cost):
        units = units_of(cost, f"lock_rate_cost of {name}")
        smallest = min((limit.window.limit for limit in limits if limit.cost is None), default=units)
        if units > smallest:
            raise ConfigurationError(
                f"lock_rate_cost of {name} is {units} units, more than the {smallest} of its smallest limit: "
                "no start could ever fit"
            )
    for limit in limits:
        where = f"lock_rate of {name}: Rate({str(limit.window)!r}, cost=)"
        if callable(limit.cost):
            _check_signature(limit.cost, where, params)
        elif limit.cost is not None and units_of(limit.cost, where) > limit.window.limit:
            raise ConfigurationError(
                f"{where} is {units_of(limit.cost, where)} units, more than the limit's {limit.window.limit}: "
                "no start could ever fit"
            )


def keys_of(options: Any, conf: Conf, args: Any, kwargs: Any) -> list[str]:
    """The rate key of each limit of a call with these arguments.

    One limit: ``<prefix>rate:<task or group>:v2:<hash of its arguments>``. Several: each key carries the limit's
    window and a hash tag of the task (or group) name, ``<prefix>rate:{<task or group>}:<seconds>s:v2:<hash>``
    (``<seconds>s:<N>u`` for a limit with a cost of its own, ``Rate(cost=)``),
    so that one call's keys hash to one Redis Cluster slot (they go in one script call) and two limits of one
    task never share a key."""
    prefix = f"{options.settings.prefix}rate:"
    if not conf.stacked:
        return [lock_key(prefix, options.space, options.binder, args, kwargs, unique_on=list(conf.limits[0].on))]
    return [
        lock_key(
            prefix,
            f"{{{options.space}}}:{limit.window.period:g}s"
            + (f":{limit.window.limit}u" if limit.cost is not None else ""),
            options.binder,
            args,
            kwargs,
            unique_on=list(limit.on),
        )
        for limit in conf.limits
    ]


#: The rate windows' scripts (lock/lua): one limit, several stacked, a charge, a pause, a booking and its claim.
SCRIPTS = (
    "rate",
    "rate_undo",
    "rate_restamp",
    "rate_stack",
    "rate_stack_restamp",
    "rate_adjust",
    "rate_pause",
    "rate_book",
    "rate_claim",
)


class RateFeature(Feature):
    """``lock_rate``, ``lock_rate_on``, ``lock_on_rate_limit``, ``lock_rate_cost``: asked after the lock is taken,
    before the body."""

    name: ClassVar[str] = "rate"
    options: ClassVar[tuple[str, ...]] = ("lock_rate", "lock_rate_on", "lock_on_rate_limit", "lock_rate_cost")
    headers: ClassVar[tuple[str, ...]] = (RATE_HEADER, SLOWED_HEADER, BOOKING_HEADER)
    scripts: ClassVar[tuple[str, ...]] = SCRIPTS

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
        cost = getattr(cls, "lock_rate_cost", None)
        if cls.lock_rate is None:
            if on is not None:
                raise ConfigurationError(f"{self.options[1]} of {name} needs a {self.options[0]}")
            if cost is not None:
                raise ConfigurationError(f"{self.options[3]} of {name} needs a {self.options[0]}")
            return
        limits = parse_limits(cls.lock_rate, on or (), f"{self.options[0]} of {name}")
        params = parameters(cls)
        if on:
            check_names(cls, self.options[1], on, params)
        for limit in limits:
            if limit.on and limit.on != tuple(on or ()):
                check_names(cls, f"{self.options[0]} of {name}: Rate(on=...)", limit.on, params)
        _check_costs(name, cost, limits, params)

    def active(self, cls: Any) -> bool:
        return cls.lock_rate is not None

    def resolve(self, task: Any) -> Conf:
        on = tuple(task.lock_rate_on) if task.lock_rate_on is not None else ()
        limits = parse_limits(task.lock_rate, on, f"{self.options[0]} of {task.name}")
        # Read on the class: a function set as an attribute is bound as a method when read on the task.
        cost = getattr(task if isinstance(task, type) else type(task), "lock_rate_cost", None)
        if cost is None:
            units: int | Callable[..., Any] = 1
        elif callable(cost):
            units = cost
        else:
            units = units_of(cost, f"{self.options[3]} of {task.name}")
        return Conf(limits, task.lock_on_rate_limit, on, units)

    def limits_of(self, task: Any) -> tuple[Limit, ...]:
        """A task's limits, parsed (its ``lock_rate`` must be set)."""
        on = tuple(task.lock_rate_on) if task.lock_rate_on is not None else ()
        return parse_limits(task.lock_rate, on, f"{self.options[0]} of {task.name}")

    def key_for(self, ctx: Any, args: Any, kwargs: Any) -> str | None:
        """The rate key of a call with these arguments (its first limit's; None: the task has no rate)."""
        keys = self.keys_for(ctx, args, kwargs)
        return keys[0] if keys else None

    def keys_for(self, ctx: Any, args: Any, kwargs: Any) -> list[str]:
        """The rate key of each limit of a call with these arguments (empty: the task has no rate; :func:`keys_of`)."""
        options = ctx.options
        conf: Conf | None = options.conf.get(self.name)
        return [] if conf is None else keys_of(options, conf, args, kwargs)

    def units(self, ctx: Any, args: Any, kwargs: Any) -> tuple[int, ...]:
        """The units a start of a call with these arguments takes of each limit (:func:`units_per_limit`)."""
        return units_per_limit(ctx.options.conf[self.name], ctx.name, args, kwargs)

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
        rate = conf  # said in messages: every limit
        keys = self.keys_for(ctx, delivery.args, delivery.kwargs)
        key = keys[0]
        try:
            units = conf.ones if conf.plain else self.units(ctx, delivery.args, delivery.kwargs)
        except Exception:
            delivery.give_back()
            delivery.failed()
            raise
        share = Share(key, units=units[0], estimate=units[0], per=units)
        if run.state is None:
            run.state = {}
        run.state[self.name] = share
        nodes = options.settings.nodes
        request = ctx.request
        if len(keys) == 1 and units[0] == 1 and books(conf.on_limit, options.policy, request):
            # A call that waits books its slot (policies/rate_booking.py): served in arrival order, one re-send.
            verdict = decide_for(nodes, key, conf.limits[0].window, request)
        elif len(keys) == 1 and units[0] == 1:
            verdict = take(nodes, key, conf.limits[0].window)  # the hot path: lua/rate.lua, as before stacking
        else:
            windows = tuple(limit.window for limit in conf.limits)
            verdict = take_many(nodes, keys, windows, units)
            share.keys, share.windows = tuple(keys), windows
        if verdict.outcome == "granted":
            share.at, share.slot, share.token = verdict.at, (verdict.slot, verdict.times), verdict.token
            share.slots = verdict.slots or ((verdict.slot,),)
            return True
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
        # skipped or failed for it; it asks again shortly (an eager call cannot wait: it is told). A copy of a call
        # whose body raised SlowDown waits for the window too: the pause is its own (SLOWED_HEADER).
        contended = (verdict.contended or bool(getattr(request, SLOWED_HEADER, None))) and not request.is_eager
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
        headers: dict[str, Any] = {RATE_HEADER: waits + 1}
        if verdict.outcome == "booked":  # re-sent for the moment it owns: a few ms after it, no jitter needed
            countdown = verdict.wait + 0.002
            headers[BOOKING_HEADER] = f"{verdict.slot}:{verdict.token}"
        # A long wait ("5/h") goes in steps: a countdown message waits unacked in a worker, which RabbitMQ's
        # consumer_timeout (30 min by default) and a Redis broker's visibility timeout do not allow for long.
        countdown = min(countdown, RATE_MAX_COUNTDOWN, options.max_countdown or RATE_MAX_COUNTDOWN)
        delivery.wait_out(countdown, "rate", headers, said)
        return False

    def body_skipped(self, delivery: Delivery) -> None:
        """Give back the share :meth:`after_lock` counted for this delivery: its body does not start after all."""
        run = delivery.run
        share = self.share(run)
        if share is not None and share.token:
            undo(delivery.ctx.options.settings.nodes, share.keys or share.key, share.token)
            share.token, share.at, share.slot = "", None, None

    def slowed(self, ctx: Any, run: Any, pause: float, limit: Any) -> tuple[float, dict[str, Any]] | None:
        """A body raised ``SlowDown(pause, limit)``: every start of this call's rate (its limits, or the one named:
        an index in ``lock_rate``, or a notation such as ``"60/m"``) waits ``pause`` s, cluster-wide. The pause is
        written into the rate logs themselves (lua/rate_pause.lua: each log filled until the pause ends), so the
        decision's script and its cost do not change, and a node that holds the pause refuses every start: with a
        majority holding it, no quorum can grant one. Returns the countdown the call is re-sent with (the pause and
        a few ms: its copy asks the rate again, never early) and its copy's header (:data:`SLOWED_HEADER`: the copy
        waits for the window whatever ``lock_on_rate_limit`` says). A start the rate did not count (no quorum,
        ``lock_on_unavailable="run"``: the nodes did not answer) pauses nothing but is re-sent all the same: the API
        said "slow down", and failing the call with it would lose it."""
        countdown = pause + 0.002 + 0.01 * random.random()  # noqa: S311 - jitter
        # Its copy holds no booking: the one this run started on is this start's count (claimed again, it would be
        # two starts on one entry); it asks the window anew ('' is no booking, see rate_booking.parse_booking).
        headers = {SLOWED_HEADER: 1, BOOKING_HEADER: ""}
        answer = min(countdown, RATE_MAX_COUNTDOWN, ctx.options.max_countdown or RATE_MAX_COUNTDOWN), headers
        share = self.share(run)
        if share is None:
            logger.warning("Task %s raised SlowDown in a start its rate did not count: nothing paused", ctx.name)
            return answer
        conf: Conf = ctx.options.conf[self.name]
        keys = list(share.keys or (share.key,))
        limits = list(conf.limits) if conf.stacked else [conf.limits[0]]
        chosen = list(range(len(limits)))
        if limit is not None:
            named = named_limits(limits, limit)
            if named:
                chosen = named
            else:
                logger.warning(
                    "Task %s raised SlowDown(limit=%r), which names no limit of its lock_rate (an index or a "
                    "notation such as '60/m'): every limit pauses",
                    ctx.name,
                    limit,
                )
        micros = round(pause * 1_000_000)
        args: list[str | int] = [secrets.token_hex(16), micros]
        for i in chosen:
            args += [limits[i].window.limit, limits[i].window.window_us]
        nodes = ctx.options.settings.nodes
        try:
            answers = nodes.run(RATE_PAUSE, [keys[i] for i in chosen], args)
        except Exception:  # best effort: the call is re-sent for after the pause all the same
            logger.warning("Task %s: its rate's pause could not be written", ctx.name, exc_info=True)
        else:
            held = sum(1 for a in answers if a is not None and not isinstance(a, BaseException))
            if held < nodes.quorum:  # other calls may start during it; this call's copy still waits its countdown
                logger.warning("Task %s: its rate's pause reached %d lock nodes, fewer than a quorum", ctx.name, held)
        return answer

    def spent(self, ctx: Any, run: Any, units: Any, limit: Any = None) -> int:
        """The body of ``run`` reports what its start really cost (``LockedTask.rate_spent``): each limit corrected
        is corrected by the difference from what it holds of it now, on the nodes that counted it (:func:`adjust`,
        one call per node). The limits corrected: the one ``limit`` names (an index in ``lock_rate``, or a notation
        such as ``"90000/m"``, as ``SlowDown(limit=)``; one naming none: ConfigurationError); without it, those whose
        cost is a function (an estimate), or every limit when none is. Returns the difference applied to the first
        limit corrected (0: nothing to correct, or the start was not counted: no rate, uncounted, undone)."""
        share = self.share(run)
        where = f"rate_spent of {ctx.name}"
        if isinstance(units, bool) or not isinstance(units, int | float) or not math.isfinite(units) or units < 0:
            raise ConfigurationError(f"{where} takes a number of units >= 0, got {units!r}")
        conf: Conf | None = ctx.options.conf.get(self.name)
        if conf is None:
            return 0
        limits = list(conf.limits)
        if limit is None:
            chosen = conf.estimated() or list(range(len(limits)))
        else:
            chosen = named_limits(limits, limit)
            if not chosen:
                raise ConfigurationError(
                    f"{where}: limit={limit!r} names no limit of its lock_rate (an index or a notation such as '60/m')"
                )
        if share is None or not share.token or share.slot is None:
            return 0
        per = list(share.per or (share.units,) * len(limits))
        deltas = {i: math.ceil(units) - per[i] for i in chosen if math.ceil(units) != per[i]}
        if not deltas:
            return 0
        keys = share.keys or (share.key,)
        windows = share.windows or tuple(lim.window for lim in limits)
        at = sorted(deltas)
        changes = [deltas[i] for i in at]
        adjust(
            ctx.options.settings.nodes,
            [keys[i] for i in at],
            [windows[i] for i in at],
            share.token,
            changes,
            share.slot[1],
        )
        for i in at:
            per[i] += deltas[i]
        share.per, share.units = tuple(per), per[0]
        return changes[0]


RATE_FEATURE = RateFeature()
