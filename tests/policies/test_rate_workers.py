"""``lock_rate`` with real workers: two prefork workers of 3 processes each, three lock nodes (and one), a Redis
broker. The node time of every counted start is recorded by the run (``rate_tasks``) and checked against the window:
no window of the period holds more than N starts. Every loop is bounded in count and time; nothing here asserts how
fast anything was (the rate's throughput is a benchmark's business: benchmarks/bench_rate.py).
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import sys
import time
from collections.abc import Iterator
from types import ModuleType
from typing import Any

import pytest
from celery.exceptions import TaskRevokedError
from worker_cluster import Cluster, cluster, new_key, polling

from celery_singleton_lock import RateLimitedError
from celery_singleton_lock.lock.record import sibling_key

pytestmark = pytest.mark.timeout(300)
#: Node clocks of one machine, read in separate calls: a counted start's time is the earliest TIME of the nodes
#: that counted it, so two starts sharing a slot may look this much closer than a window.
SLACK = 0.01


@pytest.fixture(scope="module")
def c(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with cluster(tmp_path_factory.mktemp("rate"), ttl=3.0, env={"CSL_VISIBILITY": "8"}) as cl:
        cl.app_module()
        yield cl


@pytest.fixture(scope="module")
def workers(c: Cluster) -> list[Any]:
    """One pair of workers (2 x 3 processes) on the three nodes for the whole module (a killed one is replaced)."""
    return [c.worker(name, queues="rate", concurrency=3, extra=["-I", "rate_tasks"]) for name in ("rate-a", "rate-b")]


@pytest.fixture(scope="module")
def tasks(c: Cluster, workers: list[Any]) -> ModuleType:
    sys.modules.pop("rate_tasks", None)
    import rate_tasks  # noqa: PLC0415 - imported with the cluster's env, after locked_app

    return rate_tasks


def _worker(c: Cluster, name: str, queues: str, **kw: Any) -> Any:
    return c.worker(name, queues=queues, concurrency=3, extra=["-I", "rate_tasks"], **kw)


def _rows(c: Cluster, key: str, what: str = "rate_runs") -> list[list[Any]]:
    return [r for r in (json.loads(x) for x in c.record.lrange(what, 0, -1)) if r[0] == key]


def _busiest_window(ats: list[float], period: float) -> int:
    """The most starts any window of ``period`` s (less SLACK) holds."""
    ats = sorted(ats)
    best = 0
    j = 0
    for i, at in enumerate(ats):
        while ats[j] <= at - (period - SLACK):
            j += 1
        best = max(best, i - j + 1)
    return best


def test_the_window_checks_are_not_vacuous(tasks: ModuleType) -> None:
    assert _busiest_window([0.0, 0.5, 0.99, 1.0, 1.5], 1.0) == 3
    assert _busiest_window([0.0, 1.0, 2.0], 1.0) == 1
    close = [["k", "a", 0, {"0": 10.0, "1": 10.0}], ["k", "b", 0, {"1": 10.5, "2": 10.5}]]
    assert tasks.slot_violations(close, 1.0) == ["slot 0 node 1: 0.500000 s apart"]
    apart = [["k", "a", 0, {"0": 10.0, "1": 10.0}], ["k", "b", 0, {"2": 10.5}]]
    assert tasks.slot_violations(apart, 1.0) == [f"slot 0: {apart[0][3]} and {apart[1][3]} share no node"]
    assert not tasks.slot_violations([*close[:1], ["k", "b", 0, {"1": 11.0}]], 1.0)
    assert tasks.busiest_window([["k", str(i), i, {"0": 10.0 + i / 10}] for i in range(12)], 1.0) == 10


def test_a_storm_for_one_key_never_exceeds_the_rate_in_any_window(
    c: Cluster, tasks: ModuleType, workers: list[Any]
) -> None:
    """60 calls for one key at (10, 1.0) on 2 x 3 processes, one pool child SIGKILLed mid-window (its start was
    counted; its redelivery counts again), then a whole worker SIGKILLed mid-storm (its waiting and running calls come
    back by redelivery) and replaced, while another key's calls run beside them without waiting."""
    busy, quiet = new_key("busy"), new_key("quiet")
    results = [tasks.rated.apply_async((busy, n, 0.2), queue="rate") for n in range(60)]
    others = [tasks.rated.apply_async((quiet, n, 0.0), queue="rate") for n in range(5)]
    # Kill one pool child while its run is in the body (after its start was counted).
    killed = None
    for _ in polling(30, 0.02):
        started = {r[1] for r in _rows(c, busy, "rate_started")} - {r[1] for r in _rows(c, busy)}
        rows = [r for r in _rows(c, busy, "rate_started") if r[1] in started]
        if rows:
            killed = rows[0]
            os.kill(int(rows[0][2]), signal.SIGKILL)
            break
    assert killed is not None, "no run to kill"
    # Then a whole worker, a moment later, mid-storm; a new one takes its place (the module's later tests use it).
    for _ in polling(10, 0.05):
        if len(_rows(c, busy, "rate_started")) >= 15:
            break
    dead = workers[1]
    dead.kill()
    workers[1] = c.worker("rate-c", queues="rate", concurrency=3, extra=["-I", "rate_tasks"])
    # Wait for every call, 60 s at most in all; a call still unfinished once nothing has finished for 20 s (more than
    # two of the broker's 8 s visibility timeouts: any redelivery has come back by then) is lost (examined below).
    pending, changed = list(results + others), time.monotonic()
    for _ in polling(60, 0.2):
        still = [r for r in pending if not r.ready()]
        if len(still) < len(pending):
            changed = time.monotonic()
        pending = still
        if not pending or time.monotonic() - changed > 20:
            break
    lost = [r.id for r in pending]
    states = [r.state for r in results + others]
    # docs/reliability.md, Finding 2 (the broker transport, not this library): kombu's Redis transport pops a message
    # with BRPOP and records it unacked in a second round trip, so a copy re-sent just as a whole worker is SIGKILLed
    # can be handed to the dead worker's BRPOP and vanish. The storm re-sends many copies a second, so this happens
    # here. Such a call is PENDING and its last copy was published ("re-sent") and never received by any worker;
    # anything else unfinished (received and then lost, FAILURE, REVOKED) fails the test.
    logs = "".join(w.log() for w in (*workers, dead))
    for task_id in lost:
        lines = [line for line in logs.splitlines() if task_id in line]
        assert lines and "re-sent to run in" in lines[-1], f"{task_id} lost after a worker received it: {lines[-3:]}"
    assert len(lost) <= 3, lost
    assert states.count("SUCCESS") + len(lost) == len(states), states
    started = _rows(c, busy, "rate_started")
    ats = [r[3] for r in started]
    assert None not in ats
    assert len(started) >= 61  # the killed run started twice (counted twice)
    rows = tasks.slot_rows(busy)
    assert len(rows) == len(started)
    assert not tasks.slot_violations(rows, 1.0)
    assert tasks.busiest_window(rows, 1.0) <= 10
    # (That the rate is used, not only respected, is test_one_node's: a floor of starts per window here would be a
    # throughput assertion on a shared machine.)
    assert sum(1 for r in started if r[5] > 0) >= 20  # many waited: re-sent for the window's moment
    # The quiet key shared no share with the busy one: none of its calls waited for a window.
    assert [r[5] for r in _rows(c, quiet)] == [0] * 5


