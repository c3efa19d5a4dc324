"""``lock_rate``'s waiting path on RabbitMQ (classic queues, a vhost of this module's own): the over-the-rate calls
are re-sent with countdowns through the broker and run in windows of at most N by the nodes' clock. Two prefork
workers of 3 processes, three lock nodes."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from types import ModuleType

import pytest
import rabbitmq
from worker_cluster import Cluster, cluster, new_key

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def c(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with rabbitmq.vhost() as url, cluster(tmp_path_factory.mktemp("rate-amqp"), ttl=3.0, broker_url=url) as cl:
        cl.app_module()
        yield cl


@pytest.fixture(scope="module")
def tasks(c: Cluster) -> ModuleType:
    sys.modules.pop("rate_tasks", None)
    import rate_tasks  # noqa: PLC0415 - imported with the cluster's env, after locked_app

    return rate_tasks


def test_waiting_calls_run_in_windows_of_at_most_n_on_rabbitmq(c: Cluster, tasks: ModuleType) -> None:
    for name in ("amqp-rate-a", "amqp-rate-b"):
        c.worker(name, queues="rate_amqp", concurrency=3, extra=["-I", "rate_tasks"])
    key = new_key("amqp")
    results = [tasks.rated.apply_async((key, n, 0.0), queue="rate_amqp") for n in range(30)]
    for r in results:
        r.get(timeout=120, propagate=False)
    assert [r.state for r in results].count("SUCCESS") == 30
    rows = [r for r in (json.loads(x) for x in c.record.lrange("rate_runs", 0, -1)) if r[0] == key]
    assert len(rows) == 30
    slots = tasks.slot_rows(key)
    assert len(slots) == 30
    assert not tasks.slot_violations(slots, 1.0)
    assert tasks.busiest_window(slots, 1.0) <= 10
    assert sum(1 for r in rows if r[5] > 0) >= 10  # many of them waited (re-sent through RabbitMQ)
