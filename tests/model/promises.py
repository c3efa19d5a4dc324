"""The README's promises written as code: given what a schedule did (calls, runs, final states, faults), the
violations of the promises of each task's options (an empty list: the record keeps every promise).

Small on purpose: each ``_check_*`` function is one row of the README's policy table (or one option), and reads
only the history. What it cannot know (when a message first reached a worker, the instant a worker decided) it
bounds with the margins below, so a violation it reports is a broken promise, never a timing guess.
"""

from __future__ import annotations

import itertools
import re
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from .rates import check_slowdown, check_windows, rate_ran, window_full

# Margins (seconds). Every time here is time.time() of one host (the workers, the test, the result backend's
# date_done) or a lock node's clock on that host (rate_started_at): one clock.
DECIDE = 0.5  # a worker's decision precedes its stored date_done by at most this (the store's round trip, load)
ORDER = 0.6  # two calls sent closer than this may reach workers in either order (prefetch, two workers)
COOLDOWN_CLOCK = 0.2  # the cooldown starts at the release, a little after the recorded end
CANCEL_SEEN = 1.0  # lock_on_duplicate="cancel": a run stops within ORDER + lock_ttl / 3 (its renewal) + this of a
# newer call's send (the newer call's refusal writes the request; the next renewal answers it; the body unwinds)


@dataclass(frozen=True)
class TaskOpts:
    """The options of one drawn task, as the spec gives them (tests/apps/model_app.py)."""

    name: str
    opts: dict[str, Any]

    @property
    def space(self) -> str:
        """The key space: the group's name, else the task's."""
        return str(self.opts.get("lock_group") or self.name)

    @property
    def policy(self) -> str:
        return "reschedule" if self.opts.get("lock_debounce") else str(self.opts.get("lock_on_duplicate", "skip"))

    def limit(self, key: str) -> int | None:
        limit = self.opts.get("lock_limit", 1)
        if limit == "per_key":
            return 2 if key.endswith("p") else 1
        if limit == "dialed":  # the schedule dials 1 or 2 while runs hold (suite.py's "dial" step): 2 at most
            return 2
        return None if limit is None else int(limit)

    @property
    def rate(self) -> bool:
        return self.opts.get("lock_rate") is not None


@dataclass
class Call:
    """One ``apply_async``: what the schedule sent and what it got back."""

    index: int
    task: str
    key: str
    ver: int
    sent: float  # time.time() just before the call
    returned: str | None  # the AsyncResult's id; None when delay() raised
    raised: str = ""  # the exception delay() raised, if any
    duration: float = 0.0
    fail: bool = False
    retries: int = 0
    revoked: bool = False  # the schedule revoked it (app.control.revoke)
    slow_publish: bool = False  # published through a slowed broker connection
    expires: float | None = None  # apply_async(expires=...) in seconds from ``sent``


@dataclass
class Attempt:
    """One start of a body, as the worker recorded it; ``end`` None: killed mid-run."""

    id: str
    task: str
    key: str
    ver: int
    attempt: int
    pid: int
    start: float
    rate_at: float | None
    end: float | None = None
    turn: list[int] | None = None  # lock_fair_on: [start number, turns waited, own value's calls ahead] (the node's)
    spent: list[int] | None = None  # rate_spent: [units applied (the difference), units reported]
    spent_at: float | None = None  # when rate_spent returned
    slowed: list[Any] | None = None  # it raised SlowDown: [retry_after, limit index or None]; its end is the raise


@dataclass
class Outcome:
    state: str  # SUCCESS, FAILURE, REVOKED, PENDING, ...
    reason: str = ""  # the exception's text (a REVOKED's reason, a FAILURE's error)
    done: float | None = None  # date_done, time.time()


@dataclass
class History:
    tasks: dict[str, TaskOpts]
    calls: list[Call]
    attempts: list[Attempt]
    outcomes: dict[str, Outcome]
    faults: list[tuple[float, str]] = field(default_factory=list)  # (time, "kill-child" | "kill-worker" | ...)

    def space_key(self, task: str, key: str) -> tuple[str, str]:
        return self.tasks[task].space, key


# -- helpers ---------------------------------------------------------------------------------------------------------


