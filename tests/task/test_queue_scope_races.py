"""lock_scope="queue" under attack: regression tests for what the adversarial review broke, and what it tried in vain.

Real workers (tests/apps/queue_races_app.py: locked_app's tasks plus self-rescheduling ones) on a Redis broker and
three real lock nodes. Each test names the finding it guards (FINDING n, fixed) or the attack that found nothing
(HELD). Finding 4 (a delay() between a killed run's lease end and its redelivered copy publishes a new job) is a
documented limit (docs/guarantees.md: queue scope), not fixed.
"""

from __future__ import annotations

import sys
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery
from celery.exceptions import TaskRevokedError
from celery.exceptions import TimeoutError as CeleryTimeoutError
from kombu.exceptions import OperationalError
from worker_cluster import APPS, Cluster, cluster, new_key, overlapping, polling

from celery_singleton_lock import LockedTask
from celery_singleton_lock.testing import CeleryWorker, free_port

pytestmark = pytest.mark.slow
TTL = 3.0


@pytest.fixture(scope="module")
def c(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    tmp = tmp_path_factory.mktemp("queue-races")
    with cluster(tmp, ttl=TTL) as c:
        for name in ("a1", "a2"):
            worker = CeleryWorker(
                "queue_races_app",
                name,
                cwd=str(APPS),
                log_path=str(tmp / f"{name}.log"),
                concurrency=2,
                env=c.env,
            )
            c.workers.append(worker)
            worker.start()
        c.app_module()
        yield c


@pytest.fixture(scope="module")
def mod(c: Cluster) -> Any:
    """queue_races_app as the client sees it (it imports the cluster's locked_app)."""
    sys.modules.pop("queue_races_app", None)
    import queue_races_app  # noqa: PLC0415 - configured from the cluster's env

    yield queue_races_app
    sys.modules.pop("queue_races_app", None)


def record_of(c: Cluster, key: str) -> dict[bytes, bytes]:
    with c.lock_client(c.locks[0]) as client:
        return dict(client.hgetall(key))


# -- FINDING 1 ---------------------------------------------------------------------------------------------------


def test_a_duplicate_sent_while_a_publish_fails_is_not_handed_the_unsent_job(c: Cluster) -> None:
    """FINDING 1 (phantom AsyncResult). Call A reserves the job, then its publish fails (here: the broker refuses
    connections; Celery retries the publish for ~0.6 s, then raises). A duplicate call B made during that publish
    saw A's "queued" reservation and got AsyncResult(A): but A was never published, and its reservation was
    released when A raised. B's caller held a handle that stayed PENDING forever. Fixed: a reservation is "sending"
    until its message is out; a duplicate waits for that (a few ms), or sends its own when the publish failed.
    """
    dead = free_port()  # nothing listens: every publish is refused
    app = Celery(f"phantom-{uuid.uuid4().hex[:6]}", broker=f"redis://127.0.0.1:{dead}/0", set_as_current=False)
    app.conf.update(
        result_backend=c.env["CSL_BACKEND"],
        singleton_lock_urls=c.lock_urls,
        singleton_lock_ttl=TTL,
        broker_connection_retry_on_startup=False,
    )

    @app.task(base=LockedTask, bind=True, lock_scope="queue", name="attack.phantom", shared=False)
    def phantom(self: Any, key: str) -> str:
        return key

    k = new_key()
    lock_key = phantom.lock_key_for(k)
    outcome: dict[str, Any] = {}

    def first() -> None:
        try:
            outcome["a"] = phantom.delay(k)
        except Exception as exc:  # the publish failed: what the first caller sees
            outcome["error"] = exc

    thread = threading.Thread(target=first, daemon=True)
    thread.start()
    reserved_job = None
    for _ in polling(5, 0.002):
        reserved_job = record_of(c, lock_key).get(b"job")
        if reserved_job:
            break
    assert reserved_job, "call A did not reserve the job"
    try:
        # During A's publish: B waits for it, sees it fail, reserves the job itself and publishes, which fails
        # too (the broker is down for everyone): B's caller is told, never handed A's id.
        with pytest.raises(OperationalError):
            phantom.delay(k)
        thread.join(20)
        assert "error" in outcome, "call A's publish was expected to fail (broker refuses connections)"
        assert not record_of(c, lock_key), "a failed publish left the job reserved"
    finally:
        app.close()


# -- FINDING 2 ---------------------------------------------------------------------------------------------------


def test_a_call_with_its_own_task_id_is_not_left_pending_forever(c: Cluster, mod: Any) -> None:
    """FINDING 2 (a caller's own task id dropped, fixed): apply_async(..., task_id=mine) while the job is queued or
    running publishes nothing and returns the queued job's AsyncResult, and `mine` is REVOKED at once (a caller
    waiting on the id it chose is told), never run."""
    k = new_key()
    first = mod.q_work.delay(k, 2.0)
    mine = f"mine-{uuid.uuid4().hex[:8]}"
    returned = mod.q_work.apply_async((k, 0.0), task_id=mine)
    assert returned.id == first.id  # nothing was published for `mine`: the call got the queued job
    try:
        mod.q_work.AsyncResult(mine).get(timeout=6)
    except TaskRevokedError:
        pass  # told: a duplicate of the queued job
    except CeleryTimeoutError:
        pytest.fail(f"apply_async(task_id={mine!r}) returned AsyncResult({returned.id}); {mine} stays PENDING")
    else:
        pytest.fail(f"{mine}, a duplicate of the queued job {first.id}, ran")
    assert first.get(timeout=30) == k
    assert [r[1] for r in c.runs(k)] == [first.id]


# -- FINDING 3 ---------------------------------------------------------------------------------------------------


def test_a_job_that_sends_itself_again_keeps_going(c: Cluster, mod: Any) -> None:
    """FINDING 3 (self-rescheduling job swallowed). A queue-scope job whose body ends by sending itself again with a
    countdown (a poller: `self.apply_async(args, countdown=...)`) is its own duplicate: its own run holds the job,
    so _reserve returns AsyncResult(<the running task's own id>) and publishes nothing. The chain stops after the
    first run, silently (the body even gets its own id back). Run scope sends it (the lock is free when it runs).

    task.py apply_async: the only in-body exemption is `task_id == self.request.id` (a re-send of this very
    delivery); a *new* call of the same job from inside the run that holds it is reserved and refused.
    """
    k = new_key()
    first = mod.q_again.delay(k, 2, 0.3)
    next_id = first.get(timeout=30)
    assert next_id != first.id, "the body's self.apply_async(...) returned the running task's own AsyncResult"
    assert len(c.wait_runs(k, 3, 10)) == 3


# -- HELD: attacks that found nothing ------------------------------------------------------------------------------


def test_held_a_burst_of_concurrent_callers_publishes_one_message(c: Cluster, mod: Any) -> None:
    """24 threads call delay() of one job at the same instant (a split vote at enqueue), 5 rounds: one id, one run
    per round (also tried: 16 processes x 20 rounds, fork + a wall-clock start; no second message).

    FOUND in a CI run (12 threads, loaded machine): two ids. Contenders that split the three nodes retried three
    times after a fixed 5-50 ms pause, each attempt slowed by the others (one process, one GIL), so they stayed in
    step, and each caller whose retries ran out sent a job of its own ("not held for sure ... split=True"). A split
    is no outage: the pause now doubles with each split up to the reservation's deadline (SENDING_WAIT). Failed
    first here with three CPU burners beside it (`yes > /dev/null` x3), 1 run in 3 to 4. The job lasts 1.5 s so
    that a slow caller of the burst still finds it held: a call after the job ended is a new job, rightly.
    """
    for _ in range(5):
        k = new_key()
        barrier = threading.Barrier(24)
        ids: list[str] = []

        def call(key: str = k, gate: threading.Barrier = barrier, out: list[str] = ids) -> None:
            gate.wait(5)
            out.append(mod.q_work.delay(key, 1.5).id)

        threads = [threading.Thread(target=call, daemon=True) for _ in range(24)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(10)
        assert len(ids) == 24
        assert len(set(ids)) == 1
        assert mod.q_work.AsyncResult(ids[0]).get(timeout=30) == k
        assert len(c.wait_runs(k, 1, 5)) == 1


def test_a_split_that_outlasts_the_first_retries_still_ends_in_a_reservation(c: Cluster, mod: Any) -> None:
    """FOUND (the burst above, in CI): a split vote at enqueue was retried three times after 5-50 ms, then the call
    sent a job of its own WITHOUT a reservation, so the next duplicate reserved and sent a second job. Here the split
    is made to last 0.4 s (two other callers' "sending" records on two nodes of three, as contenders leave them
    mid-attempt): the call must wait it out and reserve (the next call joins its job), not send unreserved.
    Failed first: the second call got a job id of its own.
    """
    k = new_key()
    key = mod.q_work.lock_key_for(k)
    for server, owner in zip(c.locks[:2], ("contender-a", "contender-b"), strict=True):
        with c.lock_client(server) as client:
            client.hset(key, mapping={"owner": owner, "job": f"job-of-{owner}", "state": "sending"})
            client.pexpire(key, 400)
    first = mod.q_work.delay(k, 1.0)
    assert mod.q_work.delay(k, 1.0).id == first.id
    assert first.get(timeout=30) == k
    assert len(c.wait_runs(k, 1, 5)) == 1


def test_a_partial_hold_beside_a_dead_node_is_not_waited_on_for_the_whole_deadline(
    c: Cluster, mod: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """FOUND (review of the 2 s split deadline): a reservation record on one node only (a producer killed between
    its grant there and its undo leaves it for the whole lease, 600 s by default) beside a dead node makes every
    attempt "unsure" (refused by a holder on some nodes, a node erroring, no quorum). Since the split retry runs to
    the 2 s deadline, EVERY delay() of that key blocked ~2.1-2.3 s for as long as the record stood, then sent
    unreserved anyway (no quorum is possible: one node dead, one held). A contender's partial hold lasts one attempt
    (at most a socket timeout): a hold whose remaining lease has dropped by more than that since the call first
    saw it is no contender. The call now stops asking then and sends (the worker's check guards it).
    Failed first: attempts went on until the deadline, the hold seen standing ~2 s (> 1.0 s).
    """
    from celery_singleton_lock.lock.redlock import Redlock  # noqa: PLC0415

    seen: list[tuple[str | None, float | None]] = []
    acquire = Redlock.acquire

    def spy(self: Redlock, *args: Any, **kwargs: Any) -> bool:
        got = acquire(self, *args, **kwargs)
        if not got:
            seen.append((self.held_by, self.held_for))
        return got

    k = new_key()
    key = mod.q_work.lock_key_for(k)
    timeout = mod.q_work.lock_context().options.settings.socket_timeout
    c.stop_locks(1)
    try:
        with c.lock_client(c.locks[1]) as client:
            client.hset(key, mapping={"owner": "killed-producer", "job": "job-of-killed", "state": "sending"})
            client.pexpire(key, 60_000)
        monkeypatch.setattr(Redlock, "acquire", spy)
        sent = mod.q_work.apply_async((k, 0.0), queue="csl-nobody")  # unreserved: no worker needs to see it
        monkeypatch.undo()
        assert sent.id != "job-of-killed"
        assert seen
        assert {holder for holder, _ in seen} == {"killed-producer"}
        first = seen[0][1]
        assert first is not None
        stood = [first - (left or 0.0) for _, left in seen]
        assert max(stood[:-1]) <= timeout + 0.5, stood  # asked again only while it could be a contender's
    finally:
        with c.lock_client(c.locks[1]) as client:
            client.delete(key)
        c.start_locks()


def test_held_a_call_from_inside_a_run_is_reserved(c: Cluster, mod: Any) -> None:
    """HELD: calls made inside a run are reserved like any other (self.request is the running delivery's context,
    but task_id is None there, so the `task_id == self.request.id` exemption does not apply): another task's job,
    and another job of the running task itself; a duplicate from outside gets the id sent from inside."""
    k, other, mine = new_key(), new_key(), new_key()
    sent = mod.q_spawn.delay(k, other).get(timeout=30)
    assert mod.q_work.delay(other, 0.0).id == sent
    sent_same = mod.q_spawn_same.delay(new_key(), mine).get(timeout=30)
    assert mod.q_spawn_same.delay(mine, "").id == sent_same
    assert mod.q_work.AsyncResult(sent).get(timeout=30) == other
    assert mod.q_spawn_same.AsyncResult(sent_same).get(timeout=30) == ""
    assert len(c.wait_runs(other, 1, 5)) == 1
    assert len(c.wait_runs(mine, 1, 5)) == 1


def test_revoke_queued_after_the_take_over_leaves_the_running_job_alone(c: Cluster, mod: Any) -> None:
    """FINDING 5 (revoke_queued revokes a job that is no longer queued). Its docstring: "False when there was none
    (a worker had taken the job over already: it runs, or ran)". It frees nothing then (right), but it has already
    called app.control.revoke(task_id) unconditionally: Celery 5.7's revoke stores REVOKED for an id that the
    receiving worker is not running and whose state is PENDING (celery/worker/control.py _revoke), so the worker
    that does not run it marks the running job REVOKED. Every waiter (the first caller and every duplicate handed
    the same id) gets TaskRevokedError while the job runs to the end; its later retries would be discarded too.

    task.py revoke_queued: `self.app.control.revoke(task_id)` before `_free_reservation(...)`, whatever that finds.
    (Also checked, HELD: nothing is freed, with the right or another job's arguments; duplicates keep its id.)
    """
    k, other = new_key(), new_key()
    first = mod.q_work.delay(k, 2.0)
    c.wait_started(k)
    assert record_of(c, mod.q_work.lock_key_for(k)).get(b"state") == b"run"
    assert mod.q_work.revoke_queued(first.id, other) is False
    assert mod.q_work.revoke_queued(first.id, k) is False
    assert mod.q_work.delay(k, 0.0).id == first.id
    try:
        outcome: Any = first.get(timeout=30)
    except TaskRevokedError as exc:
        outcome = exc
    assert len(c.wait_runs(k, 1, 5)) == 1
    assert outcome == k, f"revoke_queued said the job runs (False), and its waiters got {outcome!r}"


def test_held_eta_in_the_past_and_as_a_string(c: Cluster, mod: Any) -> None:
    """HELD: an ETA in the past and an ETA given as an ISO string are reserved, run once, and dedupe."""
    k1, k2 = new_key(), new_key()
    a = mod.q_work.apply_async((k1, 0.5), eta="2020-01-01T00:00:00+00:00")
    b = mod.q_work.apply_async((k2, 0.0), eta=time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(time.time() + 1.5)))
    assert mod.q_work.delay(k1, 0.0).id == a.id
    assert mod.q_work.delay(k2, 0.0).id == b.id
    assert a.get(timeout=30) == k1
    assert b.get(timeout=30) == k2
    assert len(c.runs(k1)) == 1
    assert len(c.runs(k2)) == 1


def test_held_a_retry_is_not_refused_as_its_own_duplicate(c: Cluster, mod: Any) -> None:
    """HELD: q_flaky retries twice under queue scope (Celery's retry re-sends through our apply_async with
    task_id == self.request.id: not reserved, not refused); no two runs overlap."""
    k = new_key()
    first = mod.q_flaky.delay(k, 2, 0.3)
    assert first.get(timeout=30) == 2
    runs = c.runs(k)
    assert [r[1] for r in runs] == [first.id] * 3
    assert not overlapping(runs)
