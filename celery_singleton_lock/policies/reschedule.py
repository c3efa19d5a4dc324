"""``lock_on_duplicate="reschedule"``: a duplicate waits for the holder and runs after it, once.

It waits in its key's line, and the holder's release wakes the oldest waiter at once; its fallback copy, re-sent for
when the holder's lease would end, runs it if the holder dies (no release) or the line is lost. Chord members of
any task reschedule (a skipped member would fail the chord).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

from .facts import Decision, Facts, defer

if TYPE_CHECKING:
    from . import Duplicate

__all__ = ["Reschedule"]

#: The policies whose holders wake their key's line when they release.
_WAKERS = frozenset({"reschedule", "replace", "cancel"})


class Reschedule:
    name: ClassVar[str] = "reschedule"
    waits_in_line: ClassVar[bool] = True
    replaces: ClassVar[bool] = False
    hands_on: ClassVar[bool] = False
    raises: ClassVar[bool] = False

    def decide(self, f: Facts, remaining: float) -> Decision:
        # The fallback: a dead holder's lease ends within ``remaining`` (a live one's renewals keep it ~ttl away).
        # The holder's release wakes a waiting duplicate before that (the line): no polling.
        wait = remaining
        if f.on_duplicate not in _WAKERS:
            # A chord member of a task whose holders wake no line (skip, fail): nothing wakes it, and a queued
            # holder's lease is its whole queue wait (lock_queue_ttl): look again every renewal interval instead.
            wait = min(remaining, f.interval)
        return defer(f, wait + 0.05 + 0.2 * f.jitter, "duplicate")

    def act(self, duplicate: Duplicate, decision: Decision) -> None:
        if duplicate.woken:
            # Woken, but another job took the lock first: back in the line. The job's fallback copy (sent when
            # it first waited) is still on its way, so nothing is re-sent.
            duplicate.back_in_line()
        else:
            duplicate.wait(decision.countdown)
