"""LockedTask across real workers: two ``celery worker`` processes, prefork pool, concurrency 2 each.

A broker node and three lock nodes (a 3-node Redlock) are throwaway redis-servers shared by the module; each test
uses its own keys. Runs are recorded by the tasks (start and end timestamps, in Redis) and checked afterwards.
"""

from __future__ import annotations

import importlib
import itertools
import json
import os
import signal
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import redis
from celery.exceptions import TaskRevokedError

from celery_singleton_lock.lock.redlock import Redlock, done_key_for
from celery_singleton_lock.task._delivery import SETTLE_GRACE
from celery_singleton_lock.task._run import SETTLE_HEADER as _SETTLE_HEADER
from celery_singleton_lock.testing import CeleryWorker, RedisServer, redis_servers, wait_for

APPS = Path(__file__).parent.parent / "apps"


class Cluster:
    """The module's servers, workers and the client-side app."""

    def __init__(self, broker: RedisServer, locks: list[RedisServer], tmp: Path) -> None:
        self.broker, self.locks, self.tmp = broker, locks, tmp
        self.env = {
            "CSL_BROKER": broker.url,
            "CSL_LOCK_URLS": ",".join(s.url for s in locks),
            "CSL_RECORD": broker.url.rsplit("/", 1)[0] + "/2",
            "CSL_TTL": "3",
        }
        self.record = redis.Redis.from_url(self.env["CSL_RECORD"])
        self.workers: list[CeleryWorker] = []
        self.mod: ModuleType | None = None

    def start_worker(self, name: str, **kwargs: Any) -> CeleryWorker:
        worker = CeleryWorker(
            "locked_app", name, cwd=str(APPS), log_path=str(self.tmp / f"{name}.log"), env=self.env, **kwargs
        )
        self.workers.append(worker)
        return worker.start()

    def app_module(self) -> ModuleType:
        if self.mod is None:
            os.environ.update(self.env)
            sys.path.insert(0, str(APPS))
            sys.modules.pop("locked_app", None)
            self.mod = importlib.import_module("locked_app")
        return self.mod

    def runs(self, key: str) -> list[list[Any]]:
        return [r for r in (json.loads(x) for x in self.record.lrange("runs", 0, -1)) if r[0] == key]

    def started(self, key: str) -> list[list[Any]]:
        return [r for r in (json.loads(x) for x in self.record.lrange("started", 0, -1)) if r[0] == key]

    def wait_started(self, key: str, timeout: float = 20.0) -> list[list[Any]]:
        """The recorded starts of ``key`` once there is one (polled every 20 ms, for at most ``timeout`` s)."""
        deadline = time.monotonic() + timeout
        while not self.started(key) and time.monotonic() < deadline:
            time.sleep(0.02)
        return self.started(key)

    def broker_messages(self, task_id: str) -> list[dict[str, Any]]:
        """The headers of every message of ``task_id`` in the broker: queued, or held unacked by a worker (a
        countdown copy waits there until it runs)."""
        broker = self.broker.client()
        raw = [json.loads(m)[0] for m in broker.hvals("unacked")]
        raw += [json.loads(m) for m in broker.lrange("celery", 0, -1)]
        return [m["headers"] for m in raw if m["headers"].get("id") == task_id]

    def wait_runs(self, key: str, count: int, timeout: float) -> list[list[Any]]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            runs = self.runs(key)
            if len(runs) >= count:
                return runs
            time.sleep(0.05)
        return self.runs(key)


def overlapping(runs: list[list[Any]]) -> list[tuple[Any, Any]]:
    """Pairs of runs of one key whose [start, end] intervals intersect."""
    spans = sorted((r[3], r[4], r[1]) for r in runs)
    return [(a[2], b[2]) for a, b in itertools.pairwise(spans) if b[0] < a[1]]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    tmp = tmp_path_factory.mktemp("locked")
    with redis_servers(4) as servers:
        c = Cluster(servers[0], servers[1:], tmp)
        try:
            c.start_worker("w1")
            c.start_worker("w2")
            c.app_module()
            yield c
        finally:
            for w in c.workers:
                w.kill()
            sys.path.remove(str(APPS)) if str(APPS) in sys.path else None


def holder_states(cluster: Cluster, name: str) -> list[bytes | None]:
    """The holder record's ``state`` of lock ``name`` on each of the three lock nodes (None: no record)."""
    return [s.client().hget(name, "state") for s in cluster.locks]


