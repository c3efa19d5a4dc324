"""``lock_rate`` tasks for tests/policies/test_rate_workers.py, on ``locked_app``'s app (workers import this module with
``-I rate_tasks``; locked_app itself is left alone). Every run records ``[key, task_id, pid, node time of the counted
start, wall start, rate waits, end]`` in the record list ``rate_runs`` (and its start in ``rate_started``)."""

from __future__ import annotations

import itertools
import json
import os
import time
from typing import Any

from locked_app import app, record

from celery_singleton_lock import LockedTask, Rate, SlowDown
from celery_singleton_lock.policies.rate import RATE_FEATURE

STORM_RATE = (10, 1.0)


def _run(task: Any, key: str, duration: float) -> str:
    at = task.rate_started_at
    waits = int(getattr(task.request, "singleton_lock_rate_waits", 0) or 0)
    start = time.time()
    row = [key, task.request.id, os.getpid(), at, start, waits]
    record.rpush("rate_started", json.dumps(row))
    run = task.request.__dict__.get("_singleton_lock")
    share = RATE_FEATURE.share(run) if run is not None else None
    if share is not None and share.slot is not None:  # the slot and each node's count time (tests check per slot)
        record.rpush("rate_slots", json.dumps([key, task.request.id, share.slot[0], share.slot[1]]))
    end_by = time.monotonic() + duration
    while time.monotonic() < end_by:  # bounded by duration
        time.sleep(min(0.05, max(0.0, end_by - time.monotonic())))
    record.rpush("rate_runs", json.dumps([*row, time.time()]))
    return key


@app.task(shared=False, base=LockedTask, bind=True, lock_ttl=3, lock_rate=STORM_RATE, lock_rate_on=["key"])
def rated(self: Any, key: str, n: int, duration: float = 0.0) -> str:
    """Each call (``n``) a job of its own; calls of one ``key`` share a rate of 10 per 1 s; over it, they wait."""
    return _run(self, key, duration)


@app.task(shared=False, base=LockedTask, bind=True, lock_limit=None, lock_rate=(3, 1.5), lock_rate_on=["key"])
def rated_unlocked(self: Any, key: str, duration: float = 0.0) -> str:
    """No lock at all (lock_limit=None): equal calls run side by side, but never more than 3 starts per 1.5 s."""
    return _run(self, key, duration)


@app.task(shared=False, base=LockedTask, bind=True, lock_rate="2/m", lock_on_rate_limit="skip", lock_rate_on=["key"])
def rated_skip(self: Any, key: str, n: int) -> str:
    return _run(self, key, 0.0)


@app.task(shared=False, base=LockedTask, bind=True, lock_rate="2/m", lock_on_rate_limit="fail", lock_rate_on=["key"])
def rated_fail(self: Any, key: str, n: int) -> str:
    return _run(self, key, 0.0)


@app.task(
    shared=False,
    base=LockedTask,
    bind=True,
    lock_rate=(2, 60.0),
    lock_on_rate_limit="fail",
    lock_rate_on=["key"],
    lock_unique_on=["key"],
)
def rated_dup(self: Any, key: str, duration: float = 0.0) -> str:
    """One job per key (the lock) and 2 starts per minute (the rate; over it, FAILURE): a skipped duplicate uses no
    share, so a second job after the first one still starts within the minute, and a third does not."""
    return _run(self, key, duration)


@app.task(
    shared=False,
    base=LockedTask,
    bind=True,
    lock_debounce=0.4,
    lock_unique_on=["key"],
    lock_rate="1/m",
    lock_rate_on=["key"],
    lock_on_rate_limit="skip",
)
def rated_debounced(self: Any, key: str, n: int) -> str:
    """A burst of calls runs once (debounce) and one start per minute (the rate): a not-yet-due delivery of the
    burst, re-sent for its due time, uses no share."""
    return _run(self, key, 0.0)


