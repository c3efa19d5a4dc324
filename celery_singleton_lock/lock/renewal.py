"""One watchdog per process: renews every held lock in batches and notices loss.

A prefork child runs one task at a time, but a threads or gevent pool can hold hundreds of locks in one process.
A thread per lock would cost a thread and a round trip per lock per interval; the watchdog instead renews every
lock sharing a set of nodes with one script call per node (``Redlock.nodes_extend``), so the cost per interval is
one round trip per node, however many locks the process holds.

Timeline of a renewal, ``ttl = 30 s`` and the default fraction 1/3::

    t=0    acquire            lease valid until ~29.7 s (ttl - drift)
    t=10   watchdog renews    lease valid until ~39.7 s
    t=20   renew refused      (key gone or our token replaced on too many nodes)
           -> the lock is marked lost at once: flag on the run, ``lock_lost`` signal, a WARNING log
           -> the task finds out at its next ``self.lock_held()`` / ``self.check_lock()``
    t=20   renew unanswered   (too few nodes answered: timeouts, nodes down)
           -> retried every 2.5 s; still no quorum at t=30 -> marked lost as above
    t=39.7 the lease ends by our clock; another worker may now hold the lock

Loss is therefore noticed within one renewal interval of the renewal that failed, and always before the lease's
own end.

The thread starts lazily, on the first lock registered in a process (never in the prefork parent before it forks)
and a process that forks gets a fresh watchdog in the child: the parent's thread does not survive ``fork()``.
It holds the locks it renews and is told about each run's end, so it never outlives what it renews.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import time as mod_time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from . import metrics
from ._heartbeat import write_heartbeat
from .nodes import current_pid

if TYPE_CHECKING:
    from .nodes import NodeSet

__all__ = ["Lease", "Renewable", "Watchdog", "flush_stats", "start_liveness", "watchdog"]

logger = logging.getLogger("celery_singleton_lock.renewal")

BATCH = 200  # leases per script call: keeps one Lua call short on the server
STATS_FLUSH_INTERVAL = 5.0


class Renewable(Protocol):
    """What the watchdog needs of a lock it renews (``Redlock`` is one); this module knows no lock class, so the
    lock (which registers itself here) and its renewal do not import each other."""

    @property
    def name(self) -> str:
        """The lock's name (for the logs)."""
        ...

    @property
    def nodes(self) -> NodeSet:
        """Its nodes: locks whose nodes have equal ``peers`` are renewed together; their counters flushed there."""
        ...

    @property
    def validity(self) -> float:
        """Seconds the lease is still ours by the local clock (0 when not held); no I/O."""
        ...

    @property
    def cancel_by(self) -> str | None:
        """Who asked this lock's job to stop (``lock_on_duplicate="cancel"``), as its last renewal found: the
        renewal's own answer carries it (no round trip of its own); None: nobody."""
        ...

    @staticmethod
    def nodes_extend(locks: Sequence[Any], *, unanswered: set[int] | None = None) -> list[bool | None]:
        """Extend ``locks`` (of this type, on one set of nodes) in one round trip per node: per lock True
        (extended), False (lost) or None (undecided); ``unanswered`` nodes are not asked, failing ones added."""
        ...


@dataclass(eq=False)
class Lease:
    """A held lock under the watchdog's care; ``lost`` turns True (once) when renewal fails."""

    lock: Renewable
    interval: float
    on_lost: Callable[[Lease, str], None] | None = None
    lost: bool = False
    reason: str = ""
    next_renewal: float = field(default=0.0)
    failing_since: float | None = None  # first renewal in a row that got no quorum
    label: tuple[str, str] | None = None  # (prefix, task name): where a failed renewal is counted
    #: Called (once) when a renewal finds the job asked to stop, with who asked; None: the request is not read.
    on_cancel: Callable[[Lease, str], None] | None = None
    cancel_seen: float | None = None  # when a renewal first found the stop asked

    def held(self) -> bool:
        """True while not lost and valid by our clock; no I/O."""
        return not self.lost and self.lock.validity > 0


