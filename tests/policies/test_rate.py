"""``lock_rate``'s decision (policies/rate/count.py, stack.py + lua/rate.lua, rate_stack.lua) on real redis-servers,
one node and three: the sliding window counted by slots, the quorum, the wait it names, undo, and the option checks.
Workers: tests/policies/test_rate_workers.py.
"""

from __future__ import annotations

import itertools
import threading
import time
from typing import Any

import pytest
import redis

from celery_singleton_lock import Rate as PublicRate
from celery_singleton_lock.errors import ConfigurationError
from celery_singleton_lock.lock.nodes import NodeSet
from celery_singleton_lock.lock.scripts import RATE, RATE_RESTAMP, RATE_UNDO
from celery_singleton_lock.policies.rate import Limit, Window, adjust, parse_limits, parse_rate, take, take_many, undo
from celery_singleton_lock.policies.rate import Window as Rate
from celery_singleton_lock.testing import RedisServer


def _log(server: RedisServer, key: str) -> list[tuple[bytes, float]]:
    return redis.Redis.from_url(server.url).zrange(key, 0, -1, withscores=True)


def test_parse_rate_notation_and_tuples() -> None:
    assert parse_rate("10/s", "x") == Rate(10, 1.0)
    assert parse_rate(" 100 / m ", "x") == Rate(100, 60.0)
    assert parse_rate("5/h", "x") == Rate(5, 3600.0)
    assert parse_rate((3, 2.5), "x") == Rate(3, 2.5)
    assert parse_rate([3, 2], "x") == Rate(3, 2.0)


@pytest.mark.parametrize(
    "bad",
    [
        "0/s",
        "10/w",
        "10",
        "-1/s",
        "1.5/s",
        (0, 1.0),
        (True, 1.0),
        (1, True),
        (1, 0),
        (1, float("nan")),
        (1, float("inf")),
        (1, -1),
        (1, 0.0001),
        ("1", 1.0),
        (1, 2, 3),
        None,
        10,
        b"10/s",
        (10**6, 1.0),
    ],
)
def test_parse_rate_refuses_odd_values_in_one_line(bad: object) -> None:
    with pytest.raises(ConfigurationError, match=r"^lock_rate of t must be") as info:
        parse_rate(bad, "lock_rate of t")
    assert "\n" not in str(info.value)


def test_n_starts_per_window_then_a_wait_naming_the_oldest_start(redis_node: RedisServer, name: str) -> None:
    nodes = NodeSet(redis_node.url)
    rate = Rate(3, 0.5)
    verdicts = [take(nodes, name, rate) for _ in range(3)]
    assert [v.outcome for v in verdicts] == ["granted"] * 3
    assert sorted(v.slot for v in verdicts) == [0, 1, 2]
    refused = take(nodes, name, rate)
    assert refused.outcome == "limited"
    assert 0.0 < refused.wait <= 0.5
    # After the wait, exactly one slot is free again (the oldest start left the window), not early.
    time.sleep(refused.wait + 0.01)
    assert take(nodes, name, rate).outcome == "granted"
    log = _log(redis_node, name)
    assert 1 <= len(log) <= 3  # the starts that left the window are gone from the log


def test_undo_uncounts_only_its_own_start(redis_node: RedisServer, name: str) -> None:
    nodes = NodeSet(redis_node.url)
    rate = Rate(2, 5.0)
    a, b = take(nodes, name, rate), take(nodes, name, rate)
    assert take(nodes, name, rate).outcome == "limited"
    undo(nodes, name, a.token)
    undo(nodes, name, a.token)  # twice: a late duplicate of the undo removes nothing else
    assert [m for m, _ in _log(redis_node, name)] == [f"{b.slot}:{b.token}".encode()]
    assert take(nodes, name, rate).outcome == "granted"


def test_quorum_of_three_counts_on_a_majority_and_survives_one_node_down(
    fresh_trio: list[RedisServer], name: str
) -> None:
    nodes = NodeSet([s.url for s in fresh_trio], socket_timeout=0.3)
    rate = Rate(2, 30.0)
    assert take(nodes, name, rate).outcome == "granted"
    fresh_trio[0].stop()
    v = take(nodes, name, rate)
    assert v.outcome == "granted"  # two of three: a quorum
    limited = take(nodes, name, rate)
    assert limited.outcome == "limited" and limited.wait > 20
    fresh_trio[1].stop()
    assert take(nodes, name, rate).outcome == "unavailable"


