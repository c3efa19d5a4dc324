"""Adversarial review of the async producers (aapply_async / adelay, _enqueue.asend/areserve) and of the sync
queue-scope path's refactor (_plan, _Pacing): mixed sync/async callers, slow publishes, cancelled callers, a
loop closed while the background publish runs. One worker set for the module; every wait bounded."""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import worker_cluster as wc
from celery.signals import before_task_publish

from celery_singleton_lock import _enqueue as enqueue
from celery_singleton_lock.aio import aclose

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def c(tmp_path_factory: pytest.TempPathFactory) -> Iterator[wc.Cluster]:
    with wc.cluster(tmp_path_factory.mktemp("review-aprod"), ttl=3.0) as c:
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
        caller = asyncio.ensure_future(enqueue.asend(mod.q_work, broken, (k,), {}, None, {}, linked=False))
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


def test_mixed_threads_and_coroutines_racing_get_one_job(c: wc.Cluster) -> None:
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
    assert len({*ids, *(r.id for r in results)}) == 1, (ids, [r.id for r in results])
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
