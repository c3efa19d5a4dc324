"""A duplicate skipped in the worker's main process, before the pool (issue 26; celery_singleton_lock.task._preskip).

Real redis-server processes (a broker, 1 or 3 lock nodes), real ``celery worker`` processes (prefork, ``-E``) running
tests/apps/preskip_app.py, which records every tracer run (``task_prerun``) in Redis: a duplicate skipped before the
pool is never traced, and is otherwise seen exactly as the child's skip (REVOKED naming the holder, task-revoked
with our fields, the "skipped duplicate" log line).
"""

from __future__ import annotations

import contextlib
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import rabbitmq
from celery import chord
from worker_cluster import APPS, Cluster, cluster, new_key, overlapping, polling

from celery_singleton_lock.lock.config import LockSettings
from celery_singleton_lock.task import _preskip as preskip
from celery_singleton_lock.testing import CeleryWorker, EventLog, RedisServer, assert_skipped_duplicate

pytestmark = pytest.mark.slow

TTL = 5.0
STORM = 20


@pytest.fixture(scope="module")
def pc(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """Redis broker and three lock nodes; each test starts its own worker(s)."""
    with cluster(tmp_path_factory.mktemp("preskip"), ttl=TTL) as c:
        c.app_module()
        try:
            yield c
        finally:
            sys.modules.pop("preskip_app", None)


@contextlib.contextmanager
def worker(
    c: Cluster,
    name: str,
    *,
    nodes: int = 3,
    env: dict[str, str] | None = None,
    extra: tuple[str, ...] = (),
    queue: str | None = None,
) -> Iterator[CeleryWorker]:
    """A prefork worker (-c 2, -E) on preskip_app, locking on the first ``nodes`` lock nodes, consuming ``queue``
    (default: a queue of its own, q-<name>); killed on exit."""
    queue = queue or f"q-{name}"
    w = CeleryWorker(
        "preskip_app",
        name,
        cwd=str(APPS),
        log_path=str(c.tmp / f"{name}.log"),
        env={**c.env, "CSL_LOCK_URLS": ",".join(c.lock_urls[:nodes]), **(env or {})},
        extra=["-E", "-Q", queue, *extra],
    )
    c.workers.append(w)
    w.queue = queue  # type: ignore[attr-defined]
    try:
        yield w.start(timeout=60)
    finally:
        w.kill()


def traced(c: Cluster) -> set[str]:
    return {x.decode() for x in c.record.lrange("traced", 0, -1)}


def holding(c: Cluster, w: CeleryWorker, key: str, duration: float) -> Any:
    """Start a run of ``key`` holding its lock for ``duration`` s; returns its AsyncResult once it runs."""
    holder = c.app_module().work.apply_async((key, duration), queue=w.queue)  # type: ignore[attr-defined]
    c.wait_started(key)
    return holder


#: Seconds the storm's holder runs: it must outlive the storm's copies reaching the pre-check (a bound, not an
#: expectation: on a machine slower than this a copy runs and the test fails; it never passes by it).
STORM_HOLDER = 8.0
#: The countdown of the copy due after its 3 s holder ended: 5 s more than the holder's run, so a holder that
#: starts its body late on a loaded machine still ends before the copy is due (a bound).
DUE_AFTER = 8


def storm(c: Cluster, w: CeleryWorker, key: str, count: int = STORM, duration: float = 0.0) -> list[Any]:
    """``count`` copies of the call ``work(key, duration)`` (the holder's own call when ``duration`` is its)."""
    work = c.app_module().work
    return [work.apply_async((key, duration), queue=w.queue) for _ in range(count)]  # type: ignore[attr-defined]


@pytest.mark.parametrize("nodes", [1, 3])
def test_a_storm_of_duplicates_is_skipped_before_the_pool(pc: Cluster, nodes: int) -> None:
    """Duplicates of a running job are skipped in the main process: REVOKED naming the holder, task-revoked with
    our fields, the skip's log line; no tracer run, no body run."""
    with worker(pc, f"storm{nodes}-{uuid.uuid4().hex[:6]}", nodes=nodes) as w, EventLog(pc.app_module().app) as ev:
        key = new_key("bounded")  # STORM_HOLDER is a bound: the holder is released once every copy was skipped
        holder = holding(pc, w, key, STORM_HOLDER)
        copies = storm(pc, w, key, duration=STORM_HOLDER)
        for r in copies:
            assert assert_skipped_duplicate(r, of=holder.id, timeout=20) == holder.id
        pc.record.set(f"release:{key}", 1)
        assert not {r.id for r in copies} & traced(pc)  # the pool never saw them
        assert len(pc.wait_runs(key, 1, 20)) == 1
        revoked = ev.wait(copies[-1].id, "task-revoked")
        assert revoked["holder"] == holder.id and revoked["lock_skip"] == "duplicate"
        assert revoked["reason"] == revoked["exception"] and "held by task " + holder.id in revoked["reason"]
        assert "task-started" not in ev.types(copies[-1].id)
        log = w.log()
        assert "skipped duplicate in" in log and f"[{copies[-1].id}] skipped duplicate" in log
        assert holder.get(timeout=20) == key


@pytest.mark.parametrize("nodes", [1, 3])
def test_acks_late_a_worker_sigkilled_mid_storm_loses_nothing_and_runs_nothing_twice(pc: Cluster, nodes: int) -> None:
    """acks_late (locked_app): the holder runs in worker A while A skips a first half of a storm before the pool;
    A is SIGKILLed (main process and pool), the second half is sent, and worker B (a 4 s visibility timeout, so the
    holder's unacked message is restored to it) takes the queue. Nothing runs twice or beside another run, no job is
    lost (the holder's job completes: its redelivered copy waits out or finds its own lease, as without the
    pre-check), and every duplicate's caller gets an answer: REVOKED naming a job that ran, or its own run."""
    mod = pc.app_module()
    key, tag = new_key(), uuid.uuid4().hex[:6]
    with worker(pc, f"kill-a{nodes}-{tag}", nodes=nodes) as a:
        queue = a.queue  # type: ignore[attr-defined]
        holder = holding(pc, a, key, 2.0)
        first = storm(pc, a, key, 10, 2.0)
        for r in first:
            assert_skipped_duplicate(r, of=holder.id, timeout=20)
        assert not {r.id for r in first} & traced(pc)  # A skipped them before its pool
        a.kill()  # mid-run: the holder's message is unacked (acks_late), its lease stays until its ttl
    second = [mod.work.apply_async((key, 2.0), queue=queue) for _ in range(10)]
    with worker(pc, f"kill-b{nodes}-{tag}", nodes=nodes, queue=queue, env={"CSL_VISIBILITY": "4"}):
        results = [holder, *first, *second]
        for _ in polling(60, 0.1):
            states = pc.states([r.id for r in results])
            if all(s in ("SUCCESS", "REVOKED") for s in states.values()):
                break
        assert set(states.values()) <= {"SUCCESS", "REVOKED"}, states  # every caller answered
        runs = pc.wait_runs(key, 1, 10)
        ran = [r[1] for r in runs]
        assert len(ran) == len(set(ran)), runs  # no job ran twice
        assert not overlapping(runs)  # and no run beside another
        assert {t for t, s in states.items() if s == "SUCCESS"} == set(ran)
        named = {r.id: assert_skipped_duplicate(r, timeout=5) for r in results if states[r.id] == "REVOKED"}
        # No job lost: the holder's job ran to its end after the kill (its redelivered copy), unless a copy sent in
        # the gap between its dead lease and its redelivery ran it first, and the redelivered holder was skipped as
        # that copy's duplicate (how-it-works.md: documented limit; copies skipped earlier then name the killed run).
        if states[holder.id] == "SUCCESS":
            assert set(named.values()) <= set(ran), (named, runs)  # every skip names a job that ran
        else:
            assert named[holder.id] in ran and named[holder.id] in {r.id for r in second}, (named, runs)
            assert set(named.values()) <= {*ran, holder.id}, (named, runs)
        assert pc.started(key)[0][1] == holder.id  # A's run: started, never ended


def test_on_rabbitmq_the_pool_child_decides(tmp_path: Path) -> None:
    """On RabbitMQ (a vhost of its own) the pre-check stays off (review: acks from the main process mid-storm stalled
    the consumer for seconds): duplicates of a running job are traced and skipped in the pool child, naming the
    holder, and no two runs of the job overlap."""
    with rabbitmq.vhost() as url, cluster(tmp_path, ttl=TTL, broker_url=url) as c:
        c.app_module()
        with worker(c, f"rabbit-{uuid.uuid4().hex[:6]}") as w:
            assert "duplicates skipped before the pool: off: an AMQP broker" in w.log()
            key = new_key()
            holder = holding(c, w, key, 6.0)
            copies = storm(c, w, key, 5, 6.0)
            for r in copies:
                assert_skipped_duplicate(r, of=holder.id, timeout=30)
            assert {r.id for r in copies} <= traced(c)  # the pool saw every one
            assert holder.get(timeout=30) == key
            assert not overlapping(c.runs(key))


def test_turned_off_the_child_decides(pc: Cluster) -> None:
    """singleton_lock_skip_before_pool=False: every duplicate is traced and skipped in the pool child, as before."""
    with worker(pc, f"off-{uuid.uuid4().hex[:6]}", env={"CSL_SKIP_BEFORE_POOL": "0"}) as w:
        key = new_key()
        holder = holding(pc, w, key, 3.0)
        copies = storm(pc, w, key, 5, 3.0)
        for r in copies:
            assert_skipped_duplicate(r, of=holder.id, timeout=20)
        assert {r.id for r in copies} <= traced(pc)


def test_what_is_not_the_clear_case_goes_to_the_child(pc: Cluster) -> None:
    """A redelivered copy, a retry, one of our re-sent copies, a chord member and a reschedule duplicate are traced
    in the pool child and behave as without the pre-check."""
    mod = pc.app_module()
    with worker(pc, f"child-{uuid.uuid4().hex[:6]}") as w:
        q = w.queue  # type: ignore[attr-defined]
        key, waits = new_key(), new_key()
        holder = holding(pc, w, key, 5.0)
        first = mod.work_later.apply_async((waits, 3.0), queue=q)
        pc.wait_started(waits)
        # The copies below are the holder's own call: the pre-check would decide them if they were clear cases.
        redelivered = mod.work.apply_async((key, 5.0), queue=q, headers={"redelivered": True})
        retry = mod.work.apply_async((key, 5.0), queue=q, retries=1)
        ours = mod.work.apply_async((key, 5.0), queue=q, headers={"singleton_lock_since": "1"})
        rescheduled = mod.work_later.apply_async((waits, 3.0), queue=q)
        member = chord([mod.work.s(key, 5.0).set(queue=q)], mod.collect.s().set(queue=q)).apply_async()
        child = [redelivered.id, retry.id, ours.id, rescheduled.id]
        for _ in polling(30):
            if set(child) <= traced(pc):
                break
        assert set(child) <= traced(pc)
        assert_skipped_duplicate(retry, of=holder.id, timeout=20)
        assert_skipped_duplicate(ours, of=holder.id, timeout=20)
        assert first.get(timeout=20) == waits
        assert rescheduled.get(timeout=30) == waits  # rescheduled: ran after its holder
        assert holder.get(timeout=20) == key
        assert member.get(timeout=60) == [key]  # a chord member always reschedules: it ran after the holder


def test_a_countdown_copy_is_not_decided_at_its_receipt(pc: Cluster) -> None:
    """A copy received while its job runs, due after the run ended, with expires (Celery then asks revoked() at
    receipt too): the pre-check waits until it is due, and it runs."""
    mod = pc.app_module()
    with worker(pc, f"eta-{uuid.uuid4().hex[:6]}", extra=("--prefetch-multiplier", "8")) as w:
        key = new_key()
        holder = holding(pc, w, key, 3.0)
        later = mod.work.apply_async((key, 3.0), queue=w.queue, countdown=DUE_AFTER, expires=120)  # type: ignore[attr-defined]
        assert holder.get(timeout=20) == key
        assert later.get(timeout=30) == key
        assert len(pc.wait_runs(key, 2, 10)) == 2


def test_a_paused_lock_node_opens_the_breaker_and_nothing_runs_twice(pc: Cluster) -> None:
    """A lock node SIGSTOPped mid-storm: the worker keeps working (another key's tasks complete), the breaker opens
    (the child decides, on the two live nodes), every duplicate is skipped and the job runs once."""
    mod = pc.app_module()
    with worker(pc, f"pause-{uuid.uuid4().hex[:6]}") as w:
        key, other = new_key("bounded"), new_key()  # the holder's 20 s is a bound: it is released once all is seen
        holder = holding(pc, w, key, 20.0)
        first = storm(pc, w, key, duration=20.0)
        for r in first:
            assert_skipped_duplicate(r, of=holder.id, timeout=20)
        paused = pc.locks[2]
        paused.pause()
        try:
            # In the child, each costs the paused node's socket timeout (0.5 s): a few, well within the holder's run.
            second = storm(pc, w, key, 6, 20.0)
            others = [mod.work.apply_async((f"{other}-{i}",), queue=w.queue) for i in range(3)]
            assert [r.get(timeout=60) for r in others] == [f"{other}-{i}" for i in range(3)]
            for r in second:
                assert_skipped_duplicate(r, of=holder.id, timeout=60)
            assert "are checked in the pool again" in w.log()
            assert {r.id for r in second} & traced(pc)  # the breaker sent them to the child
        finally:
            paused.resume()
        pc.record.set(f"release:{key}", 1)
        assert holder.get(timeout=30) == key
        assert len(pc.wait_runs(key, 1, 10)) == 1


def test_a_copy_of_a_finished_job_is_left_to_the_child(pc: Cluster) -> None:
    """A first delivery of a task id that already ran (its done marker set; no redelivered flag), while another job
    holds its key, is not made REVOKED before the pool: the child stops it quietly and SUCCESS stays."""
    mod = pc.app_module()
    with worker(pc, f"done-{uuid.uuid4().hex[:6]}") as w:
        key = new_key()
        first = mod.work.apply_async((key,), queue=w.queue)  # type: ignore[attr-defined]  # the call is seen
        assert first.get(timeout=20) == key
        holder = holding(pc, w, key, 4.0)
        again = mod.work.apply_async((key,), queue=w.queue, task_id=first.id)  # type: ignore[attr-defined]
        for _ in polling(20):
            if [x.decode() for x in pc.record.lrange("traced", 0, -1)].count(again.id) >= 2:
                break
        assert [x.decode() for x in pc.record.lrange("traced", 0, -1)].count(again.id) == 2
        assert holder.get(timeout=20) == key
        assert pc.states([first.id]) == {first.id: "SUCCESS"}
        assert len(pc.runs(key)) == 2  # the first run and the holder's, not the copy


#: The pre-check's default per pool, as the worker's start line says it (docs/benchmarks.md: gevent measured).
DEFAULT_PER_POOL = {
    "prefork": "on (prefork with putlocks)",
    "threads": "off: the thread pool asks before a slot is free",
    "gevent": "off: the gevent pool asks before a slot is free",
}


@pytest.mark.parametrize("pool", ["prefork", "threads"])
def test_a_copy_waiting_for_a_busy_pool_is_decided_when_it_starts(pc: Cluster, pool: str) -> None:
    """A copy prefetched by a one-slot worker while that slot runs its job starts only after the job ended: it runs,
    as without the pre-check (which must not decide it at receipt: the threads pool queues it there, unlike prefork's
    putlocks semaphore, which asks revoked() only once a process is free). The worker's start line says the
    pre-check's default for its pool."""
    mod = pc.app_module()
    name = f"busy-{pool}-{uuid.uuid4().hex[:6]}"
    with worker(pc, name, extra=("-P", pool, "-c", "1", "--prefetch-multiplier", "4")) as w:
        assert f"duplicates skipped before the pool: {DEFAULT_PER_POOL[pool]}" in w.log()
        key = new_key()
        q = w.queue  # type: ignore[attr-defined]
        # --prefetch-multiplier 4: the worker receives the copy at once, while its one slot runs the holder.
        holder = mod.work.apply_async((key, 3.0), queue=q)
        pc.wait_started(key)
        copy = mod.work.apply_async((key, 3.0), queue=q)  # the holder's own call: seen, so the pre-check looks
        assert holder.get(timeout=30) == key
        assert copy.get(timeout=30) == key
        assert len(pc.wait_runs(key, 2, 10)) == 2


def test_on_gevent_the_pool_decides(pc: Cluster) -> None:
    """gevent: the pre-check stays off (it would save CPU there, docs/benchmarks.md, but the gevent pool asks
    revoked() before its spawn waits for a free greenlet, so a copy would be decided before a slot is free, as in
    the threads pool); the worker's start line says so."""
    pytest.importorskip("gevent")
    mod = pc.app_module()
    name = f"gevent-{uuid.uuid4().hex[:6]}"
    with worker(pc, name, extra=("-P", "gevent", "-c", "1", "--prefetch-multiplier", "4")) as w:
        assert f"duplicates skipped before the pool: {DEFAULT_PER_POOL['gevent']}" in w.log()
        # As above: a copy received while the one greenlet runs the holder is decided when it starts, so it runs.
        key = new_key()
        q = w.queue  # type: ignore[attr-defined]
        holder = mod.work.apply_async((key, 3.0), queue=q)
        pc.wait_started(key)
        copy = mod.work.apply_async((key, 3.0), queue=q)
        assert holder.get(timeout=30) == key
        assert copy.get(timeout=30) == key
        assert len(pc.wait_runs(key, 2, 10)) == 2


def test_a_url_connect_timeout_does_not_stretch_the_pre_checks_deadline(redis_node: RedisServer) -> None:
    """A node URL naming its own socket_connect_timeout (redis-py lets the URL win over our options) does not give
    the main process's pre-check a longer connect wait than its own deadline: it stays off for such nodes or keeps
    its deadline (a node down behind a dropped SYN would otherwise hold the worker's event loop that long)."""
    settings = LockSettings(urls=[f"{redis_node.url}?socket_connect_timeout=5"])
    nodes = preskip._fast_nodes(settings)
    if nodes is not None:
        for client in nodes.clients:
            kwargs = client.connection_pool.connection_kwargs  # type: ignore[union-attr]
            assert kwargs["socket_connect_timeout"] <= preskip.TIMEOUT
