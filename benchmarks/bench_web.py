"""How long the locks page and /metrics take with many keys on one lock node.

One throwaway redis-server on 127.0.0.1 holds ``--keys`` LockedTask holder records (running, with every field a
run writes and a ttl), ``--lines`` waiting lines of 3 waiters each and an hour of per-minute metrics for 20 tasks;
the page (``celery_singleton_lock.web.make_app``, the doctor off: it is cached for a minute in real use) is fetched
over HTTP from its stdlib server ``--reps`` times, interleaved with /metrics. Printed: median and max wall time per
request, and the page's size (it shows one page of 100 rows a table, whatever the key count).

    python benchmarks/bench_web.py                     # 10,000 keys, 100 lines
    python benchmarks/bench_web.py --keys 1000
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time
import urllib.request
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from celery import Celery

from celery_singleton_lock.lock import metrics
from celery_singleton_lock.lock.record import sibling_key
from celery_singleton_lock.ops.web import make_app, serve
from celery_singleton_lock.testing import RedisServer

PREFIX = "bench:"


def fill(client: object, keys: int, lines: int) -> None:
    now_ms = int(time.time() * 1000)
    pipe = client.pipeline(transaction=False)  # type: ignore[attr-defined]
    for n in range(keys):
        task = f"app.task_{n % 20}"
        key = f"{PREFIX}{task}:v2:{n:032x}"
        pipe.hset(
            key,
            mapping={
                "owner": uuid.uuid4().hex,
                "fence": n + 1,
                "state": "running",
                "name": task,
                "job": str(uuid.uuid4()),
                "worker": f"{1000 + n % 7}@host-{n % 3}",
                "at": now_ms - n,
                "try": 0,
            },
        )
        pipe.pexpire(key, 600_000)
        if n < lines:
            line = sibling_key(key, ":waiters")
            pipe.zadd(line, {str(uuid.uuid4()): now_ms - i for i in range(3)})
        if n % 1000 == 999:
            pipe.execute()
    for minute in range(60):
        counts = {(f"app.task_{t}", o): 1 + (minute * t) % 7 for t in range(20) for o in ("acquired", "skipped")}
        metrics.write(pipe, PREFIX, counts, now=time.time() - 60 * minute)
    pipe.execute()


def fetch(url: str) -> tuple[float, int]:
    started = time.perf_counter()
    with urllib.request.urlopen(url, timeout=60) as response:
        size = len(response.read())
    return time.perf_counter() - started, size


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--keys", type=int, default=10_000)
    parser.add_argument("--lines", type=int, default=100)
    parser.add_argument("--reps", type=int, default=15)
    args = parser.parse_args()
    with RedisServer() as server:
        client = server.client()
        fill(client, args.keys, args.lines)
        app = Celery("bench-web", broker="memory://", set_as_current=False)
        app.conf.update(singleton_lock_urls=[server.url], singleton_lock_prefix=PREFIX)
        httpd = serve(make_app(app, refresh=0, doctor=False), "127.0.0.1", 0)
        thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True)
        thread.start()
        base = f"http://127.0.0.1:{httpd.server_address[1]}"
        try:
            fetch(base + "/")  # warm up: connections, scripts loaded
            times: dict[str, list[float]] = {"/": [], "/metrics": [], "/?page=50": []}
            sizes: dict[str, int] = {}
            for _ in range(args.reps):
                for path, took_list in times.items():
                    took, size = fetch(base + path)
                    took_list.append(took)
                    sizes[path] = size
        finally:
            httpd.shutdown()
            httpd.server_close()
    print(f"{args.keys} keys ({args.lines} lines) on one node, {args.reps} requests each, {os.cpu_count()} CPUs")
    for path, values in times.items():
        print(
            f"  GET {path:<10} median {statistics.median(values) * 1000:7.1f} ms   max {max(values) * 1000:7.1f} ms"
            f"   {sizes[path] / 1024:6.1f} KiB"
        )


if __name__ == "__main__":
    main()
