"""Debounce: a document is edited 40 times in a burst; its search reindex runs once, after the burst, with the last
edit.

``reindex_doc(doc_id, version)`` rebuilds the document's search entry from its data at ``version``. With
``lock_debounce=1`` and the lock keyed on the document (``lock_unique_on=["doc_id"]``), the calls of a burst (less
than 1 s apart) are one job: nothing more is published after the first call, every caller gets the same
``AsyncResult``, and the reindex runs once, 1 s after the last edit, with the last edit's version.

Run: ``python -m examples.reindex_debounced`` from the repository root.
"""

from __future__ import annotations

import sys
import time
import uuid
from types import ModuleType
from typing import Any

from celery_singleton_lock import LockedTask
from examples._harness import outcomes, run_example
from examples.example_app import app, records

EDITS = 40


@app.task(base=LockedTask, name="examples.search.reindex_doc", lock_unique_on=["doc_id"], lock_debounce=1)
def reindex_doc(doc_id: str, version: int) -> str:
    """Rebuild the document's search entry from its data at ``version``."""
    records().rpush(f"reindex_doc:{doc_id}", version)
    return f"{doc_id} at v{version}"


def main(app_module: ModuleType) -> dict[str, Any]:
    db = app_module.records()
    doc = f"doc-{uuid.uuid4().hex[:6]}"
    print(f"\n{doc} is edited {EDITS} times, 20 ms apart; each edit asks for a reindex (lock_debounce=1).")
    calls = []
    for version in range(1, EDITS + 1):
        calls.append(reindex_doc.delay(doc, version))
        time.sleep(0.02)
    seen = outcomes(calls, timeout=60)
    jobs = {c.id for c in calls}
    reindexed = [int(v) for v in db.lrange(f"reindex_doc:{doc}", 0, -1)]
    print(f"  task ids handed out: {len(jobs)}; every caller got: {sorted({o.value for o in seen})}")
    print(f"  reindexed versions: {reindexed}")
    return {
        "jobs": len(jobs),
        "reindexed": reindexed,
        "ok": len(jobs) == 1 and reindexed == [EDITS] and all(o.value == f"{doc} at v{EDITS}" for o in seen),
    }


if __name__ == "__main__":
    sys.exit(run_example(main))
