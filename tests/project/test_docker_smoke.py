"""pytest-celery's Docker API: LockedTask in two worker containers, Redis broker and backend containers.

``CeleryTestSetup`` brings up a Redis broker, a Redis result backend and two worker containers built from this
repository's Dockerfile (the package installed as a user installs it), each consuming its own queue, with a tasks
module of ours injected through pytest-celery's code generation. The locks live on the broker's Redis (the
fallback when ``singleton_lock_urls`` is unset). Two tests, each with containers of its own:

* a copy sent to the second worker while the first runs the job is skipped, naming the running job; two
  different jobs both run;
* the worker container running an ``acks_late`` job is killed (``docker kill``, SIGKILL to the whole container):
  the broker redelivers the message after its visibility timeout, the other worker runs it once the dead run's
  lease has ended, and the job finishes exactly once.

Images: ``tests/dockerenv.py`` (local base images from tools/docker_images.sh, else the registry's). Every
container, volume and network here carries the label ``csl.run=RUN_ID``, is removed by pytest-docker-tools at
teardown, and whatever a failure left with that label is removed at the end of the module. Skipped, saying why,
where no Docker engine answers; under CI=true it must run.
"""

from __future__ import annotations

import re
import time
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import dockerenv
import pytest
from celery import Celery
from pytest_celery import (
    CeleryBackendCluster,
    CeleryBrokerCluster,
    CeleryTestSetup,
    CeleryTestWorker,
    CeleryWorkerCluster,
    CeleryWorkerContainer,
    RedisContainer,
    RedisTestBackend,
    RedisTestBroker,
    defaults,
)
from pytest_docker_tools import build, container, fxtr, network, volume

from celery_singleton_lock.testing import assert_skipped_duplicate

pytestmark = dockerenv.marks()

ROOT = Path(__file__).resolve().parent.parent.parent
WAIT = 90
LABELS = {dockerenv.LABEL: dockerenv.RUN_ID}
VISIBILITY = 10  # s: the broker redelivers an unacked message this long after it was sent to the killed worker
SMOKE_TASKS = '''"""LockedTasks for the smoke test's worker containers (shared tasks: bound to each container's app)."""

import socket
import time

from celery import shared_task

from celery_singleton_lock import LockedTask


@shared_task(base=LockedTask, bind=True, lock_ttl=8, acks_late=True, reject_on_worker_lost=True)
def hold(self, n, seconds):
    print(f"holding {n} as {self.request.id} on {socket.gethostname()}", flush=True)
    time.sleep(seconds)
    print(f"finished {n} as {self.request.id} on {socket.gethostname()}", flush=True)
    return n
'''


class FirstWorker(CeleryWorkerContainer):
    """The worker image is this repository's Dockerfile: the package installed with pip."""

    @classmethod
    def worker_name(cls) -> str:
        return "locked_smoke_a"

    @classmethod
    def worker_queue(cls) -> str:
        return "locked_a"


class SecondWorker(FirstWorker):
    @classmethod
    def worker_name(cls) -> str:
        return "locked_smoke_b"

    @classmethod
    def worker_queue(cls) -> str:
        return "locked_b"


# One image for both workers: the compose file's app image (CSL_APP_IMAGE), so either builds it and the other finds
# every layer cached. It is kept (an image, not a container): the next run's build is a cache hit too.
locked_worker_image = build(
    path=str(ROOT),
    tag=dockerenv.APP_IMAGE,
    buildargs={"BASE": dockerenv.PYTHON_IMAGE, "PIP_OFFLINE": dockerenv.PIP_OFFLINE},
    forcerm=True,  # a failed step leaves no container behind
    scope="module",
)


