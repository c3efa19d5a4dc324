"""Redlock on real redis-server processes: exclusion, expiry, fencing, quorum, faults, fork, secrets.

Shared servers (``redis_node``, ``redis_trio``) are never faulted; tests that stop, pause or restart a node use
the ``fresh_*`` fixtures. Critical sections record their entries and exits in Redis (on ``redis_node``, a server
the lock under test does not depend on when it runs on ``redis_trio``) and are checked afterwards. Every loop is
bounded in count and in time; the time bounds are generous correctness limits, not performance assertions.
"""

from __future__ import annotations

import contextlib
import itertools
import multiprocessing
import threading
import time
import traceback
from collections.abc import Iterator, Sequence

import pytest
import redis
from hypothesis import given, settings
from hypothesis import strategies as st
from redis.crc import key_slot

from celery_singleton_lock.errors import (
    ConfigurationError,
    LockError,
    LockNotAcquiredError,
    LockUnavailableError,
)
from celery_singleton_lock.lock import nodes as nodes_module
from celery_singleton_lock.lock.redlock import NodeSet, Redlock, done_key_for, fence_key_for, redact_url
from celery_singleton_lock.testing import RedisServer, free_port, wait_for

pytestmark = pytest.mark.timeout(90)  # a hung fan-out fails its test instead of stalling the run

SOCKET_TIMEOUT = 0.5
#: A frozen node is woken after this long, whatever happens: a client that does not apply our socket_timeout
#: would wait for it, and then find it answering (no TimeoutError); a bound on the wait, not a timing assertion.
WAKE_AFTER = SOCKET_TIMEOUT + 10


def urls_of(servers: Sequence[RedisServer]) -> list[str]:
    return [s.url for s in servers]


# Python 3.12+ warns when forking while any thread runs (e.g. another test's renewal watchdog) and warnings are errors
# here; the forked children below only build fresh locks, so the warning is accepted where we fork on purpose.
forks = pytest.mark.filterwarnings("ignore:.*multi-threaded.*fork:DeprecationWarning")


def holders(servers: Sequence[RedisServer], name: str) -> list[bytes | None]:
    """The lock key's value on each live server (None where it is absent)."""
    out: list[bytes | None] = []
    for server in servers:
        client = server.client(socket_timeout=2)
        try:
            out.append(client.hget(name, "owner"))
        finally:
            client.close()
    return out


def plant(server: RedisServer, name: str, owner: str, ms: int = 5000) -> None:
    """Write a holder record for ``owner`` straight into one node (as another contender would have)."""
    client = server.client()
    client.hset(name, mapping={"owner": owner, "fence": 0})
    client.pexpire(name, ms)


def counter(server: RedisServer, name: str) -> int:
    client = server.client(socket_timeout=2)
    try:
        return int(client.get(fence_key_for(name)) or 0)
    finally:
        client.close()


# -- contention workers (module level, so multiprocessing can run them) ------------------------------------------


def contend(urls: list[str], name: str, record_url: str, worker: int, rounds: int, budget: float) -> None:
    """Take the lock ``rounds`` times (or until ``budget`` s pass); record every critical section in Redis.

    Inside the section: INCR an ``inside`` counter (its value is logged: anything but 1 is an overlap), swap the
    last fencing token for ours (a token not greater than the previous holder's is logged as a violation).
    """
    rec = redis.Redis.from_url(record_url, socket_timeout=5)
    lock = Redlock(urls, name, ttl=10.0, socket_timeout=SOCKET_TIMEOUT)
    end = time.monotonic() + budget
    done = 0
    for _ in range(rounds * 200):
        if done >= rounds or time.monotonic() >= end:
            break
        if not lock.acquire(timeout=max(0.0, end - time.monotonic())):
            continue
        try:
            inside = rec.incr(f"{name}:inside")
            fence = lock.fencing_token
            previous = int(rec.set(f"{name}:last-fence", fence, get=True) or 0)
            rec.rpush(f"{name}:inside-log", inside)
            if fence <= previous:
                rec.rpush(f"{name}:fence-violations", f"{previous} then {fence}")
            time.sleep(0.002)
            rec.decr(f"{name}:inside")
        finally:
            lock.release()
        done += 1
    rec.hset(f"{name}:progress", str(worker), done)
    rec.close()


