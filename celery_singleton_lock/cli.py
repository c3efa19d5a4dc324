"""``celery -A app locks list|show|release|stats``: see and force-release the locks held under an app's prefix.

The logic lives in plain functions taking a :class:`~celery_singleton_lock.config.LockSettings` (scan, merge,
release, stats, formatting), so it is testable without click; the click commands at the bottom only parse options,
print and pick the exit code.

A key's state is merged across the nodes: it is *held* when a quorum of nodes holds it with the same token, and
*partial* when some nodes hold it but no token reaches a quorum (a lock being acquired or released right now, a
failed attempt's leftovers, or a node that lost its data). A node that does not answer is reported by its redacted
address; the others are still shown, and the exit code is 1 when fewer than a quorum answered.
"""

from __future__ import annotations

import datetime as dt
import getpass
import json
import logging
import os
import socket
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, Literal, TypeVar, cast

import click
from celery.bin.base import CeleryCommand, handle_preload_options
from redis.exceptions import RedisError

from .config import LockSettings, settings_for
from .errors import ConfigurationError
from .keys import parse_holder
from .redlock import NodeError, _Script, fence_key_for

__all__ = [
    "LockInfo",
    "NodeRelease",
    "NodeState",
    "Report",
    "format_duration",
    "format_show",
    "format_stats",
    "format_table",
    "list_locks",
    "locks",
    "read_keys",
    "read_stats",
    "release_lock",
    "show_lock",
]

logger = logging.getLogger("celery_singleton_lock.cli")

READ_SCRIPT = """
-- KEYS[2i-1] - lock key i
-- KEYS[2i]   - its fencing counter key
-- returns an array, one {holder token or false, remaining ms (-2 missing, -1 no expiry), counter} per lock key;
--   a key that is not a string (so not a lock) reads as missing
local out = {}
for i = 1, #KEYS / 2 do
  local key, fence = KEYS[2 * i - 1], KEYS[2 * i]
  local holder, ttl, counter = false, -2, 0
  if redis.call('TYPE', key).ok == 'string' then
    holder, ttl = redis.call('GET', key), redis.call('PTTL', key)
  end
  if redis.call('TYPE', fence).ok == 'string' then
    counter = tonumber(redis.call('GET', fence)) or 0
  end
  out[i] = {holder, ttl, counter}
end
return out
"""

FORCE_RELEASE_SCRIPT = """
-- KEYS[1] - lock key
-- ARGV[1] - the holder token read from this node a moment ago
-- returns {RELEASED} when the key still held ARGV[1] and is now deleted;
--         {CHANGED, current holder or false} when it changed in between (a newer holder is left alone)
local holder = redis.call('GET', KEYS[1])
if holder == ARGV[1] then
  redis.call('DEL', KEYS[1])
  return {1}
end
return {0, holder}
"""

RELEASED, CHANGED = 1, 0

_READ = _Script(READ_SCRIPT)
_FORCE_RELEASE = _Script(FORCE_RELEASE_SCRIPT)

#: Keys read per script call: bounds the work a node does in one atomic step.
BATCH = 200
#: The SCAN COUNT hint: keys a node looks at per round trip.
SCAN_COUNT = 1000
#: The counters LockedTask flushes into ``{prefix}stats``, in display order.
STATS_FIELDS = ("acquired", "skipped", "lost", "released", "unavailable")

T = TypeVar("T")


def _text(value: object) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


@dataclass(frozen=True)
class Report(Generic[T]):
    """A result gathered from the nodes, with the nodes that did not answer."""

    value: T
    errors: tuple[NodeError, ...]
    total: int
    quorum: int

    @property
    def answered(self) -> int:
        """How many nodes answered."""
        return self.total - len(self.errors)

    @property
    def ok(self) -> bool:
        """True when at least a quorum of nodes answered (the result can be trusted)."""
        return self.answered >= self.quorum


