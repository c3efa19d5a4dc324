"""A job runs once however many messages of it exist, and never stops running for good: a duplicate's stand-in copy
of a job whose publish is slow, a producer that dies after its publish, a waiting call whose run fails, an older
call re-sent for a sending holder (replace), a copy killed by its hard time limit, a message rejected and
dead-lettered back, the callback and expiry of a job that ran as a copy, a revoked message of a dead producer.

Real redis-servers, one real prefork worker for the module (tests/apps/review_core_app.py: locked_app's tasks and a
few of its own).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery
from worker_cluster import APPS, Cluster, cluster, new_key, polling

from celery_singleton_lock import LockedTask
from celery_singleton_lock.lock.redlock import sibling_key
from celery_singleton_lock.testing import CeleryWorker
from celery_singleton_lock.testing.faults import FaultProxy

pytestmark = pytest.mark.slow
TTL = 3.0


def start_worker(c: Cluster, name: str, concurrency: int = 2) -> CeleryWorker:
    worker = CeleryWorker(
        "review_core_app",
        name,
        cwd=str(APPS),
        log_path=str(c.tmp / f"{name}.log"),
        concurrency=concurrency,
        env=c.env,
    )
    c.workers.append(worker)
    return worker.start()


def client(c: Cluster) -> Any:
    """review_core_app as the Redis cluster's client sees it (imported once: its tasks live on that cluster's app)."""
    c.app_module()
    import review_core_app  # noqa: PLC0415 - configured from the cluster's env by app_module()

    return review_core_app


@pytest.fixture(scope="module")
def c(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with cluster(tmp_path_factory.mktemp("copies"), ttl=TTL) as c:
        start_worker(c, "rc1")
        c.app_module()
        yield c


def handled(c: Cluster, task_id: str) -> int:
    """How many deliveries of ``task_id`` a worker has finished handling (run, skipped or stopped)."""
    return sum(1 for x in c.record.lrange("handled", 0, -1) if x.decode() == task_id)


def wait_handled(c: Cluster, task_id: str, count: int, timeout: float) -> int:
    for _ in polling(timeout):
        if handled(c, task_id) >= count:
            break
    return handled(c, task_id)


def run_ids(c: Cluster, key: str) -> list[str]:
    return [r[1] for r in c.runs(key)]


def test_the_original_of_a_copy_killed_by_its_hard_time_limit_does_not_run_again(c: Cluster) -> None:
    """A's publish reaches the broker 6 s late; B's delay() sends a copy of A's job after 2 s, which runs first and
    is killed by its 1 s hard time limit (FAILURE: the job ended). A's own message then arrives and must stop; it
    runs the job a second time (a first delivery that finds the key free never asks the result backend, and a
    killed run leaves no done marker)."""
    mod = client(c)
    with FaultProxy(c.broker.port) as proxy:
        slow = Celery(f"slow-{uuid.uuid4().hex[:6]}", broker=proxy.url, set_as_current=False)
        slow.conf.update(result_backend=c.env["CSL_BACKEND"], singleton_lock_urls=c.lock_urls, singleton_lock_ttl=TTL)

        @slow.task(
            base=LockedTask,
            bind=True,
            lock_unique_on=["key"],
            lock_scope="queue",
            name=mod.q_limited.name,
            shared=False,
        )
        def q_limited(self: Any, key: str, duration: float = 0.0) -> str:  # the worker's q_limited
            return key  # pragma: no cover - runs in the worker

        try:
            q_limited.delay(new_key("warm")).get(timeout=30)  # the connection is open before the link slows
            proxy.delay(6.0, direction="upstream")
            k = new_key()
            sent: dict[str, Any] = {}
            thread = threading.Thread(target=lambda: sent.setdefault("a", q_limited.delay(k, 0.0)), daemon=True)
            thread.start()
            time.sleep(0.4)
            b = mod.q_limited.delay(k, 5.0)  # B's copy (its own arguments) overruns the hard time limit
            thread.join(30)
            a = sent["a"]
            assert b.id == a.id
            for _ in polling(30):
                if len(c.started(k)) >= 2 or (mod.app.AsyncResult(a.id).state == "FAILURE" and len(c.started(k)) >= 1):
                    break
            time.sleep(3.0)  # A's own message arrives 6 s after its call: let it be handled
        finally:
            proxy.clear()
            slow.close()
    started = [r[1] for r in c.started(k)]
    assert started == [a.id], f"job {a.id} ran {len(started)} times: its copy's FAILURE did not stop its original"


@pytest.fixture
def dlx(tmp_path: Any) -> Iterator[Cluster]:
    import rabbitmq  # noqa: PLC0415 - skips (or fails under CI) when no RabbitMQ runs here

    with rabbitmq.vhost() as url:
        queue = f"rc-{uuid.uuid4().hex[:6]}"
        with cluster(tmp_path, ttl=TTL, broker_url=url, env={"CSL_DLX": queue}) as c:
            worker = CeleryWorker(
                "review_core_app",
                "dlx1",
                cwd=str(APPS),
                log_path=str(tmp_path / "dlx1.log"),
                concurrency=1,
                env=c.env,
                extra=["-Q", queue],
            )
            c.workers.append(worker)
            worker.start()
            yield c


def test_a_message_rejected_without_requeue_runs_again_when_dead_lettered_back(dlx: Cluster) -> None:
    """A body raises Reject(requeue=False) (acks_late) on RabbitMQ whose queue dead-letters through a 1 s retry
    queue back to itself (Celery's documented use of Reject): the message comes back and must run. After 41ad257 the
    rejected run leaves a done marker ("a failure is an end"; Celery stores no state for a Reject), so the returning
    message stops as "already ran", and 10 s later REVOKED is stored: the job is lost."""
    # By name, on this cluster's own app: review_core_app stays the Redis cluster's client module (importing it
    # again over another app would register its tasks twice in this process).
    app = dlx.app_module().app
    main = dlx.env["CSL_DLX"]
    sys.path.insert(0, str(APPS))
    try:
        from dlx_queues import dlx_queues  # noqa: PLC0415 - the worker's queues; no task is registered by it
    finally:
        sys.path.remove(str(APPS))
    queues = dlx_queues(main)
    with app.connection_for_write() as conn:  # the worker declares only the queue it consumes
        for queue in queues:
            queue(conn.default_channel).declare()
    k = new_key()
    # The Queue itself, not its name: Celery declares what it publishes to, and a plain name would be declared
    # without the dead-letter arguments (PRECONDITION_FAILED on RabbitMQ).
    result = app.send_task("review_core_app.reject_once", (k,), queue=queues[0])
    dlx.wait_runs(k, 2, 20)
    assert [r[1] for r in dlx.runs(k)] == [result.id, result.id], "the dead-lettered message did not run"


@pytest.mark.xfail(
    strict=True,
    reason="documented limit (guarantees.md, queue scope): a call whose job ran as another call's copy keeps its job's "
    "result but not its own link callbacks and chain (the copy carries its sender's); running them from the stopped "
    "original would run them twice after a plain redelivery, which stops the same way",
)
def test_the_callback_of_a_call_whose_job_ran_as_a_copy_still_runs(c: Cluster) -> None:
    """A calls with ``link=`` and its publish reaches the broker 4 s late; B's plain delay() meanwhile sends a copy
    of A's job (B's options: no link), which runs first; A's own message then stops as "already ran", with its
    callbacks cleared: A's job succeeded under A's id, and A's link never runs."""
    mod = client(c)
    with FaultProxy(c.broker.port) as proxy:
        slow = Celery(f"slow-{uuid.uuid4().hex[:6]}", broker=proxy.url, set_as_current=False)
        slow.conf.update(result_backend=c.env["CSL_BACKEND"], singleton_lock_urls=c.lock_urls, singleton_lock_ttl=TTL)

        @slow.task(
            base=LockedTask,
            bind=True,
            lock_unique_on=["key"],
            lock_scope="queue",
            name=mod.q_limited.name,
            shared=False,
        )
        def q_limited(self: Any, key: str, duration: float = 0.0) -> str:  # the worker's q_limited
            return key  # pragma: no cover - runs in the worker

        try:
            q_limited.delay(new_key("warm")).get(timeout=30)  # the connection is open before the link slows
            proxy.delay(4.0, direction="upstream")
            k, link_id = new_key(), f"link-{uuid.uuid4().hex[:8]}"
            link = mod.app.signature("locked_app.collect").set(task_id=link_id)
            sent: dict[str, Any] = {}
            thread = threading.Thread(
                target=lambda: sent.setdefault("a", q_limited.apply_async((k, 0.0), link=link)), daemon=True
            )
            thread.start()
            time.sleep(0.4)
            b = mod.q_limited.delay(k, 0.0)
            thread.join(30)
            a = sent["a"]
            assert b.id == a.id
            assert a.get(timeout=30) == k
            # A's own message arrives ~4 s after its call and ends (stopped as "already ran"): the worker logs its
            # second end. Its link, were it sent, is sent by that delivery's handling: a few seconds more for it.
            ended = re.compile(rf"Task {re.escape(mod.q_limited.name)}\[{a.id}\] (?!received)")
            for _ in polling(15):
                if len(ended.findall("".join(w.log() for w in c.workers))) >= 2:
                    break
            for _ in polling(5):
                if len(c.results.keys(f"celery-task-meta-{link_id}")) > 0:
                    break
        finally:
            proxy.clear()
            slow.close()
    assert [r[1] for r in c.runs(k)] == [a.id]
    assert mod.app.AsyncResult(link_id).state == "SUCCESS", "A's job succeeded, but A's link callback never ran"


