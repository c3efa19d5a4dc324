"""Queue scope from an event loop (aapply_async / adelay, _enqueue.asend/areserve) beside sync callers: one job
under mixed sync/async callers, slow publishes, cancelled callers, a loop closed while the background publish runs,
a lock node paused, a refusal short of a quorum. One worker set for the module; every wait bounded."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import worker_cluster as wc
from celery.signals import before_task_publish

from celery_singleton_lock import AsyncRedlock, Redlock
from celery_singleton_lock.lock.aio import aclose
from celery_singleton_lock.lock.scripts import ACQUIRE
from celery_singleton_lock.policies.decision import SENDING
from celery_singleton_lock.task import _enqueue as enqueue

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def c(tmp_path_factory: pytest.TempPathFactory) -> Iterator[wc.Cluster]:
    with wc.cluster(tmp_path_factory.mktemp("enqueue-async"), ttl=3.0) as c:
        c.worker("w1")
        c.app_module()
        yield c


@contextlib.contextmanager
def first_publish_held(task_name: str, release: threading.Event) -> Iterator[list[str]]:
    """The first publish of ``task_name`` waits (bounded 20 s) for ``release``; the list gets every publish's id."""
    seen: list[str] = []

    def hold(sender: Any = None, headers: Any = None, **_: Any) -> None:
        if sender == task_name:
            seen.append((headers or {}).get("id", ""))
            if len(seen) == 1:
                release.wait(20)

    before_task_publish.connect(hold, weak=False)
    try:
        yield seen
    finally:
        before_task_publish.disconnect(hold)


def consume(c: wc.Cluster, queue: str) -> None:
    mod = c.app_module()
    replies = mod.app.control.add_consumer(queue, destination=[f"w1@{os.uname().nodename}"], reply=True, timeout=5)
    assert replies, f"w1 did not start consuming {queue}"


async def until_sending(c: wc.Cluster, key: str) -> None:
    for _ in range(1000):  # bounded
        if await asyncio.to_thread(c.holder_states, key) == [b"sending"] * 3:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"no reservation 'sending' on {key}: {c.holder_states(key)}")


def run_loop(make: Any) -> Any:
    async def main() -> Any:
        try:
            return await asyncio.wait_for(make(), 60)
        finally:
            await aclose()

    return asyncio.run(main())


def test_a_slow_async_publish_and_a_sync_caller_after_sending_wait_run_the_job_once(c: wc.Cluster) -> None:
    """The async caller's publish is held past SENDING_WAIT; a sync ``apply_async`` of the same key sends a copy of
    that job (its id): both callers get one id, and the job runs once."""
    mod, k = c.app_module(), wc.new_key()
    key, queue = mod.q_work.lock_key_for(k), "ra-" + k
    release = threading.Event()

    async def scenario() -> tuple[Any, Any]:
        first = asyncio.ensure_future(mod.q_work.aapply_async((k,), queue=queue))
        await until_sending(c, key)
        second = await asyncio.to_thread(mod.q_work.apply_async, (k,), queue=queue)  # waits SENDING_WAIT, copies
        release.set()
        return await first, second

    with first_publish_held(mod.q_work.name, release) as seen:
        first, second = run_loop(scenario)
    assert first.id == second.id
    assert seen == [first.id, first.id]
    consume(c, queue)
    assert first.get(timeout=30) == k
    assert [r[1] for r in c.wait_runs(k, 1, 8)] == [first.id]


def test_a_publish_failing_after_its_caller_was_cancelled_frees_the_reservation(c: wc.Cluster) -> None:
    mod, k = c.app_module(), wc.new_key()
    key = mod.q_work.lock_key_for(k)
    release = threading.Event()

    def broken(*_: Any, **__: Any) -> Any:
        release.wait(20)
        raise OSError("broker gone")

    async def scenario() -> None:
        caller = asyncio.ensure_future(
            enqueue.asend(mod.q_work.lock_context(), broken, (k,), {}, None, {}, linked=False)
        )
        await until_sending(c, key)
        caller.cancel()
        with pytest.raises(asyncio.CancelledError):
            await caller
        release.set()
        for _ in range(1000):
            if await asyncio.to_thread(c.lock_free, key):
                return
            await asyncio.sleep(0.01)

    run_loop(scenario)
    assert c.lock_free(key), c.holder_states(key)


