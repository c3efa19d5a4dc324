"""Newest wins, also while it runs: a catalogue rebuild is asked for again mid-run; the stale one stops, the newest
one runs after it, and a stale write that slips through is refused by its fencing token.

``rebuild(shop, version)`` rebuilds the shop's catalogue from its data at ``version`` and publishes it to a store
that keeps the newest fencing token it has seen (any store with a compare: a SQL ``WHERE token <= :token``, an
object store's conditional put). With ``lock_on_duplicate="cancel"`` a newer call asks the running rebuild to stop:
the holder's watchdog sees the request at its next renewal (same round trip), the body gets JobCancelledError and
ends REVOKED ("cancelled by a newer call, task <id>"), and the newer call runs next, never beside it. The second
shop's rebuild is stubborn (it swallows the stop, like a body stuck in C code): it is no longer renewed after one
interval, the newer call runs when its lease ends, and the stubborn body's late publish is refused: its fencing
token is older than its successor's.

Run: ``python -m examples.rebuild_newest_wins`` from the repository root.
"""

from __future__ import annotations

import sys
import time
import uuid
from types import ModuleType
from typing import Any

from celery_singleton_lock import JobCancelledError, LockedTask
from examples._harness import outcomes, run_example, short
from examples.example_app import app, records

#: The store's compare-and-set: a publish whose fencing token is older than the newest seen is refused.
PUBLISH = """
if tonumber(ARGV[1]) < tonumber(redis.call('HGET', KEYS[1], 'token') or '0') then return 0 end
redis.call('HSET', KEYS[1], 'token', ARGV[1], 'version', ARGV[2])
return 1
"""


@app.task(
    base=LockedTask,
    bind=True,
    name="examples.catalogue.rebuild",
    lock_unique_on=["shop"],
    lock_on_duplicate="cancel",
    lock_ttl=1.5,
)
def rebuild(self: Any, shop: str, version: int, seconds: float, stubborn: bool = False) -> str:
    """Rebuild ``shop``'s catalogue at ``version`` (``seconds`` of work), then publish it, fenced."""
    token = self.fencing_token or 0
    end_by = time.monotonic() + seconds
    for _ in range(int(seconds / 0.05) + 2):  # bounded by count and by time
        if time.monotonic() >= end_by:
            break
        try:
            time.sleep(0.05)
        except JobCancelledError:
            if not stubborn:
                raise  # stop here: REVOKED, naming the newer call
    published = records().eval(PUBLISH, 1, f"catalogue:{shop}", token, version)
    records().rpush(f"publishes:{shop}", f"{version}:{token}:{'kept' if published else 'refused'}")
    return f"{shop} v{version} {'published' if published else 'refused: a newer rebuild published first'}"


def main(app_module: ModuleType) -> dict[str, Any]:
    db = app_module.records()
    polite, stubborn = (f"shop-{uuid.uuid4().hex[:6]}" for _ in range(2))
    print("\nA rebuild (20 s) is running when the data changes again; the newer rebuild wins.")
    old = rebuild.delay(polite, 1, 20.0)
    stuck = rebuild.delay(stubborn, 1, 6.0, stubborn=True)
    time.sleep(1.0)  # both rebuilds run
    new = rebuild.delay(polite, 2, 0.2)
    new_after_stuck = rebuild.delay(stubborn, 2, 0.2)
    # The stubborn body ends last (its 6 s), after its successor published, and tries to publish its stale catalogue.
    seen = outcomes([old, new, stuck, new_after_stuck], timeout=60)
    for outcome in seen:
        said = outcome.value if outcome.ran else outcome.reason[:90]
        print(f"  {short(outcome.task_id)}: {outcome.state:<8} {said}")
    pubs = {shop: [str(p) for p in db.lrange(f"publishes:{shop}", 0, -1)] for shop in (polite, stubborn)}
    for shop, lines in pubs.items():
        print(f"  {shop} publishes (version:token:verdict): {lines}")
    cancelled = "cancelled by a newer call" in seen[0].reason and new.id in seen[0].reason
    polite_ok = [p.split(":")[0] + ":" + p.split(":")[2] for p in pubs[polite]] == ["2:kept"]
    stale = [p for p in pubs[stubborn] if p.startswith("1:")]
    fenced = len(stale) == 1 and stale[0].endswith(":refused")
    return {
        "cancelled": cancelled,
        "polite": pubs[polite],
        "stubborn": pubs[stubborn],
        "ok": cancelled and polite_ok and fenced,
    }


if __name__ == "__main__":
    sys.exit(run_example(main))
