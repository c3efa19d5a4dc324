"""The fast tier: LockedTask through a real Celery worker running in this process, on pytest-celery's fixtures.

``celery_app`` (Celery's test app, which pytest-celery provides), configured by our ``celery_config``, is pointed at
three real lock nodes by the plugin's ``singleton_lock_app``; a real worker (``start_worker``, what Celery's own
worker fixtures use) consumes a queue of this test's own on a real Redis broker and result backend, with the pool
and parameters of ``celery_worker_pool`` / ``celery_worker_parameters``. The ``threads`` pool runs bodies in this
process: a test holds a job inside its body on a ``threading.Event`` while it sends the duplicate, and receives
the library's signals directly. Crashes, SIGKILL, time limits and several processes stay with the subprocess
workers (test_locked_task_workers.py and friends).
"""

from __future__ import annotations

import contextlib
import threading
import uuid
import warnings
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any

import pytest
from celery import Celery
from celery.exceptions import DuplicateTaskNameWarning
from celery.signals import task_success

from celery_singleton_lock import LockedTask, LockLostError, Skipped
from celery_singleton_lock.task import signals
from celery_singleton_lock.testing import (
    RedisServer,
    _forget_lock_settings,
    assert_holds_lock,
    assert_no_locks_left,
    assert_skipped_duplicate,
    in_process_worker,
    wait_for,
)

WAIT = 10.0  # seconds any single outcome may take on a loaded CI machine


@pytest.fixture(scope="module")
def celery_config(singleton_lock_node: RedisServer) -> dict[str, Any]:
    """pytest-celery's ``celery_config``: broker and results on a real Redis (the plugin's node, dbs 1 and 2)."""
    base = f"redis://127.0.0.1:{singleton_lock_node.port}"
    return {"broker_url": f"{base}/1", "result_backend": f"{base}/2", "task_track_started": True}


@pytest.fixture(scope="module")
def celery_worker_pool() -> str:
    """Threads: two bodies of this process can run at once (the ``solo`` default runs one at a time)."""
    return "threads"


@pytest.fixture(scope="module")
def celery_worker_parameters() -> dict[str, Any]:
    return {"concurrency": 4, "shutdown_timeout": 15.0}


@pytest.fixture
def singleton_lock_urls(singleton_lock_nodes: list[RedisServer]) -> list[str]:
    """Three lock nodes (quorum 2) instead of the plugin's one."""
    return [node.url for node in singleton_lock_nodes]


class Gate:
    """A job's body waits here until the test opens it; the test waits for the body to arrive first."""

    def __init__(self) -> None:
        self.arrived = threading.Event()
        self.opened = threading.Event()

    def hold(self) -> None:
        self.arrived.set()
        if not self.opened.wait(WAIT):
            raise RuntimeError("the test never opened the gate")


@pytest.fixture
def tasks(singleton_lock_app: Celery) -> SimpleNamespace:
    """The tasks of one test, registered before its worker starts (the worker knows only those)."""
    app = singleton_lock_app
    app.conf.task_default_queue = f"fast-{uuid.uuid4().hex[:8]}"  # nothing left by another test reaches this one
    ns = SimpleNamespace(gate=Gate(), runs=[], retries_seen=[])

    @app.task(base=LockedTask, shared=False, bind=True, lock_ttl=3)
    def hold(self: Any, n: int) -> int:
        ns.runs.append(self.request.id)
        ns.gate.hold()
        return n

    @app.task(base=LockedTask, shared=False, bind=True, lock_ttl=3, lock_on_duplicate="fail")
    def hold_or_fail(self: Any, n: int) -> int:
        ns.gate.hold()
        return n

    @app.task(base=LockedTask, shared=False, bind=True, lock_ttl=2, lock_on_duplicate="reschedule")
    def hold_or_wait(self: Any, n: int) -> str:
        ns.runs.append(self.request.id)
        if len(ns.runs) == 1:
            ns.gate.hold()
        return self.request.id

    @app.task(base=LockedTask, shared=False, bind=True, lock_ttl=3, max_retries=2)
    def flaky(self: Any, n: int) -> int:
        ns.retries_seen.append(self.request.retries)
        if self.request.retries == 0:
            raise self.retry(countdown=1.5)
        return n

    @app.task(base=LockedTask, shared=False, bind=True, lock_ttl=1)
    def loses_its_lock(self: Any, n: int) -> str:
        ns.gate.arrived.set()
        wait_for(lambda: not self.lock_held(), timeout=WAIT)
        try:
            self.check_lock()
        except LockLostError as exc:
            return f"stopped: {exc}"
        return "still held"

    @app.task(base=LockedTask, shared=False, lock_ttl=3, lock_cooldown=30)
    def cooled(n: int) -> int:
        return n

    ns.hold, ns.hold_or_fail, ns.hold_or_wait, ns.flaky, ns.loses_its_lock, ns.cooled = (
        hold,
        hold_or_fail,
        hold_or_wait,
        flaky,
        loses_its_lock,
        cooled,
    )
    return ns