# -- lock_group: two tasks, one key space (a run of either is a duplicate of the other; one rate for both) ----------


@app.task(shared=False, base=LockedTask, bind=True, lock_group="mailer", lock_unique_on=["domain"], lock_rate=(3, 1.0))
def send_welcome(self: Any, domain: str, duration: float = 0.0) -> str:
    return _run(self, domain, duration)


@app.task(shared=False, base=LockedTask, bind=True, lock_group="mailer", lock_unique_on=["domain"], lock_rate=(3, 1.0))
def send_digest(self: Any, domain: str, duration: float = 0.0) -> str:
    return _run(self, domain, duration)


@app.task(shared=False, base=LockedTask, bind=True, lock_group="coolers", lock_unique_on=["key"], lock_cooldown=60)
def cool_a(self: Any, key: str) -> str:
    return _run(self, key, 0.0)


@app.task(shared=False, base=LockedTask, bind=True, lock_group="coolers", lock_unique_on=["key"], lock_cooldown=60)
def cool_b(self: Any, key: str) -> str:
    return _run(self, key, 0.0)


@app.task(
    shared=False,
    base=LockedTask,
    bind=True,
    lock_group="liners",
    lock_unique_on=["key"],
    lock_limit=2,
    lock_on_duplicate="reschedule",
)
def line_a(self: Any, key: str, duration: float = 0.0) -> str:
    return _run(self, key, duration)


@app.task(
    shared=False,
    base=LockedTask,
    bind=True,
    lock_group="liners",
    lock_unique_on=["key"],
    lock_limit=2,
    lock_on_duplicate="reschedule",
)
def line_b(self: Any, key: str, duration: float = 0.0) -> str:
    return _run(self, key, duration)


# -- lock_limit as a function of the call ----------------------------------------------------------------------


def tier_limit(customer: str, duration: float = 0.0, n: int = 0) -> int:
    """Premium customers 2 at once, others 1."""
    return 2 if customer.startswith("premium") else 1


@app.task(shared=False, base=LockedTask, bind=True, lock_limit=tier_limit, lock_unique_on=["customer"])
def per_tier(self: Any, customer: str, duration: float = 0.0, n: int = 0) -> str:
    return _run(self, customer, duration)


# -- the rate beside the waiting line (issue 29) ----------------------------------------------------------------


@app.task(
    shared=False,
    base=LockedTask,
    bind=True,
    lock_unique_on=["key"],
    lock_on_duplicate="reschedule",
    lock_max_waiting=1,
    lock_rate=(1, 3.0),
    lock_rate_on=["bucket"],
)
def rated_capped(self: Any, key: str, bucket: str, duration: float = 0.0) -> str:
    """One job per ``key`` at once, at most 1 waiting in its line; 1 start per 3 s per ``bucket``."""
    return _run(self, key, duration)


@app.task(
    shared=False,
    base=LockedTask,
    bind=True,
    lock_unique_on=["key"],
    lock_on_duplicate="replace",
    lock_rate=(1, 3.0),
    lock_rate_on=["key"],
)
def rated_latest(self: Any, key: str, version: int) -> str:
    """Keep-latest (replace) and 1 start per 3 s per ``key``."""
    return _run(self, key, 0.0)


@app.task(shared=False, base=LockedTask, bind=True, lock_limit=None, lock_rate=(1, 1.0), lock_rate_on=["key"])
def rated_retrying(self: Any, key: str) -> str:
    """No lock, 1 start per 1 s per ``key``, waits: the first run of each call retries at once (``self.retry``)."""
    out = _run(self, key, 0.0)
    if not self.request.retries:
        raise self.retry(countdown=0)
    return out