def test_a_paused_node_mid_window_keeps_the_rate(c: Cluster, tasks: ModuleType) -> None:
    """One lock node of three SIGSTOPped mid-storm, then resumed: the other two are a quorum, no window over N."""
    key = new_key("pause")
    results = [tasks.rated.apply_async((key, n, 0.0), queue="rate") for n in range(30)]
    for _ in polling(20, 0.02):
        if len(_rows(c, key, "rate_started")) >= 5:
            break
    c.locks[0].pause()
    try:
        for _ in polling(20, 0.05):
            if len(_rows(c, key, "rate_started")) >= 20:
                break
    finally:
        c.locks[0].resume()
    for r in results:
        r.get(timeout=120, propagate=False)
    assert [r.state for r in results].count("SUCCESS") == 30
    rows = tasks.slot_rows(key)
    assert len(rows) == 30
    assert not tasks.slot_violations(rows, 1.0)
    assert tasks.busiest_window(rows, 1.0) <= 10


def test_skip_and_fail_over_the_rate_and_no_lock_with_lock_limit_none(c: Cluster, tasks: ModuleType) -> None:
    """Over "2/m": skip stores REVOKED, fail stores RateLimitedError; lock_limit=None runs equal calls side by side
    (no lock) and still never more than 3 starts per 1.5 s; a duplicate skipped by the lock uses no share."""
    k1, k2, k3, k4 = (new_key(p) for p in ("skip", "fail", "free", "dup"))
    skips = [tasks.rated_skip.apply_async((k1, n), queue="rate") for n in range(4)]
    fails = [tasks.rated_fail.apply_async((k2, n), queue="rate") for n in range(4)]
    for r in skips + fails:
        r.get(timeout=60, propagate=False)
    assert sorted(r.state for r in skips) == ["REVOKED", "REVOKED", "SUCCESS", "SUCCESS"]
    assert sorted(r.state for r in fails) == ["FAILURE", "FAILURE", "SUCCESS", "SUCCESS"]
    with pytest.raises(TaskRevokedError, match="rate 2 per 60 s of"):
        next(r for r in skips if r.state == "REVOKED").get(timeout=5)
    failed = next(r for r in fails if r.state == "FAILURE")
    with pytest.raises(RateLimitedError, match="rate 2 per 60 s of"):
        failed.get(timeout=5)
    # lock_limit=None: 9 equal calls, each 0.4 s long: they overlap (no lock), 3 per 1.5 s.
    free = [tasks.rated_unlocked.apply_async((k3, 0.4), queue="rate") for _ in range(9)]
    # A duplicate of a running job (the lock, lock_unique_on=["key"]) is skipped and counts nothing. The rate is
    # 2 per 60 s (over it: FAILURE), so a share a skipped duplicate used would still be spent when the holder ends:
    # the second job after it still starts (the second share), and a third one fails (the rate does count).
    holder = tasks.rated_dup.apply_async((k4, 1.5), queue="rate")
    for _ in polling(20, 0.02):
        if _rows(c, k4, "rate_started"):
            break
    dups = [tasks.rated_dup.apply_async((k4, 0.0), queue="rate") for _ in range(3)]
    for r in dups:
        r.get(timeout=30, propagate=False)
    assert [r.state for r in dups] == ["REVOKED"] * 3
    for r in dups:
        with pytest.raises(TaskRevokedError, match="duplicate of"):
            r.get(timeout=5)
    assert holder.get(timeout=30) == k4
    assert tasks.rated_dup.apply_async((k4, 0.0), queue="rate").get(timeout=30) == k4
    with pytest.raises(RateLimitedError, match="rate 2 per 60 s of"):
        tasks.rated_dup.apply_async((k4, 0.0), queue="rate").get(timeout=30)
    for r in free:
        assert r.get(timeout=60) == k3
    runs = _rows(c, k3)
    assert len(runs) == 9
    spans = sorted((r[4], r[6]) for r in runs)
    assert any(b[0] < a[1] for a, b in itertools.pairwise(spans))  # equal calls overlapped: no lock
    assert not tasks.slot_violations(tasks.slot_rows(k3), 1.5)
    assert tasks.busiest_window(tasks.slot_rows(k3), 1.5) <= 3
    assert len(_rows(c, k4, "rate_started")) == 2


def test_one_node(c: Cluster, tasks: ModuleType) -> None:
    """The same rate on a single lock node (workers told one URL only)."""
    one = {"CSL_LOCK_URLS": c.lock_urls[2]}
    _worker(c, "one-a", "rone", env=one)
    _worker(c, "one-b", "rone", env=one)
    key = new_key("one")
    results = [tasks.rated.apply_async((key, n, 0.0), queue="rone") for n in range(25)]
    for r in results:
        r.get(timeout=90, propagate=False)
    assert [r.state for r in results].count("SUCCESS") == 25
    rows = tasks.slot_rows(key)
    assert not tasks.slot_violations(rows, 1.0)
    assert tasks.busiest_window(rows, 1.0) <= 10
    # The rate is used, not only respected, without timing the run: on one node (no split vote) a start is refused
    # only while 10 starts are in its window, so the first 10 of the window never wait, however slow the machine.
    assert sum(1 for r in _rows(c, key, "rate_started") if r[5] == 0) >= 10


def test_a_group_shares_the_lock_and_the_rate_of_its_tasks(c: Cluster, tasks: ModuleType) -> None:
    """``lock_group="mailer"``: a running send_welcome makes a send_digest of the same domain a duplicate, and the
    two tasks' starts share one rate of 3 per 1 s."""
    domain = new_key("dom")
    assert tasks.send_welcome.lock_key_for(domain) == tasks.send_digest.lock_key_for(domain)
    holder = tasks.send_welcome.apply_async((domain, 1.5), queue="rate")
    for _ in polling(20, 0.02):
        if _rows(c, domain, "rate_started"):
            break
    dup = tasks.send_digest.apply_async((domain, 0.0), queue="rate")
    dup.get(timeout=30, propagate=False)
    assert dup.state == "REVOKED"
    assert len(_rows(c, domain, "rate_started")) == 1  # the digest never started
    assert holder.get(timeout=30) == domain
    # One rate for the whole group (no lock_rate_on): 9 calls of both tasks over 9 domains (no duplicates among
    # them) all run, never more than 3 starts per second counted over both tasks.
    domains = [new_key("d") for _ in range(9)]
    calls = [
        (tasks.send_welcome if n % 2 else tasks.send_digest).apply_async((d, 0.0), queue="rate")
        for n, d in enumerate(domains)
    ]
    for r in calls:
        r.get(timeout=60, propagate=False)
    assert [r.state for r in calls] == ["SUCCESS"] * 9
    rows = tasks.slot_rows(domains)
    assert len(rows) == 9
    assert not tasks.slot_violations(rows, 1.0)
    assert tasks.busiest_window(rows, 1.0) <= 3