def settling_copies(cluster: Cluster, task_id: str) -> int:
    """How many of ``task_id``'s messages in the broker are a copy re-sent for its second look at the result."""
    return sum(1 for h in cluster.broker_messages(task_id) if h.get(_SETTLE_HEADER))


def key() -> str:
    return f"k-{uuid.uuid4().hex[:12]}"


def test_burst_of_duplicates_runs_exactly_once(cluster: Cluster) -> None:
    """Twenty copies of one job sent at once run once; the others end REVOKED at once, naming the holder."""
    mod = cluster.app_module()
    k = key()
    results = [mod.work.delay(k, 1.5) for _ in range(20)]
    revoked, holder_ids = 0, set()
    for r in results:
        try:
            r.get(timeout=30)
        except TaskRevokedError as exc:
            revoked += 1
            assert mod.work.lock_key_for(k) in str(exc)
            holder_ids.update(x.id for x in results if x.id in str(exc))
    runs = cluster.wait_runs(k, 1, 10)
    assert len(runs) == 1
    assert revoked == 19
    assert holder_ids == {runs[0][1]}


def test_different_arguments_run_in_parallel(cluster: Cluster) -> None:
    """Calls with different arguments are different jobs and run at the same time."""
    mod = cluster.app_module()
    a, b = key(), key()
    results = [mod.work.delay(a, 1.5), mod.work.delay(b, 1.5)]
    assert [r.get(timeout=30) for r in results] == [a, b]
    ra, rb = cluster.runs(a)[0], cluster.runs(b)[0]
    assert ra[3] < rb[4] and rb[3] < ra[4], "the two runs should overlap in time"


def test_defaults_and_keywords_are_one_job(cluster: Cluster) -> None:
    """echo(1), echo(1, 'current') and echo(account_id=1) are the same job: one runs, the others are skipped."""
    mod = cluster.app_module()
    account = int(uuid.uuid4().int % 10**9)
    results = [mod.echo.delay(account), mod.echo.delay(account, "current"), mod.echo.delay(account_id=account)]
    outcomes = []
    for r in results:
        try:
            outcomes.append(r.get(timeout=30))
        except TaskRevokedError:
            outcomes.append("revoked")
    assert sorted(map(str, outcomes)) == sorted([str(account), "revoked", "revoked"])


def test_failure_releases_the_lock(cluster: Cluster) -> None:
    """A run that raises releases its lock: the same job sent right after its failure runs."""
    mod = cluster.app_module()
    k = key()
    with pytest.raises(RuntimeError):
        mod.work.delay(k, 0.0, True).get(timeout=30, propagate=True)
    assert mod.work.delay(k, 0.0).get(timeout=30) == k
    assert len(cluster.runs(k)) == 2


def test_release_happens_before_the_result_is_stored(cluster: Cluster) -> None:
    """A caller that waits for the result and re-sends the same job at once is never skipped (20 rounds)."""
    mod = cluster.app_module()
    k = key()
    for _ in range(20):
        assert mod.work.delay(k, 0.0).get(timeout=30) == k
    assert len(cluster.runs(k)) == 20


def test_long_task_keeps_its_lock_past_ten_ttls(cluster: Cluster) -> None:
    """A task running 10x its 0.6 s ttl keeps the lock (renewed), and duplicates sent meanwhile are skipped."""
    mod = cluster.app_module()
    k = key()
    first = mod.long_work.delay(k, 6.0)
    cluster.wait_started(k)
    dups = []
    for _ in range(5):
        time.sleep(0.9)
        dups.append(mod.long_work.delay(k, 0.1))
    assert first.get(timeout=30) == [True, True]
    for d in dups:
        with pytest.raises(TaskRevokedError):
            d.get(timeout=30)
    assert len(cluster.runs(k)) == 1


def test_retry_keeps_the_job_protected(cluster: Cluster) -> None:
    """During a retry's countdown a different duplicate is skipped, and the retry itself runs (and succeeds)."""
    mod = cluster.app_module()
    k = key()
    first = mod.flaky.delay(k, 2, 1.5)
    # The first run handed the lock over to its retry: the retry's countdown has begun.
    name = mod.flaky.lock_key_for(k, 0, 0.0)
    assert wait_for(lambda: holder_states(cluster, name).count(b"retry") >= 2, timeout=20, interval=0.005)
    dup = mod.flaky.delay(k, 0, 0.0)
    with pytest.raises(TaskRevokedError):
        dup.get(timeout=30)
    assert first.get(timeout=30) == 2
    runs = cluster.runs(k)
    assert [r[1] for r in runs] == [first.id] * 3
    assert not overlapping(runs)