@dataclass(frozen=True)
class NodeState:
    """One lock key as one node sees it."""

    node: str
    token: str | None  # None: the key is not held on this node
    ttl_ms: int  # remaining lease in ms; -1 no expiry, -2 missing
    fence: int  # the node's fencing counter for the key (0: none)


@dataclass(frozen=True)
class LockInfo:
    """One key merged over the nodes: the token most nodes hold and what it tells about the holder."""

    key: str
    state: Literal["held", "partial"]
    token: str
    nodes: tuple[str, ...]  # the nodes holding ``token``
    total: int  # how many nodes there are
    ttl: float | None  # seconds until fewer than a quorum hold it (partial: until the last one expires); None: never
    fencing_token: int | None  # max counter over the nodes that answered; None when the lock has no counter
    task_name: str | None = None
    task_id: str | None = None
    worker: str | None = None
    acquired_at: float | None = None  # wall clock of the holder's host, seconds since the epoch
    states: tuple[NodeState | None, ...] = field(default=(), repr=False)  # per node; None: did not answer

    def age(self, now: float) -> float | None:
        """Seconds since the holder acquired it (None when the token does not say)."""
        return None if self.acquired_at is None else max(0.0, now - self.acquired_at)

    def to_json(self, now: float) -> dict[str, Any]:
        """A JSON-ready dict (``ttl`` None means the key never expires)."""
        age = self.age(now)
        return {
            "key": self.key,
            "state": self.state,
            "task_name": self.task_name,
            "task_id": self.task_id,
            "worker": self.worker,
            "acquired_at": self.acquired_at,
            "age": None if age is None else round(age, 3),
            "ttl": None if self.ttl is None else round(self.ttl, 3),
            "fencing_token": self.fencing_token,
            "nodes": list(self.nodes),
            "holding": len(self.nodes),
            "total": self.total,
            "token": self.token,
        }


@dataclass(frozen=True)
class NodeRelease:
    """What a forced release did on one node."""

    node: str
    outcome: Literal["released", "not held", "changed", "unread", "error"]
    token: str | None = None  # released: the token deleted; changed: the newer holder left alone
    error: str | None = None

    def __str__(self) -> str:
        if self.outcome == "released":
            return f"{self.node}: released (was {self.token})"
        if self.outcome == "not held":
            return f"{self.node}: not held, nothing to do"
        if self.outcome == "changed":
            holder = f"now held by {self.token}" if self.token else "now free"
            return f"{self.node}: changed since it was read, left alone ({holder})"
        if self.outcome == "unread":
            return f"{self.node}: skipped, it did not answer when the key was read"
        return f"{self.node}: error: {self.error}"


# --- reading the nodes -------------------------------------------------------------------------------------------


def _is_fence_key(key: str) -> bool:
    """True for a fencing counter key (``{K}:fence``, or ``K:fence`` when K carries a hash tag)."""
    if not key.endswith(":fence"):
        return False
    if fence_key_for(key[: -len(":fence")]) == key:
        return True
    return key.startswith("{") and key.endswith("}:fence") and fence_key_for(key[1 : -len("}:fence")]) == key


def _fence_key_of(settings: LockSettings, key: str) -> str:
    """Where a key's fencing counter lives: LockedTask locks share the prefix's counter (so the value shown is an
    upper bound of the holder's token: later acquisitions of other jobs raise it too); beat claims and plain
    Redlocks under the prefix have their own (or none)."""
    if key.startswith(settings.prefix) and not key.startswith(f"{settings.prefix}beat:"):
        return settings.fence_key
    return fence_key_for(key)


def _glob_escape(text: str) -> str:
    """``text`` as a literal in a Redis glob pattern."""
    return "".join("\\" + c if c in "*?[]\\" else c for c in text)


