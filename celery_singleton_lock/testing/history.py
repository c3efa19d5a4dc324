"""A history checker for lock tests: what lock clients believed, checked against mutual exclusion and fencing.

:class:`History` records what lock clients believed (who held which name when, with which fencing token) and
:func:`check_history` checks it: no two holders of one name at once, fencing tokens growing with the order of
acquisition. :func:`run_lock_client` is such a client (threads, or a subprocess through
:func:`lock_client_main`); :class:`FaultInjector` breaks :class:`~celery_singleton_lock.faults.FaultProxy` proxies
and pauses servers at random meanwhile.

Everything here is test code: bounded loops and daemon threads.
"""

from __future__ import annotations

import contextlib
import json
import random
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from types import TracebackType
from typing import Protocol

from .faults import Direction, FaultProxy

__all__ = [
    "Acquisition",
    "FaultInjector",
    "History",
    "HistoryReport",
    "check_history",
    "lock_client_main",
    "run_lock_client",
]


# -- histories ---------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Acquisition:
    """One successful acquire, as its client saw it; times are ``time.monotonic()`` (system-wide on Linux).

    ``start`` is taken before ``acquire()`` was called, ``acquired`` right after it returned True, and ``end`` is
    when the client stopped believing it held the lock: ``acquired + validity`` moved by each successful
    ``extend()``, cut short by a ``release()`` (the time it was called) or by an ``extend()`` that said the lease
    was lost (the time it returned).
    """

    name: str
    owner: str
    fence: int
    start: float
    acquired: float
    end: float
    client: str = ""
    extends: int = 0
    released: bool = False

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> Acquisition:
        return cls(**json.loads(text))


