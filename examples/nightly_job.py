"""The cron job that must run once: three hosts each send ``nightly_cleanup(date)`` at the same moment.

Every host has the same crontab line (nobody wants the job to depend on one machine), so at 03:00 three messages
arrive together. The lock is keyed on the date: one run cleans up, the other two are skipped while it holds the
lock, each naming the run that holds it.

What this does and does not cover: LockedTask skips duplicates that arrive *while* a run holds the lock. A host
whose clock is minutes late, sending after the run finished, would start a second run; for periodic jobs sent by
beat use ``-S celery_singleton_lock.beat.SingletonScheduler`` (each due run is sent once across all beat
instances; see examples/beat_app.py), or make the job record that the date is done.

Run: ``python -m examples.nightly_job`` from the repository root.
"""

from __future__ import annotations

import datetime as dt
import sys
import threading
import time
import uuid
from types import ModuleType
from typing import Any

from celery_singleton_lock import LockedTask
from examples._harness import outcomes, run_example, short
from examples.example_app import app, records

HOSTS = ("cron-a", "cron-b", "cron-c")


@app.task(base=LockedTask, bind=True, name="examples.nightly.cleanup", lock_ttl=30)
def nightly_cleanup(self: Any, date: str) -> str:
    """Delete the day's expired sessions (~1 s); every run is recorded."""
    records().rpush(f"nightly:{date}:runs", self.request.id)
    time.sleep(1.0)
    return f"cleaned up {date}"


def main(app_module: ModuleType) -> dict[str, Any]:
    # A date of its own per run of the example, so re-running it (or the tests) starts clean.
    date = f"{dt.date.today().isoformat()}#{uuid.uuid4().hex[:6]}"
    print(f"\n03:00 on three hosts: each sends nightly_cleanup({date!r}) at the same moment.")
    sent: dict[str, Any] = {}
    barrier = threading.Barrier(len(HOSTS))

    def cron(host: str) -> None:
        barrier.wait()
        sent[host] = nightly_cleanup.delay(date)

    threads = [threading.Thread(target=cron, args=(h,)) for h in HOSTS]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    seen = dict(zip(HOSTS, outcomes([sent[h] for h in HOSTS], timeout=30), strict=True))
    runs = app_module.records().lrange(f"nightly:{date}:runs", 0, -1)
    for host, o in seen.items():
        if o.ran:
            print(f"  {host} [{short(o.task_id)}]: RAN      {o.value}")
        else:
            print(f"  {host} [{short(o.task_id)}]: {o.state:<8} skipped: held by task {short(o.holder)}")
    ran = [o for o in seen.values() if o.ran]
    skipped = [o for o in seen.values() if o.state == "REVOKED"]
    print(f"  runs of the cleanup for {date}: {len(runs)}")
    return {
        "hosts": len(HOSTS),
        "runs": len(runs),
        "skipped": len(skipped),
        "holder_named": bool(ran) and all(o.holder == ran[0].task_id for o in skipped),
        "ok": len(runs) == 1 and len(ran) == 1 and len(skipped) == len(HOSTS) - 1,
    }


if __name__ == "__main__":
    sys.exit(run_example(main))