def _span(a: Attempt, h: History) -> tuple[float, float]:
    """When an attempt held its slot: start to end, or to the first kill after its start (a killed run)."""
    if a.end is not None:
        return a.start, a.end
    kills = [t for t, kind in h.faults if kind.startswith("kill") and t >= a.start]
    return a.start, min(kills) if kills else float("inf")


def _named(reason: str) -> str | None:
    """The task id a skip's, a failure's or a replacement's reason names."""
    if reason.startswith("DuplicateTaskError: "):  # its args: key, task name, holder
        return reason.rsplit(" ", 1)[-1]
    patterns = (r"held by task (\S+?)[ )]", r"held by task (\S+)$", r"one by task (\S+?)\)", r"task (\S+) finished;",
                r"superseded by task (\S+?):", r"cancelled by a newer call, task (\S+?):")  # fmt: skip
    for pattern in patterns:
        m = re.search(pattern, reason)
        if m:
            return m.group(1)
    return None


def _ran(h: History, task_id: str) -> list[Attempt]:
    """Completed final attempts of a task id (a retried attempt is not the job's end)."""
    return [a for a in h.attempts if a.id == task_id and rate_ran(h, a) and a.attempt >= _retries(h, task_id)]


def _retries(h: History, task_id: str) -> int:
    return max((c.retries for c in h.calls if c.returned == task_id), default=0)


def _by_space(h: History) -> dict[tuple[str, str], list[Call]]:
    out: dict[tuple[str, str], list[Call]] = defaultdict(list)
    for c in h.calls:
        out[h.space_key(c.task, c.key)].append(c)
    return out


def _faulted(h: History) -> bool:
    return bool(h.faults)


# -- the promises ----------------------------------------------------------------------------------------------------


def check(h: History) -> list[str]:
    """Every broken promise of the history, one line each."""
    out: list[str] = []
    for checker in (_check_ends, _check_limit, _check_duplicates, _check_once, _check_line, _check_replace_order,
                    _check_rate, _check_debounce, _check_cooldown, _check_queue_scope, _check_cancel,
                    _check_fair, check_windows, check_slowdown):  # fmt: skip
        out += checker(h)
    return out


def _worker_killed_after(h: History, sent: float) -> bool:
    return any(t >= sent for t, kind in h.faults if kind == "kill-worker")


def _check_ends(h: History) -> list[str]:
    """Every call ends (SUCCESS, FAILURE or REVOKED); none stays PENDING. Excused: a call whose message a whole
    worker's SIGKILL lost in kombu's Redis transport (docs/reliability.md, Finding 2) or that the schedule revoked."""
    out = []
    worker_kills = [t for t, kind in h.faults if kind == "kill-worker"]
    for c in h.calls:
        if c.returned is None or c.revoked:
            continue
        o = h.outcomes.get(c.returned)
        if o is None or o.state not in ("SUCCESS", "FAILURE", "REVOKED"):
            if any(t >= c.sent for t in worker_kills):
                continue
            out.append(f"call {c.index} ({c.task} {c.key} v{c.ver}, id {c.returned}) never ended: {o and o.state}")
    return out


def _check_limit(h: History) -> list[str]:
    """lock_limit=N: never more than N runs of a key at once (1 by default; None: no lock, nothing to check)."""
    out = []
    spaces: dict[tuple[str, str], list[Attempt]] = defaultdict(list)
    for a in h.attempts:
        spaces[h.space_key(a.task, a.key)].append(a)
    for (space, key), attempts in spaces.items():
        limit = min((h.tasks[a.task].limit(key) or 10**6) for a in attempts)
        events = sorted(
            [(s, 1, a.id) for a in attempts for s, _ in [_span(a, h)]]
            + [(e, -1, a.id) for a in attempts for _, e in [_span(a, h)]]
        )  # an end sorts before a start at the same instant
        now = 0
        for _, step, task_id in events:
            now += step
            if now > limit:
                out.append(f"{space}/{key}: {now} runs at once (limit {limit}), the last started {task_id}")
                break
    return out