def test_a_group_shares_its_cooldown_its_limit_and_its_line(c: Cluster, tasks: ModuleType) -> None:
    """README: tasks of one ``lock_group`` share "their lock, limit, cooldown, line": a cool_b within the cooldown
    of a cool_a that ran is skipped; with ``lock_limit=2`` two line_a runs fill the slots, a line_b waits in the
    same line and runs after one of them, and never more than 2 of both tasks run at once."""
    k = new_key("cool")
    assert tasks.cool_a.apply_async((k,), queue="rate").get(timeout=30) == k
    late = tasks.cool_b.apply_async((k,), queue="rate")
    late.get(timeout=30, propagate=False)
    assert late.state == "REVOKED"
    assert len(_rows(c, k, "rate_started")) == 1
    k2 = new_key("line")
    holders = [tasks.line_a.apply_async((k2, 1.5), queue="rate") for _ in range(2)]
    for _ in polling(20, 0.02):
        if len(_rows(c, k2, "rate_started")) >= 2:
            break
    waiting = tasks.line_b.apply_async((k2, 0.0), queue="rate")
    for r in [*holders, waiting]:
        assert r.get(timeout=60) == k2
    runs = sorted(_rows(c, k2), key=lambda r: r[4])
    assert len(runs) == 3
    (b_run,) = [r for r in runs if r[1] == waiting.id]
    assert b_run[4] >= min(r[6] for r in runs if r[1] != waiting.id), "line_b started while both slots were held"


def test_a_limit_computed_per_call_is_the_limit_of_that_call_s_key(c: Cluster, tasks: ModuleType) -> None:
    """``lock_limit=tier_limit``: 3 long calls of a premium customer run 2 at once (the third is skipped, naming the
    limit); 2 of a basic one run 1 at once."""
    premium, basic = new_key("premium"), new_key("basic")
    first = [tasks.per_tier.apply_async((premium, 2.0, n), queue="rate") for n in range(2)]
    first.append(tasks.per_tier.apply_async((basic, 2.0, 0), queue="rate"))
    for _ in polling(30, 0.02):
        if len(_rows(c, premium, "rate_started")) >= 2 and _rows(c, basic, "rate_started"):
            break
    late = [
        tasks.per_tier.apply_async((premium, 0.0, 9), queue="rate"),
        tasks.per_tier.apply_async((basic, 0.0, 9), queue="rate"),
    ]
    for r in late:
        r.get(timeout=30, propagate=False)
    assert [r.state for r in late] == ["REVOKED", "REVOKED"]
    with pytest.raises(TaskRevokedError, match="at its limit of 2 runs"):
        late[0].get(timeout=5)
    for r in first:
        assert r.get(timeout=30) in (premium, basic)
    assert len(_rows(c, premium, "rate_started")) == 2


def test_a_debounced_delivery_that_is_not_due_yet_uses_no_share_of_the_rate(c: Cluster, tasks: ModuleType) -> None:
    """Review (issue 22): a burst's message that reaches a worker before the burst is due is re-sent for its due
    time; that deferred delivery must not count a start. With "1/m" and skip, the burst's one run must run (it was
    REVOKED: the not-due delivery had used the minute's only share)."""
    key = new_key("deb")
    first = tasks.rated_debounced.apply_async((key, 0), queue="rate")
    # Calls every 0.15 s for 2 s keep the burst from being due (debounce 0.4 s): its message, sent with a 0.4 s
    # countdown, reaches a worker while later calls still move the due time on.
    for n, _ in enumerate(polling(2.0, 0.15), start=1):
        tasks.rated_debounced.apply_async((key, n), queue="rate")
    first.get(timeout=60, propagate=False)
    assert first.state == "SUCCESS", first.result
    assert len(_rows(c, key)) == 1


def _resent_for_rate(c: Cluster, task_id: str, timeout: float = 30.0, reason: str = "rate") -> None:
    """Wait until a worker logged ``task_id`` re-sent to wait for its rate's window (or ``reason``; bounded)."""
    for _ in polling(timeout, 0.05):
        lines = "".join(w.log() for w in c.workers).splitlines()
        if any(task_id in line and "re-sent to run in" in line and f"({reason})" in line for line in lines):
            return
    raise AssertionError(f"{task_id} was not re-sent for its {reason} within {timeout} s")


def _line_length(c: Cluster, lock_key: str) -> int:
    with c.lock_client(c.locks[0]) as client:
        return int(client.zcard(sibling_key(lock_key, ":waiters")))


def test_a_call_waiting_for_its_rate_keeps_its_place_against_lock_max_waiting(c: Cluster, tasks: ModuleType) -> None:
    """Issue 29 finding 4: a call re-sent to wait for its rate window is that call again when it comes back: with
    lock_max_waiting=1 and the line full, it waits in line (runs), it is not REVOKED as a new duplicate."""
    key = new_key("capped")
    b1, b2, b3 = new_key("b1"), new_key("b2"), new_key("b3")
    assert tasks.rated_capped.apply_async((key, b1, 0.0), queue="rate").get(timeout=30) == key  # b1's window used
    waiting = tasks.rated_capped.apply_async((key, b1, 0.0), queue="rate")  # the lock is free, the window is not
    _resent_for_rate(c, waiting.id)
    holder = tasks.rated_capped.apply_async((key, b2, 6.0), queue="rate")
    for _ in polling(20, 0.02):
        if any(r[1] == holder.id for r in _rows(c, key, "rate_started")):
            break
    lock_key = tasks.rated_capped.lock_key_for(key, b1)
    queued = tasks.rated_capped.apply_async((key, b3, 0.0), queue="rate")  # fills the line (1 waiting)
    for _ in polling(20, 0.02):
        if _line_length(c, lock_key) >= 1:
            break
    assert _line_length(c, lock_key) == 1
    for r in (waiting, holder, queued):
        r.get(timeout=60, propagate=False)
    assert [waiting.state, holder.state, queued.state] == ["SUCCESS"] * 3, waiting.result