@pytest.fixture
def worker(
    tasks: SimpleNamespace,
    singleton_lock_app: Celery,
    celery_worker_pool: str,
    celery_worker_parameters: dict[str, Any],
) -> Iterator[Any]:
    """A real worker of ``celery_worker_pool`` in a thread (Celery's ``start_worker``, through
    ``in_process_worker``, which puts back the logging it changes), started after the test's tasks exist."""
    with contextlib.ExitStack() as stack:
        with warnings.catch_warnings():
            # Starting finalizes the app, which pulls in every task other modules defined with Celery's default
            # shared=True; two of their tests sharing a task name warn here. Ours are shared=False.
            warnings.simplefilter("ignore", DuplicateTaskNameWarning)
            w = stack.enter_context(
                in_process_worker(singleton_lock_app, pool=celery_worker_pool, **celery_worker_parameters)
            )
        stack.callback(tasks.gate.opened.set)  # first: the worker's shutdown waits for a body still at the gate
        yield w


@pytest.fixture
def received() -> Iterator[Callable[[str], list[dict[str, Any]]]]:
    """What each of our signals was sent with, in this process (the worker's threads included)."""
    seen: dict[str, list[dict[str, Any]]] = {}
    receivers = []
    for name in ("lock_acquired", "duplicate_skipped", "lock_released", "lock_waiting", "lock_lost"):
        signal = getattr(signals, name)

        def receiver(sender: Any, _name: str = name, **kwargs: Any) -> None:
            seen.setdefault(_name, []).append({k: v for k, v in kwargs.items() if k != "signal"})

        signal.connect(receiver, weak=False)
        receivers.append((signal, receiver))
    yield lambda name: seen.get(name, [])
    for signal, receiver in receivers:
        signal.disconnect(receiver)


def test_a_copy_sent_while_the_job_runs_is_skipped_naming_the_holder(tasks: SimpleNamespace, worker: Any) -> None:
    """While a job runs, a copy of it is skipped at once (REVOKED, naming the running job), a different job runs
    beside it, and when the job ends nothing is left locked."""
    first = tasks.hold.delay(7)
    assert tasks.gate.arrived.wait(WAIT)
    info = assert_holds_lock(tasks.hold, (7,), by=first.id)
    assert info.total == 3
    assert len(info.nodes) >= 2
    duplicate = tasks.hold.delay(7)
    assert assert_skipped_duplicate(duplicate, of=first.id, timeout=WAIT) == first.id
    other = tasks.hold.delay(8)  # another job: not a duplicate (the gate is still closed: it waits in its body)
    assert_holds_lock(tasks.hold, (8,), by=other.id)
    tasks.gate.opened.set()
    assert first.get(timeout=WAIT) == 7
    assert other.get(timeout=WAIT) == 8
    assert tasks.runs.count(duplicate.id) == 0
    assert_no_locks_left(tasks.hold.app)