def _check_duplicates(h: History) -> list[str]:
    """skip / fail: a duplicate skipped (REVOKED) or failed (DuplicateTaskError) names a holder: another call of the
    same key whose job held it then (ran around that time, or finished within its cooldown). A line that is full
    names its cap, a rate its rate; replace's "superseded" is checked with the order."""
    out = []
    ids = {c.returned: c for c in h.calls if c.returned}
    for c in h.calls:
        o = h.outcomes.get(c.returned or "")
        if c.raised:
            reason, done = c.raised, c.sent + DECIDE
            if "Duplicate" not in reason:
                out.append(f"call {c.index}: delay() raised {reason}")
                continue
        elif o is None or o.state not in ("REVOKED", "FAILURE") or c.revoked:
            continue
        else:
            reason, done = o.reason, o.done or 0.0
        if o is not None and o.state == "FAILURE" and "Duplicate" not in reason and not c.raised:
            if "RateLimited" in reason or "failing on purpose" in reason or "LockUnavailable" in reason:
                if "RateLimited" in reason and h.tasks[c.task].opts.get("lock_on_rate_limit") != "fail":
                    out.append(f"call {c.index} failed for its rate without lock_on_rate_limit='fail'")
                continue
            out.append(f"call {c.index} ({c.task} {c.key}) FAILURE: {reason[:200]}")
            continue
        if "superseded" in reason:
            if h.tasks[c.task].policy not in ("replace", "cancel") and not h.tasks[c.task].opts.get("lock_debounce"):
                out.append(f"call {c.index} ({h.tasks[c.task].policy}) REVOKED superseded: {reason[:160]}")
            continue
        if "waiting line" in reason:
            if h.tasks[c.task].opts.get("lock_max_waiting") is None:
                out.append(f"call {c.index}: line full without lock_max_waiting: {reason[:160]}")
            continue
        if ("rate" in reason and "not started" in reason) or re.search(r"rate .* reached", reason):
            if h.tasks[c.task].opts.get("lock_on_rate_limit") != "skip":
                out.append(f"call {c.index}: skipped for its rate without lock_on_rate_limit='skip': {reason[:160]}")
            continue
        if "cancelled by a newer call" in reason:
            if h.tasks[c.task].policy != "cancel":
                out.append(f"call {c.index} ({h.tasks[c.task].policy}) REVOKED cancelled: {reason[:160]}")
            continue  # _check_cancel checks whom it names
        if "revoked" in reason.lower() and "duplicate" not in reason:
            continue  # Celery's own revoke (the schedule's), expiry
        policy = h.tasks[c.task].policy
        if policy in ("reschedule", "replace", "cancel"):
            out.append(f"call {c.index} ({policy}) was skipped as a duplicate: {reason[:200]}")
            continue
        holder = _named(reason)
        other = ids.get(holder or "")
        if other is None or other is c or h.space_key(other.task, other.key) != h.space_key(c.task, c.key):
            out.append(
                f"call {c.index} ({c.task} {c.key}) skipped naming {holder!r}, no other call of its key: {reason[:200]}"
            )
            continue
        cooldown = float(h.tasks[other.task].opts.get("lock_cooldown", 0))
        spans = [_span(a, h) for a in h.attempts if a.id == holder]
        held = any(s <= done + DECIDE and e + cooldown + DECIDE >= c.sent for s, e in spans)
        queued = h.tasks[c.task].opts.get("lock_scope") == "queue" and other.sent <= done
        if not held and not queued:
            out.append(f"call {c.index} ({c.task} {c.key}) skipped naming {holder}, which did not hold the key then")
    return out


