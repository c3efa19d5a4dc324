"""Lock histories under faults, checked; and regression tests for late packets (acquire, undo, extend, release).

Every lock node here sits behind a FaultProxy, so a test can slow, hold back, drop or cut the traffic of one node
and deliver a command late, after its client gave up on it: a late packet. The history tests run many clients
(threads, and two subprocesses: CLOCK_MONOTONIC is system-wide on Linux) while a FaultInjector breaks proxies and
SIGSTOPs nodes at random; every acquisition is recorded as its client saw it and checked afterwards
(``check_history``: no two holders of one name at once, fencing tokens growing in acquisition order).
``CSL_SOAK_SECONDS`` sets how long each history runs (default 8 s), ``CSL_SOAK_SEED`` picks another random
schedule (the seed is printed with the summary).

The regression tests build one schedule each, deterministically: the proxy holds a node's bytes until the test
releases them. They read the nodes directly and accept either key layout (a plain string or a holder-record hash).
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import threading
import time
import traceback
import uuid
from collections.abc import Iterator, Sequence

import pytest

from celery_singleton_lock.lock.redlock import Redlock
from celery_singleton_lock.testing import RedisServer, wait_for
from celery_singleton_lock.testing.faults import Fault, FaultProxy
from celery_singleton_lock.testing.history import Acquisition, FaultInjector, History, check_history, run_lock_client

SOAK_SECONDS = float(os.environ.get("CSL_SOAK_SECONDS", "8"))
SOAK_SEED = int(os.environ.get("CSL_SOAK_SEED", "0"))  # another schedule of faults and client choices
ST = 0.3  # socket timeout of the locks in the regression tests: a held node times out after it


@contextlib.contextmanager
def proxies_for(servers: Sequence[RedisServer]) -> Iterator[list[FaultProxy]]:
    """One FaultProxy per server, all stopped on exit."""
    with contextlib.ExitStack() as stack:
        yield [stack.enter_context(FaultProxy(s.port)) for s in servers]


def owner_on(server: RedisServer, name: str) -> str | None:
    """The owner token the node holds for ``name`` (a plain string value, or a holder record's ``owner``)."""
    c = server.client(socket_timeout=5)
    try:
        kind = c.type(name)
        value = c.hget(name, "owner") if kind == b"hash" else c.get(name) if kind == b"string" else None
        return value.decode() if value is not None else None
    finally:
        c.close()


def pttl_on(server: RedisServer, name: str) -> int:
    c = server.client(socket_timeout=5)
    try:
        return int(c.pttl(name))
    finally:
        c.close()


def warm(urls: list[str]) -> None:
    """Load the lock scripts on every node and leave an idle connection to each (a late command then runs)."""
    lock = Redlock(urls, f"warm:{uuid.uuid4().hex}", ttl=5.0, socket_timeout=ST)
    assert lock.acquire(blocking=False)
    assert lock.extend()
    lock.release()


def stolen(urls: list[str], name: str) -> bool:
    """True when a new client can acquire ``name`` now (its lease is given back at once)."""
    other = Redlock(urls, name, ttl=5.0, socket_timeout=ST)
    try:
        return other.acquire(blocking=False)
    finally:
        other.release()


def held_bytes(holds: Sequence[Fault]) -> bool:
    return all(h.bytes > 0 for h in holds)


def assert_holds(
    holder: Redlock, servers: Sequence[RedisServer], urls: list[str], name: str, won: Sequence[bool] | None = None
) -> None:
    """``holder`` still holds ``name`` on every node it won (``won``: per node, read right after its acquire; every
    node when not given), on a majority at least, and nobody else can take it."""
    owners = [owner_on(s, name) for s in servers]
    expected = [holder.token if w else owners[i] for i, w in enumerate(won or [True] * len(servers))]
    majority = sum(o == holder.token for o in owners) > len(servers) // 2
    taken = stolen(urls, name)
    assert not taken and majority and owners == expected, (
        f"the holder (token {holder.token!r}, believes it holds for {holder.validity:.2f} s more) lost its key: "
        f"node owners {owners}; another client acquired too: {taken}"
    )


# -- the checker itself -------------------------------------------------------------------------------------------


def acq(name: str, fence: int, acquired: float, end: float, start: float | None = None) -> Acquisition:
    return Acquisition(name, f"owner-{fence}-{acquired}", fence, acquired if start is None else start, acquired, end)


def brute_force(items: Sequence[Acquisition]) -> tuple[bool, bool]:
    """(any overlap, any fencing inversion) by comparing every pair."""
    overlap = inverted = False
    for a in items:
        for b in items:
            if a is b or a.name != b.name:
                continue
            if a.acquired <= b.acquired < a.end:
                overlap = True
            if a.acquired < b.acquired and b.fence <= a.fence:
                inverted = True
    return overlap, inverted


def test_check_history_accepts_a_clean_history() -> None:
    """Disjoint intervals with growing tokens per name pass; other names are independent."""
    report = check_history(
        [acq("a", 1, 0.0, 1.0), acq("a", 2, 1.0, 2.0), acq("a", 5, 2.5, 3.0, start=0.1), acq("b", 1, 0.5, 9.0)]
    )
    assert report.ok and report.acquisitions == 4 and report.names == 2
    assert report.overlap_checks == 2 and report.fence_checks == 3
    report.assert_ok()


def test_check_history_reports_overlaps_and_fencing_inversions() -> None:
    """Two holders at once, and a token not greater than an earlier one, are both reported."""
    report = check_history([acq("a", 1, 0.0, 2.0), acq("a", 3, 1.0, 3.0), acq("a", 2, 3.5, 4.0)])
    assert not report.ok
    assert any("two holders at once" in v for v in report.violations)
    assert any("fencing token did not grow" in v for v in report.violations)
    with pytest.raises(AssertionError, match="violations"):
        report.assert_ok()


def test_check_history_agrees_with_a_pairwise_check() -> None:
    """On random small histories the checker flags exactly what comparing every pair flags."""
    import random  # noqa: PLC0415

    rng = random.Random(7)
    for _ in range(300):
        items = []
        for _ in range(rng.randrange(1, 7)):
            t = rng.uniform(0, 10)
            items.append(acq(rng.choice("ab"), rng.randrange(1, 8), t, t + rng.uniform(0.01, 3)))
        report = check_history(items)
        overlap, inverted = brute_force(items)
        assert any("two holders" in v for v in report.violations) == overlap, items
        assert any("did not grow" in v for v in report.violations) == inverted, items


def test_acquisition_round_trips_through_json() -> None:
    """A subprocess client's acquisitions come back intact."""
    a = Acquisition("n", "tok", 3, 1.5, 2.0, 3.25, "c1", 2, True)
    assert Acquisition.from_json(a.to_json()) == a
    h = History()
    h.add(a)
    h.count("attempts", 4)
    other = History()
    other.merge_json(h.to_json())
    assert other.acquisitions == [a] and other.events["attempts"] == 4


# -- histories under random faults --------------------------------------------------------------------------------

SUBPROCESS_CLIENT = (
    "import sys; from celery_singleton_lock.history import lock_client_main; lock_client_main(sys.argv[1:])"
)


def run_history(
    servers: Sequence[RedisServer],
    capsys: pytest.CaptureFixture[str],
    *,
    threads: int,
    processes: int,
    names: int,
    seed: int,
) -> None:
    """Clients in threads and subprocesses against proxied nodes under random faults; check what they saw."""
    seed += 1000 * SOAK_SEED
    history = History()
    errors: list[str] = []
    label = f"hist-{uuid.uuid4().hex[:8]}"
    lock_names = [f"{label}:{i}" for i in range(names)]
    with proxies_for(servers) as proxies:
        urls = [p.url for p in proxies]
        warm(urls)
        injector = FaultInjector(proxies, servers, seed=seed)

        def client(i: int) -> None:
            try:
                # Some clients give a caller token (a label): one instance per name re-acquires under it.
                run_lock_client(urls, lock_names, history, seconds=SOAK_SECONDS, client=f"t{i}", seed=seed * 100 + i,
                                label=f"worker-{i}" if i % 2 else None)  # fmt: skip
            except Exception:
                errors.append(traceback.format_exc())

        workers = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(threads)]

        def config(i: int) -> str:
            return json.dumps({"urls": urls, "names": lock_names, "seconds": SOAK_SECONDS, "client": f"p{i}",
                               "seed": seed * 1000 + i, "label": f"proc-{i}"})  # fmt: skip

        procs = [
            subprocess.Popen(
                [sys.executable, "-c", SUBPROCESS_CLIENT, config(i)],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for i in range(processes)
        ]
        started = time.monotonic()
        try:
            with injector:
                for w in workers:
                    w.start()
                for w in workers:
                    w.join(SOAK_SECONDS + 30)
                for p in procs:
                    out, err = p.communicate(timeout=SOAK_SECONDS + 60)
                    if p.returncode != 0:
                        errors.append(f"client process exited with {p.returncode}: {err[-2000:]}")
                    else:
                        history.merge_json(out.strip().splitlines()[-1])
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait(10)
        took = time.monotonic() - started
        faults = injector.summary()
    assert not any(w.is_alive() for w in workers), "a client thread did not finish"
    assert not errors, "\n".join(errors)
    report = history.check()
    events = ", ".join(f"{k} {v}" for k, v in sorted(history.events.items()))
    with capsys.disabled():
        print(
            f"\n[history] {len(servers)} nodes, {threads} threads + {processes} processes, {took:.1f} s, seed {seed}: "
            f"{report.summary()}\n[history] faults: {faults}\n[history] clients: {events}"
        )
    report.assert_ok()
    # A run that acquired almost nothing checked almost nothing.
    assert report.acquisitions >= 10, report.summary()
    assert history.events["extended"] > 0 and history.events["released"] > 0, events


@pytest.mark.timeout(SOAK_SECONDS * 3 + 120)
def test_history_on_three_nodes_under_faults(fresh_trio: list[RedisServer], capsys: pytest.CaptureFixture[str]) -> None:
    """Three nodes behind faulty proxies, some paused at random: no two holders at once, fencing tokens grow."""
    run_history(fresh_trio, capsys, threads=6, processes=2, names=4, seed=3)


@pytest.mark.timeout(SOAK_SECONDS * 3 + 120)
def test_history_on_five_nodes_under_faults(fresh_five: list[RedisServer], capsys: pytest.CaptureFixture[str]) -> None:
    """Five nodes behind faulty proxies, two at a time paused or held: no two holders at once, tokens grow."""
    run_history(fresh_five, capsys, threads=6, processes=1, names=4, seed=5)


# -- regressions: late packets ------------------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_caller_token_late_acquire_and_undo_never_free_the_next_attempts_lease(
    redis_trio: list[RedisServer], name: str
) -> None:
    """With token= given, attempt k's ACQUIRE and undo arriving after attempt k+1 won leave k+1's lease alone."""
    # The schedule: attempt k's commands to A and B are held, so it times out there (C alone said yes) and writes
    # its undo behind them; attempt k+1 goes through; then A and B get k's ACQUIRE and undo. Were both attempts
    # one owner token, the late ACQUIRE would find "already ours" and the undo would delete k+1's key on A and B.
    with proxies_for(redis_trio) as (pa, pb, pc):
        urls = [p.url for p in (pa, pb, pc)]
        warm(urls)
        holds = [pa.hold(), pb.hold()]  # attempt k's bytes to A and B wait until released
        retries: list[float] = []

        def sleep(seconds: float) -> None:
            # Called between attempts k and k+1: let k+1 through, keep k's bytes held.
            if not retries:
                assert wait_for(lambda: held_bytes(holds)), "attempt k's commands never reached the proxies"
                for h in holds:
                    h.stop()
            retries.append(seconds)
            time.sleep(seconds)

        lock = Redlock(urls, name, ttl=10.0, token="fixed-token", socket_timeout=ST, sleep=sleep)
        assert lock.acquire(blocking=True, timeout=5.0)
        assert len(retries) == 1, f"expected one failed attempt, then success: {len(retries)} retries"
        for h in holds:
            h.release()  # attempt k's ACQUIRE, then its undo, reach A and B now
        assert pa.wait_idle(5.0) and pb.wait_idle(5.0)
        try:
            assert_holds(lock, redis_trio, urls, name)
        finally:
            lock.release()


