"""lock_scope="queue": the job is reserved at delay()/apply_async and stays locked while its message waits and runs.

Real workers (tests/apps/locked_app.py) on a Redis broker and three lock nodes. Messages published are counted
from the outside: every call's returned id, and the runs the tasks record.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator

import pytest
from celery.exceptions import TaskRevokedError
from kombu.exceptions import EncodeError
from worker_cluster import Cluster, cluster, new_key, overlapping, polling

from celery_singleton_lock import DuplicateTaskError
from celery_singleton_lock.task import _reach

pytestmark = pytest.mark.slow
TTL = 3.0


@pytest.fixture(scope="module")
def c(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with cluster(tmp_path_factory.mktemp("queue-scope"), ttl=TTL) as c:
        c.worker("w1")
        c.worker("w2")
        c.app_module()
        yield c


def reserved(c: Cluster, key: str) -> dict[bytes, bytes]:
    """The holder record of ``key`` on the first lock node ({} when free)."""
    with c.lock_client(c.locks[0]) as client:
        return dict(client.hgetall(key))


def test_a_burst_while_queued_or_running_publishes_one_message_and_runs_once(c: Cluster) -> None:
    """Fifty delay() calls of one job, while it waits and while it runs: every caller gets the first job's
    AsyncResult (one message, one run), and the caller can .get() it."""
    mod = c.app_module()
    k = new_key()
    first = mod.q_work.apply_async((k, 1.0), countdown=1)
    burst = [mod.q_work.delay(k, 1.0) for _ in range(25)]
    c.wait_started(k)
    burst += [mod.q_work.delay(k, 1.0) for _ in range(25)]
    assert {r.id for r in burst} == {first.id}
    assert burst[-1].get(timeout=30) == k
    assert len(c.wait_runs(k, 1, 5)) == 1
    time.sleep(0.5)
    assert len(c.started(k)) == 1


def test_a_countdown_longer_than_the_ttl_keeps_the_reservation(c: Cluster) -> None:
    """A countdown of 2 ttl: the reservation outlives the ttl and a duplicate sent near its end still gets the
    queued job; the job runs once, when due."""
    mod = c.app_module()
    k = new_key()
    sent_at = time.time()
    first = mod.q_work.apply_async((k, 0.0), countdown=2 * TTL)
    time.sleep(TTL + 1)
    again = mod.q_work.delay(k, 0.0)
    assert again.id == first.id
    assert reserved(c, mod.q_work.lock_key_for(k)).get(b"state") == b"queued"
    assert first.get(timeout=30) == k
    runs = c.wait_runs(k, 1, 5)
    assert len(runs) == 1
    assert runs[0][3] >= sent_at + 2 * TTL - 0.5


def test_revoke_queued_frees_the_job_at_once(c: Cluster) -> None:
    """revoke_queued: the queued message is revoked and its reservation freed: the same job sent again is a new
    job, which runs; the revoked one never does."""
    mod = c.app_module()
    k = new_key()
    first = mod.q_work.apply_async((k, 0.0), countdown=5)
    assert mod.q_work.revoke_queued(first.id, k) is True
    second = mod.q_work.delay(k, 0.0)
    assert second.id != first.id
    assert second.get(timeout=30) == k
    time.sleep(5.5)
    runs = c.runs(k)
    assert [r[1] for r in runs] == [second.id]


def test_a_revoked_message_met_by_a_worker_frees_its_reservation(c: Cluster) -> None:
    """AsyncResult.revoke() alone: when the worker meets the revoked message (here at its countdown), it frees the
    reservation, long before the reservation's lease (countdown + lock_queue_ttl) would end."""
    mod = c.app_module()
    k = new_key()
    key = mod.q_work.lock_key_for(k)
    first = mod.q_work.apply_async((k, 0.0), countdown=1)
    first.revoke()
    for _ in polling(15, 0.1):
        if not reserved(c, key):
            break
    assert not reserved(c, key), "the reservation stayed after the worker discarded the revoked message"
    second = mod.q_work.delay(k, 0.0)
    assert second.id != first.id
    assert second.get(timeout=30) == k
    with pytest.raises(TaskRevokedError):
        first.get(timeout=5)


def test_a_message_that_expires_unseen_frees_its_job_when_it_expires(c: Cluster) -> None:
    """A message sent to a queue no worker reads, with expires=2: its reservation ends with it, not 600 s later."""
    mod = c.app_module()
    k = new_key()
    first = mod.q_work.apply_async((k, 0.0), queue="nobody-reads-this", expires=2)
    assert mod.q_work.delay(k, 0.0).id == first.id
    time.sleep(3.5)
    second = mod.q_work.delay(k, 0.0)
    assert second.id != first.id
    assert second.get(timeout=30) == k


def test_a_publish_that_fails_frees_the_reservation(c: Cluster) -> None:
    """An argument the serializer refuses: apply_async raises, and the job is not left reserved."""
    mod = c.app_module()
    k = new_key()
    with pytest.raises(EncodeError):
        mod.q_work.delay(k, 0.0, note=object())
    assert not reserved(c, mod.q_work.lock_key_for(k))
    assert mod.q_work.delay(k, 0.0).get(timeout=30) == k