def test_signals_reach_receivers_in_this_process(
    tasks: SimpleNamespace, worker: Any, received: Callable[[str], list[dict[str, Any]]]
) -> None:
    """lock_acquired (with the fencing token), duplicate_skipped (naming the holder and the policy) and
    lock_released are sent from the worker's threads to receivers connected in the test."""
    first = tasks.hold.delay(1)
    assert tasks.gate.arrived.wait(WAIT)
    duplicate = tasks.hold.delay(1)
    assert_skipped_duplicate(duplicate, of=first.id, timeout=WAIT)
    tasks.gate.opened.set()
    first.get(timeout=WAIT)
    key = tasks.hold.lock_key_for(1)
    assert wait_for(lambda: len(received("lock_released")) == 1, timeout=WAIT)
    (acquired,) = received("lock_acquired")
    assert acquired["key"] == key
    assert acquired["task_id"] == first.id
    assert isinstance(acquired["fencing_token"], int)
    assert acquired["fencing_token"] > 0
    (skipped,) = received("duplicate_skipped")
    assert skipped == {"key": key, "task_id": duplicate.id, "holder_task_id": first.id, "policy": "skip"}
    (released,) = received("lock_released")
    assert released["task_id"] == first.id
    assert released["held"]


def test_celerys_task_success_sees_a_skipped_duplicate_as_a_skipped_marker(tasks: SimpleNamespace, worker: Any) -> None:
    """monitoring.md promises Celery's own ``task_success`` receivers: it still fires for a duplicate skipped in the
    pool (here: ``singleton_lock_skip_before_pool=False``; a duplicate skipped before the pool never reaches it), with
    ``result`` a ``Skipped`` (its reason naming the holder), while the job's own run gets its real return value."""
    seen: dict[str, Any] = {}

    def receiver(sender: Any = None, result: Any = None, **kwargs: Any) -> None:
        seen[sender.request.id] = result

    app = tasks.hold.app
    app.conf.singleton_lock_skip_before_pool = False
    _forget_lock_settings(app)
    task_success.connect(receiver, weak=False)
    try:
        first = tasks.hold.delay(11)
        assert tasks.gate.arrived.wait(WAIT)
        duplicate = tasks.hold.delay(11)
        assert_skipped_duplicate(duplicate, of=first.id, timeout=WAIT)
        assert wait_for(lambda: duplicate.id in seen, timeout=WAIT)
        tasks.gate.opened.set()
        assert first.get(timeout=WAIT) == 11
        assert wait_for(lambda: first.id in seen, timeout=WAIT)
    finally:
        task_success.disconnect(receiver)
        app.conf.pop("singleton_lock_skip_before_pool", None)
        _forget_lock_settings(app)
    skipped = seen[duplicate.id]
    assert isinstance(skipped, Skipped), skipped
    assert first.id in repr(skipped)
    assert seen[first.id] == 11


def test_fail_policy_fails_the_duplicate_naming_the_holder(tasks: SimpleNamespace, worker: Any) -> None:
    """lock_on_duplicate='fail': the copy's result is FAILURE with DuplicateTaskError naming the running job, and
    assert_skipped_duplicate says it failed rather than being skipped."""
    first = tasks.hold_or_fail.delay(3)
    assert tasks.gate.arrived.wait(WAIT)
    duplicate = tasks.hold_or_fail.delay(3)
    error = duplicate.get(timeout=WAIT, propagate=False)
    assert duplicate.state == "FAILURE"
    assert type(error).__name__ == "DuplicateTaskError"
    assert first.id in str(error)
    with pytest.raises(AssertionError, match=r"failed as a duplicate .* lock_on_duplicate is 'fail'"):
        assert_skipped_duplicate(duplicate, timeout=WAIT)
    tasks.gate.opened.set()
    assert first.get(timeout=WAIT) == 3
    assert_no_locks_left(tasks.hold_or_fail.app)


