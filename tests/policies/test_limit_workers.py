"""``lock_limit=N`` with real workers: never more than N runs of a key at once, through pool-child and whole-worker
SIGKILLs; every job still runs (reschedule), and a skip names the limit.

Two prefork workers of 3 processes each (6 > the limit of 3) on one queue of this module; the lock nodes are three
redis-servers. Each run records its start and end (``locked_app._run``); a run killed mid-body has no end, and counts
as running until its process was seen gone. Every loop is bounded in count and time.
"""

from __future__ import annotations

import os
import re
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from celery.exceptions import TaskRevokedError
from celery.result import AsyncResult
from worker_cluster import Cluster, cluster, new_key, polling

from celery_singleton_lock.lock.redlock import Redlock
from celery_singleton_lock.testing import CeleryWorker, assert_skipped_duplicate

TTL = 2.0
LIMIT = 3
pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def c(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    # A short visibility timeout: the messages a SIGKILLed worker held unacked come back within seconds.
    with cluster(tmp_path_factory.mktemp("limit"), ttl=TTL, env={"CSL_VISIBILITY": "8"}) as cl:
        cl.app_module()
        yield cl


def _children(worker: CeleryWorker) -> set[int]:
    assert worker.process is not None
    out: set[int] = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == worker.process.pid:
                out.add(int(entry.name))
    return out


def _gone(pid: int, timeout: float = 10.0) -> float:
    """The time (time.time()) ``pid`` was seen gone (or a zombie)."""
    for _ in polling(timeout, 0.005):
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            return time.time()
        if state == "Z":
            return time.time()
    raise AssertionError(f"process {pid} still alive {timeout} s after SIGKILL")


def _running(c: Cluster, key: str) -> list[list[object]]:
    ended = {(r[1], r[2], r[3]) for r in c.runs(key)}
    return [s for s in c.started(key) if (s[1], s[2], s[3]) not in ended]


def _peak(c: Cluster, key: str, killed: dict[int, float]) -> int:
    windows = [(r[3], r[4]) for r in c.runs(key)]
    for s in _running(c, key):
        pid = int(s[2])  # type: ignore[call-overload]
        assert pid in killed, f"run {s} has no end and its process was not killed"
        windows.append((float(s[3]), killed[pid]))  # type: ignore[arg-type]
    events = sorted([(start, 1) for start, _ in windows] + [(end, -1) for _, end in windows])
    current = peak = 0
    for _, step in events:
        current += step
        peak = max(peak, current)
    return peak


def _release_once_redelivered(c: Cluster, worker: str, key: str, long: AsyncResult) -> None:
    """The long run's 20 s is a bound: once its redelivery (the 8 s visibility timeout) found its own slot and was
    re-sent to wait ("redelivered"), the run is released (``release:<key>``, a ``bounded-`` key); not seen before
    the run's end, nothing is cut short."""
    seen = re.compile(rf"\[{long.id}\][^\n]*redelivered")
    for _ in polling(30, 0.1):
        if seen.search("".join(w.log() for w in c.workers if w.name == worker)):
            c.record.set(f"release:{key}", 1)
            return
        if long.ready():
            return


def test_a_limit_of_3_holds_through_a_storm_with_sigkills(c: Cluster) -> None:
    app = c.app_module()
    first = c.worker("lim-a", queues="lim", concurrency=3)
    second = c.worker("lim-b", queues="lim", concurrency=3)
    key = new_key("limit")
    results = [app.limited.apply_async((key, 0.4), queue="lim") for _ in range(36)]
    killed: dict[int, float] = {}
    # Two pool children killed mid-body, one after the other.
    for _ in range(2):
        for _ in polling(20, 0.02):
            running = [s for s in _running(c, key) if int(s[2]) not in killed]  # type: ignore[call-overload]
            if running:
                break
        assert running, "no run to kill"
        pid = int(running[0][2])  # type: ignore[call-overload]
        os.kill(pid, signal.SIGKILL)
        killed[pid] = _gone(pid)
        time.sleep(0.5)
    # Then a whole worker, mid-storm; a new one takes its place.
    children = _children(second)
    second.kill()
    at = time.time()
    for pid in children:
        killed.setdefault(pid, at)
    c.worker("lim-c", queues="lim", concurrency=3)
    states = []
    for r in results:
        r.get(timeout=120, propagate=False)
        states.append(r.state)
    assert states.count("SUCCESS") == len(results), states
    assert _peak(c, key, killed) <= LIMIT
    runs = c.runs(key)
    assert {r[1] for r in runs} == {r.id for r in results}  # every job ran (killed ones again after redelivery)
    assert _peak(c, key, killed) == LIMIT  # the limit is used, not only respected
    urls = c.lock_urls
    for _ in polling(3 * TTL):
        if not Redlock(urls, app.limited.lock_key_for(key), limit=LIMIT).holders():
            break
    assert not Redlock(urls, app.limited.lock_key_for(key), limit=LIMIT).holders()
    first.stop()


def test_a_run_beyond_the_limit_is_skipped_naming_the_limit(c: Cluster) -> None:
    app = c.app_module()
    c.worker("skip-a", queues="lskip", concurrency=3)
    key = new_key("lskip")
    running = [app.limited_skip.apply_async((key, 2.0), queue="lskip") for _ in range(2)]
    c.wait_started(key, 2)
    third = app.limited_skip.apply_async((key, 0.0), queue="lskip")
    holder = assert_skipped_duplicate(third, timeout=20)
    assert holder in {r.id for r in running}
    with pytest.raises(TaskRevokedError, match=r"at its limit of 2 runs \(one by task "):
        third.get(timeout=5)
    for r in running:
        assert r.get(timeout=20) == key


def test_a_redelivery_finds_its_own_slot_after_the_callable_limit_was_lowered(c: Cluster) -> None:
    """Issue 29 finding 5: a run holds slot 2 of a callable limit of 3; the limit is lowered to 1 and the lower
    slots are free; the run's redelivery (visibility timeout) finds its own job's slot and never runs beside it."""
    app = c.app_module()
    c.worker("dial-a", queues="dial", concurrency=3)
    key = new_key("bounded")
    c.record.set(f"limit:{key}", 3)
    short = [app.dialed.apply_async((key, 2.0), queue="dial") for _ in range(2)]
    c.wait_started(key, 2)
    long = app.dialed.apply_async((key, 20.0), queue="dial")  # the third slot: slot 2
    c.wait_started(key, 3)
    c.record.set(f"limit:{key}", 1)
    for r in short:
        assert r.get(timeout=20) == key
    _release_once_redelivered(c, "dial-a", key, long)
    assert long.get(timeout=60) == key
    starts = [s for s in c.started(key) if s[1] == long.id]
    assert len(starts) == 1, starts  # redelivered after 8 s (visibility timeout), never run a second time
    assert "redelivered" in "".join(w.log() for w in c.workers if w.name == "dial-a")


def test_a_redelivery_finds_its_own_slot_after_every_node_was_restarted_empty_one_at_a_time(c: Cluster) -> None:
    """A callable limit's slots are still found by a run's redelivery after each lock node lost its data in turn
    (one node out at a time, each back before the next): the limit a slot was taken under is noted again."""
    app = c.app_module()
    c.worker("dial-b", queues="dial", concurrency=3)
    warm = new_key("dial")
    c.record.set(f"limit:{warm}", 3)
    for r in [app.dialed.apply_async((warm, 1.0), queue="dial") for _ in range(3)]:  # every pool child notes 3
        assert r.get(timeout=20) == warm
    for node in c.locks:  # each node restarted empty in turn: a quorum is up throughout
        node.restart()
        time.sleep(0.5)
    time.sleep(2.5)  # past a lease (the dialed task's lock_ttl): no note is trusted longer
    key = new_key("bounded")
    c.record.set(f"limit:{key}", 3)
    short = [app.dialed.apply_async((key, 2.0), queue="dial") for _ in range(2)]
    c.wait_started(key, 2)
    long = app.dialed.apply_async((key, 20.0), queue="dial")  # the third slot: slot 2
    c.wait_started(key, 3)
    c.record.set(f"limit:{key}", 1)
    for r in short:
        assert r.get(timeout=20) == key
    _release_once_redelivered(c, "dial-b", key, long)
    assert long.get(timeout=60) == key
    starts = [s for s in c.started(key) if s[1] == long.id]
    assert len(starts) == 1, starts  # redelivered after 8 s (visibility timeout), never run a second time
    assert "redelivered" in "".join(w.log() for w in c.workers if w.name == "dial-b")


#: Seconds the two holders of the capped limit run: they must outlive a call joining the line and another being
#: refused (a bound, not an expectation: a machine slower than this fails the test, it never passes by it).
CAPPED_HOLD = 8.0


def test_a_limit_s_capped_line_refuses_a_call_beyond_its_cap_at_once(c: Cluster) -> None:
    """``lock_limit=2`` with ``lock_max_waiting=1``: two runs hold both slots and one call waits for a slot; the next
    call is REVOKED at once (both holders still run), naming the full line; the waiting call runs after a holder,
    never more than 2 at once."""
    from celery_singleton_lock.lock.record import sibling_key  # noqa: PLC0415

    app = c.app_module()
    c.worker("lim-cap", queues="limcap", concurrency=3)
    key = new_key("cap")
    holders = [app.capped_limited.apply_async((key, CAPPED_HOLD), queue="limcap") for _ in range(2)]
    c.wait_started(key, 2)
    waiting = app.capped_limited.apply_async((key, 0.0), queue="limcap")
    lock_key = app.capped_limited.lock_key_for(key)
    client = c.lock_client(c.locks[0])
    try:
        for _ in polling(20, 0.05):
            if client.zcard(sibling_key(lock_key, ":waiters")) == 1:
                break
        assert client.zcard(sibling_key(lock_key, ":waiters")) == 1
    finally:
        client.close()
    refused = app.capped_limited.apply_async((key, 0.0), queue="limcap")
    with pytest.raises(TaskRevokedError, match="full"):
        refused.get(timeout=20)
    assert "lock_max_waiting=1" in str(refused.result)
    assert c.runs(key) == [], "the refusal came only after a holder ended"
    for r in [*holders, waiting]:
        assert r.get(timeout=60) == key
    assert _peak(c, key, {}) <= 2
    assert len(c.wait_runs(key, 3, 10)) == 3
