"""A task's rate options, read once (:class:`Conf`), the start a delivery counted (:class:`Share`), the units a call
takes of each limit and the rate keys of a call: what the feature (policies/rate/feature.py) reads of a task and a call.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from ...errors import ConfigurationError
from ...lock.keys import lock_key
from .window import Limit, Window, check_signature, units_of

__all__ = ["ON_RATE_LIMIT", "Conf", "RateLimitPolicy", "Share", "check_costs", "keys_of", "units_per_limit"]

RateLimitPolicy = Literal["wait", "skip", "fail"]
#: The values of ``lock_on_rate_limit``.
ON_RATE_LIMIT: tuple[RateLimitPolicy, ...] = ("wait", "skip", "fail")


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


def check_costs(name: str, cost: Any, limits: Sequence[Limit], params: Sequence[Any] | None) -> None:
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
            check_signature(limit.cost, where, params)
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