def _check_once(h: History) -> list[str]:
    """Each call that runs, runs to its end once (a killed attempt is run again under the same id; a finished job is
    never run again by its copies). reschedule (and replace's newest call of a key, and every rate 'wait' call):
    every call runs."""
    out = []
    by_space = _by_space(h)
    for c in h.calls:
        if c.returned is None:
            continue
        finals = _ran(h, c.returned)
        # A whole worker SIGKILLed just after a body ended, before its outcome was stored and its message acked: the
        # job was killed before its end as far as the lock and the broker know, and runs again (redelivered).
        first_end = min((a.end for a in finals if a.end is not None), default=None)
        killed_at_end = first_end is not None and any(
            first_end <= t <= first_end + DECIDE for t, kind in h.faults if kind == "kill-worker"
        )
        if len(finals) > 1 and not killed_at_end:
            out.append(f"call {c.index} ({c.task} {c.key} id {c.returned}) ran to its end {len(finals)} times")
        spans = sorted(_span(a, h) for a in h.attempts if a.id == c.returned)
        if any(s2 < e1 for (_, e1), (s2, _) in itertools.pairwise(spans)):
            out.append(f"call {c.index} ({c.task} {c.key} id {c.returned}) ran twice at once (a copy beside its job)")
        t = h.tasks[c.task]
        o = h.outcomes.get(c.returned)
        if c.revoked or o is None or t.opts.get("lock_debounce"):
            continue
        must = t.policy == "reschedule" or (
            t.policy in ("replace", "cancel") and c is max(by_space[h.space_key(c.task, c.key)], key=lambda x: x.sent)
        )
        if must and o.state == "REVOKED":
            allowed = (
                ("waiting line", "rate")
                if t.opts.get("lock_max_waiting") or t.opts.get("lock_on_rate_limit") == "skip"
                else ()
            )
            if t.policy in ("replace", "cancel"):
                allowed += ("superseded",)  # a copy reaching a worker after its newer sibling: ORDER bounds it
            if not any(a in o.reason for a in allowed):
                out.append(f"call {c.index} ({t.policy} {c.key} v{c.ver}) must run, got REVOKED: {o.reason[:200]}")
        if o.state == "SUCCESS" and not finals and c.returned == _own(c):
            out.append(f"call {c.index} ({c.key} v{c.ver}) is SUCCESS but no run of it was recorded")
    return out


def _own(c: Call) -> str | None:
    return c.returned


def _check_replace_order(h: History) -> list[str]:
    """replace: a newer call supersedes an older one, never the other way round; and older arguments never run
    last: a call sent more than ORDER before another of its key never starts after it. reschedule runs each call
    once (above), in any order the line gives."""
    out = []
    for (space, key), calls in _by_space(h).items():
        if not any(h.tasks[c.task].policy in ("replace", "cancel") for c in calls):
            continue
        sent = {c.returned: c for c in calls if c.returned}
        for c in calls:
            o = h.outcomes.get(c.returned or "")
            if o is not None and "superseded" in o.reason:
                newer = sent.get(_named(o.reason) or "")
                if newer is None:
                    out.append(f"{space}/{key}: call {c.index} superseded by no call of its key: {o.reason[:160]}")
                elif newer.sent < c.sent - ORDER and not c.slow_publish:
                    out.append(f"{space}/{key}: v{c.ver} superseded by the older v{newer.ver}")
        # At most one call waits per key: of the calls sent while one run held the key, at most one runs after it.
        for r in (a for a in h.attempts if a.id in sent and a.end is not None and not _faulted(h)):
            waiting = [c for c in calls if r.start + ORDER < c.sent < r.end - ORDER and c.returned != r.id]
            ran = [c.ver for c in waiting if _ran(h, c.returned or "")]
            if len(ran) > 1:
                out.append(f"{space}/{key}: {len(ran)} calls sent while v{r.ver} ran all ran after it: v{ran}")
                break
        starts = sorted((a.start, sent[a.id]) for a in h.attempts if a.id in sent and a.attempt == 0)
        for (s1, c1), (s2, c2) in itertools.combinations(starts, 2):
            if c2.sent < c1.sent - ORDER and not (c1.slow_publish or c2.slow_publish) and not _faulted(h):
                out.append(f"{space}/{key}: v{c2.ver} (sent {c1.sent - c2.sent:.2f} s earlier) ran after v{c1.ver}")
    return out


def _check_rate(h: History) -> list[str]:
    """lock_rate: every limit's windows (tests/model/rates.py, check_windows: one limit of cost 1 is N starts per
    window); and a call skipped or failed for its rate met a full window or a SlowDown's pause of one of its rate
    keys (another key's pause never stops it). Not judged under a node fault: an undo that did not arrive leaves a
    node's window fuller than the starts (docs/rate.md, What a failure does)."""
    out: list[str] = []
    for c in h.calls:
        o = h.outcomes.get(c.returned or "")
        t = h.tasks[c.task]
        if o is None or o.done is None or not t.rate or _faulted(h) or c.revoked:
            continue
        over = ("RateLimited" in o.reason) or (o.state == "REVOKED" and re.search(r"rate .* reached", o.reason))
        if over and not window_full(h, t, c.returned or "", c.key, o.done, DECIDE):
            out.append(f"call {c.index} ({c.task} {c.key} v{c.ver}) refused for its rate at {o.done:.3f} with room "
                       f"in every window of it: {o.reason[:120]}")  # fmt: skip
    return out