class Record:
    """What the contending workers wrote about lock ``name``."""

    def __init__(self, record: RedisServer, name: str) -> None:
        self.client = record.client(socket_timeout=5)
        self.name = name

    def entries(self) -> list[int]:
        return [int(x) for x in self.client.lrange(f"{self.name}:inside-log", 0, -1)]

    def progress(self) -> dict[str, int]:
        return {k.decode(): int(v) for k, v in self.client.hgetall(f"{self.name}:progress").items()}

    def violations(self) -> list[bytes]:
        return self.client.lrange(f"{self.name}:fence-violations", 0, -1)

    def check(self, workers: int) -> None:
        entries = self.entries()
        assert entries, "no critical section ran"
        assert max(entries) == 1, f"overlapping critical sections: {entries}"
        assert self.violations() == [], "fencing tokens went backwards"
        progress = self.progress()
        assert sorted(progress) == sorted(str(w) for w in range(workers)), progress
        assert all(n >= 1 for n in progress.values()), f"a worker never got the lock: {progress}"
        assert sum(progress.values()) == len(entries)


def run_threads(urls: list[str], name: str, record: RedisServer, workers: int, rounds: int, budget: float) -> None:
    threads = [
        threading.Thread(target=contend, args=(urls, name, record.url, w, rounds, budget), daemon=True)
        for w in range(workers)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(budget + 10)
    assert not any(t.is_alive() for t in threads), "a contending thread did not finish"


# -- 1. mutual exclusion ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("nodes", ["redis_node", "redis_trio"])
def test_threads_never_overlap(request: pytest.FixtureRequest, redis_node: RedisServer, nodes: str, name: str) -> None:
    """Eight threads contending for one name never overlap in the critical section, and each gets in."""
    servers = request.getfixturevalue(nodes)
    urls = urls_of(servers if isinstance(servers, list) else [servers])
    run_threads(urls, name, redis_node, workers=8, rounds=4, budget=30)
    Record(redis_node, name).check(workers=8)


@forks
@pytest.mark.parametrize("nodes", ["redis_node", "redis_trio"])
def test_processes_never_overlap(
    request: pytest.FixtureRequest, redis_node: RedisServer, nodes: str, name: str
) -> None:
    """Four processes contending for one name never overlap in the critical section, and each gets in."""
    servers = request.getfixturevalue(nodes)
    urls = urls_of(servers if isinstance(servers, list) else [servers])
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=contend, args=(urls, name, redis_node.url, w, 4, 30)) for w in range(4)]
    for p in procs:
        p.start()
    try:
        for p in procs:
            p.join(40)
        assert [p.exitcode for p in procs] == [0, 0, 0, 0]
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)
    Record(redis_node, name).check(workers=4)


# -- 2. expiry, extend, ownership ------------------------------------------------------------------------------


def test_lease_expires_when_holder_stops_extending(redis_node: RedisServer, name: str) -> None:
    """A holder that stops extending loses the lock after its ttl, and another instance takes it."""
    a = Redlock(redis_node.url, name, ttl=0.4)
    b = Redlock(redis_node.url, name, ttl=5)
    assert a.acquire(blocking=False)
    assert not b.acquire(blocking=False)
    assert b.contended
    assert b.held_by == a.token
    assert wait_for(lambda: b.acquire(blocking=False), timeout=3)
    assert not a.owned()
    assert holders([redis_node], name) == [b.token.encode()]
    assert b.release()


def test_extend_keeps_the_lock_past_its_ttl(redis_node: RedisServer, name: str) -> None:
    """Extending every 0.1 s keeps a 0.4 s lease for well past 0.4 s; nobody else gets it meanwhile."""
    a = Redlock(redis_node.url, name, ttl=0.4)
    b = Redlock(redis_node.url, name, ttl=5)
    assert a.acquire(blocking=False)
    start = time.monotonic()
    for _ in range(40):
        if time.monotonic() - start > 1.2:
            break
        time.sleep(0.1)
        assert a.extend()
        assert not b.acquire(blocking=False)
    assert time.monotonic() - start > 1.0
    assert a.owned()
    assert a.release()
    assert b.acquire(blocking=False)
    assert b.release()


def test_non_owner_cannot_extend_or_release(redis_trio: list[RedisServer], name: str) -> None:
    """Another instance with its own token can neither extend nor release a held lock, nor touch its keys."""
    urls = urls_of(redis_trio)
    a = Redlock(urls, name, ttl=5)
    b = Redlock(urls, name, ttl=5, token="someone-else")
    assert a.acquire(blocking=False)
    assert not b.acquire(blocking=False)
    assert not b.extend()
    assert not b.release()
    assert holders(redis_trio, name) == [a.token.encode()] * 3
    assert a.owned()
    assert a.release()


