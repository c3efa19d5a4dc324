"""``lock_fair_on``: fair turns across tenants sharing a key's slots, with real prefork workers and redis nodes.

tests/apps/locked_app.py's ``fair_call(key, tenant, item)`` shares ``key``'s two slots among tenants
(``lock_unique_on=["key"]``, ``lock_fair_on=["tenant"]``, ``lock_limit=2``, ``"reschedule"``). Every start is
recorded in order with the line node's count of it: its number among the line's starts, the starts between the call
first joining the line and its own (its turns waited) and ``k``, the calls of its own tenant waiting when it joined.
The bound checked, exactly (docs/policies.md, "Fair turns"): at most ``(k + 2) * (W - 1) + k + L - 1`` turns, W = 3
tenants, L = 2 slots: ``3k + 5``. Every loop is bounded in count and time.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery
from worker_cluster import Cluster, cluster, new_key, polling

from celery_singleton_lock import LockedTask
from celery_singleton_lock.errors import ConfigurationError
from celery_singleton_lock.lock.record import sibling_key

TTL = 4.0
LIMIT = 2
TENANTS = 3
pytestmark = pytest.mark.timeout(240)


def bound(k: int, values: int = TENANTS, limit: int = LIMIT) -> int:
    """The most turns a call with ``k`` calls of its own value waiting ahead of it waits (docs/policies.md)."""
    return (k + 2) * (values - 1) + k + limit - 1


def line_turns(records: list[list[Any]]) -> list[tuple[str, int, int]]:
    """Per start of a call that waited in line, in start order: (tenant, k, turns waited), as the line's node
    counted them (``fair_call``'s record)."""
    return [(r[1], r[6][2], r[6][1]) for r in records if r[6] is not None and r[6][1] >= 0]


def turns(records: list[list[Any]]) -> list[tuple[str, int, int]]:
    """Per start, in start order: (tenant, k, turns waited) counted from the records alone, for a line without
    turns (benchmarks/bench_fair.py's "before"). ``k``: the calls of its tenant that arrived before it and had not
    started when it arrived; turns: the starts between its arrival at a worker and its own start."""
    out = []
    arrivals = [r[4] / 1000.0 if r[4] is not None else r[5] for r in records]
    for i, r in enumerate(records):
        arrived = arrivals[i]
        waited = sum(1 for j in range(i) if records[j][5] > arrived)
        ahead = sum(
            1
            for j, o in enumerate(records)
            if j != i and o[1] == r[1] and arrivals[j] < arrived and (j > i or o[5] > arrived)
        )
        out.append((r[1], ahead, waited))
    return out


@pytest.fixture(scope="module")
def c(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    # A short visibility timeout: the messages a SIGKILLed worker held unacked come back within seconds.
    with cluster(tmp_path_factory.mktemp("fair"), ttl=TTL, env={"CSL_VISIBILITY": "8"}) as cl:
        cl.app_module()
        cl.worker("fair-1", concurrency=3)
        yield cl


def _flood(c: Cluster, key: str, a: int, others: int, duration: float) -> list[str]:
    """``a`` calls of tenant A, then ``others`` each of B and C (interleaved), all sent at once: their task ids."""
    call = c.app_module().fair_call
    ids = [call.delay(key, "A", i, duration).id for i in range(a)]
    for i in range(others):
        ids.append(call.delay(key, "B", i, duration).id)
        ids.append(call.delay(key, "C", i, duration).id)
    return ids


def _records(c: Cluster, key: str) -> list[list[Any]]:
    return [r for r in c.records("fair") if r[0] == key]


def _wait_all(c: Cluster, key: str, ids: list[str], timeout: float) -> list[list[Any]]:
    for _ in polling(timeout, 0.2):
        if {r[1] for r in c.runs(key)} >= set(ids):
            break
    done = [r[1] for r in c.runs(key)]
    missing = set(ids) - set(done)
    assert not missing, f"{len(missing)} of {len(ids)} calls never ran within {timeout} s"
    return _records(c, key)


def test_a_flood_of_one_tenant_delays_the_others_by_a_bounded_number_of_turns(c: Cluster) -> None:
    """200 calls of A queued before 10 of B and C each: every call waits at most the bound in turns, counted by the
    line's node from the moment it joined the line (arrival order would make B's first call wait for most of A's
    200: benchmarks/bench_fair.py); every start is counted once, every call runs once."""
    key = new_key("fair")
    ids = _flood(c, key, 200, 10, 0.01)
    records = _wait_all(c, key, ids, 150)
    runs = c.runs(key)
    assert sorted(r[1] for r in runs) == sorted(ids), "a call ran twice, or not at all"
    numbers = [r[6][0] for r in records if r[6] is not None and r[6][0] > 0]
    assert len(numbers) == len(set(numbers)), "the line's node counted two starts as one"
    waits = line_turns(records)
    assert {t for t, _, _ in waits} == {"A", "B", "C"}, f"too few calls waited in line to check the bound: {waits}"
    over = [(t, k, w, bound(k)) for t, k, w in waits if w > bound(k)]
    assert not over, f"calls waited past the bound (tenant, k, turns, bound): {over}"


def test_a_worker_sigkilled_mid_flood_loses_no_call(c: Cluster) -> None:
    """A second worker SIGKILLed while the flood runs: every call still completes, exactly once."""
    key = new_key("fair-kill")
    doomed = c.worker("fair-doomed", concurrency=2)
    ids = _flood(c, key, 60, 5, 0.05)
    c.wait_started(key, 10, timeout=60)
    assert doomed.process is not None
    os.kill(doomed.process.pid, signal.SIGKILL)
    _wait_all(c, key, ids, 150)
    completed = [r[1] for r in c.runs(key)]
    assert sorted(set(completed)) == sorted(ids)
    assert len(completed) == len(ids), "a call completed twice"


def test_the_line_s_node_paused_every_call_still_runs(c: Cluster) -> None:
    """The first lock node (the line's) paused: no turns can be kept, the lock still has a quorum, and every call
    runs (any order) through its fallback copy."""
    key = new_key("fair-paused")
    c.locks[0].pause()
    try:
        ids = _flood(c, key, 4, 2, 0.01)
        _wait_all(c, key, ids, 120)
    finally:
        c.locks[0].resume()
    assert sorted(r[1] for r in c.runs(key)) == sorted(ids)


def test_the_line_s_node_restarted_empty_mid_flood_every_call_still_runs_once(c: Cluster) -> None:
    """The first lock node (the line, its woken calls and turns) restarted empty while calls wait: the lock keeps a
    quorum, each waiting call's fallback copy joins a new line at a new turn, and every call runs exactly once."""
    key = new_key("fair-restart")
    ids = _flood(c, key, 20, 4, 0.05)
    c.wait_started(key, 6, timeout=60)
    c.locks[0].restart()
    _wait_all(c, key, ids, 150)
    runs = [r[1] for r in c.runs(key)]
    assert sorted(runs) == sorted(ids), "a call ran twice, or not at all"


def test_a_finished_call_still_in_line_gives_its_place_up_when_woken(c: Cluster) -> None:
    """A call that ran while its leaving the line was lost (the line's node unreachable at that moment) is still in
    the line: woken later, its copy finds the job done. That copy gives the place up and wakes the next: the line,
    its woken calls and its turns' books are left empty (a stale woken place would hold the line's turn until it
    expires, a lease per place, and its books stay for good)."""
    key = new_key("fair-stale")
    lock_key = c.app_module().fair_call.lock_key_for(key, "A", 0)
    node = c.lock_client(c.locks[0])
    line, parked, turns, woken = (sibling_key(lock_key, s) for s in (":waiters", ":parked", ":turns", ":woken"))
    ids = _flood(c, key, 3, 0, 0.5)
    saved: Any = None
    for _ in polling(60, 0.02):  # a call waiting in line: its place, message and books, as parked
        waiting = [m.decode() for m in node.zrange(line, -1, -1)]
        if waiting:
            x = waiting[0]
            pipe = node.pipeline(transaction=True)
            pipe.zscore(line, x).hget(parked, x).hget(turns, f"s:{x}").hget(turns, f"v:{x}")
            saved = (x, *pipe.execute())
            if all(v is not None for v in saved):
                break
    assert saved is not None and all(v is not None for v in saved), f"no call waited in line: {saved}"
    _wait_all(c, key, ids, 60)
    x, score, message, s, v = saved
    # Its leaving the line lost: it is back in the line, its message and the books, as before it ran.
    node.zadd(line, {x: score})
    node.hset(parked, x, message)
    node.hset(turns, mapping={f"s:{x}": s, f"v:{x}": v, f"n:{v.decode()}": 1})
    more = _flood(c, key, 0, 2, 0.05)
    _wait_all(c, key, ids + more, 60)
    left: Any = None
    for _ in polling(30, 0.5):  # its copies (woken, then its fallbacks a lease apart) come and go
        books = [f.decode() for f in node.hkeys(turns) if f.decode()[:2] in ("s:", "v:", "n:")]
        left = (node.zrange(line, 0, -1), node.zrange(woken, 0, -1), books)
        if not any(left):
            break
    assert not any(left), f"a finished call left in the line, woken, or the books: {left}"
    assert len(c.runs(key)) == len(ids) + len(more), "a call ran twice, or not at all"


def test_a_group_of_two_fair_tasks_keeps_the_bound_through_a_dialed_limit_and_retries(c: Cluster) -> None:
    """Two tasks of one lock_group share one fair line; the callable lock_limit is dialed 2 -> 1 -> 3 mid-flood,
    and some bodies retry themselves once (the retry hand-over): every call runs to its end once, every start is
    counted once, and every attempt that waited in line waited at most the bound with L the largest limit (3)."""
    key = new_key("fair-group")
    mod = c.app_module()
    ids: list[str] = []
    retried: list[str] = []
    for i in range(24):
        task = mod.fair_group_a if i % 2 else mod.fair_group_b
        ids.append(task.delay(key, "A", i, 0.02, i % 6 == 0).id)
        retried += ids[-1:] if i % 6 == 0 else []
    for i in range(4):
        ids += [mod.fair_group_a.delay(key, "B", i, 0.02).id, mod.fair_group_b.delay(key, "C", i, 0.02, i == 1).id]
        retried += ids[-1:] if i == 1 else []
    c.wait_started(key, 4, timeout=60)
    c.record.set(f"fair-limit:{key}", 1)
    c.wait_started(key, 12, timeout=60)
    c.record.set(f"fair-limit:{key}", 3)
    for _ in polling(150, 0.2):
        if len(c.runs(key)) >= len(ids) + len(retried):
            break
    runs = [r[1] for r in c.runs(key)]
    assert sorted(set(runs)) == sorted(ids), "a call never ran"
    assert sorted(runs) == sorted(ids + retried), "a call ran more often than once (plus its one retry)"
    records = _records(c, key)
    numbers = [r[6][0] for r in records if r[6] is not None and r[6][0] > 0]
    assert len(numbers) == len(set(numbers)), "the line's node counted two starts as one"
    assert {t for t, _, _ in line_turns(records)} == {"A", "B", "C"}, "too few calls waited in line to check the bound"
    over = [(t, k, w) for t, k, w in line_turns(records) if w > bound(k, limit=3)]
    assert not over, f"attempts waited past the bound (tenant, k, turns): {over}"


def test_with_a_capped_line_every_start_is_counted(c: Cluster) -> None:
    """lock_max_waiting=2: a call that takes a free slot out of its turn while the line is full runs on it (it is no
    duplicate): that start is counted too, so the line's count of turns waited stays true. Every call runs at most
    once; those refused were refused for the full line."""
    key = new_key("fair-capped")
    call = c.app_module().fair_capped
    ids = [call.delay(key, "ABC"[i % 3], i, 0.05).id for i in range(30)]
    for _ in polling(90, 0.2):
        if all(s in ("SUCCESS", "REVOKED") for s in c.states(ids).values()):
            break
    states = c.states(ids)
    assert set(states.values()) <= {"SUCCESS", "REVOKED"}, states
    runs = [r[1] for r in c.runs(key)]
    assert len(runs) == len(set(runs)) == sum(1 for s in states.values() if s == "SUCCESS")
    records = _records(c, key)
    counted = [r[6][0] for r in records if r[6] is not None and r[6][0] > 0]
    first = [r for r in records if r[6] is not None and r[6][0] == 0]  # before anyone parked: nothing to count
    assert len(counted) == len(set(counted)) == len(records) - len(first), (
        f"starts the line did not count: {[r[2] for r in records if r[6] is None]}"
    )


def test_the_bound_reads_the_line_s_count() -> None:
    """The turn counter is not vacuous: a call's record carries the node's (start, turns waited, k)."""
    records = [["k", "A", 0, "a0", None, 0.0, [1, -1, -1]], ["k", "B", 0, "b0", 5, 1.0, [5, 3, 1]]]
    records.append(["k", "C", 0, "c0", None, 2.0, None])
    assert line_turns(records) == [("B", 1, 3)]
    assert bound(0) == 5
    assert bound(1) == 8


@pytest.mark.parametrize(
    ("options", "says"),
    [
        ({"lock_fair_on": ["tenant"]}, "needs a key its values share"),
        ({"lock_fair_on": ["tenant"], "lock_unique_on": ["tenant"]}, "make the lock key"),
        ({"lock_fair_on": ["tenat"], "lock_unique_on": []}, "unknown argument"),
        ({"lock_fair_on": "tenant", "lock_unique_on": []}, "list of argument names"),
        ({"lock_fair_on": ["tenant"], "lock_unique_on": [], "lock_on_duplicate": "skip"}, "needs lock_on_duplicate"),
        (
            {"lock_fair_on": ["tenant"], "lock_unique_on": [], "lock_on_duplicate": "reschedule", "lock_rate": "5/s"},
            "cannot be used with lock_rate",
        ),
    ],
)
def test_invalid_fair_options_are_refused_at_registration_in_one_line(options: dict[str, Any], says: str) -> None:
    app = Celery("fair_check", set_as_current=False)
    app.conf.singleton_lock_urls = ["redis://127.0.0.1:1/0"]

    def call_api(tenant: str, item: int) -> None:
        return None

    app.task(base=LockedTask, shared=False, **options)(call_api)
    with pytest.raises(ConfigurationError) as caught:
        _ = app.tasks  # registration binds the task
    assert says in str(caught.value)
    assert "\n" not in str(caught.value)
