"""Booked slots: a call over its rate (``lock_on_rate_limit="wait"``) books the moment it will start, in the same
atomic script that refused it, and is re-sent once for that moment (docs/rate.md, "Waiting: booked slots").

:func:`book` is the decision of a call that holds no booking (lua/rate_book.lua): each node takes the slot of the
key's log free soonest, at max(now, the moment its last entry leaves the window), after every earlier booking; the
start is counted now, or booked for that later moment. As for a start (policies/rate/count.py), a booking counts when a
majority of the nodes gave it the same slot; its moment is the latest the majority named (each node's own clock:
the wait is the nodes' ``moment - now``, no worker clock is read). :func:`claim` is the booked call's decision when
it arrives (lua/rate_claim.lua): on time on a quorum, it starts on its booking without competing; early (or its
slot's predecessor started late and still covers the moment), it is re-sent for the moment (never run early); late
past :data:`~.window.LATE` but within a window, it starts now and its entry moves to now
(the slot's next start waits a window from it); a window late, or a booking a quorum no longer holds (a node
restarted empty and one more lost it), it books anew (a late entry stays counted: wasted, never shared).

Only a task of one limit and cost 1 books (the hot path of lua/rate.lua); stacked limits and costs keep
:func:`~celery_singleton_lock.policies.rate.stack.take_many` and its re-sends for the first free moment.
"""

from __future__ import annotations

import random
import secrets
import time
from collections import Counter
from typing import Any

from ...lock.nodes import NodeSet
from ...lock.scripts import RATE_BOOK, RATE_CLAIM, RATE_UNDO
from .count import restamp, undo
from .window import LATE, Verdict, Window

__all__ = ["BOOKING_HEADER", "SHORT", "book", "books", "claim", "decide", "decide_for", "parse_booking"]

#: The header of a booked call's re-sent copy: ``<slot>:<owner token>``, its entry in the rate log.
BOOKING_HEADER = "singleton_lock_rate_booking"
#: Attempts of one booking when contenders split the slots between the nodes.
_SPLIT_ATTEMPTS = 5
#: A booked moment at most this many seconds away is waited for in the worker instead of by a re-send.
SHORT = 0.2


def parse_booking(value: Any) -> tuple[int, str] | None:
    """The slot and token of a booking header (None: none, or not one)."""
    if not isinstance(value, str) or ":" not in value:
        return None
    slot, _, token = value.partition(":")
    if not slot.isdigit() or not token:
        return None
    return int(slot), token


def books(on_limit: str, policy: Any, request: Any) -> bool:
    """Whether a call of a one-limit, cost-1 rate books: one that waits (not an eager one, which cannot), and not
    with ``replace``: a newer call supersedes a waiting one, whose booking would stay in the log, wasted (a window
    more for the newest, per call superseded)."""
    return on_limit == "wait" and not request.is_eager and not policy.replaces


def decide_for(nodes: NodeSet, key: str, rate: Window, request: Any) -> Verdict:
    """:func:`decide` for a delivery: its booking header, and whether the broker redelivered it (not re-sent by us)."""
    redelivered = bool((request.delivery_info or {}).get("redelivered"))
    return decide(nodes, key, rate, getattr(request, BOOKING_HEADER, None), redelivered=redelivered)


def decide(nodes: NodeSet, key: str, rate: Window, booking: Any, *, redelivered: bool = False) -> Verdict:
    """The decision of a call that waits: its booking's :func:`claim` if it carries one (header value ``booking``),
    then (none, lost, or a window late) a :func:`book`. A moment at most :data:`SHORT` s away is waited for here
    (at most 3 times), not by a re-send. A copy the broker ``redelivered`` (a worker killed or shut down holding
    it) keeps its booking only while early: after the moment, the copy before it may have started on it (its
    entry is that start's count), so it books anew and the entry stays."""
    held = parse_booking(booking)
    verdict = claim(nodes, key, rate, held[1], held[0], early_only=redelivered) if held is not None else None
    if verdict is None:
        verdict = book(nodes, key, rate)
    for _ in range(3):
        if verdict.outcome != "booked" or verdict.wait > SHORT:
            break
        time.sleep(verdict.wait + 0.002)
        verdict = claim(nodes, key, rate, verdict.token, verdict.slot) or book(nodes, key, rate)
    return verdict


