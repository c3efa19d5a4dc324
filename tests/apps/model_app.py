"""The app the model-based suite (tests/testing/test_model.py) runs in real workers: locked_app's configuration, plus
the
tasks of one drawn deployment, defined from the JSON spec in ``CSL_MODEL_SPEC`` so one worker start serves every
schedule of that deployment.

The spec: ``{"tasks": [{"name": "m0", "opts": {"lock_on_duplicate": "replace", ...}}, ...]}``; ``"lock_limit":
"per_key"`` stands for :func:`per_key_limit`. Every task has one signature, ``(key, ver, duration, fail, retries)``,
and is keyed on ``key`` (``lock_unique_on=["key"]``; ``lock_limit=None``: no lock, no key); ``ver`` tells the calls
of one key apart. Each attempt records
``{"id", "task", "key", "ver", "attempt", "pid", "start", "rate_at", "turn"}`` on ``model:started`` when its body
starts (``turn``: lock_fair_on's count of its wait, see ``_turn``) and
the same with ``"end"`` on ``model:ended`` when it ends (a retry's attempt ends at its ``retry()``; a body stopped by
``lock_on_duplicate="cancel"`` ends where it stopped, with ``"cancelled": true``). Two optional arguments act on the
rate (issue 33): ``spent=n`` reports ``self.rate_spent(n)`` first (the end record then holds ``"spent": [units
applied, n]`` and ``"spent_at"``); ``slow=[retry_after, limit]`` raises ``SlowDown`` on the call's first attempt
only (its end record holds ``"slowed"``; the re-sent copy runs the body). A spec's ``lock_rate`` may be a stacked
list (:func:`rate_of`) and ``lock_rate_cost`` ``"by_duration"`` (:func:`cost_by_duration`).
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

from locked_app import app, record

from celery_singleton_lock import LockedTask, Rate, SlowDown
from celery_singleton_lock.errors import JobCancelledError

__all__ = ["app", "cost_by_duration", "dialed_limit", "per_key_limit", "rate_of"]


def per_key_limit(key: str, *args: Any, **kwargs: Any) -> int:
    """A ``lock_limit`` computed per key: 2 runs at once of a key ending in "p" (a premium key), else 1."""
    return 2 if key.endswith("p") else 1


def dialed_limit(key: str, *args: Any, **kwargs: Any) -> int:
    """A ``lock_limit`` the schedule dials while runs hold (record key ``limit:<key>``, 2 when unset)."""
    return int(record.get(f"limit:{key}") or 2)


def cost_by_duration(key: str, ver: int = 0, duration: float = 0.0, *args: Any, **kwargs: Any) -> int:
    """A ``lock_rate_cost`` computed per call: 2 units for a run of 1 s or more, else 1 ("by_duration" in a spec)."""
    return 2 if duration >= 1.0 else 1


def rate_of(spec: Any) -> Any:
    """A spec's ``lock_rate``: ``[N, S]`` is one limit; a list of ``[N, S]`` and ``{"rate": [N, S], "on": [...]}``
    items is a stacked list (a dict is a ``Rate`` of its own arguments)."""
    if isinstance(spec, list) and spec and isinstance(spec[0], list | dict):
        return [Rate(tuple(i["rate"]), on=i.get("on", [])) if isinstance(i, dict) else tuple(i) for i in spec]
    return tuple(spec) if isinstance(spec, list) else spec


def _body(
    self: Any,
    key: str,
    ver: int = 0,
    duration: float = 0.0,
    fail: bool = False,
    retries: int = 0,
    spent: int | None = None,
    slow: list[Any] | None = None,
) -> int:
    rate_at = getattr(self, "rate_started_at", None)
    attempt = {
        "id": self.request.id, "task": self.name, "key": key, "ver": ver, "attempt": self.request.retries,
        "pid": os.getpid(), "start": time.time(), "rate_at": rate_at, "turn": _turn(self),
    }  # fmt: skip
    record.rpush("model:started", json.dumps(attempt))
    if spent is not None:  # lock_rate_cost: what the start really cost, reported before the run (and when)
        attempt["spent"], attempt["spent_at"] = [self.rate_spent(spent), spent], time.time()
    if slow is not None and record.set(f"model:slowed:{self.request.id}", 1, nx=True, ex=600):
        # The API said "slow down" (once per call: its re-sent copy runs): [retry_after, limit index or None].
        record.rpush("model:ended", json.dumps({**attempt, "end": time.time(), "slowed": slow}))
        raise SlowDown(slow[0], limit=slow[1])
    end_by = time.monotonic() + duration
    try:
        for _ in range(int(duration / 0.02) + 2):  # bounded by count and by duration
            if time.monotonic() >= end_by:
                break
            time.sleep(min(0.02, max(0.0, end_by - time.monotonic())))
    except JobCancelledError:  # lock_on_duplicate="cancel": the body stopped here; its end is when it stopped
        record.rpush("model:ended", json.dumps({**attempt, "end": time.time(), "cancelled": True}))
        raise
    record.rpush("model:ended", json.dumps({**attempt, "end": time.time()}))
    if self.request.retries < retries:
        raise self.retry(countdown=0.2, max_retries=retries)
    if fail:
        raise RuntimeError("failing on purpose")
    return ver


def _turn(task: Any) -> list[int] | None:
    """lock_fair_on: [its number among the line's starts, turns waited, own value's calls ahead], as the line's node
    counted them (policies/fair.py's Turn); None: not counted."""
    run = getattr(task.request, "_singleton_lock", None)
    turn = (getattr(run, "state", None) or {}).get("fair")
    return None if turn is None else [turn.start, turn.waited, turn.ahead]


def _define(spec: dict[str, Any]) -> None:
    for task in spec.get("tasks", []):
        opts = dict(task["opts"])
        if opts.get("lock_limit") == "per_key":
            opts["lock_limit"] = per_key_limit
        elif opts.get("lock_limit") == "dialed":
            opts["lock_limit"] = dialed_limit
        if isinstance(opts.get("lock_rate"), list):
            opts["lock_rate"] = rate_of(opts["lock_rate"])
        if opts.get("lock_rate_cost") == "by_duration":
            opts["lock_rate_cost"] = cost_by_duration

        def run(
            self: Any,
            key: str,
            ver: int = 0,
            duration: float = 0.0,
            fail: bool = False,
            retries: int = 0,
            spent: int | None = None,
            slow: list[Any] | None = None,
        ) -> int:
            return _body(self, key, ver, duration, fail, retries, spent, slow)

        run.__name__ = task["name"]
        if opts.get("lock_limit", 1) is not None:  # lock_limit=None (no lock, a rate only) has no job key to name
            opts.setdefault("lock_unique_on", ["key"])
        app.task(shared=False, base=LockedTask, bind=True, name=task["name"], **opts)(run)


_define(json.loads(os.environ.get("CSL_MODEL_SPEC") or "{}"))