@app.task(shared=False, base=LockedTask, bind=True, lock_rate=(1, 1.0), lock_rate_on=["key"])
def rated_slowing(self: Any, key: str, slow: bool) -> str:
    """1 start per 1 s per ``key``, waits; with ``slow``, the first run raises SlowDown(0.3) (its copy runs after)."""
    out = _run(self, key, 0.0)
    if slow and not getattr(self.request, "singleton_lock_slowed", None):
        raise SlowDown(0.3)
    return out


# -- checking the record against the window (used by the tests and benchmarks/rate_storm.py) -----------------------


def slot_rows(key_or_keys: str | list[str]) -> list[list[Any]]:
    """``[key, task_id, slot, {node index: count time}]`` of every start of these keys."""
    keys = {key_or_keys} if isinstance(key_or_keys, str) else set(key_or_keys)
    return [r for r in (json.loads(x) for x in record.lrange("rate_slots", 0, -1)) if r[0] in keys]


def slot_violations(rows: list[list[Any]], period: float) -> list[str]:
    """What the guarantee rests on, checked exactly: two successive starts of one slot were counted on a common node,
    and on every node that counted both, the later one at least ``period`` after the earlier (that node's clock)."""
    out: list[str] = []
    by_slot: dict[int, list[dict[str, float]]] = {}
    for r in rows:
        by_slot.setdefault(r[2], []).append(r[3])
    for slot, starts in by_slot.items():
        starts.sort(key=lambda t: min(t.values()))
        for x, y in itertools.pairwise(starts):
            common = x.keys() & y.keys()
            if not common:
                out.append(f"slot {slot}: {x} and {y} share no node")
            for n in common:
                if y[n] - x[n] < period - 1e-6:
                    out.append(f"slot {slot} node {n}: {y[n] - x[n]:.6f} s apart")
    return out


def busiest_window(rows: list[list[Any]], period: float) -> int:
    """The most starts any window of ``period`` holds, each start at the earliest node time it was counted at, less
    twice the largest spread of one start's node times (the nodes read TIME at slightly different moments)."""
    ats = sorted(min(r[3].values()) for r in rows)
    slack = 2 * max((max(r[3].values()) - min(r[3].values()) for r in rows), default=0.0) + 1e-6
    best = j = 0
    for i, at in enumerate(ats):
        while ats[j] <= at - (period - slack):
            j += 1
        best = max(best, i - j + 1)
    return best


# -- stacked limits and costs (issue 33) ----------------------------------------------------------------------------

#: Three stacked limits: 4 per 1 s per key, 6 per 2 s per key, 3 per 1.5 s per (key, tenant).
STACK = [(4, 1.0), Rate((6, 2.0), on=["key"]), Rate((3, 1.5), on=["key", "tenant"])]


def _run_stacked(task: Any, key: str, tenant: str, real: int | None) -> str:
    """Record ``[key, task_id, tenant, estimate, real, {node: count time}, slots per limit]`` in ``stack_runs``;
    ``real``: report it (``rate_spent``) before recording."""
    run = task.request.__dict__.get("_singleton_lock")
    share = RATE_FEATURE.share(run) if run is not None else None
    if real is not None:
        task.rate_spent(real)
    if share is not None and share.slot is not None:
        row = [key, task.request.id, tenant, share.estimate, share.units, share.slot[1], share.slots]
        record.rpush("stack_runs", json.dumps(row))
    return key


@app.task(shared=False, base=LockedTask, bind=True, lock_limit=None, lock_rate=STACK, lock_rate_on=["key"])
def stacked(self: Any, key: str, tenant: str, n: int) -> str:
    """No lock; a start needs a share of each of the three limits of STACK."""
    return _run_stacked(self, key, tenant, None)


def estimate(key: str, tenant: str, est: int, real: int) -> int:
    return est


@app.task(
    shared=False,
    base=LockedTask,
    bind=True,
    lock_limit=None,
    lock_rate=[(10, 2.0), Rate((6, 2.0), on=["key", "tenant"])],
    lock_rate_on=["key"],
    lock_rate_cost=estimate,
)
def costed(self: Any, key: str, tenant: str, est: int, real: int) -> str:
    """A start takes ``est`` units of 10 per 2 s per key and of 6 per 2 s per (key, tenant); the run reports
    ``real``."""
    return _run_stacked(self, key, tenant, real)


