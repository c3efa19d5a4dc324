"""Smoke test on pytest-celery's Docker API: LockedTask in a worker container, Redis broker and backend containers.

``CeleryTestSetup`` brings up a Redis broker, a Redis result backend and a worker container built from this
repository's Dockerfile (the package installed as a user installs it), with a tasks module of ours injected
through pytest-celery's code generation. The locks live on the broker's Redis (the fallback when
``singleton_lock_urls`` is unset). Needs a Docker engine: where none answers, every test here is skipped, saying
so; this project's CI machines have none, and the in-process fast tier (test_fast_tier.py) and the subprocess
workers cover the same behaviour there.
"""

from __future__ import annotations

import types
from pathlib import Path
from typing import Any

import pytest
from celery import Celery
from pytest_celery import (
    CeleryBackendCluster,
    CeleryBrokerCluster,
    CeleryTestSetup,
    CeleryTestWorker,
    CeleryWorkerCluster,
    CeleryWorkerContainer,
    RedisTestBackend,
    RedisTestBroker,
    defaults,
)
from pytest_docker_tools import build, container, fxtr

from celery_singleton_lock.testing import assert_skipped_duplicate

ROOT = Path(__file__).resolve().parent.parent
WAIT = 60
SMOKE_TASKS = '''"""LockedTasks for the smoke test's worker container (shared tasks: bound to the container's app)."""

import time

from celery import shared_task

from celery_singleton_lock import LockedTask


@shared_task(base=LockedTask, bind=True, lock_ttl=30)
def hold(self, n, seconds):
    print(f"holding {n} as {self.request.id}", flush=True)
    time.sleep(seconds)
    return n
'''


def docker_engine() -> str | None:
    """None when a Docker engine answers a ping; otherwise why not (one line)."""
    try:
        import docker  # noqa: PLC0415 - pytest-celery's dependency; only asked here

        client = docker.from_env(timeout=3)
        try:
            client.ping()
        finally:
            client.close()
    except Exception as exc:  # no socket, no permission, no daemon: all mean "no engine here"
        return f"{type(exc).__name__}: {str(exc)[:200]}"
    return None


_NO_ENGINE = docker_engine()

pytestmark = [
    pytest.mark.docker,
    pytest.mark.skipif(
        _NO_ENGINE is not None,
        reason=f"no Docker engine answers ({_NO_ENGINE}); pytest-celery's container API needs one. The in-process "
        "fast tier (tests/test_fast_tier.py) covers LockedTask through a real worker without Docker",
    ),
]


class LockedWorkerContainer(CeleryWorkerContainer):
    """The worker image is this repository's Dockerfile: the package installed with pip."""

    @classmethod
    def worker_name(cls) -> str:
        return "locked_smoke_worker"

    @classmethod
    def worker_queue(cls) -> str:
        return "locked_smoke"


locked_worker_image = build(path=str(ROOT), tag="celery-singleton-lock/smoke-worker:latest")

locked_worker_container = container(
    image="{locked_worker_image.id}",
    environment=fxtr("default_worker_env"),
    network="{default_pytest_celery_network.name}",
    volumes={"{default_worker_volume.name}": defaults.DEFAULT_WORKER_VOLUME},
    wrapper_class=LockedWorkerContainer,
    timeout=defaults.DEFAULT_WORKER_CONTAINER_TIMEOUT,
    command=LockedWorkerContainer.command(),
)


@pytest.fixture
def default_worker_container_cls() -> type[CeleryWorkerContainer]:
    return LockedWorkerContainer


@pytest.fixture(scope="session")
def default_worker_container_session_cls() -> type[CeleryWorkerContainer]:
    return LockedWorkerContainer


@pytest.fixture
def default_worker_tasks(tmp_path: Path) -> set[types.ModuleType]:
    """Our tasks module, as pytest-celery's code generation reads it: a module object with a source file
    (not imported here: its shared tasks belong in the container's app, not in this process's)."""
    path = tmp_path / "csl_smoke_tasks.py"
    path.write_text(SMOKE_TASKS)
    module = types.ModuleType("csl_smoke_tasks")
    module.__file__ = str(path)
    return {module}


@pytest.fixture
def locked_worker(locked_worker_container: LockedWorkerContainer, celery_setup_app: Celery) -> Any:
    worker = CeleryTestWorker(locked_worker_container, app=celery_setup_app)
    yield worker
    worker.teardown()


@pytest.fixture
def celery_worker_cluster(locked_worker: CeleryTestWorker) -> Any:
    cluster = CeleryWorkerCluster(locked_worker)
    yield cluster
    cluster.teardown()


@pytest.fixture
def celery_broker_cluster(celery_redis_broker: RedisTestBroker) -> Any:
    cluster = CeleryBrokerCluster(celery_redis_broker)
    yield cluster
    cluster.teardown()


@pytest.fixture
def celery_backend_cluster(celery_redis_backend: RedisTestBackend) -> Any:
    cluster = CeleryBackendCluster(celery_redis_backend)
    yield cluster
    cluster.teardown()


def test_a_copy_sent_while_the_job_runs_in_a_container_is_skipped(celery_setup: CeleryTestSetup) -> None:
    """The container worker runs the job; a copy sent meanwhile is REVOKED at once, naming the running job."""
    queue = celery_setup.worker.worker_queue
    first = celery_setup.app.send_task("csl_smoke_tasks.hold", args=(7, 5), queue=queue)
    celery_setup.worker.wait_for_log(f"holding 7 as {first.id}", timeout=WAIT)
    duplicate = celery_setup.app.send_task("csl_smoke_tasks.hold", args=(7, 5), queue=queue)
    assert assert_skipped_duplicate(duplicate, of=first.id, timeout=WAIT) == first.id
    assert first.get(timeout=WAIT) == 7


def test_different_jobs_both_run_in_a_container(celery_setup: CeleryTestSetup) -> None:
    """Two different jobs are not duplicates of each other: both run."""
    queue = celery_setup.worker.worker_queue
    results = [celery_setup.app.send_task("csl_smoke_tasks.hold", args=(n, 0), queue=queue) for n in (1, 2)]
    assert [r.get(timeout=WAIT) for r in results] == [1, 2]
