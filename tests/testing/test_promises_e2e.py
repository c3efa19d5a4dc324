"""Promises of the README that had no end-to-end test, each checked with real workers on real redis-servers.

One module-wide cluster (a broker and three lock nodes, tests/worker_cluster.py) and one worker running
tests/apps/promises_app.py (locked_app's tasks and three more); the worker-start checks start their own short-lived
``celery worker`` processes. Each docstring quotes or names the README sentence it checks; those sections are now pages
of docs/: queue scope, per-key limits and the done window in docs/guarantees.md, Policies in docs/policies.md, the
chord members' answer in docs/faq.md.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import importlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest
from celery import Celery, chain, chord
from celery.beat import ScheduleEntry, Scheduler
from celery.exceptions import TaskRevokedError
from worker_cluster import APPS, Cluster, cluster, new_key, overlapping, polling

from celery_singleton_lock.testing import CeleryWorker, RedisServer

pytestmark = pytest.mark.slow
TTL = 3.0
VISIBILITY = 3600.0  # locked_app's broker visibility timeout (CSL_VISIBILITY unset)


@pytest.fixture(scope="module")
def c(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with cluster(tmp_path_factory.mktemp("promises"), ttl=TTL) as c:
        c.app_module()
        worker = CeleryWorker(
            "promises_app", "p1", cwd=str(APPS), log_path=str(c.tmp / "p1.log"), concurrency=2, env=c.env
        )
        c.workers.append(worker)  # killed by the cluster's teardown, even if it never became ready
        worker.start()
        try:
            yield c
        finally:
            sys.modules.pop("promises_app", None)


@pytest.fixture(scope="module")
def p(c: Cluster) -> ModuleType:
    """promises_app as the client sees it (its tasks on the cluster's app)."""
    sys.modules.pop("promises_app", None)
    return importlib.import_module("promises_app")


def reserved(c: Cluster, key: str) -> dict[bytes, bytes]:
    """The holder record of ``key`` on the first lock node ({} when free)."""
    with contextlib.closing(c.lock_client(c.locks[0])) as client:
        return dict(client.hgetall(key))


def received(c: Cluster, task_id: str) -> int:
    """How many messages of ``task_id`` the worker received (its INFO log line per message)."""
    return sum(w.log().count(f"[{task_id}] received") for w in c.workers)


def marks(c: Cluster) -> list[str]:
    return [m.decode() for m in c.record.lrange("marks", 0, -1)]


def outcome(result: object) -> str:
    """The task's return value, or "revoked" when it was skipped."""
    try:
        return str(result.get(timeout=30))  # type: ignore[attr-defined]
    except TaskRevokedError:
        return "revoked"


def done_markers(c: Cluster, task_id: str) -> list[int]:
    """PTTL (ms) of ``task_id``'s done marker on each lock node that has one."""
    out = []
    for server in c.locks:
        with contextlib.closing(c.lock_client(server)) as client:
            out += [int(client.pttl(k)) for k in client.scan_iter(match=f"*:done:{task_id}*")]
    return out


def drop_done_markers(c: Cluster, task_id: str) -> None:
    """What the end of the done window does: the marker is gone from every node."""
    for server in c.locks:
        with contextlib.closing(c.lock_client(server)) as client:
            for k in list(client.scan_iter(match=f"*:done:{task_id}*")):
                client.delete(k)


# -- queue scope -----------------------------------------------------------------------------------------------


def test_a_backlog_longer_than_lock_queue_ttl_lets_a_second_copy_out_that_never_runs_alongside(
    c: Cluster, p: ModuleType
) -> None:
    """README, queue scope: "a backlog longer than [countdown + lock_queue_ttl] lets a second copy be published (the
    worker's run-time check still never runs two at once)": lock_queue_ttl=1, a queue nobody reads yet."""
    k = new_key()
    queue = f"backlog-{k}"
    first = p.q_short.apply_async((k, 1.0), queue=queue)
    assert p.q_short.apply_async((k, 1.0), queue=queue).id == first.id  # reserved while within lock_queue_ttl
    key = p.q_short.lock_key_for(k, 1.0)
    for _ in polling(10, 0.1):
        if not reserved(c, key):
            break
    second = p.q_short.apply_async((k, 1.0), queue=queue)
    assert second.id != first.id, "a backlog past lock_queue_ttl still got the first job: nothing was published"
    replies = p.app.control.add_consumer(queue, reply=True, timeout=5)
    assert replies, "the worker did not start reading the backlog's queue"
    outcomes = [outcome(first), outcome(second)]
    assert set(outcomes) <= {k, "revoked"}
    runs = c.wait_runs(k, outcomes.count(k), 10)
    assert len(runs) == outcomes.count(k) >= 1
    assert not overlapping(runs)


def test_a_chain_member_is_published_and_checked_at_the_worker(c: Cluster, p: ModuleType) -> None:
    """README, queue scope: chain members "are checked at the worker only": a chain whose first member duplicates a
    queued job is published, skipped by the worker (REVOKED "skipped ... held by task <holder>"), and the chain
    stops there."""
    mod = c.app_module()
    k = new_key()
    first = mod.q_work.apply_async((k, 0.5), countdown=1)
    tail = chain(mod.q_work.si(k, 0.0), p.mark.si(f"chain-{k}")).apply_async()
    member = tail.parent
    assert member.id != first.id
    with pytest.raises(TaskRevokedError, match=rf"skipped: lock .* held by task {first.id}"):
        member.get(timeout=30)
    assert received(c, member.id) == 1
    assert first.get(timeout=30) == k
    assert p.mark.delay(f"sentinel-{k}").get(timeout=30) == f"sentinel-{k}"
    assert f"chain-{k}" not in marks(c)
    assert [r[1] for r in c.wait_runs(k, 1, 5)] == [first.id]


def test_chord_members_of_one_job_are_published_and_run_one_after_the_other(c: Cluster) -> None:
    """README, queue scope: chord members "are checked at the worker only", and "chord members that duplicate each
    other reschedule": a chord of the same queue-scope job twice publishes both members, runs them one after the
    other, and the callback gets both results."""
    mod = c.app_module()
    k = new_key()
    result = chord([mod.q_work.s(k, 0.5), mod.q_work.s(k, 0.5)], mod.collect.s()).apply_async()
    assert result.get(timeout=30) == [k, k]
    runs = c.wait_runs(k, 2, 10)
    assert len(runs) == 2
    assert not overlapping(runs)


def test_a_chord_member_that_duplicates_a_queued_job_runs_after_it(c: Cluster) -> None:
    """README: "Chord members that duplicate each other reschedule", and a rescheduled duplicate "waits for the
    holder and runs after it ... the holder's release wakes the oldest waiter at once": a chord member of a queued
    queue-scope job runs when that job ends, and the chord completes."""
    mod = c.app_module()
    k, k2 = new_key(), new_key()
    first = mod.q_work.apply_async((k, 1.0), countdown=1)
    result = chord([mod.q_work.s(k, 0.0), mod.q_work.s(k2, 0.0)], mod.collect.s()).apply_async()
    assert first.get(timeout=30) == k
    # Woken at the holder's release it is done within seconds; its fallback copy would take ten minutes.
    assert sorted(result.get(timeout=15)) == sorted([k, k2])
    runs = c.wait_runs(k, 2, 10)
    assert len(runs) == 2
    (held,) = (r for r in runs if r[1] == first.id)
    (member,) = (r for r in runs if r[1] != first.id)
    assert member[3] >= held[4], f"the member started {held[4] - member[3]:.3f} s before the queued job ended"


def test_beats_send_task_fallback_is_published_and_skipped_at_the_worker(c: Cluster) -> None:
    """README, queue scope: "send_task, beat's fallback to it ... are checked at the worker only": a beat whose app
    does not know the task sends it with send_task while the job runs; the worker skips the copy as its duplicate."""
    mod = c.app_module()
    k = new_key()
    beat_app = Celery("beat-fallback", broker=c.env["CSL_BROKER"], backend=c.env["CSL_BACKEND"], set_as_current=False)
    try:
        assert mod.q_work.name not in beat_app.tasks  # so beat takes its send_task fallback
        scheduler = Scheduler(app=beat_app, lazy=True)
        entry = ScheduleEntry(
            name=f"fallback-{k}", task=mod.q_work.name, schedule=dt.timedelta(hours=1), args=(k, 0.0), app=beat_app
        )
        first = mod.q_work.delay(k, 1.5)
        c.wait_started(k)
        copy = scheduler.apply_async(entry, advance=False)
        assert copy.id != first.id
        with pytest.raises(TaskRevokedError, match=rf"skipped: lock .* held by task {first.id}"):
            mod.app.AsyncResult(copy.id).get(timeout=30)
        assert first.get(timeout=30) == k
        assert [r[1] for r in c.wait_runs(k, 1, 5)] == [first.id]
    finally:
        beat_app.close()


def test_a_callers_own_task_id_gets_the_existing_job_and_its_own_id_is_revoked(c: Cluster) -> None:
    """README, queue scope: "A call with its own task_id that is a duplicate gets the existing job's AsyncResult,
    and REVOKED is stored for its own id"; nothing is published for it. The same own id sent twice is one
    message."""
    mod = c.app_module()
    k, k2 = new_key(), new_key()
    first = mod.q_work.apply_async((k, 1.0), countdown=1)
    mine = f"mine-{k}"
    assert mod.q_work.apply_async((k, 1.0), task_id=mine).id == first.id
    with pytest.raises(TaskRevokedError, match=first.id):
        mod.app.AsyncResult(mine).get(timeout=10)
    own = f"own-{k2}"
    assert mod.q_work.apply_async((k2, 0.5), task_id=own, countdown=1).id == own
    assert mod.q_work.apply_async((k2, 0.5), task_id=own).id == own
    assert mod.app.AsyncResult(own).state == "PENDING"  # still waiting for its countdown: not told "duplicate"
    assert first.get(timeout=30) == k
    assert mod.app.AsyncResult(own).get(timeout=30) == k2
    assert [r[1] for r in c.wait_runs(k, 1, 5)] == [first.id]
    assert [r[1] for r in c.wait_runs(k2, 1, 5)] == [own]
    assert received(c, mine) == 0
    assert received(c, own) == 1


# -- the done window -------------------------------------------------------------------------------------------


def test_a_run_that_lost_its_lock_leaves_the_long_done_window(c: Cluster) -> None:
    """README, "The done window": the marker lives max(2 x lock_ttl, 60 s) after a plain success, and
    max(2 x lock_ttl, visibility timeout) + 300 s when "the run had lost its lock" (here 3900 s, not 60 s)."""
    mod = c.app_module()
    plain = mod.work.delay(new_key(), 0.0)
    plain.get(timeout=30)
    ttls = done_markers(c, plain.id)
    assert len(ttls) == 3
    assert all(0 < t <= max(2 * TTL, 60.0) * 1000 for t in ttls)

    k = new_key()
    first = mod.watch_lock.delay(k, 10.0)
    c.wait_started(k)
    key = mod.watch_lock.lock_key_for(k, 10.0)
    try:
        for server in c.locks:  # another holder now owns the key on every node: the run's lease is lost
            with contextlib.closing(c.lock_client(server)) as client:
                client.delete(key)
                client.hset(key, mapping={"owner": "intruder", "job": "intruder"})
                client.pexpire(key, 30_000)
        assert first.get(timeout=30)["lost_at"] is not None  # it succeeded after noticing the loss
        ttls = done_markers(c, first.id)
        assert len(ttls) == 3
        assert all(VISIBILITY * 1000 < t <= (max(2 * TTL, VISIBILITY) + 300) * 1000 for t in ttls), ttls
    finally:
        for server in c.locks:
            with contextlib.closing(c.lock_client(server)) as client:
                client.delete(key)


def _wait_handled(c: Cluster, task_id: str, count: int) -> None:
    """Until the worker has finished handling ``count`` messages of ``task_id`` (bounded)."""
    for _ in polling(20, 0.05):
        log = "".join(w.log() for w in c.workers)
        if log.count(f"[{task_id}] succeeded in") + log.count(f"[{task_id}] skipped") >= count:
            return
    raise AssertionError(f"the worker did not handle {count} message(s) of {task_id} within 20 s")


def test_a_redelivered_copy_after_the_window_asks_the_backend_and_with_no_result_runs_again(c: Cluster) -> None:
    """README, "The done window": "a first attempt that starts after it asks the result backend and, with none,
    runs the job again". The copy is a redelivery as the library re-sends one (its redelivery header) of a task id
    that succeeded, arriving after the marker is gone: with SUCCESS stored it stops; with none it runs."""
    mod = c.app_module()
    k = new_key()
    task_id = f"once-{k}"
    assert mod.work.apply_async((k, 0.0), task_id=task_id).get(timeout=30) == k
    drop_done_markers(c, task_id)
    mod.work.apply_async((k, 0.0), task_id=task_id, headers={"singleton_lock_waited": 1})
    _wait_handled(c, task_id, 2)
    assert len(c.runs(k)) == 1, "the copy ran although the backend says the task id succeeded"
    drop_done_markers(c, task_id)
    c.results.delete(f"celery-task-meta-{task_id}")
    mod.work.apply_async((k, 0.0), task_id=task_id, headers={"singleton_lock_waited": 1})
    assert len(c.wait_runs(k, 2, 20)) == 2, "with no result stored, the copy did not run the job again"


def test_a_new_message_reusing_a_finished_task_id_after_the_window_runs_again(c: Cluster) -> None:
    """README, "The done window": a *new* message (not a copy) that reuses a finished task id after the window is a
    first attempt, and runs the job again (only copies ask the result backend; give new jobs new ids)."""
    mod = c.app_module()
    k = new_key()
    task_id = f"reused-{k}"
    assert mod.work.apply_async((k, 0.0), task_id=task_id).get(timeout=30) == k
    drop_done_markers(c, task_id)
    mod.work.apply_async((k, 0.0), task_id=task_id)
    _wait_handled(c, task_id, 2)
    assert len(c.wait_runs(k, 2, 20)) == 2, "a new message reusing the task id after the window did not run"


# -- policies: callbacks ---------------------------------------------------------------------------------------


def test_a_skipped_duplicate_runs_neither_its_link_callbacks_nor_its_chain(c: Cluster, p: ModuleType) -> None:
    """README, Policies: skip: "Its link callbacks and chain are not run" (the running job's own link does)."""
    mod = c.app_module()
    k = new_key()
    first = mod.work.apply_async((k, 1.5), link=p.mark.si(f"first-link-{k}"))
    c.wait_started(k)
    dup = mod.work.apply_async((k, 0.0), link=p.mark.si(f"link-{k}"))
    tail = chain(mod.work.si(k, 0.0), p.mark.si(f"chain-{k}")).apply_async()
    with pytest.raises(TaskRevokedError, match=first.id):
        dup.get(timeout=30)
    with pytest.raises(TaskRevokedError, match=first.id):
        tail.parent.get(timeout=30)
    assert first.get(timeout=30) == k
    for _ in polling(10):
        if f"first-link-{k}" in marks(c):
            break
    assert f"first-link-{k}" in marks(c), "the run's own link never ran: links are not working at all"
    assert p.mark.delay(f"sentinel-{k}").get(timeout=30) == f"sentinel-{k}"
    assert f"link-{k}" not in marks(c)
    assert f"chain-{k}" not in marks(c)


def test_a_duplicate_under_the_fail_policy_runs_its_errbacks(c: Cluster, p: ModuleType) -> None:
    """README, Policies: fail: "the result is FAILURE with DuplicateTaskError (.holder_task_id), errbacks run"."""
    k = new_key()
    first = p.work_fail.delay(k, 1.5)
    c.wait_started(k)
    dup = p.work_fail.apply_async((k, 0.0), link_error=p.mark.si(f"errback-{k}"))
    with pytest.raises(Exception, match=first.id) as raised:
        dup.get(timeout=30)
    assert type(raised.value).__name__ == "DuplicateTaskError"
    assert dup.state == "FAILURE"
    for _ in polling(15):
        if f"errback-{k}" in marks(c):
            break
    assert f"errback-{k}" in marks(c), "the duplicate's errback never ran"
    assert first.get(timeout=30) == k


# -- worker start ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("replace_at", ["task", "settings"])
def test_a_worker_refuses_to_start_with_lock_limit_and_replace(
    redis_node: RedisServer, tmp_path: Path, replace_at: str
) -> None:
    """README, per-key limits: "not with replace ... (the worker refuses to start with them)": a real
    ``celery worker`` with lock_limit=2 and "replace" (on the task, or in the settings) exits non-zero with one line
    naming the problem, and no traceback."""
    env = {**os.environ, "CSL_BROKER": redis_node.url, "CSL_REPLACE_AT": replace_at}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(APPS), env.get("PYTHONPATH", "")]))
    args = [sys.executable, "-m", "celery", "-A", "limit_replace_app", "worker", "-P", "solo", "-l", "INFO",
            "--without-gossip", "--without-mingle", "--without-heartbeat"]  # fmt: skip
    log = tmp_path / "worker.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            args, cwd=str(APPS), env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        for _ in polling(60, 0.1):
            if proc.poll() is not None or " ready." in log.read_text(errors="replace"):
                break
    finally:
        if proc.poll() is None:  # it started (or hangs): stop it, then fail below
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)
    text = log.read_text(errors="replace")
    assert " ready." not in text, f"the worker started:\n{text[-2000:]}"
    assert proc.returncode != 0, text
    lines = [line for line in text.splitlines() if "replace" in line]
    assert len(lines) == 1, text
    assert "lock_limit of limited_latest" in lines[0]
    assert "Traceback" not in text