def test_expired_holder_never_releases_the_next_holders_lock(redis_trio: list[RedisServer], name: str) -> None:
    """A's lease expires, B acquires: A.release() and A.extend() return False and B still holds the lock."""
    urls = urls_of(redis_trio)
    a = Redlock(urls, name, ttl=0.3)
    b = Redlock(urls, name, ttl=5)
    assert a.acquire(blocking=False)
    a_token = a.token
    assert a_token is not None
    assert wait_for(lambda: b.acquire(blocking=False), timeout=3)
    assert a.release() is False
    assert a.extend() is False
    held = holders(redis_trio, name)
    # B needs a quorum; a node where A's 0.3 s lease had not yet expired at B's attempt refused B, and holds nothing
    # once A's key expires there: never A's token, on no node.
    assert held.count(b.token.encode()) >= 2, held
    assert a_token.encode() not in held, held
    assert b.owned()
    assert b.release()


# -- 3. fencing tokens -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("stop_midway", [False, True], ids=["all-up", "one-stopped-midway"])
def test_fencing_tokens_increase_under_contention(
    fresh_trio: list[RedisServer], redis_node: RedisServer, name: str, stop_midway: bool
) -> None:
    """Each holder's fencing token exceeds the previous holder's, also when a node stops mid-run."""
    urls = urls_of(fresh_trio)
    rec = Record(redis_node, name)
    threads = [
        threading.Thread(target=contend, args=(urls, name, redis_node.url, w, 6, 30), daemon=True) for w in range(6)
    ]
    for t in threads:
        t.start()
    at_stop = 0
    if stop_midway:
        assert wait_for(lambda: len(rec.entries()) >= 10, timeout=20, interval=0.01)
        fresh_trio[1].stop()
        at_stop = len(rec.entries())
    for t in threads:
        t.join(40)
    assert not any(t.is_alive() for t in threads)
    rec.check(workers=6)
    assert len(rec.entries()) > at_stop  # locks were also taken with the node down


@pytest.mark.parametrize(("high", "down"), list(itertools.permutations(range(3), 2)))
def test_fencing_token_survives_diverged_counters(
    fresh_trio: list[RedisServer], name: str, high: int, down: int
) -> None:
    """Counters left high on one node by failed attempts: a later quorum without that node still issues more."""
    urls = urls_of(fresh_trio)
    fresh_trio[high].client().set(fence_key_for(name), 100)  # as if failed attempts had reached only this node
    fresh_trio[down].stop()
    first = Redlock(urls, name, ttl=10)
    assert first.acquire(blocking=False), first.node_errors
    token = first.fencing_token
    assert token == 101
    assert first.release()
    fresh_trio[down].start()  # back empty; now the node that saw 101 is the one missing
    fresh_trio[high].stop()
    second = Redlock(urls, name, ttl=10)
    assert second.acquire(blocking=False), second.node_errors
    assert second.fencing_token > token
    assert second.release()


def test_fencing_tokens_increase_across_holders(redis_trio: list[RedisServer], name: str) -> None:
    """Successive holders of one name get strictly increasing fencing tokens; fencing=False gives 0."""
    urls = urls_of(redis_trio)
    tokens = []
    for _ in range(5):
        lock = Redlock(urls, name, ttl=5)
        assert lock.acquire(blocking=False)
        tokens.append(lock.fencing_token)
        assert lock.release()
    assert tokens == sorted(set(tokens))
    plain = Redlock(urls, name + ":plain", ttl=5, fencing=False)
    assert plain.acquire(blocking=False)
    assert plain.fencing_token == 0
    assert plain.release()
    assert [counter(s, name + ":plain") for s in redis_trio] == [0, 0, 0]
    with pytest.raises(LockError, match="never acquired"):
        _ = Redlock(urls, name, ttl=5).fencing_token


# -- 4. quorum ---------------------------------------------------------------------------------------------------


def test_one_of_three_down_still_acquires(fresh_trio: list[RedisServer], name: str) -> None:
    """With one of three nodes stopped, acquire, extend and release still succeed on the other two."""
    fresh_trio[2].stop()
    lock = Redlock(urls_of(fresh_trio), name, ttl=5, socket_timeout=SOCKET_TIMEOUT)
    assert lock.acquire(blocking=False)
    assert lock.extend()
    assert lock.owned()
    assert holders(fresh_trio[:2], name) == [lock.token.encode()] * 2
    assert lock.release()
    assert holders(fresh_trio[:2], name) == [None, None]


