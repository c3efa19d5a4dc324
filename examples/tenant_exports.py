"""At most 2 exports per tenant at once: a big tenant queues 6, a small one 2, on 4 worker processes.

``export(tenant, report)`` is heavy on the tenant's own database, so each tenant gets at most 2 at a time:
``lock_limit=2`` with the lock keyed on the tenant only (``lock_unique_on=["tenant"]``). An export that finds its
tenant's 2 slots taken waits in line (``lock_on_duplicate="reschedule"``) and runs when a slot frees; other
tenants' exports are not held up. Every export runs once; the report shows each tenant's most-at-once.

Run: ``python -m examples.tenant_exports`` from the repository root.
"""

from __future__ import annotations

import json
import sys
import time
import uuid
from types import ModuleType
from typing import Any

from celery_singleton_lock import LockedTask
from examples._harness import outcomes, run_example
from examples.example_app import app, records

LIMIT = 2
EXPORT_SECONDS = 0.6


@app.task(
    base=LockedTask,
    name="examples.exports.export",
    lock_limit=LIMIT,
    lock_unique_on=["tenant"],
    lock_on_duplicate="reschedule",
    lock_ttl=2,
)
def export(tenant: str, report: str) -> str:
    """Build one export of the tenant's data (slow, and heavy on the tenant's database)."""
    start = time.time()
    time.sleep(EXPORT_SECONDS)
    records().rpush(f"exports:{tenant}", json.dumps([report, start, time.time()]))
    return f"{tenant}/{report}"


def _most_at_once(windows: list[list[Any]]) -> int:
    events = sorted([(w[1], 1) for w in windows] + [(w[2], -1) for w in windows])
    current = peak = 0
    for _, step in events:
        current += step
        peak = max(peak, current)
    return peak


def main(app_module: ModuleType) -> dict[str, Any]:
    db = app_module.records()
    run = uuid.uuid4().hex[:6]
    big, small = f"acme-{run}", f"tiny-{run}"
    print(f"\n{big} asks for 6 exports and {small} for 2, at once; lock_limit={LIMIT} per tenant, 4 worker processes.")
    results = [export.delay(big, f"report-{i}") for i in range(6)] + [export.delay(small, f"r-{i}") for i in range(2)]
    seen = outcomes(results, timeout=90)
    figures: dict[str, Any] = {"ran": sum(o.ran for o in seen), "sent": len(results)}
    for tenant in (big, small):
        windows = [json.loads(x) for x in db.lrange(f"exports:{tenant}", 0, -1)]
        t0 = min((w[1] for w in windows), default=0.0)
        print(f"  {tenant}:")
        for report, start, end in sorted(windows, key=lambda w: w[1]):
            print(f"    {report:<9} +{start - t0:4.2f}s .. +{end - t0:4.2f}s")
        figures[tenant.split("-")[0]] = {"exports": len(windows), "most_at_once": _most_at_once(windows)}
    print(f"  most at once: {figures['acme']['most_at_once']} for {big}, {figures['tiny']['most_at_once']} for {small}")
    figures["ok"] = (
        figures["ran"] == figures["sent"]
        and figures["acme"] == {"exports": 6, "most_at_once": LIMIT}
        and figures["tiny"]["exports"] == 2
    )
    return figures


if __name__ == "__main__":
    sys.exit(run_example(main))
