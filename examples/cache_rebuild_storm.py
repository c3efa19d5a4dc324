"""A cache stampede: the key expired, and 200 requests ask for a rebuild while one is already running.

Each request that misses the cache enqueues ``rebuild_cache(key)``. Without a lock that is 200 identical rebuilds
hammering the database; with ``base=LockedTask`` the first one rebuilds and every request that arrives while it
runs is skipped at once (REVOKED, naming the rebuild that holds the lock), at the cost of about a no-op task each.

Run: ``python -m examples.cache_rebuild_storm`` from the repository root.
"""

from __future__ import annotations

import sys
import time
import uuid
from collections import Counter
from types import ModuleType
from typing import Any

from celery_singleton_lock import LockedTask
from examples._harness import outcomes, run_example, short, wait_for
from examples.example_app import app, records

REQUESTS = 200
REBUILD_SECONDS = 5.0  # at least; a rebuild lasts until the example's storm has been answered (at most 60 s)


@app.task(base=LockedTask, bind=True, name="examples.cache.rebuild", lock_ttl=10)
def rebuild_cache(self: Any, key: str) -> str:
    """Recompute one cache entry from the database (slow)."""
    db = records()
    db.rpush(f"cache:{key}:rebuilds", self.request.id)
    time.sleep(REBUILD_SECONDS)
    # Slow on purpose: the rebuild also lasts until every request of the storm was answered, so that on a busy
    # machine, where sending 200 requests can take longer than 5 s, each one still arrives *during* the rebuild.
    deadline = time.monotonic() + 60.0
    while not db.exists(f"cache:{key}:answered") and time.monotonic() < deadline:
        time.sleep(0.1)
    db.set(f"cache:{key}", f"fresh value (rebuilt by {self.request.id})")
    return f"rebuilt {key}"


def main(app_module: ModuleType) -> dict[str, Any]:
    db = app_module.records()
    key = f"homepage:{uuid.uuid4().hex[:6]}"
    print(f"\nCache key {key!r} expired: a rebuild starts, then {REQUESTS} requests each ask for one meanwhile.")
    first = rebuild_cache.delay(key)
    wait_for(lambda: db.llen(f"cache:{key}:rebuilds") > 0, timeout=20)
    t0 = time.monotonic()
    storm = [rebuild_cache.delay(key) for _ in range(REQUESTS)]
    seen = outcomes(storm, timeout=60)
    decided = time.monotonic() - t0
    db.set(f"cache:{key}:answered", 1, ex=600)
    done = outcomes([first], timeout=30)[0]
    rebuilds = db.lrange(f"cache:{key}:rebuilds", 0, -1)
    states = Counter(o.state for o in seen)
    holders = Counter(short(o.holder) for o in seen if o.state == "REVOKED")
    print(f"  the first request [{short(first.id)}]: {done.state} {done.value or done.reason}")
    print(f"  the {REQUESTS} requests during the rebuild: {dict(states)} (all answered in {decided:.2f} s)")
    print(f"  each skipped one names the lock's holder: {dict(holders)}")
    print(f"  rebuilds of {key!r}: {len(rebuilds)}")
    skipped = states.get("REVOKED", 0)
    return {
        "requests": REQUESTS,
        "rebuilds": len(rebuilds),
        "skipped": skipped,
        "holder_named": set(holders) == {short(first.id)},
        "ok": len(rebuilds) == 1 and done.ran and skipped == REQUESTS,
    }


if __name__ == "__main__":
    sys.exit(run_example(main))
