"""One limit's start (lua/rate.lua): count it if the window allows it on a quorum of the nodes, or say the wait.

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

:func:`restamp` moves a grant whose answers came back late; :func:`undo` uncounts a start (also of several limits:
policies/rate/stack.py, and of a booking: policies/rate/booking.py).
"""

from __future__ import annotations

import random
import secrets
import time
from collections import Counter
from collections.abc import Sequence
from typing import Any

from ...lock.nodes import NodeSet
from ...lock.scripts import RATE, RATE_RESTAMP, RATE_UNDO, Script
from .window import LATE, Verdict, Window

__all__ = ["SPLIT_ATTEMPTS", "moved_now", "refusal", "restamp", "take", "undo"]

#: Attempts of one decision when contenders split the free slots between the nodes.
SPLIT_ATTEMPTS = 3


def take(nodes: NodeSet, key: str, rate: Window) -> Verdict:
    """Count one start under ``key`` if the window allows it on a quorum of the nodes (one round trip; a split of
    the free slots between contenders costs one more each time, at most :data:`SPLIT_ATTEMPTS`)."""
    preferred = ""
    verdict = Verdict("limited", wait=0.0)
    for attempt in range(SPLIT_ATTEMPTS):
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
            restamped = restamp(nodes, key, rate, token, slot, times)
            if restamped is not None:
                return restamped
            # Late again: uncounted. Ask afresh; after the last attempt the nodes are too slow to tell.
            verdict = Verdict("unavailable", errors=[f"the nodes answered later than {LATE:g} s, {attempt + 1} times"])
            continue
        if granted:
            undo(nodes, key, token, granted)
        refused = refusal(nodes, errors, waits, len(granted))
        if refused is not None:
            return refused
        if len(slot_frees) == len(nodes) - len(errors):
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
        if attempt + 1 < SPLIT_ATTEMPTS:
            time.sleep(verdict.wait * random.random())  # noqa: S311 - jitter
    return verdict


def refusal(nodes: NodeSet, errors: list[str], waits: list[float], granted: int) -> Verdict | None:
    """The verdict of an attempt no quorum granted, when it is not a split: ``unavailable`` (fewer than a quorum
    answered: ``errors``) or ``limited`` (refused by too many nodes for a quorum now: the window is full; ``waits``:
    each refusing node's wait). It lets a start in when a quorum of the nodes that answered has room: the ``granted``
    ones (that counted it, undone) have it now, the others when their wait ends (a stacked start: each node said the
    max over its limiting windows). None: enough nodes had room, but the contenders split it."""
    answered = len(nodes) - len(errors)
    if answered < nodes.quorum:
        return Verdict("unavailable", errors=errors)
    if answered - len(waits) < nodes.quorum:
        return Verdict("limited", wait=sorted([0.0] * granted + waits)[nodes.quorum - 1])
    return None


def restamp(nodes: NodeSet, key: str, rate: Window, token: str, slot: int, times: dict[int, float]) -> Verdict | None:
    """A grant whose answers came back later than :data:`LATE`: move its entry to the nodes' time now on the nodes
    that hold it (no waiting for the others), so the slot's next start comes a window after this moment. Counted
    when a quorum moved it within :data:`LATE`; otherwise uncounted (None), and the caller asks again."""
    moved = moved_now(nodes, RATE_RESTAMP, [key], [f"{slot}:{token}", rate.window_us], times)
    if moved is not None:
        return Verdict("granted", token=token, slot=slot, at=min(moved.values()), times=moved)
    undo(nodes, key, token)
    return None


def moved_now(
    nodes: NodeSet, script: Script, keys: list[str], args: list[str | int], times: dict[int, float]
) -> dict[int, float] | None:
    """Run a restamp ``script`` (lua/rate_restamp.lua, rate_stack_restamp.lua) on the nodes of ``times`` (those that
    hold the grant), at most twice: each node that moved it -> its time now (Unix s, its clock), once a quorum moved
    it within :data:`LATE`; None when fewer than a quorum moved it, the call failed, or it was late twice."""
    for _ in range(2):
        began = time.monotonic()
        try:
            answers = nodes.run(script, keys, args, nodes=list(times))
        except Exception:
            return None
        moved = {
            i: int(answers[i][1]) / 1_000_000
            for i in times
            if not isinstance(answers[i], BaseException) and answers[i] and int(answers[i][0]) == 1
        }
        if len(moved) < nodes.quorum:
            return None
        times = moved
        if time.monotonic() - began <= LATE:
            return times
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