def test_replace_keeps_only_the_newest_of_calls_waiting_for_the_rate(c: Cluster, tasks: ModuleType) -> None:
    """Issue 29 finding 8: with replace, two calls waiting for the rate's window (v2, then v3) are a line of their
    own: only the newest (v3) runs; v2 ends REVOKED "superseded" naming v3, never run after it."""
    key = new_key("latest")
    assert tasks.rated_latest.apply_async((key, 1), queue="rate").get(timeout=30) == key  # the window is used
    v2 = tasks.rated_latest.apply_async((key, 2), queue="rate")
    _resent_for_rate(c, v2.id)
    v3 = tasks.rated_latest.apply_async((key, 3), queue="rate")
    _resent_for_rate(c, v3.id)
    assert v3.get(timeout=60) == key
    with pytest.raises(TaskRevokedError, match=f"superseded by task {v3.id}"):
        v2.get(timeout=30)
    assert v2.id not in {r[1] for r in _rows(c, key, "rate_started")}
    # v2 left no booking behind (replace waits on today's path, never books: a superseded call's booking stayed in the
    # log, wasted, and v3 booked a window after it). v3 began once v1's start left the window: its start alone.
    rate_key = tasks.rated_latest.lock_rate_key_for(key, 3)
    assert [c.lock_client(s).zcard(rate_key) for s in c.locks] == [1] * len(c.locks)


# -- stacked limits and costs (issue 33) ----------------------------------------------------------------------------


def _limit_violations(tasks: ModuleType, rows: list[list[Any]], period: float, n: int) -> list[str]:
    """Per key of one limit: the slot check (exact, on the nodes' clocks) and the busiest window of its units."""
    out: list[str] = []
    by_key: dict[str, list[list[Any]]] = {}
    for r in rows:
        by_key.setdefault(r[0], []).append(r)
    for key, mine in by_key.items():
        out += [f"{key}: {v}" for v in tasks.slot_violations(mine, period)]
        busiest = tasks.busiest_window(mine, period)
        if busiest > n:
            out.append(f"{key}: {busiest} units in one window of {period} s, over {n}")
    return out


def test_a_storm_over_three_stacked_limits_never_exceeds_any_window(c: Cluster, tasks: ModuleType) -> None:
    """45 calls of one key from three tenants, no lock, three stacked limits (4 per 1 s per key, 6 per 2 s per key,
    3 per 1.5 s per key and tenant), one lock node SIGSTOPped mid-window and resumed: every call runs once, and no
    window of any limit holds more than its N, checked per slot and per window from the starts the nodes recorded."""
    key = new_key("stack")
    tenants = ["a", "b", "c"]
    results = [tasks.stacked.apply_async((key, tenants[n % 3], n), queue="rate") for n in range(45)]
    for _ in polling(30, 0.02):
        if len(tasks.stack_rows(key)) >= 6:
            break
    c.locks[1].pause()
    try:
        for _ in polling(20, 0.05):
            if len(tasks.stack_rows(key)) >= 15:
                break
    finally:
        c.locks[1].resume()
    for r in results:
        r.get(timeout=120, propagate=False)
    assert [r.state for r in results].count("SUCCESS") == 45
    rows = tasks.stack_rows(key)
    assert sorted(r[1] for r in rows) == sorted(r.id for r in results)  # each ran once
    assert all(len(r[6]) == 3 and all(len(s) == 1 for s in r[6]) for r in rows)
    limits = [(0, False, 1.0, 4), (1, False, 2.0, 6), (2, True, 1.5, 3)]
    for limit, on_tenant, period, n in limits:
        assert not _limit_violations(tasks, tasks.limit_rows(rows, limit, on_tenant), period, n), limit


def test_costs_estimated_then_corrected_by_the_runs_hold_the_window_to_the_corrected_units(
    c: Cluster, tasks: ModuleType
) -> None:
    """Calls estimated at 4 units of (10 per 2 s per key) and (6 per 2 s per key and tenant) that report 1-4 units
    (refunds): every call runs; the estimates never exceed a window (each start holds 4 slots of each limit), and
    the corrected units (the slots each run still holds) never exceed N in any window of either limit. Then calls
    that report more than their estimate: the extra units are charged on the nodes (a later start waits for them)."""
    key = new_key("cost")
    calls = [(key, "ab"[n % 2], 4, 1 + n % 4) for n in range(16)]
    results = [tasks.costed.apply_async(call, queue="rate") for call in calls]
    for r in results:
        r.get(timeout=120, propagate=False)
    assert [r.state for r in results].count("SUCCESS") == 16
    rows = tasks.stack_rows(key)
    assert len(rows) == 16
    assert all(r[3] == 4 and all(len(s) == 4 for s in r[6]) for r in rows)
    assert sorted(r[4] for r in rows) == sorted(call[3] for call in calls)  # the corrected units
    # A refunded slot is free at once (its next holder may start within the refunding start's window): the check is
    # on the slots each run still holds after its correction.
    for limit, on_tenant, n in ((0, False, 10), (1, True, 6)):
        assert not _limit_violations(tasks, tasks.limit_rows(rows, limit, on_tenant, kept=True), 2.0, n), limit
    # Not vacuous: some slot was held again within a window of a start that gave it back (a refund let a start in).
    assert any(
        _limit_violations(tasks, tasks.limit_rows(rows, limit, on_tenant), 2.0, n)
        for limit, on_tenant, n in ((0, False, 10), (1, True, 6))
    )
    # An under-estimate: 1 unit estimated, 6 spent, of 6 per 2 s per (key, tenant): its extra 5 units are logged
    # for a window from its report, so the next call of that tenant starts at least a window after the charge.
    over = new_key("over")
    first = tasks.costed.apply_async((over, "a", 1, 6), queue="rate")
    first.get(timeout=60)
    second = tasks.costed.apply_async((over, "a", 1, 1), queue="rate")
    second.get(timeout=60)
    charged, after = sorted(tasks.stack_rows(over), key=lambda r: min(r[5].values()))
    common = charged[5].keys() & after[5].keys()
    assert common
    assert all(after[5][node] - charged[5][node] >= 2.0 - 1e-6 for node in common), (charged, after)


