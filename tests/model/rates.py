"""The rate's promises of issue 33 written as code (docs/rate.md): stacked limits, a cost per start with
``rate_spent`` corrections, and the API's ``SlowDown``. Read by tests/model/promises.py's ``check``.

A task's ``lock_rate`` in a spec is ``[N, S]`` (one limit, of the ``lock_rate_on`` arguments) or a list of such items
and ``{"rate": [N, S], "on": [...]}`` (a ``Rate`` of its own arguments); ``lock_rate_cost`` is a number of units or
``"by_duration"`` (tests/apps/model_app.py). Every start is judged on the nodes' clock (``rate_started_at``), as the
one-limit promise always was.
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .promises import Attempt, Call, History, TaskOpts

RATE_CLOCK = 0.05  # rate windows are counted on the nodes' clock: starts closer than window - this break it
PAUSE_LANDS = 0.5  # SlowDown: the pause is written on the nodes within this of the raise (the handler's round trip)
CHARGE_SEEN = 0.2  # a charge reported this long before a start's count was seen by it (a late grant's restamp aside)
NODE_FAULTS = ("pause-node", "restart-node-empty", "restart-node-data", "pause-node-bg")


def limits(t: TaskOpts) -> list[tuple[int, float, tuple[str, ...]]]:
    """The task's limits: (N, seconds, the arguments sharing it); empty without a rate."""
    rate = t.opts.get("lock_rate")
    if rate is None:
        return []
    plain = tuple(t.opts.get("lock_rate_on") or ())
    items = rate if isinstance(rate[0], list | dict) else [rate]
    return [(int(i["rate"][0]), float(i["rate"][1]), tuple(i.get("on", ()))) if isinstance(i, dict)
            else (int(i[0]), float(i[1]), plain) for i in items]  # fmt: skip


def cost(t: TaskOpts, call: Call | None) -> int:
    """The units a start of ``call`` takes of every limit (lock_rate_cost: a constant, or "by_duration")."""
    c = t.opts.get("lock_rate_cost", 1)
    if c == "by_duration":
        return 2 if call is not None and call.duration >= 1.0 else 1
    return math.ceil(float(c))


def _call_of(h: History, task_id: str) -> Call | None:
    return next((c for c in h.calls if c.returned == task_id), None)


def rate_keys(h: History, t: TaskOpts, task_id: str, key: str) -> list[tuple[str, int, str]]:
    """The rate keys (space, limit index, its arguments' values) a start of this call takes units of."""
    call = _call_of(h, task_id)
    values = {"key": key, "duration": call.duration if call else None, "ver": call.ver if call else None}
    return [(t.space, i, "|".join(str(values[n]) for n in on) or "*") for i, (_, _, on) in enumerate(limits(t))]


def _at(a: Attempt) -> float:
    return a.rate_at if a.rate_at is not None else a.start


def _units(h: History, a: Attempt) -> tuple[int, int, float | None]:
    """(estimate, corrected units, when the correction was reported) of one start."""
    est = cost(h.tasks[a.task], _call_of(h, a.id))
    applied = a.spent[0] if a.spent else 0
    return est, est + applied, a.spent_at if a.spent else None


def _logs(h: History) -> dict[tuple[str, int, str], list[Attempt]]:
    out: dict[tuple[str, int, str], list[Attempt]] = defaultdict(list)
    for a in h.attempts:
        for rk in rate_keys(h, h.tasks[a.task], a.id, a.key):
            out[rk].append(a)
    return out


def check_windows(h: History) -> list[str]:
    """Every limit (stacked or one), per window of its starts, the last start's admission (docs/rate.md, "A cost per
    start"): (1) the units the window's starts held when its last start was counted never sum past N: each start its
    estimate, less a refund reported before that count (a refund frees its slots for the next start); (2) with all
    nodes up, an extra charge reported before that count counts too (a later start is admitted only if the charges
    reported so far fit). So the corrected units of a window exceed N by at most the under-estimates of its starts
    whose report came after its last start's count (promise 3: one at a time, the last run's error alone)."""
    out = []
    faulted = any(kind in NODE_FAULTS for _, kind in h.faults)
    for (space, i, rkey), attempts in _logs(h).items():
        n, secs, _ = limits(h.tasks[attempts[0].task])[i]
        starts = sorted(attempts, key=_at)
        for j, first in enumerate(starts):
            window = [a for a in starts[j:] if _at(a) < _at(first) + secs - RATE_CLOCK]
            last = _at(window[-1])
            units = [(_units(h, a), a is not window[-1]) for a in window]
            refunds = sum(min(e, real) if before and at is not None and at < last else e
                          for (e, real, at), before in units)  # fmt: skip
            charges = refunds + sum(max(0, real - e) for (e, real, at), before in units  # a refund counts
                                    if before and at is not None and at + CHARGE_SEEN < last)  # as in (1)  # fmt: skip
            if refunds > n or (charges > n and not faulted):
                what = "estimated (refunds seen)" if refunds > n else "held (charges seen)"
                out.append(f"rate {space}/{i}/{rkey}: {max(refunds, charges)} units {what} when the start at "
                           f"{last:.3f} was counted, within {secs - RATE_CLOCK:.2f} s from {_at(first):.3f} "
                           f"({len(window)} starts; limit {n}/{secs} s)")  # fmt: skip
                break
    return out