def tokens(key: str, tenant: str, est: int, real: int, *_: Any, **__: Any) -> int:
    """The token estimate of a call (the test gives it)."""
    return est


@app.task(
    shared=False,
    base=LockedTask,
    bind=True,
    lock_limit=None,
    lock_rate=[Rate((3, 1.0)), Rate((10, 1.0), cost=tokens)],
    lock_rate_on=["key"],
)
def priced(self: Any, key: str, tenant: str, est: int, real: int, limit: Any = None) -> str:
    """Requests and tokens per second at once (a cost per limit): a start takes 1 unit of 3 per 1 s per key and
    ``est`` of 10 per 1 s per key; the run reports ``real`` (``rate_spent``: the token limit only, its cost is the
    estimate; ``limit``: the one it names). Records as :func:`_run_stacked`, ``real`` being the tokens kept, then the
    units held per limit."""
    run = self.request.__dict__.get("_singleton_lock")
    share = RATE_FEATURE.share(run) if run is not None else None
    before = list(share.per) if share is not None else []
    self.rate_spent(real, limit=tuple(limit) if isinstance(limit, list) else limit)
    if share is not None and share.slot is not None:
        row = [key, self.request.id, tenant, before, share.per[1], share.slot[1], share.slots, list(share.per)]
        record.rpush("stack_runs", json.dumps(row))
    return key


def stack_rows(key: str) -> list[list[Any]]:
    return [r for r in (json.loads(x) for x in record.lrange("stack_runs", 0, -1)) if r[0] == key]


def limit_rows(rows: list[list[Any]], limit: int, on_tenant: bool, kept: bool = False) -> list[list[Any]]:
    """``slot_rows``-like rows of one limit of stacked runs: one row per slot (``kept``: only the slots a run still
    holds after its correction, its lowest ``real`` ones: a refund gives the highest back first), keyed by the
    limit's key (the key, or the key and the tenant)."""
    out = []
    for key, task_id, tenant, _est, real, times, slots, *_ in rows:
        held = sorted(slots[limit])[: min(real, len(slots[limit]))] if kept else slots[limit]
        for slot in held:
            out.append([f"{key}/{tenant}" if on_tenant else key, task_id, slot, times])
    return out


# -- SlowDown (issue 33) ------------------------------------------------------------------------------------------

SLOW_PAUSE = 6.0


@app.task(shared=False, base=LockedTask, bind=True, lock_rate=(10, 1.0), lock_rate_on=["key"], lock_unique_on=["n"])
def api_call(self: Any, key: str, n: int, raise_once: bool = False) -> str:
    """Records ``[key, n, task_id, node time of the counted start, raised]`` in ``slow_runs``; with ``raise_once``,
    the first run of this call raises SlowDown(SLOW_PAUSE), as a body told "429, Retry-After" would."""
    raising = bool(raise_once and record.set(f"slow-raised:{self.request.id}", 1, nx=True))
    record.rpush("slow_runs", json.dumps([key, n, self.request.id, self.rate_started_at, raising, time.time()]))
    if raising:
        raise SlowDown.from_retry_after(str(int(SLOW_PAUSE)))
    return f"{key}:{n}"


def slow_rows(key: str) -> list[list[Any]]:
    return [r for r in (json.loads(x) for x in record.lrange("slow_runs", 0, -1)) if r[0] == key]


@app.task(shared=False, base=LockedTask, bind=True, lock_unique_on=["key"])
def unrated_slow(self: Any, key: str) -> str:
    """No lock_rate: a SlowDown has no rate to pause, and fails the call."""
    raise SlowDown(1.0)


# -- SlowDown beside the other features (issue 33, the attack) ----------------------------------------------------

