"""Reading an app's locks from the nodes: scan (SCAN in batches, never KEYS), read, merge by owner, force-release.

Plain functions taking a :class:`~celery_singleton_lock.config.LockSettings`, shared by ``celery locks`` (its click
commands and formatting live in :mod:`celery_singleton_lock.cli`) and the web page (:mod:`celery_singleton_lock.web`).
A lock key holds a *holder record* (a Redis hash: ``owner``, ``fence`` and the fields its holder wrote, see
:class:`~celery_singleton_lock.redlock.Redlock`). A key's records are merged across the nodes by their ``owner``:
the lock is *held* when a quorum of nodes holds a record of the same owner, and *partial* when some nodes hold one
but no owner reaches a quorum. A key under the prefix that is not a holder record is *foreign*: listed, never
released. Done markers are not locks: listed only on request.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, Literal, TypeVar, cast

from redis.exceptions import RedisError

from .config import LockSettings
from .metrics import minute_key, total_key
from .nodes import NodeError
from .record import (
    COOLDOWN,
    ENDING,
    HANDOVER,
    RUNNING,
    burst_key_for,
    cancels_key_for,
    done_key_for,
    fence_key_for,
    sibling_key,
)
from .scripts import FORCE_RELEASE as _FORCE_RELEASE
from .scripts import READ as _READ

__all__ = [
    "BATCH",
    "KINDS",
    "SCAN_COUNT",
    "STATES",
    "LockInfo",
    "NodeRelease",
    "NodeState",
    "RateWindow",
    "Report",
    "done_marker_of",
    "format_duration",
    "holder_label",
    "list_locks",
    "merge",
    "read_keys",
    "read_rate",
    "read_stats",
    "release_lock",
    "scan_keys",
    "show_lock",
]

logger = logging.getLogger("celery_singleton_lock.cli")

#: force_release.lua's first element (lua/force_release.lua).
RELEASED, CHANGED = 1, 0

#: Keys read per script call: bounds the work a node does in one atomic step.
BATCH = 200
#: The SCAN COUNT hint: keys a node looks at per round trip.
SCAN_COUNT = 1000
#: A hash with more fields than this is not read (a holder record has about ten).
MAX_RECORD_FIELDS = 64
#: The counters LockedTask flushes into ``{prefix}stats``, in display order.
STATS_FIELDS = ("acquired", "skipped", "lost", "released", "unavailable")

#: What wrote a key: a LockedTask run (its record has a ``state``), a beat claim (``{prefix}beat:...``), a plain
#: Redlock (any other holder record), a done marker (``--done``), a ``lock_rate``'s sliding log
#: (``{prefix}rate:...``, a sorted set), a pending debounced burst, or something else (not a holder record).
KINDS = ("task", "beat", "lock", "done", "rate", "foreign", "debounce")
#: The record's ``state`` field -> the state shown (a held LockedTask lock).
_TASK_STATES = {RUNNING: "running", HANDOVER: "retry-wait", ENDING: "ending", COOLDOWN: "cooldown"}
#: Every state shown, with what it means.
STATES: dict[str, str] = {
    "running": "a LockedTask run holds it",
    "retry-wait": "handed over to the task's own retry (self.retry()), kept until that retry is delivered",
    "ending": "the run was killed by a hard time limit: the lock ends within about a second",
    "cooldown": "the run finished; the lock is kept for the task's lock_cooldown",
    "queued": "reserved at delay() (lock_scope='queue'): its message is sent and waits for a worker",
    "sending": "reserved at delay() (lock_scope='queue'): its message is being published",
    "handed": "a run stopped for a newer call (lock_on_duplicate='cancel') handed it to the newest waiting call, "
    "kept until that call takes it over",
    "held": "a plain Redlock or a beat claim holds it",
    "partial": "some nodes hold it, but no owner has a quorum",
    "foreign": "not a holder record of celery_singleton_lock",
    "done": "this task id finished: a done marker, not a lock",
    "rate": "a lock_rate's sliding log: the starts counted in the window, not a lock (never released)",
    "pending": "a debounced burst (lock_debounce): its job runs when the burst has been quiet, with its last call's "
    "arguments",
}
#: Characters of a pending burst's arguments shown (the JSON output has them whole).
ARGS_SHOWN = 120

T = TypeVar("T")


def _text(value: object) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


def _record(flat: Sequence[Any]) -> dict[str, str]:
    """A holder record from HGETALL's flat field/value reply (undecodable bytes replaced, never an error)."""
    return {_text(flat[i]): _text(flat[i + 1]) for i in range(0, len(flat) - 1, 2)}