def scan_keys(settings: LockSettings, *, match: str = "*") -> Report[list[str]]:
    """Every string key under the prefix matching ``match`` (a glob on the part after the prefix), on any node.

    SCAN with MATCH and COUNT, node after node (never KEYS: it would block a busy node). Fencing counters and the
    stats hash are left out.
    """
    nodes = settings.nodes
    pattern = _glob_escape(settings.prefix) + match
    stats_key = f"{settings.prefix}stats"
    found: set[str] = set()
    errors: list[NodeError] = []
    for i, client in enumerate(nodes.clients):
        try:
            for raw in client.scan_iter(match=pattern, count=SCAN_COUNT, _type="string"):
                key = _text(raw)
                if key not in (stats_key, settings.fence_key) and not _is_fence_key(key):
                    found.add(key)
        except (RedisError, OSError) as exc:
            errors.append(nodes.error(i, exc))
    return Report(sorted(found), tuple(errors), len(nodes), nodes.quorum)


def read_keys(
    settings: LockSettings, keys: Sequence[str], *, skip: Iterable[int] = ()
) -> Report[dict[str, list[NodeState | None]]]:
    """Each key's state on each node (None for a node that did not answer), read on all nodes at once.

    ``skip`` are node indices known to be down (they are neither asked nor reported again).
    """
    nodes = settings.nodes
    down = set(skip)
    errors: list[NodeError] = []
    states: dict[str, list[NodeState | None]] = {key: [None] * len(nodes) for key in keys}
    for start in range(0, len(keys), BATCH):
        batch = keys[start : start + BATCH]
        flat = [k for key in batch for k in (key, _fence_key_of(settings, key))]
        live = [i for i in range(len(nodes)) if i not in down]
        if not live:
            break
        answers = nodes.run(_READ, flat, (), live)
        for i in live:
            answer = answers[i]
            if isinstance(answer, BaseException):
                errors.append(nodes.error(i, answer))
                down.add(i)
                continue
            for key, (holder, ttl_ms, fence) in zip(batch, answer, strict=True):
                token = None if holder is None else _text(holder)
                states[key][i] = NodeState(nodes.names[i], token, int(ttl_ms), int(fence))
    if not keys:  # still tell the caller which nodes answer
        answers = nodes.run(_READ, (), (), [i for i in range(len(nodes)) if i not in down])
        errors += [nodes.error(i, a) for i, a in enumerate(answers) if isinstance(a, BaseException)]
    return Report(states, tuple(errors), len(nodes), nodes.quorum)


def merge(key: str, states: Sequence[NodeState | None], quorum: int) -> LockInfo | None:
    """The key's merged state, or None when no node holds it.

    The lock's token is the one most nodes hold; its fencing token is the max counter over the nodes that answered.
    """
    held = [s for s in states if s is not None and s.token is not None]
    if not held:
        return None
    token, count = Counter(s.token for s in held).most_common(1)[0]
    assert token is not None
    holding = [s for s in held if s.token == token]
    # PTTL -1 (no expiry) sorts as "forever".
    ttls = sorted((float("inf") if s.ttl_ms == -1 else s.ttl_ms / 1000.0 for s in holding), reverse=True)
    state: Literal["held", "partial"] = "held" if count >= quorum else "partial"
    remaining = ttls[quorum - 1] if state == "held" else ttls[0]
    fences = [s.fence for s in states if s is not None]
    fencing = max(fences) if fences and max(fences) > 0 else None
    holder = parse_holder(token)
    return LockInfo(
        key=key,
        state=state,
        token=token,
        nodes=tuple(s.node for s in holding),
        total=len(states),
        ttl=None if remaining == float("inf") else remaining,
        fencing_token=fencing,
        task_name=holder.task_name if holder else None,
        task_id=holder.task_id if holder else None,
        worker=holder.worker if holder else None,
        acquired_at=holder.acquired_at if holder else None,
        states=tuple(states),
    )


def list_locks(settings: LockSettings, *, match: str = "*") -> Report[list[LockInfo]]:
    """Every lock held (on a quorum, or partially) under the app's prefix, merged across the nodes, by key."""
    scanned = scan_keys(settings, match=match)
    down = [settings.nodes.names.index(e.node) for e in scanned.errors]
    read = read_keys(settings, scanned.value, skip=down)
    infos = [merge(key, states, settings.nodes.quorum) for key, states in read.value.items()]
    return Report(
        [i for i in infos if i is not None], scanned.errors + read.errors, len(settings.nodes), settings.nodes.quorum
    )