def book(nodes: NodeSet, key: str, rate: Window) -> Verdict:
    """Count a start now or book its slot's moment, on a quorum of the nodes (one round trip; one more when the
    majority's moments differ by more than :data:`~.window.LATE`: booked again, every
    node at the latest of them; a split of the slots between contenders costs one more each time, at most
    :data:`_SPLIT_ATTEMPTS`). ``granted``: start now; ``booked``: re-send for ``wait`` s with the booking (``slot``,
    ``token``); ``unavailable``: no quorum answered; ``limited`` (contended): the slots kept splitting, ask again
    shortly (today's path)."""
    preferred, after = "", 0.0
    for attempt in range(_SPLIT_ATTEMPTS):
        token = secrets.token_hex(16)
        began = time.monotonic()
        answers = nodes.run(
            RATE_BOOK,
            [key],
            [token, rate.limit, rate.window_us, preferred, round(after * 1_000_000)],
            undo_on_timeout=(RATE_UNDO, [key], [token]),
        )
        slots: dict[int, int] = {}
        delays: dict[int, float] = {}
        moments: dict[int, float] = {}
        errors: list[str] = []
        for i, answer in enumerate(answers):
            if isinstance(answer, BaseException):
                errors.append(str(nodes.error(i, answer)))
                continue
            slots[i] = int(answer[1])
            delays[i] = max(0, int(answer[2]) - int(answer[3])) / 1_000_000
            moments[i] = int(answer[2]) / 1_000_000
        slot, count = Counter(slots.values()).most_common(1)[0] if slots else (-1, 0)
        holders = [i for i, s in slots.items() if s == slot]
        if count >= nodes.quorum and max(delays[i] for i in holders) - min(delays[i] for i in holders) <= LATE:
            strays = [i for i, s in slots.items() if s != slot]
            if strays:
                undo(nodes, key, token, strays)
            # The latest moment of the majority: on every node that holds it, the slot is its own by then.
            wait = max(delays[i] for i in holders)
            times = {i: moments[i] for i in holders}
            if wait <= 0 and time.monotonic() - began <= LATE:
                return Verdict("granted", token=token, slot=slot, at=min(times.values()), times=times)
            if wait <= 0:  # counted now, but the answers came back late: moved to now on the nodes that hold it
                late = restamp(nodes, key, rate, token, slot, times)
                if late is not None:
                    return late
                continue
            return Verdict("booked", wait=wait, token=token, slot=slot, times=times)
        if slots:
            undo(nodes, key, token, list(slots))
        if len(nodes) - len(errors) < nodes.quorum:
            return Verdict("unavailable", errors=errors)
        preferred = str(slot)
        # The majority named different moments (a node that missed or kept a start the others did not), or the nodes
        # split the slots (contenders booking at once, in another order on each node): book again, every node at the
        # latest moment named, by its own clock, taking the most named slot if it is free by then, so that the
        # nodes' chains stay in step.
        after = max(delays.values(), default=0.0)
        if count < nodes.quorum and attempt + 1 < _SPLIT_ATTEMPTS:
            time.sleep(0.005 * random.random())  # noqa: S311 - jitter
    return Verdict("limited", wait=0.005 + 0.045 * random.random(), contended=True)  # noqa: S311 - jitter


def claim(nodes: NodeSet, key: str, rate: Window, token: str, slot: int, *, early_only: bool = False) -> Verdict | None:
    """A booked call arrives: ``granted`` on a quorum that finds it on time (or moved it to now); ``booked`` again
    with the wait when it is early there (or covered); ``unavailable`` without a quorum's answers; None when its
    booking is lost, or a window late: book anew (the late entry stays counted). ``early_only``: None, the entry
    left as it is, where it would start (a redelivered copy: its entry may count a start already made)."""
    member = f"{slot}:{token}"
    late_us = round(LATE * 1_000_000)
    move = ""  # first ask only; once a quorum said it may start, again moving the entries where it starts
    on = list(range(len(nodes)))  # then only the nodes that said so (a frozen one would make every answer late)
    for _ in range(3):
        began = time.monotonic()
        answers = nodes.run(RATE_CLAIM, [key], [member, rate.window_us, late_us, move, rate.limit], nodes=on)
        ok: dict[int, float] = {}
        early: list[float] = []
        errors: list[str] = []
        moves = False
        for i in on:
            answer = answers[i]
            if isinstance(answer, BaseException):
                errors.append(str(nodes.error(i, answer)))
            elif int(answer[0]) == 1:
                ok[i] = int(answer[1]) / 1_000_000
                moves = moves or int(answer[3]) == 1
            elif int(answer[0]) == 2:
                early.append(int(answer[1]) / 1_000_000)
        if len(ok) >= nodes.quorum and early_only:
            return None  # its moment came: perhaps started on by the copy before it; the entry stays counted
        if len(ok) >= nodes.quorum:
            if not moves and time.monotonic() - began <= LATE:
                return Verdict("granted", token=token, slot=slot, at=min(ok.values()), times=ok)
            move, on = "1", list(ok)
            continue  # moved now (or the answers came back late: asked again, late now: moved to now)
        if early and len(ok) + len(early) >= nodes.quorum:
            return Verdict("booked", wait=max(early), token=token, slot=slot, times=ok)
        if len(nodes) - len(errors) < nodes.quorum:
            return Verdict("unavailable", errors=errors)
        break
    # Not started on it (gone from a majority, a window late, or answered late twice): uncounted everywhere (an
    # entry removed never brings two of a slot closer), and the call books anew.
    undo(nodes, key, token, list(range(len(nodes))))
    return None
