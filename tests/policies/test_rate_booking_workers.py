"""Booked slots with real workers (policies/rate/booking.py): calls over their rate book the moment they own and are
re-sent once for it, served in arrival order; a worker SIGKILLed holding booked copies, a lock node restarted empty.
Two prefork workers of 3 processes, three lock nodes, a Redis broker; every start's slot and node times are recorded
by the run (``rate_tasks``) and checked: no window ever holds more than N starts. Bounded loops, no timing asserts.
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
from celery.exceptions import TimeoutError as ResultTimeout
from worker_cluster import Cluster, cluster, new_key, polling

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def c(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with cluster(tmp_path_factory.mktemp("booked"), ttl=3.0, env={"CSL_VISIBILITY": "8"}) as cl:
        cl.app_module()
        yield cl


@pytest.fixture(scope="module")
def workers(c: Cluster) -> list[Any]:
    return [c.worker(name, queues="book", concurrency=3, extra=["-I", "rate_tasks"]) for name in ("book-a", "book-b")]


@pytest.fixture(scope="module")
def tasks(c: Cluster, workers: list[Any]) -> ModuleType:
    sys.modules.pop("rate_tasks", None)
    import rate_tasks  # noqa: PLC0415 - imported with the cluster's env, after locked_app

    return rate_tasks


def _rows(c: Cluster, key: str, what: str = "rate_runs") -> list[list[Any]]:
    return [r for r in (json.loads(x) for x in c.record.lrange(what, 0, -1)) if r[0] == key]


def _check_window(tasks: ModuleType, key: str, starts: int) -> None:
    rows = tasks.slot_rows(key)
    assert len(rows) == starts
    assert not tasks.slot_violations(rows, 1.0)
    assert tasks.busiest_window(rows, 1.0) <= 10


def test_waiting_calls_book_their_slots_and_start_in_arrival_order(c: Cluster, tasks: ModuleType) -> None:
    """40 calls of one key at (10, 1.0), sent one after another: 10 start, 30 book and are re-sent about once each;
    at most 4 calls started three windows or more after one sent after them; no window over 10."""
    key = new_key("order")
    results = [tasks.rated.apply_async((key, n, 0.0), queue="book") for n in range(40)]
    for r in results:
        r.get(timeout=120, propagate=False)
    assert [r.state for r in results].count("SUCCESS") == 40
    sent = {r.id: n for n, r in enumerate(results)}
    rows = _rows(c, key)
    assert len(rows) == 40
    waits = [r[5] for r in rows]
    waited = [w for w in waits if w]
    assert len(waited) >= 20  # most waited (10 per window, 40 calls sent at once)
    # About once each (before booked slots: 16.7 per waiting call on rate_storm); up to 2.5 here, as a late arrival on
    # a loaded machine (CI's two cores, other modules beside) re-books once more: failed 3 of ~7 runs at 1.5 under load.
    assert sum(waited) <= 2.5 * len(waited), sorted(waits)[-8:]
    soonest, overtaken = float("inf"), []
    for n, at in sorted(((sent[r[1]], r[3]) for r in rows), reverse=True):
        # A call sent after it started two windows or more before it. Calls are served in the order they ask, at a
        # worker; each worker prefetches 12 messages of the 40 sent at once and asks for them in its own order, so
        # send order holds to about a window (one window's 10 calls).
        if soonest < at - 3.0:  # three windows: a late arrival re-booked under load adds one
            overtaken.append(n)
        soonest = min(soonest, at)
    # Arrival order, to the prefetch, for all but a few: a call that reaches its worker a window late (a loaded
    # machine) books anew, after every booking made meanwhile (docs/rate.md); one in 40 was, in a run at load 4.
    # Without booking, most calls are overtaken (908 of 1,000 by a window on rate_storm).
    assert len(overtaken) <= 4, overtaken
    _check_window(tasks, key, 40)


def test_a_worker_sigkilled_holding_bookings_wastes_at_most_their_slots(c: Cluster, tasks: ModuleType) -> None:
    """One worker alone on a queue takes 16 calls: 10 start, 6 book and wait in it as countdown messages; it is
    SIGKILLed. The broker gives their messages back (visibility 8 s) to a new worker: a window late, they book anew
    and run; meanwhile 10 more calls book after the dead bookings. Every call runs, no window over 10."""
    key = new_key("killed")
    lone = c.worker("book-lone", queues="lone", concurrency=3, extra=["-I", "rate_tasks"])
    results = [tasks.rated.apply_async((key, n, 0.0), queue="lone") for n in range(16)]
    for _ in polling(30, 0.05):
        booked = [line for line in lone.log().splitlines() if "re-sent to run in" in line]
        if len(_rows(c, key, "rate_started")) >= 10 and len(booked) >= 6:
            break
    else:
        pytest.fail("the 6 calls over the rate did not book")
    lone.kill()
    more = [tasks.rated.apply_async((key, n, 0.0), queue="book") for n in range(16, 26)]
    fresh = c.worker("book-lone2", queues="lone", concurrency=3, extra=["-I", "rate_tasks"])
    lost = []
    for r in results + more:
        try:
            r.get(timeout=90, propagate=False)
        except ResultTimeout:
            lost.append(r.id)
    # docs/reliability.md, Finding 2 (kombu's Redis transport): a copy handed to the dead worker's BRPOP may vanish.
    assert len(lost) <= 1, lost
    assert [r.state for r in results + more].count("SUCCESS") + len(lost) == 26
    starts = len(_rows(c, key, "rate_started"))
    assert starts >= 25
    _check_window(tasks, key, starts)
    fresh.stop()


def test_a_lock_node_restarted_empty_mid_storm_keeps_the_window(c: Cluster, tasks: ModuleType) -> None:
    """30 calls; once 12 started (the rest booked), one lock node of three is stopped and restarted empty: the
    bookings it forgot are still held by the other two, every call runs, no window over 10."""
    key = new_key("restart")
    results = [tasks.rated.apply_async((key, n, 0.0), queue="book") for n in range(30)]
    for _ in polling(30, 0.05):
        if len(_rows(c, key, "rate_started")) >= 12:
            break
    c.stop_locks(1)
    c.start_locks()
    for r in results:
        r.get(timeout=120, propagate=False)
    assert [r.state for r in results].count("SUCCESS") == 30
    _check_window(tasks, key, 30)


def test_a_booked_call_that_retries_books_its_retry_anew(c: Cluster, tasks: ModuleType) -> None:
    """A task without a lock (lock_limit=None) retries from its body: Celery's retry copies the request's headers,
    and the retry of a booked call carried its booking, claimed again on arrival: the same entry counted two starts
    (the second booked call and its retry) in one window at N = 1. A retry inherits no lock header, with or without a
    lock: it books anew."""
    key = new_key("retry")
    results = [tasks.rated_retrying.apply_async((key,), queue="book") for _ in range(2)]
    for r in results:
        r.get(timeout=30, propagate=False)
    assert [r.state for r in results] == ["SUCCESS", "SUCCESS"]
    rows = tasks.slot_rows(key)
    assert len(rows) == 4  # two calls, each run twice (the run and its retry)
    assert not tasks.slot_violations(rows, 1.0)


def test_a_booked_call_that_raises_slowdown_books_anew_after_the_pause(c: Cluster, tasks: ModuleType) -> None:
    """A booked call started on its booking and raised SlowDown(0.3) (window 1 s): its copy for after the pause kept
    the request's headers, its booking among them, and claimed the entry its run had counted (covered by the pause,
    then on time at its end): two starts on one entry within a window at N = 1. The copy books anew."""
    key = new_key("slowed")
    first = tasks.rated_slowing.apply_async((key, False), queue="book")
    booked = tasks.rated_slowing.apply_async((key, True), queue="book")
    for r in (first, booked):
        r.get(timeout=30, propagate=False)
    assert [first.state, booked.state] == ["SUCCESS", "SUCCESS"]
    rows = tasks.slot_rows(key)
    assert len(rows) == 3  # the first call; the booked call's run and its copy after the pause
    assert not tasks.slot_violations(rows, 1.0)


def _wait_rows(c: Cluster, key: str, count: int, timeout: float = 30.0) -> list[list[Any]]:
    for _ in polling(timeout, 0.02):
        rows = _rows(c, key, "rate_started")
        if len(rows) >= count:
            return rows
    raise AssertionError(f"{key}: fewer than {count} starts within {timeout} s")


def test_a_booked_burst_whose_due_time_moved_never_starts_its_body_within_a_window_of_the_next(
    c: Cluster, tasks: ModuleType
) -> None:
    """lock_debounce 1.2 s, 1 start per 3 s, waiting. A burst's job refused by the window books the slot's next
    moment; a call joins the burst before that moment, so the burst is due 0.8 s after it. The booked copy claimed
    its slot (counted at the moment), then the debounce held it in the worker for the due time (HOLD_MAX) and
    started the body 0.8 s after the count: the next burst's body, booked a window after the count, began 2.2 s
    after it, two bodies in one 3 s window at N = 1 (the count is what the next start is placed after)."""
    key = new_key("debounced")
    period = 3.0
    first = tasks.booked_debounced.apply_async((key, 1), queue="book")
    (row,) = _wait_rows(c, key, 1)
    moment = row[3] + period  # the slot is free a window after the first start was counted (node time)
    second = tasks.booked_debounced.apply_async((key, 2), queue="book")  # a new burst: refused at its due time, books
    for _ in polling(period, 0.02):  # until 0.4 s before the booked moment (bounded)
        if time.time() >= moment - 0.4:
            break
    joined = tasks.booked_debounced.apply_async((key, 3), queue="book")  # joins it: due 0.8 s after the moment
    _wait_rows(c, key, 2)
    last = tasks.booked_debounced.apply_async((key, 4), queue="book")  # the next burst: books a window on
    for r in (first, second, joined, last):
        r.get(timeout=60, propagate=False)
    rows = sorted(_rows(c, key), key=lambda r: r[4])
    assert len(rows) == 3, rows  # the first burst, the second (with call 3's arguments), the last
    starts = [r[4] for r in rows]  # when each body began (wall clock; the nodes run on this machine's clock)
    gaps = [round(b - a, 3) for a, b in itertools.pairwise(starts)]
    # A body begins at most about LATE (50 ms) after its count, plus the worker's own time: 0.25 s on a loaded box.
    assert all(g >= period - 0.25 for g in gaps), gaps
    assert not tasks.slot_violations(tasks.slot_rows(key), period)


def test_held_a_debounced_burst_under_stacked_limits_never_starts_within_a_window_of_the_next(
    c: Cluster, tasks: ModuleType
) -> None:
    """HELD (review of the debounce hold after a counted start): the test above with two limits (1 per 3 s and 50 per
    minute per key: not booked, take_many's path; a waiting call is re-sent to ask again). Three bursts, each
    body a window after the last. Fails with the hold after a counted start put back (debounce._hold): a guard of
    that path, which the booked test above does not take."""
    task = tasks.stacked_debounced
    key = new_key("stacked")
    period = 3.0
    first = task.apply_async((key, 1), queue="book")
    (row,) = _wait_rows(c, key, 1)
    moment = row[3] + period
    second = task.apply_async((key, 2), queue="book")
    for _ in polling(period, 0.02):  # until 0.4 s before the slot is free again (bounded)
        if time.time() >= moment - 0.4:
            break
    joined = task.apply_async((key, 3), queue="book")
    _wait_rows(c, key, 2)
    last = task.apply_async((key, 4), queue="book")
    for r in (first, second, joined, last):
        r.get(timeout=60, propagate=False)
    rows = sorted(_rows(c, key), key=lambda r: r[4])
    assert len(rows) == 3, rows
    gaps = [round(b - a, 3) for a, b in itertools.pairwise(r[4] for r in rows)]
    assert all(g >= period - 0.25 for g in gaps), gaps


def _ran_once_each(c: Cluster, bucket: str) -> dict[str, int]:
    runs: dict[str, int] = {}
    for r in _rows(c, bucket):
        runs[r[1]] = runs.get(r[1], 0) + 1
    return runs


def test_a_booked_call_of_a_job_in_its_cooldown_is_skipped_and_the_window_holds(c: Cluster, tasks: ModuleType) -> None:
    """lock_cooldown 30 s, 1 start per 0.5 s per bucket. k0 fills the window; k1 books; a second call of k1 arrives
    while k1 waits (its lock given back) and books after it; k2 books last. k1 runs, its success starts the
    cooldown: the second call's booked copy is a duplicate in it (skipped, REVOKED), never a second run of k1
    within its cooldown; every job runs once, no window over 1."""
    bucket = new_key("cool")
    k0, k1, k2 = new_key("k0"), new_key("k1"), new_key("k2")
    first = tasks.booked_cool.apply_async((k0, bucket), queue="book")
    _wait_rows(c, bucket, 1)
    job = tasks.booked_cool.apply_async((k1, bucket), queue="book")
    again = tasks.booked_cool.apply_async((k1, bucket), queue="book")
    last = tasks.booked_cool.apply_async((k2, bucket), queue="book")
    for r in (first, job, again, last):
        r.get(timeout=30, propagate=False)
    states = {r.id: r.state for r in (first, job, again, last)}
    ran = _ran_once_each(c, bucket)
    assert [first.state, last.state] == ["SUCCESS", "SUCCESS"], states
    assert sorted([job.state, again.state]) == ["REVOKED", "SUCCESS"], states  # one run of k1 in its cooldown
    assert sorted(ran.values()) == [1, 1, 1], ran
    assert all(r[5] for r in _rows(c, bucket) if r[1] in (job.id, again.id)), _rows(c, bucket)  # it had booked
    assert not tasks.slot_violations(tasks.slot_rows(bucket), 0.5)


def test_a_booked_queue_scope_job_keeps_its_reservation_while_it_waits(c: Cluster, tasks: ModuleType) -> None:
    """lock_scope="queue", 1 start per 0.5 s per bucket. k1 is refused by the window and books; a second delay() of
    k1 while it waits gets k1's job (the reservation stays, docs/options.md), not a second message; k1 runs once,
    on its booking, and no window holds 2 starts."""
    bucket = new_key("queued")
    k0, k1 = new_key("k0"), new_key("k1")
    first = tasks.booked_queued.apply_async((k0, bucket), queue="book")
    _wait_rows(c, bucket, 1)
    job = tasks.booked_queued.apply_async((k1, bucket), queue="book")
    for _ in polling(10, 0.01):  # until its delivery booked and was re-sent (bounded)
        if any(job.id in line and "re-sent to run in" in line for w in c.workers for line in w.log().splitlines()):
            break
    again = tasks.booked_queued.apply_async((k1, bucket), queue="book")
    assert again.id == job.id
    for r in (first, job):
        r.get(timeout=30, propagate=False)
    assert [first.state, job.state] == ["SUCCESS", "SUCCESS"]
    ran = _ran_once_each(c, bucket)
    assert sorted(ran.values()) == [1, 1], ran
    assert [r[5] for r in _rows(c, bucket) if r[1] == job.id] == [1]  # booked once, ran on it
    assert not tasks.slot_violations(tasks.slot_rows(bucket), 0.5)


def test_a_booked_call_that_finds_its_job_running_waits_in_line_and_runs_once(c: Cluster, tasks: ModuleType) -> None:
    """reschedule, lock_max_waiting=1, 1 start per 2 s per bucket. w (job k, bucket b) books; h (job k, another
    bucket) takes k's lock for 2.5 s meanwhile: w's booked copy is a duplicate, waits in k's line (its place kept:
    not a new duplicate for the cap) and is woken by h's release, late but within a window of its moment (its entry
    moves to its real start). Its woken copy and its fallback copy carry the same booking: w runs once (the fallback
    copy, back within the lock's ttl, does not run it again), h once; no two bodies of b closer than a window."""
    b, other = new_key("b"), new_key("other")
    k = new_key("k")
    tasks.booked_capped.apply_async((new_key("k0"), b), queue="book").get(timeout=30)  # b's window used
    w = tasks.booked_capped.apply_async((k, b), queue="book")
    for _ in polling(10, 0.01):
        if any(w.id in line and "re-sent to run in" in line for wk in c.workers for line in wk.log().splitlines()):
            break
    h = tasks.booked_capped.apply_async((k, other, 2.5), queue="book")
    _wait_rows(c, other, 1)
    for r in (w, h):
        r.get(timeout=30, propagate=False)
    assert [w.state, h.state] == ["SUCCESS", "SUCCESS"], (w.result, h.result)
    rows = _rows(c, b)
    assert [r[1] for r in rows].count(w.id) == 1, rows
    assert [r[5] for r in rows if r[1] == w.id] == [1], rows  # booked once: its copies waited in line on the booking
    time_left = 3.0  # the fallback copy of w, if any, comes back within the lock's ttl (3 s): it must not run
    for _ in polling(time_left, 0.1):
        pass
    assert [r[1] for r in _rows(c, b)].count(w.id) == 1
    assert not tasks.slot_violations(tasks.slot_rows(b), 2.0)
    starts = sorted(r[4] for r in _rows(c, b))
    assert all(y - x >= 2.0 - 0.25 for x, y in itertools.pairwise(starts)), starts


def _kill_a_booked_run_mid_body(c: Cluster, tasks: ModuleType, task: Any, key: str, window: float) -> None:
    """Use ``key``'s window, then SIGKILL a booked call's pool process mid-body: the call ends in SUCCESS, started
    twice (the killed run and its redelivery), never twice within a window."""
    task.apply_async((key, 0), queue="book").get(timeout=30)  # the window is used
    booked = task.apply_async((key, 1, 2.5), queue="book")
    pid = None
    for _ in polling(20, 0.01):
        rows = [r for r in _rows(c, key, "rate_started") if r[1] == booked.id]
        if rows:
            pid = rows[0][2]
            break
    assert pid is not None, "the booked call did not start"
    os.kill(pid, signal.SIGKILL)  # a pool process of this module's workers, running the booked call's body
    booked.get(timeout=60, propagate=False)
    assert booked.state == "SUCCESS", booked.result
    started = [r for r in _rows(c, key, "rate_started") if r[1] == booked.id]
    assert len(started) == 2, started  # the killed run and its redelivery
    assert not tasks.slot_violations(tasks.slot_rows(key), window)
    starts = sorted(r[4] for r in _rows(c, key, "rate_started"))
    assert all(y - x >= window - 0.25 for x, y in itertools.pairwise(starts)), starts


def test_a_booked_run_sigkilled_mid_body_is_redelivered_and_books_anew(c: Cluster, tasks: ModuleType) -> None:
    """acks_late and reject_on_worker_lost (locked_app), no lock, 1 start per 2 s. A booked call claims its slot and
    its pool process is SIGKILLed mid-body: the broker gives the message back at once, redelivered, its booking
    header with it. That copy must not start on the entry its killed run counted (two starts of one slot within a
    window): it books anew, and runs a window after the killed start (nothing lost; run twice, as acks_late does)."""
    _kill_a_booked_run_mid_body(c, tasks, tasks.booked_free, new_key("killed-mid"), 2.0)


def test_a_booked_locked_run_sigkilled_mid_body_is_redelivered_after_its_lease_and_books_anew(
    c: Cluster, tasks: ModuleType
) -> None:
    """As above, with a lock (lease 3 s) and 1 start per 5 s: the redelivered copy finds its dead run's lease and is
    re-sent until it ends (a copy of our own, "redelivered"); that copy is no broker redelivery
    (``delivery_info``), only our header says so. It must not start on the entry the killed run counted (late but
    within a window: it would move it to now, two starts of one slot 3.5 s apart in a 5 s window): it books anew."""
    _kill_a_booked_run_mid_body(c, tasks, tasks.booked_locked, new_key("killed-locked"), 5.0)