def _rate_full(h: History, t: TaskOpts, task_id: str, key: str, at: float) -> bool:
    """Whether the rate window of this call's rate key held N starts around ``at`` (a rate skip may be due)."""
    return t.rate and window_full(h, t, task_id, key, at, DECIDE)


def _check_line(h: History) -> list[str]:
    """lock_max_waiting=M: a call refused because the line is full found M calls of its key waiting before it: calls
    sent before it (or within ORDER after) that had not started yet when it was refused. A call's own re-sends (its
    rate wait, a redelivery, a split vote) never count: it keeps its place."""
    out = []
    for (space, key), calls in _by_space(h).items():
        for c in calls:
            o = h.outcomes.get(c.returned or "")
            cap = h.tasks[c.task].opts.get("lock_max_waiting")
            if o is None or o.state != "REVOKED" or "waiting line" not in o.reason or not cap or o.done is None:
                continue
            refused_at = o.done
            waiting = 0
            for x in calls:
                if x is c or x.returned in (None, c.returned) or x.sent > c.sent + ORDER:
                    continue
                starts = [a.start for a in h.attempts if a.id == x.returned]
                ended = h.outcomes.get(x.returned or "", Outcome("")).done
                if (min(starts) if starts else (ended if ended is not None else float("inf"))) > refused_at - DECIDE:
                    waiting += 1
            if waiting < int(cap):
                out.append(f"{space}/{key}: call {c.index} v{c.ver} refused for a full line (lock_max_waiting={cap}) "
                           f"with {waiting} call(s) sent before it waiting")  # fmt: skip
    return out


def bursts(calls: Iterable[Call], quiet: float) -> list[list[Call]]:
    """Calls of one key split where the gap is at least ``quiet`` (the generator never draws a gap near it)."""
    out: list[list[Call]] = []
    for c in sorted(calls, key=lambda x: x.sent):
        if out and c.sent - out[-1][-1].sent < quiet:
            out[-1].append(c)
        else:
            out.append([c])
    return out


def _waited(h: History, t: TaskOpts, groups: list[list[Call]]) -> list[list[Call]]:
    """lock_debounce x lock_rate (wait): a due burst waiting for its rate window runs once, with its last arguments
    (docs/options.md): a call sent while it still waited (its job not started yet) joins it, however late."""
    if not t.rate or t.opts.get("lock_on_rate_limit", "wait") != "wait":
        return groups
    out: list[list[Call]] = []
    for burst in groups:
        prior = {c.returned for c in out[-1]} - {None} if out else set()
        starts = [a.start for a in h.attempts if a.id in prior]
        if prior & {c.returned for c in burst} and (not starts or min(starts) > burst[0].sent - ORDER):
            out[-1] = out[-1] + burst
        else:
            out.append(burst)
    return out


def _check_debounce(h: History) -> list[str]:
    """lock_debounce=S: a burst (calls less than S apart) runs once, with its last call's arguments; every call of
    it gets the burst's one AsyncResult. With lock_debounce_max, a long burst may run more than once, never older
    arguments after newer."""
    out = []
    for (space, key), calls in _by_space(h).items():
        t = h.tasks[calls[0].task]
        quiet = t.opts.get("lock_debounce")
        if not quiet:
            continue
        seen: set[str | None] = set()
        for burst in _waited(h, t, bursts(calls, float(quiet))):
            ids = {c.returned for c in burst}
            last = burst[-1]
            stale = (ids & seen) - {None}
            if stale:
                out.append(f"{space}/{key}: a new burst (v{[c.ver for c in burst]}) got an earlier burst's "
                           f"AsyncResult {sorted(stale)}")  # fmt: skip
            seen |= ids
            if len(ids) != 1 and not _faulted(h):
                out.append(f"{space}/{key}: one burst got {len(ids)} AsyncResults (v{[c.ver for c in burst]})")
            runs = [a for a in h.attempts if a.id in ids and rate_ran(h, a) and a.attempt == 0]
            vers = [a.ver for a in sorted(runs, key=lambda a: a.start)]
            if last.revoked:
                continue
            o = h.outcomes.get(last.returned or "", Outcome(""))
            if (o.state in ("REVOKED", "FAILURE") and re.search(r"rate|RateLimited", o.reason) and o.done is not None
                    and _rate_full(h, t, last.returned or "", key, o.done)):  # fmt: skip
                continue  # a burst due while its rate window was full, skipped or failed for it (docs/policies.md)
            if last.expires is not None and last.expires < float(quiet) + DECIDE and not vers:
                continue  # its own expiry came before its due time
            if not vers and o.state not in ("SUCCESS", "FAILURE", "REVOKED") and _worker_killed_after(h, last.sent):
                continue  # its message lost by a whole worker's SIGKILL (_check_ends says why that is excused)
            if vers.count(last.ver) != 1:
                out.append(f"{space}/{key}: the burst's last call v{last.ver} ran {vers.count(last.ver)} times: {vers}")
            # Under a node fault a call sent on its own (no quorum) runs by itself beside the burst it could not
            # join, which runs the version before it: older arguments may run too, never after newer (below).
            if not t.opts.get("lock_debounce_max") and not _faulted(h) and any(v != last.ver for v in vers):
                out.append(f"{space}/{key}: a burst ran other arguments than its last call's v{last.ver}: {vers}")
            if vers != sorted(vers):
                out.append(f"{space}/{key}: older arguments ran after newer: {vers}")
        out += _debounce_versions(h, space, key, calls)
    return out


