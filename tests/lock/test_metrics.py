"""Lock metrics, end to end: each outcome counted once per call, where it is decided (the producer at ``delay()``, a
pool child, the worker's main process), and the ``joined`` flag on the result a call returns.

One broker, three lock nodes and one prefork worker (concurrency 2, ``rate_tasks`` imported) for the module. Each
test uses a task of its own, so the counts it reads are its own: it reads them before, waits for the flushes (the
test process's own counts are flushed by the test; a worker's watchdog flushes every 5 s), and asserts the exact
difference once a further flush interval has passed (a count made twice would show by then).
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from celery.result import AsyncResult
from worker_cluster import Cluster, cluster, new_key, polling

from celery_singleton_lock.lock import metrics
from celery_singleton_lock.lock.config import settings_for
from celery_singleton_lock.lock.renewal import STATS_FLUSH_INTERVAL, Watchdog, flush_stats
from celery_singleton_lock.testing import RedisServer, wait_for
from celery_singleton_lock.testing.faults import FaultProxy

APPS = Path(__file__).parent.parent / "apps"


@pytest.fixture(scope="module")
def c(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with cluster(tmp_path_factory.mktemp("metrics"), ttl=3.0) as cl:
        cl.worker("m1", concurrency=2, extra=["-I", "rate_tasks"])
        cl.app_module()
        yield cl


@pytest.fixture(scope="module")
def rate_tasks(c: Cluster) -> ModuleType:
    sys.modules.pop("rate_tasks", None)
    import rate_tasks  # noqa: PLC0415 - imported with the cluster's env, after locked_app

    return rate_tasks


def counts(c: Cluster, task: str) -> dict[str, int]:
    settings = settings_for(c.app_module().app)
    return dict(metrics.read_metrics(settings.nodes, settings.prefix).tasks.get(task, {}))


def counted(c: Cluster, task: str, before: dict[str, int], expected: dict[str, int]) -> dict[str, int]:
    """The counts of ``task`` made since ``before``, once every one of ``expected`` has arrived (polled for 30 s)
    and one more flush interval has passed, so that a count made more than once would show."""
    flush_stats()  # the producer's (this process's) counts

    def diff() -> dict[str, int]:
        now = counts(c, task)
        return {k: now.get(k, 0) - before.get(k, 0) for k in set(now) | set(before) if now.get(k, 0) != before.get(k)}

    for _ in polling(30, 0.25):
        if all(diff().get(k, 0) >= n for k, n in expected.items()):
            break
    time.sleep(STATS_FLUSH_INTERVAL + 1.0)  # a bound: every process's next flush has happened by then
    flush_stats()
    return diff()


def test_queue_scope_duplicates_stopped_at_delay_are_joined(c: Cluster) -> None:
    """Queue scope: three duplicate calls while the job is queued or running each count one ``joined`` (at delay(),
    in the producer) and get the job's result flagged ``joined``; the job counts one ``started``."""
    mod = c.app_module()
    name = mod.q_work.name
    before = counts(c, name)
    k = new_key()
    first = mod.q_work.delay(k, 1.5)
    dupes = [mod.q_work.delay(k, 1.5) for _ in range(3)]
    assert first.joined is False and first.holder_id is None
    assert all(d.joined is True and d.holder_id == first.id == d.id for d in dupes)
    assert first.get(timeout=30) == k
    got = counted(c, name, before, {"joined": 3, "started": 1, "released": 1})
    assert got == {"joined": 3, "started": 1, "acquired": 1, "released": 1}, got


def test_enqueue_check_join_is_counted_and_flagged(c: Cluster) -> None:
    """lock_enqueue_check: a call made while the job runs returns the running job flagged ``joined`` and counts one
    ``joined``; a call after it ended is a new job (``joined`` False)."""
    mod = c.app_module()
    name = mod.enq_work.name
    before = counts(c, name)
    k = new_key()
    first = mod.enq_work.delay(k, 1.5)
    c.wait_started(k)
    second = mod.enq_work.delay(k, 1.5)
    assert second.joined is True and second.holder_id == first.id
    assert first.get(timeout=30) == k
    third = mod.enq_work.delay(k, 0.0)
    assert third.joined is False
    third.get(timeout=30)
    got = counted(c, name, before, {"joined": 1, "started": 2})
    assert got == {"joined": 1, "started": 2, "acquired": 2, "released": 2}, got