class LoopbackRedis(RedisContainer):
    """pytest-celery's Redis container, reached on the port it publishes on 127.0.0.1.

    pytest-docker-tools takes a machine with ``/.dockerenv`` (this one has it) for "tests inside a container" and
    then gives the container's own port, 6379, which pytest-celery pairs with ``localhost``: the test app would
    talk to whatever Redis listens on 127.0.0.1:6379 (the machine's own), not to this container.
    """

    @property
    def port(self) -> int:
        deadline = time.monotonic() + WAIT
        while time.monotonic() < deadline:
            self.reload()
            published = (self.attrs["NetworkSettings"]["Ports"] or {}).get("6379/tcp") or []
            if published and published[0].get("HostPort"):
                return int(published[0]["HostPort"])
            time.sleep(0.2)
        raise TimeoutError(f"{self.name} published no port for 6379/tcp within {WAIT} s")

    @property
    def host_url(self) -> str:
        return f"{self.prefix()}127.0.0.1:{self.port}/{self.vhost}"


# pytest-celery's own network and Redis containers, with our label and their ports on loopback only.
default_pytest_celery_network = network(labels=LABELS)
LOOPBACK_PORTS = {"6379/tcp": ("127.0.0.1", None)}
default_redis_broker = container(
    image=dockerenv.REDIS_IMAGE,
    ports=LOOPBACK_PORTS,
    network="{default_pytest_celery_network.name}",
    wrapper_class=LoopbackRedis,
    timeout=60,
    command=LoopbackRedis.command(),
    labels=LABELS,
)
default_redis_backend = container(
    image=dockerenv.REDIS_IMAGE,
    ports=LOOPBACK_PORTS,
    network="{default_pytest_celery_network.name}",
    wrapper_class=LoopbackRedis,
    timeout=60,
    command=LoopbackRedis.command(),
    labels=LABELS,
)
default_worker_volume = volume(initial_content=fxtr("default_worker_initial_content"), labels=LABELS)


def _worker_container(cls: type[CeleryWorkerContainer]) -> Any:
    return container(
        image="{locked_worker_image.id}",
        environment=fxtr("default_worker_env"),
        network="{default_pytest_celery_network.name}",
        volumes={"{default_worker_volume.name}": defaults.DEFAULT_WORKER_VOLUME},
        wrapper_class=cls,
        timeout=defaults.DEFAULT_WORKER_CONTAINER_TIMEOUT,
        command=cls.command(),
        labels=LABELS,
    )


first_container = _worker_container(FirstWorker)
second_container = _worker_container(SecondWorker)


@pytest.fixture(scope="module", autouse=True)
def _engine_and_cleanup() -> Iterator[None]:
    """Fail under CI when no engine answers; at the end, remove whatever a failure left with this run's label."""
    dockerenv.require()
    try:
        with dockerenv.sigterm_as_interrupt():
            yield
    finally:
        dockerenv.remove_labelled()


@pytest.fixture
def default_worker_container_cls() -> type[CeleryWorkerContainer]:
    return FirstWorker


@pytest.fixture(scope="session")
def default_worker_container_session_cls() -> type[CeleryWorkerContainer]:
    return FirstWorker


@pytest.fixture
def celery_setup_app(celery_setup_cls: Any, celery_setup_config: dict, celery_setup_name: str) -> Celery:
    """pytest-celery's app, plus what the kill test needs; the workers' apps are generated from its changes."""
    app = celery_setup_cls.create_setup_app(
        celery_setup_config=celery_setup_config, celery_setup_app_name=celery_setup_name
    )
    app.conf.update(
        # kombu looks for unacked messages past the visibility timeout every 10 s but scans only every 10th look
        # (about 100 s): every 2 s here, so the killed worker's job comes back soon after the timeout.
        broker_transport_options={
            "visibility_timeout": VISIBILITY,
            "unacked_restore_interval": 2,
            "unacked_restore_throttle": 1,
        },
        worker_prefetch_multiplier=1,
    )
    return app


