"""``/metrics``' gauges (locks held, partial, incomplete and jobs waiting, per task) at a bounded cost per scrape.

A scrape must cost about the same at 100 keys and at 1,000,000, so it never lists the keys: it walks them with
SCAN, at most :data:`SCANS_PER_SCRAPE` SCAN round trips (of ``COUNT`` :data:`SCAN_COUNT`) per scrape, and adds each
batch it finds into per-task counters (``brief.lua`` on every node for the batch: owner, state and name only). The
walk is a *pass*: every node's keys under the prefix, then the lines on the first node. A pass that ends within one
scrape (up to about ``SCANS_PER_SCRAPE * SCAN_COUNT`` keys on a node) gives exact gauges of that moment. A longer
one carries on at the next scrape from the SCAN cursors where this one stopped, and the gauges shown are those of
the last complete pass (:attr:`Gauges.age`: how old they are; ``complete`` False until a first pass ended).

Each key is counted once over the nodes: found while walking node ``i``, it counts only when no node before ``i``
that answered has it (``brief.lua`` asked every node), so a key on every node is counted where it is first found.
Task labels are bounded (:data:`MAX_TASKS`; the others add up under ``task="(other)"``): a flood of foreign keys
with made-up names cannot blow up the exposition.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import redis
from redis.exceptions import RedisError

from ..lock.config import LockSettings
from ..lock.inventory import _glob_escape, _is_fence_key, _is_metrics_key, done_marker_of
from ..lock.nodes import NodeError
from ..lock.record import sibling_key
from ..lock.scripts import BRIEF as _BRIEF

__all__ = ["MAX_TASKS", "SCANS_PER_SCRAPE", "SCAN_COUNT", "Gauges", "lock_of_line", "read_gauges"]

#: SCAN round trips a scrape makes at most (over every node and the lines): the bound on a scrape's work.
SCANS_PER_SCRAPE = 16
#: The SCAN COUNT hint: keys a node looks at per round trip.
SCAN_COUNT = 1000
#: Distinct task labels kept per gauge; more add up under :data:`OTHER`.
MAX_TASKS = 1000
OTHER = "(other)"
#: Keys asked of ``brief.lua`` per script call.
BRIEF_BATCH = 1000


@dataclass
class Gauges:
    """Per task: locks held (a LockedTask run's record on a quorum), records on fewer than a quorum (partial), on a
    quorum but not on every node (incomplete), and jobs waiting in a line."""

    held: Counter[str] = field(default_factory=Counter)
    partial: Counter[str] = field(default_factory=Counter)
    incomplete: Counter[str] = field(default_factory=Counter)
    waiting: Counter[str] = field(default_factory=Counter)
    complete: bool = False  # False: no pass has ended yet (the gauges are empty)
    age: float = 0.0  # seconds since the pass shown began
    scans: int = 0  # SCAN round trips this scrape made
    errors: tuple[NodeError, ...] = ()
    down: tuple[int, ...] = ()  # the nodes this scrape found down (later reads of the scrape skip them)
    labels: set[str] = field(default_factory=set, repr=False)  # the task labels given so far (bounded)


@dataclass
class _Pass:
    """A walk in progress: which phase (node, pattern), its SCAN cursor, the counts so far."""

    phases: list[tuple[int, str, bool]]  # (node index, SCAN pattern, lines?)
    started: float = field(default_factory=time.monotonic)
    phase: int = 0
    cursor: int = 0
    gauges: Gauges = field(default_factory=Gauges)


@dataclass
class _State:
    lock: threading.Lock = field(default_factory=threading.Lock)
    walk: _Pass | None = None
    last: Gauges | None = None
    last_started: float = 0.0


_STATES: dict[tuple[tuple[str, ...], str], _State] = {}
_STATES_LOCK = threading.Lock()


def _text(value: object) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


def _phases(settings: LockSettings) -> list[tuple[int, str, bool]]:
    base = _glob_escape(settings.prefix)
    phases = [(i, base + "*", False) for i in range(len(settings.nodes))]
    phases.append((0, base + "*:waiters", True))
    if "}" not in settings.prefix:  # an untagged lock key's line is {KEY}:waiters
        phases.append((0, "\\{" + base + "*:waiters", True))
    return phases


def _task(settings: LockSettings, name: str, key: str, seen: set[str]) -> str:
    """The label of a record's task: its ``name`` field, or the name in its key; :data:`OTHER` past the cap."""
    if not name:
        rest = key[len(settings.prefix) :] if key.startswith(settings.prefix) else ""
        name, v2, _ = rest.rpartition(":v2:")
        name = name if v2 else ""
    if name in seen or len(seen) < MAX_TASKS:
        seen.add(name)
        return name
    return OTHER


def _records(
    settings: LockSettings, g: Gauges, node: int, keys: Sequence[str], errors: list[NodeError], down: set[int]
) -> None:
    """Count ``keys`` found on node ``node``: each key no earlier node has, merged by owner over every node."""
    nodes = settings.nodes
    shared = {settings.fence_key, f"{settings.prefix}stats"}
    wanted = [
        k
        for k in keys
        if k.startswith(settings.prefix)
        and k not in shared
        and not _is_metrics_key(settings.prefix, k)
        and not _is_fence_key(k)
        and done_marker_of(k) is None
    ]
    if not wanted:
        return
    answers = nodes.run(_BRIEF, wanted, (), [i for i in range(len(nodes)) if i not in down])
    replies: list[list[str] | None] = []
    for i, answer in enumerate(answers):
        if i in down:
            replies.append(None)
        elif isinstance(answer, BaseException):
            errors.append(nodes.error(i, answer))
            down.add(i)  # found down: this scrape asks it nothing more (each ask would wait its timeout)
            replies.append(None)
        else:
            replies.append([_text(x) for x in answer])
    for n, key in enumerate(wanted):
        if any(r is not None and r[n] != "" for r in replies[:node]):
            continue  # counted where it was first found
        records = [r[n].split("\x1f", 2) for r in replies if r is not None and r[n] not in ("", "-")]
        if not records:
            continue  # gone since the scan, or not a holder record
        owner, count = Counter(r[0] for r in records).most_common(1)[0]
        _, state, name = next(r for r in records if r[0] == owner)
        task = _task(settings, name, key, g.labels)
        if count < nodes.quorum:
            g.partial[task] += 1
            continue
        if state:
            g.held[task] += 1
        if count < len(nodes):
            g.incomplete[task] += 1


def lock_of_line(key: str) -> str | None:
    """The lock key whose waiting line ``key`` is, or None."""
    if not key.endswith(":waiters"):
        return None
    head = key[: -len(":waiters")]
    candidates = []
    if head.startswith("{"):
        if head.endswith("}"):
            candidates.append(head[1:-1])
        candidates.append(head[head.find("}") + 1 :])
    candidates.append(head)
    for lock in candidates:
        if lock and sibling_key(lock, ":waiters") == key:
            return lock
    return None


def _lines(settings: LockSettings, g: Gauges, client: Any, keys: Sequence[str]) -> None:
    locks = [(k, lock) for k in keys if (lock := lock_of_line(k)) is not None and lock.startswith(settings.prefix)]
    locks = [(k, lock) for k, lock in locks if sibling_key(lock, ":waiters") == k]
    if not locks:
        return
    pipe = client.pipeline(transaction=False)
    for k, _ in locks:
        pipe.zcard(k)
    for (_, lock), length in zip(locks, pipe.execute(), strict=True):
        if length:
            g.waiting[_task(settings, "", lock, g.labels)] += int(length)


def read_gauges(settings: LockSettings) -> Gauges:
    """The gauges for one scrape: at most :data:`SCANS_PER_SCRAPE` SCAN round trips, continuing the pass the last
    scrape of this process left unfinished (see the module's docstring)."""
    with _STATES_LOCK:
        state = _STATES.setdefault((settings.nodes.names, settings.prefix), _State())
    with state.lock:
        walk = state.walk or _Pass(_phases(settings))
        errors: list[NodeError] = []
        scans = 0
        down: set[int] = set()
        while walk.phase < len(walk.phases) and scans < SCANS_PER_SCRAPE:
            node, pattern, lines = walk.phases[walk.phase]
            client = settings.nodes.clients[node]
            if node in down:
                walk.phase, walk.cursor = walk.phase + 1, 0
                continue
            try:
                if isinstance(client, redis.Redis):
                    cursor, raw = client.scan(walk.cursor, match=pattern, count=SCAN_COUNT)
                else:  # a Redis Cluster: its SCAN keeps a cursor per master; walked whole (not bounded)
                    cursor, raw = 0, list(client.scan_iter(match=pattern, count=SCAN_COUNT))
                scans += 1
                keys = [_text(k) for k in raw]
                if lines:
                    _lines(settings, walk.gauges, client, keys)
                else:
                    for start in range(0, len(keys), BRIEF_BATCH):
                        _records(settings, walk.gauges, node, keys[start : start + BRIEF_BATCH], errors, down)
            except (RedisError, OSError) as exc:
                errors.append(settings.nodes.error(node, exc))
                down.add(node)
                walk.phase, walk.cursor = walk.phase + 1, 0
                continue
            walk.cursor = int(cursor)
            if walk.cursor == 0:
                walk.phase += 1
        if walk.phase >= len(walk.phases):
            state.last, state.last_started, state.walk = walk.gauges, walk.started, None
            state.last.complete = True
        else:
            state.walk = walk
        shown = state.last or Gauges()
        unique = {e.node: e for e in errors}
        return Gauges(
            held=shown.held,
            partial=shown.partial,
            incomplete=shown.incomplete,
            waiting=shown.waiting,
            complete=shown.complete,
            age=time.monotonic() - state.last_started if state.last else 0.0,
            scans=scans,
            errors=tuple(unique.values()),
            down=tuple(sorted(down)),
        )