#: A pause longer than the window (1 s) plus the log's 1 s of slack: a log's expiry reset to window + 1 s ends it.
LONG_PAUSE = 5.0
#: The pause of the tests that only need the raising call's copy to wait a while.
SHORT_PAUSE = 2.0


def _slow_run(task: Any, key: str, n: int, pause: float) -> str:
    """Records ``[key, n, task_id, node time of the counted start, raised, wall time, retries]`` in ``slow_runs``;
    ``pause`` > 0: the first run of this task id raises SlowDown(pause)."""
    raising = bool(pause > 0 and record.set(f"slow-raised:{task.request.id}", 1, nx=True))
    row = [key, n, task.request.id, task.rate_started_at, raising, time.time(), task.request.retries]
    record.rpush("slow_runs", json.dumps(row))
    if raising:
        record.set(f"slow-paused:{key}", 1)
        raise SlowDown(pause)
    return f"{key}:{n}"


@app.task(shared=False, base=LockedTask, bind=True, lock_limit=None, lock_rate=(10, 1.0), lock_rate_on=["key"])
def slow_spend(self: Any, key: str, n: int, mode: str) -> str:
    """``mode`` "raise": SlowDown(LONG_PAUSE); "spend": once a call of ``key`` raised (a bounded wait), report 3
    units (``rate_spent``: an extra charge written during the pause); "": run."""
    if mode == "spend":
        for _ in range(200):  # at most 10 s
            if record.exists(f"slow-paused:{key}"):
                break
            time.sleep(0.05)
        time.sleep(0.3)  # the raising body's pause is written after it raised
        self.rate_spent(3)
        record.rpush("slow_spent", json.dumps([key, time.time()]))
    return _slow_run(self, key, n, LONG_PAUSE if mode == "raise" else 0.0)


@app.task(
    shared=False,
    base=LockedTask,
    bind=True,
    lock_scope="queue",
    lock_unique_on=["key"],
    lock_rate=(10, 1.0),
    lock_rate_on=["key"],
)
def slow_queued(self: Any, key: str, n: int) -> str:
    """Queue scope: one job per ``key`` from ``delay()`` to its end; its first run raises SlowDown(SHORT_PAUSE)."""
    return _slow_run(self, key, n, SHORT_PAUSE)


@app.task(
    shared=False,
    base=LockedTask,
    bind=True,
    lock_unique_on=["key"],
    lock_on_duplicate="replace",
    lock_rate=(10, 1.0),
    lock_rate_on=["key"],
)
def slow_latest(self: Any, key: str, n: int, pause: float = 0.0) -> str:
    """Keep-latest (replace): of the calls of ``key`` waiting, only the newest runs."""
    return _slow_run(self, key, n, pause)


@app.task(
    shared=False,
    base=LockedTask,
    bind=True,
    lock_limit=None,
    lock_rate=(10, 1.0),
    lock_rate_on=["key"],
    autoretry_for=(Exception,),
    retry_kwargs={"countdown": 0, "max_retries": 3},
)
def slow_autoretry(self: Any, key: str, n: int) -> str:
    """autoretry_for=(Exception,) (retried at once): its first run raises SlowDown(SHORT_PAUSE)."""
    return _slow_run(self, key, n, SHORT_PAUSE)


@app.task(
    shared=False,
    base=LockedTask,
    bind=True,
    lock_debounce=0.3,
    lock_unique_on=["key"],
    lock_rate=(10, 1.0),
    lock_rate_on=["key"],
)
def slow_debounced(self: Any, key: str, n: int) -> str:
    """A burst of calls of ``key`` runs once, with its last call's ``n``; the burst's job raises SlowDown(SHORT_PAUSE)
    on its first run."""
    return _slow_run(self, key, n, SHORT_PAUSE)


