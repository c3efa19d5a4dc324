"""Fixtures: throwaway redis-server processes on free loopback ports (1, 3 or 5 nodes).

Shared servers are session-scoped and never faulted; tests that stop, kill or pause a node ask for the
function-scoped ``fresh_*`` fixtures, which are torn down (killed) even when the test fails.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest
from celery import Celery

from celery_singleton_lock.testing import RedisServer, redis_servers

# Worker app modules are configured from the environment by their tests; never import them at collection.
collect_ignore = ["apps"]

# `make test` (pytest -n 2 --dist loadfile --no-loadscope-reorder) hands modules to its two processes in collection
# order, one at a time as each process runs low. The longest modules go first, so that the suite does not end with
# one process still in a long module while the other sits idle (xdist's own order, most tests first, handed out
# the one-test Docker compose module, 80 s, and the two-test Sentry one among the last). Longest first, by each
# module's time run alone (approximate: a stale entry costs time, never a result); every other module follows in
# xdist's own order. Only the order changes: each module still runs whole in one process, as before.
LONGEST_FIRST = (  # each alone, on a loaded 2-core machine
    "tests/testing/test_model.py",  # ~150 s (five deployments of ~28 s)
    "tests/task/test_preskip.py",  # ~115 s
    "tests/policies/test_reschedule.py",  # ~100 s
    "tests/project/test_docker_compose.py",  # ~80 s in CI, one test (Docker)
    "tests/task/test_copies.py",  # ~70 s
    "tests/policies/test_limit_workers.py",  # ~65 s
    "tests/policies/test_decision.py",  # ~26-56 s (2.5 million combinations)
    "tests/project/test_docker_smoke.py",
    "tests/task/test_sentry.py",  # ~40 s, one set-up
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under pytest-xdist only (a worker process's collection, which sets the order modules are handed out in):
    the modules of LONGEST_FIRST first, the others after them, most tests first as xdist would order them."""
    if not hasattr(config, "workerinput"):
        return
    modules: dict[str, list[pytest.Item]] = {}
    for item in items:
        modules.setdefault(item.nodeid.split("::", 1)[0], []).append(item)
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    order = sorted(modules, key=lambda m: (rank.get(m, len(rank)), -len(modules[m]) if m not in rank else 0))
    items[:] = [item for m in order for item in modules[m]]


@pytest.fixture(scope="session")
def redis_node() -> Iterator[RedisServer]:
    """One shared server; tests use unique key names and must not fault it."""
    with redis_servers(1) as servers:
        yield servers[0]


@pytest.fixture(scope="session")
def redis_trio() -> Iterator[list[RedisServer]]:
    """Three shared independent servers (a 3-node Redlock); never faulted."""
    with redis_servers(3) as servers:
        yield servers


@pytest.fixture
def fresh_trio() -> Iterator[list[RedisServer]]:
    """Three servers of this test's own, free to stop, kill, pause and restart."""
    with redis_servers(3) as servers:
        yield servers


@pytest.fixture
def fresh_five() -> Iterator[list[RedisServer]]:
    """Five servers of this test's own, free to fault."""
    with redis_servers(5) as servers:
        yield servers


@pytest.fixture
def fresh_node() -> Iterator[RedisServer]:
    """One server of this test's own, free to fault."""
    with redis_servers(1) as servers:
        yield servers[0]


@pytest.fixture
def app(redis_node: RedisServer) -> Iterator[Celery]:
    """A Celery app of this test's own (memory broker, no result backend) locking on the shared node under a
    prefix no other test uses: LockedTask through Celery's tracer in this process (``apply()``)."""
    app = Celery(f"eager-{uuid.uuid4().hex[:8]}", broker="memory://", set_as_current=False)
    app.conf.singleton_lock_urls = [redis_node.url]
    app.conf.singleton_lock_prefix = f"eager-{uuid.uuid4().hex[:8]}:"
    yield app
    app.close()


@pytest.fixture
def name() -> str:
    """A lock name no other test uses."""
    return f"test:{uuid.uuid4().hex}"
