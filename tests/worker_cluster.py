"""Real-worker test harness shared by the fault and pool test modules (not a test module itself).

A :class:`Cluster` is a broker redis-server, three lock nodes (a 3-node Redlock, optionally password-protected)
and the ``celery worker`` processes a module starts against them (tests/apps/locked_app.py). Tasks record each
run's start and end in Redis, so tests check afterwards that no two runs of one key overlapped.
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import itertools
import json
import os
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import redis
from celery.result import AsyncResult

from celery_singleton_lock.testing import CeleryWorker, RedisServer, redis_servers

APPS = Path(__file__).parent / "apps"


def polling(timeout: float, interval: float = 0.05) -> Iterator[float]:
    """Yield the seconds elapsed, every ``interval`` s, until ``timeout``: bounded in time and in count."""
    start = time.monotonic()
    for _ in range(int(timeout / interval) + 2):
        elapsed = time.monotonic() - start
        if elapsed > timeout:
            return
        yield elapsed
        time.sleep(interval)


class Cluster:
    """One module's servers and workers, and the client-side app (``locked_app`` imported with their env)."""

    def __init__(
        self,
        broker: RedisServer,
        locks: list[RedisServer],
        tmp: Path,
        *,
        ttl: float,
        password: str | None = None,
        broker_url: str | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        """``broker`` holds the results and the run records, and is the broker unless ``broker_url`` names another
        (RabbitMQ); ``env`` adds to the workers' and the client's environment."""
        self.broker, self.locks, self.tmp, self.ttl, self.password = broker, locks, tmp, ttl, password
        auth = f":{password}@" if password else ""
        self.lock_urls = [f"redis://{auth}127.0.0.1:{s.port}/0" for s in locks]
        base = broker.url.rsplit("/", 1)[0]
        self.env = {
            "CSL_BROKER": broker_url or broker.url,
            "CSL_BACKEND": base + "/1",
            "CSL_LOCK_URLS": ",".join(self.lock_urls),
            "CSL_RECORD": base + "/2",
            "CSL_TTL": str(ttl),
            **(env or {}),
        }
        self.record = redis.Redis.from_url(self.env["CSL_RECORD"])
        self.results = redis.Redis.from_url(base + "/1")
        self.workers: list[CeleryWorker] = []
        self._app = AppImport("locked_app")
        if password:
            for server in locks:
                self._protect(server)

    # -- processes ---------------------------------------------------------------------------------------------

    def worker(
        self,
        name: str,
        *,
        queues: str | None = None,
        pool: str = "prefork",
        concurrency: int = 2,
        env: dict[str, str] | None = None,
        extra: list[str] | None = None,
    ) -> CeleryWorker:
        """Start a worker (killed at module teardown at the latest); ``env`` overrides the cluster's env."""
        extra = (["-Q", queues] if queues else []) + (extra or [])
        worker = CeleryWorker(
            "locked_app",
            name,
            cwd=str(APPS),
            log_path=str(self.tmp / f"{name}.log"),
            pool=pool,
            concurrency=concurrency,
            env={**self.env, **(env or {})},
            extra=extra,
        )
        self.workers.append(worker)
        return worker.start()

    @property
    def mod(self) -> ModuleType | None:
        """``locked_app`` once :meth:`app_module` imported it."""
        return self._app.mod

    def app_module(self) -> ModuleType:
        """``locked_app`` as the client sees it, imported afresh with this cluster's env."""
        return self._app.load(self.env)

    def close(self) -> None:
        for w in self.workers:
            w.kill()
        self.record.close()
        self.results.close()
        self._app.close()

    # -- lock nodes --------------------------------------------------------------------------------------------

    def _protect(self, server: RedisServer) -> None:
        with contextlib.closing(server.client()) as c:
            c.config_set("requirepass", self.password)

    def lock_client(self, server: RedisServer) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=server.port, password=self.password, socket_timeout=2)

    def lock_state(self, name: str) -> list[tuple[bytes | None, int]]:
        """(holder token, PTTL ms) of ``name`` on each running lock node (PTTL -2: no key)."""
        out = []
        for server in self.locks:
            if server.process is None or server.process.poll() is not None:
                continue
            with contextlib.closing(self.lock_client(server)) as c:
                out.append((c.hget(name, "owner"), int(c.pttl(name))))
        return out

    def holder_states(self, name: str) -> list[bytes | None]:
        """The holder record's ``state`` of ``name`` on each running lock node (None: no record)."""
        out = []
        for server in self.locks:
            if server.process is None or server.process.poll() is not None:
                continue
            with contextlib.closing(self.lock_client(server)) as c:
                out.append(c.hget(name, "state"))
        return out

    def wait_holder_state(self, name: str, state: str, timeout: float = 20.0) -> bool:
        """True once a quorum of the lock nodes says ``name``'s holder is in ``state`` (e.g. ``"retry"``: a retry's
        countdown), polled every 5 ms for at most ``timeout`` s; False if it never did."""
        quorum = len(self.locks) // 2 + 1
        for _ in polling(timeout, 0.005):
            if self.holder_states(name).count(state.encode()) >= quorum:
                return True
        return False

    def lock_free(self, name: str) -> bool:
        """True when no quorum of the lock nodes holds ``name``."""
        held = sum(1 for token, _ in self.lock_state(name) if token is not None)
        return held < len(self.locks) // 2 + 1

    def wait_lock_free(self, name: str, timeout: float) -> float | None:
        """Seconds until ``name`` was free (polled every 20 ms), or None if still held after ``timeout``."""
        start = time.monotonic()
        for _ in polling(timeout, 0.02):
            if self.lock_free(name):
                return time.monotonic() - start
        return None

    def stop_locks(self, count: int) -> None:
        """Stop the first ``count`` lock nodes (SIGTERM; their data is gone)."""
        for server in self.locks[:count]:
            server.stop()

    def start_locks(self) -> None:
        """(Re)start every stopped lock node on its port, password-protected again."""
        for server in self.locks:
            if server.process is None or server.process.poll() is not None:
                server.start()
                if self.password:
                    self._protect(server)

    # -- what the tasks recorded -------------------------------------------------------------------------------

    def records(self, name: str) -> list[list[Any]]:
        return [json.loads(x) for x in self.record.lrange(name, 0, -1)]

    def runs(self, key: str) -> list[list[Any]]:
        """Completed runs of ``key``: [key, task_id, pid, start, end]."""
        return [r for r in self.records("runs") if r[0] == key]

    def started(self, key: str) -> list[list[Any]]:
        """Started runs of ``key``: [key, task_id, pid, start]."""
        return [r for r in self.records("started") if r[0] == key]

    def wait_runs(self, key: str, count: int, timeout: float) -> list[list[Any]]:
        for _ in polling(timeout):
            if len(self.runs(key)) >= count:
                break
        return self.runs(key)

    def wait_started(self, key: str, count: int = 1, timeout: float = 20) -> list[list[Any]]:
        for _ in polling(timeout, 0.02):
            if len(self.started(key)) >= count:
                break
        started = self.started(key)
        assert len(started) >= count, f"{key} did not start {count} time(s) within {timeout} s"
        return started

    def states(self, task_ids: list[str]) -> dict[str, str]:
        """Stored states of ``task_ids`` (PENDING when nothing is stored), read in bulk from the result backend."""
        out: dict[str, str] = {}
        for chunk in _chunks(task_ids, 500):
            metas = self.results.mget([f"celery-task-meta-{t}" for t in chunk])
            for task_id, meta in zip(chunk, metas, strict=True):
                out[task_id] = json.loads(meta)["status"] if meta else "PENDING"
        return out