def test_calls_that_join_a_burst_count_debounced(c: Cluster) -> None:
    """lock_debounce: a burst of five calls counts four ``debounced`` (the calls that joined) and one ``started``;
    the joiners' results are flagged ``joined``, naming the burst's job."""
    mod = c.app_module()
    name = mod.debounced.name
    before = counts(c, name)
    k = new_key()
    results = [mod.debounced.delay(k, v) for v in range(5)]
    assert results[0].joined is False
    assert all(r.joined and r.holder_id == results[0].id for r in results[1:])
    assert results[0].get(timeout=30) == [k, 4]
    got = counted(c, name, before, {"debounced": 4, "started": 1, "released": 1})
    assert got.get("debounced") == 4 and got.get("started") == 1, got
    assert "skipped" not in got and "joined" not in got, got


def test_a_rescheduled_duplicate_that_ran_is_not_counted_skipped(c: Cluster) -> None:
    """reschedule: a duplicate that waits for the holder and then runs counts ``deferred`` and ``waited`` once each,
    and ``started`` like the holder; never ``skipped``."""
    mod = c.app_module()
    name = mod.work_later.name
    before = counts(c, name)
    k = new_key()
    first = mod.work_later.delay(k, 1.5)
    c.wait_started(k)
    later = mod.work_later.delay(k, 0.0)
    assert first.get(timeout=30) == k
    assert later.get(timeout=60) == k
    got = counted(c, name, before, {"started": 2, "waited": 1, "released": 2})
    assert "skipped" not in got, got
    assert got.get("started") == 2 and got.get("waited") == 1 and got.get("deferred") == 1, got


def test_a_rate_only_task_counts_started_and_rate_limited_once_per_call(c: Cluster, rate_tasks: Any) -> None:
    """lock_limit=None with a rate of 3 per 1.5 s: six calls count six ``started``, and ``rate-limited`` once for
    each call held back (at most 3: its re-sends asking again are not counted)."""
    name = rate_tasks.rated_unlocked.name
    before = counts(c, name)
    k = new_key()
    results = [rate_tasks.rated_unlocked.delay(k) for _ in range(6)]
    for r in results:
        r.get(timeout=60)
    got = counted(c, name, before, {"started": 6})
    assert got.get("started") == 6, got
    assert 1 <= got.get("rate-limited", 0) <= 3, got
    assert "acquired" not in got, got


def test_a_joined_result_is_still_an_async_result() -> None:
    """The flag is an attribute of the AsyncResult a call returns: it is still the app's AsyncResult, and pickles
    as one (the flag belongs to the call, not to the job: not carried)."""
    from celery_singleton_lock.task._run import mark_joined  # noqa: PLC0415 - the one helper every path uses

    result = mark_joined(AsyncResult("job-1"), "job-1")
    assert type(result) is AsyncResult
    assert result.joined is True and result.holder_id == "job-1" and result.id == "job-1"
    back = pickle.loads(pickle.dumps(result))
    assert type(back) is AsyncResult and back.id == "job-1"
    assert getattr(back, "joined", None) is None


def test_a_producer_that_exits_flushes_its_counts(c: Cluster) -> None:
    """A producer process that calls delay() and exits at once (no 5 s flush yet) still writes its ``joined``
    counts: it flushes them at exit."""
    mod = c.app_module()
    name = mod.q_work.name
    k = new_key()
    # The first job runs 4 s: long enough for the producer (a fresh interpreter importing Celery, slow under load) to
    # send both of its calls while the job is still reserved or running, so both join it.
    first = mod.q_work.delay(k, 4.0)
    before = counts(c, name)
    code = f"import locked_app as m\nfor _ in range(2): m.q_work.delay({k!r}, 4.0)\n"
    env = {**os.environ, **c.env, "PYTHONPATH": os.pathsep.join([str(APPS), *sys.path])}
    subprocess.run([sys.executable, "-c", code], env=env, cwd=str(APPS), check=True, timeout=60)
    assert first.get(timeout=30) == k
    got = counted(c, name, before, {"joined": 2})
    assert got.get("joined") == 2, got


# -- the flush: one batch, added exactly once (metrics.Outbox, count.lua) ----------------------------------------------


def _app_on(urls: list[str], name: str) -> Any:
    from celery import Celery  # noqa: PLC0415

    app = Celery(name, broker="memory://", set_as_current=False)
    app.conf.update(singleton_lock_urls=urls, singleton_lock_prefix=f"{name}{os.getpid()}:")
    return app


def _exact(settings: Any, task: str) -> tuple[int, int, int]:
    """The task's 'acquired' count in the legacy hash, since ever, and summed over the minutes (every node)."""
    found = metrics.read_metrics(settings.nodes, settings.prefix).tasks.get(task, {}).get("acquired", 0)
    minutes = metrics.read_metrics(settings.nodes, settings.prefix, since=3600).tasks.get(task, {}).get("acquired", 0)
    legacy = sum(int(client.hget(f"{settings.prefix}stats", "acquired") or 0) for client in settings.nodes.clients)
    return legacy, found, minutes