def _debounce_versions(h: History, space: str, key: str, calls: list[Call]) -> list[str]:
    """lock_debounce, also under faults (policies/debounce.py): each job (the calls given one AsyncResult) runs its
    last call's arguments, or is REVOKED as superseded by a job that ran a newer call's; a run carries only a call
    given its job; no call's arguments start twice (a killed run's redelivery aside); older arguments never start
    after newer ones (calls sent more than ORDER apart)."""
    out = []
    sent = {c.ver: c for c in calls}
    jobs: dict[str, list[Call]] = defaultdict(list)
    for c in calls:
        if c.returned:
            jobs[c.returned].append(c)
    for job, given in jobs.items():
        if any(c.revoked for c in given):
            continue
        last = max(given, key=lambda c: c.sent)
        runs = [a for a in h.attempts if a.id == job]
        for a in runs:
            if a.ver not in {c.ver for c in given}:
                mine = [c.ver for c in given]
                out.append(f"{space}/{key}: job {job} ran v{a.ver}, a call not given its id (v{mine})")
        o = h.outcomes.get(job)
        if o is not None and o.state == "REVOKED" and "superseded" in o.reason:
            newer = [a.ver for a in h.attempts if a.id == _named(o.reason) and a.ver in sent]
            if not any(sent[v].sent > last.sent - ORDER for v in newer):
                out.append(f"{space}/{key}: job {job} (last v{last.ver}) superseded by a run of no newer call: {newer}")
        elif o is not None and o.state == "SUCCESS" and last.ver not in {a.ver for a in runs}:
            out.append(f"{space}/{key}: job {job}'s last call v{last.ver} never ran: {[a.ver for a in runs]}")
    firsts = sorted((a for a in h.attempts if a.ver in sent and a.attempt == 0 and not a.slowed), key=lambda a: a.start)
    finished = [a.ver for a in firsts if a.end is not None]
    twice = sorted({v for v in finished if finished.count(v) > 1})
    if twice:
        out.append(f"{space}/{key}: v{twice} ran to their end more than once")
    for a1, a2 in itertools.combinations(firsts, 2):
        if sent[a2.ver].sent < sent[a1.ver].sent - ORDER:
            out.append(f"{space}/{key}: v{a2.ver} started after the newer v{a1.ver}")
    return out


