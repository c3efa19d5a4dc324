"""Adversarial review of the skip before the pool (issue 26; celery_singleton_lock._preskip).

Real redis-server processes (a broker, three lock nodes) and real prefork workers running tests/apps/preskip_app.py.
"""

from __future__ import annotations

import contextlib
import sys
import uuid
from collections.abc import Iterator

import pytest
from worker_cluster import APPS, Cluster, cluster, new_key

from celery_singleton_lock import _preskip as preskip
from celery_singleton_lock.config import LockSettings
from celery_singleton_lock.testing import CeleryWorker, RedisServer

pytestmark = pytest.mark.slow

TTL = 5.0


@pytest.fixture(scope="module")
def rc(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """Redis broker and three lock nodes; each test starts its own worker."""
    with cluster(tmp_path_factory.mktemp("review-preskip"), ttl=TTL) as c:
        c.app_module()
        try:
            yield c
        finally:
            sys.modules.pop("preskip_app", None)


@contextlib.contextmanager
def worker(c: Cluster, name: str, *extra: str, env: dict[str, str] | None = None) -> Iterator[CeleryWorker]:
    queue = f"q-{name}"
    w = CeleryWorker(
        "preskip_app",
        name,
        cwd=str(APPS),
        log_path=str(c.tmp / f"{name}.log"),
        env={**c.env, "CSL_LOCK_URLS": ",".join(c.lock_urls), **(env or {})},
        extra=["-Q", queue, *extra],
    )
    c.workers.append(w)
    w.queue = queue  # type: ignore[attr-defined]
    try:
        yield w.start(timeout=60)
    finally:
        w.kill()


#: The pre-check's default per pool, as the worker's start line says it (docs/benchmarks.md: gevent measured).
DEFAULT_PER_POOL = {
    "prefork": "on (prefork with putlocks)",
    "threads": "off: the thread pool asks before a slot is free",
    "gevent": "off: the gevent pool asks before a slot is free",
}


@pytest.mark.parametrize("pool", ["prefork", "threads"])
def test_a_copy_waiting_for_a_busy_pool_is_decided_when_it_starts(rc: Cluster, pool: str) -> None:
    """A copy prefetched by a one-slot worker while that slot runs its job starts only after the job ended: it runs,
    as without the pre-check (which must not decide it at receipt: the threads pool queues it there, unlike prefork's
    putlocks semaphore, which asks revoked() only once a process is free). The worker's start line says the
    pre-check's default for its pool."""
    mod = rc.app_module()
    with worker(rc, f"busy-{pool}-{uuid.uuid4().hex[:6]}", "-P", pool, "-c", "1", "--prefetch-multiplier", "4") as w:
        assert f"duplicates skipped before the pool: {DEFAULT_PER_POOL[pool]}" in w.log()
        key = new_key()
        q = w.queue  # type: ignore[attr-defined]
        # --prefetch-multiplier 4: the worker receives the copy at once, while its one slot runs the holder.
        holder = mod.work.apply_async((key, 3.0), queue=q)
        rc.wait_started(key)
        copy = mod.work.apply_async((key, 3.0), queue=q)  # the holder's own call: seen, so the pre-check looks
        assert holder.get(timeout=30) == key
        assert copy.get(timeout=30) == key
        assert len(rc.wait_runs(key, 2, 10)) == 2


def test_on_gevent_the_pool_decides(rc: Cluster) -> None:
    """gevent: the pre-check stays off (it would save CPU there, docs/benchmarks.md, but the gevent pool asks
    revoked() before its spawn waits for a free greenlet, so a copy would be decided before a slot is free, as in
    the threads pool); the worker's start line says so."""
    pytest.importorskip("gevent")
    mod = rc.app_module()
    with worker(rc, f"gevent-{uuid.uuid4().hex[:6]}", "-P", "gevent", "-c", "1", "--prefetch-multiplier", "4") as w:
        assert f"duplicates skipped before the pool: {DEFAULT_PER_POOL['gevent']}" in w.log()
        # As above: a copy received while the one greenlet runs the holder is decided when it starts, so it runs.
        key = new_key()
        q = w.queue  # type: ignore[attr-defined]
        holder = mod.work.apply_async((key, 3.0), queue=q)
        rc.wait_started(key)
        copy = mod.work.apply_async((key, 3.0), queue=q)
        assert holder.get(timeout=30) == key
        assert copy.get(timeout=30) == key
        assert len(rc.wait_runs(key, 2, 10)) == 2


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
