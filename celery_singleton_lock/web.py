"""``celery -A app locks web``: one page showing locks, lines and the last hour; ``/metrics`` for Prometheus.

Both are plain WSGI apps (stdlib only: no framework, no new dependency), so the same page mounts in Django, Flask or
FastAPI (``WSGIMiddleware``) behind the host app's own auth, the way Sidekiq::Web and Oban Web are mounted::

    from celery_singleton_lock.web import make_app, metrics_app
    locks_page = make_app(celery_app)            # GET /  the page; POST /release; GET /metrics
    metrics = metrics_app(celery_app)            # GET    the Prometheus text alone

Everything is read from the lock nodes at each request (SCAN in batches, never KEYS; records read 200 keys per
script call), so the page shows what every worker and host did, and a node that is down or slow costs at most its
socket timeout and is reported by its redacted address. The page is read-only unless a *secret* is given: then each
held lock has a release form, and a release needs that secret in the form (typed by the operator: a forged cross-site
form cannot know it) or in the ``X-Lock-Secret`` header, a same-origin request (an ``Origin`` naming another host is
refused), and the owner the page showed (the release is owner-checked as ``celery locks release`` is: a lock taken
over since the page was drawn is left alone). Every value shown is escaped (task ids and keys are user data), a
Content-Security-Policy lets only the page's own script run, and no URL, password or holder token is shown.
"""

from __future__ import annotations

import base64
import bisect
import hashlib
import hmac
import html
import json
import logging
import math
import secrets
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, cast
from urllib.parse import parse_qs, quote, urlencode

from redis.exceptions import RedisError

from ._gauges import lock_of_line as _lock_of_line
from ._gauges import read_gauges
from .config import LockSettings, settings_for
from .doctor import Finding, run_doctor
from .errors import ConfigurationError, LockError
from .explain import Explanation, explain, explain_key, explanation_facts
from .health import route as health_route
from .inventory import (
    _TASK_STATES,
    LockInfo,
    Report,
    burst_line,
    done_marker_of,
    format_duration,
    holder_label,
    merge,
    read_burst,
    read_keys,
    release_lock,
    scan_bursts,
    scan_keys,
    show_lock,
)
from .metrics import OUTCOMES, WAIT_MS, WAITS, MetricsReport, read_metrics, read_minutes
from .nodes import NodeError
from .record import burst_key_for, pending_cancels
from .scripts import BRIEF as _BRIEF

__all__ = [
    "MIN_SECRET",
    "PAGE_SIZE",
    "Line",
    "exposition",
    "list_page",
    "make_app",
    "metrics_app",
    "scan_lines",
    "serve",
]

logger = logging.getLogger("celery_singleton_lock.web")

#: Rows per table and page.
PAGE_SIZE = 100
#: Waiters shown per line (the line's length is always shown).
LINE_SHOWN = 20
#: The shortest secret accepted for releases (a short one could be guessed).
MIN_SECRET = 16
#: The request body read at most (a release form is a few hundred bytes).
MAX_BODY = 16 * 1024
#: Wrong release secrets a client address may send per ``SECRET_WINDOW`` s; then 429 until the oldest ages out.
SECRET_TRIES, SECRET_WINDOW = 5, 60.0
#: Client addresses whose wrong secrets are remembered at most (the oldest are forgotten first).
MAX_CLIENTS = 10_000
#: ``/locks.json``: locks per page unless ``?limit=`` says, and the most a page may ask for.
JSON_LIMIT, JSON_MAX_LIMIT = 500, 5000
#: The longest ``?cursor=`` taken (a cursor is a key, base64: keys are bounded, see docs/keys.md).
MAX_CURSOR = 8192
#: Characters of a key a cursor carries; a longer key is named by them and a digest.
CURSOR_KEY = 1024
#: Keys up to this many characters link to their explanation (``/explain?key=``); a longer one would make a URL
#: servers refuse (its call, searched for on the page, is explained).
EXPLAIN_LINK = 4096
SCAN_COUNT = 1000
BATCH = 200

StartResponse = Callable[[str, list[tuple[str, str]]], Any]
WSGIApp = Callable[[dict[str, Any], StartResponse], Iterable[bytes]]

#: Chart colours per outcome (others grey).
COLOURS = {
    "acquired": "#2e7d32",
    "released": "#81c784",
    "skipped": "#f9a825",
    "deferred": "#1e88e5",
    "waited": "#90caf9",
    "replaced": "#8e24aa",
    "rate-limited": "#6d4c41",
    "slowed": "#a1887f",
    "lost": "#d32f2f",
    "renew-failed": "#ff7043",
    "unavailable": "#000000",
}
HELD_STATES = ("running", "retry-wait", "ending", "held", "partial")


def e(value: object) -> str:
    """``value`` as HTML text or attribute (quotes escaped too)."""
    return html.escape("" if value is None else str(value), quote=True)


# --- reading -------------------------------------------------------------------------------------------------------


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


def _down(settings: LockSettings, snap: Snapshot) -> list[int]:
    """The nodes a snapshot found down: the request's later reads skip them (each would wait its timeout again)."""
    failed = {x.node for x in snap.errors}
    return [i for i, name in enumerate(settings.nodes.names) if name in failed]


# --- Prometheus ----------------------------------------------------------------------------------------------------


