"""lock_on_duplicate="cancel": a newer call of a running key stops the running job and runs after it, never beside it.

Real workers (prefork with two children; two solo workers on one queue, since a solo worker runs one body at a time;
a gevent worker of two greenlets, where the stop is thrown into the body's greenlet)
on one broker and three lock nodes (tests/worker_cluster.py). The bodies (tests/apps/locked_app.py, ``rebuild``)
record their spans (start, end, their argument, their fencing token, how they ended) and write their argument to a
store that refuses a write older than the newest fencing token it saw.
"""

from __future__ import annotations

import itertools
import json
import os
import signal
from collections.abc import Iterator
from typing import Any

import pytest
from celery.bin.base import CLIContext
from click.testing import CliRunner
from worker_cluster import Cluster, cluster, new_key, polling

from celery_singleton_lock.ops.cli import locks

TTL = 1.5  # the tasks' own lock_ttl: renewed every 0.5 s
WAIT = 40.0  # seconds any single outcome may take on a loaded machine
QUEUES = {"prefork": "c-prefork", "solo": "c-solo", "gevent": "c-gevent"}


@pytest.fixture(scope="module")
def c(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with cluster(tmp_path_factory.mktemp("cancel"), ttl=TTL) as cl:
        cl.app_module()
        yield cl


@pytest.fixture(scope="module")
def workers(c: Cluster) -> dict[str, Any]:
    """Per pool, room for the running body and the newer call's delivery at once."""
    return {
        "prefork": [c.worker("w-prefork", queues=QUEUES["prefork"], pool="prefork", concurrency=2)],
        "solo": [c.worker(f"w-solo-{i}", queues=QUEUES["solo"], pool="solo", concurrency=1) for i in (1, 2)],
        "gevent": [c.worker("w-gevent", queues=QUEUES["gevent"], pool="gevent", concurrency=2)],
    }


def spans(c: Cluster, key: str) -> list[list[Any]]:
    """[key, task id, pid, start, end, n, fencing token, how, (wrote)] of every body of ``key`` that ended."""
    return [r for r in c.records("spans") if r[0] == key]


def wait_spans(c: Cluster, key: str, count: int) -> list[list[Any]]:
    for _ in polling(WAIT, 0.1):
        if len(spans(c, key)) >= count:
            break
    found = spans(c, key)
    assert len(found) >= count, f"{key}: {len(found)} bodies ended, expected {count}: {found}"
    return found


def revoked_reason(c: Cluster, task_id: str) -> str:
    """The reason stored with a REVOKED state (what AsyncResult.get() raises)."""
    mod = c.app_module()
    result = mod.app.AsyncResult(task_id)
    for _ in polling(WAIT, 0.1):
        if result.state == "REVOKED":
            break
    assert result.state == "REVOKED", (task_id, result.state)
    return str(result.result)


@pytest.mark.parametrize("pool", ["prefork", "solo", "gevent"])
def test_a_running_job_is_cancelled_by_a_newer_call_which_runs_after_it(
    c: Cluster, workers: dict[str, Any], pool: str
) -> None:
    """A newer call of a running key stops the running body (REVOKED, naming the newer call), and runs after it
    with its own arguments: its start comes after the stopped body's end (never beside it)."""
    mod = c.app_module()
    k = new_key()
    first = mod.rebuild.apply_async((k, 1, 30.0), queue=QUEUES[pool])
    c.wait_started(k, 1, timeout=WAIT)
    newer = mod.rebuild.apply_async((k, 2, 0.2), queue=QUEUES[pool])
    assert newer.get(timeout=WAIT) == 2
    stopped, ran = sorted(wait_spans(c, k, 2), key=lambda s: s[3])
    assert (stopped[1], stopped[7]) == (first.id, "cancelled")
    assert (ran[1], ran[5], ran[7]) == (newer.id, 2, "ran")
    assert ran[3] >= stopped[4], f"the newer call started before the stopped body ended: {stopped} {ran}"
    reason = revoked_reason(c, first.id)
    assert "cancelled by a newer call" in reason and newer.id in reason, reason
    assert ran[6] > stopped[6]  # fencing tokens: the successor's is newer


def test_a_body_that_ignores_the_stop_lets_the_newer_call_run_at_its_lease_s_end(
    c: Cluster, workers: dict[str, Any]
) -> None:
    """A body that swallows the stop is no longer renewed after one interval: the newer call runs once its lease
    has ended, with a greater fencing token, and the stopped body's late write is refused by the fenced store."""
    mod = c.app_module()
    k = new_key()
    first = mod.rebuild_stubborn.apply_async((k, 1, 8.0), queue=QUEUES["prefork"])
    c.wait_started(k, 1, timeout=WAIT)
    newer = mod.rebuild_stubborn.apply_async((k, 2, 0.1), queue=QUEUES["prefork"])
    assert newer.get(timeout=WAIT) == 2
    late, ran = sorted(wait_spans(c, k, 2), key=lambda s: s[4], reverse=True)
    assert (late[1], late[7]) == (first.id, "ignored the stop")
    assert ran[1] == newer.id
    assert ran[6] > late[6]  # the successor's fencing token is newer
    assert ran[8] == 1 and late[8] == 0, f"the stale write was not refused: {late}"
    assert ran[4] < late[4]  # the successor ran (and wrote) while the stubborn body still went on


def test_a_burst_of_newer_calls_during_one_cancel_runs_the_last_one_once(c: Cluster, workers: dict[str, Any]) -> None:
    """Twenty newer calls while one runs: the running one is stopped, the last call runs once after it with its
    own arguments, and every call in between is superseded (REVOKED), never run."""
    mod = c.app_module()
    k = new_key()
    first = mod.rebuild.apply_async((k, 0, 30.0), queue=QUEUES["prefork"])
    c.wait_started(k, 1, timeout=WAIT)
    calls = [mod.rebuild.apply_async((k, n, 0.1), queue=QUEUES["prefork"]) for n in range(1, 21)]
    assert calls[-1].get(timeout=WAIT) == 20
    for _ in polling(TTL * 4, 0.2):  # fallback copies of the superseded calls come back and must not run
        pass
    found = spans(c, k)
    assert sorted((s[1], s[5], s[7]) for s in found) == sorted(
        [(first.id, 0, "cancelled"), (calls[-1].id, 20, "ran")]
    ), found
    states = c.states([r.id for r in calls[:-1]])
    assert set(states.values()) == {"REVOKED"}, states


def superseded_reasons(c: Cluster, task_ids: list[str]) -> dict[str, str]:
    """Per task id: its stored state, and for a REVOKED one the reason (what AsyncResult.get() raises)."""
    out: dict[str, str] = {}
    for task_id in task_ids:
        meta = c.results.get(f"celery-task-meta-{task_id}")
        if meta is None:
            out[task_id] = "PENDING"
            continue
        stored = json.loads(meta)
        result = stored.get("result")
        if isinstance(result, dict):  # an exception: its message's arguments
            message = result.get("exc_message")
            result = " ".join(map(str, message)) if isinstance(message, list | tuple) else message
        out[task_id] = f"{stored['status']}: {result}"
    return out


def test_fifty_newer_calls_around_one_cancel_run_only_the_last_after_it(c: Cluster, workers: dict[str, Any]) -> None:
    """Fifty newer calls while one runs (issue 32's burst): the running one is stopped and hands its lock to the
    newest call waiting when it stops; every call in between ends REVOKED "superseded by task <id>", never run, also
    those that reach a worker just as the stopped run released (the release hands the lock on, so they meet it held:
    before, 1 run in 5 such a call found the key free and ran). When the fifty reach the workers faster than the
    holder's next renewal (0.5 s) only the last runs after it; on a loaded machine the holder may stop while calls are
    still arriving: the newest waiting then runs and the later calls stop it in turn. Either way the runs go in call
    order, never two at once, each but the last ends cancelled, and the last call runs last."""
    mod = c.app_module()
    k = new_key()
    first = mod.rebuild.apply_async((k, 0, 30.0), queue=QUEUES["prefork"])
    c.wait_started(k, 1, timeout=WAIT)
    calls = [mod.rebuild.apply_async((k, n, 0.1), queue=QUEUES["prefork"]) for n in range(1, 51)]
    assert calls[-1].get(timeout=WAIT) == 50
    for _ in polling(TTL * 4, 0.2):  # fallback copies of the superseded calls come back and must not run
        pass
    found = sorted(spans(c, k), key=lambda s: s[3])
    ran = [s[5] for s in found]
    assert found[0][1] == first.id, found
    assert ran[0] == 0 and ran[-1] == 50 and ran == sorted(set(ran)), found  # in call order, each once, the last last
    assert [s[7] for s in found] == ["cancelled"] * (len(found) - 1) + ["ran"], found
    assert all(a[4] <= b[3] for a, b in itertools.pairwise(found)), found  # never two at once
    print(f"runs after the first: {ran[1:]}")
    reasons = superseded_reasons(c, [r.id for n, r in enumerate(calls, 1) if n not in ran])
    bad = {t: r for t, r in reasons.items() if not r.startswith("REVOKED: superseded by task ")}
    assert not bad, bad


def test_a_newer_call_meeting_the_stopped_run_s_release_supersedes_the_waiter_it_was_handed_to(
    c: Cluster,
) -> None:
    """The moment of the release, made to happen: one prefork child runs A, the other is kept busy, and call X is
    queued behind it, so X reaches a worker just after A (stopped for call N) released, and before N's woken copy.
    X is newer than N: X runs after A, and N, the waiter in between, ends REVOKED "superseded by task X", never run
    (before: X found the key free and ran, and N ran after it, an older call last)."""
    mod = c.app_module()
    queue = "c-release"
    c.worker("w-release", queues=queue, pool="prefork", concurrency=2, extra=["-O", "fair"])
    k = new_key()
    first = mod.rebuild.apply_async((k, 0, 30.0), queue=queue)
    c.wait_started(k, 1, timeout=WAIT)
    waiter = mod.rebuild.apply_async((k, 1, 0.1), queue=queue)  # asks A to stop, waits in line
    blocker = mod.build.apply_async((new_key(), 0, 4.0), queue=queue)  # the other child, until after A's release
    newest = mod.rebuild.apply_async((k, 2, 1.0), queue=queue)  # queued: it reaches the child A frees
    assert newest.get(timeout=WAIT) == 2
    blocker.get(timeout=WAIT)
    for _ in polling(TTL * 4, 0.2):  # the waiter's copies come back and must not run
        pass
    found = sorted(spans(c, k), key=lambda s: s[3])
    assert [(s[1], s[7]) for s in found] == [(first.id, "cancelled"), (newest.id, "ran")], found
    assert found[0][4] <= found[1][3], found
    reason = superseded_reasons(c, [waiter.id])[waiter.id]
    assert reason.startswith(f"REVOKED: superseded by task {newest.id}"), reason


# -- the durable cancel (LockedTask.cancel, cancel_task_id, locks cancel) of a plain LockedTask ---------------------


def locks_cli(c: Cluster, *args: str) -> Any:
    """``celery -A locked_app locks ARGS`` in this process (click's runner)."""
    app = c.app_module().app
    return CliRunner().invoke(locks, list(args), obj=CLIContext(app=app, no_color=True, workdir=None))


def test_a_cancel_made_while_no_worker_runs_drops_the_message_when_a_worker_starts(c: Cluster) -> None:
    """A message cancelled by task id before any worker of its queue runs is dropped by the worker started later:
    REVOKED naming the cancel, its body never run; `locks list` showed the cancel pending meanwhile."""
    mod = c.app_module()
    k = new_key()
    queued = mod.build.apply_async((k, 1, 0.1), queue="c-late")
    report = mod.build.cancel_task_id(queued.id, (k, 1, 0.1))
    assert (report.outcome, report.durable) == ("pending", True), str(report)
    listed = locks_cli(c, "list")
    assert f"pending cancel  task {queued.id}" in listed.output, listed.output
    late = c.worker("w-late", queues="c-late", pool="solo", concurrency=1)
    try:
        reason = revoked_reason(c, queued.id)
        assert reason.startswith("cancelled (by task.cancel at "), reason
        again = mod.build.apply_async((k, 2, 0.1), queue="c-late")  # a call after the cancel is a new job: it runs
        assert again.get(timeout=WAIT) == 2
    finally:
        late.stop()
    assert [(s[1], s[7]) for s in spans(c, k)] == [(again.id, "ran")]


def test_a_worker_restarted_between_cancel_and_delivery_still_drops_the_message(c: Cluster) -> None:
    """A countdown message held by a worker, cancelled, the worker restarted before its time: the restored message
    reaches the new worker process and is dropped (Celery's own revoke lives in the old process's memory)."""
    mod = c.app_module()
    k = new_key()
    w = c.worker("w-restart", queues="c-restart", pool="solo", concurrency=1)
    queued = mod.build.apply_async((k, 1, 0.1), queue="c-restart", countdown=4)
    for _ in polling(WAIT, 0.1):  # held by the worker, waiting for its time
        if queued.id in w.log():
            break
    assert mod.build.cancel_task_id(queued.id, (k, 1, 0.1)).outcome == "pending"
    w.stop()
    w2 = c.worker("w-restart-2", queues="c-restart", pool="solo", concurrency=1)
    try:
        reason = revoked_reason(c, queued.id)
        assert reason.startswith("cancelled (by task.cancel at "), reason
    finally:
        w2.stop()
    assert spans(c, k) == []


@pytest.mark.parametrize("pool", ["prefork", "solo"])
def test_locks_cancel_stops_a_running_job_of_any_locked_task(c: Cluster, workers: dict[str, Any], pool: str) -> None:
    """`locks cancel --task NAME --args` stops a running plain LockedTask within a renewal interval: its body is
    interrupted, it ends REVOKED "cancelled (by locks cancel ...)" and its lock is free; a cancel of it once it
    ended says so and changes nothing; a call after the cancel runs."""
    mod = c.app_module()
    k = new_key()
    running = mod.build.apply_async((k, 1, 30.0), queue=QUEUES[pool])
    c.wait_started(k, 1, timeout=WAIT)
    out = locks_cli(c, "cancel", "--task", "locked_app.build", "--args", f'["{k}", 1, 30.0]')
    assert out.exit_code == 0, out.output
    assert f"task {running.id}" in out.output and "running: asked to stop" in out.output, out.output
    reason = revoked_reason(c, running.id)
    assert reason.startswith("cancelled (by locks cancel by "), reason
    assert [(s[1], s[7]) for s in wait_spans(c, k, 1)] == [(running.id, "cancelled")]
    again = locks_cli(c, "cancel", "--id", running.id, "--task", "locked_app.build", "--args", f'["{k}", 1, 30.0]')
    assert again.exit_code == 0 and "already ended: nothing changed" in again.output, again.output
    after = mod.build.apply_async((k, 2, 0.1), queue=QUEUES[pool])
    assert after.get(timeout=WAIT) == 2


def test_a_cancel_with_a_lock_node_paused_is_written_on_the_quorum(c: Cluster, workers: dict[str, Any]) -> None:
    """With one of three lock nodes paused, `build.cancel(...)` of a running job is written on the other two (a
    quorum: durable) and still stops it."""
    mod = c.app_module()
    k = new_key()
    running = mod.build.apply_async((k, 1, 30.0), queue=QUEUES["prefork"])
    c.wait_started(k, 1, timeout=WAIT)
    c.locks[0].pause()
    try:
        report = mod.build.cancel(k, 1, 30.0)
        assert (report.task_id, report.outcome, report.written, report.durable) == (running.id, "running", 2, True)
        assert revoked_reason(c, running.id).startswith("cancelled (by task.cancel at ")
    finally:
        c.locks[0].resume()


def test_a_cancelled_run_is_a_task_revoked_event_naming_the_newer_call_and_counted(c: Cluster) -> None:
    """A real worker (-E) sends the stopped run as task-revoked whose reason (Flower's exception) names the newer
    call that cancelled it, and `locks stats` shows the run under 'cancelled'."""
    from celery_singleton_lock.testing import EventLog  # noqa: PLC0415

    mod = c.app_module()
    c.worker("w-events", queues="c-events", pool="prefork", concurrency=2, extra=["-E"])
    with EventLog(mod.app) as events:
        k = new_key()
        first = mod.rebuild.apply_async((k, 1, 30.0), queue="c-events")
        c.wait_started(k, 1, timeout=WAIT)
        newer = mod.rebuild.apply_async((k, 2, 0.1), queue="c-events")
        assert newer.get(timeout=WAIT) == 2
        event = events.wait(first.id, "task-revoked", timeout=WAIT)
        assert event["lock_skip"] == "cancelled" and event["holder"] == newer.id, event
        assert f"cancelled by a newer call, task {newer.id}" in event["reason"], event
        shown = events.state().tasks[first.id]
        assert shown.state == "REVOKED" and newer.id in shown.exception, (shown.state, shown.exception)
    for _ in polling(WAIT, 0.5):  # the workers flush their counters every few seconds
        out = locks_cli(c, "stats", "--json")
        if json.loads(out.output)["tasks"].get("locked_app.rebuild", {}).get("cancelled", 0) >= 1:
            break
    assert json.loads(out.output)["tasks"]["locked_app.rebuild"]["cancelled"] >= 1, out.output
    table = locks_cli(c, "stats").output
    assert "CANCELLED" in table, table


# -- attacks (issue 32 review): cancel x retry, x redelivery after SIGKILL, x a lost lease -----------------------------


def starts(c: Cluster, key: str) -> list[list[Any]]:
    return [r for r in c.records("started") if r[0] == key]


def test_a_durably_cancelled_body_that_retries_does_not_come_back(c: Cluster, workers: dict[str, Any]) -> None:
    """A body that answers the durable cancel's stop with self.retry: its retry is dropped (REVOKED naming the
    cancel), never run again."""
    mod = c.app_module()
    k = new_key()
    running = mod.build_retrying.apply_async((k, 1, 30.0), queue=QUEUES["prefork"])
    c.wait_started(k, 1, timeout=WAIT)
    assert mod.build_retrying.cancel(k, 1, 30.0).outcome == "running"
    assert revoked_reason(c, running.id).startswith("cancelled (by task.cancel at ")
    for _ in polling(3.0, 0.2):  # the retry (countdown 0.3 s) would have started by now
        pass
    assert len(starts(c, k)) == 1, starts(c, k)


def test_a_retry_s_hand_over_cancelled_durably_is_dropped(c: Cluster, workers: dict[str, Any]) -> None:
    """A job waiting for its retry (countdown 3 s), cancelled by task id: the hand-over is freed and the retry's
    copy is dropped when it arrives (REVOKED naming the cancel), its body not run again."""
    mod = c.app_module()
    k = new_key()
    first = mod.flaky.apply_async((k, 1, 3.0), queue=QUEUES["prefork"])
    c.wait_runs(k, 1, timeout=WAIT)
    report = mod.flaky.cancel_task_id(first.id, (k, 1, 3.0))
    assert report.outcome in ("freed", "pending"), str(report)
    assert revoked_reason(c, first.id).startswith("cancelled (by task.cancel at ")
    for _ in polling(2.0, 0.2):
        pass
    assert len(c.runs(k)) == 1, c.runs(k)


def test_a_newer_call_runs_once_when_the_cancelled_body_retries(c: Cluster, workers: dict[str, Any]) -> None:
    """A body stopped by a newer call that answers with self.retry: the newer call runs once, and the stopped job's
    retry never runs (neither beside nor after it: newest wins)."""
    mod = c.app_module()
    k = new_key()
    first = mod.rebuild_retrying.apply_async((k, 1, 30.0), queue=QUEUES["prefork"])
    c.wait_started(k, 1, timeout=WAIT)
    newer = mod.rebuild_retrying.apply_async((k, 2, 0.5), queue=QUEUES["prefork"])
    assert newer.get(timeout=WAIT) == 2
    for _ in polling(3.0, 0.2):
        pass
    found = spans(c, k)
    ran = [s for s in found if s[1] == newer.id]
    assert len(ran) == 1, found
    for s in found:
        if s[1] != newer.id:
            assert s[4] <= ran[0][3] or s[3] >= ran[0][4], f"ran beside the newer call: {found}"
    assert [r[1] for r in starts(c, k)].count(first.id) == 1, starts(c, k)


def test_the_redelivered_copy_of_a_cancelled_job_after_a_sigkill_does_not_run(
    c: Cluster, workers: dict[str, Any]
) -> None:
    """A running job cancelled durably whose pool child is SIGKILLed at once: its redelivered copy is dropped
    (REVOKED naming the cancel), never run again."""
    mod = c.app_module()
    k = new_key()
    running = mod.build.apply_async((k, 1, 30.0), queue=QUEUES["prefork"])
    pid = c.wait_started(k, 1, timeout=WAIT)[0][2]
    mod.build.cancel_task_id(running.id, (k, 1, 30.0))
    os.kill(pid, signal.SIGKILL)
    assert revoked_reason(c, running.id).startswith("cancelled (by task.cancel at ")
    for _ in polling(4.0, 0.2):
        pass
    assert len(starts(c, k)) == 1, starts(c, k)


def test_a_job_cancelled_by_a_newer_call_then_sigkilled_does_not_come_back(c: Cluster, workers: dict[str, Any]) -> None:
    """The newer call's cancel, then the stopped job's pool child SIGKILLed: its redelivered copy never runs, and
    the newer call runs exactly once."""
    mod = c.app_module()
    k = new_key()
    first = mod.rebuild.apply_async((k, 1, 30.0), queue=QUEUES["prefork"])
    pid = c.wait_started(k, 1, timeout=WAIT)[0][2]
    newer = mod.rebuild.apply_async((k, 2, 0.5), queue=QUEUES["prefork"])
    for _ in polling(0.3, 0.05):  # the newer call's delivery asks the cancel meanwhile (either order must hold)
        pass
    os.kill(pid, signal.SIGKILL)
    assert newer.get(timeout=WAIT) == 2
    assert f"cancelled by a newer call, task {newer.id}" in revoked_reason(c, first.id)
    for _ in polling(4.0, 0.2):
        pass
    st = starts(c, k)
    assert [r[1] for r in st].count(first.id) == 1, st
    assert [r[1] for r in st].count(newer.id) == 1, st


def test_a_cancel_survives_a_lock_node_restart_during_it(c: Cluster, workers: dict[str, Any]) -> None:
    """A running job cancelled durably while one lock node is restarted: it still ends REVOKED naming the cancel,
    its body stopped, and the key is free for a new call."""
    mod = c.app_module()
    k = new_key()
    running = mod.build.apply_async((k, 1, 30.0), queue=QUEUES["prefork"])
    c.wait_started(k, 1, timeout=WAIT)
    c.stop_locks(1)
    try:
        report = mod.build.cancel(k, 1, 30.0)
        assert report.durable, str(report)
    finally:
        c.start_locks()
    assert revoked_reason(c, running.id).startswith("cancelled (by task.cancel at ")
    after = mod.build.apply_async((k, 2, 0.1), queue=QUEUES["prefork"])
    assert after.get(timeout=WAIT) == 2


@pytest.mark.parametrize("pool", ["prefork", "solo"])
def test_a_cancelled_copy_meeting_the_skip_before_the_pool_ends_revoked_naming_the_cancel(
    c: Cluster, workers: dict[str, Any], pool: str
) -> None:
    """A job cancelled by task id before its message is sent, a duplicate of a running call (the pre-pool check's
    case): it ends REVOKED naming the cancel, not as a skipped duplicate, and its body never runs."""
    from uuid import uuid4  # noqa: PLC0415

    mod = c.app_module()
    k = new_key()
    running = mod.build.apply_async((k, 1, 6.0), queue=QUEUES[pool])
    c.wait_started(k, 1, timeout=WAIT)
    later = str(uuid4())
    assert mod.build.cancel_task_id(later, (k, 1, 6.0)).outcome == "pending"
    mod.build.apply_async((k, 1, 6.0), queue=QUEUES[pool], task_id=later)
    reason = revoked_reason(c, later)
    assert reason.startswith("cancelled (by task.cancel at "), reason
    assert running.get(timeout=WAIT) == 1
    assert [r[1] for r in starts(c, k)] == [running.id], starts(c, k)


def test_a_newer_call_s_cancel_with_a_lock_node_restarted_empty_meanwhile(c: Cluster, workers: dict[str, Any]) -> None:
    """A lock node restarted empty while a newer call's cancel is under way: the running body still stops (REVOKED
    naming the newer call), and the newer call runs once after it, never beside it."""
    mod = c.app_module()
    k = new_key()
    first = mod.rebuild.apply_async((k, 1, 30.0), queue=QUEUES["prefork"])
    c.wait_started(k, 1, timeout=WAIT)
    newer = mod.rebuild.apply_async((k, 2, 0.2), queue=QUEUES["prefork"])
    c.stop_locks(1)
    c.start_locks()
    assert newer.get(timeout=WAIT) == 2
    stopped, ran = sorted(wait_spans(c, k, 2), key=lambda s: s[3])
    assert (stopped[1], stopped[7], ran[1], ran[7]) == (first.id, "cancelled", newer.id, "ran"), (stopped, ran)
    assert ran[3] >= stopped[4], f"the newer call started before the stopped body ended: {stopped} {ran}"
    assert newer.id in revoked_reason(c, first.id)


def test_a_newer_call_during_a_retry_s_hand_over_runs_once_never_beside_it(c: Cluster, workers: dict[str, Any]) -> None:
    """A newer call while the key's job waits for its retry (the hand-over: not running, so not asked to stop): the
    retry runs, then the newer call once, never beside it."""
    mod = c.app_module()
    k = new_key()
    mod.rebuild_retry_first.apply_async((k, 1, 2.0), queue=QUEUES["prefork"])
    c.wait_started(k, 1, timeout=WAIT)
    newer = mod.rebuild_retry_first.apply_async((k, 2, 0.0), queue=QUEUES["prefork"])
    assert newer.get(timeout=WAIT) == 2
    for _ in polling(3.0, 0.2):
        pass
    found = spans(c, k)
    ran = [s for s in found if s[1] == newer.id]
    assert len(ran) == 1, found
    for s in found:
        if s[1] != newer.id:
            assert s[4] <= ran[0][3] or s[3] >= ran[0][4], f"ran beside the newer call: {found}"


def test_the_holder_read_counts_a_durable_cancel_s_done_marker_as_set(c: Cluster) -> None:
    """status.lua (the skip before the pool reads a copy's done marker as its counter): a durable cancel's marker,
    'cancel:<who> at <when>', is no number and counts as 1 (set), on every node; a plain marker '1' too; none is 0.
    A marker read as a number only (tonumber) would drop the answer's third element (Lua's nil ends the array)."""
    from celery_singleton_lock.lock.record import done_key_for  # noqa: PLC0415
    from celery_singleton_lock.lock.scripts import STATUS  # noqa: PLC0415

    mod = c.app_module()
    k = new_key()
    key = mod.build.lock_key_for(k, 1, 0.1)
    nodes = mod.build.lock_context().options.settings.nodes
    cancelled, finished, unknown = done_key_for(key, "t-cancelled"), done_key_for(key, "t-ran"), done_key_for(key, "t")
    for client in nodes.clients:
        client.set(cancelled, "cancel:locks cancel by alice@host at 2025-01-01 00:00:00 UTC", px=60_000)
        client.set(finished, "1", px=60_000)
    for marker, expected in ((cancelled, 1), (finished, 1), (unknown, 0)):
        answers = nodes.run(STATUS, (key, marker), ())
        assert [a[2] for a in answers] == [expected] * len(nodes.clients), (marker, answers)


# -- attacks on the hand-over (issue 32 review): a lost woken copy, a cancelled waiter, a holder ending by itself ----


SLOW_Q = "c-slow"  # rebuild_slow: renewed every 3 s, a waiting call's fallback copy ~9 s, a handed lock 30 s


@pytest.fixture(scope="module")
def slow_worker(c: Cluster) -> Any:
    return c.worker("w-slow", queues=SLOW_Q, pool="prefork", concurrency=2)


def line_keys(c: Cluster, key: str) -> tuple[Any, str, str]:
    """The first lock node's client (the node holding the key's line) and the line's two keys."""
    from celery_singleton_lock.lock.record import sibling_key  # noqa: PLC0415

    return c.lock_client(c.locks[0]), sibling_key(key, ":waiters"), sibling_key(key, ":parked")


def wait_parked(c: Cluster, key: str, task_id: str) -> dict[str, Any]:
    """The message that wakes ``task_id``, once it waits in ``key``'s line (polled every 5 ms)."""
    client, _, parked = line_keys(c, key)
    for _ in polling(WAIT, 0.005):
        message = client.hget(parked, task_id)
        if message is not None:
            return dict(json.loads(message))
    raise AssertionError(f"{task_id} never waited in the line of {key}")


def wait_asked(c: Cluster, key: str, task_id: str) -> None:
    """Once ``task_id`` has asked ``key``'s running holder to stop (the record's ``cancel`` field, on node 2)."""
    client = c.lock_client(c.locks[1])
    for _ in polling(WAIT, 0.005):
        if client.hget(key, "cancel") == task_id.encode():
            return
    raise AssertionError(f"{task_id} never asked the holder of {key} to stop")


def handed_until(c: Cluster, key: str, task_id: str) -> float:
    """Once a quorum of nodes holds ``key`` handed to ``task_id``: when that hand-over ends (Unix s, by its PTTL)."""
    import time  # noqa: PLC0415

    assert c.wait_holder_state(key, "handed", timeout=WAIT), c.holder_states(key)
    client = c.lock_client(c.locks[1])
    assert client.hget(key, "job") == task_id.encode(), client.hgetall(key)
    return time.time() + int(client.pttl(key)) / 1000.0


def test_a_waiter_s_fallback_copy_superseded_while_handed_passes_the_lock_on(c: Cluster, slow_worker: Any) -> None:
    """The stopped run hands its lock to waiter W, and W's woken copy is lost (here: sent to a queue nobody reads;
    in life a worker SIGKILLed holding it, restored only after the visibility timeout). A newer call N meets the lock
    handed to W: it supersedes W, and waits. W's fallback copy arrives first: it must pass the lock on to N (as the
    woken copy would), so N runs then, not only once the hand-over expires 30 s later."""
    mod = c.app_module()
    k = new_key()
    first = mod.rebuild_slow.apply_async((k, 0, 60.0), queue=SLOW_Q)
    c.wait_started(k, 1, timeout=WAIT)
    key = mod.rebuild_slow.lock_key_for(k, 0, 60.0)
    waiter = mod.rebuild_slow.apply_async((k, 1, 0.1), queue=SLOW_Q)
    woken = wait_parked(c, key, waiter.id)  # before the holder's next renewal (3 s) sees the request
    woken["options"].update(queue="c-void", exchange="", routing_key="c-void")
    client, _, parked = line_keys(c, key)
    client.hset(parked, waiter.id, json.dumps(woken))
    until = handed_until(c, key, waiter.id)
    newest = mod.rebuild_slow.apply_async((k, 2, 0.1), queue=SLOW_Q)
    assert newest.get(timeout=WAIT + 30) == 2
    found = sorted(spans(c, k), key=lambda s: s[3])
    assert [(s[1], s[7]) for s in found] == [(first.id, "cancelled"), (newest.id, "ran")], found
    assert found[1][3] < until, f"the newest call waited for the hand-over to W to expire: {found[1][3] - until:.1f}"
    reason = superseded_reasons(c, [waiter.id])[waiter.id]
    assert reason.startswith(f"REVOKED: superseded by task {newest.id}"), reason


def test_a_waiter_cancelled_durably_is_never_handed_the_lock(c: Cluster, slow_worker: Any) -> None:
    """Waiter W asks the running job to stop, and is itself cancelled by task id (`task.cancel_task_id`, `locks
    cancel`) before the stopped run's release: the release must not hand the lock to W, whose copies are all dropped
    (nothing would ever take it over: the key stuck, every later call waiting for the hand-over to expire, 30 s).
    W ends REVOKED naming the cancel, never run, and the key is free for the next call."""
    mod = c.app_module()
    k = new_key()
    first = mod.rebuild_slow.apply_async((k, 0, 60.0), queue=SLOW_Q)
    c.wait_started(k, 1, timeout=WAIT)
    key = mod.rebuild_slow.lock_key_for(k, 0, 60.0)
    waiter = mod.rebuild_slow.apply_async((k, 1, 0.1), queue=SLOW_Q)
    wait_asked(c, key, waiter.id)  # before the holder's next renewal (3 s) sees the request
    assert mod.rebuild_slow.cancel_task_id(waiter.id, (k, 1, 0.1)).outcome == "pending"
    assert revoked_reason(c, waiter.id).startswith("cancelled (by task.cancel at ")
    assert [(s[1], s[7]) for s in wait_spans(c, k, 1)] == [(first.id, "cancelled")]
    for _ in polling(1.0, 0.05):  # the dropped copy's release of its place, if any, has happened
        pass
    held = [c.lock_client(s).hgetall(key) for s in c.locks]
    assert not any(r.get(b"job") == waiter.id.encode() for r in held), held
    after = mod.rebuild_slow.apply_async((k, 2, 0.1), queue=SLOW_Q)
    assert after.get(timeout=WAIT) == 2


def test_a_holder_ending_by_itself_after_the_request_hands_its_lock_to_the_waiter(c: Cluster) -> None:
    """The running job A ends by itself after the newer call W asked it to stop, before its renewal saw the request
    (renewed every 3 s, its body 2 s). A's release must hand the lock to W as a stop would: X, a newer call reaching
    the child A frees (queued behind it, the other child kept busy), meets the lock handed to W and supersedes it,
    and runs; W never runs (before: A's release freed the key, X found it free and ran, and W, older, ran after X:
    an older call last)."""
    mod = c.app_module()
    queue = "c-natural"
    c.worker("w-natural", queues=queue, pool="prefork", concurrency=2, extra=["-O", "fair"])
    k = new_key()
    first = mod.rebuild_slow.apply_async((k, 0, 2.0), queue=queue)
    c.wait_started(k, 1, timeout=WAIT)
    waiter = mod.rebuild_slow.apply_async((k, 1, 0.1), queue=queue)  # asks A to stop, waits in line
    key = mod.rebuild_slow.lock_key_for(k, 0, 2.0)
    wait_parked(c, key, waiter.id)
    blocker = mod.build.apply_async((new_key(), 0, 5.0), queue=queue)  # the other child, until after A's end
    newest = mod.rebuild_slow.apply_async((k, 2, 1.0), queue=queue)  # queued: it reaches the child A frees
    assert newest.get(timeout=WAIT) == 2
    assert first.get(timeout=WAIT) == 0  # A ran to its end: the request came too late to stop it
    blocker.get(timeout=WAIT)
    for _ in polling(3.0, 0.2):  # the waiter's woken copy comes back and must not run
        pass
    found = sorted(spans(c, k), key=lambda s: s[3])
    assert [(s[1], s[7]) for s in found] == [(first.id, "ran"), (newest.id, "ran")], found
    assert found[0][4] <= found[1][3], found
    reason = superseded_reasons(c, [waiter.id])[waiter.id]
    assert reason.startswith(f"REVOKED: superseded by task {newest.id}"), reason


def test_a_waiter_cancelled_once_handed_and_superseded_lets_the_newer_call_run(c: Cluster, slow_worker: Any) -> None:
    """The lock is handed to W (its woken copy lost), a newer call N supersedes W and waits, then W is cancelled by
    task id (the hand-over freed: what `locks cancel --id` does for a task whose results are ignored; with results,
    the superseded W is REVOKED already and the cancel leaves it alone). W's fallback copy, finding W superseded and
    cancelled, must wake N: N runs then, not only when its own fallback copy comes (timed for the hand-over's end,
    30 s)."""
    mod = c.app_module()
    k = new_key()
    first = mod.rebuild_slow.apply_async((k, 0, 60.0), queue=SLOW_Q)
    c.wait_started(k, 1, timeout=WAIT)
    key = mod.rebuild_slow.lock_key_for(k, 0, 60.0)
    waiter = mod.rebuild_slow.apply_async((k, 1, 0.1), queue=SLOW_Q)
    woken = wait_parked(c, key, waiter.id)
    woken["options"].update(queue="c-void", exchange="", routing_key="c-void")
    client, _, parked = line_keys(c, key)
    client.hset(parked, waiter.id, json.dumps(woken))
    until = handed_until(c, key, waiter.id)
    newest = mod.rebuild_slow.apply_async((k, 2, 0.1), queue=SLOW_Q)
    wait_parked(c, key, newest.id)
    for _ in polling(1.0, 0.1):  # N looks at the lock once more after parking (handed: it waits), then defers
        pass
    from celery_singleton_lock.policies.cancel import cancel_job  # noqa: PLC0415

    settings = mod.rebuild_slow.lock_context().options.settings
    report = cancel_job(settings.nodes, settings.prefix, key, waiter.id, by="locks cancel by test")
    assert report.outcome == "freed", str(report)
    assert newest.get(timeout=WAIT + 30) == 2
    found = sorted(spans(c, k), key=lambda s: s[3])
    assert [(s[1], s[7]) for s in found] == [(first.id, "cancelled"), (newest.id, "ran")], found
    assert found[1][3] < until, f"the newest call waited for the hand-over to W to expire: {found[1][3] - until:.1f}"


def test_an_older_waiting_call_never_stops_a_newer_run(c: Cluster, slow_worker: Any) -> None:
    """W asks A to stop too late (A ends by itself first) and waits through A's cooldown; N, a newer call, reaches a
    worker as the cooldown ends, finds the key free and runs. W's fallback copy then meets N's run: W is older, so N
    must not be asked to stop: W ends REVOKED "superseded by task N", never run (before: N was stopped, "cancelled by
    a newer call" naming the older W, and W ran last: the older call won)."""
    mod = c.app_module()
    k = new_key()
    first = mod.rebuild_cool.apply_async((k, 0, 2.0), queue=SLOW_Q)
    c.wait_started(k, 1, timeout=WAIT)
    key = mod.rebuild_cool.lock_key_for(k, 0, 2.0)
    waiter = mod.rebuild_cool.apply_async((k, 1, 0.1), queue=SLOW_Q)
    wait_asked(c, key, waiter.id)  # A's next renewal (3 s) would see it: A's body ends first (2 s)
    assert first.get(timeout=WAIT) == 0
    assert c.wait_holder_state(key, "cooldown", timeout=WAIT)
    assert c.wait_lock_free(key, timeout=WAIT) is not None
    newest = mod.rebuild_cool.apply_async((k, 2, 8.0), queue=SLOW_Q)  # runs past W's fallback copy (~9 s)
    assert newest.get(timeout=WAIT) == 2
    reason = superseded_reasons(c, [waiter.id])[waiter.id]
    found = sorted(spans(c, k), key=lambda s: s[3])
    assert [(s[1], s[7]) for s in found] == [(first.id, "ran"), (newest.id, "ran")], (found, reason)
    assert reason.startswith(f"REVOKED: superseded by task {newest.id}"), reason
