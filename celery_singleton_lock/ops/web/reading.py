"""What the locks page shows, read from the nodes at one time: every key classified into the page's sections (a few
bytes a key, ``brief.lua``), the shown rows read in full, the waiting lines, the pending bursts and cancels."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import cast

from redis.exceptions import RedisError

from ...lock.config import LockSettings
from ...lock.inventory import (
    _TASK_STATES,
    LockInfo,
    Report,
    done_marker_of,
    merge,
    read_burst,
    read_keys,
    scan_bursts,
    scan_keys,
)
from ...lock.nodes import NodeError
from ...lock.record import pending_cancels
from ...lock.scripts import BRIEF as _BRIEF
from .._gauges import lock_of_line as _lock_of_line

#: Rows per table and page.
PAGE_SIZE = 100
#: Waiters shown per line (the line's length is always shown).
LINE_SHOWN = 20
SCAN_COUNT = 1000
BATCH = 200
HELD_STATES = ("running", "retry-wait", "handed", "ending", "held", "partial")


@dataclass(frozen=True)
class Line:
    """A key's waiting line (on the first lock node): the oldest waiters first."""

    key: str  # the lock key
    task: str
    length: int
    waiters: tuple[tuple[str, float], ...]  # (task id, since: s since the epoch)


def task_of(prefix: str, key: str) -> str:
    """The task name a LockedTask key names (``prefix + name + ':v2:' + hash``), or ``""``."""
    if not key.startswith(prefix):
        return ""
    name, v2, _ = key[len(prefix) :].rpartition(":v2:")
    return name if v2 else ""


def _glob(text: str) -> str:
    return "".join("\\" + c if c in "*?[]\\" else c for c in text)


def scan_lines(settings: LockSettings, *, skip: Iterable[int] = ()) -> Report[list[Line]]:
    """Every waiting line under the prefix: SCAN on the first node (where lines live), then ZCARD and the oldest
    waiters of each, ``BATCH`` lines per pipeline. None when the first node is in ``skip`` (found down already)."""
    nodes = settings.nodes
    if 0 in set(skip):
        return Report([], (), 1, 1)
    client = nodes.clients[0]
    base = _glob(settings.prefix)
    patterns = [base + "*:waiters", "\\{*" + base + "*:waiters"]
    found: set[str] = set()
    errors: list[NodeError] = []
    lines: list[Line] = []
    try:
        for pattern in patterns:
            for raw in client.scan_iter(match=pattern, count=SCAN_COUNT):
                found.add(raw.decode("utf-8", "replace") if isinstance(raw, bytes) else str(raw))
        keys = sorted(
            (k, lock)
            for k in found
            if (lock := _lock_of_line(k)) is not None and lock.startswith(settings.prefix)  # not "{xa:..}" for "a:"
        )
        for start in range(0, len(keys), BATCH):
            batch = keys[start : start + BATCH]
            pipe = client.pipeline(transaction=False)
            for key, _ in batch:
                pipe.zcard(key)
                pipe.zrange(key, 0, LINE_SHOWN - 1, withscores=True)
            answers = pipe.execute()
            for i, (_, lock) in enumerate(batch):
                length, head = answers[2 * i], answers[2 * i + 1]
                if not length:
                    continue
                waiters = tuple(
                    (m.decode("utf-8", "replace") if isinstance(m, bytes) else str(m), float(s) / 1000.0)
                    for m, s in head
                )
                lines.append(Line(lock, task_of(settings.prefix, lock), int(length), waiters))
    except (RedisError, OSError) as exc:
        errors.append(nodes.error(0, exc))
    # Only the first node holds lines: the others' answers do not matter here.
    return Report(lines, tuple(errors), 1, 1)


@dataclass(frozen=True)
class Brief:
    """One key as a quick look classifies it (owner, state and task name only, from every node)."""

    key: str
    kind: str  # task, beat, lock, done, foreign
    state: str
    task: str
    holding: int = 0  # nodes holding the merged owner's record (0: done marker, foreign key)
    total: int = 0  # nodes in all


#: The page's sections, and which briefs go in each.
SECTIONS: dict[str, Callable[[Brief], bool]] = {
    "held": lambda b: b.kind not in ("done", "beat") and b.state in HELD_STATES,
    "beat": lambda b: b.kind == "beat" and b.state in HELD_STATES,
    "reserved": lambda b: b.state in ("queued", "sending"),
    "cooldown": lambda b: b.state == "cooldown",
    "done": lambda b: b.kind == "done",
    "foreign": lambda b: b.kind == "foreign",
}