def test_a_retry_under_queue_scope_keeps_the_job_and_is_not_blocked_by_it(c: Cluster) -> None:
    """The retries run (no self-collision with the job's own lock), and a duplicate sent during a retry's countdown
    gets the retrying job, publishing nothing."""
    mod = c.app_module()
    k = new_key()
    first = mod.q_flaky.delay(k, 2, 1.5)
    # The first run handed the lock over to its retry: the retry's countdown has begun.
    assert c.wait_holder_state(mod.q_flaky.lock_key_for(k, 0, 0.0), "retry"), "the job never waited for its retry"
    assert mod.q_flaky.delay(k, 0, 0.0).id == first.id
    assert first.get(timeout=30) == 2
    assert [r[1] for r in c.runs(k)] == [first.id] * 3
    assert not overlapping(c.runs(k))


def test_send_task_bypasses_the_reservation_and_the_worker_still_skips_it(c: Cluster) -> None:
    """send_task (and beat's fallback to it) does not go through apply_async: the worker's run-time check skips the
    copy as a duplicate of the reserved job."""
    mod = c.app_module()
    k = new_key()
    first = mod.q_work.delay(k, 1.5)
    c.wait_started(k)
    bypass = mod.app.send_task(mod.q_work.name, (k, 0.0))
    with pytest.raises(TaskRevokedError, match=first.id):
        bypass.get(timeout=30)
    assert first.get(timeout=30) == k
    assert len(c.runs(k)) == 1


def test_fail_policy_raises_at_the_caller(c: Cluster) -> None:
    mod = c.app_module()
    k = new_key()
    first = mod.q_fail.delay(k, 1.0)
    with pytest.raises(DuplicateTaskError, match=first.id):
        mod.q_fail.delay(k, 1.0)
    assert first.get(timeout=30) == k


def test_a_second_click_within_the_cooldown_gets_the_first_charge(c: Cluster) -> None:
    """Queue scope with lock_cooldown: the second click, 1 s after the charge finished, gets the charge's result
    (same task id) and charges nothing; after the cooldown a click charges again."""
    mod = c.app_module()
    k = new_key()
    first = mod.q_charge.delay(k)
    charged = first.get(timeout=30)
    time.sleep(1.0)
    second = mod.q_charge.delay(k)
    assert second.id == first.id
    assert second.get(timeout=5) == charged
    time.sleep(4.0)
    third = mod.q_charge.delay(k)
    assert third.id != first.id
    assert third.get(timeout=30) != charged
    assert len(c.runs(k)) == 2


def test_no_quorum_at_delay_sends_anyway_and_the_worker_guards(c: Cluster) -> None:
    """With 2 of 3 lock nodes down, delay() cannot reserve: it sends the message (never drops it), the worker backs
    off until the nodes are back, and the job runs once."""
    mod = c.app_module()
    k = new_key()
    c.stop_locks(2)
    try:
        result = mod.q_work.delay(k, 0.0)
        time.sleep(1.0)
        assert not c.started(k)
    finally:
        c.start_locks()
    assert result.get(timeout=30) == k
    assert len(c.runs(k)) == 1


def test_no_quorum_at_delay_is_said_once_per_interval_not_per_call(
    c: Cluster, caplog: pytest.LogCaptureFixture
) -> None:
    """With 2 of 3 lock nodes down, five delay() calls of queue-scope jobs publish unreserved and the producer says so
    in one WARNING (naming the nodes that do not answer, no password), not five."""
    mod = c.app_module()
    keys = [new_key() for _ in range(5)]
    _reach._last_said.clear()  # a warning an earlier test of this process logged starts its own interval
    c.stop_locks(2)
    try:
        with caplog.at_level(logging.WARNING, logger="celery_singleton_lock.task"):
            results = [mod.q_work.delay(k, 0.0) for k in keys]
    finally:
        c.start_locks()
    said = [r.getMessage() for r in caplog.records if "found no quorum" in r.getMessage()]
    assert len(said) == 1, said
    assert "a queue-scope reservation found no quorum of lock nodes (1 of 3 answer, 2 needed" in said[0]
    assert all(f"127.0.0.1:{s.port}" in said[0] for s in c.locks[:2])
    assert all(r.get(timeout=30) == k for r, k in zip(results, keys, strict=True))


def test_group_members_are_checked_at_the_worker_only(c: Cluster) -> None:
    """A group of the same call twice: both messages are published (a group counts its members' own ids), and the
    worker runs one and skips the other as its duplicate."""
    from celery import group  # noqa: PLC0415

    mod = c.app_module()
    k = new_key()
    results = group(mod.q_work.s(k, 1.0), mod.q_work.s(k, 1.0)).apply_async()
    ids = [r.id for r in results.results]
    assert len(set(ids)) == 2
    outcomes = []
    for r in results.results:
        try:
            outcomes.append(r.get(timeout=30))
        except TaskRevokedError:
            outcomes.append("revoked")
    assert sorted(outcomes) == sorted([k, "revoked"])
    assert len(c.runs(k)) == 1


def test_a_job_waiting_for_its_rate_stays_the_key_s_job(c: Cluster) -> None:
    """Issue 29 finding 6: queue scope with lock_rate: while the reserved job waits for its rate's window, the key
    stays reserved for it: a later delay() gets that job (no message of its own), and the job runs once."""
    mod = c.app_module()
    k = new_key()
    assert mod.q_rated.delay(k).get(timeout=30) == k  # the window is used for 3 s
    waiting = mod.q_rated.delay(k)
    for _ in polling(20, 0.05):
        lines = "".join(w.log() for w in c.workers).splitlines()
        if any(waiting.id in line and "re-sent to run in" in line and "(rate)" in line for line in lines):
            break
    later = [mod.q_rated.delay(k) for _ in range(3)]
    assert {r.id for r in later} == {waiting.id}
    assert waiting.get(timeout=30) == k
    assert len(c.wait_runs(k, 2, 5)) == 2