def test_two_of_three_down_fails_fast_and_leaves_nothing(fresh_trio: list[RedisServer], name: str) -> None:
    """With two of three nodes stopped, acquire returns False at once (they refuse connections: nothing to wait
    for), undoes its write, and says why."""
    fresh_trio[1].stop()
    fresh_trio[2].stop()
    urls = urls_of(fresh_trio)
    lock = Redlock(urls, name, ttl=5, socket_timeout=SOCKET_TIMEOUT)
    assert lock.acquire(blocking=False) is False
    assert all("ConnectionError" in e.error for e in lock.node_errors), lock.node_errors
    assert holders(fresh_trio[:1], name) == [None]
    assert lock.contended is False
    assert sorted(e.node for e in lock.node_errors) == sorted(NodeSet(urls).names[1:])
    with pytest.raises(LockUnavailableError) as info:
        with Redlock(urls, name, ttl=5, timeout=0.3, socket_timeout=SOCKET_TIMEOUT):
            pytest.fail("entered the lock without a quorum")
    err = info.value
    assert isinstance(err, LockNotAcquiredError)
    assert err.key == name
    assert len(err.node_errors) == 2
    assert all("ConnectionError" in e for e in err.node_errors)
    assert holders(fresh_trio[:1], name) == [None]


def test_contended_lock_raises_not_acquired_naming_the_holder(redis_trio: list[RedisServer], name: str) -> None:
    """`with` on a lock someone else holds raises LockNotAcquiredError (not Unavailable) naming the holder."""
    urls = urls_of(redis_trio)
    holder = Redlock(urls, name, ttl=5)
    assert holder.acquire(blocking=False)
    with pytest.raises(LockNotAcquiredError) as info:
        with Redlock(urls, name, ttl=5, timeout=0.2):
            pytest.fail("entered a held lock")
    assert not isinstance(info.value, LockUnavailableError)
    assert info.value.holder == holder.token
    assert holder.token in str(info.value)
    assert holder.release()


def _warm(servers: Sequence[RedisServer], name: str) -> None:
    """One acquire/release on every node, so the scripts are loaded and connections pooled before a fault."""
    lock = Redlock(urls_of(servers), name + ":warm", ttl=5, socket_timeout=SOCKET_TIMEOUT)
    assert lock.acquire(blocking=False)
    assert lock.release()


@contextlib.contextmanager
def frozen(server: RedisServer) -> Iterator[None]:
    """``server`` frozen (SIGSTOP) for the block, and woken (SIGCONT) at its end, or after WAKE_AFTER s if the block
    is still waiting on it then."""
    server.pause()
    waker = threading.Timer(WAKE_AFTER, server.resume)
    waker.start()
    try:
        yield
        assert server.paused and waker.is_alive(), f"the node was woken after {WAKE_AFTER} s: the client waited for it"
    finally:
        waker.cancel()
        server.resume()


def timed_out_on(lock: Redlock) -> list[str]:
    """The nodes the lock's last attempt gave up on at socket_timeout (a TimeoutError: the node was frozen)."""
    return [e.node for e in lock.node_errors if "TimeoutError" in e.error]


def test_one_paused_node_costs_at_most_the_socket_timeout(fresh_trio: list[RedisServer], name: str) -> None:
    """With one node frozen (SIGSTOP), acquire succeeds while it is still frozen (it gave up on that node at
    socket_timeout); the frozen node keeps nothing."""
    _warm(fresh_trio, name)
    with frozen(fresh_trio[2]):
        lock = Redlock(urls_of(fresh_trio), name, ttl=10, socket_timeout=SOCKET_TIMEOUT)
        assert lock.acquire(blocking=False)  # (a success records no node errors: the quorum answered)
    # The frozen node ran our SET when it woke up, then the undo queued right behind it on the same connection.
    assert wait_for(lambda: holders(fresh_trio[2:], name) == [None], timeout=3)
    assert holders(fresh_trio[:2], name) == [lock.token.encode()] * 2
    assert lock.release()


