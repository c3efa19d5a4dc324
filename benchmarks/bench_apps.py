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
                       (throughput mode only: since issue 26 a block may end in either process, and is not profiled)
``BENCH_BLOCK``        block mode (``bench_skip.py``), instead of N: messages per block; ``BENCH_BLOCKS`` the blocks'
                       paths in queue order (``plain``, ``floor``, ``executed``, ``executed_child``, ``skip``,
                       ``preskip``), ``BENCH_HELD_ARG`` the skip's argument, ``BENCH_HELD_KEY`` its lock key (the
                       floor's refused acquire goes there)

The probe (throughput mode) is one ``task_postrun`` receiver, connected for every contender alike: it counts
finished tasks in a local int; at the 1st and at the N-th it reads the wall clock and the CPU time (utime+stime from
``/proc/<pid>/stat``) of this process and of the worker's main process (the process group leader: the same process
under ``-P solo``, the pool's parent under prefork), and at the N-th it writes them to ``BENCH_RECORD``. So the window
is exactly N-1 tasks, measured in the worker, with no I/O per task and without the worker's start-up.
"""

from __future__ import annotations

import cProfile
import itertools
import json
import os
import socket
import time
from typing import Any, ClassVar

import redis
from celery import Celery, signals
from celery.worker.request import Request

import celery_singleton_lock
from celery_singleton_lock import LockedRequest, LockedTask

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


class ChildOnlyRequest(LockedRequest):  # type: ignore[misc]
    """LockedRequest without the pre-check before the pool (issue 26): every duplicate is decided in the pool child."""

    def revoked(self) -> bool:
        return bool(Request.revoked(self))


@app.task(base=LockedTask, name="bench.locked_child", Request=f"{__name__}:ChildOnlyRequest")
def locked_child(i: int) -> None:
    """``bench.locked`` as it was before the pre-check: its duplicates are skipped in the pool child."""


if QueueOnce is not None and Singleton is not None:

    @app.task(base=QueueOnce, name="bench.once", once={"graceful": True})
    def once(i: int) -> None:
        """No-op, celery-once ``QueueOnce``."""

    @app.task(base=Singleton, name="bench.singleton")
    def singleton(i: int) -> None:
        """No-op, celery-singleton ``Singleton``."""


_floor: list[Any] = []  # per process (a pool child connects after the fork): the connection and the script's sha


@app.task(name="bench.floor")
def floor(i: int) -> None:
    """Plain ``celery.Task`` whose body does ONE refused acquire: ``_floors``' hash acquire (EVALSHA, low-level
    redis-py, a persistent connection) on the key ``BENCH_HELD_KEY`` another job holds, on the first lock node. The
    floor of a skipped duplicate: a no-op plus the one round trip a skip needs (``bench_skip.py``)."""
    if not _floor:
        import _floors  # noqa: PLC0415 - benchmarks/_floors.py, on the workers' PYTHONPATH

        port = int(LOCK_URLS[0].rsplit(":", 1)[1].split("/")[0])
        conn = _floors.connect(port)
        _floor.extend([conn, _floors.load([conn], _floors.HASH_ACQUIRE), os.environ["BENCH_HELD_KEY"]])
    conn, sha, key = _floor
    conn.send_command("EVALSHA", sha, 1, key, os.urandom(16).hex(), 60_000)
    if not isinstance(conn.read_response(), list):
        raise RuntimeError(f"{key} was not held by another job's record")


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
        self.sample: str | None = None  # the first such return value's repr (what the skip was)
        self.first: tuple[float, float] | None = None
        self.profiler: cProfile.Profile | None = None

    def __call__(self, retval: Any = None, **_: Any) -> None:
        self.count += 1
        if retval is not None:
            self.not_none += 1
            if self.sample is None:
                self.sample = repr(retval)[:300]
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
                "sample": self.sample,
                "pids": _worker_pids(),
                "package": celery_singleton_lock.__file__,  # which checkout the worker imported
            }
            record.set(f"bench:done:{RUN}", json.dumps(report))


@signals.worker_ready.connect
def _ready(**_: Any) -> None:
    """Tell the benchmark this worker consumes now (it runs with ``-l WARNING``: no "ready" line in its log)."""
    record.set(f"bench:ready:{RUN}:{os.getpgid(0)}", "1")


# -- the block probe (bench_skip.py) ----------------------------------------------------------------------------------

BLOCK = int(os.environ.get("BENCH_BLOCK", "0"))
BLOCKS = [b for b in os.environ.get("BENCH_BLOCKS", "").split(",") if b]
HELD_ARG = int(os.environ.get("BENCH_HELD_ARG", "-7"))


def _thread_cpu_ns(pid: int) -> int:
    """CPU time of every thread of ``pid`` in ns (``/proc/<pid>/task/*/schedstat``: exact, not clock ticks)."""
    total = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat", encoding="ascii") as f:
                total += int(f.read().split()[0])
        except (OSError, ValueError):  # a thread that just ended
            continue
    return total


def _children(pid: int) -> list[int]:
    """The pool children of the worker's main process ``pid``."""
    out: list[int] = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/children", encoding="ascii") as f:
                out += [int(x) for x in f.read().split()]
        except (OSError, ValueError):
            continue
    return out


class _GreenValue:
    """``multiprocessing.Value``'s interface for one process of greenlets."""

    def __init__(self) -> None:
        import threading  # noqa: PLC0415 - patched by the pool by now

        self.value = 0
        self._lock = threading.RLock()

    def get_lock(self) -> Any:
        return self._lock


class _BlockProbe:
    """One worker, a queue of blocks of ``BENCH_BLOCK`` messages, each block one path (``BENCH_BLOCKS`` says which:
    ``plain``, ``executed``, ``skip``, ...): at the end of every block, the CPU time of the pool children and of the
    main process (ns, every thread) and the wall clock; at the end of the last, the report. Each task is checked to
    belong to its block's path (the skip paths' argument is ``BENCH_HELD_ARG``, and a child's skip returns a marker).

    A task ends in the pool child (``task_postrun``) or, skipped before the pool (``preskip``), in the main process
    (``_preskip._skip``, wrapped): the count is shared by both (an int in memory the fork shares, under a lock made
    before the fork), and whichever process ends a block takes its mark (to Redis, once per block).
    """

    def __init__(self) -> None:
        import multiprocessing  # noqa: PLC0415 - block mode only

        if socket.socket.__module__ != "socket":
            # gevent/eventlet (one process): a multiprocessing lock is a real semaphore, which a greenlet holding it
            # across a (patched, yielding) Redis call would deadlock against the hub's skip; threading's is patched.
            self.shared: Any = _GreenValue()
        else:
            self.shared = multiprocessing.Value("q", 0)  # made at import, in the main process: the children share it
        self.leader = os.getpgid(0)
        self.wrong: list[str] = []
        self.profiler: cProfile.Profile | None = None

    def _mark(self, index: int) -> None:
        main = _thread_cpu_ns(self.leader)
        child = sum(_thread_cpu_ns(p) for p in _children(self.leader)) if os.getpid() == self.leader else 0
        if os.getpid() != self.leader:
            child = _thread_cpu_ns(os.getpid())
        record.rpush(f"bench:marks:{RUN}", json.dumps([index, time.perf_counter(), child, main]))

    def __call__(self, sender: Any = None, args: Any = None, retval: Any = None, main: bool = False, **_: Any) -> None:
        with self.shared.get_lock():
            count = self.shared.value = self.shared.value + 1
            index = (count - 1) // BLOCK
            expected = BLOCKS[index] if index < len(BLOCKS) else "?"
            if sender is not None and sender.name in ("bench.plain", "bench.floor"):
                path = sender.name.split(".")[1]
            elif sender is not None and sender.name == "bench.locked_child":
                path = "skip" if args and args[0] == HELD_ARG else "executed_child"
            else:
                path = "preskip" if args and args[0] == HELD_ARG else "executed"
            # A skip before the pool returns nothing; the first message of the held key in a worker is not checked
            # (the pre-check's gate: a key this worker has not seen), so its skip comes from the child, with a marker.
            skipped = path == "skip" or (path == "preskip" and (main or retval is not None))
            if skipped != (main or retval is not None) or path != expected:
                self.wrong.append(f"task {count} ({path}, block of {expected}) returned {retval!r}"[:300])
                record.rpush(f"bench:wrong:{RUN}", self.wrong[-1])
            if retval is not None:
                record.setnx(f"bench:sample:{RUN}", repr(retval)[:300])
            if count == 1 or not count % BLOCK:
                self._mark(index if count == 1 else index + 1)
            if count % BLOCK or (count // BLOCK) < len(BLOCKS):
                return
        marks = sorted(json.loads(m) for m in record.lrange(f"bench:marks:{RUN}", 0, -1))
        blocks = [
            {"path": BLOCKS[i], "seconds": b[1] - a[1], "child_ns": b[2] - a[2], "main_ns": b[3] - a[3]}
            for i, (a, b) in enumerate(itertools.pairwise(marks))
        ]
        wrong = [w.decode() for w in record.lrange(f"bench:wrong:{RUN}", 0, -1)]
        sample = record.get(f"bench:sample:{RUN}")
        report = {
            "block": BLOCK,
            "blocks": blocks,
            "wrong": wrong[:20],
            "wrong_count": len(wrong),
            "sample": sample.decode() if sample else None,
            "pids": [os.getpid(), self.leader],
            "package": celery_singleton_lock.__file__,  # which checkout the worker imported
        }
        record.set(f"bench:done:{RUN}", json.dumps(report))

    profilers: ClassVar[dict[str, cProfile.Profile]] = {}


if os.environ.get("BENCH_FORCE_PRESKIP") == "1":
    # bench_skip.py --force-preskip: the pre-check in a pool where the library keeps it off (gevent, eventlet,
    # threads), to measure what it would save there. Not a supported setting: the pool's own decision is overridden
    # once the worker is ready (pool_started ran), and the patched-socket guard is lifted.
    from celery_singleton_lock.task import _preskip

    @signals.worker_ready.connect(weak=False)
    def _force_preskip(**_: Any) -> None:
        _preskip._at_start = True
        _preskip._green = lambda: False


if BLOCK > 0:
    _block_probe = _BlockProbe()
    signals.task_postrun.connect(_block_probe, weak=False)
    from celery_singleton_lock.task import _preskip as _preskip_room

    _skip_before_pool = _preskip_room._skip

    def _counted_skip(request: Any, task: Any, *args: Any) -> None:
        """A skip before the pool, counted where it happens (solo/gevent skips in the pool are in this process too,
        and end in task_postrun)."""
        _skip_before_pool(request, task, *args)
        _block_probe(sender=task, args=(HELD_ARG,), retval=None, main=True)

    _preskip_room._skip = _counted_skip
elif N > 0:
    signals.task_postrun.connect(_Probe(), weak=False)