def show_lock(settings: LockSettings, key: str) -> Report[tuple[LockInfo | None, list[NodeState | None]]]:
    """One key: its merged state (None when no node holds it) and its state on each node."""
    read = read_keys(settings, [key])
    states = read.value[key]
    return Report((merge(key, states, settings.nodes.quorum), states), read.errors, read.total, read.quorum)


def release_lock(settings: LockSettings, key: str, seen: Sequence[NodeState | None]) -> Report[list[NodeRelease]]:
    """Force-release ``key``: on each node, delete it if it still holds the token ``seen`` there.

    Timeline of why the token is compared, not just deleted: the operator reads the key (holder A), looks at it,
    confirms; meanwhile A's lease expires and B acquires. A plain DEL now would delete B's fresh lock and let a third
    run start beside B; the compare-and-delete finds B's token instead and leaves it alone. The fencing counters are
    never touched, so fencing tokens keep growing.
    """
    nodes = settings.nodes
    out: list[NodeRelease | None] = [None] * len(nodes)
    by_token: dict[str, list[int]] = {}
    for i, state in enumerate(seen):
        if state is None:
            out[i] = NodeRelease(nodes.names[i], "unread")
        elif state.token is None:
            out[i] = NodeRelease(nodes.names[i], "not held")
        else:
            by_token.setdefault(state.token, []).append(i)
    errors: list[NodeError] = []
    for token, indices in by_token.items():
        answers = nodes.run(_FORCE_RELEASE, (key,), (token,), indices)
        for i in indices:
            answer = answers[i]
            if isinstance(answer, BaseException):
                error = nodes.error(i, answer)
                errors.append(error)
                out[i] = NodeRelease(nodes.names[i], "error", error=error.error)
            elif int(answer[0]) == RELEASED:
                out[i] = NodeRelease(nodes.names[i], "released", token=token)
            else:
                now_held = None if answer[1] is None else _text(answer[1])
                out[i] = NodeRelease(nodes.names[i], "changed", token=now_held)
    unread = [NodeError(r.node, "did not answer when the key was read") for r in out if r and r.outcome == "unread"]
    return Report([r for r in out if r is not None], tuple(unread + errors), len(nodes), nodes.quorum)


def read_stats(settings: LockSettings) -> Report[dict[str, int]]:
    """The workers' counters: the ``{prefix}stats`` hash summed over the nodes that answer."""
    nodes = settings.nodes
    totals: Counter[str] = Counter(dict.fromkeys(STATS_FIELDS, 0))
    errors: list[NodeError] = []
    for i, client in enumerate(nodes.clients):
        try:
            fields = cast(Mapping[bytes, bytes], client.hgetall(f"{settings.prefix}stats"))
        except (RedisError, OSError) as exc:
            errors.append(nodes.error(i, exc))
            continue
        for name, value in fields.items():
            totals[_text(name)] += int(value)
    ordered = {name: totals[name] for name in STATS_FIELDS}
    ordered.update({name: totals[name] for name in sorted(totals) if name not in ordered})
    return Report(ordered, tuple(errors), len(nodes), nodes.quorum)


# --- formatting ----------------------------------------------------------------------------------------------------


def format_duration(seconds: float | None, *, none: str = "-") -> str:
    """A short human duration.

    >>> format_duration(4.25), format_duration(75), format_duration(3725), format_duration(None, none="never")
    ('4.2s', '1m15s', '1h02m', 'never')
    """
    if seconds is None:
        return none
    if seconds < 60:
        return f"{seconds:.1f}s"
    whole = int(seconds)
    if whole < 3600:
        return f"{whole // 60}m{whole % 60:02d}s"
    if whole < 86400:
        return f"{whole // 3600}h{whole % 3600 // 60:02d}m"
    return f"{whole // 86400}d{whole % 86400 // 3600:02d}h"