@app.task(
    shared=False,
    base=LockedTask,
    bind=True,
    lock_limit=None,
    lock_rate=[(10, 2.0), Rate("5/s", on=["key", "tenant"])],
    lock_rate_on=["key"],
)
def slow_tenant(self: Any, key: str, tenant: str, n: int, raising: bool = False) -> str:
    """Two stacked limits (10 per 2 s per key, 5/s per key and tenant); ``raising``: the first run raises
    SlowDown(SHORT_PAUSE, limit="5/s"), pausing only its tenant's limit."""
    raised = bool(raising and record.set(f"slow-raised:{self.request.id}", 1, nx=True))
    row = [key, n, self.request.id, self.rate_started_at, raised, time.time(), tenant]
    record.rpush("slow_runs", json.dumps(row))
    if raised:
        raise SlowDown(SHORT_PAUSE, limit="5/s")
    return f"{key}:{tenant}:{n}"


@app.task(
    shared=False, base=LockedTask, bind=True, lock_rate=(10, 1.0), lock_rate_on=["key"], lock_on_rate_limit="skip"
)
def slow_skip(self: Any, key: str, n: int) -> str:
    """Over the rate: skipped (REVOKED). Its first run raises SlowDown(LONG_PAUSE), longer than the workers' longest
    countdown here (the broker's visibility timeout / 2: 4 s): its copy comes back within the pause."""
    return _slow_run(self, key, n, LONG_PAUSE)


@app.task(
    shared=False, base=LockedTask, bind=True, lock_rate=(10, 1.0), lock_rate_on=["key"], lock_on_rate_limit="fail"
)
def slow_fail(self: Any, key: str, n: int) -> str:
    """As slow_skip, failing (RateLimitedError) over the rate."""
    return _slow_run(self, key, n, LONG_PAUSE)


@app.task(
    shared=False,
    base=LockedTask,
    bind=True,
    lock_unique_on=["key"],
    lock_rate=(10, 1.0),
    lock_rate_on=["key"],
    lock_on_unavailable="run",
)
def slow_unguarded(self: Any, key: str, n: int) -> str:
    """Runs unguarded (its start uncounted) without a quorum; its first run raises SlowDown(1.0)."""
    return _slow_run(self, key, n, 1.0)


_PAIR = {"lock_group": "slowpair", "lock_unique_on": ["key"], "lock_limit": 2, "lock_on_duplicate": "reschedule"}


@app.task(shared=False, base=LockedTask, bind=True, lock_rate=(10, 1.0), **_PAIR)
def slow_pair_a(self: Any, key: str, n: int) -> str:
    """A group (two tasks, one lock of 2 slots, one rate) whose task a's first run raises SlowDown(1.5)."""
    return _slow_run(self, key, n, 1.5)


@app.task(shared=False, base=LockedTask, bind=True, lock_rate=(10, 1.0), **_PAIR)
def slow_pair_b(self: Any, key: str, n: int) -> str:
    """slow_pair_a's partner in its group."""
    return _slow_run(self, key, n, 0.0)


# -- SlowDown after the body's own retry(throw=False) (issue 33, second attack) ------------------------------------


def _retry_then_slow(task: Any, key: str, n: int) -> str:
    """The first run of this task id sends a retry (``retry(throw=False)``, countdown 0.3 s), then raises
    SlowDown(SHORT_PAUSE): the call must run once more, not twice (the retry and a SlowDown copy)."""
    raising = bool(record.set(f"slow-raised:{task.request.id}", 1, nx=True))
    row = [key, n, task.request.id, task.rate_started_at, raising, time.time(), task.request.retries]
    record.rpush("slow_runs", json.dumps(row))
    if raising:
        task.retry(countdown=0.3, throw=False, max_retries=3)
        raise SlowDown(SHORT_PAUSE)
    return f"{key}:{n}"