def _int(value: str | None) -> int | None:
    try:
        return None if value is None else int(value)
    except ValueError:
        return None


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
    """One key as one node sees it."""

    node: str
    redis_type: str  # the key's Redis type there: 'hash', 'string', ...; 'none' when it is missing
    record: Mapping[str, str]  # the holder record ({} when the key is not one: missing, or foreign)
    ttl_ms: int  # remaining ms; -1 no expiry, -2 missing

    @property
    def owner(self) -> str | None:
        """The record's owner token; None when the key holds no holder record on this node."""
        return self.record.get("owner")

    @property
    def fence(self) -> int:
        """The record's own fencing token (0: none, or no record)."""
        return _int(self.record.get("fence")) or 0

    @property
    def present(self) -> bool:
        """True when the key exists on this node (a record or anything else)."""
        return self.redis_type != "none"

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict."""
        return {
            "node": self.node,
            "type": self.redis_type,
            "owner": self.owner,
            "fence": self.fence or None,
            "ttl_ms": self.ttl_ms,
            "record": dict(self.record),
        }


@dataclass(frozen=True)
class LockInfo:
    """One key merged over the nodes: the holder record most nodes hold (by owner) and what it says."""

    key: str
    kind: Literal["task", "beat", "lock", "done", "rate", "foreign", "debounce"]
    state: str  # one of STATES
    owner: str | None  # the merged owner token (None: done marker, foreign key)
    nodes: tuple[str, ...]  # the nodes holding that owner's record (done, foreign: the nodes having the key)
    total: int  # how many nodes there are
    ttl: float | None  # seconds until fewer than a quorum hold it (partial, done, foreign: until the last copy ends)
    fencing_token: int | None  # the holder's own token: the records' max ``fence`` over ``nodes``; None: no fencing
    task_name: str | None = None
    task_id: str | None = None
    worker: str | None = None
    acquired_at: float | None = None  # the record's ``at``: wall clock of the holder's host, s since the epoch
    waiting: bool = False  # a redelivered copy of the same task id waits for this holder
    redis_type: str = "hash"  # the key's Redis type (the most common one for a foreign key)
    lock_key: str | None = None  # the lock a done marker belongs to; the key itself otherwise
    record: Mapping[str, str] = field(default_factory=dict)  # the merged owner's record as stored on a node
    states: tuple[NodeState | None, ...] = field(default=(), repr=False)  # per node; None: did not answer

    def age(self, now: float) -> float | None:
        """Seconds since the holder acquired it (None when its record does not say)."""
        return None if self.acquired_at is None else max(0.0, now - self.acquired_at)

    def to_json(self, now: float) -> dict[str, Any]:
        """A JSON-ready dict (``ttl`` None means the key never expires)."""
        age = self.age(now)
        return {
            "key": self.key,
            "kind": self.kind,
            "state": self.state,
            "task_name": self.task_name,
            "task_id": self.task_id,
            "worker": self.worker,
            "acquired_at": self.acquired_at,
            "age": None if age is None else round(age, 3),
            "ttl": None if self.ttl is None else round(self.ttl, 3),
            "fencing_token": self.fencing_token,
            "waiting": self.waiting,
            "nodes": list(self.nodes),
            "holding": len(self.nodes),
            "total": self.total,
            "owner": self.owner,
            "lock_key": self.lock_key,
            "type": self.redis_type,
            "record": dict(self.record),
        }


@dataclass(frozen=True)
class NodeRelease:
    """What a forced release did on one node."""

    node: str
    outcome: Literal["released", "not held", "foreign", "changed", "unread", "error"]
    owner: str | None = None  # released: the owner deleted; changed: the newer owner left alone
    error: str | None = None
    redis_type: str | None = None  # foreign, changed: what the key is there

    def __str__(self) -> str:
        if self.outcome == "released":
            return f"{self.node}: released (was owner {self.owner})"
        if self.outcome == "not held":
            return f"{self.node}: not held, nothing to do"
        if self.outcome == "foreign":
            return f"{self.node}: a Redis {self.redis_type}, not a holder record: left alone"
        if self.outcome == "changed":
            if self.owner:
                now = f"now owned by {self.owner}"
            elif self.redis_type in (None, "none"):
                now = "now free"
            else:
                now = f"now a Redis {self.redis_type}, not a holder record"
            return f"{self.node}: changed since it was read, left alone ({now})"
        if self.outcome == "unread":
            return f"{self.node}: skipped, it did not answer when the key was read"
        return f"{self.node}: error: {self.error}"


# --- reading the nodes -------------------------------------------------------------------------------------------


def _has_tag(key: str) -> bool:
    """True when ``key`` carries a Redis Cluster hash tag (a non-empty ``{...}``, first ``{`` and first ``}``)."""
    start = key.find("{")
    return start != -1 and key.find("}", start + 1) > start + 1


def _is_fence_key(key: str) -> bool:
    """True for a fencing counter key (``{K}:fence``, or ``K:fence`` when K carries a hash tag)."""
    if not key.endswith(":fence"):
        return False
    if fence_key_for(key[: -len(":fence")]) == key:
        return True
    return key.startswith("{") and key.endswith("}:fence") and fence_key_for(key[1 : -len("}:fence")]) == key


def done_marker_of(key: str) -> tuple[str, str] | None:
    """``(lock key, task id)`` when ``key`` is named as a done marker (``done_key_for(lock key, task id)``).

    >>> done_marker_of("{p:reports.rebuild:ab12}:done:task-7")
    ('p:reports.rebuild:ab12', 'task-7')
    >>> done_marker_of("p:reports.rebuild:ab12") is None
    True
    """
    at = key.find(":done:")
    while at != -1:
        head, job = key[:at], key[at + len(":done:") :]
        candidates = []
        if head.startswith("{"):
            if head.endswith("}"):
                candidates.append(head[1:-1])  # an untagged lock key: {KEY}:done:ID
            candidates.append(head[head.find("}") + 1 :])  # an untagged one with a '}': {n}KEY:done:ID
        # A tagged one: KEY:done:ID. Last: "{KEY}" and "KEY" have the same marker, and the untagged key is the
        # one a prefix makes (a lock key that is all hash tag is rare).
        candidates.append(head)
        for lock in candidates:
            if lock and job and done_key_for(lock, job) == key:
                return lock, job
        at = key.find(":done:", at + 1)
    return None


def _is_metrics_key(prefix: str, key: str) -> bool:
    """A hash of the workers' counts (see :mod:`celery_singleton_lock.metrics`), not a lock."""
    # (Under a prefix with a hash tag the flush's batch markers are named under it too: "P stats:batch:<id>".)
    return key == total_key(prefix) or key.startswith(
        (minute_key(prefix, 0)[:-1], f"{prefix}stats:batch:", f"{total_key(prefix)}:batch:")
    )


