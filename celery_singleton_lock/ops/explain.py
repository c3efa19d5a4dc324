"""``celery locks explain TASK --args JSON --kwargs JSON``: what would happen to that call now, and why.

The call's key is the task's own (``lock_key_for``, ``lock_rate_key_for``, ``lock_limit_for``); everything else is
read with :mod:`celery_singleton_lock.inventory`'s readers: the holder of each slot (merged over the nodes, with each
node's answer when they disagree), the waiting line against ``lock_max_waiting``, the rate log of each node, a
pending debounced burst, and the done markers of the key's finished task ids. Nothing is written: the answer is a
reading of the nodes at one moment, and the call itself may find them changed.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..errors import ConfigurationError
from ..lock.config import LockSettings, settings_for
from ..lock.inventory import (
    LockInfo,
    NodeState,
    RateWindow,
    _glob_escape,
    done_marker_of,
    format_duration,
    line_of,
    merge,
    read_burst,
    read_keys,
    read_rate,
    scan_keys,
)
from ..lock.nodes import NodeError
from ..lock.record import COOLDOWN, slot_keys
from ..policies.limit import LIMIT
from ..policies.rate import RATE_FEATURE

__all__ = ["Explanation", "explain", "explain_key", "explanation_facts", "format_explanation", "lock_of_key"]

#: Done markers listed at most (the JSON has the same bound).
MAX_DONE = 10
#: The highest slot number a key is read as (``name:slot:<i>``, see ``lock_limit``); above, a key is its own lock.
MAX_SLOT = 100_000


@dataclass
class Explanation:
    """What a call would meet now: the verdict, why, and every fact read."""

    task: str
    key: str | None  # None: lock_limit=None (no lock)
    verdict: str  # runs, skipped, fails, waits, replaces, cancels, joins-burst, unavailable, ...
    why: list[str]
    slots: list[LockInfo | None] = field(default_factory=list)
    disagreements: dict[str, list[str]] = field(default_factory=dict)  # slot key -> each node's answer
    line: int | None = None
    cap: int | None = None
    rate_key: str | None = None
    rate: str | None = None
    rate_windows: list[RateWindow | None] = field(default_factory=list)
    rate_frees_in: float | None = None  # seconds until a quorum of nodes has a free share (0: now)
    burst: LockInfo | None = None
    done: list[LockInfo] = field(default_factory=list)
    errors: list[NodeError] = field(default_factory=list)
    quorum: int = 1
    total: int = 1

    def to_json(self, now: float) -> dict[str, Any]:
        """A JSON-ready dict."""
        return {
            "task": self.task,
            "key": self.key,
            "verdict": self.verdict,
            "why": self.why,
            "slots": [None if s is None else s.to_json(now) for s in self.slots],
            "disagreements": self.disagreements,
            "line": {"waiting": self.line, "cap": self.cap},
            "rate": None
            if self.rate_key is None
            else {
                "key": self.rate_key,
                "rate": self.rate,
                "frees_in": self.rate_frees_in,
                "nodes": [
                    None if w is None else {"node": w.node, "starts_ago": list(w.starts), "frees_in": w.frees_in}
                    for w in self.rate_windows
                ],
            },
            "burst": None if self.burst is None else self.burst.to_json(now),
            "done": [d.to_json(now) for d in self.done],
            "errors": [f"{e.node}: {e.error}" for e in self.errors],
            "quorum": self.quorum,
            "total": self.total,
        }


def _node_answer(state: NodeState | None) -> str:
    if state is None:
        return "no answer"
    if state.owner is not None:
        job = state.record.get("job") or "-"
        return f"{state.node}: {state.record.get('state', 'held')} by task {job} (fence {state.fence or '-'})"
    return f"{state.node}: {'a Redis ' + state.redis_type if state.present else 'free'}"


def _holder(info: LockInfo, now: float) -> str:
    since = ""
    if info.acquired_at is not None:
        stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(info.acquired_at))
        since = f" since {stamp} ({format_duration(info.age(now))} ago)"
    fence = f", fencing token {info.fencing_token}" if info.fencing_token is not None else ""
    return f"task {info.task_id or '?'} on {info.worker or '?'}{since}{fence}"


def _quorum_wait(windows: Sequence[RateWindow | None], quorum: int) -> float | None:
    """Seconds until a quorum of the nodes that answered has room (the quorum-th soonest); None: too few answered."""
    waits = sorted(w.frees_in for w in windows if w is not None)
    return waits[quorum - 1] if len(waits) >= quorum else None


def _locked_tasks(app: Any) -> dict[str, Any]:
    return {n: t for n, t in app.tasks.items() if getattr(t, "_singleton_lock_task", False)}


def explain(app: Any, task_name: str, args: Sequence[Any], kwargs: Mapping[str, Any]) -> Explanation:
    """Read the nodes and say what ``task_name(*args, **kwargs)`` would meet now."""
    task = _locked_tasks(app).get(task_name)
    if task is None:
        known = sorted(_locked_tasks(app))
        raise ConfigurationError(f"{task_name!r} is not a LockedTask of this app; LockedTasks: {', '.join(known)}")
    settings: LockSettings = settings_for(app)
    limit = task.lock_limit_for(*args, **kwargs)
    key = task.lock_key_for(*args, **kwargs) if limit is not None else None
    out = Explanation(task_name, key, "runs", [], quorum=settings.nodes.quorum, total=len(settings.nodes))
    held = _read_lock(out, settings, task, key, limit or 1) if key is not None else []
    if task.lock_rate is not None:
        limits = RATE_FEATURE.limits_of(task)  # stacked: the first limit's log is read (its key is the rate key)
        rate = limits[0].window
        out.rate_key = task.lock_rate_key_for(*args, **kwargs)
        out.rate = " and ".join(str(limit.window) for limit in limits)
        if out.rate_key is not None:
            windows = read_rate(settings, out.rate_key, rate.limit, rate.period)
            out.rate_windows = windows.value
            out.errors += [e for e in windows.errors if e not in out.errors]
            out.rate_frees_in = _quorum_wait(windows.value, settings.nodes.quorum)
    _decide(out, task, settings, limit, held)
    return out


def lock_of_key(key: str) -> str:
    """The lock a key belongs to: a slot key's (``lock_limit``: ``name:slot:<i>``) or a done marker's lock, else
    the key itself.

    >>> from celery_singleton_lock.record import done_key_for, slot_keys
    >>> names = ["p:t:v2:ab", "p:{x}t", "p:t}", "p:{}t", "p:a{b"]
    >>> all({lock_of_key(k) for k in slot_keys(n, 3)} == {n} for n in names)
    True
    >>> lock_of_key(done_key_for("p:t:v2:ab", "task-7")), lock_of_key("p:t:slot:0"), lock_of_key("p:t:slot:\u00b2")
    ('p:t:v2:ab', 'p:t:slot:0', 'p:t:slot:²')
    """
    marker = done_marker_of(key)
    if marker is not None:
        return marker[0]
    at = key.rfind(":slot:")
    digits = key[at + len(":slot:") :].partition("{")[0] if at != -1 else ""
    number = int(digits) if digits.isascii() and digits.isdigit() and len(digits) < len(str(MAX_SLOT)) else 0
    if not 1 <= number < MAX_SLOT:
        return key
    head = key[:at]
    # name:slot:i and name:slot:i{tag}; or a sibling form, {tag}name:slot:i or {name}:slot:i (as done_marker_of)
    locks = [head]
    if head.startswith("{"):
        locks.insert(0, head[head.find("}") + 1 :])
        if head.endswith("}"):
            locks.insert(0, head[1:-1])
    for lock in locks:
        if lock and slot_keys(lock, number + 1)[-1] == key:
            return lock
    return key


def _task_of_lock(app: Any, prefix: str, lock: str) -> Any:
    """The LockedTask whose keys ``lock`` is one of (``prefix`` + its ``lock_group`` or name + ``:``), or None."""
    rest = lock[len(prefix) :] if lock.startswith(prefix) else None
    if rest is None:
        return None
    found = [t for t in _locked_tasks(app).values() if rest.startswith(f"{t.lock_group or t.name}:")]
    return max(found, key=lambda t: (len(t.lock_group or t.name), t.name), default=None)


def explain_key(app: Any, key: str) -> Explanation:
    """Read the nodes and say what a call locking ``key`` (a lock, a slot or a done marker under the app's prefix)
    would meet now. The policy is the task the key names (or its holder record does); its rate needs the call's
    arguments (``lock_rate_on``): :func:`explain` reads it."""
    settings: LockSettings = settings_for(app)
    if not key.startswith(settings.prefix):
        raise ConfigurationError(f"{key[:200]!r} is not a key under this app's prefix {settings.prefix!r}")
    lock = lock_of_key(key)
    task = _task_of_lock(app, settings.prefix, lock)
    name = "" if task is None else task.name
    out = Explanation(name, lock, "runs", [], quorum=settings.nodes.quorum, total=len(settings.nodes))
    limit = 1 if task is None else LIMIT.static(type(task))
    held = _read_lock(out, settings, task, lock, limit)
    if not any(out.slots) and not out.line and out.burst is None and not out.done and out.verdict != "unavailable":
        out.why.append(f"nothing is under {lock} now: no holder, cooldown, waiting line, pending burst or done marker")
    named = next((s.task_name for s in out.slots if s is not None and s.task_name), None)
    if task is None and named in _locked_tasks(app):  # a lock_key() key names no task: its holder record does
        task, out.task = _locked_tasks(app)[named], str(named)
    if task is None:
        out.task = named or "?"
        out.verdict = "unavailable" if out.verdict == "unavailable" else ("held" if held else "free")
        out.why.append(
            f"no LockedTask of this app makes {lock} (a Redlock, a beat claim or another app's task): "
            "what the nodes hold is shown, no task's policy applies"
        )
        out.why += [f"{i.key} is {i.state} by {_holder(i, time.time())}" for i in held]
        return out
    if LIMIT.varies(type(task)):
        out.why.append("lock_limit is a function of the arguments: only the first slot is read (explain the call)")
    if task.lock_rate is not None:
        out.rate = " and ".join(str(limit.window) for limit in RATE_FEATURE.limits_of(task))
        out.why.append(f"lock_rate={out.rate} counts per call (lock_rate_on): explain the call to read its windows")
    _decide(out, task, settings, limit, held)
    return out


def _read_lock(out: Explanation, settings: LockSettings, task: Any, key: str, limit: int) -> list[LockInfo]:
    """Read lock ``key``'s ``limit`` slots, its line, burst and done markers into ``out``; the slots held."""
    nodes = settings.nodes
    held: list[LockInfo] = []
    keys = list(slot_keys(key, limit))
    read = read_keys(settings, keys)
    out.errors += read.errors
    if not read.ok:
        policy = settings.on_unavailable if task is None else task.lock_on_unavailable or settings.on_unavailable
        out.verdict = "unavailable"
        out.why.append(
            f"only {read.answered} of {read.total} lock node(s) answered (quorum {read.quorum}): "
            f"lock_on_unavailable={policy!r} decides"
        )
    for k in keys:
        states = read.value[k]
        info = merge(k, states, nodes.quorum, prefix=settings.prefix)
        out.slots.append(info)
        answers = {_node_answer(s).split(": ", 1)[-1] for s in states if s is not None}
        if len(answers) > 1:
            out.disagreements[k] = [_node_answer(s) for s in states]
        if info is not None and info.kind in ("task", "lock", "beat") and info.state != "partial":
            held.append(info)
    out.line = line_of(settings, key)
    out.cap = None if task is None else task.lock_max_waiting
    out.burst = read_burst(settings, key)
    prefix_len = len(settings.prefix) if key.startswith(settings.prefix) else 0
    scanned = scan_keys(settings, match=_glob_escape(key[prefix_len:]) + "*", done=True)
    markers = [k for k in scanned.value if (done_marker_of(k) or ("",))[0] == key][:MAX_DONE]
    if markers:
        done_read = read_keys(settings, markers)
        infos = (merge(k, s, nodes.quorum, prefix=settings.prefix) for k, s in done_read.value.items())
        out.done = [i for i in infos if i is not None]
    return held


def _decide(out: Explanation, task: Any, settings: LockSettings, limit: int | None, held: list[LockInfo]) -> None:
    """The verdict of ``task``'s policy over what :func:`_read_lock` (and the rate reading) put in ``out``."""
    now = time.time()
    key = out.key
    on_duplicate = "reschedule" if task.lock_debounce else task.lock_on_duplicate or settings.on_duplicate
    if out.verdict == "unavailable":
        return
    if key is None:
        out.why.append("lock_limit=None: no lock, any number of runs at once")
    elif task.lock_debounce:
        if out.burst is not None:
            out.verdict = "joins-burst"
            out.why.append(
                f"a debounced burst is pending: task {out.burst.task_id} is due in "
                f"{format_duration(out.burst.ttl)}; this call joins it, pushes it back by lock_debounce="
                f"{task.lock_debounce:g}s and its arguments replace call #{out.burst.record.get('seq', '?')}'s"
            )
        else:
            out.verdict = "starts-burst"
            out.why.append(f"no burst pending: this call starts one, run after lock_debounce={task.lock_debounce:g}s")
    if key is not None and not task.lock_debounce and len(held) >= (limit or 1):
        first = min(held, key=lambda i: i.ttl if i.ttl is not None else float("inf"))
        for info in held:
            what = "in its cooldown" if info.record.get("state") == COOLDOWN else f"held ({info.state})"
            ttl = format_duration(info.ttl, none="never")
            out.why.append(f"{info.key} is {what} by {_holder(info, now)}; its lease ends in {ttl} unless renewed")
        if all(i.record.get("state") == COOLDOWN for i in held):
            out.why.append(f"the cooldown ends in {format_duration(first.ttl)} (lock_cooldown={task.lock_cooldown:g}s)")
        if on_duplicate == "skip":
            out.verdict = "skipped"
            out.why.append("lock_on_duplicate='skip': the call is not run (its result names the holder)")
        elif on_duplicate == "fail":
            out.verdict = "fails"
            out.why.append("lock_on_duplicate='fail': the call fails with DuplicateTaskError")
        elif on_duplicate == "replace":
            out.verdict = "replaces"
            out.why.append(
                "lock_on_duplicate='replace': it waits in the key's line after the holder, and an older waiting call "
                "is superseded by it (REVOKED); the holder runs to its end"
            )
        elif on_duplicate == "cancel":
            out.verdict = "cancels"
            out.why.append(
                "lock_on_duplicate='cancel': the running holder is asked to stop (its watchdog sees it within one "
                "renewal interval); this call waits in the key's line and runs after it, never beside it"
            )
        elif out.cap is not None and out.line is not None and out.line >= out.cap:
            out.verdict = "refused"
            out.why.append(f"the line is full: {out.line} waiting, lock_max_waiting={out.cap}")
        else:
            out.verdict = "waits"
            place = "?" if out.line is None else str(out.line + 1)
            cap = f" of cap {out.cap}" if out.cap is not None else ""
            out.why.append(f"lock_on_duplicate='reschedule': it joins the line at place {place}{cap}")
    elif key is not None and not task.lock_debounce:
        free = (limit or 1) - len(held)
        out.why.append(f"{free} of {limit or 1} slot(s) of {key} free: the lock would be taken")
    if out.rate_frees_in is not None and out.rate_frees_in > 0 and out.verdict == "runs":
        out.verdict = {"wait": "rate-waits", "skip": "rate-skipped", "fail": "rate-fails"}[task.lock_on_rate_limit]
        out.why.append(
            f"the rate {out.rate} is used up on a quorum of the nodes: a share frees in "
            f"{format_duration(out.rate_frees_in)} (lock_on_rate_limit={task.lock_on_rate_limit!r})"
        )
    elif out.rate_frees_in is not None and out.verdict == "runs":
        out.why.append(f"the rate {out.rate} has room now")


def explanation_facts(found: Explanation, now: float) -> list[tuple[str, str]]:
    """The facts read, one ``(label, text)`` a line (label ``""``: more of the line above); no owner token."""
    facts = [("key", found.key or "-")]
    for info in found.slots:
        if info is not None and info.kind in ("task", "lock", "beat"):
            facts.append(("holder", f"{info.key}: {info.state} by {_holder(info, now)}"))
    for slot, answers in found.disagreements.items():
        facts.append(("nodes differ", f"{slot}:"))
        facts += [("", a) for a in answers]
    if found.key is not None:
        cap = f" (cap {found.cap}: lock_max_waiting)" if found.cap is not None else ""
        facts.append(("line", f"{'?' if found.line is None else found.line} waiting{cap}"))
    if found.rate_key is not None:
        frees = "?" if found.rate_frees_in is None else format_duration(found.rate_frees_in)
        facts.append(("rate", f"{found.rate} on {found.rate_key}: a share frees in {frees}"))
        for w in found.rate_windows:
            if w is not None:
                ago = ", ".join(format_duration(a) for a in w.starts) or "none"
                facts.append(("", f"{w.node}: starts {ago} ago; room in {format_duration(w.frees_in)}"))
    if found.burst is not None:
        args = found.burst.record.get("args", "")
        facts.append(
            (
                "burst",
                f"task {found.burst.task_id} due in {format_duration(found.burst.ttl)}, with call "
                f"#{found.burst.record.get('seq', '?')}'s arguments {args[:120]}",
            )
        )
    for done in found.done:
        facts.append(("done marker", f"task {done.task_id} finished; marker ends in {format_duration(done.ttl)}"))
    facts += [("error", f"node {e.node} did not answer: {e.error}") for e in found.errors]
    return facts


def format_explanation(found: Explanation, now: float) -> str:
    """The verdict, why, then the facts read: one a line."""
    lines = [f"{found.task}: {found.verdict}"]
    lines += [f"  because {w}" for w in found.why]
    lines += [f"{label:<12} {text}" if label else f"{'':15}{text}" for label, text in explanation_facts(found, now)]
    return "\n".join(lines)