def test_a_stand_in_copy_does_not_carry_its_callers_expiry_onto_the_job(c: Cluster) -> None:
    """The worker is busy. A calls (no expiry) and its publish reaches the broker 4 s late; B calls 0.4 s later with
    ``expires=1`` and, after 2 s, sends a copy of A's job: with B's expiry. When the worker frees up, the copy has
    expired: the worker revokes A's task id (REVOKED stored, the id added to its revoked set), and A's own message,
    next in the queue, is then revoked too: A's job, which A asked to run whenever, never runs."""
    mod = client(c)
    with FaultProxy(c.broker.port) as proxy:
        slow = Celery(f"slow-{uuid.uuid4().hex[:6]}", broker=proxy.url, set_as_current=False)
        slow.conf.update(result_backend=c.env["CSL_BACKEND"], singleton_lock_urls=c.lock_urls, singleton_lock_ttl=TTL)

        @slow.task(
            base=LockedTask,
            bind=True,
            lock_unique_on=["key"],
            lock_scope="queue",
            name=mod.q_limited.name,
            shared=False,
        )
        def q_limited(self: Any, key: str, duration: float = 0.0) -> str:  # the worker's q_limited
            return key  # pragma: no cover - runs in the worker

        name = new_key("gate")
        try:
            q_limited.delay(new_key("warm")).get(timeout=30)  # the connection is open before the link slows
            for _ in range(2):  # both pool processes, until the gate opens: the job's messages wait in the queue
                c.app_module().gate.delay(name)
            for _ in polling(20):
                if c.record.lrange("gated", 0, -1).count(name.encode()) >= 2:
                    break
            assert c.record.lrange("gated", 0, -1).count(name.encode()) == 2, "the pool processes are not both busy"
            proxy.delay(4.0, direction="upstream")
            k = new_key()
            sent: dict[str, Any] = {}
            thread = threading.Thread(target=lambda: sent.setdefault("a", q_limited.delay(k, 0.0)), daemon=True)
            thread.start()
            time.sleep(0.4)
            b = mod.q_limited.apply_async((k, 0.0), expires=1.0)
            thread.join(30)
            a = sent["a"]
            assert b.id == a.id
            time.sleep(1.5)  # the copy's expiry has passed, and A's message is in the queue behind it
        finally:
            c.record.set(f"gate:{name}", 1)
            proxy.clear()
            slow.close()
    c.wait_runs(k, 1, 20)
    assert [r[1] for r in c.runs(k)] == [a.id], f"A's job never ran: {mod.app.AsyncResult(a.id).state}"


