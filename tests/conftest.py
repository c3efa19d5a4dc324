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