@pytest.mark.timeout(60)
def test_two_locks_with_one_caller_token_exclude_each_other(redis_trio: list[RedisServer], name: str) -> None:
    """token= is a label, not an identity: two instances given the same one never both hold the lock."""
    urls = [s.url for s in redis_trio]
    first = Redlock(urls, name, ttl=5.0, token="same-label", socket_timeout=ST)
    second = Redlock(urls, name, ttl=5.0, token="same-label", socket_timeout=ST)
    assert first.acquire(blocking=False)
    try:
        assert not second.acquire(blocking=False), "two instances with one caller token hold the lock at once"
    finally:
        second.release()
        first.release()


@pytest.mark.timeout(60)
def test_late_extend_never_extends_or_deletes_the_next_holders_key(redis_trio: list[RedisServer], name: str) -> None:
    """An EXTEND held back until another client holds the lock does not touch that client's key."""
    with proxies_for(redis_trio) as (pa, pb, pc):
        urls = [p.url for p in (pa, pb, pc)]
        warm(urls)
        first = Redlock(urls, name, ttl=1.0, socket_timeout=ST)
        assert first.acquire(blocking=False)
        holds = [pa.hold(), pb.hold()]
        lag = pc.delay(0.4)  # a loaded machine: C's EXTEND lands late
        assert not first.extend()  # A and B do not answer: undecided, the lease stands until its deadline
        pc.remove(lag)
        assert wait_for(lambda: held_bytes(holds))
        for h in holds:
            h.stop()
        # A and B free up when first's lease ends (its EXTEND never reached them); C a moment later (the EXTEND
        # reached it). Wait for all three: a second acquire between the two would hold A and B only, a valid
        # quorum that the strict check below (every node) would wrongly call a lost key (a CI flake, 2026-11-24).
        assert wait_for(lambda: all(owner_on(s, name) is None for s in redis_trio), timeout=5.0)
        second = Redlock(urls, name, ttl=8.0, socket_timeout=ST)
        assert second.acquire(blocking=False)
        for h in holds:
            h.release()
        assert pa.wait_idle(5.0) and pb.wait_idle(5.0)
        try:
            assert_holds(second, redis_trio, urls, name)
            # first's EXTEND asks for 1000 ms: the key keeps second's 8 s lease.
            assert min(pttl_on(s, name) for s in redis_trio[:2]) > 3000
        finally:
            second.release()