def _columns(rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(row[c]) for row in rows) for c in range(len(rows[0]))]
    return "\n".join("  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)).rstrip() for row in rows)


def format_table(infos: Sequence[LockInfo], now: float) -> str:
    """An aligned table, one lock a row."""
    rows = [("KEY", "TASK", "TASK ID", "WORKER", "AGE", "TTL", "FENCE", "NODES", "STATE")]
    rows += [
        (
            i.key,
            i.task_name or "-",
            i.task_id or "-",
            i.worker or "-",
            format_duration(i.age(now)),
            format_duration(i.ttl, none="never"),
            "-" if i.fencing_token is None else str(i.fencing_token),
            f"{len(i.nodes)}/{i.total}",
            i.state,
        )
        for i in infos
    ]
    return _columns(rows)


def format_show(key: str, info: LockInfo | None, states: Sequence[NodeState | None], quorum: int, now: float) -> str:
    """The merged state of one key, then its state on each node."""
    lines: list[str] = []
    if info is None:
        lines.append(f"{key}: not held on any node that answered")
    else:
        when = "-"
        if info.acquired_at is not None:
            stamp = dt.datetime.fromtimestamp(info.acquired_at, tz=dt.timezone.utc).isoformat(timespec="seconds")
            when = f"{stamp} ({format_duration(info.age(now))} ago)"
        fields = [
            ("key", key),
            ("state", f"{info.state} on {len(info.nodes)}/{info.total} nodes (quorum {quorum})"),
            ("task", info.task_name or "-"),
            ("task id", info.task_id or "-"),
            ("worker", info.worker or "-"),
            ("acquired", when),
            ("ttl", format_duration(info.ttl, none="never")),
            ("fencing token", "-" if info.fencing_token is None else str(info.fencing_token)),
            ("token", info.token),
        ]
        width = max(len(name) for name, _ in fields)
        lines += [f"{name.ljust(width)}  {value}" for name, value in fields]
    lines.append("")
    rows = [("NODE", "HOLDER TOKEN", "TTL", "FENCE")]
    for state in states:
        if state is None:
            continue  # reported as an error line
        if state.token is None:
            rows.append((state.node, "(not held)", "-", str(state.fence)))
        else:
            ttl = None if state.ttl_ms == -1 else state.ttl_ms / 1000.0
            rows.append((state.node, state.token, format_duration(ttl, none="never"), str(state.fence)))
    if len(rows) > 1:
        lines.append(_columns(rows))
    return "\n".join(lines)


def format_stats(totals: Mapping[str, int]) -> str:
    """One counter a line, aligned."""
    width = max(len(name) for name in totals)
    return "\n".join(f"{name.ljust(width)}  {n}" for name, n in totals.items())


# --- the click layer -----------------------------------------------------------------------------------------------

F = TypeVar("F", bound=Callable[..., Any])
_preload = cast(Callable[[F], F], handle_preload_options)


def _settings(ctx: click.Context) -> LockSettings:
    try:
        return settings_for(ctx.obj.app)
    except ConfigurationError as exc:
        raise click.ClickException(str(exc)) from None


def _who() -> str:
    try:
        user = getpass.getuser()
    except (OSError, KeyError, ImportError):  # no login name (a container with an unknown uid)
        user = f"uid {os.getuid()}" if hasattr(os, "getuid") else "unknown"
    return f"{user}@{socket.gethostname()} (pid {os.getpid()})"


def _report_errors(ctx: click.Context, report: Report[Any]) -> None:
    """Print one line per node that did not answer; exit 1 after the output when fewer than a quorum answered."""
    for error in report.errors:
        ctx.obj.error(f"error: node {error.node} did not answer: {error.error}")
    if not report.ok:
        ctx.obj.error(
            f"error: only {report.answered} of {report.total} node(s) answered (quorum {report.quorum}): "
            "the result is incomplete"
        )


def _finish(ctx: click.Context, report: Report[Any]) -> None:
    _report_errors(ctx, report)
    if not report.ok:
        ctx.exit(1)


@click.group(name="locks")
@click.pass_context
@_preload
def locks(ctx: click.Context, /, **kwargs: Any) -> None:
    """Inspect and force-release celery_singleton_lock locks (singleton_lock_* settings of the app)."""


@locks.command(name="list", cls=CeleryCommand)
@click.option("--json", "as_json", is_flag=True, help="Print a JSON list (for scripts).")
@click.option("--match", default="*", show_default=True, help="Glob on the key after the prefix, e.g. 'reports.*'.")
@click.pass_context
def list_command(ctx: click.Context, *, as_json: bool, match: str) -> None:
    """Every lock held under the app's prefix, merged across the nodes."""
    settings = _settings(ctx)
    report = list_locks(settings, match=match)
    now = time.time()
    if as_json:
        ctx.obj.echo(json.dumps([i.to_json(now) for i in report.value], indent=2))
    elif report.value:
        ctx.obj.echo(format_table(report.value, now))
    else:
        ctx.obj.echo(f"no locks held under {settings.prefix!r}")
    _finish(ctx, report)


@locks.command(name="show", cls=CeleryCommand)
@click.argument("key")
@click.option("--json", "as_json", is_flag=True, help="Print JSON (for scripts).")
@click.pass_context
def show_command(ctx: click.Context, key: str, *, as_json: bool) -> None:
    """One KEY's holder and its state on each node."""
    settings = _settings(ctx)
    report = show_lock(settings, key)
    info, states = report.value
    now = time.time()
    if as_json:
        per_node = [
            {"node": s.node, "token": s.token, "ttl_ms": s.ttl_ms, "fence": s.fence} for s in states if s is not None
        ]
        lock = None if info is None else info.to_json(now)
        ctx.obj.echo(json.dumps({"lock": lock, "nodes": per_node}, indent=2))
    else:
        ctx.obj.echo(format_show(key, info, states, settings.nodes.quorum, now))
    _finish(ctx, report)


@locks.command(name="release", cls=CeleryCommand)
@click.argument("key")
@click.option("--yes", "-y", "yes", is_flag=True, help="Do not ask for confirmation.")
@click.pass_context
def release_command(ctx: click.Context, key: str, *, yes: bool) -> None:
    """Force-release KEY on every node (only the holder read now is deleted, never a newer one)."""
    settings = _settings(ctx)
    seen = show_lock(settings, key)
    info, states = seen.value
    if not any(s is not None and s.token is not None for s in states):
        ctx.obj.echo(f"{key}: not held on any node that answered, nothing to release")
        _finish(ctx, seen)
        return
    ctx.obj.echo(format_show(key, info, states, settings.nodes.quorum, time.time()))
    _report_errors(ctx, seen)
    if not yes and not click.confirm(f"\nForce-release {key} on every node?", default=False):
        ctx.obj.echo("aborted: nothing released")
        ctx.exit(1)
    report = release_lock(settings, key, states)
    outcomes = Counter(r.outcome for r in report.value)
    summary = ", ".join(f"{n} {outcome}" for outcome, n in outcomes.items())
    logger.warning("forced release of lock %s by %s: %s", key, _who(), summary)
    for result in report.value:
        ctx.obj.echo(str(result))
    ctx.obj.echo(f"released on {outcomes['released']} of {len(report.value)} node(s)")
    if not report.ok:
        ctx.obj.error(f"error: fewer than a quorum ({report.quorum}) of the nodes answered: the lock may still be held")
        ctx.exit(1)


@locks.command(name="stats", cls=CeleryCommand)
@click.option("--json", "as_json", is_flag=True, help="Print a JSON object (for scripts).")
@click.pass_context
def stats_command(ctx: click.Context, *, as_json: bool) -> None:
    """The workers' lock counters, summed over the nodes (flushed every few seconds)."""
    report = read_stats(_settings(ctx))
    ctx.obj.echo(json.dumps(report.value, indent=2) if as_json else format_stats(report.value))
    _finish(ctx, report)