def _glob_escape(text: str) -> str:
    """``text`` as a literal in a Redis glob pattern."""
    return "".join("\\" + c if c in "*?[]\\" else c for c in text)


def _patterns(settings: LockSettings, match: str, *, done: bool) -> list[str]:
    """The SCAN patterns: the prefix, and with ``done`` also where the done markers of those keys live."""
    base = _glob_escape(settings.prefix) + match
    patterns = [base]
    if done:
        if not match.endswith("*"):  # a tagged key's marker is KEY:done:ID (else already matched by ``base``)
            patterns.append(base + ":done:*")
        if not _has_tag(settings.prefix):  # an untagged key's marker is {KEY}:done:ID (or {n}KEY:done:ID)
            patterns.append("\\{*" + base + "*:done:*")
    return patterns


def scan_keys(settings: LockSettings, *, match: str = "*", done: bool = False) -> Report[list[str]]:
    """Every key under the prefix matching ``match`` (a glob on the part after the prefix), on any node.

    SCAN with MATCH and COUNT, node after node (never KEYS: it would block a busy node). Fencing counters and the
    stats hash are left out, and done markers too unless ``done`` (their own SCAN: under an untagged prefix they
    are named ``{KEY}:done:ID``, outside the prefix).
    """
    nodes = settings.nodes
    stats_key = f"{settings.prefix}stats"
    found: set[str] = set()
    errors: list[NodeError] = []
    patterns = _patterns(settings, match, done=done)
    for i, client in enumerate(nodes.clients):
        try:
            for pattern in patterns:
                for raw in client.scan_iter(match=pattern, count=SCAN_COUNT):
                    key = _text(raw)
                    if (
                        key in (stats_key, settings.fence_key, cancels_key_for(settings.prefix))
                        or _is_metrics_key(settings.prefix, key)
                        or _is_fence_key(key)
                    ):
                        continue
                    marker = done_marker_of(key)
                    if marker is not None and (not done or not marker[0].startswith(settings.prefix)):
                        continue  # (a "{*P*:done:*" match can be another app's: "{xa:t:v2:..}:done:1" for P "a:")
                    found.add(key)
        except (RedisError, OSError) as exc:
            errors.append(nodes.error(i, exc))
    return Report(sorted(found), tuple(errors), len(nodes), nodes.quorum)