PRODUCER_DIES = textwrap.dedent(
    """
    import os, sys
    from celery_singleton_lock import redlock
    import locked_app

    def die(*args, **kwargs):  # the producer exits between its publish and marking the reservation sent
        os._exit(0)

    redlock.Redlock.transfer = die
    locked_app.q_work.apply_async((sys.argv[1], 0.1), task_id=sys.argv[2])
    os._exit(3)  # not reached: transfer runs right after the publish
    """
)


def test_a_revoked_message_of_a_producer_that_died_after_its_publish_frees_its_job(c: Cluster) -> None:
    """A's producer dies between its publish and marking the reservation sent, while the worker is busy; A is
    revoked, and the worker meets its message ("a revoked or expired message frees its reservation when a worker
    meets it"); the same job is then called again and must run. After 41ad257 the reservation stays "sending" for
    the whole lock_queue_ttl (600 s; 10 s before) and only a "queued" one is freed, so the new call sends a copy
    of A's job under A's revoked id, which the worker discards: the job cannot run for 10 minutes (and
    ``revoke_queued(A)`` returns False and revokes nothing, for as long)."""
    mod = c.app_module()
    name = new_key("gate")
    for _ in range(2):  # both pool processes, until the gate opens: A's message waits in the queue
        mod.gate.delay(name)
    try:
        for _ in polling(20):
            if c.record.lrange("gated", 0, -1).count(name.encode()) >= 2:
                break
        assert c.record.lrange("gated", 0, -1).count(name.encode()) == 2, "the pool processes are not both busy"
        k, a_id = new_key(), f"a-{uuid.uuid4().hex[:8]}"
        env = {**os.environ, **c.env, "PYTHONPATH": f"{APPS}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
        done = subprocess.run(
            [sys.executable, "-c", PRODUCER_DIES, k, a_id], env=env, cwd=str(APPS), timeout=60, check=False
        )
        assert done.returncode == 0, "the producer did not die at the point it marks the reservation sent"
        mod.app.control.revoke(a_id)
        time.sleep(1.0)  # the broadcast reaches the worker
    finally:
        c.record.set(f"gate:{name}", 1)  # free the pool, also when an assertion failed
    for _ in polling(20):
        if mod.app.AsyncResult(a_id).state == "REVOKED":
            break
    assert mod.app.AsyncResult(a_id).state == "REVOKED", "the worker did not meet A's revoked message"
    again = mod.q_work.delay(k, 0.1)
    for _ in polling(30):
        if c.runs(k):
            break
    assert [r[1] for r in c.runs(k)] == [again.id], f"the job did not run again ({again.id}; A was {a_id})"


# -- queue scope: a slow publish, a producer that dies after publishing ------------------------------------------------


def test_a_duplicate_during_a_slow_publish_sends_a_copy_of_that_job_not_a_second_job(c: Cluster) -> None:
    """Producer A's publish reaches the broker 3 s late (a slow link); B's delay() 0.4 s later gets A's job, and
    the job runs once (before the fix B published a job of its own after 2 s, and both ran)."""
    mod = c.app_module()
    with FaultProxy(c.broker.port) as proxy:
        slow = Celery(f"slow-{uuid.uuid4().hex[:6]}", broker=proxy.url, set_as_current=False)
        slow.conf.update(result_backend=c.env["CSL_BACKEND"], singleton_lock_urls=c.lock_urls, singleton_lock_ttl=TTL)

        @slow.task(
            base=LockedTask,
            bind=True,
            lock_unique_on=["key"],
            lock_scope="queue",
            name="locked_app.q_work",
            shared=False,
        )
        def q_work(self: Any, key: str, duration: float = 0.0, note: Any = None) -> str:  # the worker's q_work
            return key  # pragma: no cover - runs in the worker

        try:
            warm = new_key("warm")
            q_work.delay(warm).get(timeout=30)  # the producer's broker connection is open before the link slows
            proxy.delay(3.0, direction="upstream")
            k = new_key()
            sent: dict[str, Any] = {}
            thread = threading.Thread(target=lambda: sent.setdefault("a", q_work.delay(k, 0.1)), daemon=True)
            thread.start()
            time.sleep(0.4)
            b = mod.q_work.delay(k, 0.1)
            thread.join(30)
            a = sent["a"]
            assert b.id == a.id, "B's delay() started a job of its own while A's publish was under way"
            assert a.get(timeout=30) == k
            assert wait_handled(c, a.id, 2, 30) == 2, "the copy and A's own message were not both handled"
            assert run_ids(c, k) == [a.id]
        finally:
            proxy.clear()
            slow.close()


def test_a_producer_that_dies_after_its_publish_leaves_one_job(c: Cluster) -> None:
    """A's producer exits between its publish and marking the reservation sent, while the worker is busy, so its
    message waits: a call 0.4 s later, and one 11 s later (past the old 10 s "sending" lease), get A's job, and the
    job runs once when the worker frees up (before the fix each published a job of its own, and they ran)."""
    mod = c.app_module()
    name = new_key("gate")
    for _ in range(2):  # both pool processes, until the gate opens: A's message waits in the queue
        mod.gate.delay(name)
    try:
        for _ in polling(20):
            if c.record.lrange("gated", 0, -1).count(name.encode()) >= 2:
                break
        assert c.record.lrange("gated", 0, -1).count(name.encode()) == 2, "the pool processes are not both busy"
        k, a_id = new_key(), f"a-{uuid.uuid4().hex[:8]}"
        env = {**os.environ, **c.env, "PYTHONPATH": f"{APPS}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
        done = subprocess.run(
            [sys.executable, "-c", PRODUCER_DIES, k, a_id], env=env, cwd=str(APPS), timeout=60, check=False
        )
        assert done.returncode == 0, "the producer did not die at the point it marks the reservation sent"
        time.sleep(0.4)
        b = mod.q_work.delay(k, 0.1)
        assert b.id == a_id
        time.sleep(11.0 - 0.4)
        late = mod.q_work.delay(k, 0.1)
        assert late.id == a_id, "a call after 10 s started a second job while A's message still waits in the queue"
    finally:
        c.record.set(f"gate:{name}", 1)  # free the pool, also when an assertion failed
    assert mod.q_work.AsyncResult(a_id).get(timeout=40) == k
    assert wait_handled(c, a_id, 3, 30) == 3, "A's message and both copies were not all handled"
    assert run_ids(c, k) == [a_id]


# -- a waiting call whose run fails runs once --------------------------------------------------------------------------


@pytest.mark.parametrize("task", ["later_or_fail", "latest_or_fail"])
def test_a_waiting_call_whose_run_fails_runs_once(c: Cluster, task: str) -> None:
    """A call waits behind a 1.5 s holder, is woken when it ends, runs and fails; its fallback copy then stops
    instead of running the job again (before the fix it asked the backend only "succeeded?", and ran it again)."""
    mod = c.app_module()
    fn = getattr(mod, task)
    k = new_key()
    extra: tuple[Any, ...] = (k,) if task == "later_or_fail" else (k, "v")
    holder = fn.apply_async((*extra, 1.5))
    c.wait_started(k, 1)
    waiting = fn.apply_async((*extra, 0.0, True))
    with pytest.raises(RuntimeError, match="failing on purpose"):
        waiting.get(timeout=30, propagate=True)
    assert holder.get(timeout=30) in (k, "v")
    # The first delivery, the copy the holder's release woke, and the fallback copy (a lease away).
    assert wait_handled(c, waiting.id, 3, 3 * TTL + 10) == 3
    time.sleep(0.5)  # the last copy's handling ends after its postrun record; nothing more may run
    assert run_ids(c, k).count(waiting.id) == 1, "the failed job ran a second time"
    assert mod.app.AsyncResult(waiting.id).state == "FAILURE"


# -- replace orders calls by first arrival, whatever re-sent them ------------------------------------------------------


def test_an_older_call_re_sent_for_a_sending_holder_does_not_replace_a_newer_one(c: Cluster) -> None:
    """The older call O first reaches a worker while a "sending" reservation holds the key, and is re-sent (3 s);
    meanwhile H runs and the newer call N waits. O's copy must not replace N: calls are ordered by first arrival
    (before the fix, O's copy counted as arriving when the copy arrived, and replaced N)."""
    mod = c.app_module()
    k = new_key()
    key = mod.latest_slow.lock_key_for(k, "x")
    for server in c.locks:  # another job's reservation whose publish is under way: O is re-sent, not parked
        with c.lock_client(server) as client:
            client.hset(key, mapping={"owner": "other-owner", "job": "other-job", "state": "sending"})
            client.pexpire(key, 6000)
    old = mod.latest_slow.apply_async((k, "old", 0.0))
    assert wait_handled(c, old.id, 1, 20) == 1
    for server in c.locks:
        with c.lock_client(server) as client:
            client.delete(key)
    holder = mod.latest_slow.apply_async((k, "holder", 4.0))
    c.wait_started(k, 1)
    new = mod.latest_slow.apply_async((k, "new", 0.0))
    line = sibling_key(key, ":waiters")
    with c.lock_client(c.locks[0]) as client:
        for _ in polling(10, 0.02):
            if client.zscore(line, new.id) is not None:
                break
        assert client.zscore(line, new.id) is not None, "the newer call did not wait in line"
    assert holder.get(timeout=30) == "holder"
    assert new.get(timeout=30) == "new"
    assert wait_handled(c, old.id, 2, 20) >= 2
    values = [r[1] for r in c.runs(k)]
    assert old.id not in values, "the older call replaced the newer one"
    assert values == [holder.id, new.id]
