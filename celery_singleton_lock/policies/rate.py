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

This module imports nothing of Celery: the delivery (``_delivery``) calls :func:`take` and carries the verdict out.
"""

from __future__ import annotations

import math
import random
import re
import secrets
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from ..errors import ConfigurationError
from ..nodes import NodeSet
from ..scripts import RATE, RATE_RESTAMP, RATE_UNDO

__all__ = ["ON_RATE_LIMIT", "Rate", "RateLimitPolicy", "Verdict", "parse_rate", "take", "undo"]

RateLimitPolicy = Literal["wait", "skip", "fail"]
#: The values of ``lock_on_rate_limit``.
ON_RATE_LIMIT: tuple[RateLimitPolicy, ...] = ("wait", "skip", "fail")

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
