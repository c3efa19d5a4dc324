"""Booked slots (policies/rate/booking.py + lua/rate_book.lua, lua/rate_claim.lua) on real redis-servers, one node and
three: a refused call books the moment it owns, in arrival order; bookings count in the window; early, on time, late;
a node restarted empty. Workers: tests/policies/test_rate_workers.py."""

from __future__ import annotations

import threading
import time

import redis

from celery_singleton_lock.lock.nodes import NodeSet
from celery_singleton_lock.lock.scripts import RATE_PAUSE
from celery_singleton_lock.policies.rate import Verdict, Window, take
from celery_singleton_lock.policies.rate.booking import book, claim, decide, parse_booking
from celery_singleton_lock.testing import RedisServer


def _scores(server: RedisServer, key: str) -> dict[str, float]:
    return {m.decode(): s / 1e6 for m, s in redis.Redis.from_url(server.url).zrange(key, 0, -1, withscores=True)}


def _wait_and_claim(nodes: NodeSet, key: str, rate: Window, verdict: Verdict) -> Verdict:
    """Sleep until a booking's moment, then claim it (early again: sleep again; at most 5 times)."""
    for _ in range(5):
        if verdict.outcome != "booked":
            return verdict
        time.sleep(verdict.wait + 0.002)
        verdict = decide(nodes, key, rate, f"{verdict.slot}:{verdict.token}")
    return verdict


def test_refused_calls_book_moments_in_arrival_order_and_bookings_count(redis_node: RedisServer, name: str) -> None:
    nodes = NodeSet(redis_node.url)
    rate = Window(2, 0.6)
    verdicts = [book(nodes, name, rate) for _ in range(6)]
    assert [v.outcome for v in verdicts] == ["granted", "granted"] + ["booked"] * 4
    waits = [v.wait for v in verdicts[2:]]
    # Arrival order: each later call owns a later (or equal) moment. The moments, not the waits: a wait is counted
    # from when its call asked, so under load a later call's wait can be shorter for a later moment.
    moments = [max(v.times.values()) for v in verdicts[2:]]
    assert moments == sorted(moments), moments
    # Two per window: calls 3-4 own the first window after the starts, 5-6 the next one.
    assert 0.4 < waits[0] <= 0.6 and 0.4 < waits[1] <= 0.6 and 1.0 < waits[2] <= 1.2 and 1.0 < waits[3] <= 1.2
    assert {v.slot for v in verdicts[2:4]} == {0, 1} and {v.slot for v in verdicts[4:]} == {0, 1}
    # A new call cannot take a booked slot: rate.lua (skip / fail) refuses, rate_book.lua books after the others.
    assert take(nodes, name, rate).outcome == "limited"
    later = book(nodes, name, rate)
    assert later.outcome == "booked" and later.wait > waits[-1]
    # Early: re-sent for the moment, not run (the same booking); then on time: it starts on it.
    early = decide(nodes, name, rate, f"{verdicts[2].slot}:{verdicts[2].token}")
    assert early.outcome == "booked" and early.token == verdicts[2].token and 0 < early.wait <= 0.6
    started = _wait_and_claim(nodes, name, rate, early)
    assert started.outcome == "granted" and started.token == verdicts[2].token
    entry = _scores(redis_node, name)[f"{started.slot}:{started.token}"]
    assert abs(entry - started.at) < 1e-3  # counted at its booked moment, not moved


def test_a_late_arrival_starts_now_and_its_successor_waits_a_window_from_it(redis_node: RedisServer, name: str) -> None:
    # A 1.2 s window and 0.4 s of lateness: a sleep that overshoots by up to ~0.3 s on a loaded machine changes
    # nothing below (a 0.4 s window and 0.15 s failed once so: the successor's claim came after the late start's
    # window and was granted).
    nodes = NodeSet(redis_node.url)
    rate = Window(1, 1.2)
    assert book(nodes, name, rate).outcome == "granted"
    first, second, third = (book(nodes, name, rate) for _ in range(3))
    assert first.outcome == second.outcome == third.outcome == "booked"
    time.sleep(first.wait + 0.4)  # late by 0.4 s (more than LATE, less than a window)
    late = claim(nodes, name, rate, first.token, first.slot)
    assert late is not None and late.outcome == "granted"
    assert _scores(redis_node, name)[f"{first.slot}:{first.token}"] == late.at  # moved to its real start
    # Its successor, on its own moment, finds the late start covering it: it waits a window from that start.
    time.sleep(max(0.0, second.wait - first.wait - 0.4) + 0.01)
    covered = claim(nodes, name, rate, second.token, second.slot)
    assert covered is not None and covered.outcome == "booked" and 0.05 < covered.wait <= 0.4
    started = _wait_and_claim(nodes, name, rate, covered)
    assert started.outcome == "granted" and started.at >= late.at + rate.period - 1e-6
    # A window late: not started on the booking (its slot may be its successor's): book anew; the entry stays.
    time.sleep(max(0.0, third.wait - second.wait - 0.4) + rate.period + 0.5)
    assert claim(nodes, name, rate, third.token, third.slot) is None
    assert claim(nodes, name, rate, "no-such-token", 0) is None  # a booking not held: book anew
    assert parse_booking("x:y") is None and parse_booking("3:abc") == (3, "abc") and parse_booking(None) is None


