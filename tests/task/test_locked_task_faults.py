"""LockedTask under faults, on real workers: killed workers and children, revoke, shutdown, time limits, lock nodes
going down, chords, bad arguments, and a soak of a few thousand messages.

One broker and three password-protected lock nodes (a 3-node Redlock) are shared by the module with two
``celery worker`` processes (prefork, concurrency 2 each); tests that end a worker start their own on a private
queue. Each test uses its own keys; tests that stop lock nodes restart them even when they fail.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import random
import signal
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
from billiard.exceptions import TimeLimitExceeded
from celery import chord, group
from celery.exceptions import SoftTimeLimitExceeded, TaskRevokedError
from worker_cluster import Cluster, cluster, new_key, overlapping, polling

from celery_singleton_lock.errors import LockUnavailableError, UnserializableArgumentsError
from celery_singleton_lock.lock import metrics
from celery_singleton_lock.lock.config import settings_for

PASSWORD = "s3cr3t-lock-pw"
TTL = 3.0


@pytest.fixture(scope="module")
def c(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with cluster(tmp_path_factory.mktemp("faults"), ttl=TTL, password=PASSWORD) as cl:
        cl.worker("w1")
        cl.worker("w2")
        cl.app_module()
        yield cl


@pytest.fixture
def nodes_back(c: Cluster) -> Iterator[None]:
    """Restart every stopped lock node after the test, pass or fail."""
    try:
        yield
    finally:
        c.start_locks()


def seen_held(c: Cluster, name: str) -> tuple[float, float]:
    """(ms left on ``name``'s lease, when): the lock must be held by a quorum now."""
    held = sorted(ms for token, ms in c.lock_state(name) if token is not None)
    assert len(held) >= 2, f"lock {name} is not held"
    return float(held[len(held) // 2]), time.monotonic()


def lease_until_gone(c: Cluster, name: str, timeout: float) -> list[float]:
    """The ms left on ``name``'s lease (its quorum's median) at each sighting, every 20 ms, until no quorum holds
    it; fails the test if one still does after ``timeout`` s."""
    sightings: list[float] = []
    for _ in polling(timeout, 0.02):
        held = sorted(ms for token, ms in c.lock_state(name) if token is not None)
        if len(held) < 2:
            return sightings
        sightings.append(float(held[len(held) // 2]))
    pytest.fail(f"lock {name} still held after {timeout} s")


def renewed(sightings: list[float]) -> bool:
    """True when the lease grew between two sightings (a renewal adds a whole renewal interval; 100 ms of slack
    for the nodes being read one after the other)."""
    return any(later > earlier + 100 for earlier, later in itertools.pairwise(sightings))


def wait_ended(c: Cluster, name: str, timeout: float) -> list[list[tuple[bytes | None, int]]]:
    """Sightings of ``name``, every 20 ms until no quorum holds it: (holder state, PTTL ms) on each lock node, both
    read in one round trip per node.

    A run killed at its hard time limit has its lock taken over by the worker's main process: state ``ending``,
    a lease of about 1 s that nobody renews (task.py, LockedRequest.on_timeout and _end_lease_of)."""
    sightings: list[list[tuple[bytes | None, int]]] = []
    for _ in polling(timeout, 0.02):
        nodes = []
        for server in c.locks:
            with contextlib.closing(c.lock_client(server)) as client:
                state, pttl = client.pipeline(transaction=False).hget(name, "state").pttl(name).execute()
            nodes.append((state, int(pttl)))
        if sum(1 for _, pttl in nodes if pttl > 0) < 2:
            return sightings
        sightings.append(nodes)
    pytest.fail(f"lock {name} still held after {timeout} s")


def assert_lease_ended_at_once(sightings: list[list[tuple[bytes | None, int]]]) -> None:
    """The killed run's lease was taken over on a quorum (state ``ending``) and every such record was the ~1 s end
    lease, never renewed, until the lock was gone: not the run's own lease, left to run out its ttl."""
    first = next((i for i, nodes in enumerate(sightings) if [s for s, _ in nodes].count(b"ending") >= 2), None)
    assert first is not None, f"the lease was never taken over: {sightings}"
    ending = [[ms for s, ms in nodes if s == b"ending"] for nodes in sightings[first:]]
    assert all(ms <= 1000 for seen in ending for ms in seen), ending
    nodes = range(len(sightings[first]))
    per_node = [[float(seen[n][1]) for seen in sightings[first:] if seen[n][0] == b"ending"] for n in nodes]
    assert not any(renewed(seen) for seen in per_node), per_node


def wait_gone(c: Cluster, name: str, timeout: float, seen: tuple[float, float]) -> tuple[float, float]:
    """Wait until ``name`` is free; return (seconds waited, ms its lease had left by the last sighting).

    ``seen`` is a sighting of the lock held, taken before the fault. The ms left is a lower bound (a renewal since
    a sighting only adds to it), so a positive value proves the key was deleted (released), not left to expire.
    """
    start = time.monotonic()
    last_ms, last_seen = seen
    for _ in polling(timeout, 0.02):
        held = sorted(ms for token, ms in c.lock_state(name) if token is not None)
        now = time.monotonic()
        if len(held) < 2:
            return now - start, last_ms - (now - last_seen) * 1000
        last_ms, last_seen = float(held[len(held) // 2]), now
    pytest.fail(f"lock {name} still held after {timeout} s")


def other_logs(c: Cluster, *names: str) -> str:
    return "".join(w.log() for w in c.workers if w.name in names)


def test_sigkill_of_a_whole_worker_frees_the_lock_within_ttl(c: Cluster) -> None:
    """SIGKILL of a whole worker mid-task: nobody renews its lease, which ends within a ttl, and the same job sent
    again runs elsewhere."""
    mod = c.app_module()
    victim = c.worker("victim-kill", queues="victim")
    k = new_key()
    name = mod.work.lock_key_for(k)
    first = mod.work.apply_async((k, 30.0), queue="victim")
    victim_pid = c.wait_started(k)[0][2]
    assert not c.lock_free(name)
    victim.kill()
    sightings = lease_until_gone(c, name, TTL + 5)
    assert sightings[0] <= TTL * 1000, sightings[0]  # at most a ttl left at the kill ...
    assert not renewed(sightings), sightings  # ... and never renewed after it: free within that ttl
    again = mod.work.delay(k, 0.1)
    assert again.get(timeout=30) == k
    run = [r for r in c.runs(k) if r[1] == again.id]
    assert len(run) == 1
    assert run[0][2] != victim_pid
    assert again.id in other_logs(c, "w1", "w2")
    # The killed delivery stays unacked in Redis until the visibility timeout (3600 s here): nothing re-ran it.
    assert [r[1] for r in c.started(k)] == [first.id, again.id]


@pytest.fixture(scope="module")
def quick_lost(c: Cluster) -> Iterator[str]:
    """A worker (one pool child) that reports a dead child after 1 s (``worker_lost_wait``, Celery's default 10 s);
    yields its queue."""
    worker = c.worker("quick-lost", queues="quick-lost", concurrency=1, env={"CSL_LOST_WAIT": "1"})
    yield "quick-lost"
    worker.stop(timeout=30)


def test_sigkill_of_a_pool_child_ends_its_lease_at_once(c: Cluster, quick_lost: str) -> None:
    """A pool child SIGKILLed mid-run (acks_late, reject_on_worker_lost): the worker's main process ends the dead
    run's 30 s lease when Celery reports it (WorkerLostError), so the redelivery runs within seconds, not after it."""
    mod = c.app_module()
    k = new_key()
    name = mod.long_lease.lock_key_for(k)
    first = mod.long_lease.apply_async((k, 2.0), queue=quick_lost)
    pid = c.wait_started(k)[0][2]
    os.kill(pid, signal.SIGKILL)
    killed_at = time.time()
    pttls = sorted((ms for _, ms in c.lock_state(name)), reverse=True)
    assert pttls[1] > 20_000, pttls  # the dead run's lease had most of its 30 s left
    lease_end = killed_at + pttls[1] / 1000
    assert first.get(timeout=60) == k
    started = c.started(k)
    assert [s[1] for s in started] == [first.id, first.id]
    assert started[1][2] != pid
    # Waiting the lease out would start the redelivery at lease_end (the test of the same kill in test_locked_task
    # asserts that of a lease Celery's 10 s wait outlasts). Here it takes worker_lost_wait (1 s), the ~1 s end lease
    # and a requeue: a bound of 15 s under the lease's end, which only a stall of 15 s on a loaded machine misses.
    assert started[1][3] < lease_end - 15, (started[1][3], lease_end)
    assert [r[1] for r in c.runs(k)] == [first.id]
    # The main process counted the kill (its watchdog flushes every 5 s; the dead child's own counts are gone).
    settings = settings_for(mod.app)
    killed = 0
    for _ in polling(30, 0.25):
        report = metrics.read_metrics(settings.nodes, settings.prefix)
        killed = report.tasks.get(mod.long_lease.name, {}).get("killed", 0)
        if killed:
            break
    assert killed >= 1


def test_a_paused_pool_child_keeps_its_lease(c: Cluster, quick_lost: str) -> None:
    """A pool child paused mid-run (SIGSTOP) has not died: its lease stands (a duplicate sent meanwhile is skipped),
    and once resumed its run ends, the only run."""
    mod = c.app_module()
    k = new_key()
    name = mod.long_lease.lock_key_for(k)
    first = mod.long_lease.apply_async((k, 1.0), queue=quick_lost)
    pid = c.wait_started(k)[0][2]
    os.kill(pid, signal.SIGSTOP)
    try:
        time.sleep(3.0)  # three times the worker's worker_lost_wait: a pause taken for a death would be acted on
        assert c.holder_states(name).count(b"run") >= 2, c.holder_states(name)
        duplicate = mod.long_lease.delay(k, 0.0)
        with pytest.raises(TaskRevokedError):
            duplicate.get(timeout=30)
        assert c.holder_states(name).count(b"run") >= 2, c.holder_states(name)
    finally:
        os.kill(pid, signal.SIGCONT)
    assert first.get(timeout=30) == k
    assert [r[1] for r in c.runs(k)] == [first.id]


def test_revoke_terminate_releases_the_lock(c: Cluster) -> None:
    """revoke(terminate=True) of a running task: its lock is released (not left to expire) and the job runs again."""
    mod = c.app_module()
    k = new_key()
    name = mod.work.lock_key_for(k)
    first = mod.work.delay(k, 30.0)
    c.wait_started(k)
    seen = seen_held(c, name)
    first.revoke(terminate=True)
    _, left_ms = wait_gone(c, name, TTL + 5, seen)
    assert left_ms > 0, "the lock expired instead of being released"
    assert mod.work.delay(k, 0.1).get(timeout=30) == k
    assert first.state == "REVOKED"
    assert len(c.runs(k)) == 1


def test_warm_shutdown_lets_the_run_finish_and_release(c: Cluster) -> None:
    """SIGTERM (warm shutdown) of a worker mid-task: the run completes, its lock is released and the job runs again."""
    mod = c.app_module()
    victim = c.worker("victim-term", queues="victim")
    k = new_key()
    name = mod.work.lock_key_for(k)
    first = mod.work.apply_async((k, 2.0), queue="victim")
    c.wait_started(k)
    victim.stop(timeout=30)
    assert victim.process is not None
    assert victim.process.returncode == 0
    assert first.get(timeout=5) == k
    assert c.lock_free(name)
    assert mod.work.delay(k, 0.1).get(timeout=30) == k
    assert len(c.runs(k)) == 2


def test_soft_time_limit_releases_the_lock(c: Cluster) -> None:
    """A run stopped by its soft time limit fails with SoftTimeLimitExceeded, releases its lock, and can run again."""
    mod = c.app_module()
    k = new_key()
    name = mod.overrun.lock_key_for(k, 5.0)
    first = mod.overrun.delay(k, 5.0)
    c.wait_started(k)
    seen = seen_held(c, name)
    with pytest.raises(SoftTimeLimitExceeded):
        first.get(timeout=30)
    _, left_ms = wait_gone(c, name, TTL + 5, seen)
    assert left_ms > 0, "the lock expired instead of being released"
    assert mod.overrun.delay(k, 0.1).get(timeout=30) is None


def test_hard_time_limit_ends_the_lease_at_once(c: Cluster) -> None:
    """A run killed by its hard time limit (it swallows the soft one) fails, and its lease is ended at once: taken
    over by a ~1 s end lease nobody renews."""
    mod = c.app_module()
    k = new_key()
    name = mod.overrun.lock_key_for(k, 5.0)
    first = mod.overrun.delay(k, 5.0, True)
    c.wait_started(k)
    seen_held(c, name)  # held by the run before its limit
    assert_lease_ended_at_once(wait_ended(c, name, TTL + 5))  # watched from before the limit: nothing missed
    with pytest.raises(TimeLimitExceeded):
        first.get(timeout=30)
    assert mod.overrun.delay(k, 0.1).get(timeout=30) is None


def test_hard_time_limit_of_a_child_deaf_to_sigterm(c: Cluster) -> None:
    """A child deaf to SIGTERM, SIGKILLed at its hard time limit: its lease is ended at once (a ~1 s end lease),
    not renewed to its 6 s ttl."""
    # Its watchdog renews 2.05 s after the start: after the parent's after_return (at the 2 s limit) ended the lease
    # and before billiard's SIGKILL (0.1 s after a SIGTERM it ignores). Capping the lease's expiry was undone by that
    # renewal (held ~6 s more); taking the lock over is not.
    mod = c.app_module()
    k = new_key()
    name = mod.stubborn.lock_key_for(k, 10.0)
    first = mod.stubborn.delay(k, 10.0)
    c.wait_started(k)
    seen_held(c, name)  # held by the run before its limit
    # Its renewal after the take-over is refused: the end lease (~1 s), not the 6.15 s ttl it would renew to.
    assert_lease_ended_at_once(wait_ended(c, name, 15))  # watched from before the limit: nothing missed
    with pytest.raises(TimeLimitExceeded):
        first.get(timeout=30)
    assert mod.work.delay(new_key(), 0.0).get(timeout=30)  # the pool replaced the killed child


def test_lock_nodes_down_defer_the_job_until_they_return(c: Cluster, nodes_back: None) -> None:
    """With every lock node down the job neither runs nor is dropped: it waits with back-off, then runs once."""
    mod = c.app_module()
    k = new_key()
    c.stop_locks(3)
    result = mod.work.delay(k, 0.0)
    for _ in polling(15, 0.1):
        if other_logs(c, "w1", "w2").count(f"work[{result.id}] waits") >= 2:
            break
    assert other_logs(c, "w1", "w2").count(f"work[{result.id}] waits") >= 2, "no back-off seen"
    assert result.state == "PENDING"
    assert not c.started(k)
    c.start_locks()
    assert result.get(timeout=30) == k
    assert len(c.runs(k)) == 1


def test_lock_nodes_down_fail_and_run_policies(c: Cluster, nodes_back: None) -> None:
    """With no quorum, lock_on_unavailable='fail' fails at once (LockUnavailableError); 'run' runs, with a warning."""
    mod = c.app_module()
    a, b = new_key(), new_key()
    c.stop_locks(2)
    failed = mod.work_or_fail.delay(a)
    unguarded = mod.work_unguarded.delay(b)
    with pytest.raises(LockUnavailableError) as info:
        failed.get(timeout=10)
    assert mod.work_or_fail.lock_key_for(a) in str(info.value)
    assert not c.started(a)
    assert unguarded.get(timeout=10) == b
    assert f"work_unguarded[{unguarded.id}] runs UNGUARDED" in other_logs(c, "w1", "w2")


def test_quorum_loss_during_a_run_is_noticed_before_its_lease_runs_out(c: Cluster, nodes_back: None) -> None:
    """Losing 2 of 3 lock nodes mid-run: the watchdog's renewal notices (lock_held() turns False, check_lock()
    raises) before the lease it last renewed could have expired, so the run can stop before another may start."""
    mod = c.app_module()
    k = new_key()
    name = mod.watch_lock.lock_key_for(k, 15.0)
    result = mod.watch_lock.delay(k, 15.0)
    c.wait_started(k)
    time.sleep(0.3)
    # The lease's end as last seen before the stop: nothing can renew it after the stop, so it ends by then.
    before = time.time()
    ms_left, _ = seen_held(c, name)
    c.stop_locks(2)
    lease_end = before + ms_left / 1000
    out = result.get(timeout=30)
    assert out["lost_at"] is not None, "the run never noticed"
    # The first renewal after the stop comes within one interval (TTL/3); one that gets no quorum is retried for
    # one more interval before the lock is declared lost (a stall must not cost the lock), still before it ends.
    assert out["lost_at"] < lease_end, (out["lost_at"], lease_end)
    # Declared lost after one renewal interval of retries, each at least an eighth of an interval apart (renewal.py:
    # a quarter interval, or a quarter of a validity kept above half an interval): at most 8, a count, not a time.
    retries = other_logs(c, "w1", "w2").count(f"renewal of lock {name} got no quorum; retrying")
    assert 1 <= retries <= 8, retries
    assert out["error"].startswith("LockLostError")
    assert "renewal" in out["error"]  # noticed by the watchdog, not by the lease running out
    assert f"watch_lock[{result.id}] LOST while running" in other_logs(c, "w1", "w2")


def test_group_of_different_jobs_all_run(c: Cluster) -> None:
    """A group of three calls with different arguments runs all three."""
    mod = c.app_module()
    keys = [new_key() for _ in range(3)]
    assert group(mod.work.s(k, 0.3) for k in keys)().get(timeout=30) == keys


def test_chord_with_identical_members_completes(c: Cluster) -> None:
    """A chord with the same call twice in its header completes: the duplicate is rescheduled, not skipped."""
    mod = c.app_module()
    k = new_key()
    result = chord([mod.work.s(k, 0.5), mod.work.s(k, 0.5)])(mod.collect.s())
    assert result.get(timeout=45) == [k, k]
    runs = c.runs(k)
    assert len(runs) == 2
    assert not overlapping(runs)
    assert "(duplicate): lock" in other_logs(c, "w1", "w2")


def test_arguments_without_a_key_fail_clearly(c: Cluster) -> None:
    """Arguments no lock key can be built from end FAILURE (UnserializableArgumentsError); workers keep running."""
    # Two real cases under the JSON serializer: a message whose arguments do not fit the signature (sent by an
    # older client, say), and a value of a type the app registered with kombu's JSON serializer.
    mod = c.app_module()
    k = new_key()
    misfit = mod.app.send_task("locked_app.work", args=[k], kwargs={"colour": "blue"})
    with pytest.raises(UnserializableArgumentsError, match=r"lock key of locked_app\.work.*do not match"):
        misfit.get(timeout=30)
    opaque = mod.take_opaque.delay(k, mod.Opaque("x"))
    with pytest.raises(UnserializableArgumentsError, match=r"type Opaque has no canonical form.*lock_key="):
        opaque.get(timeout=30)
    assert not c.started(k)
    assert all(w.process is not None and w.process.poll() is None for w in c.workers if w.name in ("w1", "w2"))
    assert mod.work.delay(k, 0.0).get(timeout=30) == k


SOAK_MESSAGES = 2000
SOAK_KEYS = 30


def test_soak_no_overlap_and_every_message_accounted_for(c: Cluster, capsys: pytest.CaptureFixture[str]) -> None:
    """2000 messages on 30 keys with random duplicates: no two runs of a key overlap; each ran once or was REVOKED."""
    mod = c.app_module()
    seed = random.randrange(2**32)
    rng = random.Random(seed)
    tag = new_key("soak")
    sent: list[tuple[str, str, str]] = []  # (task name, key, task id)
    start = time.monotonic()
    for _ in range(SOAK_MESSAGES):
        if len(sent) >= SOAK_MESSAGES:
            break
        i = rng.randrange(SOAK_KEYS)
        later = rng.random() < 0.1  # lock_on_duplicate='reschedule' instead of 'skip'
        task, key = (mod.work_later, f"{tag}-L{i}") if later else (mod.work, f"{tag}-{i}")
        duration = round(rng.uniform(0.0, 0.03), 4)
        for _ in range(1 if rng.random() < 0.7 else rng.randint(2, 4)):  # random duplicates, back to back
            sent.append((task.name, key, task.delay(key, duration).id))
    ids = [t for _, _, t in sent]
    states: dict[str, str] = {}
    for _ in polling(120, 0.5):
        states = c.states(ids)
        if all(s in ("SUCCESS", "REVOKED", "FAILURE") for s in states.values()):
            break
    drained = time.monotonic() - start
    records = [r for r in c.records("runs") if r[0].startswith(tag)]
    by_key: dict[str, list[list[Any]]] = {}
    for r in records:
        by_key.setdefault(r[0], []).append(r)
    ran = Counter(r[1] for r in records)
    counts = Counter(states.values())
    rescheduled = sum(w.log().count("(duplicate): lock singleton_lock:locked_app.work_later") for w in c.workers)
    with capsys.disabled():
        print(
            f"\nsoak (seed {seed}): {len(sent)} messages drained in {drained:.1f} s: {counts['SUCCESS']} ran, "
            f"{counts['REVOKED']} skipped as duplicates, {rescheduled} reschedulings"
        )
    pending = [t for t, s in states.items() if s not in ("SUCCESS", "REVOKED")]
    assert not pending, f"{len(pending)} messages neither ran nor were skipped, e.g. {pending[:3]}"
    assert {k: o for k, runs in by_key.items() if (o := overlapping(runs))} == {}
    assert [t for t, n in ran.items() if n > 1] == []
    assert set(ran) <= set(ids)
    for name, _key, task_id in sent:
        if states[task_id] == "SUCCESS":
            assert ran[task_id] == 1, f"{task_id} is SUCCESS but never ran"
        else:
            assert name == mod.work.name, f"{task_id} of {name} (reschedule policy) was skipped"
            assert ran[task_id] == 0


def test_no_password_in_worker_logs(c: Cluster, nodes_back: None) -> None:
    """Lock nodes down (every node error logged, naming its node) and back: no worker log contains the lock
    nodes' password; the settings line shows ***. (Independent of the tests before it; their faults are checked
    too, as they are in the same logs.)"""
    mod = c.app_module()
    k = new_key()
    c.stop_locks(3)
    result = mod.work.delay(k, 0.0)
    for _ in polling(15, 0.1):
        if f"work[{result.id}] waits" in other_logs(c, "w1", "w2"):
            break
    c.start_locks()
    assert result.get(timeout=30) == k
    logs = {w.name: w.log() for w in c.workers}
    waits = [line for line in "".join(logs.values()).splitlines() if f"work[{result.id}] waits" in line]
    assert waits, "the outage was not logged"
    assert "127.0.0.1" in waits[0], waits[0]  # the line names the nodes: the password had a chance to appear
    assert all(PASSWORD not in text for text in logs.values())
    assert "redis://:***@127.0.0.1" in logs["w1"]