def _check_cooldown(h: History) -> list[str]:
    """lock_cooldown=C: after a success, its slot stays held C s from its end (a failure holds nothing): with the
    default limit of 1 no other run of the key starts then; with lock_limit=N, no start finds N slots held."""
    out = []
    for (space, key), calls in _by_space(h).items():
        cooldown = max(float(h.tasks[c.task].opts.get("lock_cooldown", 0)) for c in calls)
        if not cooldown:
            continue
        ids = {c.returned for c in calls}
        attempts = sorted((a for a in h.attempts if a.id in ids), key=lambda a: a.start)
        limit = min((h.tasks[c.task].limit(key) or 10**6) for c in calls)
        cooled = [
            a
            for a in attempts
            if a.end is not None
            and h.outcomes.get(a.id, Outcome("")).state == "SUCCESS"
            and a.attempt >= _retries(h, a.id)
        ]
        for a in cooled:
            for b in attempts:
                if b.id != a.id and a.end < b.start < a.end + cooldown - COOLDOWN_CLOCK:
                    # A success keeps its slot (lock_limit=N: the other N - 1 slots stay free to take).
                    held = sum(
                        1
                        for x in cooled
                        if x.id != b.id
                        and x.end is not None
                        and x.end - COOLDOWN_CLOCK <= b.start < x.end + cooldown - COOLDOWN_CLOCK
                    )
                    held += sum(1 for x in attempts if x.id != b.id and _span(x, h)[0] < b.start < _span(x, h)[1])
                    if held >= limit:
                        out.append(f"{space}/{key}: {b.id} started {b.start - a.end:.2f} s into {a.id}'s cooldown")
    return out


def _check_queue_scope(h: History) -> list[str]:
    """lock_scope="queue" (skip, fail): a delay() while the key's job is queued or running returns that job's id
    (publishes nothing); with reschedule or replace the call is sent and waits at the worker (the matrix's note).
    lock_enqueue_check: a delay() while the key's job runs returns the running job's id."""
    out = []
    for (space, key), calls in _by_space(h).items():
        for c in calls:
            t = h.tasks[c.task]
            queue = t.opts.get("lock_scope") == "queue" and t.policy in ("skip", "fail")
            enqueue = t.opts.get("lock_enqueue_check")
            if not (queue or enqueue) or c.returned is None or _faulted(h) or c.slow_publish:
                continue
            for prior in calls:
                if prior is c or prior.returned in (None, c.returned) or prior.sent >= c.sent - ORDER or prior.revoked:
                    continue
                spans = [_span(a, h) for a in h.attempts if a.id == prior.returned]
                if not spans or h.outcomes.get(prior.returned or "", Outcome("")).state not in ("SUCCESS", "FAILURE"):
                    continue
                first, last = min(s for s, _ in spans), max(e for _, e in spans)
                busy_from = prior.sent if queue else first
                if busy_from + ORDER < c.sent < last - ORDER:
                    out.append(
                        f"{space}/{key}: v{c.ver} got its own job {c.returned} while {prior.returned} was "
                        f"{'queued or running' if queue else 'running'}"
                    )
                    break
    return out


def _check_cancel(h: History) -> list[str]:
    """lock_on_duplicate="cancel": a newer call of a running key stops the run. A run ends REVOKED "cancelled" only
    naming a newer call of its key (sent after it, ORDER aside) and only once it had started; the named call's run
    never overlaps it (starts after it stopped). Of the calls sent while a cancelled run held the key (inside its
    span, ORDER margins), at most one ends SUCCESS or FAILURE, and none sent more than ORDER after it: the others
    end REVOKED, superseded (or cancelled in turn by a newer one)."""
    out = []
    for (space, key), calls in _by_space(h).items():
        if not any(h.tasks[c.task].policy == "cancel" for c in calls):
            continue
        sent = {c.returned: c for c in calls if c.returned}
        out += _cancel_sent(h, space, key, calls)
        for c in calls:
            o = h.outcomes.get(c.returned or "")
            if o is None or o.state != "REVOKED" or "cancelled by a newer call" not in o.reason:
                continue
            newer = sent.get(_named(o.reason) or "")
            mine = [a for a in h.attempts if a.id == c.returned]
            if newer is None or newer is c:
                out.append(f"{space}/{key}: call {c.index} cancelled naming no other call of its key: {o.reason[:160]}")
                continue
            if newer.sent < c.sent - ORDER and not c.slow_publish:
                out.append(f"{space}/{key}: v{c.ver} cancelled by the older v{newer.ver}")
            if not mine:
                out.append(f"{space}/{key}: v{c.ver} REVOKED cancelled but never started (only a run is cancelled)")
                continue
            stopped = max(_span(a, h)[1] for a in mine)
            follows = [a for a in h.attempts if a.id == newer.returned]
            if any(a.start < stopped for a in follows):
                out.append(f"{space}/{key}: v{newer.ver} started beside the run of v{c.ver} it cancelled")
            if _faulted(h) or h.tasks[c.task].limit(key) != 1:
                continue
            start = min(a.start for a in mine)
            during = [x for x in calls if start + ORDER < x.sent < stopped - ORDER and x is not c]
            ran = [x for x in during if h.outcomes.get(x.returned or "", Outcome("")).state in ("SUCCESS", "FAILURE")]
            if len(ran) > 1:
                out.append(f"{space}/{key}: {len(ran)} calls sent while v{c.ver} was cancelled all ran after it: "
                           f"v{[x.ver for x in ran]}")  # fmt: skip
            late = max((x.sent for x in during), default=0.0)
            for x in ran:
                if x.sent < late - ORDER:
                    out.append(f"{space}/{key}: v{x.ver} ran after the cancel of v{c.ver}, not the newest call then")
            for x in during:
                ox = h.outcomes.get(x.returned or "", Outcome(""))
                if x not in ran and not x.revoked and not ((ox.state == "REVOKED" and "superseded" in ox.reason)
                                                            or "cancelled" in ox.reason):  # fmt: skip
                    out.append(f"{space}/{key}: v{x.ver}, sent during the cancel of v{c.ver}, ended {ox.state} "
                               f"{ox.reason[:120]}")  # fmt: skip
    return out