def test_a_minority_that_missed_starts_cannot_let_a_third_one_in(fresh_trio: list[RedisServer], name: str) -> None:
    """The counterexample of counting instead of slots: starts seen by {A,B}, {B,C} -> a third on {A,C} must be
    refused, since it would share a slot with one of them on a node of both majorities."""
    nodes = NodeSet([s.url for s in fresh_trio], socket_timeout=0.3)
    rate = Rate(2, 30.0)
    ab = NodeSet([fresh_trio[0].url, fresh_trio[1].url])
    bc = NodeSet([fresh_trio[1].url, fresh_trio[2].url])
    ac = NodeSet([fresh_trio[0].url, fresh_trio[2].url])
    # Each two-node set's quorum is both nodes: a start counted on both is a start counted on a majority of three.
    assert take(ab, name, rate).outcome == "granted"
    assert take(bc, name, rate).outcome == "granted"
    third = take(ac, name, rate)
    granted_total = 2 + (third.outcome == "granted")
    # Whatever A and C said, the full set never grants past the rate now.
    assert take(nodes, name, rate).outcome == "limited"
    if third.outcome == "granted":
        # A and C had a free slot each (each saw one start): the slots they gave must differ from the ones held on
        # B, or a majority holds one slot twice. B holds slots 0 and 1, so a third start is never granted a slot
        # that a quorum of three would accept: the full set refuses above.
        pytest.fail(f"{granted_total} starts counted for a rate of 2: {third}")