def test_two_paused_nodes_fail_in_bounded_time_and_leave_no_lease(fresh_trio: list[RedisServer], name: str) -> None:
    """With two nodes frozen, acquire returns False while they are still frozen (it gave up on each at
    socket_timeout); after SIGCONT no node holds it."""
    _warm(fresh_trio, name)
    with frozen(fresh_trio[1]), frozen(fresh_trio[2]):
        lock = Redlock(urls_of(fresh_trio), name, ttl=10, socket_timeout=SOCKET_TIMEOUT)
        assert lock.acquire(blocking=False) is False
        assert lock.contended is False
        assert timed_out_on(lock) == list(NodeSet(urls_of(fresh_trio)).names[1:])
        assert holders(fresh_trio[:1], name) == [None]
    assert wait_for(lambda: holders(fresh_trio, name) == [None, None, None], timeout=3)
    # The lock is free again: nothing lingers until the ttl.
    again = Redlock(urls_of(fresh_trio), name, ttl=5, socket_timeout=SOCKET_TIMEOUT)
    assert again.acquire(blocking=False)
    assert again.release()


def test_user_clients_without_socket_timeout_are_bounded_by_ours(fresh_trio: list[RedisServer], name: str) -> None:
    """redis.Redis clients passed in (socket_timeout=None) are given up on at our socket_timeout when frozen: the
    acquire succeeds while the node is still frozen."""
    clients = [s.client(socket_timeout=None) for s in fresh_trio]
    lock = Redlock(clients, name, ttl=10, socket_timeout=SOCKET_TIMEOUT)
    assert lock.acquire(blocking=False)
    assert lock.release()
    with frozen(fresh_trio[2]):
        assert lock.acquire(blocking=False)
    assert lock.release()


def test_five_nodes_tolerate_two_down(fresh_five: list[RedisServer], name: str) -> None:
    """With five nodes, two stopped still leave a quorum of three; a third stopped node takes it away."""
    urls = urls_of(fresh_five)
    fresh_five[0].stop()
    fresh_five[3].stop()
    lock = Redlock(urls, name, ttl=5, socket_timeout=SOCKET_TIMEOUT)
    assert lock.acquire(blocking=False)
    assert lock.nodes.quorum == 3
    assert lock.release()
    fresh_five[4].stop()
    assert lock.acquire(blocking=False) is False
    assert len(lock.node_errors) == 3
    assert holders([fresh_five[1], fresh_five[2]], name) == [None, None]


# -- 5. blocking acquire ---------------------------------------------------------------------------------------


def test_blocking_acquire_gets_the_lock_once_released(redis_trio: list[RedisServer], name: str) -> None:
    """A blocking acquire waits while another thread holds the lock and gets it soon after the release."""
    urls = urls_of(redis_trio)
    holder = Redlock(urls, name, ttl=10)
    assert holder.acquire(blocking=False)
    released = threading.Event()
    result: list[tuple[bool, bool]] = []

    def wait() -> None:
        waiter = Redlock(urls, name, ttl=10)
        got = waiter.acquire(blocking=True, timeout=10)
        result.append((got, released.is_set()))
        if got:
            waiter.release()

    t = threading.Thread(target=wait, daemon=True)
    t.start()
    time.sleep(0.3)
    assert result == []  # still waiting
    released.set()
    assert holder.release()
    t.join(10)
    assert not t.is_alive()
    assert result == [(True, True)]


def test_blocking_acquire_with_timeout_gives_up(redis_trio: list[RedisServer], name: str) -> None:
    """A blocking acquire on a held lock returns False after its timeout, not before, and while the holder still
    holds it (a waiter that ignored its timeout would wait for the 10 s lease to end, and then get the lock)."""
    urls = urls_of(redis_trio)
    holder = Redlock(urls, name, ttl=10)
    assert holder.acquire(blocking=False)
    waiter = Redlock(urls, name, ttl=10)
    start = time.monotonic()
    assert waiter.acquire(blocking=True, timeout=0.5) is False
    assert time.monotonic() - start >= 0.5
    assert holder.owned()
    assert waiter.held_by == holder.token
    assert holder.release()


# -- 6. fork safety ---------------------------------------------------------------------------------------------


def _child_probe(urls: list[str], held: str, free: str, out: multiprocessing.Queue) -> None:  # type: ignore[type-arg]
    taken = Redlock(urls, held, ttl=5).acquire(blocking=False)
    other = Redlock(urls, free, ttl=5)
    got = other.acquire(blocking=False)
    out.put((taken, got, other.release()))


