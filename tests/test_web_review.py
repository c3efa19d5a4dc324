"""Adversarial review of issue 23 (metrics in Redis, /metrics, the locks page): each test failed before its fix.

One real redis-server for the module; the watchdog and the page run in this process against it.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery

from celery_singleton_lock import metrics
from celery_singleton_lock.config import settings_for
from celery_singleton_lock.renewal import Watchdog
from celery_singleton_lock.testing import RedisServer, wait_for


@pytest.fixture(scope="module")
def server() -> Iterator[RedisServer]:
    with RedisServer() as r:
        yield r


def app_on(server: RedisServer, name: str) -> Any:
    app = Celery(name, broker="memory://", set_as_current=False)
    app.conf.singleton_lock_urls = [server.url]
    app.conf.singleton_lock_prefix = f"{name}:"
    return app


def test_a_flush_that_timed_out_on_a_paused_node_is_not_counted_twice(server: RedisServer) -> None:
    """A node paused (SIGSTOP) during a flush still runs the pipeline it was sent once it resumes: the watchdog
    must not keep that batch and write it again (the counts of 10 outcomes read 15 before the fix)."""
    settings = settings_for(app_on(server, "flushtwice"))
    nodes, prefix = settings.nodes, settings.prefix
    watchdog = Watchdog()

    def acquired() -> int:
        return metrics.read_metrics(nodes, prefix).tasks.get("t", {}).get("acquired", 0)

    watchdog.count(nodes, prefix, "acquired", "t", 5)
    watchdog.flush_stats()  # the connection is open: the next pipeline is sent to the paused node
    assert acquired() == 5
    watchdog.count(nodes, prefix, "acquired", "t", 5)
    server.pause()
    try:
        watchdog.flush_stats()  # times out after socket_timeout: the node holds the commands, unanswered
    finally:
        server.resume()
    assert wait_for(lambda: acquired() >= 10, timeout=15, interval=0.05)
    watchdog.flush_stats()
    assert acquired() == 10