class Watchdog:
    """Renews registered leases every ``interval`` and flushes per-process counters to Redis."""

    def __init__(self, clock: Callable[[], float] = mod_time.monotonic) -> None:
        self._clock = clock
        self._leases: set[Lease] = set()
        self._mutex = threading.Lock()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._pid = os.getpid()
        self._stats: dict[tuple[NodeSet, str], Counter[tuple[str, str]]] = {}
        self._outbox = metrics.Outbox()  # batches sent until a node confirms them, each added once
        self._next_flush = 0.0
        self._sleeping_until = 0.0  # when the thread next wakes up by itself

    def __len__(self) -> int:
        return len(self._leases)

    def register(
        self,
        lock: Renewable,
        interval: float,
        on_lost: Callable[[Lease, str], None] | None = None,
        label: tuple[str, str] | None = None,
        on_cancel: Callable[[Lease, str], None] | None = None,
    ) -> Lease:
        """Renew ``lock`` every ``interval`` seconds until :meth:`unregister` (or until it is lost); ``label``
        (prefix, task name) counts its failed renewals; ``on_cancel`` is told when its job is asked to stop."""
        lease = Lease(lock, interval, on_lost, next_renewal=self._clock() + interval, label=label, on_cancel=on_cancel)
        with self._mutex:
            self._leases.add(lease)
            self._ensure_thread()
            # Wake the thread only if it would sleep past this lease's first renewal: waking it for every task
            # would cost a thread switch per task on the hot path.
            wake = lease.next_renewal < self._sleeping_until
        if wake:
            self._wake.set()
        return lease

    def _ensure_thread(self) -> None:
        global _flush_at_exit  # noqa: PLW0603 - once per process (a forked child inherits the registration)
        if not _flush_at_exit:
            # A producer (a web app counting its ``joined`` calls) that exits normally flushes its last counts; a
            # pool child exits with os._exit: it flushes on worker_process_shutdown instead.
            _flush_at_exit = True
            atexit.register(_flush_quietly)
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="singleton-lock-watchdog", daemon=True)
            self._thread.start()

    def unregister(self, lease: Lease) -> None:
        with self._mutex:
            self._leases.discard(lease)

    def count(self, nodes: NodeSet, prefix: str, event: str, task: str = "", n: int = 1) -> None:
        """Add ``n`` to a per-process counter of (``task``, ``event``), an outcome of :data:`metrics.OUTCOMES`; the
        watchdog adds them up in Redis every 5 s (see :mod:`celery_singleton_lock.metrics`): no I/O here."""
        with self._mutex:
            counter = self._stats.get((nodes, prefix))
            if counter is None:
                counter = self._stats[(nodes, prefix)] = Counter()
                self._ensure_thread()
            counter[(task, event)] += n

    def count_wait(self, nodes: NodeSet, prefix: str, task: str, seconds: float) -> None:
        """Count a run that took its lock after waiting ``seconds`` (``waited``, and the time waited)."""
        with self._mutex:
            counter = self._stats.get((nodes, prefix))
            if counter is None:
                counter = self._stats[(nodes, prefix)] = Counter()
                self._ensure_thread()
            counter[(task, "waited")] += 1
            counter[(task, metrics.WAITS)] += 1
            counter[(task, metrics.WAIT_MS)] += max(0, int(seconds * 1000))

    def _loop(self) -> None:
        while True:
            try:
                self._tick()
            except Exception:  # the thread must outlive any surprise, or every lock of the process would lapse
                logger.exception("lock watchdog: unexpected error; carrying on")
                self._wake.wait(0.1)

    def _tick(self) -> None:
        """Renew what is due, flush counters when due, then sleep until the next due time (or a wake-up)."""
        now = self._clock()
        with self._mutex:
            leases = list(self._leases)
        due = [lease for lease in leases if lease.next_renewal <= now]
        if due:
            self.renew(due)
        if now >= self._next_flush:
            self.flush_stats()
            self._next_flush = now + STATS_FLUSH_INTERVAL
        with self._mutex:
            self._sleeping_until = min([lease.next_renewal for lease in self._leases] + [self._next_flush])
            self._wake.clear()
            overdue = max([self._clock() - lease.next_renewal for lease in self._leases], default=0.0)
        if _liveness_file is not None:
            self._heartbeat(_liveness_file, len(leases), overdue)
        self._wake.wait(max(self._sleeping_until - self._clock(), 0.01))

    def _heartbeat(self, path: str, leases: int, overdue: float) -> None:
        """Rewrite the liveness file: alive, and due again within one flush interval (the longest sleep)."""
        try:
            write_heartbeat(path, role="worker", due_in=STATS_FLUSH_INTERVAL, leases=leases, overdue=overdue)
        except OSError as exc:
            logger.warning("lock watchdog: cannot write the liveness file: %s", exc)

    def renew(self, leases: list[Lease]) -> None:
        """Renew ``leases`` now: one batched script call per node set (and per BATCH leases)."""
        # By the nodes they talk to, not by NodeSet object: every ``with Redlock(urls, ...)`` builds a NodeSet of its
        # own, and renewed one by one a paused node would cost each of them socket_timeout in turn.
        groups: dict[object, list[Lease]] = {}
        for lease in leases:
            groups.setdefault(lease.lock.nodes.peers, []).append(lease)
        for group in groups.values():
            # A node that did not answer one batch is not asked by the next ones of this renewal: a paused node
            # then costs socket_timeout once per renewal, not once per BATCH leases (which lost every lease of a
            # process holding many, a healthy quorum notwithstanding).
            unanswered: set[int] = set()
            for start in range(0, len(group), BATCH):
                batch = group[start : start + BATCH]
                started = self._clock()
                try:
                    results = type(batch[0].lock).nodes_extend([lease.lock for lease in batch], unanswered=unanswered)
                except Exception as exc:  # undecided, like a timeout: the lease stands until its deadline
                    logger.exception("renewal of %d lock(s) failed", len(batch))
                    results = [None] * len(batch)
                    reason = f"renewal raised {type(exc).__name__}"
                else:
                    reason = "renewal refused: lease expired, key gone, or quorum lost"
                with self._mutex:
                    current = set(self._leases)
                for lease, ok in zip(batch, results, strict=True):
                    if lease not in current:
                        continue  # released (or handed over) while we renewed: not a loss
                    if ok:
                        lease.next_renewal = started + lease.interval
                        lease.failing_since = None
                        if lease.on_cancel is not None and lease.lock.cancel_by is not None:
                            self._asked(lease, lease.lock.cancel_by)
                        continue
                    now = self._clock()
                    if ok is None:
                        # Too few nodes answered (timeouts, nodes down): the lease still stands. Retry every quarter
                        # interval for one interval, so a stall (a fork for BGSAVE, an fsync) does not cost the lock;
                        # then it is lost, still well before the lease itself could end.
                        if lease.failing_since is None:
                            lease.failing_since = now
                        if lease.label is not None:
                            self.count(lease.lock.nodes, lease.label[0], "renew-failed", lease.label[1])
                        validity = lease.lock.validity
                        if now - lease.failing_since < lease.interval and validity > lease.interval / 2:
                            lease.next_renewal = now + min(lease.interval / 4, validity / 4)
                            logger.warning("renewal of lock %s got no quorum; retrying", lease.lock.name)
                            continue
                        reason = "renewal failed: no quorum of nodes answered for one renewal interval"
                    self._lost(lease, reason)

    def _asked(self, lease: Lease, by: str) -> None:
        """A renewal found ``lease``'s job asked to stop by ``by``: tell its run (which stops its body), once. A body
        still running at the next renewal (one interval of grace: C code, a swallowed exception) is no longer
        renewed: its lease ends by itself, and the caller that asked runs then, never beside it (with a greater
        fencing token: a late write of the stopped run is refused by a store that checks them)."""
        if lease.cancel_seen is None:
            lease.cancel_seen = self._clock()
            try:
                lease.on_cancel(lease, by)  # type: ignore[misc]  # checked by the caller
            except Exception:
                logger.exception("cancel callback for %s raised", lease.lock.name)
            return
        self._lost(lease, f"cancelled by {by}, and its body did not stop within one renewal interval: left to expire")

    def _lost(self, lease: Lease, reason: str) -> None:
        self.unregister(lease)
        if lease.lost:
            return
        lease.lost = True
        lease.reason = reason
        if lease.on_lost is not None:
            try:
                lease.on_lost(lease, reason)
            except Exception:
                logger.exception("lock-lost callback for %s raised", lease.lock.name)

    def flush_stats(self) -> None:
        """Send the counters to Redis as one batch (:class:`metrics.Outbox`: added exactly once, retried until a
        node confirms it)."""
        with self._mutex:
            pending = {k: c for k, c in self._stats.items() if c}
            self._stats = {k: Counter() for k in self._stats}
        self._outbox.send(pending)