def test_a_cost_per_limit_holds_each_window_and_rate_spent_corrects_the_estimated_limit_only(
    c: Cluster, tasks: ModuleType
) -> None:
    """Requests and tokens at once: 12 calls of one key, each 1 unit of (3 per 1 s) and its estimate, 4, of
    (10 per 1 s, Rate(cost=)); each run reports 1-4 tokens (rate_spent: a refund of the token limit only). Every call
    runs once; every start held 1 slot of the request limit and 4 of the token limit; no window of the request
    limit holds more than 3 starts (all its slots: nothing refunded there), none of the token limit more than 10 of
    the tokens the runs kept (from the starts the nodes recorded)."""
    key = new_key("priced")
    calls = [(key, "a", 4, 1 + n % 4) for n in range(12)]
    results = [tasks.priced.apply_async(call, queue="rate") for call in calls]
    for r in results:
        r.get(timeout=60, propagate=False)
    assert [r.state for r in results].count("SUCCESS") == 12
    rows = tasks.stack_rows(key)
    assert sorted(r[1] for r in rows) == sorted(r.id for r in results)  # each ran once
    assert all(r[3] == [1, 4] and [len(s) for s in r[6]] == [1, 4] for r in rows), rows
    assert sorted(r[7][1] for r in rows) == sorted(call[3] for call in calls)  # the token limit corrected
    assert all(r[7][0] == 1 for r in rows)  # the request limit not
    assert not _limit_violations(tasks, tasks.limit_rows(rows, 0, False), 1.0, 3)
    assert not _limit_violations(tasks, tasks.limit_rows(rows, 1, False, kept=True), 1.0, 10)
    # Not vacuous: a refunded token slot was held again within a window of the start that gave it back.
    assert _limit_violations(tasks, tasks.limit_rows(rows, 1, False), 1.0, 10)
    # rate_spent(n, limit=...): the limit named alone, by notation or index; a name of no limit fails the call.
    named = new_key("named")
    by_notation = tasks.priced.apply_async((named, "a", 4, 2, [10, 1.0]), queue="rate")
    assert by_notation.get(timeout=30) == named
    by_index = tasks.priced.apply_async((named, "a", 4, 3, 0), queue="rate")
    assert by_index.get(timeout=30) == named
    per = {r[1]: r[7] for r in tasks.stack_rows(named)}
    assert per == {by_notation.id: [1, 2], by_index.id: [3, 4]}, per
    wrong = tasks.priced.apply_async((named, "a", 4, 3, "7/h"), queue="rate")
    wrong.get(timeout=30, propagate=False)
    assert wrong.state == "FAILURE" and "names no limit of its lock_rate" in str(wrong.result), wrong.result


def test_stacked_limits_and_cost_corrections_with_a_lock_node_restarted_empty_mid_window(
    c: Cluster, tasks: ModuleType
) -> None:
    """Issue 33 attack, suspect 6 (cleared; a guard): the stacked storm and costed calls reporting their real units
    (refunds racing the restart) while lock node 0 is restarted empty mid-window. Every call runs once, and no
    window of any limit holds more than the bound docs/rate.md promises for a node restarted without persistence
    (2 N: it forgot its logs), for the estimates and for the units each run kept after its correction."""
    key, cost_key = new_key("stack-restart"), new_key("cost-restart")
    tenants = ["a", "b", "c"]
    results = [tasks.stacked.apply_async((key, tenants[n % 3], n), queue="rate") for n in range(30)]
    costs = [tasks.costed.apply_async((cost_key, "ab"[n % 2], 4, 1 + n % 4), queue="rate") for n in range(8)]
    for _ in polling(30, 0.02):
        if len(tasks.stack_rows(key)) >= 6 and tasks.stack_rows(cost_key):
            break
    c.stop_locks(1)
    c.start_locks()
    for r in results + costs:
        r.get(timeout=120, propagate=False)
    assert [r.state for r in results + costs].count("SUCCESS") == 38
    rows, cost_rows = tasks.stack_rows(key), tasks.stack_rows(cost_key)
    assert sorted(r[1] for r in rows) == sorted(r.id for r in results)  # each ran once
    assert sorted(r[1] for r in cost_rows) == sorted(r.id for r in costs)

    def busiest(limit_rows: list[list[Any]], period: float) -> int:  # per key of the limit
        per_key: dict[str, list[list[Any]]] = {}
        for r in limit_rows:
            per_key.setdefault(r[0], []).append(r)
        return max(tasks.busiest_window(mine, period) for mine in per_key.values())

    for limit, on_tenant, period, n in [(0, False, 1.0, 4), (1, False, 2.0, 6), (2, True, 1.5, 3)]:
        assert busiest(tasks.limit_rows(rows, limit, on_tenant), period) <= 2 * n, limit
    for limit, on_tenant, n in ((0, False, 10), (1, True, 6)):
        for kept in (False, True):
            assert busiest(tasks.limit_rows(cost_rows, limit, on_tenant, kept=kept), 2.0) <= 2 * n, (limit, kept)


def test_slow_down_pauses_its_key_cluster_wide_while_another_key_goes_on(c: Cluster, tasks: ModuleType) -> None:
    """A body raises SlowDown(6 s) (read from a Retry-After): no start of its key comes within the pause, on the
    nodes' clock (the other calls of that key, on both workers, wait for it); the raising call is re-sent and runs
    once after the pause (SUCCESS, two runs in all: the raise, then the run); calls of another key sent during the
    pause run at once, never held back by it."""
    paused, other = new_key("slow"), new_key("goes-on")
    first = tasks.api_call.apply_async((paused, 0, True), queue="rate")
    raised_at = None
    for _ in polling(30, 0.02):
        raised = [r for r in tasks.slow_rows(paused) if r[4]]
        if raised:
            raised_at = raised[0][5]
            break
    assert raised_at is not None, "the body never raised"
    rest = [tasks.api_call.apply_async((paused, n), queue="rate") for n in range(1, 6)]
    beside = [tasks.api_call.apply_async((other, n), queue="rate") for n in range(5)]
    assert first.get(timeout=60) == f"{paused}:0"
    assert [r.get(timeout=60) for r in rest] == [f"{paused}:{n}" for n in range(1, 6)]
    assert [r.get(timeout=60) for r in beside] == [f"{other}:{n}" for n in range(5)]
    rows = tasks.slow_rows(paused)
    runs_of_first = [r for r in rows if r[2] == first.id]
    assert [r[4] for r in runs_of_first] == [True, False]  # raised once, then ran once
    pause_end = raised_at + tasks.SLOW_PAUSE
    late = [r for r in rows if not r[4]]
    assert all(r[3] >= pause_end - SLACK - 0.05 for r in late), [(r[1], r[3] - raised_at) for r in late]
    # The other key was not held back by the pause: its first call started before the pause ended.
    beside_rows = tasks.slow_rows(other)
    assert min(r[3] for r in beside_rows) < pause_end
    assert {r[1] for r in beside_rows} == set(range(5))


def test_slow_down_without_a_rate_fails_the_call_with_it(c: Cluster, tasks: ModuleType) -> None:
    """SlowDown needs a rate to pause: a task without lock_rate that raises it fails (FAILURE, the SlowDown), once,
    and is not re-sent."""
    from celery_singleton_lock import SlowDown  # noqa: PLC0415

    result = tasks.unrated_slow.apply_async((new_key("unrated"),), queue="rate")
    with pytest.raises(SlowDown):
        result.get(timeout=60)
    assert result.state == "FAILURE"


def _raised(tasks: ModuleType, key: str) -> list[Any]:
    """The row of the run of ``key`` that raised SlowDown (bounded wait)."""
    for _ in polling(30, 0.02):
        raised = [r for r in tasks.slow_rows(key) if r[4]]
        if raised:
            return raised[0]
    raise AssertionError(f"no run of {key} raised SlowDown")