@app.task(shared=False, base=LockedTask, bind=True, lock_unique_on=["key"], lock_rate=(10, 1.0), lock_rate_on=["key"])
def slow_after_retry(self: Any, key: str, n: int) -> str:
    return _retry_then_slow(self, key, n)


@app.task(shared=False, base=LockedTask, bind=True, lock_limit=None, lock_rate=(10, 1.0), lock_rate_on=["key"])
def slow_after_retry_unlocked(self: Any, key: str, n: int) -> str:
    return _retry_then_slow(self, key, n)


@app.task(shared=False, base=LockedTask, bind=True, lock_unique_on=["key"], lock_rate=(10, 1.0), lock_rate_on=["key"])
def slow_dup(self: Any, key: str, n: int, pause: float = 0.0) -> str:
    """One job per ``key`` at once (a duplicate is skipped); ``pause`` > 0: its first run raises SlowDown(pause)."""
    return _slow_run(self, key, n, pause)


@app.task(shared=False, base=LockedTask, bind=True, lock_group="slowers", lock_unique_on=["key"], lock_rate=(10, 1.0))
def slow_group_a(self: Any, key: str, n: int, pause: float = 0.0) -> str:
    """One rate for both tasks of the group "slowers" (no lock_rate_on): a SlowDown in either pauses both."""
    return _slow_run(self, key, n, pause)


@app.task(shared=False, base=LockedTask, bind=True, lock_group="slowers", lock_unique_on=["key"], lock_rate=(10, 1.0))
def slow_group_b(self: Any, key: str, n: int, pause: float = 0.0) -> str:
    return _slow_run(self, key, n, pause)


@app.task(
    shared=False,
    base=LockedTask,
    bind=True,
    lock_unique_on=["key"],
    lock_cooldown=1.5,
    lock_rate=(10, 1.0),
    lock_rate_on=["key"],
)
def slow_cool(self: Any, key: str, n: int, pause: float = 0.0) -> str:
    """One job per ``key`` (a duplicate is skipped), and none within 1.5 s of a success of the key (cooldown)."""
    return _slow_run(self, key, n, pause)


@app.task(
    shared=False,
    base=LockedTask,
    bind=True,
    lock_unique_on=["key"],
    lock_rate=(10, 1.0),
    lock_rate_on=["key"],
    max_retries=1,
)
def slow_exhausted(self: Any, key: str, n: int) -> str:
    """max_retries=1: the first run retries (spending the one retry); the retry, with no retry left, hands a
    SlowDown(SHORT_PAUSE) to ``self.retry(exc=...)`` once: it pauses the rate and runs once after it."""
    if self.request.retries == 0:
        raise self.retry(countdown=0.1)
    try:
        return _slow_run(self, key, n, SHORT_PAUSE)
    except SlowDown as exc:
        raise self.retry(exc=exc) from exc


@app.task(shared=False, base=LockedTask, bind=True, lock_unique_on=["key"], lock_rate=(10, 1.0), lock_rate_on=["key"])
def slow_then_long(self: Any, key: str, n: int, duration: float) -> str:
    """Its first run raises SlowDown(SHORT_PAUSE); every later run records its pid (``slow_pids``), runs ``duration``
    s and records its end (``slow_done``)."""
    out = _slow_run(self, key, n, SHORT_PAUSE)
    record.rpush("slow_pids", json.dumps([key, os.getpid()]))
    time.sleep(duration)
    record.rpush("slow_done", json.dumps([key, self.request.id]))
    return out


@app.task(shared=False, base=LockedTask, bind=True, lock_limit=None, lock_rate=(10, 1.0), lock_rate_on=["key"])
def slow_free(self: Any, key: str, n: int, pause: float = 0.0) -> str:
    """No lock, 10 starts per 1 s per ``key``; ``pause`` > 0: its first run raises SlowDown(pause)."""
    return _slow_run(self, key, n, pause)