def read_keys(
    settings: LockSettings, keys: Sequence[str], *, skip: Iterable[int] = ()
) -> Report[dict[str, list[NodeState | None]]]:
    """Each key's state on each node (None for a node that did not answer): one script call per node per batch.

    ``skip`` are node indices known to be down (they are neither asked nor reported again).
    """
    nodes = settings.nodes
    down = set(skip)
    errors: list[NodeError] = []
    states: dict[str, list[NodeState | None]] = {key: [None] * len(nodes) for key in keys}
    for start in range(0, len(keys), BATCH):
        batch = keys[start : start + BATCH]
        live = [i for i in range(len(nodes)) if i not in down]
        if not live:
            break
        answers = nodes.run(_READ, batch, (MAX_RECORD_FIELDS,), live)
        for i in live:
            answer = answers[i]
            if isinstance(answer, BaseException):
                errors.append(nodes.error(i, answer))
                down.add(i)
                continue
            for key, (redis_type, flat, ttl_ms) in zip(batch, answer, strict=True):
                states[key][i] = NodeState(nodes.names[i], _text(redis_type), _record(flat), int(ttl_ms))
    if not keys:  # still tell the caller which nodes answer
        answers = nodes.run(_READ, (), (MAX_RECORD_FIELDS,), [i for i in range(len(nodes)) if i not in down])
        errors += [nodes.error(i, a) for i, a in enumerate(answers) if isinstance(a, BaseException)]
    return Report(states, tuple(errors), len(nodes), nodes.quorum)


def _seconds(ttl_ms: int) -> float:
    return float("inf") if ttl_ms == -1 else ttl_ms / 1000.0