def test_a_charge_during_a_pause_longer_than_the_window_does_not_end_the_pause(c: Cluster, tasks: ModuleType) -> None:
    """Issue 33 attack, suspect 1: a pause (5 s) longer than the window (1 s) lives in the rate log, whose expiry an
    extra charge (``rate_spent`` above the estimate, by a run that started before the pause) reset to window + 1 s:
    the log and its pause were dropped ~2 s later and a call sent 3 s into the pause started at once. Now no script
    shortens a log's expiry: that call starts after the pause, and so does the raising call's copy."""
    key = new_key("spend")
    spender = tasks.slow_spend.apply_async((key, 0, "spend"), queue="rate")
    raiser = tasks.slow_spend.apply_async((key, 1, "raise"), queue="rate")
    raised = _raised(tasks, key)
    assert spender.get(timeout=30) == f"{key}:0"
    assert [json.loads(x)[0] for x in c.record.lrange("slow_spent", 0, -1)].count(key) == 1
    for _ in polling(10, 0.05):  # until 3 s into the pause, by the wall clock of this machine (the nodes' too)
        if time.time() >= raised[5] + 3.0:
            break
    late = tasks.slow_spend.apply_async((key, 2, ""), queue="rate")
    assert late.get(timeout=60) == f"{key}:2"
    assert raiser.get(timeout=60) == f"{key}:1"
    pause_end = raised[3] + tasks.LONG_PAUSE
    after = [r for r in tasks.slow_rows(key) if r[1] in (1, 2) and not r[4]]
    assert len(after) == 2
    assert all(r[3] >= pause_end - SLACK - 0.05 for r in after), [(r[1], r[3] - raised[3]) for r in after]


def test_slow_down_in_queue_scope_keeps_the_job_reserved_during_the_pause(c: Cluster, tasks: ModuleType) -> None:
    """Issue 33 attack, suspect 3: the raising call's lock was released outright, so the queue-scope reservation was
    gone during the pause and a duplicate ``delay()`` published a second job (two runs after the pause). Now the
    lock goes back to a reservation for the re-sent copy, as a call waiting for its window: the duplicate gets the
    same job, which runs once after the pause."""
    key = new_key("queued")
    first = tasks.slow_queued.apply_async((key, 0), queue="rate")
    _resent_for_rate(c, first.id, reason="slowed")  # its lock given up (or kept as a reservation): pausing
    dup = tasks.slow_queued.apply_async((key, 1), queue="rate")
    assert first.get(timeout=60) == f"{key}:0"
    dup.get(timeout=60, propagate=False)
    assert dup.id == first.id, "a duplicate published a second job during the pause"
    assert [(r[1], r[4]) for r in tasks.slow_rows(key)] == [(0, True), (0, False)]


def test_slow_down_with_replace_keeps_only_the_newest_waiting_call(c: Cluster, tasks: ModuleType) -> None:
    """Issue 33 attack, suspect 4: with replace, the raising call's copy waited outside the key's line, so a newer
    call sent during the pause ran and the older copy ran too (older arguments after newer ones, or both). Now the
    copy waits in the line as a call waiting for its window: the newer call supersedes it (REVOKED naming it) and
    runs alone after the pause."""
    key = new_key("latest")
    older = tasks.slow_latest.apply_async((key, 0, tasks.SHORT_PAUSE), queue="rate")
    _resent_for_rate(c, older.id, reason="slowed")
    newer = tasks.slow_latest.apply_async((key, 1), queue="rate")
    assert newer.get(timeout=60) == f"{key}:1"
    with pytest.raises(TaskRevokedError, match=f"superseded by task {newer.id}"):
        older.get(timeout=30)
    assert [(r[1], r[4]) for r in tasks.slow_rows(key)] == [(0, True), (1, False)]


def test_slow_down_passes_through_autoretry_for(c: Cluster, tasks: ModuleType) -> None:
    """Issue 33 attack, suspect 5: ``autoretry_for=(Exception,)`` caught SlowDown and retried the call at once (its
    countdown), the rate never paused. SlowDown is the library's own exit, not an error to retry: it passes through
    Celery's autoretry (and ``self.retry(exc=SlowDown(...))``), the rate pauses, the call runs once after the pause,
    no retry spent."""
    key = new_key("autoretry")
    result = tasks.slow_autoretry.apply_async((key, 0), queue="rate")
    assert result.get(timeout=60) == f"{key}:0"
    rows = tasks.slow_rows(key)
    assert [(r[4], r[6]) for r in rows] == [(True, 0), (False, 0)], rows
    assert rows[1][3] >= rows[0][3] + tasks.SHORT_PAUSE - SLACK - 0.05


def test_slow_down_in_a_debounced_burst_runs_the_burst_s_last_arguments_once(c: Cluster, tasks: ModuleType) -> None:
    """Issue 33 attack, suspect 2 (cleared; a guard): a burst's job that raises SlowDown is re-sent with the arguments
    it ran with (the burst's last call's, not its own message's). A call sent during the pause is a burst (a job) of
    its own. After the pause, either the first burst's copy runs its arguments once, before the newer burst's run,
    or the newer burst's run came first and the copy ends REVOKED, superseded by it: older arguments never run after
    newer ones (debounce's order), and nothing runs within the pause."""
    key = new_key("deb-slow")
    calls = [tasks.slow_debounced.apply_async((key, n), queue="rate") for n in range(4)]
    _raised(tasks, key)
    later = tasks.slow_debounced.apply_async((key, 9), queue="rate")
    for r in [*calls, later]:
        r.get(timeout=60, propagate=False)
    rows = tasks.slow_rows(key)
    seen = [(r[1], r[2], r[4]) for r in rows]
    job = calls[0].id  # the burst's job: its first call's task id
    assert all(r.id == job for r in calls)
    nine = [(9, later.id, True), (9, later.id, False)]  # it raises once too (its own first run), then runs
    if calls[0].state == "SUCCESS":
        assert seen == [(3, job, True), (3, job, False), *nine], seen
    else:
        with pytest.raises(TaskRevokedError, match=f"superseded by task {later.id}"):
            calls[0].get(timeout=5)
        assert seen == [(3, job, True), *nine], seen
    pause_end = rows[0][3] + tasks.SHORT_PAUSE
    assert all(r[3] >= pause_end - SLACK - 0.05 for r in rows[1:]), rows