def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def exposition(settings: LockSettings) -> str:
    """The Prometheus text exposition (format 0.0.4) of the app's lock metrics, read from the nodes now.

    Families: ``celery_lock_events_total{task,outcome}`` (counter: every outcome since the counts began, summed over
    every worker and host), ``celery_lock_wait_seconds{task}`` (summary: sum and count of the time runs waited
    before taking their lock), ``celery_lock_held{task}`` and ``celery_lock_waiting{task}`` (gauges: locks held and
    jobs waiting in a line now), ``celery_lock_partial{task}`` (gauge: lock records, cooldowns and reservations
    included, on fewer than a quorum of nodes: no owner holds them, so they guard nothing, e.g. a cooldown left on
    one node after two restarted empty), ``celery_lock_incomplete{task}`` (gauge: records on a quorum but not on
    every node: one more node lost and they are partial), ``celery_lock_nodes_up`` (gauge: lock nodes that
    answered). Labels are ``task`` and
    ``outcome`` only, never a key or a task id. A counter never goes down from one scrape to the next while a node
    holding some of its counts does not answer (:func:`_never_lower`).
    """
    gauges = read_gauges(settings)
    found = read_metrics(settings.nodes, settings.prefix, skip=gauges.down)
    found = _never_lower(settings, found, complete=not (found.errors or gauges.errors))
    out = [
        "# HELP celery_lock_events_total Lock outcomes per task (see celery_singleton_lock.metrics.OUTCOMES).",
        "# TYPE celery_lock_events_total counter",
    ]
    for task, counts in found.tasks.items():
        for outcome, n in counts.items():
            out.append(f'celery_lock_events_total{{task="{_label(task)}",outcome="{_label(outcome)}"}} {n}')
    out += [
        "# HELP celery_lock_wait_seconds Time runs waited (re-sent or in a line) before taking their lock.",
        "# TYPE celery_lock_wait_seconds summary",
    ]
    for task, (ms, n) in found.waits.items():
        out.append(f'celery_lock_wait_seconds_sum{{task="{_label(task)}"}} {ms / 1000.0}')
        out.append(f'celery_lock_wait_seconds_count{{task="{_label(task)}"}} {n}')
    held, waiting, partial, incomplete = gauges.held, gauges.waiting, gauges.partial, gauges.incomplete
    for name, help_, values in (
        ("celery_lock_held", "Locks held now per task (running, retry-wait, ending, cooldown, queued).", held),
        ("celery_lock_waiting", "Jobs waiting in a line now per task.", waiting),
        ("celery_lock_partial", "Lock records (cooldowns, reservations too) on fewer than a quorum of nodes.", partial),
        ("celery_lock_incomplete", "Lock records on a quorum but not on every lock node now.", incomplete),
    ):
        out += [f"# HELP {name} {help_}", f"# TYPE {name} gauge"]
        out += [f'{name}{{task="{_label(t)}"}} {n}' for t, n in sorted(values.items())]
    out += [
        "# HELP celery_lock_nodes_up Lock nodes that answered this scrape.",
        "# TYPE celery_lock_nodes_up gauge",
        f"celery_lock_nodes_up {len(settings.nodes) - len({x.node for x in found.errors + gauges.errors})}",
        "# HELP celery_lock_gauges_age_seconds Age of the walk over the keys the gauges above come from (a walk "
        "longer than one scrape ends over several).",
        "# TYPE celery_lock_gauges_age_seconds gauge",
        f"celery_lock_gauges_age_seconds {gauges.age:.3f}",
        "# HELP celery_lock_gauges_complete 1 once a walk over every key has ended (the gauges are 0 until then).",
        "# TYPE celery_lock_gauges_complete gauge",
        f"celery_lock_gauges_complete {int(gauges.complete)}",
    ]
    return "\n".join(out) + "\n"


#: The highest count this process exposed per series, per (nodes, prefix): see :func:`_never_lower`.
_EXPOSED: dict[tuple[tuple[str, ...], str], dict[tuple[str, str], int]] = {}
_EXPOSED_LOCK = threading.Lock()


def _never_lower(settings: LockSettings, found: MetricsReport, *, complete: bool) -> MetricsReport:
    """``found`` with each count raised to the highest this process exposed before, unless it is ``complete``
    (every node answered).

    Counts live on whichever node answered each flush, and are read summed over the nodes that answer: with a node
    down the sum is short. A counter that goes down reads as a reset in Prometheus (its whole total counted again
    when the node is back), so such a scrape never shows less than an earlier one did (bounded: one entry a
    series). When every node answers, the sums are shown as read: a real reset (a node that lost its data) shows.
    """
    with _EXPOSED_LOCK:
        seen = _EXPOSED.setdefault((settings.nodes.names, settings.prefix), {})
        if complete:
            seen.clear()
        for task, counts in found.tasks.items():
            for outcome, n in counts.items():
                seen[(task, outcome)] = max(seen.get((task, outcome), 0), n)
        for task, (ms, n) in found.waits.items():
            for field, value in ((WAIT_MS, ms), (WAITS, n)):
                seen[(task, field)] = max(seen.get((task, field), 0), value)
        tasks: dict[str, dict[str, int]] = {}
        waits: dict[str, tuple[int, int]] = {}
        for (task, outcome), n in sorted(seen.items()):
            if outcome in (WAIT_MS, WAITS):
                waits[task] = (seen.get((task, WAIT_MS), 0), seen.get((task, WAITS), 0))
            else:
                tasks.setdefault(task, {})[outcome] = n
    order = {o: i for i, o in enumerate(OUTCOMES)}
    ordered = {
        t: dict(sorted(c.items(), key=lambda kv: (order.get(kv[0], len(order)), kv[0]))) for t, c in tasks.items()
    }
    return MetricsReport(ordered, waits, found.errors)


# --- the page ------------------------------------------------------------------------------------------------------

STYLE = """
body{font:13px/1.4 system-ui,sans-serif;margin:1em 2em;color:#222}
h1{font-size:20px}h2{font-size:16px;margin-top:1.6em;border-bottom:1px solid #ddd}
table{border-collapse:collapse}td,th{padding:2px 8px;border-bottom:1px solid #eee;text-align:left;vertical-align:top}
th{background:#f6f6f6}code{font-size:12px}.err{color:#b00020}.warn{color:#a15c00}.ok{color:#2e7d32}
.muted{color:#777}.chart{display:inline-block;margin:0 2em 1em 0}.legend span{margin-right:1em}
form.release{display:inline}form.release input{width:9em}
tr.partial td{background:#fde0e0}tr.incomplete td{background:#fff4d6}details{margin:.5em 0}
summary{cursor:pointer;color:#1e5fa8}
"""


def _table(
    head: Sequence[str], rows: Sequence[Sequence[str]], cls: str, row_classes: Sequence[str] | None = None
) -> str:
    """An HTML table; ``rows`` are already escaped HTML; ``row_classes``: a class per row ("" for none)."""
    if not rows:
        return '<p class="muted">none</p>'
    cells = "".join(f"<th>{e(h)}</th>" for h in head)
    marks = [f' class="{c}"' if c else "" for c in (row_classes or [""] * len(rows))]
    body = "".join(
        f"<tr{m}>" + "".join(f"<td>{c}</td>" for c in row) + "</tr>" for row, m in zip(rows, marks, strict=True)
    )
    return f'<table class="{cls}"><thead><tr>{cells}</tr></thead><tbody>{body}</tbody></table>'


