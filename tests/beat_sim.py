"""Simulated beat instances on simulated clocks, for the slot tests (tests/task/test_beat.py,
tests/task/test_beat_dst.py).

Each instance runs celery's own ``is_due`` the way ``SingletonSchedulerMixin`` asks it, and names its due runs with
``slot_for``; a timeline interleaves their ticks, and the first claim of a slot wins, as on Redis.
"""

from __future__ import annotations

import datetime as dt
import heapq
import random
import time
from collections.abc import Callable
from typing import Any

from celery_singleton_lock.task.beat import _before_repeat, slot_for

UTC = dt.timezone.utc


def at(*args: int, micro: int = 0) -> dt.datetime:
    return dt.datetime(*args, microsecond=micro, tzinfo=UTC)


class Instance:
    """One simulated beat instance: its own clock offset, tick latency, last_run_at and start time."""

    def __init__(
        self,
        make: Callable[[Callable[[], dt.datetime]], Any],
        offset: float,
        latency: float,
        stale: float = 0.0,
        start: float = 0.0,
    ) -> None:
        self.clock = at(2000, 1, 1)
        self.schedule = make(lambda: self.clock)
        self.offset, self.latency, self.stale = dt.timedelta(seconds=offset), latency, stale
        self.start = start  #: seconds into the timeline at which it (re)starts
        self.last_run_at: dt.datetime | None = None

    def wake(self, true_now: dt.datetime) -> tuple[str | None, float]:
        """A tick at ``true_now``: the slot it would claim (ISO, or None), and seconds until it wakes again."""
        self.clock = true_now + self.offset
        if self.last_run_at is None:  # a fresh schedule file is due one period from now; a stale one at once
            self.last_run_at = self.clock - dt.timedelta(seconds=self.stale)
        # What SingletonSchedulerMixin.is_due asks celery (last_run_at read from before a repeated hour).
        due, next_s = self.schedule.is_due(_before_repeat(self.schedule, self.last_run_at) or self.last_run_at)
        label = None
        if due:
            label = slot_for(self.schedule, self.last_run_at, now=self.clock).iso
            self.last_run_at = self.clock  # reserve(): last_run_at = now
        return label, max(next_s, 0.001)


def simulate(
    instances: list[Instance], start: dt.datetime, seconds: float, seed: int = 7, max_ticks: int = 20_000
) -> list[str]:
    """Run the instances for ``seconds`` of true time, each waking late by its latency plus up to 5 ms of jitter;
    the labels claimed, in order (a label is claimed once: the first claimer wins, the others are refused).

    Fails past ``max_ticks`` ticks or 30 real seconds: an instance due on every tick would spin here."""
    rng = random.Random(seed)
    end = start + dt.timedelta(seconds=seconds)
    heap = [(start + dt.timedelta(seconds=inst.start + i * 0.137), i) for i, inst in enumerate(instances)]
    claimed: dict[str, int] = {}
    deadline = time.monotonic() + 30
    for _ in range(max_ticks):
        if not heap or heap[0][0] > end:
            return sorted(claimed)
        now, i = heapq.heappop(heap)
        label, next_s = instances[i].wake(now)
        if label is not None:
            claimed.setdefault(label, i)
        late = instances[i].latency + rng.uniform(0, 0.005)
        heapq.heappush(heap, (now + dt.timedelta(seconds=next_s + late), i))
        if time.monotonic() > deadline:
            break
    raise AssertionError(f"simulation stopped at {now:%Y-%m-%dT%H:%M:%S.%fZ} (instance {i}): spinning? {claimed}")