@pytest.mark.timeout(60)
def test_late_release_never_frees_the_next_holders_lock(redis_trio: list[RedisServer], name: str) -> None:
    """A RELEASE held back until another client holds the lock does not free it."""
    with proxies_for(redis_trio) as (pa, pb, pc):
        urls = [p.url for p in (pa, pb, pc)]
        warm(urls)
        first = Redlock(urls, name, ttl=1.0, socket_timeout=ST)
        assert first.acquire(blocking=False)
        holds = [pa.hold(), pb.hold()]
        assert not first.release()  # only C answered
        assert wait_for(lambda: held_bytes(holds))
        for h in holds:
            h.stop()
        second = Redlock(urls, name, ttl=8.0, socket_timeout=ST)
        assert second.acquire(blocking=True, timeout=5.0)  # once first's keys on A and B expire
        # A majority at least: a node whose copy of first's key had not expired yet may have refused it (load).
        won = [owner_on(s, name) == second.token for s in redis_trio]
        for h in holds:
            h.release()
        assert pa.wait_idle(5.0) and pb.wait_idle(5.0)
        try:
            assert_holds(second, redis_trio, urls, name, won)
        finally:
            second.release()


@pytest.mark.timeout(60)
def test_caller_token_late_release_never_frees_the_same_locks_next_lease(
    redis_trio: list[RedisServer], name: str
) -> None:
    """With token= given, a RELEASE of lease 1 held back until the same instance took lease 2 leaves lease 2 alone."""
    with proxies_for(redis_trio) as (pa, pb, pc):
        urls = [p.url for p in (pa, pb, pc)]
        warm(urls)
        lock = Redlock(urls, name, ttl=1.0, token="worker-1", socket_timeout=ST)
        assert lock.acquire(blocking=False)
        holds = [pa.hold(), pb.hold()]
        assert not lock.release()  # only C answered: lease 1's keys stay on A and B until they expire
        assert wait_for(lambda: held_bytes(holds))
        for h in holds:
            h.stop()
        assert lock.acquire(blocking=True, timeout=5.0)
        won = [owner_on(s, name) == lock.token for s in redis_trio]
        for h in holds:
            h.release()  # lease 1's RELEASE reaches A and B now
        assert pa.wait_idle(5.0) and pb.wait_idle(5.0)
        try:
            assert_holds(lock, redis_trio, urls, name, won)
        finally:
            lock.release()


