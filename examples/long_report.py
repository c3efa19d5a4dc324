"""A 5-second report on a 1-second lock: renewed while it runs, checked before every write, fenced.

``lock_ttl=1`` means a crashed report frees its lock within a second; the watchdog renews the lease every ttl/3
while the report runs, so the report itself may take as long as it needs. Between steps it calls
``self.check_lock()`` (raises ``LockLostError`` once the lock is lost: stop before the next side effect) and
writes each section with ``self.fencing_token``, through a store that rejects a token lower than one it has seen
(a writer that lost its lock and was overtaken can no longer overwrite the newer holder's work). A duplicate sent
two seconds in, long after the first ttl would have run out, is still skipped.

Run: ``python -m examples.long_report`` from the repository root.
"""

from __future__ import annotations

import sys
import time
import uuid
from types import ModuleType
from typing import Any

import redis

from celery_singleton_lock import LockedTask
from examples._harness import outcomes, run_example, short, wait_for
from examples.example_app import app, records

STEPS = 10
STEP_SECONDS = 0.5
TTL = 1.0

# KEYS[1] - the report's hash
# ARGV[1] - the section (a field), ARGV[2] - its content, ARGV[3] - the writer's fencing token
# returns 1 if written, 0 if rejected: a newer holder (a higher token) has already written to this report
FENCED_WRITE = """
local last = tonumber(redis.call('HGET', KEYS[1], '_fence') or '0')
if tonumber(ARGV[3]) < last then return 0 end
redis.call('HSET', KEYS[1], '_fence', ARGV[3], ARGV[1], ARGV[2])
return 1
"""


@app.task(base=LockedTask, bind=True, name="examples.report.monthly", lock_ttl=TTL)
def monthly_report(self: Any, account: str) -> dict[str, Any]:
    """Build the report in steps, checking the lock before each write; returns what each step saw."""
    db = records()
    db.set(f"report:{account}:started", self.request.id)
    node = redis.Redis.from_url(next(iter(self.app.conf.singleton_lock_urls)))
    key = self.lock_key_for(account)
    steps = []
    start = time.monotonic()
    for i in range(STEPS):
        time.sleep(STEP_SECONDS)  # query, aggregate, render one section
        self.check_lock()  # raises LockLostError if the lease was lost: no write after that
        written = db.eval(FENCED_WRITE, 1, f"report:{account}", f"section-{i}", f"rows of {i}", self.fencing_token)
        steps.append(
            {
                "at": round(time.monotonic() - start, 2),
                "held": self.lock_held(),
                "ttl_left_ms": node.pttl(key),
                "token": self.fencing_token,
                "written": bool(written),
            }
        )
    return {"steps": steps, "seconds": round(time.monotonic() - start, 2)}


def main(app_module: ModuleType) -> dict[str, Any]:
    db = app_module.records()
    account = f"acme-{uuid.uuid4().hex[:6]}"
    print(f"\nmonthly_report({account!r}): {STEPS * STEP_SECONDS:.0f} s of work on a lock_ttl={TTL:g} s lease.")
    report = monthly_report.delay(account)
    wait_for(lambda: db.exists(f"report:{account}:started") > 0, timeout=20)
    time.sleep(2.0)  # two ttls into the run: without renewal the lock would have expired by now
    print("  2 s in, the same report is requested again ...")
    duplicate = outcomes([monthly_report.delay(account)], timeout=20)[0]
    done = outcomes([report], timeout=30)[0]
    steps = done.value["steps"] if done.ran else []
    for s in steps:
        print(
            f"  +{s['at']:4.1f}s  lock held: {s['held']!s:<5}  ttl left on node 1: {s['ttl_left_ms']:4d} ms"
            f"  fencing token {s['token']}  section written: {s['written']}"
        )
    held = bool(steps) and all(s["held"] and s["ttl_left_ms"] > 0 for s in steps)
    seconds = done.value["seconds"] if done.ran else 0.0
    print(
        f"  the report ran {seconds:.1f} s on a {TTL:g} s lease: "
        + ("renewed, held throughout" if held else "NOT held throughout")
    )
    print(f"  the duplicate [{short(duplicate.task_id)}]: {duplicate.state}: {duplicate.reason}")
    skipped = duplicate.state == "REVOKED" and duplicate.holder == report.id
    return {
        "steps": len(steps),
        "seconds": seconds,
        "held_throughout": held,
        "writes_accepted": sum(s["written"] for s in steps),
        "tokens": sorted({s["token"] for s in steps}),
        "duplicate_skipped": skipped,
        "ok": done.ran and held and len(steps) == STEPS and skipped and seconds > 3 * TTL,
    }


if __name__ == "__main__":
    sys.exit(run_example(main))
