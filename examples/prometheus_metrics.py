"""The lock's outcomes for Prometheus: one endpoint reading the counts every worker process wrote to Redis.

Each worker process counts its lock outcomes in memory and its watchdog adds them up in Redis every few seconds
(and when a pool child exits), so prefork children, several workers and several hosts need nothing of their own:
no ``PROMETHEUS_MULTIPROC_DIR``, no exporter per worker. Serve the endpoint with ``celery -A app locks web``
(``/metrics``), or mount it in your own web app::

    from celery_singleton_lock.web import metrics_app
    app.mount("/lock-metrics", WSGIMiddleware(metrics_app(celery_app)))   # FastAPI; Flask/Django alike

Here it is served on a free port in this process and scraped before and after four calls of one job.

Run: ``python -m examples.prometheus_metrics`` from the repository root.
"""

from __future__ import annotations

import sys
import threading
import time
import urllib.request
import uuid
from collections import Counter
from types import ModuleType
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from celery_singleton_lock import LockedTask
from celery_singleton_lock.web import metrics_app, serve
from examples._harness import outcomes, run_example
from examples.example_app import app


@app.task(base=LockedTask, bind=True, name="examples.metrics.export_invoices", lock_ttl=10)
def export_invoices(self: Any, batch: str) -> str:
    """A job worth counting: ~1 s of exporting."""
    time.sleep(1.0)
    return f"exported {batch}"


def events(url: str, task: str) -> Counter[str]:
    """``celery_lock_events_total`` of ``task`` by outcome, as Prometheus reads it."""
    with urllib.request.urlopen(url, timeout=10) as response:
        text = response.read().decode()
    found: Counter[str] = Counter()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "celery_lock_events_total" and sample.labels["task"] == task:
                found[sample.labels["outcome"]] += int(sample.value)
    return found


def main(app_module: ModuleType) -> dict[str, Any]:
    server = serve(metrics_app(app_module.app), "127.0.0.1", 0)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}/metrics"
    try:
        before = events(url, export_invoices.name)
        batch = f"2026-11-{uuid.uuid4().hex[:4]}"
        print(f"\nexport_invoices({batch!r}) sent 4 times at once: 1 runs, 3 are skipped duplicates.")
        seen = outcomes([export_invoices.delay(batch) for _ in range(4)], timeout=30)
        expected = {"started": 1, "acquired": 1, "skipped": 3, "released": 1}
        this_run: dict[str, int] = {}
        for _ in range(60):  # the workers flush every 5 s: wait up to 15 s
            after = events(url, export_invoices.name)
            this_run = {k: after[k] - before[k] for k in after if after[k] != before[k]}
            if this_run == expected:
                break
            time.sleep(0.25)
        print(f"  {url}: celery_lock_events_total added by this run: {this_run}")
    finally:
        server.shutdown()
        server.server_close()
    ran = sum(o.ran for o in seen)
    return {**after, "this_run": this_run, "ok": ran == 1 and this_run == expected}


if __name__ == "__main__":
    sys.exit(run_example(main))
