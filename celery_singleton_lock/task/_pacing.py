"""The waits between a queue-scope reservation's attempts at enqueue (:func:`._enqueue.reserve` and ``areserve``)."""

from __future__ import annotations

import random
import time

from ..lock.aio import AsyncRedlock
from ..lock.record import SENDING
from ..lock.redlock import Redlock

__all__ = ["ATTEMPTS", "SENDING_WAIT", "Pacing"]

#: Queue scope: how long a duplicate call waits for another call's publish under way before it sends a copy of that
#: call's job (same task id; see reserve).
SENDING_WAIT = 2.0

ATTEMPTS = int(SENDING_WAIT / 0.005) + 2  # every refused attempt pauses >= 5 ms until the deadline
_SPLIT_PAUSE_MAX = 0.4


class Pacing:
    """The waits between a reservation's attempts (one for :func:`reserve` and :func:`areserve`)."""

    def __init__(self, socket_timeout: float) -> None:
        self.splits, self.deadline = 0, time.monotonic() + SENDING_WAIT
        # A contender's partial hold lasts one attempt: its round trips (a socket timeout at most, a node frozen)
        # and its undo, plus a loaded process's delays.
        self.attempt_hold = socket_timeout + 0.5
        self.first_seen: tuple[str, float] | None = None  # (holder, its lease left) when this call first met it

    def next(self, lock: Redlock | AsyncRedlock) -> float | None:
        """Seconds to wait before the next attempt after a refused one, or None: the verdict is due."""
        # With a node not answering, contenders that arrived together and took one node each look alike: refused
        # by another caller on some nodes, granted on the rest, short of a quorum either way (not "split": the
        # refusals alone do not deny the quorum). Sent at once, each sent a job of its own.
        unsure = lock.held_by is not None and not lock.contended and bool(lock.node_errors)
        if unsure and self._standing(lock):
            # ...unless the hold has stood longer than an attempt holds: no contender's, but a record a producer
            # killed mid-attempt left (or a reservation that lost its quorum with a node's data), for up to its
            # whole lease. While it stands beside the nodes not answering, no call can reach a quorum: waiting to
            # the deadline only delayed every call of the key by 2 s. Sent now (the worker's check guards it).
            return None
        if (lock.split or unsure) and time.monotonic() < self.deadline:
            # Contenders that split the nodes try again after a jittered pause that doubles with each split
            # (Redlock's rule), up to the deadline: a split is no outage, and one of them wins within a few
            # rounds. A fixed 5-50 ms window and three tries kept a dozen callers of one process in step on a
            # loaded machine (each attempt slowed by the others), and each then sent a job of its own.
            self.splits += 1
            return random.uniform(0.005, min(_SPLIT_PAUSE_MAX, 0.025 * 2**self.splits))  # noqa: S311 - jitter
        sending = (lock.holder_record or {}).get("state") == SENDING
        if not (lock.contended and sending) or time.monotonic() >= self.deadline:
            return None
        # Another call of the job is publishing right now (a double click): wait the few ms until its message is
        # sent (then this call gets it) or its publish failed (then this call reserves the job itself).
        return 0.005

    def _standing(self, lock: Redlock | AsyncRedlock) -> bool:
        """Whether the holder that refused this attempt stands (its lease ran down since this call first met it for
        longer than an attempt holds) and, while it does, the nodes left could not make a quorum."""
        holder, left = lock.held_by, lock.held_for
        if holder is None or left is None:
            return False
        if self.first_seen is None or self.first_seen[0] != holder:
            self.first_seen = (holder, left)
            return False
        nodes = lock.nodes
        if len(nodes) - len(lock.node_errors) - 1 >= nodes.quorum:  # a quorum stays possible beside it: retried
            return False
        return self.first_seen[1] - left > self.attempt_hold
