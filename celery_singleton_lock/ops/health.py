"""Health probes: readiness (a quorum of lock nodes answers) and liveness (this process's watchdog or beat ticks).

Readiness asks every node at once (one no-key script call through the fan-out, bounded by the socket timeout) and
is ready while at least a quorum answers. Liveness cannot be asked of another process over the network, so the
process writes it down: with ``singleton_lock_liveness_file`` set, a worker's lock watchdog (every process of the
worker that has one) and a beat under the singleton scheduler rewrite that file after every pass, atomically
(write, then rename), with when the next write is due at the latest. A probe (``celery locks health --liveness``)
reads the file and fails when that due time has passed by more than a grace period: the writer is stuck or dead.

The file (JSON)::

    {"pid": 4121, "host": "w-1", "role": "worker", "at": 1764300000.1, "due": 1764300005.1, "leases": 3,
     "overdue": 0.0}

``at``: when it was written (wall clock, s); ``due``: the latest time of the next write (a watchdog wakes at least
every :data:`~celery_singleton_lock.renewal.STATS_FLUSH_INTERVAL` s; beat writes after every tick and is due again
after the tick's own sleep); ``leases``: locks the writer renews; ``overdue``: how late its most overdue renewal is
(s). Staleness bound: a live writer is never later than ``due`` plus the time one pass takes (a renewal or a beat
tick: a socket timeout per batch of nodes that do not answer), which the default grace (10 s) covers.

The WSGI routes ``/healthz`` (readiness) and ``/livez`` (the serving process answers) are :func:`route`'s, mounted by
:func:`celery_singleton_lock.web.make_app`.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from ..lock._heartbeat import write_heartbeat
from ..lock.config import LockSettings
from ..lock.inventory import Report, read_keys
from ..lock.nodes import NodeError

__all__ = [
    "DEFAULT_GRACE",
    "Liveness",
    "Readiness",
    "liveness",
    "readiness",
    "route",
    "write_heartbeat",
]

#: Seconds a heartbeat may be later than its own ``due`` before the probe fails.
DEFAULT_GRACE = 10.0


@dataclass(frozen=True)
class Readiness(Report[None]):
    """Which lock nodes answered (``errors``: the others, redacted): ready while at least a quorum did (``ok``)."""

    @property
    def ready(self) -> bool:
        """True while a quorum of the nodes answers."""
        return self.ok

    @property
    def unreachable(self) -> tuple[NodeError, ...]:
        """The nodes that did not answer: redacted addresses and errors."""
        return self.errors

    def line(self) -> str:
        """One line: ready or not, the quorum, and the nodes that did not answer."""
        head = f"{'ready' if self.ready else 'not ready'}: {self.answered} of {self.total} lock node(s) answered"
        head += f" (quorum {self.quorum})"
        if self.unreachable:
            head += "; unreachable: " + "; ".join(str(e) for e in self.unreachable)
        return head

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict."""
        return {
            "probe": "readiness",
            "ok": self.ready,
            "answered": self.answered,
            "total": self.total,
            "quorum": self.quorum,
            "unreachable": [{"node": e.node, "error": e.error} for e in self.unreachable],
        }


def readiness(settings: LockSettings) -> Readiness:
    """Ask every node at once (bounded by the socket timeout) whether it answers."""
    report = read_keys(settings, [])
    return Readiness(None, report.errors, report.total, report.quorum)


@dataclass(frozen=True)
class Liveness:
    """What a liveness file says, judged at ``now``."""

    ok: bool
    reason: str
    path: str
    data: dict[str, Any]

    def line(self) -> str:
        """One line: alive or not, and why."""
        return f"{'alive' if self.ok else 'not alive'}: {self.reason}"

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict."""
        return {"probe": "liveness", "ok": self.ok, "reason": self.reason, "file": self.path, "heartbeat": self.data}


def liveness(path: str, *, grace: float = DEFAULT_GRACE, now: float | None = None) -> Liveness:
    """Judge the heartbeat in ``path``: alive while its ``due`` time has not passed by more than ``grace`` seconds
    and no renewal is more than ``grace`` seconds overdue."""
    now = time.time() if now is None else now
    try:
        with open(path, encoding="utf-8") as source:
            data = json.load(source)
        due, at = float(data["due"]), float(data["at"])
        overdue = float(data.get("overdue", 0.0))
    except FileNotFoundError:
        why = f"no heartbeat file {path} (not written yet, or singleton_lock_liveness_file differs)"
        return Liveness(ok=False, reason=why, path=path, data={})
    except (OSError, ValueError, KeyError, TypeError) as exc:
        why = f"unreadable heartbeat file {path}: {type(exc).__name__}"
        return Liveness(ok=False, reason=why, path=path, data={})
    who = f"{data.get('role', '?')} pid {data.get('pid', '?')}@{data.get('host', '?')}"
    if now > due + grace:
        why = f"{who} last wrote {now - at:.1f}s ago and was due {now - due:.1f}s ago (grace {grace:g}s): stuck or dead"
        return Liveness(ok=False, reason=why, path=path, data=data)
    if overdue > grace:
        why = f"{who}: a lock renewal is {overdue:.1f}s overdue (grace {grace:g}s)"
        return Liveness(ok=False, reason=why, path=path, data=data)
    why = f"{who} wrote {max(0.0, now - at):.1f}s ago, {data.get('leases', 0)} lease(s)"
    return Liveness(ok=True, reason=why, path=path, data=data)


WSGIApp = Callable[[dict[str, Any], Callable[..., Any]], Iterable[bytes]]


def route(path: str, settings: Callable[[], LockSettings]) -> WSGIApp | None:
    """The WSGI handler of ``/healthz`` (200 while a quorum of lock nodes answers, else 503) or ``/livez`` (200: the
    serving process answers), or None for any other path. JSON bodies; GET and HEAD only."""
    if path not in ("/healthz", "/livez"):
        return None

    def health(environ: dict[str, Any], start: Callable[..., Any]) -> Iterable[bytes]:
        if environ.get("REQUEST_METHOD", "GET") not in ("GET", "HEAD"):
            return _answer(start, "405 Method Not Allowed", {"error": "GET only"})
        if path == "/livez":
            return _answer(start, "200 OK", {"probe": "liveness", "ok": True, "pid": os.getpid()})
        found = readiness(settings())
        return _answer(start, "200 OK" if found.ready else "503 Service Unavailable", found.to_json())

    return health


def _answer(start: Callable[..., Any], status: str, body: dict[str, Any]) -> list[bytes]:
    data = json.dumps(body).encode("utf-8")
    start(
        status,
        [
            ("Content-Type", "application/json"),
            ("Content-Length", str(len(data))),
            ("Cache-Control", "no-store"),
            ("X-Content-Type-Options", "nosniff"),
        ],
    )
    return [data]
