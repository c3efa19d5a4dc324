"""What a limit is, and what the nodes said of a start: the rate's pure words, no I/O.

:class:`Window` (N starts in any window of a period), :func:`parse_rate` (``"60/m"``, ``(N, seconds)``), :class:`Rate`
and :class:`Limit` (a limit with its own arguments and cost), :func:`parse_limits` (``lock_rate``'s limits, stacked),
:func:`units_of` (a cost as whole units), :class:`Verdict` (the answer of a decision: policies/rate/count.py,
stack.py and booking.py give it) and :data:`LATE`.
"""

from __future__ import annotations

import inspect
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from ...errors import ConfigurationError

__all__ = [
    "LATE",
    "Limit",
    "Rate",
    "Verdict",
    "Window",
    "check_signature",
    "named_limits",
    "parse_limits",
    "parse_rate",
    "units_of",
]

_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
_NOTATION = re.compile(r"^\s*(\d+)\s*/\s*([smhd])\s*$")
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


def check_signature(fn: Any, where: str, params: Sequence[Any] | None) -> None:
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