def test_three_nodes_a_node_restarted_empty_and_a_split_moment(fresh_trio: list[RedisServer], name: str) -> None:
    nodes = NodeSet([s.url for s in fresh_trio])
    rate = Window(1, 0.5)
    assert book(nodes, name, rate).outcome == "granted"
    booked = book(nodes, name, rate)
    assert booked.outcome == "booked" and len(booked.times) == 3
    # Node 0 restarted empty: the booking lost there, two still hold it; a new call there gets no quorum for the slot.
    fresh_trio[0].restart()
    assert book(nodes, name, rate).outcome == "booked"  # booked after it on the two that remember
    started = _wait_and_claim(nodes, name, rate, booked)
    assert started.outcome == "granted" and set(started.times) == {1, 2}
    # A node that saw one more start names a later moment: the call waits for the latest of the majority.
    key = name + ":split"
    r2 = redis.Redis.from_url(fresh_trio[2].url)
    now = r2.time()
    r2.zadd(key, {"0:other": now[0] * 1_000_000 + now[1] - 100_000})  # a start 0.1 s ago, on node 2 only
    split = book(nodes, key, rate)
    assert split.outcome == "booked" and 0.3 < split.wait <= 0.5
    assert _wait_and_claim(nodes, key, rate, split).outcome == "granted"
    # Two nodes lost it: no quorum holds the booking, the call books anew.
    lost = book(nodes, key, rate)
    assert lost.outcome == "booked"
    for s in fresh_trio[:2]:
        redis.Redis.from_url(s.url).delete(key)
    assert claim(nodes, key, rate, lost.token, lost.slot) is None


