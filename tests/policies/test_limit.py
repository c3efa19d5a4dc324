"""``Redlock(limit=N)``: up to N holders of one name, on real redis-server processes (1 node and 3 nodes).

The slots are N holder records tried in one script call per node; the tests check the count (never more than N
holders, also with a node that disagrees and under contention through the fault proxy), the per-job rule (one job
never holds two slots), and that renewal, expiry, hand-over and the done marker work per slot as for a plain lock.
Every loop is bounded in count and in time.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Sequence

import pytest
from celery import Celery
from celery.bootsteps import Blueprint
from hypothesis import given
from hypothesis import strategies as st
from redis.crc import key_slot

from celery_singleton_lock import LockedTask
from celery_singleton_lock.errors import ConfigurationError
from celery_singleton_lock.lock.redlock import Redlock, done_key_for, fence_key_for, slot_keys
from celery_singleton_lock.task._startup import SettingsStep as _SettingsStep
from celery_singleton_lock.task._startup import StartError as _StartError
from celery_singleton_lock.testing import RedisServer, wait_for
from celery_singleton_lock.testing.faults import FaultProxy

pytestmark = pytest.mark.timeout(120)


def urls_of(servers: Sequence[RedisServer]) -> list[str]:
    return [s.url for s in servers]


@pytest.fixture(params=["one", "three"])
def nodes(request: pytest.FixtureRequest, redis_node: RedisServer, redis_trio: list[RedisServer]) -> list[str]:
    return [redis_node.url] if request.param == "one" else urls_of(redis_trio)


def test_limit_must_be_a_whole_number_at_least_one(redis_node: RedisServer) -> None:
    for bad in (0, -1, 1.5, True, "2"):
        with pytest.raises(ConfigurationError, match="limit must be a whole number >= 1"):
            Redlock(redis_node.url, "x", limit=bad)  # type: ignore[arg-type]


def test_up_to_n_holders_then_refused_and_a_release_frees_a_slot(nodes: list[str], name: str) -> None:
    locks = [Redlock(nodes, name, ttl=10, limit=3, record={"who": str(i)}) for i in range(4)]
    assert [lock.acquire(blocking=False) for lock in locks[:3]] == [True, True, True]
    assert sorted(lock.slot for lock in locks[:3]) == [0, 1, 2]
    assert len({lock.key for lock in locks[:3]}) == 3
    assert locks[0].locked()
    assert sorted(r["who"] for r in locks[0].holders()) == ["0", "1", "2"]
    fourth = locks[3]
    assert not fourth.acquire(blocking=False)
    assert fourth.contended and not fourth.split
    assert fourth.held_by in {lock.token for lock in locks[:3]}
    # fencing tokens grow across the slots of one name (one counter)
    fences = [lock.fencing_token for lock in locks[:3]]
    assert len(set(fences)) == 3
    freed = locks[1].slot
    assert locks[1].release()
    assert not locks[0].locked()
    assert fourth.acquire(blocking=False)
    assert fourth.slot == freed
    assert fourth.fencing_token > max(fences)
    for lock in (locks[0], locks[2], fourth):
        assert lock.release()
    assert locks[0].holders() == []


def test_limit_one_is_the_plain_lock(redis_node: RedisServer, name: str) -> None:
    a, b = Redlock(redis_node.url, name, limit=1), Redlock(redis_node.url, name)
    assert a.acquire(blocking=False)
    assert a.key == name and a.slot == 0
    assert not b.acquire(blocking=False) and b.held_by == a.token
    client = redis_node.client()
    assert client.keys(name + "*") == [name.encode()]
    assert a.release()


def test_one_job_never_holds_two_slots(nodes: list[str], name: str) -> None:
    first = Redlock(nodes, name, limit=3, job="job-1")
    assert first.acquire(blocking=False)
    other = Redlock(nodes, name, limit=3, job="job-2")
    assert other.acquire(blocking=False)  # a different job: a free slot
    again = Redlock(nodes, name, limit=3, job="job-1")
    assert not again.acquire(blocking=False)  # two slots are free, but job-1 holds one: refused by itself
    assert again.contended and again.held_by == first.token
    assert (again.holder_record or {}).get("job") == "job-1"
    assert first.holder() is not None and first.holder().get("waiting") == "1"  # type: ignore[union-attr]
    assert first.release() and other.release()


def test_a_hand_over_is_taken_over_on_its_own_slot(nodes: list[str], name: str) -> None:
    blocker = Redlock(nodes, name, limit=2, job="other")
    assert blocker.acquire(blocking=False)
    run = Redlock(nodes, name, limit=2, job="job-1")
    assert run.acquire(blocking=False)
    slot = run.slot
    assert run.transfer(10, {"state": "retry", "open": "1"})
    retry = Redlock(nodes, name, limit=2, job="job-1")
    assert not retry.acquire(blocking=False)  # the hand-over is the job's own: refused, not marked waiting
    assert (retry.holder_record or {}).get("state") == "retry"
    retry.replaces = retry.held_by
    assert retry.acquire(blocking=False)
    assert retry.slot == slot
    assert retry.release() and blocker.release()
    assert not run.release()  # the hand-over was taken over: nothing of the first run's is left to release


def test_the_done_marker_is_the_jobs_whatever_slot_it_ran_on(nodes: list[str], name: str) -> None:
    blocker = Redlock(nodes, name, limit=2, job="other")
    assert blocker.acquire(blocking=False)
    run = Redlock(nodes, name, limit=2, job="job-1")
    assert run.acquire(blocking=False) and run.slot == 1
    assert run.finish(done_for=10, waited_for=10)
    assert blocker.release()
    late = Redlock(nodes, name, limit=2, job="job-1")
    assert not late.acquire(blocking=False) and late.done
    assert not Redlock(nodes, name, limit=2).locked()
    # the marker lives where a plain lock's does: one per (name, job), not per slot
    assert done_key_for(name, "job-1") == done_key_for(late.name, "job-1")


def test_renewal_keeps_a_slot_and_a_dead_holder_frees_it_within_the_ttl(nodes: list[str], name: str) -> None:
    kept = Redlock(nodes, name, ttl=0.6, limit=2)
    dead = Redlock(nodes, name, ttl=0.6, limit=2)
    assert kept.acquire(blocking=False) and dead.acquire(blocking=False)
    newcomer = Redlock(nodes, name, ttl=5, limit=2)
    deadline = time.monotonic() + 5
    acquired = False
    while time.monotonic() < deadline and not acquired:  # bounded: 5 s, the dead lease ends in 0.6 s
        assert kept.extend()
        acquired = newcomer.acquire(blocking=False)
        time.sleep(0.1)
    assert acquired and newcomer.slot == dead.slot
    assert kept.owned() and not dead.owned()
    assert not dead.extend()
    kept.release()
    newcomer.release()


def test_a_node_that_lost_its_slots_does_not_break_the_count(redis_trio: list[RedisServer], name: str) -> None:
    """Node 3 forgot slot 0 (restarted empty): it grants slot 0 while nodes 1-2 grant slot 1; slot 1 wins."""
    urls = urls_of(redis_trio)
    first = Redlock(urls, name, limit=3)
    assert first.acquire(blocking=False) and first.slot == 0
    client = redis_trio[2].client()
    client.delete(name)
    second = Redlock(urls, name, limit=3)
    assert second.acquire(blocking=False)
    assert second.slot == 1
    # the stray grant of slot 0 on node 3 was undone
    assert client.exists(name) == 0
    assert {r.get("owner") for r in first.holders()} == {first.token, second.token}
    first.release()
    second.release()


def test_a_limit_full_on_a_quorum_is_held_even_when_nodes_name_different_holders(
    redis_trio: list[RedisServer], name: str
) -> None:
    urls = urls_of(redis_trio)
    a = Redlock(urls, name, limit=2)
    b = Redlock(urls, name, limit=2)
    assert a.acquire(blocking=False) and b.acquire(blocking=False)
    # On node 3 swap the two slots' records: each node still has both slots busy, but names another lowest holder.
    client = redis_trio[2].client()
    keys = slot_keys(name, 2)
    records = [client.hgetall(k) for k in keys]
    for k, record in zip(keys, reversed(records), strict=True):
        client.delete(k)
        client.hset(k, mapping=record)
        client.pexpire(k, 10_000)
    c = Redlock(urls, name, limit=2)
    assert not c.acquire(blocking=False)
    assert c.contended and not c.split  # full: a duplicate, not a split vote to retry
    a.release()
    b.release()
    for k in keys:
        client.delete(k)


def test_contenders_splitting_the_last_free_slot_is_a_split_vote_not_the_limit(
    redis_trio: list[RedisServer], name: str
) -> None:
    """Review finding: limit 2, a holder on slot 0 everywhere, and the free slot 1 taken on node 1 by one contender
    and on node 2 by another (arrived together): nobody holds slot 1 on a quorum. A third attempt, refused by nodes 1
    and 2, was called "at the limit" (a duplicate: skipped by LockedTask) while a slot was free; it is a split."""
    urls = urls_of(redis_trio)
    holder = Redlock(urls, name, ttl=30, limit=2)
    assert holder.acquire(blocking=False)
    slot1 = slot_keys(name, 2)[1]
    for server, owner in zip(redis_trio[:2], ("contender-x", "contender-y"), strict=True):
        client = server.client()
        client.hset(slot1, mapping={"owner": owner, "fence": "0"})
        client.pexpire(slot1, 5_000)
    lock = Redlock(urls, name, ttl=30, limit=2)
    assert not lock.acquire(blocking=False)
    assert lock.split and not lock.contended
    # the same nodes with one contender holding slot 1 on a quorum: the limit is reached
    for server in redis_trio[:2]:
        server.client().hset(slot1, "owner", "contender-x")
    again = Redlock(urls, name, ttl=30, limit=2)
    assert not again.acquire(blocking=False)
    assert again.contended and not again.split
    holder.release()
    for server in redis_trio:
        server.client().delete(slot1)


@pytest.mark.parametrize("stale", [True, False])
def test_a_limit_reached_on_quorums_that_differ_per_slot_is_held_not_a_split(
    redis_trio: list[RedisServer], name: str, stale: bool
) -> None:
    """Second review finding: A holds slot 0 on nodes 1-2, B slot 1 on nodes 2-3 (node 1 was out of B's reach), and
    node 3's slot 0 is busy with a stale lease (``stale``) or free. The limit is reached, yet node 1 (slot 1 free)
    and node 3 (slot 0 free, unless stale) grant: counting only the refusing nodes' owners called it a split, and
    LockedTask re-sent the duplicate every 0.05-0.5 s instead of skipping it. Grants now report the slots' owners."""
    n1, n2, n3 = urls_of(redis_trio)
    d = Redlock([n3], name, ttl=30, limit=2, job="D")
    assert d.acquire(blocking=False)
    a = Redlock([n1, n2], name, ttl=30, limit=2, job="A")
    b = Redlock([n2, n3], name, ttl=30, limit=2, job="B")
    assert a.acquire(blocking=False) and a.slot == 0
    assert b.acquire(blocking=False) and b.slot == 1
    if not stale:
        assert d.release()
    c = Redlock([n1, n2, n3], name, ttl=30, limit=2, job="C")
    assert not c.acquire(blocking=False)
    assert c.contended and not c.split
    for server in redis_trio:
        server.client().delete(*slot_keys(name, 2))


def test_instances_with_different_limits_admit_up_to_the_larger_one(redis_node: RedisServer, name: str) -> None:
    """docs/guarantees.md says of changing N: the slots are 0..N-1 of each instance's own N, so a limit-2 and a limit-3
    instance on one name admit up to 3 at once, a plain lock sees slot 0 only, and a limit-2 instance's view stops
    at its two slots."""
    url = redis_node.url
    twos = [Redlock(url, name, ttl=10, limit=2) for _ in range(3)]
    three = Redlock(url, name, ttl=10, limit=3)
    plain = Redlock(url, name, ttl=10)
    assert twos[0].acquire(blocking=False) and twos[1].acquire(blocking=False)
    assert not twos[2].acquire(blocking=False) and twos[2].contended
    assert not plain.acquire(blocking=False)  # slot 0 is busy
    assert three.acquire(blocking=False) and three.slot == 2
    assert len(twos[0].holders()) == 2
    assert len(three.holders()) == 3
    for lock in (*twos[:2], three):
        lock.release()


def test_with_a_limit_a_later_acquisition_gets_a_larger_fencing_token(nodes: list[str], name: str) -> None:
    """Tokens order successive holders whatever slot each got: one that starts after another ended is larger."""
    seen: list[int] = []
    a = Redlock(nodes, name, ttl=10, limit=2)
    b = Redlock(nodes, name, ttl=10, limit=2)
    for _ in range(3):
        assert a.acquire(blocking=False) and b.acquire(blocking=False)
        seen += sorted((a.fencing_token, b.fencing_token))
        slots = (a.slot, b.slot)
        a.release()
        b.release()
        assert (a.slot, b.slot) == slots  # the last lease's slot, as the docstrings say
    assert all(later > earlier for earlier, later in itertools.pairwise(seen)), seen


@given(st.text(min_size=1, max_size=40), st.integers(min_value=2, max_value=6))
def test_slot_keys_hash_to_the_names_cluster_slot(name: str, limit: int) -> None:
    keys = slot_keys(name, limit)
    assert len(keys) == limit == len(set(keys))
    assert keys[0] == name
    slot = key_slot(name.encode("utf-8", "surrogatepass"))
    for key in (*keys, fence_key_for(name), done_key_for(name, "j")):
        assert key_slot(key.encode("utf-8", "surrogatepass")) == slot
    if "{" not in name:
        assert all(k.startswith(name) for k in keys)  # found by a SCAN of the prefix


def test_never_more_than_n_holders_under_contention_and_late_packets(
    redis_node: RedisServer, fresh_trio: list[RedisServer], name: str
) -> None:
    """8 threads x 3 nodes (one behind a proxy delaying every reply 0-30 ms): at most 3 hold at any moment.

    Each holder records entry and exit (monotonic, one process) only while its lease is valid by its own clock;
    the check counts overlapping [enter, exit] windows. Bounded: 4 s of contention.
    """
    limit = 3
    with FaultProxy(fresh_trio[2].port) as proxy:
        proxy.delay(0.0, jitter=0.03)
        urls = [fresh_trio[0].url, fresh_trio[1].url, proxy.url]
        windows: list[tuple[float, float]] = []
        guard = threading.Lock()
        errors: list[BaseException] = []
        stop = time.monotonic() + 4.0

        def worker() -> None:
            try:
                for _ in range(400):  # bounded in count and in time
                    if time.monotonic() > stop:
                        return
                    lock = Redlock(urls, name, ttl=1.0, limit=limit, socket_timeout=0.5)
                    if not lock.acquire(blocking=False):
                        time.sleep(0.002)
                        continue
                    enter = time.monotonic()
                    time.sleep(0.01)
                    leave = time.monotonic()
                    if lock.validity > 0 and leave < enter + lock.validity + 0.01:
                        with guard:
                            windows.append((enter, leave))
                    lock.release()
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=worker) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(20)
    assert not errors
    assert len(windows) > 50, len(windows)
    events = sorted([(e, 1) for e, _ in windows] + [(x, -1) for _, x in windows], key=lambda p: (p[0], p[1]))
    current = peak = 0
    for _, step in events:
        current += step
        peak = max(peak, current)
    assert peak <= limit
    assert peak == limit  # the limit is used, not only respected
    assert wait_for(lambda: not Redlock(urls_of(fresh_trio), name, limit=limit).holders(), timeout=3)


