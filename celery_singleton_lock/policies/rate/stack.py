"""Several limits' start, or a start of a cost other than 1 (lua/rate_stack.lua): all or none, a quorum per limit;
and a counted start's cost corrected afterwards (lua/rate_adjust.lua, ``rate_spent``).
"""

from __future__ import annotations

import random
import secrets
import time
from collections import Counter
from collections.abc import Sequence
from typing import Any

from ...lock.nodes import NodeSet
from ...lock.scripts import RATE_ADJUST, RATE_STACK, RATE_STACK_RESTAMP, RATE_UNDO
from .count import SPLIT_ATTEMPTS, moved_now, refusal, undo
from .window import LATE, Verdict, Window

__all__ = ["adjust", "take_many"]


def take_many(nodes: NodeSet, keys: Sequence[str], windows: Sequence[Window], cost: int | Sequence[int] = 1) -> Verdict:
    """Count one start of ``cost`` units (one number for every limit, or one per limit) under every key (one per
    limit, ``windows`` theirs) if every window allows it on a quorum of the nodes, all or none (lua/rate_stack.lua:
    one script call per node with every key, so one round trip; a split costs one more each time, at most
    :data:`SPLIT_ATTEMPTS`).

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
    for attempt in range(SPLIT_ATTEMPTS):
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
        refused = refusal(nodes, errors, waits, len(granted))
        if refused is not None:
            return refused
        if len(frees) == len(nodes) - len(errors):
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
        if attempt + 1 < SPLIT_ATTEMPTS:
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
    """:func:`~.count.restamp` of a start of several limits or units (lua/rate_stack_restamp.lua)."""
    args: list[str | int] = [token, *(w.window_us for w in windows), *(",".join(map(str, s)) for s in slots)]
    moved = moved_now(nodes, RATE_STACK_RESTAMP, keys, args, times)
    if moved is not None:
        return Verdict("granted", token=token, slot=slots[0][0], at=min(moved.values()), times=moved, slots=slots)
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