def test_a_retry_that_gives_up_leaves_no_reservation(cluster: Cluster) -> None:
    """A body that catches MaxRetriesExceededError and returns ends in SUCCESS with its lock released: the same job
    sent again at once runs (it used to be skipped as a duplicate of a retry that was never sent)."""
    app = cluster.app_module()
    k = key()
    assert app.give_up.delay(k).get(timeout=20) == "gave up"
    assert app.give_up.delay(k).get(timeout=20) == "gave up"
    assert len(cluster.runs(k)) == 2


@pytest.mark.parametrize("rest", [1.5, 0.05])
def test_retry_without_throw_hands_over_only_when_the_body_ends(cluster: Cluster, rest: float) -> None:
    """retry(countdown=0, throw=False) sends the retry at once while the body goes on (long or short): the retry
    runs after the first attempt's body ended, never beside it, and is never dropped because that body's return
    stored SUCCESS for the task id."""
    app = cluster.app_module()
    k = key()
    app.no_throw.delay(k, rest)
    runs = cluster.wait_runs(k, 2, 30)
    assert len(runs) == 2
    assert overlapping(runs) == []


def test_polling_with_retry_without_throw_runs_every_attempt(cluster: Cluster) -> None:
    """A job that polls with retry(throw=False) (each attempt sends the next and goes on) runs every attempt, one
    at a time: a later attempt is not taken for a copy of a finished job."""
    app = cluster.app_module()
    k = key()
    app.poll_no_throw.delay(k, 3, 0.3)
    runs = cluster.wait_runs(k, 4 + 3, 40)  # 4 attempts; the first 3 also record their 'rest'
    assert len(runs) == 7
    assert overlapping(runs) == []


def test_raise_retry_hands_over_only_after_the_body_unwound(cluster: Cluster) -> None:
    """raise self.retry() inside a with-block whose exit takes 0.5 s: the retry enters its own section only after
    the first attempt's exit ran (it used to start beside the unwinding body)."""
    app = cluster.app_module()
    k = key()
    assert app.retry_in_section.delay(k).get(timeout=30) == 1
    runs = cluster.wait_runs(k, 2, 10)
    assert len(runs) == 2
    assert overlapping(runs) == []


def test_a_retry_is_a_new_attempt_for_the_lock_headers(cluster: Cluster) -> None:
    """A retry inherits neither the outage attempt count nor the redelivery mark of the delivery that sent it."""
    app = cluster.app_module()
    result = app.header_probe.apply_async((key(),), headers={"singleton_lock_attempt": 4, "singleton_lock_waited": 1})
    assert result.get(timeout=30) == [None, None]


def test_done_marker_window_follows_the_delivery(cluster: Cluster) -> None:
    """A plain success keeps its done marker for the short window; a retried job's and a redelivered copy's success
    keep it for the whole window (a retry never asks the backend, and another copy of a redelivered message may
    still come: the original of a visibility-timeout restore)."""
    app = cluster.app_module()
    lock_client = redis.Redis.from_url(cluster.env["CSL_LOCK_URLS"].split(",")[0])
    plain, retried, redelivered = key(), key(), key()
    r1 = app.work.delay(plain)
    r2 = app.flaky.delay(retried, 1, 0.2)
    r3 = app.work.apply_async((redelivered,), headers={"singleton_lock_waited": 1})
    for r in (r1, r2, r3):
        r.get(timeout=30)

    def marker_ttl(task: Any, k: str, task_id: str) -> int:
        return int(lock_client.pttl(done_key_for(task.lock_key_for(k), task_id)))

    assert 0 < marker_ttl(app.work, plain, r1.id) <= 60_000
    # a retry's marker is its only proof of success (it never asks the backend): the whole window
    assert int(lock_client.pttl(done_key_for(app.flaky.lock_key_for(retried, 1, 0.2), r2.id))) > 3_600_000
    assert marker_ttl(app.work, redelivered, r3.id) > 3_600_000