@forks
def test_lock_survives_a_fork(redis_trio: list[RedisServer], name: str) -> None:
    """A forked child cannot take the parent's lock but can take another; the parent's lock still works after."""
    urls = urls_of(redis_trio)
    lock = Redlock(urls, name, ttl=10)
    assert lock.acquire(blocking=False)
    ctx = multiprocessing.get_context("fork")
    out = ctx.Queue()
    child = ctx.Process(target=_child_probe, args=(urls, name, name + ":other", out))
    child.start()
    try:
        assert out.get(timeout=15) == (False, True, True)
        child.join(15)
        assert child.exitcode == 0
    finally:
        if child.is_alive():
            child.kill()
            child.join(5)
    assert lock.owned()
    assert lock.extend()
    assert not Redlock(urls, name, ttl=5).acquire(blocking=False)
    assert lock.release()
    assert holders(redis_trio, name) == [None, None, None]


# -- 7. restarted nodes -----------------------------------------------------------------------------------------


def test_extend_repairs_a_restarted_node(fresh_trio: list[RedisServer], name: str) -> None:
    """After one of three nodes restarts empty, extend keeps the lock and puts the key and counter back there."""
    lock = Redlock(urls_of(fresh_trio), name, ttl=10, socket_timeout=SOCKET_TIMEOUT)
    assert lock.acquire(blocking=False)
    fresh_trio[1].restart()
    assert holders(fresh_trio[1:2], name) == [None]
    assert lock.extend()
    assert holders(fresh_trio, name) == [lock.token.encode()] * 3
    assert counter(fresh_trio[1], name) >= lock.fencing_token
    assert lock.release()
    assert holders(fresh_trio, name) == [None, None, None]


def test_extend_fails_after_the_only_node_restarts(fresh_node: RedisServer, name: str) -> None:
    """On one node, a restart (data lost) means the lock is lost: extend returns False and owned() is False."""
    lock = Redlock(fresh_node.url, name, ttl=10, socket_timeout=SOCKET_TIMEOUT)
    assert lock.acquire(blocking=False)
    fresh_node.restart()
    assert lock.extend() is False
    assert not lock.owned()
    assert lock.validity == 0.0
    assert lock.release() is False


# -- 8. secrets -------------------------------------------------------------------------------------------------

SECRETS = ("s3cret", "wr0ng-pw", "right-pw")


def _assert_no_secret(*texts: str) -> None:
    for text in texts:
        for secret in SECRETS:
            assert secret not in text, f"password {secret!r} leaked in {text!r}"


def test_passwords_never_appear_in_errors(redis_node: RedisServer, fresh_node: RedisServer, name: str) -> None:
    """A dead node's and a live node's wrong password never show in errors, node_errors or reprs."""
    fresh_node.client().config_set("requirepass", "right-pw")
    urls = [
        redis_node.url,
        f"redis://:s3cret@127.0.0.1:{free_port()}/0",
        f"redis://:wr0ng-pw@127.0.0.1:{fresh_node.port}/0",
    ]
    lock = Redlock(urls, name, ttl=5, socket_timeout=SOCKET_TIMEOUT)
    assert lock.acquire(blocking=False) is False
    assert len(lock.node_errors) == 2
    assert "ConnectionError" in lock.node_errors[0].error
    assert "Authentication" in lock.node_errors[1].error or "WRONGPASS" in lock.node_errors[1].error
    with pytest.raises(LockUnavailableError) as info:
        with Redlock(urls, name, ttl=5, timeout=0.2, socket_timeout=SOCKET_TIMEOUT):
            pytest.fail("entered without a quorum")
    err = info.value
    _assert_no_secret(
        str(lock.nodes),
        repr(lock.nodes),
        repr(lock),
        *map(str, lock.node_errors),
        *map(repr, lock.node_errors),
        str(err),
        repr(err),
        repr(err.args),
        "".join(traceback.format_exception(err)),
    )
    assert holders([redis_node], name) == [None]


@pytest.mark.parametrize(
    ("url", "says"),
    [
        ("http://user:s3cret@127.0.0.1:6379/0", "redis://"),
        ("", "redis://"),
        ("redis://:s3cret@127.0.0.1:notaport/0", "Port"),
        ("redis://:s3cret@127.0.0.1:99999/0", "Port"),
        ("redis://:s3cret@[::1/0", "invalid Redis URL"),
        ("http://127.0.0.1:6379/0?password=s3cret", "redis://"),
    ],
)
def test_invalid_urls_raise_configuration_error_without_the_password(url: str, says: str, name: str) -> None:
    """A URL that is not a usable Redis URL raises ConfigurationError saying what to do, password redacted."""
    with pytest.raises(ConfigurationError) as info:
        Redlock([url], name)
    assert says in str(info.value)
    _assert_no_secret(str(info.value), repr(info.value), "".join(traceback.format_exception(info.value)))