def _chunks(items: list[str], size: int) -> Iterator[tuple[str, ...]]:
    for i in range(0, len(items), size):
        yield tuple(items[i : i + size])


class AppImport:
    """A test app module (tests/apps) imported afresh in the test process under an env of its own: the env is set
    for the import and the process's life of the module, and put back, the app closed and forgotten, on close."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.mod: ModuleType | None = None
        self._saved: dict[str, str | None] = {}

    def load(self, env: dict[str, str]) -> ModuleType:
        if self.mod is None:
            for k, v in env.items():
                self._saved.setdefault(k, os.environ.get(k))
                os.environ[k] = v
            if str(APPS) not in sys.path:
                sys.path.insert(0, str(APPS))
            sys.modules.pop(self.name, None)
            self.mod = importlib.import_module(self.name)
        return self.mod

    def close(self) -> None:
        for k, v in self._saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        if self.mod is not None:
            forget_results(self.mod.app)
            self.mod.app.close()
            sys.modules.pop(self.name, None)
        with contextlib.suppress(ValueError):
            sys.path.remove(str(APPS))


def forget_results(app: Any) -> int:
    """Cut every live AsyncResult of ``app`` from its result backend (how many), before the module's servers stop.

    Celery subscribes each sent call's result (Redis pub/sub) and unsubscribes when its AsyncResult is collected. One
    collected after the broker stopped (a cycle, a failed test's traceback) retries that unsubscribe ~20 times, 1 s
    apart, inside whatever later test the garbage collector runs in: a later module's bounded wait then stalls past
    its bound (CI: test_queue_scope's retry test). Without a backend its ``__del__`` does nothing."""
    cut = 0
    for obj in gc.get_objects():
        # type(), not isinstance(): a Celery Proxy among them would evaluate itself for its __class__.
        if issubclass(type(obj), AsyncResult) and obj.app is app and obj.backend is not None:
            obj.backend = None
            cut += 1
    return cut


@contextlib.contextmanager
def cluster(
    tmp: Path,
    *,
    ttl: float,
    password: str | None = None,
    broker_url: str | None = None,
    env: dict[str, str] | None = None,
    binary: str | None = None,
) -> Iterator[Cluster]:
    """A broker and three lock nodes (servers of ``binary``: redis-server by default); every server and worker is
    killed on exit, even after a failure."""
    with redis_servers(4, binary=binary) as servers:
        c = Cluster(servers[0], servers[1:], tmp, ttl=ttl, password=password, broker_url=broker_url, env=env)
        try:
            yield c
        finally:
            c.close()


def overlapping(runs: list[list[Any]]) -> list[tuple[Any, Any]]:
    """Pairs of runs of one key whose [start, end] intervals intersect."""
    spans = sorted((r[3], r[4], r[1]) for r in runs)
    return [(a[2], b[2]) for a, b in itertools.pairwise(spans) if b[0] < a[1]]


def new_key(prefix: str = "k") -> str:
    return f"{prefix}-{uuid.uuid4().hex[:12]}"