@pytest.mark.timeout(60)
def test_late_acquire_and_undo_of_a_failed_attempt_never_free_the_next_holder(
    redis_trio: list[RedisServer], name: str
) -> None:
    """A failed attempt's ACQUIRE and undo, held back until another client holds the lock, leave it alone."""
    with proxies_for(redis_trio) as (pa, pb, pc):
        urls = [p.url for p in (pa, pb, pc)]
        warm(urls)
        holds = [pa.hold(), pb.hold()]
        first = Redlock(urls, name, ttl=5.0, socket_timeout=ST)
        assert not first.acquire(blocking=False)  # A and B time out: the undo follows the ACQUIRE, both held
        assert wait_for(lambda: held_bytes(holds))
        for h in holds:
            h.stop()
        second = Redlock(urls, name, ttl=5.0, socket_timeout=ST)
        assert second.acquire(blocking=False)
        for h in holds:
            h.release()
        assert pa.wait_idle(5.0) and pb.wait_idle(5.0)
        try:
            assert_holds(second, redis_trio, urls, name)
        finally:
            second.release()


@pytest.mark.timeout(60)
def test_late_undo_after_its_acquire_ran_never_frees_the_next_holder(redis_trio: list[RedisServer], name: str) -> None:
    """The ACQUIRE ran on A and B but its replies were held; the undo, held too, arrives after a new holder won."""
    with proxies_for(redis_trio) as (pa, pb, pc):
        urls = [p.url for p in (pa, pb, pc)]
        warm(urls)
        replies = [pa.hold(direction="downstream"), pb.hold(direction="downstream")]
        first = Redlock(urls, name, ttl=1.0, socket_timeout=ST)
        result: list[bool] = []
        attempt = threading.Thread(target=lambda: result.append(first.acquire(blocking=False)), daemon=True)
        attempt.start()
        # The replies being held means the ACQUIRE ran; hold what the client writes next on those connections
        # (the undo, written when it times out ST seconds later).
        assert wait_for(lambda: held_bytes(replies))
        undos = [pa.hold(target="open"), pb.hold(target="open")]
        attempt.join(5.0)
        assert result == [False]
        assert wait_for(lambda: held_bytes(undos)), "the undo never reached the proxies"
        for h in (*replies, *undos):
            h.stop()
        second = Redlock(urls, name, ttl=8.0, socket_timeout=ST)
        assert second.acquire(blocking=True, timeout=5.0)  # once first's keys on A and B expire
        for h in (*replies, *undos):
            h.release()
        assert pa.wait_idle(5.0) and pb.wait_idle(5.0)
        try:
            assert_holds(second, redis_trio, urls, name)
        finally:
            second.release()