def _cancel_sent(h: History, space: str, key: str, calls: list[Call]) -> list[str]:
    """lock_on_duplicate="cancel": a run that a newer call of its key met (sent more than ORDER after the run
    started) and that still ran CANCEL_SEEN past the newer call's reach and the holder's next renewal was cancelled:
    it ends REVOKED "cancelled by a newer call"."""
    out = []
    for c in calls:
        t = h.tasks[c.task]
        if t.policy != "cancel" or c.revoked or c.retries or c.returned is None or _faulted(h):
            continue
        bound = ORDER + float(t.opts.get("lock_ttl", 60)) / 3 + CANCEL_SEEN
        for a in (a for a in h.attempts if a.id == c.returned):
            end = _span(a, h)[1]
            met = [x for x in calls if x.returned not in (None, c.returned) and x.sent > max(a.start, c.sent) + ORDER
                   and end > x.sent + bound]  # fmt: skip
            o = h.outcomes.get(c.returned, Outcome(""))
            if met and not (o.state == "REVOKED" and "cancelled by a newer call" in o.reason):
                out.append(f"{space}/{key}: v{c.ver} ran {end - met[0].sent:.2f} s past the newer v{met[0].ver}'s "
                           f"send and was not cancelled: {o.state} {o.reason[:120]}")  # fmt: skip
    return out


def _check_fair(h: History) -> list[str]:
    """lock_fair_on (docs/policies.md, "Fair turns"): the line's node counts each start once, and a call that joined
    the line with k calls of its own value waiting waits at most (k + 2)(W - 1) + k + L - 1 turns (starts of its key
    from its joining to its own start), W the values of its key's calls, L the key's limit. (Every call runs, once:
    _check_once, as every reschedule.)"""
    out = []
    for (space, key), calls in _by_space(h).items():
        fair = [c for c in calls if h.tasks[c.task].opts.get("lock_fair_on")]
        if not fair:
            continue
        names = h.tasks[fair[0].task].opts["lock_fair_on"]
        values = len({tuple(getattr(c, n) for n in names) for c in fair})
        limit = max(h.tasks[c.task].limit(key) or 1 for c in fair)
        ids = {c.returned for c in fair}
        counted = [a for a in h.attempts if a.id in ids and a.turn is not None]
        numbers = [a.turn[0] for a in counted if a.turn[0] > 0]
        restarted = any("restart" in kind for _, kind in h.faults)  # a node restarted empty counts afresh
        if len(numbers) != len(set(numbers)) and not restarted:
            out.append(f"{space}/{key}: the fair line counted two starts as one: {sorted(numbers)}")
        for a in counted:
            _, waited, ahead = a.turn
            bound = (ahead + 2) * (values - 1) + ahead + limit - 1
            if waited >= 0 and waited > bound:
                out.append(f"{space}/{key}: v{a.ver} waited {waited} turns with {ahead} of its value ahead, past the "
                           f"bound {bound} ({values} values, limit {limit})")  # fmt: skip
    return out