def _noop() -> None: ...


def _register(app: Celery, name: str, options: dict[str, object]) -> object:
    """Register a task and bind it (binding checks the options)."""
    app.task(base=LockedTask, shared=False, name=name, **options)(_noop)
    return app.tasks[name]


def test_lock_limit_options_are_checked_with_one_clear_line(redis_node: RedisServer) -> None:
    """Bad combinations are refused at registration; a settings-level 'replace' stops the worker at start."""
    app = Celery("limit_checks", broker=redis_node.url, set_as_current=False)
    app.conf.singleton_lock_urls = [redis_node.url]
    cases = [
        ({"lock_limit": 0}, "lock_limit of .* must be a whole number >= 1"),
        ({"lock_limit": 2.5}, "lock_limit of .* must be a whole number >= 1"),
        ({"lock_limit": 2, "lock_scope": "queue"}, "works with lock_scope='run' only"),
        ({"lock_limit": 2, "lock_enqueue_check": True}, "cannot be used with lock_enqueue_check"),
    ]
    for i, (options, message) in enumerate(cases):
        with pytest.raises(ConfigurationError, match=message):
            _register(app, f"bad{i}", options)
    app = Celery("limit_settings", broker=redis_node.url, set_as_current=False)
    app.conf.singleton_lock_urls = [redis_node.url]
    app.conf.singleton_lock_on_duplicate = "replace"

    @app.task(base=LockedTask, shared=False, name="limited", lock_limit=2)
    def limited() -> None: ...

    class Worker:
        pass

    worker = Worker()
    worker.app = app  # type: ignore[attr-defined]
    with pytest.raises(_StartError, match="lock_limit of limited cannot be used with lock_on_duplicate='replace'"):
        _SettingsStep(worker, blueprint=Blueprint())