def test_duplicate_nodes_are_refused(redis_node: RedisServer, name: str) -> None:
    """The same node listed twice is a ConfigurationError saying the nodes must be independent, no password."""
    url = f"redis://:s3cret@127.0.0.1:{redis_node.port}/0"
    with pytest.raises(ConfigurationError, match=r"listed twice.*independent") as info:
        Redlock([url, url], name)
    _assert_no_secret(str(info.value))
    with pytest.raises(ConfigurationError, match="at least one Redis node"):
        Redlock([], name)


def test_a_url_list_is_parsed_once_per_process_and_its_cache_shows_no_password(fresh_node: RedisServer) -> None:
    """NodeSets built from one URL list share one parse (same clients, names and flags, each its own object), an
    invalid URL is refused every time, and no cache key's repr shows the URL's password."""
    fresh_node.client().config_set("requirepass", "s3cret")
    url = f"redis://:s3cret@127.0.0.1:{fresh_node.port}/0"
    first, second = NodeSet(url), NodeSet([url])
    assert first is not second
    assert first.clients == second.clients  # built once: the same client objects
    assert (first.names, first.peers, first.quorum) == (second.names, second.peers, second.quorum)
    assert NodeSet(url, socket_timeout=0.25).socket_timeout == 0.25  # the options are part of the key
    for _ in range(2):
        with pytest.raises(ConfigurationError, match="Port"):
            NodeSet(f"redis://:s3cret@127.0.0.1:{fresh_node.port}0000/0")
    lock = Redlock(url, "cache:k", ttl=5, socket_timeout=SOCKET_TIMEOUT)
    assert lock.acquire(blocking=False), lock.node_errors
    assert lock.release()
    _assert_no_secret(repr(list(nodes_module._built)), repr(list(nodes_module._clients)))


def test_redact_url_never_raises_and_hides_the_password() -> None:
    """redact_url masks the password in any URL, even one with a bad port or an IPv6 host, and never raises."""
    assert redact_url("redis://:s3cret@127.0.0.1:6379/0") == "redis://:***@127.0.0.1:6379/0"
    assert redact_url("redis://u:s3cret@[::1]:6379/0") == "redis://u:***@[::1]:6379/0"
    assert redact_url("redis://127.0.0.1:6379/0") == "redis://127.0.0.1:6379/0"
    for url in ("redis://:s3cret@h:notaport/0", "redis://:s3cret@h:99999/0", "redis://h/0?password=s3cret"):
        _assert_no_secret(redact_url(url))


# -- 9. ACL users and unix sockets ------------------------------------------------------------------------------


def test_acl_user_url(fresh_node: RedisServer, name: str) -> None:
    """A URL naming an ACL user and password locks as that user; the password never shows in the node names."""
    admin = fresh_node.client()
    admin.acl_setuser("locker", enabled=True, passwords=["+s3cret"], keys=["*"], categories=["+@all"])
    admin.acl_setuser("default", enabled=False)  # so nothing works without the URL's credentials
    url = f"redis://locker:s3cret@127.0.0.1:{fresh_node.port}/0"
    lock = Redlock(url, name, ttl=5, socket_timeout=SOCKET_TIMEOUT)
    assert lock.acquire(blocking=False), lock.node_errors
    assert lock.fencing_token == 1
    as_locker = redis.Redis.from_url(url)
    assert as_locker.hget(name, "owner") == lock.token.encode()
    assert lock.release()
    assert as_locker.exists(name) == 0
    anonymous = Redlock(fresh_node.url, name, ttl=5, socket_timeout=SOCKET_TIMEOUT)
    assert anonymous.acquire(blocking=False) is False
    assert anonymous.node_errors
    _assert_no_secret(repr(lock.nodes))


def test_unix_socket_url(name: str) -> None:
    """A unix:// URL works as a node, alone and next to TCP nodes."""
    with RedisServer(unixsocket=True) as unix, RedisServer() as tcp1, RedisServer() as tcp2:
        lock = Redlock(unix.unix_url, name, ttl=5, socket_timeout=SOCKET_TIMEOUT)
        assert lock.nodes.names == (f"unix://{unix.unixsocket}",)
        assert lock.acquire(blocking=False), lock.node_errors
        assert holders([unix], name) == [lock.token.encode()]
        assert lock.extend()
        assert lock.release()
        mixed = Redlock([unix.unix_url, tcp1.url, tcp2.url], name, ttl=5, socket_timeout=SOCKET_TIMEOUT)
        assert mixed.acquire(blocking=False), mixed.node_errors
        assert holders([unix, tcp1, tcp2], name) == [mixed.token.encode()] * 3
        assert mixed.release()


