"""Keep-latest: an account is edited 5 times while its search reindex runs; only the newest edit is reindexed next.

``reindex(account, version)`` rebuilds the account's search documents from its data at ``version``. Edits arrive
faster than a reindex takes. With ``lock_on_duplicate="replace"`` and the lock keyed on the account
(``lock_unique_on=["account"]``), one reindex runs and at most one waits: each newer edit takes the waiting one's
place, so after the running one only the newest version is reindexed. The replaced callers' results say so
(REVOKED, "superseded by task <id>").

Run: ``python -m examples.reindex_latest`` from the repository root.
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

EDITS = 5


@app.task(
    base=LockedTask,
    name="examples.search.reindex",
    lock_unique_on=["account"],
    lock_on_duplicate="replace",
    lock_ttl=3,
)
def reindex(account: str, version: int) -> str:
    """Rebuild the account's search documents from its data at ``version`` (slow)."""
    time.sleep(1.5)
    records().rpush(f"reindex:{account}", version)
    return f"{account} at v{version}"


def main(app_module: ModuleType) -> dict[str, Any]:
    db = app_module.records()
    account = f"account-{uuid.uuid4().hex[:6]}"
    print(f"\n{account} is edited {EDITS + 1} times; each edit asks for a reindex (1.5 s each).")
    first = reindex.delay(account, 1)
    time.sleep(0.5)  # the first reindex is running
    later = []
    for version in range(2, EDITS + 2):
        later.append(reindex.delay(account, version))
        time.sleep(0.15)  # edits a little apart: each reaches a worker before the next
    seen = outcomes([first, *later], timeout=60)
    for version, outcome in enumerate(seen, 1):
        said = outcome.value if outcome.ran else outcome.reason.split(": ", 1)[-1][:80]
        print(f"  edit v{version} ({short(outcome.task_id)}): {outcome.state:<8} {said}")
    reindexed = [int(v) for v in db.lrange(f"reindex:{account}", 0, -1)]
    superseded = sum("superseded by task" in o.reason for o in seen)
    print(f"  reindexed versions, in order: {reindexed}; superseded: {superseded}")
    return {
        "reindexed": reindexed,
        "superseded": superseded,
        "ok": reindexed == [1, EDITS + 1] and superseded == EDITS - 1,
    }


if __name__ == "__main__":
    sys.exit(run_example(main))