def test_slow_down_naming_one_stacked_limit_pauses_only_that_limit_s_keys(c: Cluster, tasks: ModuleType) -> None:
    """Issue 33 attack, suspect 7 (cleared; a guard): ``SlowDown(limit="5/s")`` in tenant a's call pauses its
    per-tenant limit only: tenant a's calls of the key start after the pause, tenant b's calls of the same key (which
    share the key's other limit, not paused) start during it."""
    key = new_key("tenant")
    first = tasks.slow_tenant.apply_async((key, "a", 0, True), queue="rate")
    raised = _raised(tasks, key)
    more = [tasks.slow_tenant.apply_async((key, t, n), queue="rate") for n, t in enumerate("abab", start=1)]
    assert first.get(timeout=60) == f"{key}:a:0"
    assert [r.get(timeout=60) for r in more] == [f"{key}:{t}:{n}" for n, t in enumerate("abab", start=1)]
    rows = [r for r in tasks.slow_rows(key) if not r[4]]
    pause_end = raised[3] + tasks.SHORT_PAUSE
    tenant_a = [r for r in rows if r[6] == "a"]
    assert len(tenant_a) == 3
    assert all(r[3] >= pause_end - SLACK - 0.05 for r in tenant_a), [(r[1], r[3] - raised[3]) for r in tenant_a]
    assert min(r[3] for r in rows if r[6] == "b") < pause_end  # the other tenant was not held back


def test_the_raising_call_s_copy_waits_out_the_pause_whatever_lock_on_rate_limit_says(
    c: Cluster, tasks: ModuleType
) -> None:
    """Issue 33 attack: with ``lock_on_rate_limit`` skip / fail, the raising call's copy that came back before the
    pause's end (a countdown capped by the broker's visibility timeout, here 4 s of a 5 s pause; or a worker clock
    behind the nodes') was refused by the pause and ended REVOKED / FAILED: never run. The pause is the call's own,
    not a new call over the rate: its copies wait for the window, and it runs once after the pause."""
    skip, fail = new_key("slow-skip"), new_key("slow-fail")
    skipped = tasks.slow_skip.apply_async((skip, 0), queue="rate")
    failed = tasks.slow_fail.apply_async((fail, 0), queue="rate")
    assert skipped.get(timeout=60) == f"{skip}:0"
    assert failed.get(timeout=60) == f"{fail}:0"
    for key in (skip, fail):
        rows = tasks.slow_rows(key)
        assert [r[4] for r in rows] == [True, False], rows
        assert rows[1][3] >= rows[0][3] + tasks.LONG_PAUSE - SLACK - 0.05, rows


def test_slow_down_in_a_group_with_two_slots_pauses_the_group_s_rate(c: Cluster, tasks: ModuleType) -> None:
    """A guard (cleared): task a of a group (lock_limit=2, reschedule, one rate) raises SlowDown(1.5); task b's calls
    of the key sent during the pause start after it (the group's rate paused), and a's copy runs once (its slot
    given back for the pause, taken again after it: no call lost, none run twice)."""
    key = new_key("pair")
    first = tasks.slow_pair_a.apply_async((key, 0), queue="rate")
    raised = _raised(tasks, key)
    more = [tasks.slow_pair_b.apply_async((key, n), queue="rate") for n in (1, 2, 3)]
    assert first.get(timeout=60) == f"{key}:0"
    assert [r.get(timeout=60) for r in more] == [f"{key}:{n}" for n in (1, 2, 3)]
    rows = [r for r in tasks.slow_rows(key) if not r[4]]
    assert sorted(r[1] for r in rows) == [0, 1, 2, 3], rows
    assert all(r[3] >= raised[3] + 1.5 - SLACK - 0.05 for r in rows), [(r[1], r[3] - raised[3]) for r in rows]


@pytest.mark.parametrize("task", ["slow_after_retry", "slow_after_retry_unlocked"])
def test_slow_down_after_the_body_s_own_retry_runs_the_call_once_more(c: Cluster, tasks: ModuleType, task: str) -> None:
    """SlowDown's second attack: a body that sent its retry (``retry(throw=False)``, 0.3 s) and then raised SlowDown
    was re-sent too: without a lock (``lock_limit=None``: no done marker) the retry and the SlowDown's copy both ran
    after the pause. The retry is the call again: no copy is re-sent, the retry waits out the pause (the rate) and
    runs once."""
    key = new_key("retry-slow")
    result = getattr(tasks, task).apply_async((key, 0), queue="rate")
    assert result.get(timeout=60) == f"{key}:0"
    time.sleep(1.5)  # a second run would come at the pause's end too, beside the first
    rows = tasks.slow_rows(key)
    assert [r[4] for r in rows] == [True, False], rows


def test_slow_down_s_copy_is_not_skipped_as_a_duplicate_of_a_call_sent_during_the_pause(
    c: Cluster, tasks: ModuleType
) -> None:
    """SlowDown's second attack: with ``lock_on_duplicate="skip"`` (the default), the raising call's copy gave its lock
    back for the pause; a call of the same key sent during it waited for the window too, and after the pause the two
    raced for the lock: the raising call, when it lost, ended REVOKED as a duplicate (never run; about half the keys
    here). Its copy now waits as a duplicate instead (as a chord member does) and runs once after the other call."""
    keys = [new_key("slow-dup") for _ in range(6)]
    raisers = [tasks.slow_dup.apply_async((k, 0, tasks.SHORT_PAUSE), queue="rate") for k in keys]
    for r in raisers:
        _resent_for_rate(c, r.id, reason="slowed")
    others = [tasks.slow_dup.apply_async((k, 1), queue="rate") for k in keys]
    assert [r.get(timeout=60) for r in raisers] == [f"{k}:0" for k in keys]
    for r in others:  # each either ran (after the pause) or was skipped as a duplicate of the running raiser's copy
        r.get(timeout=60, propagate=False)
    for k in keys:
        rows = tasks.slow_rows(k)
        assert [(r[1], r[4]) for r in rows if r[1] == 0] == [(0, True), (0, False)], rows


def test_slow_down_in_one_task_of_a_group_pauses_the_group_s_shared_rate(c: Cluster, tasks: ModuleType) -> None:
    """SlowDown's second attack (cleared; a guard): the tasks of a ``lock_group`` share one rate, so a SlowDown raised
    by slow_group_a pauses slow_group_b's starts too (another key, sent during the pause: it starts after it), and
    the raising call runs once after the pause."""
    k1, k2 = new_key("grp-a"), new_key("grp-b")
    first = tasks.slow_group_a.apply_async((k1, 0, tasks.SHORT_PAUSE), queue="rate")
    raised = _raised(tasks, k1)
    other = tasks.slow_group_b.apply_async((k2, 1), queue="rate")
    assert first.get(timeout=60) == f"{k1}:0"
    assert other.get(timeout=60) == f"{k2}:1"
    assert [r[4] for r in tasks.slow_rows(k1)] == [True, False]
    pause_end = raised[3] + tasks.SHORT_PAUSE
    late = [r for r in tasks.slow_rows(k1) + tasks.slow_rows(k2) if not r[4]]
    assert len(late) == 2
    assert all(r[3] >= pause_end - SLACK - 0.05 for r in late), [(r[1], r[3] - raised[3]) for r in late]


