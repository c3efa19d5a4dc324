"""A partner's API allows 5 calls per second per customer: a burst of 15 calls for one customer runs 5 per second
across every worker process, while another customer's 3 calls run at once.

``call_partner_api(customer_id, payload)`` has ``lock_rate=(5, 1.0)`` keyed on the customer only
(``lock_rate_on=["customer_id"]``): never more than 5 starts per customer in ANY 1 s window (a sliding window, counted
on the lock nodes, not per worker as Celery's own ``rate_limit``). Two calls with different payloads are two jobs that
share the customer's rate; ``lock_limit=None`` takes no lock at all, so calls run side by side within the rate. A call
over the rate waits: it is re-sent for the moment the window lets it in (never early, never dropped).

Run: ``python -m examples.partner_api_rate`` from the repository root.
"""

from __future__ import annotations

import json
import sys
import uuid
from types import ModuleType
from typing import Any

from celery_singleton_lock import LockedTask
from examples._harness import outcomes, run_example
from examples.example_app import app, records

RATE = (5, 1.0)


@app.task(
    base=LockedTask,
    bind=True,
    name="examples.partner.call_partner_api",
    lock_rate=RATE,
    lock_rate_on=["customer_id"],
    lock_limit=None,
)
def call_partner_api(self: Any, customer_id: str, payload: dict[str, Any]) -> str:
    """One call of the partner's API for the customer (recorded with when the lock nodes counted its start)."""
    records().rpush(f"partner:{customer_id}", json.dumps([payload["n"], self.rate_started_at]))
    return f"{customer_id}/{payload['n']}"


def busiest_window(starts: list[float], period: float) -> int:
    """The most starts any window of ``period`` s holds (by the nodes' clock, 10 ms of slack between nodes)."""
    starts = sorted(starts)
    best = j = 0
    for i, at in enumerate(starts):
        while starts[j] <= at - (period - 0.01):
            j += 1
        best = max(best, i - j + 1)
    return best


def main(app_module: ModuleType) -> dict[str, Any]:
    db = app_module.records()
    run = uuid.uuid4().hex[:6]
    busy, quiet = f"acme-{run}", f"tiny-{run}"
    print(f"\n{busy} sends 15 calls and {quiet} 3, at once; lock_rate={RATE} per customer.")
    results = [call_partner_api.delay(busy, {"n": i}) for i in range(15)]
    results += [call_partner_api.delay(quiet, {"n": i}) for i in range(3)]
    seen = outcomes(results, timeout=90)
    figures: dict[str, Any] = {"ran": sum(o.ran for o in seen), "sent": len(results)}
    for customer in (busy, quiet):
        starts = [json.loads(x)[1] for x in db.lrange(f"partner:{customer}", 0, -1)]
        t0 = min(starts, default=0.0)
        print(f"  {customer}: starts at +" + ", +".join(f"{s - t0:.2f}" for s in sorted(starts)) + " s")
        figures[customer.split("-")[0]] = {"calls": len(starts), "busiest_window": busiest_window(starts, RATE[1])}
    print(f"  busiest 1 s window: {figures['acme']['busiest_window']} for {busy}, {figures['tiny']['busiest_window']}")
    figures["ok"] = (
        figures["ran"] == figures["sent"]
        and figures["acme"] == {"calls": 15, "busiest_window": RATE[0]}
        and figures["tiny"]["calls"] == 3
    )
    return figures


if __name__ == "__main__":
    sys.exit(run_example(main))
