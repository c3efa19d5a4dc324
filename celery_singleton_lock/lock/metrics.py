"""Per-task lock metrics kept in Redis: the outcome vocabulary, how a process's counts are written, how they are read.

Counts are made in the process that decides (a pool child, a threads worker, the worker's main process for a skip
before the pool), added up there in memory (``Watchdog.count``, one dict update: no I/O on the hot path) and written
by that process's watchdog every few seconds, and when a pool child or the worker exits, in one pipeline to the
first lock node that answers. They are read back summed over every node, so prefork children, several workers and
several hosts add up without any per-process files.

Keys, all under the app's prefix (``P``):

=============================== ======= ==============================================================================
key                             type    holds
=============================== ======= ==============================================================================
``P stats``                     hash    outcome -> count, all tasks, since ever (what ``locks stats`` read before)
``P stats:total``               hash    ``task \\x1f outcome`` -> count since ever (Prometheus counters)
``P stats:m:<minute>``          hash    the same, for one minute (``<minute>`` = Unix time // 60), kept ``KEEP`` s
=============================== ======= ==============================================================================

A minute's hash has at most one field per (task, outcome): its size is bounded by the app's task names, and at
most ``KEEP / 60`` of them exist at a time. Time spent waiting in a line is two more fields per task
(``@wait_ms``, ``@waits``): the sum of the waits in ms and their number.

Other rooms count into :data:`OUTCOMES` by name (``LockedTask._count("rate-limited")``): a new outcome is added
here, once, with what it means.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, cast

from redis.exceptions import RedisError, ResponseError

from .nodes import NodeError, NodeSet
from .record import sibling_key
from .scripts import COUNT as _COUNT

__all__ = [
    "KEEP",
    "MARK_TTL",
    "OUTCOMES",
    "WAITS",
    "WAIT_MS",
    "MetricsReport",
    "Outbox",
    "minute_key",
    "parse_since",
    "read_metrics",
    "read_minutes",
    "total_key",
    "write",
]

#: Every outcome counted, with what it means (the order is the display order). Each is counted once per call (per
#: delivery attempt: a retry is a new one), where it is decided, never once per re-sent copy; docs/metrics.md has the
#: table of where each is counted.
OUTCOMES: dict[str, str] = {
    "started": "a body started (under its lock, or with a rate only, or unguarded): once per run",
    "acquired": "a run took its lock",
    "joined": "a call at delay() got an existing job's result and sent nothing (queue scope, lock_enqueue_check)",
    "debounced": "a call at delay() joined a burst already pending (lock_debounce): it runs as the burst's one job",
    "skipped": "a duplicate did not run and will not (lock_on_duplicate='skip', or a full line)",
    "failed-duplicate": "a duplicate failed with DuplicateTaskError (lock_on_duplicate='fail'), at delay() or a worker",
    "deferred": "a call was re-sent to run later (a duplicate waiting, an outage, a split vote): once per call",
    "waited": "a run started after waiting (re-sent or in a line): once per call; its wait is in the wait time",
    "replaced": "a waiting job was superseded by a newer call (lock_on_duplicate='replace')",
    "rate-limited": "a call was held back by its rate (waited, skipped or failed): once per call, not per re-send",
    "slowed": "a body raised SlowDown: its rate paused cluster-wide, the call re-sent for after the pause",
    "cancelled": "a running job was stopped for a newer call of its key (lock_on_duplicate='cancel'): REVOKED",
    "lost": "a lock was lost while its task ran",
    "killed": "a run's pool child died under it (SIGKILL, OOM, hard time limit): counted by the worker's main process",
    "renew-failed": "a renewal got no quorum (retried; 'lost' follows if it never succeeds)",
    "unavailable": "no quorum of lock nodes answered a call's acquire or rate: once per call, not per retry",
    "released": "a run gave its lock up",
}
#: Field suffixes for the time waited in a line: the sum in ms, and how many waits.
WAIT_MS, WAITS = "@wait_ms", "@waits"
#: How long a minute's counts are kept (24 h and two minutes: a full day is always readable).
KEEP = 24 * 3600 + 120
#: Separates the task name from the outcome in a field (a task name may hold any other character).
SEP = "\x1f"


def total_key(prefix: str) -> str:
    """The hash of counts since ever."""
    return f"{prefix}stats:total"


def minute_key(prefix: str, minute: int) -> str:
    """The hash of one minute's counts (``minute`` = Unix time // 60)."""
    return f"{prefix}stats:m:{minute}"