def test_slow_down_s_copy_beside_a_cooldown_runs_once(c: Cluster, tasks: ModuleType) -> None:
    """SlowDown's second attack, x ``lock_cooldown``: a call of the key sent during the pause races the raising call's
    copy after it; when that call runs first, its success cools the key down, and the copy (another job's cooldown)
    waits it out and runs, never REVOKED as a duplicate; when the copy runs first, the other call is a duplicate
    within its cooldown (skipped, as any call)."""
    keys = [new_key("slow-cool") for _ in range(4)]
    raisers = [tasks.slow_cool.apply_async((k, 0, tasks.SHORT_PAUSE), queue="rate") for k in keys]
    for r in raisers:
        _resent_for_rate(c, r.id, reason="slowed")
    others = [tasks.slow_cool.apply_async((k, 1), queue="rate") for k in keys]
    assert [r.get(timeout=60) for r in raisers] == [f"{k}:0" for k in keys]
    for k, other in zip(keys, others, strict=True):
        other.get(timeout=60, propagate=False)
        ran = [(r[1], r[4]) for r in tasks.slow_rows(k)]
        assert ran.count((0, False)) == 1, ran
        assert other.state == ("SUCCESS" if (1, False) in ran else "REVOKED"), (other.state, ran)


def test_slow_down_through_retry_with_no_retry_left_still_pauses_and_runs_once(c: Cluster, tasks: ModuleType) -> None:
    """SlowDown's second attack, (6): ``self.retry(exc=SlowDown(...))`` in the last allowed retry (max_retries spent)
    is not MaxRetriesExceeded and not the SlowDown as a failure: the rate pauses and the call runs once after it."""
    key = new_key("slow-exhausted")
    result = tasks.slow_exhausted.apply_async((key, 0), queue="rate")
    assert result.get(timeout=60) == f"{key}:0"
    rows = tasks.slow_rows(key)
    assert [(r[4], r[6]) for r in rows] == [(True, 1), (False, 1)], rows
    assert rows[1][3] >= rows[0][3] + tasks.SHORT_PAUSE - SLACK - 0.05, rows


def test_slow_down_s_copy_redelivered_after_its_worker_died_runs_to_its_end_once(c: Cluster, tasks: ModuleType) -> None:
    """SlowDown's second attack, (4): the raising call's copy SIGKILLed mid-body (its pool child; acks_late with
    reject_on_worker_lost: the broker redelivers it) is the same call again: it waits for the dead run's lease, runs
    and ends once (one end recorded, SUCCESS)."""
    key = new_key("slow-kill")
    result = tasks.slow_then_long.apply_async((key, 0, 1.0), queue="rate")
    pid = None
    for _ in polling(30, 0.02):
        pids = [json.loads(x) for x in c.record.lrange("slow_pids", 0, -1)]
        mine = [p for k, p in pids if k == key]
        if mine:
            pid = mine[0]
            break
    assert pid is not None, "the copy never ran"
    os.kill(pid, signal.SIGKILL)
    assert result.get(timeout=60) == f"{key}:0"
    time.sleep(1.0)  # a second end would come within the first's run
    ends = [json.loads(x) for x in c.record.lrange("slow_done", 0, -1)]
    assert [e for e in ends if e[0] == key] == [[key, result.id]]
    assert [r[4] for r in tasks.slow_rows(key)] == [True, False, False]  # the raise, the killed copy, its redelivery


def test_slow_down_with_one_lock_node_paused_holds_on_the_majority(c: Cluster, tasks: ModuleType) -> None:
    """SlowDown's second attack, (5): lock node 0 of 3 SIGSTOPped before the body raises, resumed during the pause:
    every call runs once (nothing twice), and the raising call runs once, after the pause. (Calls of the key sent
    right after the raise may start before the pause is written: a frozen node can hold up the write to the others by
    its connection's handshake, docs/rate.md; measured: 3 of 4 such calls counted ~0.57 s into a 2 s pause.)"""
    key = new_key("slow-stop")
    c.locks[0].pause()
    try:
        first = tasks.slow_free.apply_async((key, 0, tasks.SHORT_PAUSE), queue="rate")
        raised = _raised(tasks, key)
        rest = [tasks.slow_free.apply_async((key, n), queue="rate") for n in range(1, 5)]
        _resent_for_rate(c, first.id, reason="slowed")
    finally:
        c.locks[0].resume()
    assert first.get(timeout=60) == f"{key}:0"
    assert [r.get(timeout=60) for r in rest] == [f"{key}:{n}" for n in range(1, 5)]
    rows = tasks.slow_rows(key)
    assert sorted((r[1], r[4]) for r in rows) == [(0, False), (0, True), (1, False), (2, False), (3, False), (4, False)]
    (copy,) = [r for r in rows if r[1] == 0 and not r[4]]
    assert copy[3] >= raised[3] + tasks.SHORT_PAUSE - SLACK - 0.05, copy[3] - raised[3]


def test_slow_down_with_lock_limit_2_runs_the_copy_once_and_never_3_at_once(c: Cluster, tasks: ModuleType) -> None:
    """SlowDown's second attack, (2): ``lock_limit=2``: the raising call's copy gives its slot back for the pause; two
    calls of the key sent during it take the slots and wait for the window too. After the pause the copy runs once
    (waiting as a duplicate when both slots are taken, never REVOKED), and never 3 runs of the key at once."""
    key = new_key("slow-two")
    first = tasks.slow_two.apply_async((key, 0, tasks.SHORT_PAUSE), queue="rate")
    _resent_for_rate(c, first.id, reason="slowed")
    others = [tasks.slow_two.apply_async((key, n), queue="rate") for n in (1, 2)]
    assert first.get(timeout=60) == f"{key}:0"
    for r in others:
        r.get(timeout=60, propagate=False)
    rows = tasks.slow_rows(key)
    assert [r[4] for r in rows if r[1] == 0] == [True, False], rows
    ends = {e[1]: e[2] for e in (json.loads(x) for x in c.record.lrange("slow_done", 0, -1)) if e[0] == key}
    spans = [(r[5], ends[r[2]]) for r in rows if not r[4]]
    assert len(spans) == len(ends)
    for start, _ in spans:
        assert sum(1 for s, e in spans if s <= start < e) <= 2, spans


def test_slow_down_in_a_start_run_uncounted_without_a_quorum_re_sends_the_call(c: Cluster, tasks: ModuleType) -> None:
    """``lock_on_unavailable="run"``: with two lock nodes of three down, the body runs uncounted (no quorum for the
    lock or the rate). The API still said "slow down": the call is re-sent for after the pause (nothing can be
    paused on the nodes), never failed with the SlowDown and lost. Last in the module: it restarts two nodes empty."""
    key = new_key("unguarded-slow")
    c.stop_locks(2)
    try:
        result = tasks.slow_unguarded.apply_async((key, 0), queue="rate")
        assert result.get(timeout=30) == f"{key}:0"
    finally:
        c.start_locks()
    rows = tasks.slow_rows(key)
    assert [r[4] for r in rows] == [True, False], rows
    assert rows[1][5] >= rows[0][5] + 1.0 - 0.05, rows