def test_mixed_threads_and_coroutines_racing_get_one_job(c: wc.Cluster, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="celery_singleton_lock")
    mod, k = c.app_module(), wc.new_key()
    queue = "ra-" + k
    go = threading.Barrier(5)
    ids: list[str] = []

    def sync_caller() -> None:
        go.wait(10)
        ids.append(mod.q_work.apply_async((k,), queue=queue).id)

    async def scenario() -> list[Any]:
        await asyncio.to_thread(go.wait, 10)
        return list(await asyncio.gather(*(mod.q_work.aapply_async((k,), queue=queue) for _ in range(4))))

    threads = [threading.Thread(target=sync_caller) for _ in range(4)]
    for t in threads:
        t.start()
    results = run_loop(scenario)
    for t in threads:
        t.join(30)
    verdicts = [r.getMessage() for r in caplog.records if r.name.startswith("celery_singleton_lock")]
    assert len({*ids, *(r.id for r in results)}) == 1, (ids, [r.id for r in results], verdicts)
    consume(c, queue)
    assert results[0].get(timeout=30) == k
    assert len(c.wait_runs(k, 1, 8)) == 1


def test_a_loop_closed_while_its_publish_runs_leaves_one_job(c: wc.Cluster) -> None:
    """asyncio.run ends (cancelling the background publish's task) while the publish is held in its thread: the
    message is sent, the reservation stays 'sending'; a later call sends a copy of that job: one run."""
    mod, k = c.app_module(), wc.new_key()
    key, queue = mod.q_work.lock_key_for(k), "ra-" + k
    release = threading.Event()
    ids: list[str] = []

    async def scenario() -> None:
        caller = asyncio.ensure_future(mod.q_work.aapply_async((k,), queue=queue))
        await until_sending(c, key)
        caller.cancel()
        with pytest.raises(asyncio.CancelledError):
            await caller
        threading.Timer(0.3, release.set).start()

    with first_publish_held(mod.q_work.name, release) as seen:
        run_loop(scenario)
        later = mod.q_work.apply_async((k,), queue=queue)
    ids = seen
    assert len(set(ids)) == 1, ids
    assert later.id == ids[0]
    consume(c, queue)
    assert later.get(timeout=30) == k
    assert len(c.wait_runs(k, 1, 8)) == 1


def test_a_run_sending_its_next_run_with_its_own_id_from_an_event_loop_sends_it(c: wc.Cluster) -> None:
    """A queue-scope run sends its key's next run from an event loop in its body, with the next run's own task id
    (as ``apply_async`` may): the call is sent, as the sync call is (the holder is this very run), not skipped as
    a duplicate of itself with the caller's id marked REVOKED. The verdict ran in a worker thread, which does not
    see the running task's request."""
    mod, k = c.app_module(), wc.new_key()
    next_id = "next-" + k
    first = mod.q_next_async.apply_async((k, next_id))
    assert first.get(timeout=30) == next_id
    assert mod.q_next_async.AsyncResult(next_id).get(timeout=30) is None
    assert [r[1] for r in c.wait_runs(k, 2, 10)] == [first.id, next_id]


def test_aapply_async_with_countdown_expires_and_a_link_is_one_job_whose_callback_runs(c: wc.Cluster) -> None:
    """Options pass through the async producer: concurrent calls with countdown, expires and a link get one job
    (its reservation spans the countdown), which runs once, and its callback runs after it."""
    mod, k = c.app_module(), wc.new_key()

    async def scenario() -> list[Any]:
        calls = (mod.q_work.aapply_async((k,), countdown=0.5, expires=60, link=mod.work.s()) for _ in range(3))
        return list(await asyncio.gather(*calls))

    results = run_loop(scenario)
    assert len({r.id for r in results}) == 1
    assert results[0].get(timeout=30) == k
    runs = c.wait_runs(k, 2, 10)  # the job's run, then its callback's (work(k): the job's result)
    assert runs[0][1] == results[0].id
    assert len(runs) == 2


def children(c: wc.Cluster, key: str, count: int) -> list[list[Any]]:
    """q_child's records of ``key`` ([key, id, parent id]), once there are ``count`` (bounded: 20 s)."""
    for _ in range(200):
        found = [r for r in c.records("children") if r[0] == key]
        if len(found) >= count:
            return found
        time.sleep(0.1)
    return [r for r in c.records("children") if r[0] == key]


@pytest.mark.parametrize("how", ["sync", "async", "other"])
def test_a_job_sent_from_an_event_loop_in_a_run_is_that_run_s_child(c: wc.Cluster, how: str) -> None:
    """``aapply_async`` from an event loop in a run's body: the message's parent id is that run's, as with
    ``apply_async`` (Celery reads the current task per thread, and the publish runs in a worker thread)."""
    mod, k = c.app_module(), wc.new_key()
    first = mod.q_child.apply_async((k, how))
    assert first.get(timeout=30) == f"{first.id}-next"
    runs = children(c, k, 2)
    assert [r[1:] for r in runs] == [[first.id, None], [f"{first.id}-next", first.id]]


