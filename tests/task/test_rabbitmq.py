"""LockedTask on a real RabbitMQ broker, classic and quorum queues, with real ``celery worker`` processes.

Each queue type gets a vhost of its own (tests/rabbitmq.py), three lock nodes, and three workers run with ``-E``:
w1 and w2 on the default queue, w3 alone on queue ``kill`` (a worker the last test SIGKILLs). Celery events are
captured from the same broker, so the tests also check what a monitor (Flower, ``celery events``, a Prometheus
exporter) is told about each delivery.

RabbitMQ differs from Redis where it matters here: a message whose channel closes (a worker killed) is redelivered at
once, not after a visibility timeout, so the copy arrives while the dead run's lease is still live; and on quorum
queues a countdown goes through native delayed delivery, in whole seconds, refusing anything below 1 s.
"""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import rabbitmq
from celery.exceptions import TaskRevokedError
from worker_cluster import APPS, Cluster, cluster, new_key, overlapping, polling

from celery_singleton_lock.testing import CeleryWorker, EventLog, RedisServer, wait_for

pytestmark = pytest.mark.slow

TTL = 5.0


#: The event capture these tests (and test_monitoring) use.
Events = EventLog


@pytest.fixture(scope="module", params=["classic", "quorum"])
def rc(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    queue_type = request.param
    with rabbitmq.vhost() as url:
        tmp = tmp_path_factory.mktemp(f"rabbit-{queue_type}")
        with cluster(tmp, ttl=TTL, broker_url=url, env={"CSL_QUEUE_TYPE": queue_type}) as c:
            c.queue_type = queue_type  # type: ignore[attr-defined]
            c.app_module()
            with ThreadPoolExecutor(3) as pool:
                started = [
                    pool.submit(c.worker, "w1", queues="celery", extra=["-E"]),
                    pool.submit(c.worker, "w2", queues="celery", extra=["-E"]),
                    pool.submit(c.worker, "w3", queues="kill", concurrency=1, extra=["-E"]),
                ]
                for f in started:
                    f.result(timeout=90)
            events = Events(c.app_module().app).start()
            c.events = events  # type: ignore[attr-defined]
            try:
                yield c
            finally:
                events.stop()


def logs(c: Cluster) -> str:
    return "".join(w.log() for w in c.workers)


def test_workers_use_the_queue_type(rc: Cluster) -> None:
    """The module really runs on RabbitMQ with the queue type it names (else the rest proves nothing)."""
    mod = rc.app_module()
    assert mod.app.connection_for_write().transport.driver_type == "amqp"
    with mod.app.connection_for_write() as conn:
        declared = conn.default_channel.queue_declare("celery", passive=True)
    assert declared.queue == "celery"
    arguments = mod.app.amqp.queues["celery"].queue_arguments or {}
    assert arguments.get("x-queue-type") == ("quorum" if rc.queue_type == "quorum" else None)  # type: ignore[attr-defined]


def test_duplicates_are_skipped_across_two_workers_and_reported_as_revoked(rc: Cluster) -> None:
    """Six copies of one job on two workers: one runs; five end REVOKED at once, naming the holder, and every
    monitor is told task-revoked (with the reason and the holder's id) for them, never task-succeeded."""
    mod = rc.app_module()
    events: Events = rc.events  # type: ignore[attr-defined]
    k = new_key()
    first = mod.work.delay(k, 2.0)
    rc.wait_started(k)
    dups = [mod.work.delay(k, 2.0) for _ in range(5)]
    for dup in dups:
        with pytest.raises(TaskRevokedError, match=first.id):
            dup.get(timeout=30)
    assert first.get(timeout=30) == k
    assert len(rc.wait_runs(k, 1, 10)) == 1
    events.wait(first.id, "task-succeeded")
    state = events.state()
    for dup in dups:
        revoked = events.wait(dup.id, "task-revoked")
        assert revoked["holder"] == first.id
        assert revoked["lock_skip"] == "duplicate"
        assert mod.work.lock_key_for(k) in revoked["reason"]
        assert "task-succeeded" not in events.types(dup.id)
        state = events.state()
        assert state.tasks[dup.id].state == "REVOKED"
        assert f"work[{dup.id}] skipped duplicate in" in logs(rc)
        assert f"work[{dup.id}] succeeded" not in logs(rc)
    assert state.tasks[first.id].state == "SUCCESS"


def test_reschedule_runs_each_copy_after_the_holder(rc: Cluster) -> None:
    """lock_on_duplicate='reschedule': the duplicates are re-sent (on quorum queues through native delayed delivery,
    in whole seconds) and each runs after the one before it; a re-send is reported as task-retried, and each task id
    gets exactly one task-succeeded, for its real run."""
    mod = rc.app_module()
    events: Events = rc.events  # type: ignore[attr-defined]
    k = new_key()
    first = mod.work_later.delay(k, 1.5)
    rc.wait_started(k)
    later = [mod.work_later.delay(k, 0.2) for _ in range(2)]
    for r in [first, *later]:
        assert r.get(timeout=60) == k
    runs = rc.wait_runs(k, 3, 10)
    assert len(runs) == 3
    assert not overlapping(runs)
    for r in later:
        retried = events.wait(r.id, "task-retried")
        assert retried["lock_skip"] == "deferred"
        assert "(duplicate)" in retried["reason"]
        events.wait(r.id, "task-succeeded")
        assert events.types(r.id).count("task-succeeded") == 1
        assert events.state().tasks[r.id].state == "SUCCESS"
    if rc.queue_type == "quorum":  # type: ignore[attr-defined]
        # Every re-send's countdown was a whole number of seconds, at least 1.
        import re  # noqa: PLC0415

        countdowns = [float(x) for x in re.findall(r"re-sent to run in ([\d.]+)s", logs(rc))]
        assert countdowns
        assert all(x >= 1 and x == int(x) for x in countdowns), countdowns


def test_retry_keeps_the_job_protected(rc: Cluster) -> None:
    """During a retry's countdown a different duplicate is skipped, and the retry itself runs (and succeeds)."""
    mod = rc.app_module()
    k = new_key()
    first = mod.flaky.delay(k, 2, 1.5)
    # The first run handed the lock over to its retry: the retry's countdown has begun.
    assert rc.wait_holder_state(mod.flaky.lock_key_for(k, 0, 0.0), "retry"), "the job never waited for its retry"
    dup = mod.flaky.delay(k, 0, 0.0)
    with pytest.raises(TaskRevokedError):
        dup.get(timeout=30)
    assert first.get(timeout=60) == 2
    runs = rc.runs(k)
    assert [r[1] for r in runs] == [first.id] * 3
    assert not overlapping(runs)


def test_lock_nodes_down_then_back_the_job_waits_and_runs(rc: Cluster) -> None:
    """With 2 of 3 lock nodes stopped, the job backs off (re-sent with a countdown: 0.5 s, then 1 s, ... which a
    quorum queue only takes in whole seconds) and runs once the nodes are back: never FAILURE, never lost."""
    mod = rc.app_module()
    k = new_key()
    rc.stop_locks(2)
    try:
        result = mod.work.delay(k, 0.0)
        for _ in polling(15, 0.1):
            if logs(rc).count(f"work[{result.id}] waits") >= 2:
                break
        assert logs(rc).count(f"work[{result.id}] waits") >= 2, "no back-off seen"
        assert result.state == "PENDING"
        assert not rc.started(k)
    finally:
        rc.start_locks()
    assert result.get(timeout=30) == k
    assert len(rc.runs(k)) == 1
    # what a monitor saw: the back-off copies as retries, one success, never a failure or a revoke
    events: Events = rc.events  # type: ignore[attr-defined]
    events.wait(result.id, "task-succeeded")
    seen = events.types(result.id)
    assert "task-retried" in seen, seen
    assert seen.count("task-succeeded") == 1, seen
    assert not {"task-failed", "task-revoked"} & set(seen), seen


def test_sigkill_of_a_pool_child_redelivers_at_once_and_the_copy_waits_out_the_lease(rc: Cluster) -> None:
    """acks_late + task_reject_on_worker_lost: the parent requeues the message of a SIGKILLed child, RabbitMQ
    delivers it again at once, while the dead run's lease is live; the copy waits for it and runs once. (A 15 s
    lease: with the module's 5 s one, a redelivery slowed by a busy machine arrived after it, and just ran.)"""
    mod = rc.app_module()
    k = new_key()
    result = mod.work_long_lease.delay(k, 3.0)
    pid = rc.wait_started(k)[0][2]
    os.kill(pid, signal.SIGKILL)
    assert result.get(timeout=90) == k
    assert len(rc.runs(k)) == 1
    assert len(rc.started(k)) == 2
    assert f"work_long_lease[{result.id}] deferred in" in logs(rc), "the copy did not arrive while the lease was live"
    events: Events = rc.events  # type: ignore[attr-defined]
    events.wait(result.id, "task-succeeded")
    seen = events.types(result.id)
    # the copy waiting for its twin (the same task id) sends no event of its own (docs/monitoring.md): a monitor
    # sees the killed run rejected, then the one run that succeeded; never a retry, revoke or failure
    assert "task-rejected" in seen, seen
    assert seen.count("task-succeeded") == 1, seen
    assert not {"task-retried", "task-revoked", "task-failed"} & set(seen), seen


def test_sigkill_of_a_whole_worker_redelivers_at_once_and_the_copy_waits(rc: Cluster) -> None:
    """The whole worker SIGKILLed mid-run: its channel closes, RabbitMQ hands the message to another worker at once,
    the dead run's lease still live; that copy is deferred until the lease ends, then runs once."""
    mod = rc.app_module()
    k = new_key()
    result = mod.work.apply_async((k, 4.0), queue="kill")
    rc.wait_started(k)
    w2 = next(w for w in rc.workers if w.name == "w2")
    w3 = next(w for w in rc.workers if w.name == "w3")
    replies = mod.app.control.add_consumer("kill", destination=[f"w2@{os.uname().nodename}"], reply=True, timeout=5)
    assert replies, "w2 did not start consuming queue kill"
    w3.kill()
    assert result.get(timeout=60) == k
    assert len(rc.runs(k)) == 1
    started = rc.started(k)
    assert len(started) == 2
    assert f"work[{result.id}] deferred in" in w2.log(), "the copy did not arrive while the lease was live"
    # Celery's tracer stores the result before the pool child logs its success line: the line may trail get().
    succeeded = f"work[{result.id}] succeeded in"
    assert wait_for(lambda: succeeded in w2.log(), timeout=10), w2.log()


def test_reasons_are_in_the_event_and_the_result_for_a_skipped_duplicate_with_an_odd_task_id(rc: Cluster) -> None:
    """A holder whose task id holds spaces, ':' and '>' is still named exactly in the event and the stored result."""
    mod = rc.app_module()
    events: Events = rc.events  # type: ignore[attr-defined]
    k = new_key()
    odd = f"odd id: <{k}> 12:3 >"
    first = mod.work.apply_async((k, 1.5), task_id=odd)
    rc.wait_started(k)
    dup = mod.work.delay(k, 0.0)
    with pytest.raises(TaskRevokedError, match="odd id"):
        dup.get(timeout=30)
    assert events.wait(dup.id, "task-revoked")["holder"] == odd
    assert first.get(timeout=30) == k


def test_a_copy_re_sent_twice_carries_no_earlier_x_death(rc: Cluster) -> None:
    """On quorum queues each countdown is a trip through RabbitMQ's delay queues, which dead-letter the message
    and record it in x-death; a copy re-sent again must not carry the last trip's record (RabbitMQ < 4.0.1 drops
    a message it sees cycling): each delivery shows at most its own one trip. Here the re-sends are the outage
    back-off (2 of 3 lock nodes stopped), whole seconds through the delay queues."""
    if rc.queue_type != "quorum":  # type: ignore[attr-defined]
        pytest.skip("x-death comes from native delayed delivery, used with quorum queues only")
    mod = rc.app_module()
    k = new_key()
    rc.stop_locks(2)
    try:
        result = mod.deaths_seen.delay(k, 0.0)
        for _ in polling(20, 0.1):
            if logs(rc).count(f"deaths_seen[{result.id}] waits") >= 3:
                break
        assert logs(rc).count(f"deaths_seen[{result.id}] waits") >= 3, "not re-sent 3 times: the test proved nothing"
    finally:
        rc.start_locks()
    assert result.get(timeout=30) <= 1
    assert len(rc.runs(k)) == 1


def test_quorum_queues_with_a_direct_exchange_are_named_at_worker_start(
    tmp_path: Path, redis_node: RedisServer
) -> None:
    """Celery only warns per message that native delayed delivery cannot use a direct exchange (each countdown copy
    then holds a prefetch slot): the worker says so once at start, naming the queue and what to set."""
    with rabbitmq.vhost() as url:
        conf = {"singleton_lock_urls": [redis_node.url], "task_default_queue_type": "quorum"}
        worker = CeleryWorker(
            "config_app",
            "direct",
            cwd=str(APPS),
            log_path=str(tmp_path / "direct.log"),
            concurrency=1,
            env={"CSL_BROKER": url, "CSL_CONF": json.dumps(conf)},
        )
        try:
            worker.start(timeout=60)
        finally:
            worker.kill()
    lines = [line for line in worker.log().splitlines() if "queue celery" in line and "direct exchange" in line]
    assert len(lines) == 1, worker.log()
    assert "task_default_exchange_type = 'topic'" in lines[0]