def _pages(items: Sequence[Any], page: int, base: str) -> tuple[Sequence[Any], str]:
    start = (max(page, 1) - 1) * PAGE_SIZE
    return items[start : start + PAGE_SIZE], _nav(len(items), page, base)


def _nav(total: int, page: int, base: str = "") -> str:
    """Links to the previous and next page, when there is more than one: to the page's path (``base/``), never
    relative (from the answer to a release, ``?page=2`` would be ``GET /release?page=2``)."""
    pages = max(1, -(-total // PAGE_SIZE))
    page = max(page, 1)
    if pages == 1:
        return ""
    links = []
    if page > 1:
        links.append(f'<a href="{e(base)}/?page={page - 1}">previous</a>')
    if page < pages:
        links.append(f'<a href="{e(base)}/?page={page + 1}">next</a>')
    return f'<p class="muted">{total} in all; page {page} of {pages} {" ".join(links)}</p>'


def chart(series: Sequence[Mapping[str, int]], width: int = 360, height: int = 48) -> str:
    """An inline SVG of stacked bars, one a minute (oldest left), coloured by outcome."""
    tallest = max((sum(m.values()) for m in series), default=0) or 1
    bar = width / max(len(series), 1)
    rects = []
    for i, minute in enumerate(series):
        y = float(height)
        for outcome in [o for o in OUTCOMES if minute.get(o)] + sorted(o for o in minute if o not in OUTCOMES):
            h = minute[outcome] * height / tallest
            y -= h
            rects.append(
                f'<rect x="{i * bar:.1f}" y="{y:.1f}" width="{max(bar - 1, 1):.1f}" height="{h:.1f}" '
                f'fill="{COLOURS.get(outcome, "#9e9e9e")}"><title>{e(outcome)}: {minute[outcome]}</title></rect>'
            )
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" role="img" '
        f'style="background:#fafafa">{"".join(rects)}</svg>'
    )


def _held_rows(snap: Snapshot, shown: Sequence[LockInfo], base: str, *, release: bool) -> list[list[str]]:
    rows = []
    for i in shown:
        row = [
            _key_cell(i.key, base),
            e(i.state),
            e(i.task_name or "-"),
            f"<code>{e(i.task_id or '-')}</code>",
            e(i.worker or "-"),
            e(format_duration(i.age(snap.now))),
            e(format_duration(i.ttl, none="never")),
            e("-" if i.fencing_token is None else i.fencing_token),
            e(f"{len(i.nodes)}/{i.total}"),
        ]
        if release:
            row.append(_release_form(i, base))
        rows.append(row)
    return rows


def _release_form(i: LockInfo, base: str) -> str:
    """A release form naming the key and a digest of its holder's owner token (never the token: see
    :func:`_owner_digest`); the release is owner-checked as ``celery locks release`` is."""
    return (
        f'<form class="release" method="post" action="{e(base)}/release">'
        f'<input type="hidden" name="key" value="{e(i.key)}">'
        f'<input type="hidden" name="owner" value="{e(_owner_digest(i.owner))}">'
        '<input type="password" name="secret" placeholder="secret" autocomplete="off" required>'
        "<button>release</button></form>"
    )


def _call_inputs(task: str, args: str, kwargs: str, button: str) -> str:
    """A form's inputs for a call: the task's name, its args and kwargs as JSON (``celery call``'s convention)."""
    return (
        f'<input name="task" value="{e(task)}" placeholder="task, e.g. shop.charge" size="22">'
        f'<input name="args" value="{e(args)}" placeholder="args JSON" size="12">'
        f'<input name="kwargs" value="{e(kwargs)}" placeholder="kwargs JSON" size="12"> <button>{e(button)}</button>'
    )


def _key_cell(key: str | None, base: str) -> str:
    """A key as the page shows it: code, linked to its explanation (``/explain?key=``) unless it is too long."""
    if key is None:
        return "-"
    if len(key) > EXPLAIN_LINK:
        return f"<code>{e(key)}</code>"
    return f'<a href="{e(base)}/explain?key={e(quote(key, safe=""))}"><code>{e(key)}</code></a>'


#: Verdicts shown in green (the call would run, or start a burst) and red (no quorum); the rest amber.
GOOD_VERDICTS, BAD_VERDICTS = ("runs", "free", "starts-burst"), ("unavailable",)


def render_explanation(found: Explanation, now: float, base: str, query: str) -> str:
    """``locks explain``'s answer as HTML (every value escaped, no owner token): the verdict, why, the facts read;
    at most :data:`PAGE_SIZE` reasons and facts (``query``'s ``explain.json`` has them all)."""
    cls = "ok" if found.verdict in GOOD_VERDICTS else "err" if found.verdict in BAD_VERDICTS else "warn"
    why = [f"<li>{e(w)}</li>" for w in found.why[:PAGE_SIZE]]
    facts = explanation_facts(found, now)
    rows = [[e(label), f"<code>{e(text)}</code>"] for label, text in facts[:PAGE_SIZE]]
    more = max(0, len(found.why) - PAGE_SIZE) + max(0, len(facts) - PAGE_SIZE)
    json_link = f'<a href="{e(base)}/explain.json?{e(query)}">explain.json</a>'
    return (
        f'<section id="explain"><h2>Why: <span class="{cls}" id="verdict">{e(found.verdict)}</span> '
        f'<span class="muted">{e(found.task or "-")}, read now; the call itself may find it changed</span></h2>'
        f'<ul id="why">{"".join(why)}</ul>'
        + _table(["", "read"], rows, "facts")
        + f'<p class="muted">{f"{more} more line(s) not shown: " if more else ""}all of it as {json_link}</p>'
        + "</section>"
    )


def render_explain_page(found: Explanation | None, message: str, base: str, query: Mapping[str, list[str]]) -> str:
    """The ``/explain`` page: a form for a key or a call, then the explanation (or what to change)."""
    key = query.get("key", [""])[0]
    task, args, kwargs = (query.get(n, [d])[0] for n, d in (("task", ""), ("args", "[]"), ("kwargs", "{}")))
    parts = [
        "<!doctype html><html><head><meta charset='utf-8'><title>celery_singleton_lock: explain</title>",
        f"<style>{STYLE}</style></head><body>",
        f'<h1>Why? <a href="{e(base)}/" class="muted">all locks</a></h1>',
        f'<form method="get" action="{e(base)}/explain" id="ask">'
        f'<input name="key" value="{e(key if not task else "")}" placeholder="key" size="40"> '
        f"<button>explain the key</button> <span class='muted'>or a call:</span> "
        + _call_inputs(task, args, kwargs, "explain the call")
        + "</form>",
    ]
    if message:
        parts.append(f'<p class="warn" id="message">{e(message)}</p>')
    if found is not None:
        asked = {"task": task, "args": args, "kwargs": kwargs} if task else {"key": key}
        parts.append(render_explanation(found, time.time(), base, urlencode(asked)))
    parts.append("</body></html>")
    return "".join(parts)


def _mark(i: LockInfo) -> str:
    """A row's class: ``partial`` (on fewer than a quorum: it guards nothing), ``incomplete`` (on a quorum, not on
    every node), or none."""
    if i.state == "partial":
        return "partial"
    return "incomplete" if len(i.nodes) < i.total else ""


def _owner_digest(owner: str | None) -> str:
    """What the page shows of a holder's owner token: a digest (the token itself is the holder's to release with)."""
    return "" if owner is None else hmac.new(b"celery_singleton_lock.web", owner.encode(), "sha256").hexdigest()[:32]


class _Tries:
    """Wrong secrets per client address: at most ``limit`` in any ``window`` s, then :meth:`wait` says how long
    until one more is allowed. Bounded: the addresses seen longest ago are forgotten past :data:`MAX_CLIENTS`."""

    def __init__(self, limit: int, window: float) -> None:
        self.limit, self.window = limit, window
        self._failed: dict[str, list[float]] = {}
        self._lock = threading.Lock()

    def _recent(self, client: str, now: float) -> list[float]:
        kept = [t for t in self._failed.get(client, ()) if now - t < self.window]
        if kept:
            self._failed[client] = kept
        else:
            self._failed.pop(client, None)
        return kept

    def wait(self, client: str) -> float:
        """Seconds until ``client`` may try a secret again (0: now)."""
        now = time.monotonic()
        with self._lock:
            recent = self._recent(client, now)
            return 0.0 if len(recent) < self.limit else recent[-self.limit] + self.window - now

    def failed(self, client: str) -> None:
        """Count one wrong secret from ``client``."""
        now = time.monotonic()
        with self._lock:
            recent = self._recent(client, now)
            self._failed.pop(client, None)  # re-inserted last: the dict's order is the order of last failure
            self._failed[client] = [*recent, now][-self.limit :]
            while len(self._failed) > MAX_CLIENTS:
                del self._failed[next(iter(self._failed))]


@dataclass
class _DoctorCache:
    at: float = 0.0
    findings: list[Finding] | None = None


def render(
    snap: Snapshot,
    *,
    page: int,
    series: tuple[list[int], dict[str, list[dict[str, int]]]],
    findings: Sequence[Finding] | None,
    base: str,
    release: bool,
    refresh: float,
    nonce: str,
    prefix: str,
    message: str = "",
    reload_to: str | None = None,
    search: str = "",
    call: tuple[str, str, str] = ("", "[]", "{}"),
    explanation: str = "",
) -> str:
    """The page's HTML (every value escaped); its refresh loads ``reload_to`` (the page's URL, when this answers a
    POST) or reloads itself. ``search``: the key substring (or task name) the rows were filtered by; ``call``: the
    task, args and kwargs of the call searched for, as typed; ``explanation``: that call's, as HTML
    (:func:`render_explanation`)."""
    counts = {name: n for name, (n, _) in snap.sections.items()}
    held, beat, reserved, cooling, done, foreign = (
        snap.sections[name][1] for name in ("held", "beat", "reserved", "cooldown", "done", "foreign")
    )
    partial = sum(b.state == "partial" for b in snap.briefs if b.kind not in ("done", "foreign"))
    parts = [
        "<!doctype html><html><head><meta charset='utf-8'><title>celery_singleton_lock</title>",
        f"<style>{STYLE}</style></head><body>",
        f"<h1>Locks under <code>{e(prefix)}</code></h1>",
    ]
    status = "ok" if snap.answered >= snap.quorum and not snap.errors else "err"
    parts.append(
        f'<p class="{status}" id="nodes">{snap.answered} of {snap.total} lock node(s) answered (quorum {snap.quorum}); '
        f"{counts['held']} held, {sum(x.length for x in snap.lines)} waiting, {counts['reserved']} reserved, "
        f"{counts['cooldown']} cooling down, {counts.get('pending', 0)} debounced run(s) pending, "
        f"{counts['beat']} beat claims, {counts['done']} done markers. "
        f'<span class="muted">Read at {e(time.strftime("%H:%M:%S", time.gmtime(snap.now)))} UTC'
        f"{f'; refreshes every {refresh:g}s' if refresh else ''}. "
        f'<a href="{e(base)}/metrics">/metrics</a></span></p>'
    )
    for error in snap.errors:
        parts.append(f'<p class="err">node {e(error.node)} did not answer: {e(error.error)}</p>')
    if partial:
        parts.append(
            f'<p class="err" id="partial">{partial} partial record(s): on fewer than a quorum of nodes, they guard '
            "nothing (a cooldown or reservation there lets a second call run); highlighted below</p>"
        )
    if message:
        parts.append(f'<p class="warn" id="message">{e(message)}</p>')
    task, args, kwargs = call
    parts.append(
        f'<form method="get" action="{e(base)}/" id="search">'
        f'<input name="q" value="{e(search if not task else "")}" placeholder="key part or task name" size="30"> '
        f"<button>search</button> <span class='muted'>or a call:</span> "
        + _call_inputs(task, args, kwargs, "find its key")
        + (f' <a href="{e(base)}/">clear</a>' if search else "")
        + "</form>"
    )
    if search:
        parts.append(f'<p class="muted" id="searched">only keys containing <code>{e(search)}</code></p>')
    parts.append(explanation)
    shown, nav = held, _nav(counts["held"], page, base)
    head = ["key", "state", "task", "holder task id", "worker", "age", "time left", "fencing token", "nodes"]
    parts += [
        "<h2>Held</h2>",
        nav,
        _table(
            [*head, "release"] if release else head,
            _held_rows(snap, shown, base, release=release),
            "held",
            [_mark(i) for i in shown],
        ),
    ]
    if not release:
        parts.append('<p class="muted">Read-only: start with a secret to release locks here.</p>')
    parts.append("<h2>Lines (waiting duplicates, oldest first)</h2>")
    shown_lines, nav = _pages(snap.lines, page, base)
    rows = []
    for line in shown_lines:
        who = "<br>".join(
            f"{n}. <code>{e(t)}</code> <span class='muted'>waiting {e(format_duration(max(0.0, snap.now - s)))}</span>"
            for n, (t, s) in enumerate(line.waiters, 1)
        )
        more = (
            f"<br><span class='muted'>... and {line.length - len(line.waiters)} more</span>"
            if line.length > len(line.waiters)
            else ""
        )
        rows.append([_key_cell(line.key, base), e(line.task or "-"), e(line.length), who + more])
    parts += [nav, _table(["key", "task", "waiting", "order"], rows, "lines")]
    count, pending = snap.sections.get("pending", (0, []))
    rows = [
        [
            _key_cell(i.lock_key, base),
            e(i.state),
            e(i.task_name or "-"),
            f"<code>{e(i.task_id or '-')}</code>",
            e(format_duration(i.ttl)),
            e(burst_line(i)),
            e(f"{len(i.nodes)}/{i.total}"),
        ]
        for i in pending
    ]
    parts += [
        "<h2>Pending debounced runs</h2>",
        _nav(count, page, base),
        _table(
            ["key", "state", "task", "job's task id", "runs in", "with", "nodes"],
            rows,
            "pending",
            [_mark(i) for i in pending],
        ),
    ]
    rows = [
        [f"<code>{e(key)}</code>", f"<code>{e(task_id)}</code>", e(by), e(format_duration(max(0.0, at - snap.now)))]
        for key, task_id, by, at in snap.cancels
    ]
    parts += ["<h2>Pending cancels</h2>", _table(["key", "task id", "cancelled by", "dropped for"], rows, "cancels")]
    for title, items, cls, count in (
        ("Queue-scope reservations", reserved, "reserved", counts["reserved"]),
        ("Cooldowns", cooling, "cooldowns", counts["cooldown"]),
    ):
        shown, nav = items, _nav(count, page, base)
        rows = [
            [
                _key_cell(i.key, base),
                e(i.state),
                e(i.task_name or "-"),
                f"<code>{e(i.task_id or '-')}</code>",
                e(holder_label(i)),
                e(format_duration(i.ttl, none="never")),
                e(f"{len(i.nodes)}/{i.total}"),
                *([_release_form(i, base)] if release else []),
            ]
            for i in shown
        ]
        head = ["key", "state", "task", "task id", "sent or run by", "time left", "nodes"]
        table = _table([*head, "release"] if release else head, rows, cls, [_mark(i) for i in shown])
        parts += [f"<h2>{e(title)}</h2>", nav, table]
    opened = " open" if search else ""
    shown, nav = beat, _nav(counts["beat"], page, base)
    rows = _held_rows(snap, shown, base, release=release)
    head = ["key", "state", "task", "holder task id", "claimed by", "age", "time left", "fencing token", "nodes"]
    parts += [
        f'<details id="beat"{opened}><summary>{counts["beat"]} beat claim(s): one per schedule slot, kept about a '
        "minute (show)</summary>",
        nav,
        _table([*head, "release"] if release else head, rows, "beat", [_mark(i) for i in shown]),
        "</details>",
    ]
    shown, nav = done, _nav(counts["done"], page, base)
    rows = [
        [_key_cell(i.lock_key, base), f"<code>{e(i.task_id)}</code>", e(format_duration(i.ttl, none="never"))]
        for i in shown
    ]
    parts += [
        f'<details id="done"{opened}><summary>{counts["done"]} done marker(s): finished task ids, not locks '
        "(show)</summary>",
        nav,
        _table(["lock", "task id", "time left"], rows, "done"),
        "</details>",
    ]
    if foreign:
        shown, nav = foreign, _nav(counts["foreign"], page, base)
        rows = [[f"<code>{e(i.key)}</code>", e(i.redis_type)] for i in shown]
        parts += ["<h2>Other keys under the prefix</h2>", nav, _table(["key", "type"], rows, "foreign")]
    _, per_task = series
    parts.append("<h2>Last hour per task</h2>")
    if per_task:
        for task, minutes in per_task.items():
            totals: Counter[str] = Counter()
            for m in minutes:
                totals.update(m)
            summary = ", ".join(f"{e(o)} {n}" for o, n in totals.most_common())
            title = f'<b>{e(task or "-")}</b> <span class="muted">{summary}</span>'
            parts.append(f'<div class="chart"><div>{title}</div>{chart(minutes)}</div>')
        legend = "".join(f'<span style="color:{c}">&#9632; {e(o)}</span>' for o, c in COLOURS.items())
        parts.append(f'<p class="legend">{legend}</p>')
    else:
        parts.append('<p class="muted">nothing counted in the last hour</p>')
    parts.append("<h2>Doctor</h2>")
    if findings is None:
        parts.append('<p class="muted">not run</p>')
    else:
        fine = sum(f.level == "ok" for f in findings)
        parts.append(f'<p class="ok">{fine} check(s) ok{"; the others:" if fine < len(findings) else ""}</p>')
        rows = [
            [
                f'<span class="{ {"error": "err", "warning": "warn"}.get(f.level, "ok") }">{e(f.level)}</span>',
                e(f.subject),
                e(f.code),
                e(f.message) + (f"<br><span class='muted'>fix: {e(f.fix)}</span>" if f.fix else ""),
            ]
            for f in findings
            if f.level != "ok"
        ]
        if rows:
            parts.append(_table(["level", "subject", "check", "finding"], rows, "doctor"))
    if refresh:
        # Reload unless the operator is typing a secret (a reload would lose it). The answer to a release (a POST)
        # loads the page instead: reloading it would send the form, and the release, again at every refresh.
        again = "location.reload()"
        if reload_to is not None:
            target = json.dumps(reload_to).replace("<", "\\u003c")  # no "</script>" can end the script
            again = f"location.replace({target})"
        parts.append(
            f'<script nonce="{nonce}">setInterval(function(){{var a=document.activeElement;'
            f"if(!a||a.tagName!=='INPUT'){again}}},{int(refresh * 1000)});</script>"
        )
    parts.append("</body></html>")
    return "".join(parts)


# --- the WSGI apps -------------------------------------------------------------------------------------------------

SECURITY_HEADERS = [
    ("X-Content-Type-Options", "nosniff"),
    # Not "no-referrer": with it a browser sends "Origin: null" on the page's own form posts (refused as cross-site).
    ("Referrer-Policy", "same-origin"),
    ("X-Frame-Options", "DENY"),
    ("Cache-Control", "no-store"),
]


def _csp(nonce: str) -> str:
    return (
        "default-src 'none'; style-src 'unsafe-inline'; img-src data:; "
        f"script-src 'nonce-{nonce}'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'"
    )


def _respond(
    start: StartResponse,
    status: str,
    body: str,
    kind: str = "text/html; charset=utf-8",
    nonce: str = "",
    retry_after: float = 0.0,
) -> list[bytes]:
    data = body.encode("utf-8", "surrogateescape")
    headers = [("Content-Type", kind), ("Content-Length", str(len(data))), *SECURITY_HEADERS]
    if retry_after > 0:
        headers.append(("Retry-After", str(math.ceil(retry_after))))
    headers.append(("Content-Security-Policy", _csp(nonce or secrets.token_urlsafe(8))))
    start(status, headers)
    return [data]


def _settings_of(source: Any) -> Callable[[], LockSettings]:
    if isinstance(source, LockSettings):
        return lambda: source
    return lambda: settings_for(source)


def metrics_app(app: Any) -> WSGIApp:
    """A WSGI app answering every GET with the Prometheus text (:func:`exposition`) of ``app`` (a Celery app)."""
    settings = _settings_of(app)

    def metrics(environ: dict[str, Any], start: StartResponse) -> Iterable[bytes]:
        if environ.get("REQUEST_METHOD", "GET") not in ("GET", "HEAD"):
            return _respond(start, "405 Method Not Allowed", "GET only\n", "text/plain; charset=utf-8")
        return _respond(start, "200 OK", exposition(settings()), "text/plain; version=0.0.4; charset=utf-8")

    return metrics


def _same_origin(environ: Mapping[str, Any]) -> bool:
    """False for a request a browser marks as sent from another site (``Origin`` or ``Sec-Fetch-Site``)."""
    if environ.get("HTTP_SEC_FETCH_SITE", "same-origin") not in ("same-origin", "none"):
        return False
    origin = environ.get("HTTP_ORIGIN")
    if origin is None:
        return True
    host = environ.get("HTTP_HOST") or f"{environ.get('SERVER_NAME', '')}:{environ.get('SERVER_PORT', '')}"
    return origin in (f"http://{host}", f"https://{host}")


def make_app(
    app: Any,
    *,
    secret: str | None = None,
    refresh: float = 5.0,
    doctor: bool = True,
    doctor_every: float = 60.0,
    allowed_hosts: Sequence[str] | None = None,
) -> WSGIApp:
    """The page as a WSGI app: ``GET /`` the page (``?page=N``), ``GET /metrics`` the Prometheus text, ``POST
    /release`` (only with ``secret``, at least :data:`MIN_SECRET` characters), ``GET /explain`` and
    ``/explain.json`` (``?key=``, or a call ``?task=&args=&kwargs=``: ``celery locks explain``'s answer). ``app``
    is the Celery app;
    ``doctor``: show ``celery locks doctor``'s findings, run at most every ``doctor_every`` s. ``allowed_hosts``:
    the host names (without port) a request's ``Host`` may name, others get 403 (``locks web`` on a loopback
    address passes the loopback names: a site re-resolving its name to 127.0.0.1, DNS rebinding, cannot read the
    page); None (mounted in a host app): any, the host app checks."""
    if secret is not None and len(secret) < MIN_SECRET:
        raise ConfigurationError(f"locks web: the release secret must be at least {MIN_SECRET} characters long")
    settings = _settings_of(app)
    metrics = metrics_app(app)
    cache = _DoctorCache()
    guard = threading.Lock()
    tries = _Tries(SECRET_TRIES, SECRET_WINDOW)

    def findings() -> list[Finding] | None:
        if not doctor:
            return None
        with guard:
            if cache.findings is None or time.monotonic() - cache.at > doctor_every:
                try:
                    cache.findings = run_doctor(app, timeout=2.0)
                except Exception as exc:  # the page still shows the locks
                    logger.debug("locks web: the doctor failed", exc_info=True)
                    cache.findings = [Finding("error", "doctor", "app", f"the doctor failed: {type(exc).__name__}")]
                cache.at = time.monotonic()
            return cache.findings

    def page(environ: dict[str, Any], start: StartResponse, message: str = "", status: str = "200 OK") -> list[bytes]:
        query = parse_qs(environ.get("QUERY_STRING", ""))
        try:
            number = int(query.get("page", ["1"])[0])
        except ValueError:
            number = 1
        current = settings()
        search = query.get("q", [""])[0].strip()[:200]
        call = (query.get("task", [""])[0].strip()[:200], query.get("args", ["[]"])[0], query.get("kwargs", ["{}"])[0])
        explanation = ""
        if call[0]:
            search, why = _key_of_call(app, *call)
            message = message or why
            found = _explained(app, query)[0] if search != "\x00" else None
            if found is not None:
                asked = urlencode({"task": call[0], "args": call[1], "kwargs": call[2]})
                explanation = render_explanation(found, time.time(), environ.get("SCRIPT_NAME", "").rstrip("/"), asked)
        snap = snapshot(current, number, search)
        span, per_task, _ = read_minutes(current.nodes, current.prefix, 60, skip=_down(current, snap))
        nonce = secrets.token_urlsafe(16)
        base = environ.get("SCRIPT_NAME", "").rstrip("/")
        body = render(
            snap,
            page=number,
            series=(span, per_task),
            findings=findings(),
            base=base,
            release=secret is not None,
            refresh=refresh,
            nonce=nonce,
            prefix=current.prefix,
            message=message,
            reload_to=f"{base}/" if environ.get("REQUEST_METHOD") == "POST" else None,
            search=search,
            call=call,
            explanation=explanation,
        )
        return _respond(start, status, body, nonce=nonce)

    def release(environ: dict[str, Any], start: StartResponse) -> list[bytes]:
        def refuse(status: str, why: str) -> list[bytes]:
            logger.warning("locks web: release refused (%s) from %s", why, environ.get("REMOTE_ADDR", "?"))
            return page(environ, start, f"not released: {why}", status)

        if environ.get("REQUEST_METHOD") != "POST":
            return _respond(start, "405 Method Not Allowed", "POST only\n", "text/plain; charset=utf-8")
        if secret is None:
            return refuse("403 Forbidden", "releasing is off (no secret configured); the page is read-only")
        if not _same_origin(environ):
            return refuse("403 Forbidden", "the request came from another site")
        try:
            size = int(environ.get("CONTENT_LENGTH") or 0)
        except ValueError:
            size = 0
        if size > MAX_BODY:
            return refuse("413 Payload Too Large", "request too large")
        form = parse_qs(environ["wsgi.input"].read(size).decode("utf-8", "replace")) if size > 0 else {}
        given = environ.get("HTTP_X_LOCK_SECRET") or form.get("secret", [""])[0]
        client = str(environ.get("REMOTE_ADDR", "?"))
        wait = tries.wait(client)
        if wait > 0:  # before the comparison: a client out of tries learns nothing, even from the right secret
            logger.warning("locks web: release refused (too many wrong secrets) from %s", client)
            why = f"too many wrong secrets from {client}: try again in {math.ceil(wait)} s\n"
            return _respond(start, "429 Too Many Requests", why, "text/plain; charset=utf-8", retry_after=wait)
        if not hmac.compare_digest(given.encode("utf-8", "surrogateescape"), secret.encode("utf-8")):
            tries.failed(client)
            return refuse("403 Forbidden", "wrong or missing secret")
        key, owner = form.get("key", [""])[0], form.get("owner", [""])[0]
        current = settings()
        if not key or not owner:
            return refuse("400 Bad Request", "name the key and the owner shown")
        if not key.startswith(current.prefix):
            # The page shows only this prefix's keys: it releases nothing else (another app's lock on shared nodes).
            return refuse("400 Bad Request", "not a key under this app's prefix")
        seen = show_lock(current, key)
        info, states = seen.value
        if info is None or info.owner is None or not hmac.compare_digest(_owner_digest(info.owner), owner):
            return refuse("409 Conflict", f"{key} changed since the page was read (another holder, or free)")
        only = [s if s is not None and s.owner == info.owner else None for s in states]
        report = release_lock(current, key, only)
        done = sum(r.outcome == "released" for r in report.value)
        logger.warning(
            "forced release of lock %s (%s %s[%s]) from the web page by %s: released on %d of %d node(s)",
            key,
            info.state,
            info.task_name or "?",
            info.task_id or "?",
            environ.get("REMOTE_ADDR", "?"),
            done,
            len(report.value),
        )
        return page(environ, start, f"released {key} on {done} of {len(report.value)} node(s)")

    def locks_json(environ: dict[str, Any], start: StartResponse) -> list[bytes]:
        query = parse_qs(environ.get("QUERY_STRING", ""), keep_blank_values=True)
        try:
            after = _cursor_key(query.get("cursor", [""])[0])
            limit = _limit(query.get("limit", [str(JSON_LIMIT)])[0])
        except ValueError:
            why = f"cursor must be a 'next' this endpoint returned, limit a number from 1 to {JSON_MAX_LIMIT}"
            return _respond(start, "400 Bad Request", json.dumps({"error": why}), "application/json")
        found = list_page(settings(), after, limit)
        data = {
            "locks": [_public(i.to_json(time.time())) for i in found.value[0]],
            "next": found.value[1],
            "limit": limit,
            "errors": [f"{x.node}: {x.error}" for x in found.errors],
        }
        return _respond(start, "200 OK", json.dumps(data), "application/json")

    def explain_page(environ: dict[str, Any], start: StartResponse, *, as_json: bool) -> list[bytes]:
        query = parse_qs(environ.get("QUERY_STRING", ""))
        found, why = _explained(app, query)
        status = "200 OK" if found is not None else "400 Bad Request"
        if as_json:
            data = {"error": why} if found is None else _explanation_json(found, time.time())
            return _respond(start, status, json.dumps(data), "application/json")
        base = environ.get("SCRIPT_NAME", "").rstrip("/")
        return _respond(start, status, render_explain_page(found, why, base, query))

    hosts = None if allowed_hosts is None else {h.lower() for h in allowed_hosts}

    def wsgi(environ: dict[str, Any], start: StartResponse) -> Iterable[bytes]:
        path = environ.get("PATH_INFO", "/") or "/"
        if hosts is not None and _host_name(environ.get("HTTP_HOST", "")) not in hosts:
            logger.warning("locks web: refused a request for host %r", environ.get("HTTP_HOST", "")[:100])
            return _respond(start, "403 Forbidden", "unknown host\n", "text/plain; charset=utf-8")
        probe = health_route(path, settings)
        if probe is not None:
            return probe(environ, start)
        if path in ("/", ""):
            return page(environ, start)
        if path == "/metrics":
            return metrics(environ, start)
        if path == "/release":
            return release(environ, start)
        if path == "/locks.json":
            return locks_json(environ, start)
        if path in ("/explain", "/explain.json"):
            return explain_page(environ, start, as_json=path.endswith(".json"))
        return _respond(start, "404 Not Found", "not found\n", "text/plain; charset=utf-8")

    return wsgi


def _cursor_key(cursor: str) -> tuple[str, str]:
    """What a ``/locks.json`` cursor names: the last key of the page before, or for a key longer than
    :data:`CURSOR_KEY` characters its first ones and a digest of it (``(head, digest)``; ``("", "")``: from the
    first key). Any key is a valid place to start (the next page is the keys after it), so a cursor made up by hand
    can only move where the listing starts, never past the prefix."""
    if not cursor:
        return "", ""
    if len(cursor) > MAX_CURSOR:
        raise ValueError(cursor)
    text, _, digest = cursor.partition(".")
    try:
        raw = text.encode("ascii") + b"=" * (-len(text) % 4)
        return base64.b64decode(raw, altchars=b"-_", validate=True).decode("utf-8"), digest
    except (ValueError, UnicodeError):  # binascii.Error is a ValueError
        raise ValueError(cursor) from None


def _digest(key: str) -> str:
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()[:24]


def _cursor_of(key: str) -> str:
    """The cursor after ``key``: the key itself (base64), or past :data:`CURSOR_KEY` characters (a URL has a
    bounded length) its first ones and a digest of the whole."""
    head = key[:CURSOR_KEY]
    text = base64.urlsafe_b64encode(head.encode("utf-8", "surrogatepass")).decode("ascii").rstrip("=")
    return text if head == key else f"{text}.{_digest(key)}"


def _start(keys: Sequence[str], head: str, digest: str) -> int:
    """Where the page after the cursor ``(head, digest)`` starts in the sorted ``keys``."""
    if not digest:
        return bisect.bisect_right(keys, head)
    at = bisect.bisect_left(keys, head)
    for i in range(at, len(keys)):  # the long keys sharing those first characters, in order
        if not keys[i].startswith(head):
            break
        if _digest(keys[i]) == digest:
            return i + 1
    return at  # the key is gone: start at its first characters (a key may be listed twice, none is missed)


def _limit(text: str) -> int:
    """``?limit=``: a whole number from 1 to :data:`JSON_MAX_LIMIT` (ValueError otherwise)."""
    limit = int(text.strip()[:8])
    if not 1 <= limit <= JSON_MAX_LIMIT:
        raise ValueError(text)
    return limit


def list_page(settings: LockSettings, after: tuple[str, str], limit: int) -> Report[tuple[list[LockInfo], str | None]]:
    """The ``limit`` keys after the cursor ``after`` (:func:`_cursor_key`), by key (done markers and pending
    bursts included), read and merged, and the cursor of the next page (None: this was the last). Only the page's
    keys are read in full."""
    scanned = scan_keys(settings, done=True)
    down = [settings.nodes.names.index(x.node) for x in scanned.errors]
    bursts = scan_bursts(settings, skip=down)
    pending = {burst_key_for(k): k for k in bursts.value}
    keys = sorted({k for k in scanned.value if k not in pending and not k.endswith(":debounce")} | set(pending))
    at = _start(keys, *after) if after[0] else 0
    shown = keys[at : at + limit]
    read = read_keys(settings, [k for k in shown if k not in pending], skip=down)
    infos: list[LockInfo] = []
    for key in shown:
        if key in pending:
            info = read_burst(settings, pending[key])
        else:
            info = merge(key, read.value[key], settings.nodes.quorum, prefix=settings.prefix)
        if info is not None:
            infos.append(info)
    more = _cursor_of(shown[-1]) if at + limit < len(keys) and shown else None
    errors = scanned.errors + bursts.errors + read.errors
    return Report((infos, more), errors, len(settings.nodes), settings.nodes.quorum)


def _parse_call(app: Any, task_name: str, args: str, kwargs: str) -> tuple[Any, list[Any], dict[str, Any]]:
    """The LockedTask and arguments of a call typed on the page (``args``/``kwargs`` as JSON, as ``celery call``
    takes them); ConfigurationError saying what to change."""
    task = getattr(app, "tasks", {}).get(task_name)
    if task is None or not callable(getattr(task, "lock_key_for", None)):
        raise ConfigurationError(f"no LockedTask named {task_name!r} in this app")
    try:
        call_args, call_kwargs = json.loads(args or "[]"), json.loads(kwargs or "{}")
    except ValueError as exc:
        raise ConfigurationError(f"args and kwargs must be JSON, e.g. [7] and {{}} ({str(exc)[:200]})") from None
    if not isinstance(call_args, list) or not isinstance(call_kwargs, dict):
        raise ConfigurationError("args must be a JSON list and kwargs a JSON object, e.g. [7] and {}")
    return task, call_args, call_kwargs


def _key_of_call(app: Any, task_name: str, args: str, kwargs: str) -> tuple[str, str]:
    """The lock key of a call (``args``/``kwargs`` as JSON, as ``celery call`` takes them) and what the page says:
    ``(key, "")``, or ``("\x00", why)`` when there is none (a search nothing matches)."""
    try:
        task, call_args, call_kwargs = _parse_call(app, task_name, args, kwargs)
    except ConfigurationError as exc:
        return "\x00", str(exc)
    try:
        key = str(task.lock_key_for(*call_args, **call_kwargs))
    except (TypeError, ValueError, ConfigurationError) as exc:
        return "\x00", f"{task_name}: these arguments give no lock key ({type(exc).__name__}: {str(exc)[:200]})"
    return key, f"{task_name}(*{args}, **{kwargs}) locks {key}"


def _explained(app: Any, query: Mapping[str, list[str]]) -> tuple[Explanation | None, str]:
    """``locks explain`` of ``?key=`` or of the call ``?task=&args=&kwargs=``, or None and what to change."""
    task_name = query.get("task", [""])[0].strip()[:200]
    key = query.get("key", [""])[0]
    try:
        if task_name:
            task, args, kwargs = _parse_call(
                app, task_name, query.get("args", ["[]"])[0], query.get("kwargs", ["{}"])[0]
            )
            return explain(app, task.name, args, kwargs), ""
        if key:
            return explain_key(app, key), ""
    except (TypeError, ValueError, LockError) as exc:  # ConfigurationError, UnserializableArgumentsError: both
        return None, str(exc)[:400]
    return None, "name a key (?key=) or a call (?task=&args=&kwargs=, the arguments as JSON)"


def _explanation_json(found: Explanation, now: float) -> dict[str, Any]:
    """An explanation's JSON without owner tokens or stored records (:func:`_public`)."""
    data = found.to_json(now)
    data["slots"] = [None if s is None else _public(s) for s in data["slots"]]
    data["burst"] = None if data["burst"] is None else _public(data["burst"])
    data["done"] = [_public(d) for d in data["done"]]
    return data


def _host_name(host: str) -> str:
    """The name in a ``Host`` header, without its port (``[::1]:8089`` -> ``[::1]``)."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[: host.find("]") + 1] if "]" in host else host
    return host.rsplit(":", 1)[0] if ":" in host else host


def _public(data: dict[str, Any]) -> dict[str, Any]:
    """A lock's JSON without its owner token (the holder's own secret for release and renewal)."""
    data = dict(data)
    data.pop("owner", None)
    data.pop("record", None)
    return data


def serve(wsgi: WSGIApp, host: str = "127.0.0.1", port: int = 8089) -> Any:
    """A threaded stdlib WSGI server for ``wsgi`` (``serve_forever()`` it; ``server_address`` has the port)."""
    from socketserver import ThreadingMixIn  # noqa: PLC0415
    from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server  # noqa: PLC0415

    class Server(ThreadingMixIn, WSGIServer):
        daemon_threads = True

    class Quiet(WSGIRequestHandler):
        def log_message(self, format: str, *args: Any) -> None:
            logger.info("%s %s", self.address_string(), format % args)

    return make_server(host, port, cast(Any, wsgi), server_class=Server, handler_class=Quiet)