@pytest.fixture
def default_worker_tasks(tmp_path: Path) -> set[types.ModuleType]:
    """Our tasks module, as pytest-celery's code generation reads it: a module object with a source file
    (not imported here: its shared tasks belong in the containers' apps, not in this process's)."""
    path = tmp_path / "csl_smoke_tasks.py"
    path.write_text(SMOKE_TASKS)
    module = types.ModuleType("csl_smoke_tasks")
    module.__file__ = str(path)
    return {module}


@pytest.fixture
def celery_worker_cluster(
    first_container: FirstWorker, second_container: SecondWorker, celery_setup_app: Celery
) -> Any:
    workers = [
        CeleryTestWorker(first_container, app=celery_setup_app),
        CeleryTestWorker(second_container, app=celery_setup_app),
    ]
    cluster = CeleryWorkerCluster(*workers)
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


def _workers(setup: CeleryTestSetup) -> tuple[CeleryTestWorker, CeleryTestWorker]:
    first, second = setup.worker_cluster
    return first, second


def _lines(worker: CeleryTestWorker, pattern: str) -> list[str]:
    return re.findall(pattern, worker.logs())


def test_a_copy_sent_to_another_worker_while_the_job_runs_is_skipped(celery_setup: CeleryTestSetup) -> None:
    """The first container runs the job; a copy sent to the second meanwhile is REVOKED at once, naming the running
    job; two different jobs both run."""
    first, second = _workers(celery_setup)
    app = celery_setup.app
    # This process talks to the broker container, on its published loopback port (never to 127.0.0.1:6379).
    assert app.conf.broker_url == celery_setup.broker.container.host_url
    assert not app.conf.broker_url.endswith(":6379/0")
    running = app.send_task("csl_smoke_tasks.hold", args=(7, 5), queue=first.worker_queue)
    first.wait_for_log(f"holding 7 as {running.id}", timeout=WAIT)
    duplicate = app.send_task("csl_smoke_tasks.hold", args=(7, 5), queue=second.worker_queue)
    assert assert_skipped_duplicate(duplicate, of=running.id, timeout=WAIT) == running.id
    assert running.get(timeout=WAIT) == 7
    assert _lines(second, r"holding 7 as") == []
    distinct = [
        app.send_task("csl_smoke_tasks.hold", args=(n, 0), queue=w.worker_queue) for n, w in ((1, first), (2, second))
    ]
    assert [r.get(timeout=WAIT) for r in distinct] == [1, 2]


def test_a_worker_container_killed_mid_run_its_job_is_redelivered_and_runs_once(celery_setup: CeleryTestSetup) -> None:
    """``docker kill`` the container running an acks_late job: the job comes back (visibility timeout) and the
    other worker runs it, once; the killed run never finished."""
    first, second = _workers(celery_setup)
    app = celery_setup.app
    # Both workers consume the first queue from here on: the redelivered message goes to whichever is alive.
    app.control.add_consumer(first.worker_queue, destination=[second.hostname()], reply=True, timeout=10)
    job = app.send_task("csl_smoke_tasks.hold", args=(9, 5), queue=first.worker_queue)
    deadline = time.monotonic() + WAIT
    victim = None
    while victim is None and time.monotonic() < deadline:
        for worker in (first, second):
            if _lines(worker, f"holding 9 as {job.id}"):
                victim = worker
                break
        else:
            time.sleep(0.2)
    assert victim is not None, "the job did not start on either worker"
    survivor = second if victim is first else first
    victim.kill()  # docker kill (SIGKILL): the whole container, pool and all
    assert job.get(timeout=3 * WAIT) == 9
    print(f"killed {victim.hostname()}; survivor's log:\n" + "\n".join(survivor.logs().splitlines()[-6:]))
    finished = _lines(survivor, rf"finished 9 as {job.id}")
    assert finished, survivor.logs()[-3000:]
    assert len(finished) == 1
    assert _lines(victim, rf"finished 9 as {job.id}") == []  # killed mid-run: the first run never ended
