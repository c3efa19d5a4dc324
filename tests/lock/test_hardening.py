"""Regression tests for the review's defects, through Celery's tracer in this process (``apply()``).

Each test failed on the code before its fix (see the CHANGELOG entry). Real redis-server, no worker, and no
result backend unless a test says so: what they see is decided by the lock alone.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

import pytest
import redis
from celery import Celery

from celery_singleton_lock import LockedTask, Skipped
from celery_singleton_lock.errors import DuplicateTaskError
from celery_singleton_lock.lock.redlock import NodeSet, Redlock, done_key_for
from celery_singleton_lock.task._brokers import visibility_timeout as _visibility_timeout
from celery_singleton_lock.task._handover import end_lease_of
from celery_singleton_lock.testing import RedisServer


@pytest.mark.parametrize("holder_id", ["nightly|done|1", "|done|", "done", "x|retry|y", "a|b|c|d|123|e"])
def test_a_holder_whose_id_looks_like_a_marker_still_excludes_others(app: Celery, holder_id: str) -> None:
    """A live holder whose task id contains '|done|' (or any separator soup) is a holder like any other: another
    job with the same arguments is skipped as its duplicate, never run beside it."""
    seen: list[Any] = []

    @app.task(shared=False, base=LockedTask, bind=True)
    def nightly(self: Any, n: int) -> str:
        if self.request.id == holder_id:
            seen.append(nightly.apply(args=(n,), task_id=f"other-{uuid.uuid4().hex[:6]}").get())
        return self.request.id

    assert nightly.apply(args=(1,), task_id=holder_id).get() == holder_id
    assert len(seen) == 1
    assert isinstance(seen[0], Skipped)
    assert seen[0].holder_task_id == holder_id


@pytest.mark.parametrize("task_id", ["done", "|done|", "job|done|7"])
def test_a_task_id_that_looks_like_a_marker_is_an_ordinary_job(app: Celery, task_id: str) -> None:
    """After another job succeeded, a job whose id reads 'done' runs (it is not that job's done marker); once it
    succeeded, a copy of the same id stops as already succeeded and a new id runs."""
    runs: list[str] = []

    @app.task(shared=False, base=LockedTask, bind=True)
    def job(self: Any, n: int) -> str:
        runs.append(self.request.id)
        return self.request.id

    assert job.apply(args=(5,), task_id="first").get() == "first"
    assert job.apply(args=(5,), task_id=task_id).get() == task_id
    again = job.apply(args=(5,), task_id=task_id).get()
    assert isinstance(again, Skipped)
    assert again.reason == "already ran"
    assert job.apply(args=(5,), task_id="last").get() == "last"
    assert runs == ["first", task_id, "last"]


def test_a_late_copy_of_a_finished_job_never_runs_it_again(app: Celery, redis_node: RedisServer) -> None:
    """With no result backend the done marker is the only memory of a success: a copy of the same task id that
    starts several ttls later (a busy pool, a long countdown) still stops, as already succeeded."""
    runs: list[str] = []

    @app.task(shared=False, base=LockedTask, bind=True, lock_ttl=0.3, ignore_result=True)
    def job(self: Any, n: int) -> None:
        runs.append(self.request.id)

    job.apply(args=(1,), task_id="late-1").get()
    time.sleep(1.0)  # over 3 ttls: the old marker (ttl + 0.5 s) was gone by now
    late = job.apply(args=(1,), task_id="late-1").get()
    assert isinstance(late, Skipped)
    assert late.reason == "already ran"
    assert runs == ["late-1"]
    marker = redis_node.client().pttl(done_key_for(job.lock_key_for(1), "late-1"))
    assert marker > 50_000  # at least a minute after the success, whatever the ttl


def test_a_copy_waiting_for_its_twin_keeps_the_done_marker_for_the_whole_window(
    app: Celery, redis_node: RedisServer
) -> None:
    """A copy of the same task id that arrived while its twin ran (and was sent to wait) marks the twin's record
    'waiting'; the twin's success then keeps the done marker for the documented window (longest wait we create,
    or the broker's visibility timeout, plus a margin), not the short default."""
    app.conf.broker_transport_options = {"visibility_timeout": 1000}

    @app.task(shared=False, base=LockedTask, bind=True, lock_ttl=2)
    def job(self: Any, n: int) -> None:
        with pytest.raises(DuplicateTaskError):  # eager: a copy that would be re-sent to wait raises instead
            job.apply(args=(n,), task_id=self.request.id, throw=True).get()
        assert redis_node.client().hget(job.lock_key_for(n), "waiting") == b"1"

    job.apply(args=(2,), task_id="twin-1", throw=True).get()
    marker = redis_node.client().pttl(done_key_for(job.lock_key_for(2), "twin-1"))
    # docs/cli.md: past the broker's visibility timeout (1000 s, longer than 2 ttls) plus 5 minutes.
    window = 1000 + 5 * 60
    assert (window - 5) * 1000 < marker <= window * 1000


def test_the_visibility_timeout_cap_uses_kombu_s_default(redis_node: RedisServer) -> None:
    """A Redis broker with no visibility_timeout set has kombu's 3600 s: re-sent copies are capped at half of it
    (they used to be uncapped, so a lock_ttl >= 3600 let waiting copies multiply); AMQP has none; an explicit
    value wins."""
    redis_app = Celery("vt", broker=redis_node.url, set_as_current=False)
    assert _visibility_timeout(redis_app) == 3600.0
    redis_app.conf.singleton_lock_urls = [redis_node.url]

    @redis_app.task(base=LockedTask, lock_ttl=7200)
    def slow() -> None: ...

    assert slow._options().max_countdown == 1800.0
    assert slow._options().done_window >= 3600.0
    explicit = Celery("vt2", broker=redis_node.url, set_as_current=False)
    explicit.conf.broker_transport_options = {"visibility_timeout": 120}
    assert _visibility_timeout(explicit) == 120.0
    amqp = Celery("vt3", broker="amqp://guest:guest@127.0.0.1:5672//", set_as_current=False)
    assert _visibility_timeout(amqp) is None


def test_the_enqueue_check_sends_a_call_with_its_own_task_id(app: Celery, redis_node: RedisServer) -> None:
    """With lock_enqueue_check, a call without a task id returns the running run's result; a call that names its own
    task id is sent as asked (its caller waits on that id, which another run's result would leave PENDING)."""

    @app.task(shared=False, base=LockedTask, lock_enqueue_check=True)
    def charge(order: int) -> None: ...

    holder = Redlock(app.conf.singleton_lock_urls, charge.lock_key_for(7), ttl=10, job="running-1")
    assert holder.acquire(blocking=False)
    try:
        assert charge.delay(7).id == "running-1"
        assert charge.apply_async((7,), task_id="mine").id == "mine"
    finally:
        holder.release()


def test_lock_held_turns_false_from_the_local_deadline_without_renewal(app: Celery) -> None:
    """A body that starves the watchdog (CPU-bound under gevent) sees lock_held() turn False once the lease's
    local deadline passes, with no I/O: simulated by taking the lease away from the watchdog."""
    from celery_singleton_lock.lock.renewal import watchdog  # noqa: PLC0415

    observed: list[bool] = []

    @app.task(shared=False, base=LockedTask, bind=True, lock_ttl=0.4)
    def busy(self: Any) -> None:
        run = self._current()
        watchdog().unregister(run.lease)  # as if the watchdog never got to run
        observed.append(self.lock_held())
        time.sleep(0.5)
        observed.append(self.lock_held())

    busy.apply().get()
    assert observed == [True, False]


class _FailingSend(redis.Connection):
    """A connection whose first script call fails to write, as a socket reset mid-write would."""

    failures = 1

    def send_packed_command(self, command: Any, check_health: bool = True) -> None:
        if _FailingSend.failures > 0 and b"EVALSHA" in b"".join(command if isinstance(command, list) else [command]):
            _FailingSend.failures -= 1
            raise OSError("connection reset while writing (injected)")
        super().send_packed_command(command, check_health=check_health)


def test_a_failed_write_returns_the_connection_to_a_caller_s_pool(redis_node: RedisServer, name: str) -> None:
    """A client passed in with a bounded blocking pool gets its connection back when writing a command fails: the
    next lock call finds one instead of waiting for a connection that leaked."""
    pool = redis.BlockingConnectionPool(
        connection_class=_FailingSend, host="127.0.0.1", port=redis_node.port, max_connections=1, timeout=0.5
    )
    client = redis.Redis(connection_pool=pool)
    nodes = NodeSet([client])
    lock = Redlock(nodes, name, ttl=5)
    assert not lock.acquire(blocking=False)
    assert lock.node_errors
    assert lock.acquire(blocking=False), lock.node_errors
    assert lock.release()


# -- found by the adversarial review of the holder record (each failed on the commit that introduced the record) --


def test_a_repaired_node_gets_the_whole_record_back(fresh_trio: list[RedisServer], name: str) -> None:
    """A node that lost its data is repaired by the next renewal with the whole holder record, not just owner and
    fence; and a reader merges one owner's records across nodes, so a stripped record never hides the job (a retry
    or redelivery of the same task id used to read 'held by task None' and be skipped as a duplicate)."""
    urls = [s.url for s in fresh_trio]
    lock = Redlock(urls, name, ttl=5, job="task-7", record={"state": "run", "name": "t"})
    assert lock.acquire(blocking=False)
    fresh_trio[0].restart()
    assert lock.extend()
    assert fresh_trio[0].client().hget(name, "job") == b"task-7"
    fresh_trio[1].client().hdel(name, "job", "state", "name")  # a record stripped some other way
    seen = Redlock(urls, name, ttl=5, job="task-7")
    assert not seen.acquire(blocking=False)
    assert seen.holder_record is not None
    assert seen.holder_record["job"] == "task-7"
    whole = Redlock(urls, name).holder()
    assert whole is not None
    assert seen.holder_record.items() <= whole.items()  # a refusal answers the fields a decision needs
    assert whole["job"] == "task-7"
    assert lock.release()


def test_a_failed_take_over_puts_the_hand_over_back(fresh_trio: list[RedisServer], name: str) -> None:
    """A take-over of a retry's hand-over that fails its quorum (one node unreachable, one paused) undoes itself by
    putting the hand-over back, also on the paused node when it wakes: a different job then cannot take the
    reservation's place (the undo used to delete it)."""
    urls = [s.url for s in fresh_trio]
    run = Redlock(urls, name, ttl=10, job="X", record={"state": "run"})
    assert run.acquire(blocking=False)
    assert run.transfer(10, {"state": "retry", "open": "1"})
    handover = run.token
    dead = "redis://127.0.0.1:1/0"  # nothing listens on port 1: refused at once
    retry = Redlock([urls[0], dead, urls[2]], name, ttl=10, job="X", socket_timeout=0.2)
    retry.replaces = handover
    fresh_trio[2].pause()
    try:
        assert not retry.acquire(blocking=False)
    finally:
        fresh_trio[2].resume()
    deadline = time.monotonic() + 5
    owners: list[bytes | None] = []
    while time.monotonic() < deadline:  # the paused node runs the queued undo when it wakes
        owners = [s.client().hget(name, "owner") for s in fresh_trio]
        if owners == [handover.encode()] * 3:
            break
        time.sleep(0.02)
    assert owners == [handover.encode()] * 3
    assert fresh_trio[0].client().hget(name, "state") == b"retry"
    assert not Redlock(urls, name, ttl=5, job="Y").acquire(blocking=False)


def test_a_job_s_own_retry_does_not_mark_its_hand_over_waiting(redis_node: RedisServer, name: str) -> None:
    """The retry's first acquire is refused by its own hand-over (open for it): that is not a copy waiting for a
    twin, so the record is not marked 'waiting' (every retried job used to keep its done marker for an hour)."""
    run = Redlock(redis_node.url, name, ttl=5, job="X", record={"state": "run"})
    assert run.acquire(blocking=False)
    assert run.transfer(5, {"state": "retry", "open": "1"})
    assert not Redlock(redis_node.url, name, ttl=5, job="X").acquire(blocking=False)
    assert redis_node.client().hget(name, "waiting") is None
    run.transfer(5, {"state": "run", "open": ""}, renewable=True)
    assert not Redlock(redis_node.url, name, ttl=5, job="X").acquire(blocking=False)
    assert redis_node.client().hget(name, "waiting") == b"1"
    run.release()


def test_a_key_that_is_not_a_record_fails_only_its_own_renewal(redis_node: RedisServer, name: str) -> None:
    """A batched renewal with one lock whose key was overwritten by a string (another tool, an old version) answers
    'lost' for that lock alone; the others in the batch are extended (the whole batch used to fail)."""
    nodes = NodeSet([redis_node.url])
    good, bad = Redlock(nodes, name, ttl=5), Redlock(nodes, name + ":b", ttl=5)
    assert good.acquire(blocking=False) and bad.acquire(blocking=False)
    redis_node.client().set(name + ":b", "not a record", px=5000)
    assert Redlock.nodes_extend([good, bad]) == [True, False]
    assert good.release()


def test_a_task_id_with_a_lone_surrogate_runs(app: Celery, redis_node: RedisServer) -> None:
    """A JSON message can carry a lone surrogate in its task id ('\\ud800'): the lock is taken and released as for
    any id, and a copy of that id stops on its done marker (it used to fail the task with UnicodeEncodeError)."""
    runs: list[str] = []

    @app.task(shared=False, base=LockedTask, bind=True)
    def job(self: Any, n: int) -> int:
        # The record names the id, surrogate and all (assert_holds_lock reads it as the CLI shows it: U+FFFD).
        assert redis_node.client().hget(job.lock_key_for(n), "job") == self.request.id.encode("utf-8", "surrogatepass")
        runs.append(self.request.id)
        return n

    # The node has our scripts cached after a first run (so this test does not depend on the tests before it): the
    # NOSCRIPT fallback is the next test's.
    assert job.apply(args=(0,), task_id="plain", throw=True).get() == 0
    assert job.apply(args=(1,), task_id="id-\ud800", throw=True).get() == 1
    assert redis_node.client().exists(job.lock_key_for(1)) == 0  # released
    again = job.apply(args=(1,), task_id="id-\ud800", throw=True).get()
    assert isinstance(again, Skipped) and again.reason == "already ran", again
    assert job.apply(args=(1,), task_id="id-\udc00", throw=True).get() == 1  # another id is another run
    assert runs == ["plain", "id-\ud800", "id-\udc00"]


def test_a_task_id_with_a_lone_surrogate_runs_on_a_node_without_our_scripts(fresh_node: RedisServer) -> None:
    """The first run on a node that has not cached our scripts (new, restarted, SCRIPT FLUSHed) sends EVAL instead
    of EVALSHA: a task id with a lone surrogate runs there too."""
    app = Celery(f"surrogate-{uuid.uuid4().hex[:8]}", broker="memory://", set_as_current=False)
    app.conf.singleton_lock_urls = [fresh_node.url]

    @app.task(shared=False, base=LockedTask)
    def job(n: int) -> int:
        return n

    try:
        assert job.apply(args=(1,), task_id="id-\ud800", throw=True).get() == 1
    finally:
        app.close()


def test_a_hard_time_limit_ends_only_the_killed_run_s_lease(app: Celery, redis_node: RedisServer) -> None:
    """After a hard time limit the main process takes over only a record the killed child wrote (its pid): another
    delivery of the same task id (a retry, a redelivered twin) that holds the lock by now keeps it."""

    @app.task(shared=False, base=LockedTask)
    def job(n: int) -> None: ...

    key = job.lock_key_for(3)
    twin = Redlock(app.conf.singleton_lock_urls, key, ttl=10, job="X", record={"state": "run", "worker": "111@h"})
    assert twin.acquire(blocking=False)
    end_lease_of(job.lock_context(), "X", key, "222@h")  # the killed child was 222
    assert redis_node.client().hget(key, "owner") == twin.token.encode()
    end_lease_of(job.lock_context(), "X", key, "111@h")
    assert redis_node.client().hget(key, "state") == b"ending"
    assert 0 < redis_node.client().pttl(key) <= 1000


def test_the_undo_snapshot_does_not_grow_with_retries(redis_node: RedisServer, name: str) -> None:
    """Hand-over and take-over thirty times (a job retried thirty times): the taken-over record kept for an undo
    stays one level deep (it used to nest and double every retry, stalling the node after ~20)."""
    holder = Redlock(redis_node.url, name, ttl=10, job="X", record={"state": "run"})
    assert holder.acquire(blocking=False)
    for _ in range(30):
        assert holder.transfer(10, {"state": "retry", "open": "1"})
        retry = Redlock(redis_node.url, name, ttl=10, job="X", record={"state": "run"})
        retry.replaces = holder.token
        assert retry.acquire(blocking=False)
        holder = retry
    assert redis_node.client().memory_usage(name) < 2048
    assert holder.release()


def test_an_odd_try_field_is_an_unknown_try() -> None:
    """A record's 'try' that is not a plain decimal number (another tool's record, '²' counts as a digit to
    str.isdigit) is unknown, never an error in before_start."""
    from celery_singleton_lock.task._run import try_of as _try_of  # noqa: PLC0415

    assert _try_of({"try": "3"}) == 3
    assert _try_of({"try": "\u00b2"}) is None
    assert _try_of({"try": ""}) is None
    assert _try_of({}) is None
