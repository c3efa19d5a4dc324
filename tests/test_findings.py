"""Issue 19's broken promises, each on its own schedule, against real redis-servers and a real prefork worker.

1. Queue scope published a second message when the first publish was slow, or its producer died after publishing:
   a duplicate call that found the reservation still "sending" after 2 s published a job of its own, and both ran.
2. A waiting call (reschedule, replace) whose run failed ran a second time: its fallback copy asked the result
   backend only "did it succeed?".
3. replace: an older call replaced a newer one when its first delivery was re-sent for another reason than a
   duplicate: only the duplicate's re-send carried the first-arrival time.
"""

from __future__ import annotations

import os
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
from celery_singleton_lock.faults import FaultProxy
from celery_singleton_lock.redlock import sibling_key

pytestmark = pytest.mark.slow
TTL = 3.0


@pytest.fixture(scope="module")
def c(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with cluster(tmp_path_factory.mktemp("findings"), ttl=TTL) as c:
        c.worker("f1", concurrency=2)
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


# -- 1. queue scope: a slow publish, a producer that dies after publishing ------------------------------------------


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


# -- 2. a waiting call whose run fails runs once ----------------------------------------------------------------


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


# -- 3. replace orders calls by first arrival, whatever re-sent them -----------------------------------------------


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