class History:
    """A thread-safe record of acquisitions and event counts, from many clients."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._items: list[Acquisition] = []
        #: Counts of what the clients did (attempts, failures, extends by outcome, releases).
        self.events: Counter[str] = Counter()

    def add(self, acquisition: Acquisition) -> None:
        with self._lock:
            self._items.append(acquisition)

    def count(self, event: str, n: int = 1) -> None:
        with self._lock:
            self.events[event] += n

    @property
    def acquisitions(self) -> list[Acquisition]:
        with self._lock:
            return list(self._items)

    def merge_json(self, text: str) -> None:
        """Add what :func:`lock_client_main` printed: one JSON document."""
        doc = json.loads(text)
        with self._lock:
            self._items.extend(Acquisition(**a) for a in doc["acquisitions"])
            self.events.update(doc["events"])

    def to_json(self) -> str:
        with self._lock:
            return json.dumps({"acquisitions": [asdict(a) for a in self._items], "events": dict(self.events)})

    def check(self) -> HistoryReport:
        return check_history(self.acquisitions)


@dataclass
class HistoryReport:
    """What :func:`check_history` found."""

    acquisitions: int
    names: int
    overlap_checks: int  # acquisitions compared with every earlier one of their name (by the latest end so far)
    fence_checks: int  # ordered pairs (earlier, later) of one name whose fencing tokens were compared
    violations: list[str]

    @property
    def ok(self) -> bool:
        return not self.violations

    def summary(self) -> str:
        return (
            f"{self.acquisitions} acquisitions of {self.names} names; {self.overlap_checks} overlap checks, "
            f"{self.fence_checks} fencing-order pairs; {len(self.violations)} violations"
        )

    def assert_ok(self) -> None:
        if self.violations:
            shown = "\n  ".join(self.violations[:20])
            raise AssertionError(f"{self.summary()}:\n  {shown}")


def _show(a: Acquisition, origin: float) -> str:
    return (
        f"[{a.client} owner={a.owner[-12:]} fence={a.fence} start={a.start - origin:.3f} "
        f"acquired={a.acquired - origin:.3f} end={a.end - origin:.3f} extends={a.extends} released={a.released}]"
    )


def check_history(acquisitions: Iterable[Acquisition]) -> HistoryReport:
    """Check that no two acquisitions of one name were believed held at once, and that fencing tokens grow.

    Overlap: the intervals ``[acquired, end)`` of one name must be disjoint. Each acquisition is compared with the
    one of greatest ``end`` among those acquired before it, which finds every overlapping pair's later member.

    Fencing: sorted by ``acquired`` (completion), each token must be greater than every earlier one. With disjoint
    intervals this is the order in which the lock was held, and the recorded times are inside the true ones
    (``acquired`` read after ``acquire()`` returned, ``end`` no later than the client's belief), so the recorded
    order is the true one. It implies the weaker claims: an acquisition that *started* after another one
    completed, or after its validity ended, has a greater token. (Holds while no node loses its counters.)
    """
    groups: dict[str, list[Acquisition]] = {}
    for a in acquisitions:
        groups.setdefault(a.name, []).append(a)
    violations: list[str] = []
    overlap_checks = fence_checks = total = 0
    for name, items in sorted(groups.items()):
        items.sort(key=lambda a: (a.acquired, a.end))
        total += len(items)
        origin = items[0].start
        latest: Acquisition | None = None  # the acquisition with the greatest end so far
        top: Acquisition | None = None  # the one with the greatest fencing token so far
        for i, b in enumerate(items):
            if latest is not None:
                overlap_checks += 1
                if b.acquired < latest.end:
                    # One owner token twice: the lock let a holder in again (re-entrant), or a token was reused.
                    same = " (one owner token)" if b.owner == latest.owner else ""
                    violations.append(
                        f"{name}: two holders at once{same} for {latest.end - b.acquired:.3f} s: "
                        f"{_show(latest, origin)} and {_show(b, origin)}"
                    )
            if top is not None:
                fence_checks += i
                if b.fence <= top.fence:
                    violations.append(
                        f"{name}: fencing token did not grow: {_show(b, origin)} completed after {_show(top, origin)}"
                    )
            if latest is None or b.end > latest.end:
                latest = b
            if top is None or b.fence > top.fence:
                top = b
    return HistoryReport(total, len(groups), overlap_checks, fence_checks, violations)


# -- lock clients and fault injection ---------------------------------------------------------------------------------


def run_lock_client(
    urls: Sequence[str],
    names: Sequence[str],
    history: History,
    *,
    seconds: float,
    client: str,
    seed: int,
    label: str | None = None,
    ttl: tuple[float, float] = (0.3, 0.9),
    socket_timeout: float = 0.2,
    max_iterations: int = 100_000,
) -> None:
    """Take, extend, release and abandon locks on ``names`` for ``seconds``, recording each acquisition.

    One Redlock instance per name is kept and reused (as a worker would), with ``label`` as its caller token.
    Acquires are blocking (bounded) or not at random; a holder extends at random moments (the way the renewal
    watchdog would), sometimes lets the lease run out, and mostly releases.
    """
    from ..lock.redlock import Redlock  # noqa: PLC0415 - keeps ``testing`` importable without the lock module

    rng = random.Random(seed)  # noqa: S311 - reproducible test schedules, not secrets
    deadline = time.monotonic() + seconds
    locks: dict[tuple[str, float], Redlock] = {}
    ttls = [round(rng.uniform(*ttl), 2) for _ in range(3)]
    for _ in range(max_iterations):
        now = time.monotonic()
        if now >= deadline:
            break
        name = rng.choice(list(names))
        lease = rng.choice(ttls)
        lock = locks.get((name, lease))
        if lock is None:
            lock = locks[name, lease] = Redlock(list(urls), name, ttl=lease, token=label, socket_timeout=socket_timeout)
        blocking = rng.random() < 0.5
        history.count("attempts")
        start = time.monotonic()
        if blocking:
            ok = lock.acquire(blocking=True, timeout=min(rng.uniform(0.05, 1.0), max(0.0, deadline - start)))
        else:
            ok = lock.acquire(blocking=False)
        if not ok:
            # Held by someone else (a quorum said so), or not enough nodes answered in time.
            history.count("refused" if lock.contended else "unavailable")
            time.sleep(rng.uniform(0.0, 0.05))
            continue
        acquired = time.monotonic()
        end = acquired + lock.validity
        owner, fence = lock.token or "", lock.fencing_token
        extends = 0
        released = False
        # Mostly short critical sections; some outlive the ttl and need renewals.
        hold_until = acquired + lease * (rng.uniform(0.0, 0.15) if rng.random() < 0.85 else rng.uniform(0.5, 1.5))
        for _step in range(1000):
            now = time.monotonic()
            if now >= end:
                history.count("expired")  # the lease ran out by our clock: we stopped believing at ``end``
                break
            if now >= hold_until:
                if rng.random() < 0.9:
                    end = min(end, time.monotonic())
                    lock.release()
                    released = True
                    history.count("released")
                else:
                    history.count("abandoned")  # a crash: believed held until ``end``
                break
            time.sleep(max(0.001, min(hold_until, now + rng.uniform(0.15, 0.6) * lease) - now))
            if time.monotonic() >= min(hold_until, end) or rng.random() < 0.2:
                continue  # sometimes a renewal is late or skipped
            if lock.extend():
                end = time.monotonic() + lock.validity
                extends += 1
                history.count("extended")
            elif lock.validity > 0:
                history.count("extend_undecided")  # too few answers: the lease stands until its deadline
            else:
                end = min(end, time.monotonic())  # lost: believed held until extend() said otherwise
                history.count("extend_lost")
                break
        history.add(Acquisition(name, owner, fence, start, acquired, end, client, extends, released))


def lock_client_main(argv: Sequence[str] | None = None) -> None:
    """Run :func:`run_lock_client` from a JSON document of its keyword arguments (``argv[0]``); print the history.

    For a client in another process: ``python -c "import sys; from celery_singleton_lock.history import
    lock_client_main; lock_client_main(sys.argv[1:])" '{"urls": [...], ...}'``.
    """
    args = json.loads((sys.argv[1:] if argv is None else list(argv))[0])
    history = History()
    if "ttl" in args:
        args["ttl"] = tuple(args["ttl"])
    run_lock_client(history=history, **args)
    sys.stdout.write(history.to_json() + "\n")
    sys.stdout.flush()


class Pausable(Protocol):
    """A server that can be frozen and thawed (``RedisServer``: SIGSTOP, SIGCONT)."""

    def pause(self) -> None: ...
    def resume(self) -> None: ...


class FaultInjector:
    """Random faults on proxies and pauses of servers, from a daemon thread, until :meth:`stop`.

    Each step picks a fault (delay, timed hold, drop, cut, pause) and a node, sets it, and schedules its end.
    At most ``max_faulty`` nodes are held, dropped or paused at a time (default: a minority), so the lock stays
    available; latency and cuts may hit any node. ``stop()`` ends every fault, resumes every server and heals
    every proxy, even when the thread failed (its exception is raised then).
    """

    KINDS: tuple[str, ...] = ("delay", "hold", "drop", "cut", "pause")

    def __init__(
        self,
        proxies: Sequence[FaultProxy],
        servers: Sequence[Pausable] = (),
        *,
        seed: int,
        interval: tuple[float, float] = (0.1, 0.3),
        max_faulty: int | None = None,
        kinds: Sequence[str] | None = None,
        max_steps: int = 100_000,
    ) -> None:
        self.proxies = list(proxies)
        self.servers = list(servers)
        self.rng = random.Random(seed)  # noqa: S311 - reproducible test schedules, not secrets
        self.interval = interval
        self.max_faulty = len(self.proxies) // 2 if max_faulty is None else max_faulty
        self.kinds = tuple(kinds or self.KINDS)
        if "pause" in self.kinds and len(self.servers) != len(self.proxies):
            raise ValueError("pause needs the servers, one per proxy, in the same order")
        self.max_steps = max_steps
        #: Faults injected, by kind.
        self.counts: Counter[str] = Counter()
        self._lock = threading.Lock()
        self._undo: list[tuple[float, int | None, Callable[[], None]]] = []  # (when, node it blocks, undo)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def start(self) -> FaultInjector:
        self._thread = threading.Thread(target=self._run, name="FaultInjector", daemon=True)
        self._thread.start()
        return self

    def __enter__(self) -> FaultInjector:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    def summary(self) -> str:
        return ", ".join(f"{kind} {self.counts[kind]}" for kind in self.kinds) + f" (total {self.counts.total()})"

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
        with self._lock:
            pending, self._undo = self._undo, []
        for _when, _node, undo in pending:
            with contextlib.suppress(Exception):
                undo()
        for proxy in self.proxies:
            with contextlib.suppress(Exception):
                proxy.heal()
        if self._error is not None:
            raise RuntimeError(f"FaultInjector failed: {self._error!r}") from self._error

    def _run(self) -> None:
        try:
            for _ in range(self.max_steps):
                if self._stop.wait(self.rng.uniform(*self.interval)):
                    return
                now = time.monotonic()
                with self._lock:
                    due = [u for u in self._undo if u[0] <= now]
                    self._undo = [u for u in self._undo if u[0] > now]
                for _when, _node, undo in due:
                    undo()
                self._step(now)
        except BaseException as exc:  # pragma: no cover - reported by stop()
            self._error = exc

    def _later(self, seconds: float, node: int | None, undo: Callable[[], None]) -> None:
        with self._lock:
            self._undo.append((time.monotonic() + seconds, node, undo))

    def _step(self, now: float) -> None:
        rng = self.rng
        kind = rng.choice(self.kinds)
        node = rng.randrange(len(self.proxies))
        proxy = self.proxies[node]
        if kind in ("hold", "drop", "pause"):
            with self._lock:
                busy = {n for _w, n, _u in self._undo if n is not None}
            if node not in busy and len(busy) >= self.max_faulty:
                kind = "delay"  # a majority must stay reachable: fall back to latency
        if kind == "delay":
            # Mostly latency a round trip survives; now and then more than the clients' socket timeout.
            seconds = rng.uniform(0.005, 0.05) if rng.random() < 0.9 else rng.uniform(0.1, 0.3)
            fault = proxy.delay(seconds, jitter=rng.uniform(0.0, 0.02))
            self._later(rng.uniform(0.1, 0.5), None, fault.stop)
        elif kind == "hold":
            held: list[Direction] = ["upstream", "upstream", "both"]
            fault = proxy.hold(rng.uniform(0.2, 0.9), direction=rng.choice(held))
            self._later(rng.uniform(0.05, 0.4), node, fault.stop)
        elif kind == "drop":
            dropped: list[Direction] = ["upstream", "downstream", "both"]
            fault = proxy.drop(direction=rng.choice(dropped))
            self._later(rng.uniform(0.05, 0.3), node, fault.stop)
        elif kind == "cut":
            open_now = proxy.open_connections()
            if open_now and rng.random() < 0.5:
                proxy.cut(rng.choice(open_now), reset=rng.random() < 0.3)
            else:
                proxy.cut("all", reset=rng.random() < 0.3)
        elif kind == "pause":
            server = self.servers[node]
            server.pause()
            self._later(rng.uniform(0.1, 0.7), node, server.resume)
        self.counts[kind] += 1
