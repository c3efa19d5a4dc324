"""The library's signals as Prometheus counters, exported by each worker.

Where the counters live: the signals are sent in the process that runs the task, which with the prefork pool is
a pool *child*. Plain in-memory counters would be split across the children and invisible to an exporter in the
worker's main process (and lost whenever a child is replaced). So this uses prometheus_client's multiprocess mode:
with ``PROMETHEUS_MULTIPROC_DIR`` set in the worker's environment, every process writes its counts to its own
memory-mapped file in that directory, and the exporter, an HTTP server started in the worker's main process once
the worker is ready, adds up all the files at each scrape. The directory is emptied when the worker starts
(stale counts from an earlier run would be added in). Give each worker its own directory, and scrape each
worker. Without the directory (solo or threads pool), the counters of the one process are exported directly.

Worker environment: ``PROMETHEUS_MULTIPROC_DIR`` (a directory of its own), ``EXAMPLES_METRICS_PORT`` (start the
exporter), ``EXAMPLES_METRICS_ADDR`` (default 127.0.0.1). ``main`` scrapes ``EXAMPLES_METRICS_URLS``.

Run: ``python -m examples.prometheus_metrics`` from the repository root.
"""

from __future__ import annotations

import logging
import os
import sys
import time
import urllib.request
import uuid
from collections import Counter as Tally
from pathlib import Path
from types import ModuleType
from typing import Any

from celery.signals import worker_init, worker_ready
from prometheus_client import CollectorRegistry, Counter, multiprocess, start_http_server
from prometheus_client.parser import text_string_to_metric_families

from celery_singleton_lock import LockedTask, signals
from examples._harness import outcomes, run_example
from examples.example_app import app

logger = logging.getLogger(__name__)
PREFIX = "celery_singleton_lock_"

# This process's own registry (not the global one, so importing the module twice cannot register twice). In
# multiprocess mode the values also go to this process's file in PROMETHEUS_MULTIPROC_DIR, which is what is exported.
REGISTRY = CollectorRegistry()
ACQUIRED = Counter(f"{PREFIX}acquired", "Locks acquired by task runs", ["task"], registry=REGISTRY)
DUPLICATE_SKIPPED = Counter(
    f"{PREFIX}duplicate_skipped", "Duplicates not run, by the policy applied", ["task", "policy"], registry=REGISTRY
)
LOST = Counter(f"{PREFIX}lost", "Locks lost while their task ran", ["task"], registry=REGISTRY)
RELEASED = Counter(
    f"{PREFIX}released", "Locks released; held=False: it had been lost before", ["task", "held"], registry=REGISTRY
)
UNAVAILABLE = Counter(
    f"{PREFIX}unavailable", "Runs that found no quorum of lock nodes, by policy", ["task", "policy"], registry=REGISTRY
)


def _task(sender: Any) -> str:
    return str(getattr(sender, "name", None) or "-")


@signals.lock_acquired.connect
def _acquired(sender: Any, **_: Any) -> None:
    ACQUIRED.labels(_task(sender)).inc()


@signals.duplicate_skipped.connect
def _skipped(sender: Any, policy: str, **_: Any) -> None:
    DUPLICATE_SKIPPED.labels(_task(sender), policy).inc()


@signals.lock_lost.connect
def _lost(sender: Any, **_: Any) -> None:
    LOST.labels(_task(sender)).inc()


@signals.lock_released.connect
def _released(sender: Any, held: bool, **_: Any) -> None:
    RELEASED.labels(_task(sender), str(held)).inc()


@signals.lock_unavailable.connect
def _unavailable(sender: Any, policy: str, **_: Any) -> None:
    UNAVAILABLE.labels(_task(sender), policy).inc()


def exposition_registry() -> CollectorRegistry:
    """What the exporter serves: every process's counts in multiprocess mode, else this process's counters."""
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)
        return registry
    return REGISTRY


