"""The locks page and the ``/explain`` page as HTML: every value escaped (task ids and keys are user data), no owner
token (a release form carries a digest of it), the only script the page's own, under its nonce."""

from __future__ import annotations

import html
import json
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any
from urllib.parse import quote, urlencode

from ...lock.inventory import LockInfo, burst_line, format_duration, holder_label
from ...lock.metrics import OUTCOMES
from ..doctor import Finding
from ..explain import Explanation, explanation_facts
from .reading import PAGE_SIZE, Snapshot
from .release import owner_digest

#: Keys up to this many characters link to their explanation (``/explain?key=``); a longer one would make a URL
#: servers refuse (its call, searched for on the page, is explained).
EXPLAIN_LINK = 4096

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


def e(value: object) -> str:
    """``value`` as HTML text or attribute (quotes escaped too)."""
    return html.escape("" if value is None else str(value), quote=True)


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
    :func:`~.release.owner_digest`); the release is owner-checked as ``celery locks release`` is."""
    return (
        f'<form class="release" method="post" action="{e(base)}/release">'
        f'<input type="hidden" name="key" value="{e(i.key)}">'
        f'<input type="hidden" name="owner" value="{e(owner_digest(i.owner))}">'
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
    parts = [
        "<!doctype html><html><head><meta charset='utf-8'><title>celery_singleton_lock</title>",
        f"<style>{STYLE}</style></head><body>",
        f"<h1>Locks under <code>{e(prefix)}</code></h1>",
        *_status(snap, base, refresh),
    ]
    if message:
        parts.append(f'<p class="warn" id="message">{e(message)}</p>')
    parts += _search(base, search, call)
    parts.append(explanation)
    parts += _held(snap, page, base, release=release)
    parts += _lines(snap, page, base)
    parts += _pending(snap, page, base)
    parts += _reservations(snap, page, base, release=release)
    parts += _beat_and_done(snap, page, base, release=release, opened=bool(search))
    parts += _foreign(snap, page, base)
    parts += _last_hour(series[1])
    parts += _doctor(findings)
    parts += _reload(refresh, nonce, reload_to)
    parts.append("</body></html>")
    return "".join(parts)


def _counts(snap: Snapshot) -> dict[str, int]:
    """Keys per section (``pending``: debounced bursts)."""
    return {name: n for name, (n, _) in snap.sections.items()}


def _status(snap: Snapshot, base: str, refresh: float) -> list[str]:
    """The nodes that answered, what each section counts, the nodes that did not answer and the partial records."""
    counts = _counts(snap)
    partial = sum(b.state == "partial" for b in snap.briefs if b.kind not in ("done", "foreign"))
    status = "ok" if snap.answered >= snap.quorum and not snap.errors else "err"
    parts = [
        f'<p class="{status}" id="nodes">{snap.answered} of {snap.total} lock node(s) answered (quorum {snap.quorum}); '
        f"{counts['held']} held, {sum(x.length for x in snap.lines)} waiting, {counts['reserved']} reserved, "
        f"{counts['cooldown']} cooling down, {counts.get('pending', 0)} debounced run(s) pending, "
        f"{counts['beat']} beat claims, {counts['done']} done markers. "
        f'<span class="muted">Read at {e(time.strftime("%H:%M:%S", time.gmtime(snap.now)))} UTC'
        f"{f'; refreshes every {refresh:g}s' if refresh else ''}. "
        f'<a href="{e(base)}/metrics">/metrics</a></span></p>'
    ]
    parts += [f'<p class="err">node {e(error.node)} did not answer: {e(error.error)}</p>' for error in snap.errors]
    if partial:
        parts.append(
            f'<p class="err" id="partial">{partial} partial record(s): on fewer than a quorum of nodes, they guard '
            "nothing (a cooldown or reservation there lets a second call run); highlighted below</p>"
        )
    return parts


def _search(base: str, search: str, call: tuple[str, str, str]) -> list[str]:
    """The search box: a part of a key or a task's name, or a call whose key to find."""
    task, args, kwargs = call
    parts = [
        f'<form method="get" action="{e(base)}/" id="search">'
        f'<input name="q" value="{e(search if not task else "")}" placeholder="key part or task name" size="30"> '
        f"<button>search</button> <span class='muted'>or a call:</span> "
        + _call_inputs(task, args, kwargs, "find its key")
        + (f' <a href="{e(base)}/">clear</a>' if search else "")
        + "</form>"
    ]
    if search:
        parts.append(f'<p class="muted" id="searched">only keys containing <code>{e(search)}</code></p>')
    return parts


def _held(snap: Snapshot, page: int, base: str, *, release: bool) -> list[str]:
    """The held locks (a release form each, when releasing is on)."""
    shown = snap.sections["held"][1]
    head = ["key", "state", "task", "holder task id", "worker", "age", "time left", "fencing token", "nodes"]
    parts = [
        "<h2>Held</h2>",
        _nav(snap.sections["held"][0], page, base),
        _table(
            [*head, "release"] if release else head,
            _held_rows(snap, shown, base, release=release),
            "held",
            [_mark(i) for i in shown],
        ),
    ]
    if not release:
        parts.append('<p class="muted">Read-only: start with a secret to release locks here.</p>')
    return parts