def test_a_finished_job_whose_result_was_never_stored_does_not_leave_its_caller_waiting(cluster: Cluster) -> None:
    """A run killed after its release wrote the done marker but before Celery stored SUCCESS finished the job and
    stored nothing: its redelivered copy stops on the marker and stores REVOKED saying so, instead of leaving the
    task id PENDING forever (found by the soak)."""
    app = cluster.app_module()
    k = key()
    task_id = f"finished-{uuid.uuid4().hex[:8]}"
    killed_run = Redlock(cluster.env["CSL_LOCK_URLS"].split(","), app.work.lock_key_for(k), ttl=5, job=task_id)
    assert killed_run.acquire(blocking=False)
    killed_run.finish(done_for=60, waited_for=60)  # ... and the process died before storing its result
    result = app.work.apply_async((k,), task_id=task_id)
    with pytest.raises(TaskRevokedError, match="already ran"):
        result.get(timeout=20)
    assert cluster.runs(k) == []


def test_a_copy_that_finds_its_job_done_waits_for_the_twin_s_result(cluster: Cluster) -> None:
    """A copy that stops on the done marker while the twin that wrote it has not stored its SUCCESS yet (the gap
    between the release and the result store) does not store REVOKED at once: it looks again after a grace, and
    the caller gets the twin's result (REVOKED used to reach the waiter first, and could overwrite the SUCCESS)."""
    app = cluster.app_module()
    k = key()
    task_id = f"twin-{uuid.uuid4().hex[:8]}"
    twin = Redlock(cluster.env["CSL_LOCK_URLS"].split(","), app.work.lock_key_for(k), ttl=5, job=task_id)
    assert twin.acquire(blocking=False)
    twin.finish(done_for=60, waited_for=60)  # the twin released; its SUCCESS is stored a moment later:
    result = app.work.apply_async((k,), task_id=task_id)
    # The copy ran, found the marker and no result, and re-sent itself for a second look: that message waits,
    # held unacked by a worker, for SETTLE_GRACE s. Seeing it proves the copy ran (and stored nothing).
    assert wait_for(lambda: settling_copies(cluster, task_id) == 1, timeout=20), cluster.broker_messages(task_id)
    assert result.state == "PENDING"
    app.work.backend.mark_as_done(task_id, "the twin's result")
    assert result.get(timeout=30) == "the twin's result"
    # The second look ran (its message is gone) and, finding SUCCESS, left it alone.
    assert wait_for(lambda: not cluster.broker_messages(task_id), timeout=SETTLE_GRACE + 30)
    assert app.work.AsyncResult(task_id).state == "SUCCESS"
    assert cluster.runs(k) == []


def test_sigkill_of_pool_child_redelivers_and_runs_once_more(cluster: Cluster) -> None:
    """SIGKILL of the pool process mid-task (acks_late, reject_on_worker_lost): the redelivery starts only after the
    child is dead (its lease ended by the worker's main process once Celery reports the child lost, or run out),
    and runs to completion exactly once."""
    mod = cluster.app_module()
    k = key()
    result = mod.work.delay(k, 2.0)
    cluster.wait_started(k)
    pid = cluster.started(k)[0][2]
    os.kill(pid, signal.SIGKILL)
    killed_at = time.time()
    assert result.get(timeout=60) == k
    runs = cluster.runs(k)
    assert len(runs) == 1
    started = cluster.started(k)
    assert len(started) == 2
    assert runs[0][1] == result.id
    # Never beside the dead run: the main process ends its lease only once billiard has reaped the child (a paused
    # child keeps its lease: tests/task/test_locked_task_faults.py), so the redelivery starts after the kill.
    assert started[1][3] >= killed_at, (started[1][3], killed_at)


def test_enqueue_check_returns_the_running_job_instead_of_sending(cluster: Cluster) -> None:
    """With lock_enqueue_check, a job sent while the same job runs gets the running job's AsyncResult (no second
    message); once it has finished, the same job is sent and runs again."""
    mod = cluster.app_module()
    k = key()
    first = mod.enq_work.delay(k, 1.5)
    cluster.wait_started(k)
    second = mod.enq_work.delay(k, 1.5)
    assert second.id == first.id
    assert first.get(timeout=30) == k
    third = mod.enq_work.delay(k, 0.0)
    assert third.id != first.id
    assert third.get(timeout=30) == k
    assert [r[1] for r in cluster.runs(k)] == [first.id, third.id]