def test_a_batch_cut_off_on_its_way_to_its_node_is_sent_again_and_counted_once() -> None:
    """FOUND: a batch sent to a node whose connection dropped before the node read all of it was taken as written
    (at most once), so its counts were lost. Now it is retried on that node, under its batch id, until the node
    confirms it: the counts arrive, exactly once, whatever part of it had landed."""
    from celery_singleton_lock.lock.renewal import Watchdog  # noqa: PLC0415
    from celery_singleton_lock.testing import RedisServer  # noqa: PLC0415
    from celery_singleton_lock.testing.faults import FaultProxy  # noqa: PLC0415

    with RedisServer() as server, FaultProxy(server.port) as proxy:
        settings = settings_for(_app_on([proxy.url], "cutoff"))
        watchdog = Watchdog()
        watchdog.count(settings.nodes, settings.prefix, "acquired", "t", 3)
        watchdog.flush_stats()
        assert _exact(settings, "t") == (3, 3, 3)
        slow = proxy.bandwidth(60, direction="upstream")  # a PING passes; a batch takes seconds: cut off mid-way
        watchdog.count(settings.nodes, settings.prefix, "acquired", "t", 4)
        watchdog.flush_stats()
        slow.stop()
        proxy.cut()
        for _ in polling(20, 0.2):
            watchdog.flush_stats()
            if _exact(settings, "t") == (7, 7, 7):
                break
        watchdog.flush_stats()
        assert _exact(settings, "t") == (7, 7, 7)


def test_flushes_paused_mid_way_by_sigstop_are_counted_exactly_once() -> None:
    """A node SIGSTOPped at any point of a flush and SIGCONTed later (it then runs what it had read): every batch
    is added once, never twice, never lost, in the legacy hash, the totals and the minutes alike."""
    import threading  # noqa: PLC0415

    from celery_singleton_lock.lock.renewal import Watchdog  # noqa: PLC0415
    from celery_singleton_lock.testing import RedisServer  # noqa: PLC0415

    with RedisServer() as server:
        settings = settings_for(_app_on([server.url], "paused"))
        watchdog = Watchdog()
        total = 0
        for n in range(6):
            watchdog.count(settings.nodes, settings.prefix, "acquired", "t", n + 1)
            total += n + 1
            pause = threading.Timer(0.002 * n, server.pause)
            pause.start()
            watchdog.flush_stats()
            pause.join()
            server.resume()
        for _ in polling(20, 0.2):
            watchdog.flush_stats()
            if watchdog._outbox.pending() == 0:
                break
        assert watchdog._outbox.pending() == 0
        assert _exact(settings, "t") == (total, total, total)


# -- /metrics' gauges: a bounded walk ----------------------------------------------------------------------------------


def test_a_scrape_scans_a_bounded_number_of_keys_and_the_walk_counts_each_key_once() -> None:
    """A scrape makes at most SCANS_PER_SCRAPE SCAN round trips whatever the number of keys; a walk longer than a
    scrape carries on at the next one, and once it ends the gauges are exact: a key on every node, or only on the
    second and third, is counted once (held, incomplete), one on the first only is partial."""
    from celery_singleton_lock.ops import _gauges  # noqa: PLC0415
    from celery_singleton_lock.testing import RedisServer  # noqa: PLC0415

    servers = [RedisServer().start() for _ in range(3)]
    try:
        settings = settings_for(_app_on([s.url for s in servers], "walk"))
        prefix = settings.prefix
        clients = [s.client() for s in servers]
        for client in clients:
            pipe = client.pipeline(transaction=False)
            for i in range(3000):
                pipe.hset(f"{prefix}t.a:v2:{i:032x}", mapping={"owner": f"o{i}", "state": "run", "name": "t.a"})
            pipe.execute()
        for client in clients[1:]:
            client.hset(f"{prefix}t.b:v2:{0:032x}", mapping={"owner": "ob", "state": "run", "name": "t.b"})
        clients[0].hset(f"{prefix}t.c:v2:{0:032x}", mapping={"owner": "oc", "state": "run", "name": "t.c"})
        bound = 3
        old, _gauges.SCANS_PER_SCRAPE = _gauges.SCANS_PER_SCRAPE, bound
        try:
            gauges = _gauges.read_gauges(settings)
            assert gauges.scans <= bound and not gauges.complete
            for _ in range(40):
                gauges = _gauges.read_gauges(settings)
                assert gauges.scans <= bound
                if gauges.complete:
                    break
        finally:
            _gauges.SCANS_PER_SCRAPE = old
        assert gauges.complete
        assert dict(gauges.held) == {"t.a": 3000, "t.b": 1}
        assert dict(gauges.incomplete) == {"t.b": 1}
        assert dict(gauges.partial) == {"t.c": 1}
    finally:
        for s in servers:
            s.close()