def _lines(snap: Snapshot, page: int, base: str) -> list[str]:
    """The waiting lines, each with its oldest waiters in order."""
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
    return [
        "<h2>Lines (waiting duplicates, oldest first)</h2>",
        nav,
        _table(["key", "task", "waiting", "order"], rows, "lines"),
    ]


def _pending(snap: Snapshot, page: int, base: str) -> list[str]:
    """The debounced bursts waiting to run, and the durable cancels still pending."""
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
    cancels = [
        [f"<code>{e(key)}</code>", f"<code>{e(task_id)}</code>", e(by), e(format_duration(max(0.0, at - snap.now)))]
        for key, task_id, by, at in snap.cancels
    ]
    return [
        "<h2>Pending debounced runs</h2>",
        _nav(count, page, base),
        _table(
            ["key", "state", "task", "job's task id", "runs in", "with", "nodes"],
            rows,
            "pending",
            [_mark(i) for i in pending],
        ),
        "<h2>Pending cancels</h2>",
        _table(["key", "task id", "cancelled by", "dropped for"], cancels, "cancels"),
    ]


def _reservations(snap: Snapshot, page: int, base: str, *, release: bool) -> list[str]:
    """The queue-scope reservations and the cooldowns (a release form each, when releasing is on)."""
    parts: list[str] = []
    for title, section, cls in (
        ("Queue-scope reservations", "reserved", "reserved"),
        ("Cooldowns", "cooldown", "cooldowns"),
    ):
        count, shown = snap.sections[section]
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
        parts += [f"<h2>{e(title)}</h2>", _nav(count, page, base), table]
    return parts


def _beat_and_done(snap: Snapshot, page: int, base: str, *, release: bool, opened: bool) -> list[str]:
    """The beat claims and the done markers, folded away unless the page shows a search."""
    is_open = " open" if opened else ""
    count, shown = snap.sections["beat"]
    head = ["key", "state", "task", "holder task id", "claimed by", "age", "time left", "fencing token", "nodes"]
    parts = [
        f'<details id="beat"{is_open}><summary>{count} beat claim(s): one per schedule slot, kept about a '
        "minute (show)</summary>",
        _nav(count, page, base),
        _table(
            [*head, "release"] if release else head,
            _held_rows(snap, shown, base, release=release),
            "beat",
            [_mark(i) for i in shown],
        ),
        "</details>",
    ]
    count, done = snap.sections["done"]
    rows = [
        [_key_cell(i.lock_key, base), f"<code>{e(i.task_id)}</code>", e(format_duration(i.ttl, none="never"))]
        for i in done
    ]
    return [
        *parts,
        f'<details id="done"{is_open}><summary>{count} done marker(s): finished task ids, not locks (show)</summary>',
        _nav(count, page, base),
        _table(["lock", "task id", "time left"], rows, "done"),
        "</details>",
    ]


def _foreign(snap: Snapshot, page: int, base: str) -> list[str]:
    """Other keys under the prefix (none of this package's), if any."""
    count, shown = snap.sections["foreign"]
    if not shown:
        return []
    rows = [[f"<code>{e(i.key)}</code>", e(i.redis_type)] for i in shown]
    return ["<h2>Other keys under the prefix</h2>", _nav(count, page, base), _table(["key", "type"], rows, "foreign")]


def _last_hour(per_task: Mapping[str, Sequence[Mapping[str, int]]]) -> list[str]:
    """A chart per task of its outcomes a minute, the last hour, and the colours' legend."""
    parts = ["<h2>Last hour per task</h2>"]
    if not per_task:
        return [*parts, '<p class="muted">nothing counted in the last hour</p>']
    for task, minutes in per_task.items():
        totals: Counter[str] = Counter()
        for m in minutes:
            totals.update(m)
        summary = ", ".join(f"{e(o)} {n}" for o, n in totals.most_common())
        title = f'<b>{e(task or "-")}</b> <span class="muted">{summary}</span>'
        parts.append(f'<div class="chart"><div>{title}</div>{chart(minutes)}</div>')
    legend = "".join(f'<span style="color:{c}">&#9632; {e(o)}</span>' for o, c in COLOURS.items())
    return [*parts, f'<p class="legend">{legend}</p>']


def _doctor(findings: Sequence[Finding] | None) -> list[str]:
    """The doctor's findings that are not ok (the ok ones counted), or that it was not run."""
    parts = ["<h2>Doctor</h2>"]
    if findings is None:
        return [*parts, '<p class="muted">not run</p>']
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
    return parts


def _reload(refresh: float, nonce: str, reload_to: str | None) -> list[str]:
    """The page's one script: reload every ``refresh`` s (0: never) unless the operator is typing a secret (a reload
    would lose it). The answer to a release (a POST) loads the page instead: reloading it would send the form, and
    the release, again at every refresh."""
    if not refresh:
        return []
    again = "location.reload()"
    if reload_to is not None:
        target = json.dumps(reload_to).replace("<", "\\u003c")  # no "</script>" can end the script
        again = f"location.replace({target})"
    return [
        f'<script nonce="{nonce}">setInterval(function(){{var a=document.activeElement;'
        f"if(!a||a.tagName!=='INPUT'){again}}},{int(refresh * 1000)});</script>"
    ]