def merge(key: str, states: Sequence[NodeState | None], quorum: int, *, prefix: str | None = None) -> LockInfo | None:
    """The key's merged state, or None when no node that answered has it.

    Records are grouped by ``owner``: the lock's holder is the owner most nodes hold, and its fencing token is the
    max ``fence`` over the records of that owner. A key of a done marker's name holding no record is a done marker;
    any other key holding no record is foreign.
    """
    answered = [s for s in states if s is not None]
    records = [s for s in answered if s.owner is not None]
    if not records:
        present = [s for s in answered if s.present]
        if not present:
            return None
        longest = max(_seconds(s.ttl_ms) for s in present)
        marker = done_marker_of(key)
        is_done = marker is not None and all(s.redis_type == "string" for s in present)
        is_rate = (
            not is_done
            and prefix is not None
            and key.startswith(f"{prefix}rate:")
            and all(s.redis_type == "zset" for s in present)
        )
        bare: Literal["done", "rate", "foreign"] = "done" if is_done else "rate" if is_rate else "foreign"
        return LockInfo(
            key=key,
            kind=bare,
            state=bare,
            owner=None,
            nodes=tuple(s.node for s in present),
            total=len(states),
            ttl=None if longest == float("inf") else longest,
            fencing_token=None,
            task_id=marker[1] if is_done and marker else None,
            redis_type=Counter(s.redis_type for s in present).most_common(1)[0][0],
            lock_key=marker[0] if is_done and marker else key,
            states=tuple(states),
        )
    owner, count = Counter(s.owner for s in records).most_common(1)[0]
    holding = [s for s in records if s.owner == owner]
    # PTTL -1 (no expiry) sorts as "forever".
    ttls = sorted((_seconds(s.ttl_ms) for s in holding), reverse=True)
    held = count >= quorum
    remaining = ttls[quorum - 1] if held else ttls[0]
    fence = max(s.fence for s in holding)
    record = max(holding, key=lambda s: s.fence).record
    kind: Literal["task", "beat", "lock"]
    if "state" in record:
        kind = "task"
    elif prefix is not None and key.startswith(f"{prefix}beat:"):
        kind = "beat"
    else:
        kind = "lock"
    state = "partial"
    if held:
        state = _TASK_STATES.get(record["state"], record["state"]) if kind == "task" else "held"
    at = _int(record.get("at"))
    return LockInfo(
        key=key,
        kind=kind,
        state=state,
        owner=owner,
        nodes=tuple(s.node for s in holding),
        total=len(states),
        ttl=None if remaining == float("inf") else remaining,
        fencing_token=fence or None,
        task_name=record.get("name"),
        task_id=record.get("job"),
        worker=record.get("worker"),
        acquired_at=None if at is None else at / 1000.0,
        waiting=any(s.record.get("waiting") == "1" for s in holding),
        lock_key=key,
        record=record,
        states=tuple(states),
    )


def list_locks(settings: LockSettings, *, match: str = "*", done: bool = False) -> Report[list[LockInfo]]:
    """Every key under the app's prefix (locks held on a quorum or partially, foreign keys), merged, by key.

    With ``done``, the done markers of those keys are listed too (kind ``done``).
    """
    scanned = scan_keys(settings, match=match, done=done)
    down = [settings.nodes.names.index(e.node) for e in scanned.errors]
    read = read_keys(settings, scanned.value, skip=down)
    quorum = settings.nodes.quorum
    merged = [merge(key, states, quorum, prefix=settings.prefix) for key, states in read.value.items()]
    infos = [i for i in merged if i is not None and not i.key.endswith(":debounce")]
    bursts = scan_bursts(settings, match, skip=down + [settings.nodes.names.index(e.node) for e in read.errors])
    infos += [b for b in (read_burst(settings, lock) for lock in bursts.value) if b is not None]
    infos.sort(key=lambda i: (i.lock_key or i.key, i.kind))
    return Report(infos, scanned.errors + read.errors + bursts.errors, len(settings.nodes), settings.nodes.quorum)