def write(pipe: Any, prefix: str, counts: Mapping[tuple[str, str], int], now: float | None = None) -> None:
    """Queue the commands adding ``counts`` ((task, outcome) -> n) on ``pipe``: the legacy totals hash, the totals
    by task and the current minute's hash (and its expiry)."""
    minute = int((time.time() if now is None else now) // 60)
    bucket = minute_key(prefix, minute)
    for (task, outcome), n in counts.items():
        if not n:
            continue
        if not outcome.startswith("@"):
            pipe.hincrby(f"{prefix}stats", outcome, n)
        pipe.hincrby(total_key(prefix), f"{task}{SEP}{outcome}", n)
        pipe.hincrby(bucket, f"{task}{SEP}{outcome}", n)
    pipe.expire(bucket, KEEP)


logger = logging.getLogger("celery_singleton_lock.metrics")

#: How long a batch's markers live (s): a batch retried within it is added once.
MARK_TTL = KEEP
#: How long a batch is retried at most (s): well inside :data:`MARK_TTL`, after that it is dropped, logged.
GIVE_UP = 12 * 3600
#: Batches kept per (nodes, prefix) at most while their node does not answer (the oldest dropped, logged).
MAX_BATCHES = 1000


@dataclass
class _Batch:
    """Counts flushed together: one id, one minute, and once sent, one node (see :class:`Outbox`)."""

    counts: Counter[tuple[str, str]]
    minute: int
    made: float = field(default_factory=time.monotonic)
    id: str = field(default_factory=lambda: secrets.token_hex(8))
    node: int | None = None  # the node it was sent to (maybe received): retried there only


class Outbox:
    """A process's counts on their way to Redis: each flush a *batch* with an id, added exactly once.

    Timeline of the loss this closes: the watchdog sends a batch's pipeline to a node; the node reads part of it, or
    all of it, and the connection drops (the node paused, restarted, a proxy cut it). Was it added? Sending it again
    could count it twice; not sending it could lose it. So each hash of a batch is added by ``count.lua`` with the
    batch's id, which sets a marker beside that hash (``sibling_key(hash, ":batch:<id>")``, :data:`MARK_TTL` s) in the
    same atomic step: a batch sent again is added where it was not yet, and nowhere twice. A batch sent once (any
    byte of it may have reached the node) is retried on *that* node only, at each flush, until the node answers
    (another node has no marker: the batch would count twice there); a batch not yet sent (every node failed its
    PING) is merged into the next one and may go to any node. Bounded: :data:`MAX_BATCHES` batches per target,
    each retried at most :data:`GIVE_UP` s; a batch dropped is logged with its size.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sending = threading.Lock()
        self._batches: dict[tuple[NodeSet, str], list[_Batch]] = {}

    def pending(self) -> int:
        """Batches not yet known to be added."""
        with self._lock:
            return sum(len(b) for b in self._batches.values())

    def send(self, counts: Mapping[tuple[NodeSet, str], Counter[tuple[str, str]]], now: float | None = None) -> None:
        """Make a batch of each target's ``counts``, then send every batch not yet added (one flush)."""
        minute = int((time.time() if now is None else now) // 60)
        # One flush at a time (the watchdog's thread, a flush at exit, a test's): a batch is never merged into while
        # it is being sent, nor sent twice at once.
        with self._sending:
            with self._lock:
                for target, counter in counts.items():
                    batches = self._batches.setdefault(target, [])
                    unsent = next((b for b in batches if b.node is None and b.minute == minute), None)
                    if unsent is not None:
                        unsent.counts.update(counter)
                    elif counter:
                        batches.append(_Batch(Counter(counter), minute))
                    while len(batches) > MAX_BATCHES:
                        lost = batches.pop(0)
                        logger.warning(
                            "lock metrics: dropped a batch of %d counts (no node took it)", lost.counts.total()
                        )
                work = [(target, list(batches)) for target, batches in self._batches.items()]
            for (nodes, prefix), batches in work:
                for batch in batches:
                    added = self._deliver(nodes, prefix, batch)
                    old = time.monotonic() - batch.made > GIVE_UP
                    if not added and old:
                        logger.warning("lock metrics: gave up a batch of %d counts", batch.counts.total())
                    if added or old:
                        with self._lock:
                            self._batches[(nodes, prefix)].remove(batch)

    def _deliver(self, nodes: NodeSet, prefix: str, batch: _Batch) -> bool:
        """True once every hash of ``batch`` is added on its node (now, or by an earlier attempt)."""
        if batch.node is None:
            for i, client in enumerate(nodes.clients):
                try:
                    client.ping()  # nothing of the batch is sent to a node that does not answer this
                except ResponseError:
                    pass  # it answered (an ACL user without PING: NOPERM)
                except (RedisError, OSError):
                    continue
                batch.node = i
                break
            else:
                return False
        for key, fields, life in _hashes_of(prefix, batch):
            args: list[str | int] = [MARK_TTL, life]
            for name, n in fields.items():
                args += [name, n]
            answer = nodes.run(_COUNT, (key, sibling_key(key, f":batch:{batch.id}")), args, [batch.node])[batch.node]
            if isinstance(answer, BaseException):
                logger.debug("lock metrics: a batch was not confirmed; sent again at the next flush (added once)")
                return False
        return True


def _hashes_of(prefix: str, batch: _Batch) -> list[tuple[str, dict[str, int], int]]:
    """The hashes a batch adds to: (key, field -> increment, the hash's life in s or 0)."""
    legacy: Counter[str] = Counter()
    fields: dict[str, int] = {}
    for (task, outcome), n in batch.counts.items():
        if not n:
            continue
        if not outcome.startswith("@"):
            legacy[outcome] += n
        fields[f"{task}{SEP}{outcome}"] = n
    out = [(f"{prefix}stats", dict(legacy), 0), (total_key(prefix), fields, 0)]
    return [*out, (minute_key(prefix, batch.minute), fields, KEEP)] if fields else []


def parse_since(text: str) -> float:
    """Seconds from ``30s``, ``10m``, ``2h``, ``1d`` (or a plain number of seconds); at most :data:`KEEP`.

    >>> parse_since("10m"), parse_since("2h"), parse_since("45")
    (600.0, 7200.0, 45.0)
    """
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400}
    text = text.strip().lower()
    scale = units.get(text[-1:])
    number = text[:-1] if scale is not None else text
    try:
        seconds = float(number) * (scale or 1)
    except ValueError:
        raise ValueError(f"not a period: {text!r} (say 30s, 10m, 2h or 1d)") from None
    if not seconds > 0:
        raise ValueError(f"not a period: {text!r} (it must be more than 0)")
    return min(seconds, float(KEEP - 120))


@dataclass(frozen=True)
class MetricsReport:
    """Counts per task and outcome, summed over the nodes that answered."""

    tasks: dict[str, dict[str, int]]
    waits: dict[str, tuple[int, int]]  # task -> (ms waited in all, number of waits)
    errors: tuple[NodeError, ...]

    @property
    def total(self) -> dict[str, int]:
        """Counts per outcome over every task."""
        out: Counter[str] = Counter()
        for counts in self.tasks.values():
            out.update(counts)
        return _ordered(out)

    def to_json(self) -> dict[str, Any]:
        """``{"tasks": {task: {outcome: n}}, "total": {outcome: n}}`` (``celery locks stats --json``)."""
        return {"tasks": self.tasks, "total": self.total}


def _ordered(counts: Mapping[str, int]) -> dict[str, int]:
    known = [o for o in OUTCOMES if counts.get(o)]
    return {o: counts[o] for o in known + sorted(k for k in counts if k not in OUTCOMES and counts[k])}


def _text(value: object) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


def _fold(hashes: Iterable[Mapping[Any, Any]]) -> tuple[dict[str, dict[str, int]], dict[str, tuple[int, int]]]:
    counts: dict[str, Counter[str]] = {}
    for fields in hashes:
        for raw, value in fields.items():
            task, _, outcome = _text(raw).rpartition(SEP)
            try:
                n = int(value)
            except ValueError:
                continue
            counts.setdefault(task, Counter())[outcome] += n
    tasks: dict[str, dict[str, int]] = {}
    waits: dict[str, tuple[int, int]] = {}
    for task in sorted(counts):
        c = counts[task]
        if c.get(WAITS):
            waits[task] = (c[WAIT_MS], c[WAITS])
        shown = _ordered({k: v for k, v in c.items() if not k.startswith("@")})
        if shown:
            tasks[task] = shown
    return tasks, waits


def _hashes(
    nodes: NodeSet, keys: list[str], skip: Iterable[int] = ()
) -> tuple[list[Mapping[Any, Any]], list[NodeError]]:
    found: list[Mapping[Any, Any]] = []
    errors: list[NodeError] = []
    down = set(skip)
    for i, client in enumerate(nodes.clients):
        if i in down:
            continue
        try:
            pipe = client.pipeline(transaction=False)
            for key in keys:
                pipe.hgetall(key)
            found.extend(cast(list[Mapping[Any, Any]], pipe.execute()))
        except (RedisError, OSError) as exc:
            errors.append(nodes.error(i, exc))
    return found, errors


def read_metrics(
    nodes: NodeSet, prefix: str, since: float | None = None, now: float | None = None, *, skip: Iterable[int] = ()
) -> MetricsReport:
    """The counts of the last ``since`` seconds (whole minutes, the current one included), or since ever (None);
    the nodes ``skip`` (found down by an earlier read of the same request) are not asked again."""
    if since is None:
        keys = [total_key(prefix)]
    else:
        last = int((time.time() if now is None else now) // 60)
        first = last - max(0, int(-(-since // 60)) - 1)
        keys = [minute_key(prefix, m) for m in range(first, last + 1)]
    found, errors = _hashes(nodes, keys, skip)
    tasks, waits = _fold(found)
    return MetricsReport(tasks, waits, tuple(errors))


def read_minutes(
    nodes: NodeSet, prefix: str, minutes: int = 60, now: float | None = None, *, skip: Iterable[int] = ()
) -> tuple[list[int], dict[str, list[dict[str, int]]], tuple[NodeError, ...]]:
    """Per minute (oldest first), per task: the outcome counts of the last ``minutes`` minutes (for a chart); the
    nodes ``skip`` are not asked."""
    last = int((time.time() if now is None else now) // 60)
    span = list(range(last - minutes + 1, last + 1))
    series: dict[str, list[dict[str, int]]] = {}
    errors: list[NodeError] = []
    per_node: list[list[Mapping[Any, Any]]] = [[{} for _ in span] for _ in nodes.clients]
    down = set(skip)
    for i, client in enumerate(nodes.clients):
        if i in down:
            continue
        try:
            pipe = client.pipeline(transaction=False)
            for m in span:
                pipe.hgetall(minute_key(prefix, m))
            per_node[i] = cast(list[Mapping[Any, Any]], pipe.execute())
        except (RedisError, OSError) as exc:
            errors.append(nodes.error(i, exc))
    for slot in range(len(span)):
        tasks, _ = _fold(node[slot] for node in per_node)
        for task, counts in tasks.items():
            series.setdefault(task, [{} for _ in span])[slot] = counts
    return span, series, tuple(errors)