def test_sync_and_async_callers_racing_with_a_lock_node_paused_get_one_job(
    c: wc.Cluster, caplog: pytest.LogCaptureFixture
) -> None:
    """One of three lock nodes paused; two threads (``apply_async``) and two coroutines (``aapply_async``) of one
    key race: one job id for all, one publish, one run. Connections are warmed (concurrently, retried) first."""
    caplog.set_level(logging.DEBUG, logger="celery_singleton_lock")
    mod, k = c.app_module(), wc.new_key()
    queue = "ra-" + k
    nodes = mod.q_work._options().settings.nodes
    # The sync callers' pool: four connections per node made while every node answers.
    warm = [Redlock(nodes, f"warm-{k}-{i}", ttl=5.0) for i in range(4)]
    threads = [threading.Thread(target=lambda lk=lk: lk.acquire(timeout=20.0)) for lk in warm]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert all(lk.release() for lk in warm)
    go = threading.Barrier(3)
    ids: list[str] = []

    def sync_caller() -> None:
        go.wait(20)
        ids.append(mod.q_work.apply_async((k,), queue=queue).id)

    async def scenario() -> list[Any]:
        locks = [AsyncRedlock(c.lock_urls, f"awarm-{k}-{i}", ttl=5.0, socket_timeout=0.5) for i in range(2)]
        for lock in locks:
            assert await lock.acquire(timeout=20.0)
        for lock in locks:
            await lock.release()
        await asyncio.to_thread(c.locks[0].pause)
        await asyncio.to_thread(go.wait, 20)
        return list(await asyncio.gather(*(mod.q_work.aapply_async((k,), queue=queue) for _ in range(2))))

    callers = [threading.Thread(target=sync_caller) for _ in range(2)]
    for t in callers:
        t.start()
    try:
        results = run_loop(scenario)
        for t in callers:
            t.join(30)
    finally:
        c.locks[0].resume()
    verdicts = [r.getMessage() for r in caplog.records if r.name.startswith("celery_singleton_lock")]
    assert len({*ids, *(r.id for r in results)}) == 1, (ids, [r.id for r in results], verdicts)
    consume(c, queue)
    assert results[0].get(timeout=30) == k
    assert len(c.wait_runs(k, 1, 8)) == 1


@contextlib.contextmanager
def scripts_naming(c: wc.Cluster, node: int, key: str) -> Iterator[list[str]]:
    """Every EVAL/EVALSHA naming ``key`` that lock node ``node`` runs meanwhile (its MONITOR stream, bounded)."""
    seen: list[str] = []
    stop = threading.Event()
    ready = threading.Event()

    def watch() -> None:
        with contextlib.closing(c.lock_client(c.locks[node])) as client, client.monitor() as monitor:
            ready.set()
            for _ in range(100_000):  # bounded: a PING at the end wakes it
                command = monitor.next_command()["command"]
                if stop.is_set():
                    return
                if command.upper().startswith("EVAL") and key in command:
                    seen.append(command)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    assert ready.wait(10)
    try:
        yield seen
    finally:
        stop.set()
        with contextlib.closing(c.lock_client(c.locks[node])) as client:
            client.ping()
        thread.join(10)


@pytest.mark.parametrize("flavour", ["sync", "async"])
def test_a_refusal_short_of_a_quorum_with_a_node_down_is_tried_again(c: wc.Cluster, flavour: str) -> None:
    """Node 0 paused, another caller's reservation on node 1 only (a contender that arrived together and took one
    node), node 2 free: each attempt of ``apply_async`` / ``aapply_async`` is refused on one node, granted on one,
    unanswered on one. That is what two callers racing with a node down see (each had one node; both sent: two
    jobs): the call's reservation tries again (as for a split vote), seen on node 2, instead of giving its verdict
    after one attempt."""
    mod, k = c.app_module(), wc.new_key()
    key = mod.q_work.lock_key_for(k)
    queue = f"nobody-{k}"  # the call's message, if sent, waits there unconsumed
    record = {"state": SENDING, "name": mod.q_work.name, "open": "1"}
    other = Redlock([c.lock_urls[1]], key, ttl=30.0, fencing=False, job="other", record=record)
    assert other.acquire(blocking=False)
    try:
        with scripts_naming(c, 2, key) as seen:
            c.locks[0].pause()
            try:
                if flavour == "async":

                    async def call() -> Any:
                        return await mod.q_work.aapply_async((k,), queue=queue)

                    run_loop(call)
                else:
                    mod.q_work.apply_async((k,), queue=queue)
            finally:
                c.locks[0].resume()
        # The acquire scripts node 2 ran, one per attempt (an EVALSHA retried as EVAL after NOSCRIPT is one: the
        # same keys and arguments): more than one attempt.
        attempts = {x[x.index(key) :] for x in seen if x.startswith(f"EVALSHA {ACQUIRE.sha} ") or "acquire.lua" in x}
        assert len(attempts) > 1, seen
    finally:
        other.release()