def scan_bursts(settings: LockSettings, match: str = "*", *, skip: Iterable[int] = ()) -> Report[list[str]]:
    """The lock keys (under the prefix, matching ``match``) that have a pending debounced burst on some node
    (``skip``: node indices known to be down, neither asked nor reported again)."""
    nodes = settings.nodes
    base = _glob_escape(settings.prefix) + match
    pattern = base + ":debounce" if _has_tag(settings.prefix) else "\\{" + base + "\\}:debounce"
    found: set[str] = set()
    errors: list[NodeError] = []
    down = set(skip)
    for i, client in enumerate(nodes.clients):
        if i in down:
            continue
        try:
            for raw in client.scan_iter(match=pattern, count=SCAN_COUNT):
                name = _text(raw).removesuffix(":debounce")
                lock = name if _has_tag(settings.prefix) else name[1:-1]
                if lock.startswith(settings.prefix) and burst_key_for(lock) == _text(raw):
                    found.add(lock)
        except (RedisError, OSError) as exc:
            errors.append(nodes.error(i, exc))
    return Report(sorted(found), tuple(errors), len(nodes), nodes.quorum)


def read_burst(settings: LockSettings, key: str) -> LockInfo | None:
    """Lock ``key``'s pending debounced burst, merged over the nodes (the job a quorum agrees on; else the job most
    nodes have, as ``partial``), or None when no node that answered has one. ``ttl``: seconds until it is due."""
    nodes = settings.nodes
    burst = burst_key_for(key)
    seen: list[tuple[str, dict[str, str]]] = []
    for i, client in enumerate(nodes.clients):
        try:
            pipe = client.pipeline(transaction=False)
            pipe.hgetall(burst)
            pipe.time()
            fields, (sec, usec) = pipe.execute()
        except (RedisError, OSError):
            continue
        record = {_text(k): _text(v) for k, v in (fields or {}).items()}
        if record.get("job"):
            record["_due_in"] = str((int(record.get("due", "0")) - (int(sec) * 1000 + int(usec) // 1000)) / 1000.0)
            seen.append((nodes.names[i], record))
    if not seen:
        return None
    job, count = Counter(r["job"] for _, r in seen).most_common(1)[0]
    holding = [(n, r) for n, r in seen if r["job"] == job]
    record = max((r for _, r in holding), key=lambda r: int(r.get("seq", "0") or 0))
    at = _int(record.get("at"))
    return LockInfo(
        key=burst,
        kind="debounce",
        state="pending" if count >= nodes.quorum else "partial",
        owner=None,
        nodes=tuple(n for n, _ in holding),
        total=len(nodes),
        ttl=max(0.0, float(record.pop("_due_in"))),
        fencing_token=None,
        task_name=record.get("name"),
        task_id=job,
        acquired_at=None if at is None else at / 1000.0,
        lock_key=key,
        record=record,
    )


def line_of(settings: LockSettings, key: str) -> int | None:
    """How many jobs wait in lock ``key``'s line (on its first node); None when that node does not answer."""
    try:
        return int(settings.nodes.clients[0].zcard(sibling_key(key, ":waiters")))
    except (RedisError, OSError):
        return None


@dataclass(frozen=True)
class RateWindow:
    """One node's sliding log of a ``lock_rate`` key: the starts counted in the last window, by that node's clock."""

    node: str
    starts: tuple[float, ...]  # seconds ago each counted start began, newest first
    frees_in: float  # seconds until one more start fits on this node (0: now)


def read_rate(settings: LockSettings, key: str, limit: int, period: float) -> Report[list[RateWindow | None]]:
    """Rate ``key``'s log on each node (None: did not answer): the starts of the last ``period`` seconds and when
    one more of ``limit`` fits there. Read only (ZRANGE and TIME), never trimmed: that is rate.lua's job."""
    nodes = settings.nodes
    out: list[RateWindow | None] = [None] * len(nodes)
    errors: list[NodeError] = []
    for i, client in enumerate(nodes.clients):
        try:
            pipe = client.pipeline(transaction=False)
            pipe.zrange(key, 0, -1, withscores=True)
            pipe.time()
            entries, (sec, usec) = pipe.execute()
        except (RedisError, OSError) as exc:
            errors.append(nodes.error(i, exc))
            continue
        now_us = int(sec) * 1_000_000 + int(usec)
        window_us = period * 1_000_000
        live = sorted((float(score) for _, score in entries if float(score) > now_us - window_us), reverse=True)
        # A start fits once all but limit - 1 of the live ones left the window (rate.lua's rule).
        frees = 0.0 if len(live) < limit else (live[limit - 1] + window_us - now_us) / 1_000_000
        out[i] = RateWindow(nodes.names[i], tuple((now_us - t) / 1_000_000 for t in live), max(0.0, frees))
    return Report(out, tuple(errors), len(nodes), nodes.quorum)


def burst_line(info: LockInfo) -> str:
    """What a pending burst's row says: when its job runs, and with which call's arguments."""
    args = info.record.get("args", "")
    shown = args if len(args) <= ARGS_SHOWN else args[:ARGS_SHOWN] + "..."
    return (
        f"task {info.task_id} runs in {format_duration(info.ttl)} unless another call joins, with the arguments of "
        f"call #{info.record.get('seq', '?')} of the burst: {shown}"
    )


def show_lock(settings: LockSettings, key: str) -> Report[tuple[LockInfo | None, list[NodeState | None]]]:
    """One key: its merged state (None when no node has it) and its state on each node."""
    read = read_keys(settings, [key])
    states = read.value[key]
    info = merge(key, states, settings.nodes.quorum, prefix=settings.prefix)
    return Report((info, states), read.errors, read.total, read.quorum)


def release_lock(settings: LockSettings, key: str, seen: Sequence[NodeState | None]) -> Report[list[NodeRelease]]:
    """Force-release ``key``: on each node, delete its holder record if it still names the owner ``seen`` there.

    Timeline of why the owner is compared, not just deleted: the operator reads the key (holder A), looks at it,
    confirms; meanwhile A's lease expires and B acquires. A plain DEL now would delete B's fresh lock and let a third
    run start beside B; the compare-and-delete finds B's owner instead and leaves it alone. A key that is not a
    holder record is never deleted. The fencing counters are never touched, so fencing tokens keep growing.
    """
    nodes = settings.nodes
    out: list[NodeRelease | None] = [None] * len(nodes)
    by_owner: dict[str, list[int]] = {}
    for i, state in enumerate(seen):
        if state is None:
            out[i] = NodeRelease(nodes.names[i], "unread")
        elif state.owner is not None:
            by_owner.setdefault(state.owner, []).append(i)
        elif state.present:
            out[i] = NodeRelease(nodes.names[i], "foreign", redis_type=state.redis_type)
        else:
            out[i] = NodeRelease(nodes.names[i], "not held")
    errors: list[NodeError] = []
    for owner, indices in by_owner.items():
        answers = nodes.run(_FORCE_RELEASE, (key,), (owner,), indices)
        for i in indices:
            answer = answers[i]
            if isinstance(answer, BaseException):
                error = nodes.error(i, answer)
                errors.append(error)
                out[i] = NodeRelease(nodes.names[i], "error", error=error.error)
            elif int(answer[0]) == RELEASED:
                out[i] = NodeRelease(nodes.names[i], "released", owner=owner)
            else:
                now_owner = None if answer[1] is None else _text(answer[1])
                out[i] = NodeRelease(nodes.names[i], "changed", owner=now_owner, redis_type=_text(answer[2]))
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


def holder_label(i: LockInfo) -> str:
    """Who wrote a record: a queue-scope reservation names its *producer* (the process that called delay(), not a
    worker: no worker has the job yet), a run its worker."""
    if not i.worker:
        return "-"
    return f"producer {i.worker}" if i.state in ("queued", "sending") else i.worker


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