_watchdog: Watchdog | None = None
_flush_at_exit = False


def _flush_quietly() -> None:
    try:
        flush_stats()
    except Exception:  # never block an exit: the counts are only statistics
        logger.debug("flushing lock counters at exit failed", exc_info=True)


_watchdog_lock = threading.Lock()
#: ``singleton_lock_liveness_file`` once a worker started its liveness (inherited by forked pool children, whose
#: watchdogs write it too once they run).
_liveness_file: str | None = None


def start_liveness(path: str) -> None:
    """Make this process's watchdog (and those of processes forked from it) rewrite ``path`` on every pass, and start
    it now: a worker's main process calls this once its pool has started (see :mod:`celery_singleton_lock.health`)."""
    global _liveness_file  # noqa: PLW0603 - one per process, by design
    _liveness_file = path
    current = watchdog()
    with current._mutex:  # noqa: SLF001
        current._ensure_thread()  # noqa: SLF001
    current._wake.set()  # noqa: SLF001 - write the first heartbeat now


def watchdog() -> Watchdog:
    """This process's watchdog (a new one after ``fork()``: threads do not survive it)."""
    global _watchdog  # noqa: PLW0603 - one per process, by design
    current = _watchdog
    if current is not None and current._pid == current_pid():  # noqa: SLF001
        return current
    with _watchdog_lock:
        if _watchdog is None or _watchdog._pid != current_pid():  # noqa: SLF001
            _watchdog = Watchdog()
        return _watchdog


def flush_stats() -> None:
    """Flush this process's counters now, if it has a watchdog (a pool child about to exit: they would be lost)."""
    current = _watchdog
    if current is not None and current._pid == current_pid():  # noqa: SLF001
        current.flush_stats()