def test_a_renewal_without_a_quorum_counts_renew_failed_and_the_run_goes_on(c: Cluster) -> None:
    """Two of three lock nodes paused for a little over one renewal interval while a run holds its lock (a 3 s lease
    renewed every 1 s): the watchdog counts ``renew-failed`` for a renewal that got no quorum, the next one succeeds
    (the lease had not run out), and the run ends as ``released``, never ``lost``."""
    mod = c.app_module()
    name = mod.work.name
    before = counts(c, name)
    k = new_key()
    result = mod.work.delay(k, 6.0)
    c.wait_started(k)
    time.sleep(0.3)  # just past a renewal: the next one falls inside the pause
    c.locks[0].pause()
    c.locks[1].pause()
    try:
        time.sleep(1.6)  # a bound: over one renewal interval (1 s), under the lease (3 s)
    finally:
        c.locks[0].resume()
        c.locks[1].resume()
    assert result.get(timeout=30) == k
    got = counted(c, name, before, {"renew-failed": 1, "released": 1})
    assert got.get("renew-failed", 0) >= 1, got
    assert got.get("lost", 0) == 0, got
    assert got.get("released") == 1, got


def test_a_flush_that_timed_out_on_a_paused_node_is_not_counted_twice(fresh_node: RedisServer) -> None:
    """A node paused (SIGSTOP) during a flush still runs what it was sent once it resumes: the watchdog must not
    both send the batch and keep it to write again (10 outcomes read 15 before the fix). Now the PING before the
    batch times out, nothing of the batch is sent, and it is written once, when the node answers (the watchdog's
    own tick, or the flush below)."""
    settings = settings_for(_app_on([fresh_node.url], "flushtwice"))
    nodes, prefix = settings.nodes, settings.prefix
    watchdog = Watchdog()

    def acquired() -> int:
        return metrics.read_metrics(nodes, prefix).tasks.get("t", {}).get("acquired", 0)

    watchdog.count(nodes, prefix, "acquired", "t", 5)
    watchdog.flush_stats()  # (or the watchdog's own thread, started by count(), already is flushing)
    assert wait_for(lambda: acquired() >= 5, timeout=15, interval=0.05)
    watchdog.count(nodes, prefix, "acquired", "t", 5)
    fresh_node.pause()
    try:
        watchdog.flush_stats()  # the PING times out after socket_timeout: the batch is kept
    finally:
        fresh_node.resume()
    watchdog.flush_stats()
    assert wait_for(lambda: acquired() >= 10, timeout=15, interval=0.05)
    watchdog.flush_stats()
    assert acquired() == 10


def test_counts_flushed_while_the_first_node_is_stalled_land_on_the_next_node(fresh_node: RedisServer) -> None:
    """A first node that accepts connections but answers nothing (stalled, or blackholed) must not swallow every
    flush: a batch not yet sent goes to the next node that answers; only a batch sent and then timed out counts
    as written (the node may still run it)."""
    behind = RedisServer().start()
    try:
        with FaultProxy(behind.port) as proxy:
            settings = settings_for(_app_on([proxy.url, fresh_node.url], "stalledfirst"))
            proxy.hold()
            watchdog = Watchdog()
            watchdog.count(settings.nodes, settings.prefix, "acquired", "t", 5)
            watchdog.flush_stats()  # (or the watchdog's own thread, started by count(), already is flushing)
            client, total = fresh_node.client(), metrics.total_key(settings.prefix)
            assert wait_for(lambda: client.hgetall(total) != {}, timeout=15, interval=0.05)
            assert client.hgetall(total) == {f"t{metrics.SEP}acquired".encode(): b"5"}
    finally:
        behind.close()


def test_a_worker_stopped_right_after_a_storm_has_flushed_the_skips_its_main_process_counted(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """Duplicates skipped before the pool are counted in the worker's main process, whose watchdog flushes every
    5 s; only pool children flushed at exit. A worker stopped (warm) right after a storm lost those skips (2 of 20
    counted): the main process flushes at worker shutdown too. Counts equal the real outcomes."""
    with cluster(tmp_path_factory.mktemp("storm"), ttl=5.0) as c:
        worker = c.worker("storm", concurrency=2)
        mod = c.app_module()
        k = new_key()
        first = mod.work.delay(k, 3.0)
        c.wait_started(k)
        dupes = [mod.work.delay(k, 0.0) for _ in range(20)]
        for d in [first, *dupes]:
            d.get(timeout=60, propagate=False)
        runs = len(c.runs(k))
        worker.stop()
        settings = settings_for(mod.app)
        counted = metrics.read_metrics(settings.nodes, settings.prefix).tasks.get(mod.work.name, {})
        assert (counted.get("acquired"), counted.get("skipped", 0), counted.get("released")) == (runs, 21 - runs, runs)