def test_reschedule_policy_runs_the_duplicate_after_the_holder(
    tasks: SimpleNamespace, worker: Any, received: Callable[[str], list[dict[str, Any]]]
) -> None:
    """lock_on_duplicate='reschedule': the copy is re-sent (lock_waiting) and runs once the holder has released,
    never beside it; its caller gets its own SUCCESS."""
    first = tasks.hold_or_wait.delay(5)
    assert tasks.gate.arrived.wait(WAIT)
    duplicate = tasks.hold_or_wait.delay(5)
    assert wait_for(lambda: bool(received("lock_waiting")), timeout=WAIT)
    assert received("lock_waiting")[0]["task_id"] == duplicate.id
    assert tasks.runs == [first.id]  # not run beside the holder
    tasks.gate.opened.set()
    assert first.get(timeout=WAIT) == first.id
    assert duplicate.get(timeout=WAIT) == duplicate.id
    assert tasks.runs == [first.id, duplicate.id]
    assert_no_locks_left(tasks.hold_or_wait.app, timeout=WAIT)


def test_a_retry_keeps_the_lock_until_the_retry_runs(tasks: SimpleNamespace, worker: Any) -> None:
    """self.retry() hands the lock to the retry: meanwhile a copy of the job is skipped as a duplicate of the
    retrying task id; the retry runs and succeeds, and releases."""
    job = tasks.flaky.delay(9)
    assert_holds_lock(tasks.flaky, (9,), by=job.id, state="retry-wait", timeout=WAIT)
    duplicate = tasks.flaky.delay(9)
    assert_skipped_duplicate(duplicate, of=job.id, timeout=WAIT)
    assert job.get(timeout=WAIT) == 9
    assert tasks.retries_seen == [0, 1]
    assert_no_locks_left(tasks.flaky.app)


def test_a_copy_within_the_cooldown_is_skipped_naming_the_finished_run(tasks: SimpleNamespace, worker: Any) -> None:
    """lock_cooldown: the same job sent after a success, within the cooldown, is REVOKED as a duplicate of the
    finished run (the reason says it is cooling down), and the lock is left held on purpose."""
    first = tasks.cooled.delay(6)
    assert first.get(timeout=WAIT) == 6
    assert_holds_lock(tasks.cooled, (6,), by=first.id, state="cooldown")
    later = tasks.cooled.delay(6)
    assert assert_skipped_duplicate(later, of=first.id, timeout=WAIT) == first.id
    assert "cooling down until" in str(later.result)
    with pytest.raises(AssertionError, match="cooldown"):
        assert_no_locks_left(tasks.cooled.app)


def test_a_lost_lock_is_noticed_by_the_body(
    tasks: SimpleNamespace,
    worker: Any,
    singleton_lock_nodes: list[RedisServer],
    received: Callable[[str], list[dict[str, Any]]],
) -> None:
    """The watchdog renews in the worker's process; when the lock's records vanish from every node, the next
    renewal fails: lock_held() turns False, check_lock() raises, and lock_lost is sent."""
    job = tasks.loses_its_lock.delay(4)
    assert tasks.gate.arrived.wait(WAIT)
    key = tasks.loses_its_lock.lock_key_for(4)
    assert_holds_lock(tasks.loses_its_lock, (4,), by=job.id)
    for node in singleton_lock_nodes:
        node.client().delete(key)
    outcome = job.get(timeout=WAIT)
    assert outcome.startswith("stopped: lock ")
    assert key in outcome
    (lost,) = received("lock_lost")
    assert lost["key"] == key
    assert lost["task_id"] == job.id


@pytest.mark.parametrize("celery_worker_pool", ["solo"])
def test_under_the_solo_pool_a_copy_waits_behind_the_job_and_runs(tasks: SimpleNamespace, worker: Any) -> None:
    """celery_session_worker's default pool runs one task at a time: a copy sent while the job is queued or running
    is taken only after the job released its lock, so it runs too (the solo pool cannot show a skip)."""
    tasks.gate.opened.set()
    first, second = tasks.hold.delay(2), tasks.hold.delay(2)
    assert first.get(timeout=WAIT) == 2
    assert second.get(timeout=WAIT) == 2
    assert tasks.runs == [first.id, second.id]
    assert_no_locks_left(tasks.hold.app)