def test_contenders_at_the_window_edge_never_exceed_the_rate(redis_trio: list[RedisServer], name: str) -> None:
    """Many threads deciding at once, for several windows: no window of the nodes' clock holds more than N."""
    nodes = NodeSet([s.url for s in redis_trio])
    rate = Rate(5, 0.3)
    granted: list[float] = []
    slots: list[tuple[int, dict[int, float]]] = []
    lock = threading.Lock()

    def contend() -> None:
        end = time.monotonic() + 1.5
        for _ in range(400):
            if time.monotonic() > end:
                return
            v = take(nodes, name, rate)
            if v.outcome == "granted":
                with lock:
                    granted.append(v.at)  # when the nodes counted it (TIME inside the script)
                    slots.append((v.slot, dict(v.times)))
            else:
                time.sleep(min(v.wait, 0.05))

    threads = [threading.Thread(target=contend) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    granted.sort()
    assert len(granted) >= 5
    # Checked exactly, on each node's own clock (no slack: the three nodes' TIME is read in three calls, and a grant
    # whose answers came back late is restamped up to LATE s later, so the grants' ``at`` of different nodes are not
    # one clock): on every node, no window of 0.3 s holds more than 5 of the grants it counted, and two successive
    # grants of one slot were counted on a common node, at least a window apart there.
    per_node: dict[int, list[float]] = {}
    by_slot: dict[int, list[dict[int, float]]] = {}
    for slot, times in slots:
        by_slot.setdefault(slot, []).append(times)
        for node, at in times.items():
            per_node.setdefault(node, []).append(at)
    for node, ats in per_node.items():
        ats.sort()
        for i in range(len(ats) - 5):
            assert ats[i + 5] - ats[i] >= rate.period - 1e-6, (node, ats[i : i + 6])
    for slot, starts in by_slot.items():
        starts.sort(key=lambda t: min(t.values()))
        for x, y in itertools.pairwise(starts):
            common = x.keys() & y.keys()
            assert common, (slot, x, y)
            assert all(y[n] - x[n] >= rate.period - 1e-6 for n in common), (slot, x, y)


#: Seconds between the starts of the lowered-rate test: the check runs between the oldest start leaving the window
#: and the 4th oldest leaving it, 3 x APART s later. A bound: a machine so loaded that 3 x APART s pass between two
#: reads of the node's clock fails the test (it never passes without checking).
APART = 0.4


def test_a_lowered_rate_counts_the_starts_already_in_the_window(redis_node: RedisServer, name: str) -> None:
    """5 starts at (5, 2 s), APART s apart, then the rate is lowered to 2: once the oldest left the window, 4 are still
    in it, so no start fits (the entries of slots 2..4 count too) until the 4th oldest left."""
    nodes = NodeSet(redis_node.url)
    ats = []
    for _ in range(5):
        v = take(nodes, name, Rate(5, 2.0))
        assert v.outcome == "granted"
        ats.append(v.at)
        time.sleep(APART)
    client = redis.Redis.from_url(redis_node.url)
    for _ in range(400):  # until the oldest left the window by the node's clock (bounded: ~4 s)
        sec, usec = client.time()
        if sec + usec / 1e6 > ats[0] + 2.0 + 0.01:
            break
        time.sleep(0.01)
    assert sec + usec / 1e6 > ats[0] + 2.0, "the oldest start never left the window"
    v = take(nodes, name, Rate(2, 2.0))
    sec, usec = client.time()
    assert sec + usec / 1e6 < ats[3] + 2.0, "the 4th oldest start left the window before the check: see APART"
    assert v.outcome == "limited", v


def test_celery_locks_names_a_rate_log_as_such_not_as_a_foreign_key(redis_trio: list[RedisServer]) -> None:
    """``celery locks`` lists every key under the prefix: a rate's sliding log is shown as a rate (kind ``rate``),
    not as ``foreign`` ("not a holder record of celery_singleton_lock"), and is never released."""
    from celery_singleton_lock.lock.config import LockSettings  # noqa: PLC0415
    from celery_singleton_lock.ops.cli import list_locks  # noqa: PLC0415

    urls = [s.url for s in redis_trio]
    prefix = f"p{time.monotonic_ns()}:"
    key = f"{prefix}rate:reports.send:v2:abc"
    assert take(NodeSet(urls), key, Rate(3, 30.0)).outcome == "granted"
    settings = LockSettings(urls=urls, prefix=prefix)
    (info,) = list_locks(settings).value
    assert (info.key, info.kind, info.state) == (key, "rate", "rate")


def test_an_eager_call_over_the_rate_raises_rate_limited_error(redis_node: RedisServer) -> None:
    """``task.apply()`` cannot wait: over the rate it raises RateLimitedError naming the rate (whatever the policy)."""
    from celery import Celery  # noqa: PLC0415

    from celery_singleton_lock import LockedTask, RateLimitedError  # noqa: PLC0415
    from celery_singleton_lock.testing import use_lock_nodes  # noqa: PLC0415

    app = Celery("rate_eager", broker="memory://", backend="cache+memory://", set_as_current=False)

    @app.task(base=LockedTask, shared=False, lock_rate=(1, 60.0), lock_rate_on=["n"])
    def once_a_minute(n: int, note: str = "") -> int:
        return n

    with use_lock_nodes(app, redis_node.url, prefix=f"eager{time.monotonic_ns()}:"):
        assert once_a_minute.apply(args=(1,)).get() == 1
        assert once_a_minute.apply(args=(2,)).get() == 2  # another key, another rate
        with pytest.raises(RateLimitedError, match=r"rate 1 per 60 s of .* reached"):
            once_a_minute.apply(args=(1, "again")).get()


def test_a_grant_whose_reply_came_back_late_never_starts_within_a_window_of_the_next(
    redis_node: RedisServer, name: str
) -> None:
    """1 start per 0.5 s. The first decision's reply is held 0.6 s on its way back (FaultProxy): the node counted it
    at t0, its caller would start at t0 + 0.6. A second caller, asking on its own connection, is granted at t0 + 0.5:
    two starts about 0.1 s apart, in one window (the bodies; the node's log was right). Review of issue 22: a grant
    whose answers took longer than policies.rate.LATE is restamped at the nodes' time now (or uncounted), so its
    slot's next start comes a window after its body could begin."""
    from celery_singleton_lock.testing.faults import FaultProxy  # noqa: PLC0415

    rate = Rate(1, 0.5)
    with FaultProxy(redis_node.port) as proxy:
        late_nodes = NodeSet(proxy.url, socket_timeout=5.0)
        assert take(late_nodes, f"{name}:warm", rate).outcome == "granted"  # connected
        for script in (RATE, RATE_UNDO, RATE_RESTAMP):  # loaded: no NOSCRIPT round trip through the delay
            redis.Redis.from_url(redis_node.url).script_load(script.body)
        slow = proxy.delay(0.6, direction="downstream")
        first: list[tuple[str, float]] = []
        t = threading.Thread(target=lambda: first.append((take(late_nodes, name, rate).outcome, time.monotonic())))
        t.start()
        direct = NodeSet(redis_node.url)
        for _ in range(200):  # bounded: until the node counted the first start (its reply is still on its way)
            if _log(redis_node, name):
                break
            time.sleep(0.005)
        second: tuple[str, float] | None = None
        for _ in range(200):  # bounded: about 4 s
            v = take(direct, name, rate)
            if v.outcome == "granted":
                second = (v.outcome, time.monotonic())
                break
            time.sleep(0.02)
        slow.stop()  # what is on its way keeps its delay; the rest goes at once
        t.join(30)
    assert first and second
    starts = sorted(at for outcome, at in (first[0], second) if outcome == "granted")
    assert len(starts) < 2 or starts[1] - starts[0] >= rate.period - 0.05, starts


def test_a_full_window_whose_starts_hold_different_majorities_names_its_real_wait(
    fresh_trio: list[RedisServer], name: str
) -> None:
    """(2, 30 s) on 3 nodes: X counted on {A, C} (slot 0), Y on {B, C} (slot 1): the window is full. A third start
    gets A: slot 1, B: slot 0, C: refused; no slot can gain a quorum until X leaves the window, 30 s on. Review of
    issue 22: take() answered a 5-50 ms jitter (a contenders' split), so a waiting call was re-sent every few ms for
    the whole window; the nodes now say when each slot is free there, and the wait is when one is on a quorum."""
    rate = Rate(2, 30.0)
    a, b, c = (s.url for s in fresh_trio)
    assert take(NodeSet([a, c]), name, rate).outcome == "granted"
    # Y asks B and C for slot 1 (as take's second attempt does, after a split)
    y = NodeSet([b, c]).run(RATE, [name], ["y" * 32, rate.limit, rate.window_us, "1", ""])
    assert [list(map(int, answer[:2])) for answer in y] == [[1, 1], [1, 1]]
    third = take(NodeSet([a, b, c]), name, rate)
    assert third.outcome == "limited"
    assert third.wait > 20, third


def test_two_nodes_whose_lowest_free_slots_differ_agree_on_a_slot_free_on_both(
    fresh_trio: list[RedisServer], name: str
) -> None:
    """Review of issue 22: on nodes B (all free) and C (slot 0 taken), B gives slot 0 and C slot 1; asking again for
    the slot most nodes gave (a tie: 0) split again, three times, and the start was refused with slot 1 free on both.
    The nodes' free slots pick slot 1."""
    rate = Rate(2, 30.0)
    b, c = fresh_trio[1].url, fresh_trio[2].url
    assert take(NodeSet(c), name, rate).slot == 0
    second = take(NodeSet([b, c]), name, rate)
    assert second.outcome == "granted" and second.slot == 1, second


def test_contenders_under_the_rate_are_never_told_it_is_reached(redis_trio: list[RedisServer], name: str) -> None:
    """Review of issue 22: 24 contenders at once for a rate of 30 on three nodes kept splitting the free slots, and a
    few were answered "limited" as if the rate were reached: with lock_on_rate_limit="skip" or "fail" such a call
    was REVOKED or failed under the rate. Such an answer is now marked contended (the rate feature re-sends it, whatever
    the policy)."""
    nodes = NodeSet([s.url for s in redis_trio])
    rate = Rate(30, 20.0)
    told: list[Any] = []
    for round_ in range(6):  # bounded: a few rounds of 24 contenders (a split is likely, not certain, in one)
        key = f"{name}:{round_}"
        barrier = threading.Barrier(24)
        verdicts: list[Any] = []

        def contend(key: str = key, barrier: threading.Barrier = barrier, verdicts: list[Any] = verdicts) -> None:
            barrier.wait(10)
            verdicts.append(take(nodes, key, rate))

        threads = [threading.Thread(target=contend) for _ in range(24)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert len(verdicts) == 24
        told += [v for v in verdicts if v.outcome == "limited" and not getattr(v, "contended", False)]
    assert not told, told


# -- stacked limits and costs (issue 33): lua/rate_stack.lua, take_many, adjust -----------------------------------


def _units(server: RedisServer, key: str) -> int:
    return len(_log(server, key))


def test_parse_limits_stacks_plain_items_rates_with_their_own_arguments_and_days() -> None:
    """A list of limits: plain items on lock_rate_on, Rate(...) on its own arguments (none: the whole task); "N/d"."""
    limits = parse_limits(["3000/m", PublicRate("60/m", on=["tenant"]), (10_000, 86400)], ["account"], "x")
    assert [(lim.window, lim.on) for lim in limits] == [
        (Window(3000, 60.0), ("account",)),
        (Window(60, 60.0), ("tenant",)),
        (Window(10_000, 86400.0), ("account",)),
    ]
    assert parse_rate("10/d", "x") == Window(10, 86400.0)
    assert parse_limits((5, 2), (), "x") == (Limit(Window(5, 2.0), ()),)  # (N, seconds) is one limit, not two
    assert parse_limits(PublicRate("5/s"), ["a"], "x") == (Limit(Window(5, 1.0), ()),)


@pytest.mark.parametrize(
    ("bad", "says"),
    [
        (["10/s", "20/s"], "two limits per 1 s on the same arguments"),
        (["10/s", "10/w"], "must be"),
        ([], "must be"),
        ([PublicRate("1/s", on="tenant")], "must be a list of argument names"),
        (["1/s"] * 9, "at most 8"),
    ],
)
def test_parse_limits_refuses_in_one_line(bad: object, says: str) -> None:
    with pytest.raises(ConfigurationError, match=r"^lock_rate of t") as info:
        parse_limits(bad, (), "lock_rate of t")
    assert says in str(info.value) and "\n" not in str(info.value)


def test_a_stacked_start_takes_a_share_of_every_limit_or_of_none(redis_node: RedisServer, name: str) -> None:
    """(3 per 30 s) and (2 per 30 s): two starts take a slot of each; the third is refused by the second limit and
    leaves nothing in the first's log (all or none), with the second limit's wait."""
    nodes = NodeSet(redis_node.url)
    keys, windows = [f"{name}:a", f"{name}:b"], [Window(3, 30.0), Window(2, 30.0)]
    first, second = (take_many(nodes, keys, windows) for _ in range(2))
    assert (first.outcome, second.outcome) == ("granted", "granted")
    assert {first.slots, second.slots} == {((0,), (0,)), ((1,), (1,))}
    third = take_many(nodes, keys, windows)
    assert third.outcome == "limited" and 25 < third.wait <= 30, third
    assert (_units(redis_node, keys[0]), _units(redis_node, keys[1])) == (2, 2)


def test_the_wait_of_a_stacked_refusal_is_the_latest_of_its_limiting_windows(
    redis_node: RedisServer, name: str
) -> None:
    """(1 per 0.5 s) and (1 per 20 s): refused, the wait is the 20 s window's, not the first free moment of one."""
    nodes = NodeSet(redis_node.url)
    keys, windows = [f"{name}:a", f"{name}:b"], [Window(1, 0.5), Window(1, 20.0)]
    assert take_many(nodes, keys, windows).outcome == "granted"
    refused = take_many(nodes, keys, windows)
    assert refused.outcome == "limited" and 15 < refused.wait <= 20, refused


def test_stacked_limits_keep_the_slot_argument_against_minorities_that_missed_starts(
    fresh_trio: list[RedisServer], name: str
) -> None:
    """The counterexample of counting, with two limits: starts counted on {A,B} and {B,C}; a third on {A,C} (each
    saw one) would be granted by counts; the full set never grants a third for limits of 2."""
    keys, windows = [f"{name}:a", f"{name}:b"], [Window(2, 30.0), Window(5, 30.0)]
    a, b, c = (s.url for s in fresh_trio)
    assert take_many(NodeSet([a, b]), keys, windows).outcome == "granted"
    assert take_many(NodeSet([b, c]), keys, windows).outcome == "granted"
    take_many(NodeSet([a, c]), keys, windows)
    assert take_many(NodeSet([a, b, c], socket_timeout=0.3), keys, windows).outcome == "limited"


def test_a_start_of_cost_c_takes_c_slots_of_every_limit(redis_node: RedisServer, name: str) -> None:
    """Cost 3 of (5 per 30 s) and (4 per 30 s): one start holds 3 slots of each; a second of cost 3 is refused (4 - 3
    left), one of cost 1 fits."""
    nodes = NodeSet(redis_node.url)
    keys, windows = [f"{name}:a", f"{name}:b"], [Window(5, 30.0), Window(4, 30.0)]
    first = take_many(nodes, keys, windows, 3)
    assert first.outcome == "granted" and first.slots == ((0, 1, 2), (0, 1, 2))
    assert take_many(nodes, keys, windows, 3).outcome == "limited"
    assert take_many(nodes, keys, windows, 1).slots == ((3,), (3,))


def test_a_refund_frees_slots_at_once_and_an_extra_charge_holds_later_starts_back(
    redis_node: RedisServer, name: str
) -> None:
    """rate_spent's correction: a start estimated at 3 of (4 per 30 s) that cost 1 gives 2 back (a start of 3 fits
    again); one that cost 4 more is charged, and no start fits until the charge leaves the window."""
    nodes = NodeSet(redis_node.url)
    keys, windows = [name], [Window(4, 30.0)]
    first = take_many(nodes, keys, windows, 3)
    assert take_many(nodes, keys, windows, 2).outcome == "limited"
    adjust(nodes, keys, windows, first.token, -2, [0])  # it cost 1
    assert _units(redis_node, name) == 1
    second = take_many(nodes, keys, windows, 3)
    assert second.outcome == "granted"
    adjust(nodes, keys, windows, second.token, 1, [0])  # it cost 4: 1 + 4 = 5 units logged, one over
    assert _units(redis_node, name) == 5
    refused = take_many(nodes, keys, windows, 1)
    assert refused.outcome == "limited" and refused.wait > 25
    undo(nodes, keys, second.token)  # its slots and its extra charge
    assert _units(redis_node, name) == 1


def test_a_cost_per_limit_takes_each_limit_s_own_units_and_corrects_each_on_its_own(
    redis_node: RedisServer, name: str
) -> None:
    """Requests and tokens: a start takes 1 of (3 per 30 s) and 4 of (10 per 30 s), all or none (a third start of 4
    tokens does not fit: nothing of it is logged, not even its request); a correction of the token log alone
    (rate_adjust.lua, a difference per log) gives 3 tokens back and leaves the requests as they are."""
    nodes = NodeSet(redis_node.url)
    keys, windows = [f"{name}:r", f"{name}:t"], [Window(3, 30.0), Window(10, 30.0)]
    first = take_many(nodes, keys, windows, (1, 4))
    assert first.outcome == "granted" and [len(s) for s in first.slots] == [1, 4], first
    assert take_many(nodes, keys, windows, [1, 4]).outcome == "granted"
    refused = take_many(nodes, keys, windows, (1, 4))
    assert refused.outcome == "limited" and refused.wait > 25
    assert (_units(redis_node, keys[0]), _units(redis_node, keys[1])) == (2, 8)
    adjust(nodes, keys[1:], windows[1:], first.token, [-3], [0])
    assert (_units(redis_node, keys[0]), _units(redis_node, keys[1])) == (2, 5)
    adjust(nodes, keys, windows, first.token, [0, 2], [0])  # a difference per log: the requests' 0 changes nothing
    assert (_units(redis_node, keys[0]), _units(redis_node, keys[1])) == (2, 7)
    assert take_many(nodes, keys, windows, (1, 3)).outcome == "granted"
    assert take_many(nodes, keys, windows, (1, 1)).outcome == "limited"  # 3 requests in the window


def test_the_one_limit_path_counts_extra_charges_too(redis_node: RedisServer, name: str) -> None:
    """A start of one limit and cost 1 goes through lua/rate.lua (the hot path); an extra charge logged behind it by
    rate_adjust.lua is counted there: (2 per 30 s), one start that cost 2: the window is full."""
    nodes = NodeSet(redis_node.url)
    rate = Window(2, 30.0)
    first = take(nodes, name, rate)
    adjust(nodes, [name], [rate], first.token, 1, [0])
    refused = take(nodes, name, rate)
    assert refused.outcome == "limited" and refused.wait > 25, refused


def test_stacked_splits_agree_on_slots_free_on_a_quorum(fresh_trio: list[RedisServer], name: str) -> None:
    """On B (all free) and C (slots 0 of both limits taken), B gives slot 0 and C slot 1 of each: the retry asks
    each node when each slot is free and takes the ones free on both."""
    keys, windows = [f"{name}:a", f"{name}:b"], [Window(3, 30.0), Window(3, 30.0)]
    b, c = fresh_trio[1].url, fresh_trio[2].url
    assert take_many(NodeSet(c), keys, windows).slots == ((0,), (0,))
    second = take_many(NodeSet([b, c]), keys, windows, 2)
    assert second.outcome == "granted" and second.slots == ((1, 2), (1, 2)), second


def test_contenders_over_three_stacked_limits_never_exceed_any_window(redis_trio: list[RedisServer], name: str) -> None:
    """8 threads deciding at once with costs 1-2 over (6 per 0.3 s), (9 per 0.6 s) and (20 per 5 s): on every node's
    clock no window of any limit holds more units than its N, and two successive holders of one slot of one limit
    were counted on a common node at least that limit's window apart."""
    nodes = NodeSet([s.url for s in redis_trio])
    keys = [f"{name}:a", f"{name}:b", f"{name}:c"]
    windows = [Window(6, 0.3), Window(9, 0.6), Window(20, 5.0)]
    grants: list[tuple[int, Any]] = []
    lock = threading.Lock()

    def contend(seed: int) -> None:
        end = time.monotonic() + 1.5
        for i in range(300):
            if time.monotonic() > end:
                return
            cost = 1 + (seed + i) % 2
            v = take_many(nodes, keys, windows, cost)
            if v.outcome == "granted":
                with lock:
                    grants.append((cost, v))
            else:
                time.sleep(min(v.wait, 0.05))

    threads = [threading.Thread(target=contend, args=(n,)) for n in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert sum(cost for cost, _ in grants) >= 6
    for j, window in enumerate(windows):
        per_node: dict[int, list[tuple[float, int]]] = {}
        by_slot: dict[int, list[dict[int, float]]] = {}
        for cost, v in grants:
            assert len(v.slots[j]) == cost
            for slot in v.slots[j]:
                by_slot.setdefault(slot, []).append(v.times)
            for node, at in v.times.items():
                per_node.setdefault(node, []).append((at, cost))
        for node, starts in per_node.items():
            starts.sort()
            for i, (at, _) in enumerate(starts):
                inside = sum(c for t, c in starts[i:] if t - at < window.period - 1e-6)
                assert inside <= window.limit, (j, node, at, inside)
        for slot, holders in by_slot.items():
            holders.sort(key=lambda t: min(t.values()))
            for x, y in itertools.pairwise(holders):
                common = x.keys() & y.keys()
                assert common, (j, slot, x, y)
                assert all(y[n] - x[n] >= window.period - 1e-6 for n in common), (j, slot, x, y)


def test_a_stacked_grant_whose_reply_came_back_late_is_restamped(redis_node: RedisServer, name: str) -> None:
    """(1 per 0.5 s) stacked with (100 per 60 s), the first decision's reply held 0.6 s on its way back: its
    entries are restamped at the node's time now (lua/rate_stack_restamp.lua) or it is uncounted, so a second
    start, asked while the reply travels, comes a window after the first body could begin, not 0.1 s after."""
    from celery_singleton_lock.lock.scripts import RATE_STACK, RATE_STACK_RESTAMP  # noqa: PLC0415
    from celery_singleton_lock.testing.faults import FaultProxy  # noqa: PLC0415

    keys, windows = [f"{name}:a", f"{name}:b"], [Window(1, 0.5), Window(100, 60.0)]
    with FaultProxy(redis_node.port) as proxy:
        late_nodes = NodeSet(proxy.url, socket_timeout=5.0)
        assert take_many(late_nodes, [f"{name}:w1", f"{name}:w2"], windows).outcome == "granted"  # connected
        for script in (RATE_STACK, RATE_UNDO, RATE_STACK_RESTAMP):
            redis.Redis.from_url(redis_node.url).script_load(script.body)
        slow = proxy.delay(0.6, direction="downstream")
        first: list[tuple[str, float]] = []
        t = threading.Thread(
            target=lambda: first.append((take_many(late_nodes, keys, windows).outcome, time.monotonic()))
        )
        t.start()
        direct = NodeSet(redis_node.url)
        for _ in range(200):  # bounded: until the node counted the first start
            if _log(redis_node, keys[0]):
                break
            time.sleep(0.005)
        second: tuple[str, float] | None = None
        for _ in range(200):  # bounded: about 4 s
            v = take_many(direct, keys, windows)
            if v.outcome == "granted":
                second = (v.outcome, time.monotonic())
                break
            time.sleep(0.02)
        slow.stop()
        t.join(30)
    assert first and second
    starts = sorted(at for outcome, at in (first[0], second) if outcome == "granted")
    assert len(starts) < 2 or starts[1] - starts[0] >= windows[0].period - 0.05, starts


# -- SlowDown: a pause written into the rate logs (issue 33) --------------------------------------------------------


def _pause(nodes: NodeSet, keys: list[str], windows: list[Window], seconds: float) -> None:
    from celery_singleton_lock.lock.scripts import RATE_PAUSE  # noqa: PLC0415

    args: list[str | int] = ["p" * 32, round(seconds * 1_000_000)]
    for w in windows:
        args += [w.limit, w.window_us]
    nodes.run(RATE_PAUSE, keys, args)


def test_a_pause_refuses_every_start_of_its_logs_until_it_ends_and_other_keys_go_on(
    fresh_trio: list[RedisServer], name: str
) -> None:
    """lua/rate_pause.lua on two of three nodes (the third missed it: paused, down): every start of the paused key,
    one limit (rate.lua) or stacked (rate_stack.lua), is refused with the wait until the pause's end, longer than
    the window; another key goes on; after the pause, starts go on."""
    everyone = NodeSet([s.url for s in fresh_trio], socket_timeout=0.3)
    majority = NodeSet([fresh_trio[0].url, fresh_trio[1].url])
    one, stacked = Window(100, 0.5), [Window(100, 0.5), Window(1000, 60.0)]
    stack_keys = [f"{name}:s1", f"{name}:s2"]
    assert take(everyone, f"{name}:one", one).outcome == "granted"
    _pause(majority, [f"{name}:one"], [one], 1.5)
    _pause(majority, stack_keys[:1], stacked[:1], 1.5)  # only the named limit of the stacked call
    refused = take(everyone, f"{name}:one", one)
    assert refused.outcome == "limited" and 1.0 < refused.wait <= 1.5, refused
    refused = take_many(everyone, stack_keys, stacked)
    assert refused.outcome == "limited" and 1.0 < refused.wait <= 1.5, refused
    assert take(everyone, f"{name}:other", one).outcome == "granted"
    time.sleep(1.6)
    assert take(everyone, f"{name}:one", one).outcome == "granted"
    assert take_many(everyone, stack_keys, stacked).outcome == "granted"


def test_slow_down_reads_retry_after_seconds_and_http_dates() -> None:
    """SlowDown.from_retry_after: delay seconds, an HTTP-date (relative to now), the default when missing or
    unreadable, never below 0; SlowDown refuses a negative or odd pause in one line."""
    from celery_singleton_lock import SlowDown  # noqa: PLC0415

    assert SlowDown.from_retry_after("120").retry_after == 120.0
    now = 1445412480.0  # Wed, 21 Oct 2015 07:28:00 GMT
    assert SlowDown.from_retry_after("Wed, 21 Oct 2015 07:28:30 GMT", now=now).retry_after == 30.0
    assert SlowDown.from_retry_after("Wed, 21 Oct 2015 07:27:00 GMT", now=now).retry_after == 0.0
    assert SlowDown.from_retry_after(None, default=2.5).retry_after == 2.5
    assert SlowDown.from_retry_after("soon", default=3.0, limit="60/m").limit == "60/m"
    with pytest.raises(ValueError, match=r"^SlowDown\(retry_after=\) must be") as info:
        SlowDown(-1)
    assert "\n" not in str(info.value)
    assert SlowDown(2.0, 1).args == (2.0, 1)  # rebuilt by pickle as cls(*args)
    # Issue 33 attack, suspect 7: odd pauses are refused in one line in the body (the call fails with it, FAILURE:
    # nothing paused, nothing lost silently); a huge or infinite one is capped at 30 days; 0 pauses nothing.
    for bad in (float("nan"), "5", None, True, -0.1):
        with pytest.raises(ValueError, match=r"^SlowDown\(retry_after=\) must be"):
            SlowDown(bad)  # type: ignore[arg-type]
    assert SlowDown(float("inf")).retry_after == SlowDown(1e12).retry_after == 30 * 86400.0
    assert SlowDown(0).retry_after == 0.0