def classify(settings: LockSettings, keys: Sequence[str], *, skip: Iterable[int] = ()) -> Report[list[Brief]]:
    """Each key's kind, state and task from ``brief.lua`` on every node (its owner, state and name: a few bytes a
    key, 1,000 keys a script call), so sorting 10,000 keys costs a fraction of reading every record; merged by owner
    and quorum as :func:`~celery_singleton_lock.inventory.merge` does."""
    nodes = settings.nodes
    down = set(skip)
    errors: list[NodeError] = []
    done = {k: m for k in keys if (m := done_marker_of(k)) is not None}
    rest = [k for k in keys if k not in done]
    answers: list[list[str] | None] = [None if i in down else [] for i in range(len(nodes))]
    for start in range(0, len(rest), BATCH * 5):
        live = [i for i, a in enumerate(answers) if a is not None]
        if not live:
            break
        batch = rest[start : start + BATCH * 5]
        got = nodes.run(_BRIEF, batch, (), live)
        for i in live:
            answer = got[i]
            if isinstance(answer, BaseException):
                errors.append(nodes.error(i, answer))
                answers[i] = None
            else:
                cast(list[str], answers[i]).extend(_text(x) for x in answer)
    briefs = [Brief(k, "done", "done", task_of(settings.prefix, m[0])) for k, m in done.items()]
    replies = [a for a in answers if a is not None]
    for n, key in enumerate(rest):
        seen = [a[n] for a in replies if n < len(a)]
        records = [x.split("\x1f", 2) for x in seen if x not in ("", "-")]
        if not records:
            if "-" in seen:
                briefs.append(Brief(key, "foreign", "foreign", ""))
            continue  # gone since the scan
        owner, count = Counter(r[0] for r in records).most_common(1)[0]
        _, state, name = next(r for r in records if r[0] == owner)
        if state:
            kind = "task"
        elif key.startswith(f"{settings.prefix}beat:"):
            kind = "beat"
        else:
            kind = "lock"
        shown = "partial"
        if count >= nodes.quorum:
            shown = _TASK_STATES.get(state, state) if state else "held"
        briefs.append(Brief(key, kind, shown, name or task_of(settings.prefix, key), count, len(nodes)))
    briefs.sort(key=lambda b: b.key)
    return Report(briefs, tuple(errors), len(nodes), nodes.quorum)


def _text(value: object) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


@dataclass
class Snapshot:
    """What one page shows, read at one time: every key classified, the shown page of each section read in full."""

    now: float
    briefs: list[Brief]
    sections: dict[str, tuple[int, list[LockInfo]]]  # section -> (keys in it, the page's keys read and merged);
    # "pending": the debounced bursts (lock_debounce) waiting to run
    lines: list[Line]
    errors: tuple[NodeError, ...]
    answered: int
    total: int
    quorum: int
    #: the durable cancels still pending (``locks list``'s source, record.pending_cancels): (key, task id, by,
    #: expires at Unix s)
    cancels: list[tuple[str, str, str, float]] = field(default_factory=list)


def snapshot(settings: LockSettings, page: int = 1, search: str = "") -> Snapshot:
    """Every key under the prefix (done markers too) classified, page ``page`` of each section read, and the lines.

    SCAN finds the keys (batches of 1,000), :func:`classify` sorts them into sections, and only the rows shown
    (``PAGE_SIZE`` a section) are read in full: the page's cost grows slowly with the number of keys. ``search``:
    only the keys containing it, or whose task's name does (the page's search box).
    """
    scanned = scan_keys(settings, done=True)
    down = [settings.nodes.names.index(x.node) for x in scanned.errors]
    briefs = classify(settings, scanned.value, skip=down)
    if search:
        briefs = replace(briefs, value=[b for b in briefs.value if search in b.key or search == b.task])
    groups = {name: [b.key for b in briefs.value if test(b)] for name, test in SECTIONS.items()}
    wanted: list[str] = []
    for keys in groups.values():
        start = (max(page, 1) - 1) * PAGE_SIZE
        wanted.extend(keys[start : start + PAGE_SIZE])
    read = read_keys(settings, wanted, skip=down)
    infos = {k: merge(k, states, settings.nodes.quorum, prefix=settings.prefix) for k, states in read.value.items()}
    sections = {
        name: (len(keys), [i for k in keys if (i := infos.get(k)) is not None]) for name, keys in groups.items()
    }
    lines = scan_lines(settings, skip=down)
    found = scan_bursts(settings, skip=down)
    pending = [k for k in found.value if not search or search in k or search == task_of(settings.prefix, k)]
    start = (max(page, 1) - 1) * PAGE_SIZE
    bursts = [b for k in pending[start : start + PAGE_SIZE] if (b := read_burst(settings, k)) is not None]
    sections["pending"] = (len(pending), bursts)
    errors = scanned.errors + tuple(
        x for x in read.errors + lines.errors + found.errors if x.node not in {e.node for e in scanned.errors}
    )
    answered = len(settings.nodes) - len({x.node for x in scanned.errors + read.errors + briefs.errors})
    answering = [c for i, c in enumerate(settings.nodes.clients) if i not in down]  # a stalled node: asked once
    cancels = [c for c in pending_cancels(answering, settings.prefix) if not search or search in c[0]]
    return Snapshot(
        time.time(),
        briefs.value,
        sections,
        lines.value,
        errors,
        answered,
        len(settings.nodes),
        settings.nodes.quorum,
        cancels,
    )


def down_nodes(settings: LockSettings, snap: Snapshot) -> list[int]:
    """The nodes a snapshot found down: the request's later reads skip them (each would wait its timeout again)."""
    failed = {x.node for x in snap.errors}
    return [i for i, name in enumerate(settings.nodes.names) if name in failed]