# -- 10. Redis Cluster hash tags ---------------------------------------------------------------------------------

_tricky = st.text(alphabet=st.sampled_from("ab:{}") | st.characters(blacklist_categories=("Cs",)), min_size=1)


@settings(max_examples=300, deadline=None)
@given(_tricky)
def test_fence_key_shares_the_lock_keys_cluster_slot(key: str) -> None:
    """For any lock name, the fencing counter's key hashes to the same Redis Cluster slot and differs from it."""
    fence = fence_key_for(key)
    assert fence != key
    assert key_slot(fence.encode()) == key_slot(key.encode())


def test_fence_key_keeps_an_existing_hash_tag() -> None:
    """A name with a hash tag keeps it (so a prefix's tag groups locks); one without becomes the tag."""
    assert fence_key_for("locks:{tenant1}:job") == "locks:{tenant1}:job:fence"
    assert fence_key_for("plain") == "{plain}:fence"


def test_split_vote_is_not_contention(redis_trio: list[RedisServer], name: str) -> None:
    """Nodes held by two different contenders, none with a quorum: the attempt fails as a split vote, not as
    'held by someone else', so a LockedTask retries instead of skipping every contender."""
    plant(redis_trio[0], name, "contender-a")
    plant(redis_trio[1], name, "contender-b")
    lock = Redlock([s.url for s in redis_trio], name, ttl=5.0)
    assert not lock.acquire(blocking=False)
    assert lock.split
    assert not lock.contended
    assert redis_trio[2].client().exists(name) == 0  # our yes on the third node was undone
    plant(redis_trio[1], name, "contender-a")
    assert not lock.acquire(blocking=False)
    assert lock.contended
    assert not lock.split
    assert lock.held_by == "contender-a"


@pytest.mark.parametrize("limit", [1, 2])
def test_finish_marks_the_current_job_done_when_job_was_set_after_construction(
    redis_node: RedisServer, name: str, limit: int
) -> None:
    """``job`` is a public attribute: a lock built without one and given one later must still write its done marker
    to ``done_key_for(name, job)``, never over the fencing counter or another holder's slot (review of 332d47f: the
    marker went to the constructor's last key)."""
    client = redis.Redis.from_url(redis_node.url)
    lock = Redlock(redis_node.url, name, ttl=10.0, limit=limit)
    other = Redlock(redis_node.url, name, ttl=10.0, limit=limit)
    assert lock.acquire(blocking=False)
    token = lock.fencing_token
    if limit > 1:
        assert other.acquire(blocking=False)  # the other slot
    lock.job = "task-1"
    assert lock.finish(done_for=5.0, waited_for=5.0)
    assert client.exists(done_key_for(name, "task-1"))
    assert client.ttl(fence_key_for(name)) == -1  # the counter never expires
    if limit > 1:
        assert other.extend()  # its slot is still its own
        other.release()
    after = Redlock(redis_node.url, name, ttl=10.0, limit=limit)
    assert after.acquire(blocking=False)
    assert after.fencing_token > token
    after.release()


@pytest.mark.parametrize(
    ("job", "worker"),
    [("job-1", "1@host"), ("jöb:12:ü", "wörker ✓ 3:x"), ("5:abcde", "")],
    ids=["ascii", "any-characters", "looks-prefixed"],
)
def test_a_refusal_reads_the_holder_s_record_back_exactly(redis_node: RedisServer, job: str, worker: str) -> None:
    """A refused acquire's answer holds the holder's fields as ``<length>:<value>`` (lengths in bytes): read as text
    when it is all ASCII, byte by byte otherwise; either way each value comes back as written (an empty one: absent)."""
    name = f"refusal-record-{job.encode().hex()}"
    record = {"state": "run", "worker": worker, "try": "0"}
    holder = Redlock([redis_node.url], name, ttl=10, job=job, record=record)
    assert holder.acquire(blocking=False)
    try:
        other = Redlock([redis_node.url], name, ttl=10, job="another")
        assert not other.acquire(blocking=False)
        assert other.held_by == holder.token
        expected = {"job": job, "state": "run", "try": "0", **({"worker": worker} if worker else {})}
        assert other.holder_record is not None
        assert {k: v for k, v in other.holder_record.items() if k != "owner"} == expected
    finally:
        holder.release()