@worker_init.connect
def _empty_multiproc_dir(**_: Any) -> None:
    """In the worker's main process, before the pool forks: forget the counts of an earlier run."""
    directory = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    if directory:
        for stale in Path(directory).glob("*.db"):
            stale.unlink()


@worker_ready.connect
def _start_exporter(**_: Any) -> None:
    """In the worker's main process, once the pool is up: serve /metrics on EXAMPLES_METRICS_PORT."""
    port = os.environ.get("EXAMPLES_METRICS_PORT")
    if not port:
        return
    if not os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        logger.warning("PROMETHEUS_MULTIPROC_DIR is not set: counts made in prefork pool children are not exported")
    addr = os.environ.get("EXAMPLES_METRICS_ADDR", "127.0.0.1")
    start_http_server(int(port), addr=addr, registry=exposition_registry())
    logger.info("Prometheus metrics on http://%s:%s/metrics", addr, port)


@app.task(base=LockedTask, bind=True, name="examples.metrics.export_invoices", lock_ttl=10)
def export_invoices(self: Any, batch: str) -> str:
    """A job worth counting: ~1 s of exporting."""
    time.sleep(1.0)
    return f"exported {batch}"


def scrape(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as response:
        return str(response.read().decode())


def totals(texts: list[str]) -> Tally[tuple[str, tuple[tuple[str, str], ...]]]:
    """Sum the ``*_total`` samples of our families over several workers' exposition texts."""
    summed: Tally[tuple[str, tuple[tuple[str, str], ...]]] = Tally()
    for text in texts:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name.startswith(PREFIX) and sample.name.endswith("_total"):
                    summed[(sample.name, tuple(sorted(sample.labels.items())))] += int(sample.value)
    return summed


def by_family(summed: Tally[tuple[str, tuple[tuple[str, str], ...]]]) -> dict[str, int]:
    families: Tally[str] = Tally()
    for (name, _labels), value in summed.items():
        families[name.removeprefix(PREFIX).removesuffix("_total")] += value
    return {f: families.get(f, 0) for f in ("acquired", "duplicate_skipped", "released", "lost", "unavailable")}


def main(app_module: ModuleType) -> dict[str, Any]:
    urls = [u for u in os.environ.get("EXAMPLES_METRICS_URLS", "").split(",") if u]
    if not urls:
        print("EXAMPLES_METRICS_URLS is not set: no worker exporters to scrape")
        return {"ok": False}
    before = totals([scrape(u) for u in urls])
    batch = f"2026-11-{uuid.uuid4().hex[:4]}"
    print(f"\nexport_invoices({batch!r}) sent 4 times at once: 1 runs, 3 are skipped duplicates.")
    seen = outcomes([export_invoices.delay(batch) for _ in range(4)], timeout=30)
    print(f"  outcomes: {dict(Tally(o.state for o in seen))}")
    texts = [scrape(u) for u in urls]
    for url, text in zip(urls, texts, strict=True):
        ours = [line for line in text.splitlines() if PREFIX in line]
        print(f"\n  {url} (this worker's pool processes, added up by its exporter):")
        print("\n".join(f"    {line}" for line in ours))
    after = totals(texts)
    families = by_family(after)
    this_run: Tally[str] = Tally()
    for key, value in after.items():
        if dict(key[1]).get("task") == export_invoices.name:
            this_run[key[0].removeprefix(PREFIX).removesuffix("_total")] += value - before[key]
    print(f"\n  totals over both workers since they started (every example's tasks): {families}")
    print(f"  added by this run's export_invoices: {dict(this_run)}")
    ran = sum(o.ran for o in seen)
    return {
        **families,
        "this_run": dict(this_run),
        "ok": ran == 1 and this_run["duplicate_skipped"] == 3 and this_run["acquired"] == this_run["released"] == 1,
    }


if __name__ == "__main__":
    sys.exit(run_example(main))
