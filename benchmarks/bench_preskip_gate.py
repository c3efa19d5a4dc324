"""What a non-duplicate pays for the pre-check before the pool (issue 26), on a real worker Request, in-process.

A call the worker process has not seen (the gate's miss: every first message of a call, e.g. an executed LockedTask
with its own arguments) goes through ``LockedRequest.revoked()``: Celery's own ``revoked()``, then the pre-check's
clear-case checks and its gate (no key, no I/O). This times both on real ``celery.worker.request`` objects built
by ``create_request_cls`` as the worker builds them (task from the app's registry, reserved as the worker reserves
them), no broker needed; bench_skip.py measures the whole worker, where the noise of a shared VM is larger than this::

    python benchmarks/bench_preskip_gate.py              # Celery's revoked() vs ours, µs per call
    python benchmarks/bench_preskip_gate.py --profile    # + cProfile of ours
"""

from __future__ import annotations

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
for _name, _value in {
    "BENCH_BROKER": "redis://127.0.0.1:1/0",
    "BENCH_BACKEND": "redis://127.0.0.1:1/1",
    "BENCH_LOCK_URLS": "redis://127.0.0.1:1/0",
    "BENCH_RECORD": "redis://127.0.0.1:1/2",
}.items():
    os.environ.setdefault(_name, _value)  # nothing connects: no I/O on this path

import cProfile  # noqa: E402
import pstats  # noqa: E402
import timeit  # noqa: E402
import uuid  # noqa: E402
from typing import Any  # noqa: E402

import bench_apps  # noqa: E402
from celery.worker import state  # noqa: E402
from celery.worker.request import Request, create_request_cls  # noqa: E402
from kombu import Message  # noqa: E402

from celery_singleton_lock.task._monitoring import LockedRequest  # noqa: E402

app = bench_apps.app
app.finalize()
task = app.tasks["bench.locked"]  # the registry's object, as a worker has it


class Pool:
    apply_async = None


Req = create_request_cls(LockedRequest, task, Pool(), "bench@h", None, app=app)


def make(i: int) -> Any:
    tid = str(uuid.uuid4())
    headers = {
        "lang": "py",
        "task": task.name,
        "id": tid,
        "retries": 0,
        "argsrepr": repr((i,)),
        "kwargsrepr": "{}",
        "root_id": tid,
        "parent_id": None,
        "origin": "x",
        "ignore_result": True,
        "eta": None,
        "expires": None,
    }
    body = ((i,), {}, {"callbacks": None, "errbacks": None, "chain": None, "chord": None})
    msg = Message(
        body=body,
        headers=headers,
        content_type="application/x-python-serialize",
        content_encoding="binary",
        delivery_info={"exchange": "", "routing_key": "q"},
        properties={},
    )
    req = Req(msg, app=app, task=task, body=body, headers=headers, decoded=True, hostname="bench@h")
    state.task_reserved(req)
    return req


N = 5000
reqs = [make(i) for i in range(3 * N)]
it = iter(reqs)
base = timeit.timeit(lambda: Request.revoked(next(it)), number=N) / N
ours = timeit.timeit(lambda: next(it).revoked(), number=N) / N
print(
    f"Celery's revoked(): {base * 1e6:.2f} µs; LockedRequest.revoked(), an unseen call: {ours * 1e6:.2f} µs; "
    f"the pre-check's own: {(ours - base) * 1e6:.2f} µs"
)
if "--profile" in sys.argv:
    p = cProfile.Profile()
    p.enable()
    for _ in range(N):
        next(it).revoked()
    p.disable()
    pstats.Stats(p).sort_stats("tottime").print_stats(8)