@app.task(
    shared=False,
    base=LockedTask,
    bind=True,
    lock_unique_on=["key"],
    lock_limit=2,
    lock_rate=(10, 1.0),
    lock_rate_on=["key"],
)
def slow_two(self: Any, key: str, n: int, pause: float = 0.0) -> str:
    """At most 2 runs of ``key`` at once (a third is skipped); ``pause`` > 0: its first run raises SlowDown(pause);
    every run lasts 0.5 s and records its end (``slow_done``)."""
    out = _slow_run(self, key, n, pause)
    time.sleep(0.5)
    record.rpush("slow_done", json.dumps([key, self.request.id, time.time()]))
    return out


# -- booked slots beside other options (tests/policies/test_rate_booking_workers.py) ---------------------------------


@app.task(
    shared=False,
    base=LockedTask,
    bind=True,
    lock_ttl=3,
    lock_debounce=1.2,
    lock_unique_on=["key"],
    lock_rate=(1, 3.0),
    lock_rate_on=["key"],
)
def booked_debounced(self: Any, key: str, n: int) -> str:
    """A burst of calls runs once, 1.2 s after its last call; 1 start per 3 s per ``key``, waiting (booked)."""
    return _run(self, key, 0.0)


@app.task(
    shared=False,
    base=LockedTask,
    bind=True,
    lock_ttl=3,
    lock_debounce=1.2,
    lock_unique_on=["key"],
    lock_rate=[Rate((1, 3.0), on=["key"]), Rate((50, 60.0), on=["key"])],
)
def stacked_debounced(self: Any, key: str, n: int) -> str:
    """booked_debounced with a second limit: stacked limits are not booked (a waiting call is re-sent to ask again)."""
    return _run(self, key, 0.0)


@app.task(
    shared=False,
    base=LockedTask,
    bind=True,
    lock_cooldown=30,
    lock_unique_on=["key"],
    lock_rate=(1, 0.5),
    lock_rate_on=["bucket"],
)
def booked_cool(self: Any, key: str, bucket: str) -> str:
    """One run of ``key`` per 30 s after a success (cooldown); 1 start per 0.5 s per ``bucket``, waiting (booked)."""
    return _run(self, bucket, 0.0)


@app.task(
    shared=False,
    base=LockedTask,
    bind=True,
    lock_scope="queue",
    lock_unique_on=["key"],
    lock_rate=(1, 0.5),
    lock_rate_on=["bucket"],
)
def booked_queued(self: Any, key: str, bucket: str) -> str:
    """Queue scope: one job per ``key`` from ``delay()`` to its end; 1 start per 0.5 s per ``bucket`` (booked)."""
    return _run(self, bucket, 0.0)


@app.task(
    shared=False,
    base=LockedTask,
    bind=True,
    lock_unique_on=["key"],
    lock_on_duplicate="reschedule",
    lock_max_waiting=1,
    lock_rate=(1, 2.0),
    lock_rate_on=["bucket"],
)
def booked_capped(self: Any, key: str, bucket: str, duration: float = 0.0) -> str:
    """One job per ``key`` at once, at most 1 waiting in its line; 1 start per 2 s per ``bucket`` (booked)."""
    return _run(self, bucket, duration)


@app.task(shared=False, base=LockedTask, bind=True, lock_limit=None, lock_rate=(1, 2.0), lock_rate_on=["key"])
def booked_free(self: Any, key: str, n: int, duration: float = 0.0) -> str:
    """No lock (lock_limit=None), 1 start per 2 s per ``key``, waiting (booked); acks_late (locked_app)."""
    return _run(self, key, duration)


@app.task(shared=False, base=LockedTask, bind=True, lock_ttl=3, lock_rate=(1, 5.0), lock_rate_on=["key"])
def booked_locked(self: Any, key: str, n: int, duration: float = 0.0) -> str:
    """Locked (one run of a call at a time, lease 3 s), 1 start per 5 s per ``key``, waiting (booked); acks_late."""
    return _run(self, key, duration)
