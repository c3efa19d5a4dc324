"""LockedTask across worker kinds and worker-level settings: a visibility-timeout redelivery, the threads, solo and
gevent pools, child recycling (worker_max_tasks_per_child=1), and settings so bad the worker must not start.

One broker and three lock nodes are shared by the module; each test starts the workers it needs on queues (or a
broker database) of its own, so their messages never reach another test's workers.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import needs
import pytest
import redis
from celery.exceptions import TaskRevokedError
from worker_cluster import APPS, Cluster, cluster, new_key, overlapping, polling

from celery_singleton_lock.testing import CeleryWorker, free_port

TTL = 3.0
PASSWORD = "s3cr3t-cfg-pw"


@pytest.fixture(scope="module")
def c(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with cluster(tmp_path_factory.mktemp("workers"), ttl=TTL) as cl:
        cl.app_module()
        yield cl


@pytest.fixture(scope="module")
def pools(c: Cluster) -> dict[str, CeleryWorker]:
    """A threads-pool worker (8 threads) on queue 'threads' and a solo-pool worker on queue 'solo'."""
    return {
        "threads": c.worker("threads", queues="threads", pool="threads", concurrency=8),
        "solo": c.worker("solo", queues="solo", pool="solo", concurrency=1),
    }


def burst(task: object, key: str, duration: float, queue: str, n: int) -> tuple[int, int]:
    """Send ``n`` copies of one job to ``queue`` at once; return (results, REVOKED) once all are ready.

    A worker that is not on the event loop (threads, solo, gevent pools) takes more messages only every second or
    so once its prefetch window is full, so a burst no larger than the window all arrives while the first runs.
    """
    results = [task.apply_async((key, duration), queue=queue) for _ in range(n)]  # type: ignore[attr-defined]
    done = revoked = 0
    for r in results:
        try:
            r.get(timeout=30)
            done += 1
        except TaskRevokedError:
            revoked += 1
    return done, revoked


def test_visibility_timeout_redelivery_never_runs_beside_the_running_copy(c: Cluster) -> None:
    """A visibility-timeout redelivery of a running task waits instead of running beside it; the job runs once."""
    mod = c.app_module()
    url = c.broker.url.rsplit("/", 1)[0] + "/3"  # a broker database of its own: the 2 s sweeps touch nothing else
    env = {"CSL_BROKER": url, "CSL_VISIBILITY": "2"}
    workers = [c.worker("vis-a", env=env), c.worker("vis-b", env=env)]
    broker = redis.Redis.from_url(url)
    # Timeline: the run takes 7 s. After 2 s the broker's sweep (every second here) restores its unacked message; the
    # copy finds the lock held by its own task id and is re-sent with a countdown capped at 1 s (half the visibility
    # timeout, so the broker never restores and doubles the copy itself), again until the run succeeded; then the
    # copy takes the lock, sees SUCCESS and skips.
    try:
        k = new_key()
        with mod.app.connection_for_write(url) as conn:
            result = mod.work.apply_async((k, 7.0), connection=conn)
        assert result.get(timeout=60) == k
        # Drained: no copy queued or held unacked (countdown copies wait unacked in the workers) for 2 s running.
        quiet_since, drained = None, False
        for elapsed in polling(10, 0.1):
            if broker.llen("celery") or broker.hlen("unacked"):
                quiet_since = None
            elif quiet_since is None:
                quiet_since = elapsed
            elif elapsed - quiet_since >= 2.0:
                drained = True
                break
        assert drained, "copies of the job kept circulating"
        logs = "".join(w.log() for w in workers)
        # Celery's own line for a re-sent copy says "deferred" (never "succeeded") and why.
        countdowns = [
            float(x)
            for x in re.findall(
                rf"work\[{result.id}\] deferred in [^:]*: re-sent to run in ([\d.]+)s \(redelivered", logs
            )
        ]
        assert countdowns, "no redelivery happened: the test proved nothing"
        assert max(countdowns) <= 1.0  # half the visibility timeout
        assert f"work[{result.id}] succeeded in" in logs
        assert f"work[{result.id}] skipped: already done in" in logs
        assert len(c.started(k)) == 1
        runs = c.runs(k)
        assert len(runs) == 1
        assert not overlapping(runs)
        assert result.state == "SUCCESS"
    finally:
        broker.close()
        for w in workers:
            w.kill()


def test_threads_pool_burst_runs_once_and_retry_works(c: Cluster, pools: dict[str, CeleryWorker]) -> None:
    """On a threads pool, eight copies of one job sent at once run once, and a retrying task runs to success."""
    mod = c.app_module()
    k = new_key()
    assert burst(mod.work, k, 1.5, "threads", 8) == (1, 7)
    assert len(c.runs(k)) == 1
    k = new_key()
    assert mod.flaky.apply_async((k, 2, 0.5), queue="threads").get(timeout=30) == 2
    runs = c.runs(k)
    assert len(runs) == 3
    assert len({r[1] for r in runs}) == 1
    assert not overlapping(runs)


def test_solo_pool_skips_duplicates_and_retries(c: Cluster, pools: dict[str, CeleryWorker]) -> None:
    """A solo-pool worker skips duplicates of a job running elsewhere, holds locks others skip, and retries."""
    mod = c.app_module()
    k = new_key()
    holder = mod.work.apply_async((k, 2.0), queue="threads")
    c.wait_started(k)
    assert burst(mod.work, k, 0.0, "solo", 4) == (0, 4)
    assert holder.get(timeout=30) == k
    k = new_key()
    holder = mod.work.apply_async((k, 2.0), queue="solo")
    c.wait_started(k)
    assert burst(mod.work, k, 0.0, "threads", 4) == (0, 4)
    assert holder.get(timeout=30) == k
    assert len(c.runs(k)) == 1
    k = new_key()
    assert mod.flaky.apply_async((k, 2, 0.5), queue="solo").get(timeout=30) == 2
    assert len(c.runs(k)) == 3


def test_child_recycling_after_every_task(c: Cluster) -> None:
    """With max_tasks_per_child=1 jobs all run, locks are released, copies never overlap, and each child's counters
    are kept (flushed at its exit): per run one started, acquired and released; per skipped copy one skipped."""
    mod = c.app_module()
    c.worker("recycle", queues="recycle", env={"CSL_MAX_TASKS_PER_CHILD": "1", "CSL_PREFIX": "recycle:"})

    def lock_name(k: str) -> str:  # the worker's key: the client's, with the worker's prefix
        return "recycle:" + mod.work.lock_key_for(k).removeprefix("singleton_lock:")

    k = new_key()
    for _ in range(4):
        assert mod.work.apply_async((k, 0.05), queue="recycle").get(timeout=30) == k
        assert c.lock_free(lock_name(k))
    runs = c.runs(k)
    assert len(runs) == 4
    assert len({r[2] for r in runs}) == 4, "children were not recycled"
    # A fresh child can take a second or more to start here, so later copies may arrive after the first ended.
    k2 = new_key()
    done, revoked = burst(mod.work, k2, 1.0, "recycle", 4)
    runs = c.runs(k2)
    assert done == len(runs) >= 1
    assert done + revoked == 4
    assert not overlapping(runs)
    assert c.lock_free(lock_name(k2))
    ran = str(4 + done).encode()
    expected = {b"started": ran, b"acquired": ran, b"released": ran}  # docs/metrics.md: each body counts started
    if revoked:
        expected[b"skipped"] = str(revoked).encode()
    stats = c.lock_client(c.locks[0])
    for _ in polling(10, 0.1):
        if stats.hgetall("recycle:stats") == expected:
            break
    assert stats.hgetall("recycle:stats") == expected
    # The per-task counts go in the same flush (each child flushes at its exit): what `locks stats` shows per task.
    per_task = {k.decode().partition("\x1f")[2].encode(): v for k, v in stats.hgetall("recycle:stats:total").items()}
    assert {k: v for k, v in per_task.items() if not k.startswith(b"@")} == expected
    assert all(k.decode().startswith(mod.work.name + "\x1f") for k in stats.hgetall("recycle:stats:total"))


def test_gevent_pool_burst_and_renewal(c: Cluster) -> None:
    """On a gevent pool, eight copies of one job sent at once run once and a run past 5 ttls keeps its lock."""
    needs.module("gevent", "the gevent pool needs it (the test extra has it)")
    mod = c.app_module()
    c.worker("gevent", queues="gevent", pool="gevent", concurrency=8)
    k = new_key()
    assert burst(mod.work, k, 1.5, "gevent", 8) == (1, 7)
    k = new_key()
    assert mod.long_work.apply_async((k, 3.0), queue="gevent").get(timeout=30) == [True, True]


BAD_SETTINGS = {
    "negative ttl": ({"singleton_lock_ttl": -1}, "singleton_lock_ttl"),
    "misspelt setting": ({"singleton_lock_tll": 5}, "singleton_lock_tll"),
    "AMQP broker, no lock urls": (None, "singleton_lock_urls"),
}


@pytest.mark.parametrize("case", list(BAD_SETTINGS))
def test_bad_settings_stop_the_worker_at_start(c: Cluster, tmp_path: Path, case: str) -> None:
    """Bad singleton_lock_* settings stop the worker before it is ready, naming the setting, never the password."""
    conf, setting = BAD_SETTINGS[case]
    if conf is None:  # the check must stop the worker before it even tries the (closed) AMQP port
        broker, conf = f"amqp://guest:{PASSWORD}@127.0.0.1:{free_port()}//", {}
    else:
        broker = c.broker.url
        conf = {**conf, "singleton_lock_urls": [f"redis://:{PASSWORD}@127.0.0.1:{c.locks[0].port}/0"]}
    worker = CeleryWorker(
        "config_app",
        "bad",
        cwd=str(APPS),
        log_path=str(tmp_path / "bad.log"),
        env={"CSL_BROKER": broker, "CSL_CONF": json.dumps(conf)},
    )
    try:
        with pytest.raises(RuntimeError, match=r"worker bad exited with [1-9]"):
            worker.start(timeout=60)
    finally:
        worker.kill()
    output = worker.log()
    # One line saying what to change, in the CLI's own "Error:" form, and no traceback.
    errors = [line for line in output.splitlines() if line.startswith("Error: celery_singleton_lock: ")]
    assert len(errors) == 1, output
    assert setting in errors[0]
    assert "Traceback" not in output
    assert " ready." not in output
    assert PASSWORD not in output
