"""A cap on the line: 10 sync requests for one account while its sync runs; 3 wait, the rest are refused at once.

``sync_account(account)`` takes a while and must run one at a time per account; every request must run
(``lock_on_duplicate="reschedule"``), but a storm must not park an unbounded number of messages. With
``lock_max_waiting=3``, a request that finds 3 waiting already is REVOKED at once, its reason saying the line of its
key is full; the 3 waiting ones run after the running one, one at a time.

Run: ``python -m examples.bounded_line`` from the repository root.
"""

from __future__ import annotations

import sys
import time
import uuid
from types import ModuleType
from typing import Any

from celery_singleton_lock import LockedTask
from examples._harness import outcomes, run_example, short
from examples.example_app import app, records

REQUESTS = 10


@app.task(
    base=LockedTask,
    name="examples.accounts.sync_account",
    lock_unique_on=["account"],
    lock_on_duplicate="reschedule",
    lock_max_waiting=3,
    lock_ttl=5,
)
def sync_account(account: str, request: int) -> int:
    """Sync the account with the upstream system (slow)."""
    time.sleep(1.5)
    records().rpush(f"sync:{account}", request)
    return request


def main(app_module: ModuleType) -> dict[str, Any]:
    db = app_module.records()
    account = f"account-{uuid.uuid4().hex[:6]}"
    print(f"\n{account}: a sync runs (1.5 s), then {REQUESTS} more requests arrive; at most 3 may wait.")
    first = sync_account.delay(account, 0)
    time.sleep(0.5)  # the first sync is running
    later = []
    for n in range(1, REQUESTS + 1):
        later.append(sync_account.delay(account, n))
        time.sleep(0.02)  # a storm: all of them while the first sync runs
    seen = outcomes([first, *later], timeout=60)
    for n, outcome in enumerate(seen):
        said = outcome.value if outcome.ran else outcome.reason.split(": ", 1)[-1][:90]
        print(f"  request {n} ({short(outcome.task_id)}): {outcome.state:<8} {said}")
    ran = [int(v) for v in db.lrange(f"sync:{account}", 0, -1)]
    refused = sum("is full" in o.reason for o in seen)
    print(f"  ran: {ran}; refused at once (line full): {refused}")
    return {"ran": len(ran), "refused": refused, "ok": len(ran) == 4 and refused == REQUESTS - 3}


if __name__ == "__main__":
    sys.exit(run_example(main))