def test_contenders_that_book_never_put_more_than_n_starts_in_a_window(
    redis_trio: list[RedisServer], name: str
) -> None:
    nodes = NodeSet([s.url for s in redis_trio])
    rate = Window(3, 0.3)
    starts: list[tuple[int, float]] = []
    lock = threading.Lock()

    def call() -> None:
        verdict = _wait_and_claim(nodes, name, rate, book(nodes, name, rate))
        for _ in range(5):  # a late one books anew (bounded)
            if verdict.outcome != "limited" or not verdict.contended:
                break
            time.sleep(verdict.wait)
            verdict = _wait_and_claim(nodes, name, rate, book(nodes, name, rate))
        if verdict.outcome == "granted":
            with lock:
                starts.extend((i, at) for i, at in verdict.times.items())

    threads = [threading.Thread(target=call) for _ in range(15)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    for node in range(3):
        ats = sorted(at for i, at in starts if i == node)
        over = [ats[j] for j in range(len(ats) - rate.limit) if ats[j + rate.limit] - ats[j] < rate.period - 1e-6]
        assert not over, (node, ats)
    assert len({at for _, at in starts}) >= 10  # most of the 15 started (a late one may have booked past the join)


def test_a_booking_claimed_over_a_second_late_keeps_its_log_until_it_leaves_the_window(
    redis_node: RedisServer, name: str
) -> None:
    """A late claim moves its entry to now: the log must then live until that entry leaves the window. It kept the
    expiry its booking set (the booked moment + a window + 1 s), so a claim more than 1 s late left a log that expired
    while its start was still in the window, and a new call then started within a window of it (one limit, N=1)."""
    nodes = NodeSet(redis_node.url)
    rate = Window(1, 1.6)
    assert book(nodes, name, rate).outcome == "granted"
    booked = book(nodes, name, rate)
    assert booked.outcome == "booked"
    time.sleep(booked.wait + 1.2)  # 1.2 s late: more than the log's 1 s margin, less than a window
    late = claim(nodes, name, rate, booked.token, booked.slot)
    assert late is not None and late.outcome == "granted"
    pttl = redis.Redis.from_url(redis_node.url).pttl(name)
    assert pttl >= rate.period * 1000, f"the log expires in {pttl} ms, its last start leaves the window in 1600 ms"


def test_with_one_node_of_three_paused_a_waiting_call_starts_and_a_booked_one_claims(
    fresh_trio: list[RedisServer], name: str
) -> None:
    """A node frozen (SIGSTOP) answers nothing: every round trip to all three takes the socket timeout, so each
    answer comes back later than LATE. The start counted now must then move to now on the nodes that hold it (as
    rate.take does), and a booked call's claim ask again only the nodes that let it start: before, both asked all
    three again, late every time, and a call waiting for its rate never started while the node was paused (book()
    ended 'limited' after ~10 s, every time)."""
    nodes = NodeSet([s.url for s in fresh_trio], socket_timeout=0.2)
    rate = Window(1, 1.0)
    assert book(nodes, name, rate).outcome == "granted"
    booked = book(nodes, name, rate)
    assert booked.outcome == "booked"
    fresh_trio[2].pause()
    try:
        started = _wait_and_claim(nodes, name, rate, booked)
        assert started.outcome == "granted" and started.token == booked.token, started
        other = f"{name}:other"
        assert book(nodes, other, rate).outcome == "granted"
    finally:
        fresh_trio[2].resume()


def _pause(nodes: NodeSet, key: str, rate: Window, seconds: float) -> None:
    """A body's SlowDown(seconds) on this one-limit rate, as policies/rate/feature.py writes it (lua/rate_pause.lua)."""
    nodes.run(RATE_PAUSE, [key], ["pause-token", round(seconds * 1_000_000), rate.limit, rate.window_us])


def test_a_booked_call_never_starts_inside_a_pause_longer_than_the_window(redis_node: RedisServer, name: str) -> None:
    """A SlowDown pause longer than the window stores its entries in the future (they leave the window when the pause
    ends). rate_claim.lua looked only at entries up to now for what covers a booking, so a call booked before the
    pause started on its moment inside the pause."""
    nodes = NodeSet(redis_node.url)
    rate = Window(1, 0.3)
    assert book(nodes, name, rate).outcome == "granted"
    booked = book(nodes, name, rate)
    assert booked.outcome == "booked" and booked.wait <= 0.3
    _pause(nodes, name, rate, 1.5)  # until ~1.5 s from now: the booking's moment (~0.3 s) is inside it
    time.sleep(booked.wait + 0.01)
    verdict = claim(nodes, name, rate, booked.token, booked.slot)
    assert verdict is not None and verdict.outcome == "booked", verdict  # waits: it must not start in the pause
    assert verdict.wait > 1.0
    # A booking made during the pause lands after it.
    during = book(nodes, name, rate)
    assert during.outcome == "booked" and during.wait > 1.0


def test_bookings_made_before_lock_rate_was_lowered_never_put_more_than_the_new_n_in_a_window(
    redis_node: RedisServer, name: str
) -> None:
    """lock_rate lowered between deploys (same key): bookings of slots >= the new N, made under the old one, were
    still claimed (rate_claim.lua did not know N), so their starts joined the others' in one window: 4 at N = 2. A
    booking of a slot >= N now books anew under the new N, and such an entry holds every slot, as in rate_book.lua."""
    nodes = NodeSet(redis_node.url)
    old, new = Window(4, 0.4), Window(2, 0.4)
    assert [book(nodes, name, old).outcome for _ in range(4)] == ["granted"] * 4
    booked = [book(nodes, name, old) for _ in range(4)]
    assert [v.outcome for v in booked] == ["booked"] * 4 and {v.slot for v in booked} == {0, 1, 2, 3}
    time.sleep(max(v.wait for v in booked) + 0.005)
    started = [v for v in booked if (c := claim(nodes, name, new, v.token, v.slot)) and c.outcome == "granted"]
    assert len(started) <= new.limit, [v.slot for v in started]
    assert all(v.slot < new.limit for v in started)


def test_a_redelivered_copy_after_its_moment_books_anew_and_the_start_stays_counted(
    redis_node: RedisServer, name: str
) -> None:
    """A booked copy that started, its worker killed (acks_late), comes back from the broker within a window (a
    RabbitMQ connection closed; a Redis visibility timeout shorter than a long window, "100/d"): its claim found its
    own entry and started on it again (on time) or moved it to now (late), so the killed start was no longer
    counted: two starts on one entry. Redelivered, it keeps its booking only while early; then it books anew."""
    nodes = NodeSet(redis_node.url)
    rate = Window(1, 0.5)
    assert book(nodes, name, rate).outcome == "granted"
    booked = book(nodes, name, rate)
    assert booked.outcome == "booked"
    held = f"{booked.slot}:{booked.token}"
    time.sleep(max(0.0, booked.wait - 0.1))
    early = decide(nodes, name, rate, held, redelivered=True)  # early (within SHORT: waited here): its own
    assert early.outcome == "granted" and early.token == booked.token
    again = decide(nodes, name, rate, held, redelivered=True)  # the killed start's copy, redelivered at once
    assert again.outcome == "booked" and again.token != booked.token and again.wait > 0.4
    assert held in _scores(redis_node, name)  # the first start stays counted