def _paused(h: History, a: Attempt) -> list[tuple[str, int, str]]:
    """The rate keys a raising attempt's SlowDown paused (every limit of its call, or the one it named)."""
    keys = rate_keys(h, h.tasks[a.task], a.id, a.key)
    limit = a.slowed[1] if a.slowed else None
    return keys if limit is None or not 0 <= limit < len(keys) else [keys[limit]]


def check_slowdown(h: History) -> list[str]:
    """SlowDown(retry_after=T, limit) raised at r (docs/rate.md, "The API's own slow down"): no start of a paused
    rate key from the moment the pause is written (r + PAUSE_LANDS at the latest) to r + T (less RATE_CLOCK); the
    raising call runs once after the pause (never lost: its outcome is its copy's; not doubled: _check_once), unless
    a newer call superseded it, or its policy skipped or failed it for the rate."""
    out = []
    for a in (a for a in h.attempts if a.slowed):
        r, pause = a.end or a.start, float(a.slowed[0])
        paused = set(_paused(h, a))
        for b in h.attempts:
            if b is a or not (r + PAUSE_LANDS < _at(b) < r + pause - RATE_CLOCK):
                continue
            if paused & set(rate_keys(h, h.tasks[b.task], b.id, b.key)):
                out.append(f"{b.task} {b.key} v{b.ver} started {_at(b) - r:.3f} s after a SlowDown({pause:g} s, "
                           f"limit {a.slowed[1]}) of v{a.ver} paused its rate")  # fmt: skip
        out += _ran_once_after(h, a)
    return out


def _ran_once_after(h: History, a: Attempt) -> list[str]:
    call = _call_of(h, a.id)
    if call is None or call.revoked:
        return []
    t = h.tasks[a.task]
    o = h.outcomes.get(a.id)
    reason = o.reason if o else ""
    runs = [b for b in h.attempts if b.id == a.id and not b.slowed and b.start > (a.end or a.start)]
    ended = (o.done if o and o.done is not None else 0.0) >= (a.end or a.start) + float(a.slowed[0])  # type: ignore[index]
    excused = any(w in reason for w in ("superseded", "cancelled")) or (  # skipped or failed for the rate after the
        t.opts.get("lock_on_rate_limit") in ("skip", "fail") and ("rate" in reason or "RateLimited" in reason) and ended
    )  # pause (a full window): asked during its own pause, the copy came early
    if not runs and not excused and not any(kind == "kill-worker" for _, kind in h.faults):
        return [f"call {call.index} ({a.task} {a.key} v{a.ver}) raised SlowDown and never ran after it: "
                f"{o and o.state} {reason[:120]}"]  # fmt: skip
    if runs and min(b.start for b in runs) < (a.end or a.start) + float(a.slowed[0]) - RATE_CLOCK:  # type: ignore[index]
        return [f"call {call.index} ({a.task} {a.key} v{a.ver}) ran again within its own SlowDown's pause"]
    return []


def window_full(h: History, t: TaskOpts, task_id: str, key: str, at: float, margin: float) -> bool:
    """Whether a start of this call around ``at`` could be over a limit: some limit's window held units such that
    its estimate did not fit (charges counted), or a SlowDown paused one of its keys (a rate skip or failure may be
    due then). ``margin`` widens every bound."""
    mine = rate_keys(h, t, task_id, key)
    est = cost(t, _call_of(h, task_id))
    for a in h.attempts:
        if a.slowed and set(_paused(h, a)) & set(mine):
            r = a.end or a.start
            if r - margin <= at <= r + float(a.slowed[0]) + margin:
                return True
    logs = _logs(h)
    for rk in mine:
        n, secs, _ = limits(t)[rk[1]]
        held = sum(max(_units(h, a)[:2]) for a in logs.get(rk, []) if at - secs - margin <= _at(a) <= at + margin)
        if held + est > n:
            return True
    return False


def rate_ran(h: History, a: Attempt) -> bool:
    """A completed attempt that ran to its end (not one that raised SlowDown: its copy is the call's run)."""
    return a.end is not None and not a.slowed


__all__ = ["check_slowdown", "check_windows", "cost", "limits", "rate_keys", "rate_ran", "window_full"]
