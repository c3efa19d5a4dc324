"""The real-worker harness (tests/worker_cluster.py) itself: what a module's cluster leaves behind in the process
when it closes (``make test`` runs many modules, one after another, in each pytest-xdist process)."""

from __future__ import annotations

import gc
import logging
from pathlib import Path

import pytest
from worker_cluster import cluster, new_key


def test_a_closed_cluster_s_results_are_collected_without_a_word_to_its_stopped_broker(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """AsyncResults still subscribed when their cluster closed, collected later (a cycle), never call the stopped
    result store: Celery's consumer would retry their unsubscribe ~20 s inside whatever later test collects them."""
    with cluster(tmp_path, ttl=3.0) as c:
        mod = c.app_module()
        results = [mod.work.delay(new_key(), 0.0) for _ in range(3)]  # no worker: each stays subscribed
        assert len(mod.app.backend.result_consumer.subscribed_to) == 3
        cycle: list[object] = [results]
        cycle.append(cycle)  # freed only by the cyclic collector, after the cluster closed
        del results, cycle
    with caplog.at_level(logging.ERROR, logger="celery.backends.redis"):
        gc.collect()
    assert not [r.getMessage() for r in caplog.records if r.name.startswith("celery.backends")]
