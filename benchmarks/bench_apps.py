"""The Celery app that ``bench_task.py`` runs in real worker processes (one module, one config, every contender).

Configured from the environment (the benchmark writes it):

``BENCH_BROKER``       broker URL (a throwaway redis-server)
``BENCH_BACKEND``      result backend URL
``BENCH_LOCK_URLS``    comma-separated lock nodes: LockedTask uses all of them, celery-once and celery-singleton
                       the first one
``BENCH_RECORD``       a Redis URL where the worker reports its measurements
``BENCH_N``            throughput mode: the number of tasks this worker will run (0: no probe)
``BENCH_RUN``          a label the report is stored under (``bench:done:<run>``)
``BENCH_PROFILE``      optional path: cProfile the worker between its 1st and N-th task and dump the stats there

The probe (throughput mode) is one ``task_postrun`` receiver, connected for every contender alike: it counts
finished tasks in a local int; at the 1st and at the N-th it reads the wall clock and the CPU time (utime+stime from
``/proc/<pid>/stat``) of this process and of the worker's main process (the process group leader: the same process
under ``-P solo``, the pool's parent under prefork), and at the N-th it writes them to ``BENCH_RECORD``. So the window
is exactly N-1 tasks, measured in the worker, with no I/O per task and without the worker's start-up.
"""

from __future__ import annotations

import cProfile
import json
import os
import time
from typing import Any

import redis
from celery import Celery, signals

from celery_singleton_lock import LockedTask

try:  # the peers are only needed by bench_task.py (the `bench` extra); profile_task.py runs without them
    from celery_once import QueueOnce
    from celery_singleton import Singleton
except ImportError:  # pragma: no cover - depends on the extras installed
    QueueOnce = Singleton = None

LOCK_URLS = os.environ["BENCH_LOCK_URLS"].split(",")
N = int(os.environ.get("BENCH_N", "0"))
RUN = os.environ.get("BENCH_RUN", "run")
PROFILE = os.environ.get("BENCH_PROFILE", "")

app = Celery("bench_apps", broker=os.environ["BENCH_BROKER"], backend=os.environ["BENCH_BACKEND"])
app.conf.update(
    # celery_singleton_lock: every node given; all other singleton_lock_* settings at their defaults (ttl 60 s)
    singleton_lock_urls=LOCK_URLS,
    # celery-once: its Redis backend on the first lock node (it locks in apply_async, unlocks in after_return)
    ONCE={"backend": "celery_once.backends.Redis", "settings": {"url": LOCK_URLS[0], "default_timeout": 3600}},
    # celery-singleton: on the first lock node (it locks in apply_async, unlocks in on_success/on_failure)
    singleton_backend_url=LOCK_URLS[0],
    task_ignore_result=os.environ.get("BENCH_STORE_RESULTS") != "1",
    broker_connection_retry_on_startup=True,
    worker_hijack_root_logger=True,
)
record = redis.Redis.from_url(os.environ["BENCH_RECORD"])


@app.task(name="bench.plain")
def plain(i: int) -> None:
    """No-op, plain ``celery.Task``."""


@app.task(base=LockedTask, name="bench.locked")
def locked(i: int) -> None:
    """No-op, LockedTask (the lock key hashes ``i``: every call is a distinct job)."""


if QueueOnce is not None and Singleton is not None:

    @app.task(base=QueueOnce, name="bench.once", once={"graceful": True})
    def once(i: int) -> None:
        """No-op, celery-once ``QueueOnce``."""

    @app.task(base=Singleton, name="bench.singleton")
    def singleton(i: int) -> None:
        """No-op, celery-singleton ``Singleton``."""


@app.task(name="bench.plain_stored", ignore_result=False)
def plain_stored(i: int) -> None:
    """No-op, plain ``celery.Task``, result stored: the storm's reference (a skip stores REVOKED)."""


@app.task(base=LockedTask, bind=True, name="bench.storm", ignore_result=False)
def storm(self: Any, job: str, duration: float) -> None:
    """The storm's one job: sleep ``duration`` s and record the run (start, end, pid, task id)."""
    start = time.time()
    time.sleep(duration)
    record.rpush(f"bench:storm:{RUN}", json.dumps([start, time.time(), os.getpid(), self.request.id]))


# -- the probe -------------------------------------------------------------------------------------------------------

_TICK = os.sysconf("SC_CLK_TCK")


def _cpu_seconds(pid: int) -> float:
    """utime + stime of every thread of ``pid``, in seconds."""
    with open(f"/proc/{pid}/stat", encoding="ascii") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICK  # fields 14 and 15 of proc(5), after pid and comm


def _worker_pids() -> list[int]:
    leader = os.getpgid(0)  # the benchmark starts each worker in a session of its own
    return sorted({os.getpid(), leader})


class _Probe:
    def __init__(self) -> None:
        self.count = 0
        self.not_none = 0  # a return value other than None: a LockedTask Skipped marker, i.e. not a real run
        self.first: tuple[float, float] | None = None
        self.profiler: cProfile.Profile | None = None

    def __call__(self, retval: Any = None, **_: Any) -> None:
        self.count += 1
        if retval is not None:
            self.not_none += 1
        if self.count == 1:
            cpu = sum(_cpu_seconds(p) for p in _worker_pids())
            self.first = (time.perf_counter(), cpu)
            if PROFILE:
                self.profiler = cProfile.Profile()
                self.profiler.enable()
        elif self.count == N:
            end = time.perf_counter()
            if self.profiler is not None:
                self.profiler.disable()
                self.profiler.dump_stats(PROFILE)
            cpu = sum(_cpu_seconds(p) for p in _worker_pids())
            assert self.first is not None
            report = {
                "tasks": N - 1,
                "seconds": end - self.first[0],
                "cpu_seconds": cpu - self.first[1],
                "not_none": self.not_none,
                "pids": _worker_pids(),
            }
            record.set(f"bench:done:{RUN}", json.dumps(report))


@signals.worker_ready.connect
def _ready(**_: Any) -> None:
    """Tell the benchmark this worker consumes now (it runs with ``-l WARNING``: no "ready" line in its log)."""
    record.set(f"bench:ready:{RUN}:{os.getpgid(0)}", "1")


if N > 0:
    signals.task_postrun.connect(_Probe(), weak=False)
