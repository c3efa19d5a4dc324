"""Soak LockedTask on real workers under injected faults, then check what ran.

::

    .venv/bin/python tools/soak.py                      # 20,000 messages, 3 workers, the full fault schedule
    .venv/bin/python tools/soak.py --quick              # 2,000 messages, fewer faults: a smoke run (~1-2 min)
    .venv/bin/python tools/soak.py --messages 50000 --workers 4 --seed 7 --out /tmp/soak

What it starts (all on 127.0.0.1, on free ports, killed on exit): a broker redis-server, a result-backend
redis-server, a record redis-server (where the tasks write what they did; never faulted) and three lock nodes
(a 3-node Redlock, no persistence); then ``--workers`` real ``celery worker`` processes (prefork, concurrency 2,
``task_acks_late``, ``task_reject_on_worker_lost``, a ``--visibility``-second Redis visibility timeout swept every
second) running ``tools/soak_app.py``.

What it does: sends ``--messages`` messages at about ``--rate`` per second, in bursts: each burst is 1-6 copies of
one job (one of ``--keys`` keys, same arguments, different task ids) sent back to back, so the copies reach
different pool processes at about the same time. Bodies sleep a few ms to 200 ms; a few outlive several lock
renewals (``--long-fraction``) and a few retry once (the lock is handed over to the retry). Meanwhile a fault
thread injects, spread over the sending time: SIGKILLs of pool children (mostly of one that is running a body),
SIGKILLs of whole workers (each restarted a few seconds later), SIGSTOP/SIGCONT pauses of one lock node (shorter
than the lease; sometimes a child is killed during the pause), and one lock node SIGKILLed and restarted empty.
Then it waits (bounded) until the broker holds no message, queued or unacked, saves everything in ``--out`` and
checks (docs/reliability.md says what each check means and its limits):

* no two runs of one key overlapped (a killed run spans [start, the end of its guaranteed lease]);
* runs whose lock was lost while running are counted apart, and may overlap only if they noticed;
* every task id whose body completed has SUCCESS stored;
* no lost job: every task id's body completed, or it was REVOKED as a duplicate of a task id whose body completed
  (following holders that were skipped in turn); messages that no worker ever received and that a whole-worker
  SIGKILL lost in the broker transport are reported apart;
* no task id completed its body twice (unless its process was killed between the body's end and the done marker:
  reported apart, the inherent at-least-once window);
* every run without an end was killed; the queue drained; every message was sent.

``--reanalyse DIR`` runs the checks again on a saved run.

Exit status: 0 when every check passed, 1 when one failed, 2 on a harness error.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib
import itertools
import json
import os
import platform
import random
import re
import signal
import sys
import tempfile
import threading
import time
import traceback
from collections import Counter, defaultdict
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from types import ModuleType
from typing import Any

import redis

TOOLS = Path(__file__).resolve().parent
ROOT = TOOLS.parent
if str(ROOT) not in sys.path:  # run from a checkout: python tools/soak.py
    sys.path.insert(1, str(ROOT))

from celery_singleton_lock.testing import CeleryWorker, RedisServer  # noqa: E402

TERMINAL = ("SUCCESS", "REVOKED", "FAILURE")
HELD_BY = re.compile(r"held by task ([0-9a-f-]{36})")
RECEIVED = re.compile(r"Task soak_app\.job\[([0-9a-f-]{36})\] received")
# Worker log lines at ERROR that a SIGKILL of a pool child or of a lock node is expected to produce.
EXPECTED_ERRORS = (
    "WorkerLostError",
    "exited with 'signal 9 (SIGKILL)'",
    "exited with 'signal 15 (SIGTERM)'",
    "Process 'ForkPoolWorker",
)


# -- configuration ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Config:
    messages: int
    workers: int
    keys: int
    rate: float
    ttl: float
    visibility: float
    socket_timeout: float
    child_kills: int
    worker_kills: int
    node_pauses: int
    node_restarts: int
    node_down: float
    retry_fraction: float
    long_fraction: float
    drain_timeout: float
    timeout: float
    seed: int
    out: Path
    quick: bool
    reanalyse: Path | None


def parse_args(argv: list[str] | None) -> Config:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--quick", action="store_true", help="smoke run: 2,000 messages and fewer faults (defaults below)")
    p.add_argument("--messages", type=int, help="messages to send (default 20000; --quick 2000)")
    p.add_argument("--workers", type=int, default=3, help="celery worker processes, prefork concurrency 2 (3)")
    p.add_argument("--keys", type=int, help="distinct jobs (default 100; --quick 40)")
    p.add_argument("--rate", type=float, help="messages sent per second (default 90; --quick 60)")
    p.add_argument("--ttl", type=float, default=4.0, help="lock ttl, seconds (4)")
    p.add_argument("--visibility", type=float, default=20.0, help="broker visibility timeout, seconds (20)")
    p.add_argument("--socket-timeout", type=float, default=0.5, help="singleton_lock_socket_timeout (0.5)")
    p.add_argument("--child-kills", type=int, help="SIGKILLs of a pool child (default 24; --quick 4)")
    p.add_argument("--worker-kills", type=int, help="SIGKILLs of a whole worker, restarted after (6; --quick 1)")
    p.add_argument("--node-pauses", type=int, help="SIGSTOP/SIGCONT of one lock node (10; --quick 2)")
    p.add_argument("--node-restarts", type=int, help="lock node SIGKILLed and restarted empty (1; --quick 1)")
    p.add_argument("--node-down", type=float, default=0.5, help="seconds a killed lock node stays down (0.5)")
    p.add_argument("--retry-fraction", type=float, default=0.05, help="share of bursts whose job retries once")
    p.add_argument(
        "--long-fraction", type=float, default=0.005, help="share of bursts with a 1.5-2.5 x ttl body (renewals)"
    )
    p.add_argument("--drain-timeout", type=float, help="seconds to wait for the queue to drain (600; --quick 240)")
    p.add_argument("--timeout", type=float, help="hard cap on the whole run, seconds (2400; --quick 600)")
    p.add_argument("--seed", type=int, help="random seed (default: random, printed)")
    p.add_argument("--out", type=Path, help="directory for logs and report.json (default: a new temp dir)")
    p.add_argument("--reanalyse", type=Path, metavar="DIR", help="run the checks again on a saved run's --out DIR")
    a = p.parse_args(argv)
    q = a.quick

    def pick(value: Any, full: Any, quick: Any) -> Any:
        return value if value is not None else (quick if q else full)

    cfg = Config(
        messages=pick(a.messages, 20000, 2000),
        workers=a.workers,
        keys=pick(a.keys, 100, 40),
        rate=pick(a.rate, 90.0, 60.0),
        ttl=a.ttl,
        visibility=a.visibility,
        socket_timeout=a.socket_timeout,
        child_kills=pick(a.child_kills, 24, 4),
        worker_kills=pick(a.worker_kills, 6, 1),
        node_pauses=pick(a.node_pauses, 10, 2),
        node_restarts=pick(a.node_restarts, 1, 1),
        node_down=a.node_down,
        retry_fraction=a.retry_fraction,
        long_fraction=a.long_fraction,
        drain_timeout=pick(a.drain_timeout, 600.0, 240.0),
        timeout=pick(a.timeout, 2400.0, 600.0),
        seed=a.seed if a.seed is not None else random.SystemRandom().randrange(2**31),
        out=a.out or Path(tempfile.mkdtemp(prefix="csl-soak-")),
        quick=q,
        reanalyse=a.reanalyse,
    )
    if cfg.messages < 1 or cfg.workers < 1 or cfg.keys < 1 or cfg.rate <= 0:
        p.error("--messages, --workers, --keys and --rate must be positive")
    if cfg.visibility < 2 * cfg.ttl + 2:
        p.error("--visibility must be at least 2 x --ttl + 2 s: a re-sent copy waits up to a ttl, unacked")
    return cfg


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


# -- processes ----------------------------------------------------------------------------------------------------


def children_of(pid: int) -> list[int]:
    """Pids whose parent is ``pid`` (a prefork worker's pool processes), from /proc."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", encoding="ascii", errors="replace") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[-1].split()
        if len(fields) > 1 and fields[1] == str(pid):
            out.append(int(entry))
    return sorted(out)


class Workers:
    """The soak's worker processes; a killed worker is replaced by a fresh process with a fresh log file."""

    def __init__(self, cfg: Config, env: dict[str, str]) -> None:
        self.cfg, self.env = cfg, env
        self.current: dict[str, CeleryWorker] = {}
        self.all: list[CeleryWorker] = []
        self._incarnation: Counter[str] = Counter()
        self.mutex = threading.Lock()

    def start(self, name: str) -> CeleryWorker:
        n = self._incarnation[name]
        self._incarnation[name] += 1
        worker = CeleryWorker(
            "soak_app",
            name,
            cwd=str(TOOLS),
            log_path=str(self.cfg.out / f"{name}.{n}.log"),
            concurrency=2,
            env=self.env,
        )
        with self.mutex:
            self.all.append(worker)
        worker.start(timeout=90)
        with self.mutex:
            self.current[name] = worker
        return worker

    def live(self) -> list[CeleryWorker]:
        with self.mutex:
            return [w for w in self.current.values() if w.process is not None and w.process.poll() is None]

    def stop_all(self) -> None:
        threads = [threading.Thread(target=w.stop, kwargs={"timeout": 20}) for w in self.live()]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        for w in self.all:
            w.kill()

    def logs(self) -> str:
        return "".join(w.log() for w in self.all)


# -- faults -------------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Fault:
    kind: str  # child_kill, worker_kill, node_pause, node_restart
    at: float  # wall clock, when the signal was sent
    target: str
    pids: list[int] = dataclasses.field(default_factory=list)
    mid_body: str | None = None  # the task id whose body ran in the killed child (child_kill), if known
    seconds: float = 0.0  # pause length, time down, or time until the worker was back
    note: str = ""
    unacked: list[str] = dataclasses.field(default_factory=list)  # worker_kill: task ids unacked on the broker


class FaultThread(threading.Thread):
    """Injects the schedule's faults one after the other, ``gap`` seconds apart; stops early on ``stop``."""

    def __init__(
        self,
        cfg: Config,
        rng: random.Random,
        workers: Workers,
        locks: list[RedisServer],
        record: redis.Redis,
        broker: redis.Redis,
        span: float,
    ) -> None:
        super().__init__(name="faults", daemon=True)
        self.cfg, self.rng, self.workers, self.locks, self.record = cfg, rng, workers, locks, record
        self.broker = broker
        kinds = ["child_kill"] * cfg.child_kills + ["worker_kill"] * cfg.worker_kills + ["node_pause"] * cfg.node_pauses
        rng.shuffle(kinds)
        # Lock-node restarts go to the middle of the schedule, kept a ttl away from pauses (see node_restart): an
        # empty node plus a node that was paused while a run acquired is Redlock's known limit.
        for i in range(cfg.node_restarts):
            kinds.insert(len(kinds) * (i + 1) // (cfg.node_restarts + 1), "node_restart")
        self.kinds = kinds
        # Spread the faults over the sending time, less the time the faults themselves take.
        busy = (
            cfg.worker_kills * 6.0
            + cfg.node_pauses * 0.55 * cfg.ttl
            + cfg.node_restarts * (2 * cfg.ttl + 2.0 + cfg.node_down)
        )
        self.gap = max(1.0, (span - busy) / (len(kinds) + 1)) if kinds else 0.0
        self.faults: list[Fault] = []
        self.errors: list[str] = []
        self.stop_event = threading.Event()
        self._last_pause_end = 0.0

    def run(self) -> None:
        try:
            for kind in self.kinds:
                if self.stop_event.wait(self.gap):
                    return
                getattr(self, kind)()
        except Exception:
            self.errors.append(traceback.format_exc())
            log("fault thread failed:\n" + self.errors[-1])

    # A child is killed mid-body most of the time: the pids whose last 'started' record has no 'ends' record yet.
    def _busy_pids(self) -> dict[int, str]:
        started = [json.loads(x) for x in self.record.lrange("started", -300, -1)]
        ended = {(r[1], r[3]) for r in (json.loads(x) for x in self.record.lrange("ends", -600, -1))}
        return {r[2]: r[1] for r in started if (r[1], r[3]) not in ended}

    def child_kill(self, note: str = "") -> None:
        live = self.workers.live()
        if not live:
            self.errors.append("child_kill: no live worker")
            return
        candidates = {pid: w for w in live if w.process for pid in children_of(w.process.pid)}
        if not candidates:
            self.errors.append("child_kill: no pool child found")
            return
        busy = {pid: t for pid, t in self._busy_pids().items() if pid in candidates}
        pool = busy if busy and self.rng.random() < 0.8 else candidates
        pid = self.rng.choice(sorted(pool))
        fault = Fault("child_kill", time.time(), candidates[pid].name, [pid], busy.get(pid), note=note)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        self.faults.append(fault)
        log(
            f"fault: SIGKILL pool child {pid} of {fault.target}"
            + (f" mid-body of {fault.mid_body}" if busy.get(pid) else "")
        )

    def worker_kill(self) -> None:
        live = self.workers.live()
        if not live:
            self.errors.append("worker_kill: no live worker")
            return
        worker = self.rng.choice(live)
        assert worker.process is not None
        pids = [worker.process.pid, *children_of(worker.process.pid)]
        fault = Fault("worker_kill", time.time(), worker.name, pids)
        worker.kill()
        self.faults.append(fault)
        # What the broker will restore after the visibility timeout: every message the dead worker had taken.
        fault.unacked = sorted(unacked_ids(self.broker))
        down = self.rng.uniform(1.0, 4.0)
        log(f"fault: SIGKILL worker {worker.name} (pids {pids}); restarting in {down:.1f} s")
        time.sleep(down)
        self.workers.start(worker.name)
        fault.seconds = time.time() - fault.at
        log(f"fault: worker {worker.name} back after {fault.seconds:.1f} s")

    def node_pause(self) -> None:
        i = self.rng.randrange(len(self.locks))
        node = self.locks[i]
        seconds = self.rng.uniform(0.3, 0.8) * self.cfg.ttl  # shorter than the lease
        kill_during = self.rng.random() < 0.5 and self.cfg.child_kills > 0
        fault = Fault("node_pause", time.time(), f"lock{i}:{node.port}", seconds=seconds)
        node.pause()
        self.faults.append(fault)
        log(
            f"fault: SIGSTOP lock node {i} for {seconds:.2f} s" + (" (+ a child kill during it)" if kill_during else "")
        )
        if kill_during:
            time.sleep(seconds / 2)
            self.child_kill(note=f"during the pause of lock node {i}")
            time.sleep(max(0.0, fault.at + seconds - time.time()))
        else:
            time.sleep(seconds)
        node.resume()
        self._last_pause_end = time.time()

    def node_restart(self) -> None:
        # Keep the restart away from pauses: a run that acquired while a node was paused holds only two nodes, and
        # if one of them then comes back empty, a new run can take the lock (Redlock needs delayed restarts there).
        wait = self._last_pause_end + self.cfg.ttl + 1.0 - time.time()
        if wait > 0:
            time.sleep(wait)
        i = self.rng.randrange(len(self.locks))
        node = self.locks[i]
        fault = Fault("node_restart", time.time(), f"lock{i}:{node.port}")
        node.kill()
        self.faults.append(fault)
        time.sleep(self.cfg.node_down)
        node.start()
        fault.seconds = time.time() - fault.at
        log(f"fault: lock node {i} SIGKILLed and restarted empty after {fault.seconds:.2f} s")
        # Nothing else for a while: the next fault (a pause, say) must not meet runs that hold only two nodes.
        time.sleep(self.cfg.ttl + 1.0)


# -- sending ------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Sent:
    task_id: str
    key: str
    burst: int
    at: float


class Sender(threading.Thread):
    """Sends the messages in bursts of copies of one job, paced at ``rate`` messages per second."""

    def __init__(self, cfg: Config, rng: random.Random, task: Any, deadline: float) -> None:
        super().__init__(name="sender", daemon=True)
        self.cfg, self.rng, self.task, self.deadline = cfg, rng, task, deadline
        self.sent: list[Sent] = []
        self.bursts = 0
        self.error: str | None = None
        self.finished_at: float | None = None
        self.stop_event = threading.Event()

    def run(self) -> None:
        try:
            self._send()
        finally:
            self.finished_at = time.time()

    def _send(self) -> None:
        rng, cfg = self.rng, self.cfg
        t0 = time.monotonic()
        try:
            for burst in range(cfg.messages):  # at most one burst per message: bounded
                if len(self.sent) >= cfg.messages or self.stop_event.is_set() or time.monotonic() > self.deadline:
                    break
                key = f"k{rng.randrange(cfg.keys):04d}"
                copies = min(
                    rng.choices([1, 2, 3, 4, 6], weights=[30, 30, 20, 10, 10])[0], cfg.messages - len(self.sent)
                )
                u = rng.random()
                duration = (
                    rng.uniform(0.002, 0.02)
                    if u < 0.6
                    else rng.uniform(0.02, 0.1)
                    if u < 0.9
                    else rng.uniform(0.1, 0.2)
                )
                if rng.random() < cfg.long_fraction:  # outlives several renewals (every ttl/3)
                    duration = rng.uniform(1.5, 2.5) * cfg.ttl
                countdown = round(rng.uniform(0.1, 0.6), 3) if rng.random() < cfg.retry_fraction else 0.0
                args = (key, round(duration, 4), countdown)
                for _ in range(copies):
                    result = self.task.apply_async(args)
                    self.sent.append(Sent(result.id, key, burst, time.time()))
                self.bursts += 1
                ahead = t0 + len(self.sent) / cfg.rate - time.monotonic()
                if ahead > 0:
                    time.sleep(ahead)
        except Exception:
            self.error = traceback.format_exc()
            log("sender failed:\n" + self.error)


# -- reading back -------------------------------------------------------------------------------------------------


def read_list(client: redis.Redis, name: str) -> list[list[Any]]:
    out: list[list[Any]] = []
    total = int(client.llen(name))
    for start in range(0, total, 5000):
        out += [json.loads(x) for x in client.lrange(name, start, start + 4999)]
    return out


def read_states(backend: redis.Redis, ids: list[str]) -> dict[str, dict[str, Any] | None]:
    out: dict[str, dict[str, Any] | None] = {}
    for start in range(0, len(ids), 500):
        chunk = ids[start : start + 500]
        for task_id, meta in zip(chunk, backend.mget([f"celery-task-meta-{t}" for t in chunk]), strict=True):
            out[task_id] = json.loads(meta) if meta else None
    return out


def status(meta: dict[str, Any] | None) -> str:
    return str(meta["status"]) if meta else "PENDING"


# -- the checks ---------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Run:
    key: str
    task_id: str
    pid: int
    start: float
    lease_until: float | None
    fence: int | None
    retries: int
    end: float | None = None
    held: bool | None = None
    outcome: str | None = None  # "done", "retry", or None: no end recorded (killed)
    death: float | None = None  # when its process was SIGKILLed (a run with no end)
    lost: bool = False  # its lock was reported lost (lock_lost) while it ran, or it ended with lock_held() False
    renewed_until: float | None = None  # a long body: the lease guaranteed at its last progress record

    @property
    def guaranteed_end(self) -> float:
        """Until when no other run may have started: its end, or, killed, the end of its guaranteed lease."""
        if self.end is not None:
            return self.end
        return max(x for x in (self.lease_until, self.renewed_until, self.death, self.start) if x is not None)


def overlaps(runs: list[Run], end: Callable[[Run], float]) -> list[tuple[Run, Run]]:
    """Pairs (a, b) of runs of one key with a.start <= b.start < end(a)."""
    pairs = []
    ordered = sorted(runs, key=lambda r: r.start)
    for i, a in enumerate(ordered):
        for b in itertools.islice(ordered, i + 1, None):
            if b.start >= end(a):
                break
            pairs.append((a, b))
    return pairs


def analyse(
    ttl: float,
    sent: list[Sent],
    faults: list[Fault],
    lists: dict[str, list[list[Any]]],
    metas: dict[str, dict[str, Any] | None],
    received: set[str],
    progress: dict[str, list[float]],
) -> dict[str, Any]:
    """Every check and figure, from what was saved: sent messages, faults, the record lists, the result states."""
    started, ends, skips, waits = lists["started"], lists["ends"], lists["skips"], lists["waits"]
    lost, released, unavailable = lists["lost"], lists["released"], lists["unavailable"]
    ids = [s.task_id for s in sent]
    states = {t: status(metas.get(t)) for t in ids}

    # Runs: a 'started' record joined with its 'ends' record (same task id, same start).
    end_of = {(e[1], e[3]): e for e in ends}
    runs: list[Run] = []
    for s in started:
        r = Run(s[0], s[1], s[2], s[3], s[4], s[5], s[6])
        e = end_of.get((r.task_id, r.start))
        if e is not None:
            r.end, r.held, r.outcome = e[4], e[5], e[6]
        p = progress.get(f"{r.task_id}|{r.start!r}")
        if p is not None:
            r.renewed_until = p[1]
        runs.append(r)
    deaths: dict[int, float] = {}
    for f in faults:
        if f.kind in ("child_kill", "worker_kill"):
            for pid in f.pids:
                deaths.setdefault(pid, f.at)
    unexplained_unfinished = []
    for r in runs:
        if r.end is None:
            r.death = deaths.get(r.pid)
            if r.death is None or r.death < r.start:
                unexplained_unfinished.append(r)
    lost_by_task: dict[str, list[float]] = defaultdict(list)
    for row in lost:
        lost_by_task[row[1]].append(row[3])
    for r in runs:
        until = r.end if r.end is not None else (r.death or r.start)
        if r.held is False or any(r.start <= t <= until + 0.001 for t in lost_by_task.get(r.task_id, [])):
            r.lost = True

    by_key: dict[str, list[Run]] = defaultdict(list)
    for r in runs:
        by_key[r.key].append(r)
    strict = [p for rs in by_key.values() for p in overlaps(rs, lambda r: r.guaranteed_end)]
    strict_clean = [(a, b) for a, b in strict if not (a.lost or b.lost)]
    strict_lost = [(a, b) for a, b in strict if a.lost or b.lost]
    lost_unnoticed = [
        (a, b) for a, b in strict_lost if (a.lost and a.held is not False) or (b.lost and b.held is not False)
    ]

    # Informational: killed runs spanning [start, start + ttl] (the lease can end earlier: it starts at the acquire,
    # before the body) and [start, death + ttl] (the lease cannot outlive its last renewal by more than a ttl).
    def loose(r: Run) -> float:
        return r.end if r.end is not None else r.start + ttl

    def widest(r: Run) -> float:
        return r.end if r.end is not None else max(r.start, r.death or r.start) + ttl

    loose_pairs = [p for rs in by_key.values() for p in overlaps(rs, loose)]
    widest_pairs = [p for rs in by_key.values() for p in overlaps(rs, widest)]

    # Completed twice: a task id with two 'done' ends.
    done_runs: dict[str, list[Run]] = defaultdict(list)
    for r in runs:
        if r.outcome == "done":
            done_runs[r.task_id].append(r)
    released_at: dict[tuple[str, int], list[float]] = defaultdict(list)
    for row in released:
        released_at[(row[1], row[2])].append(row[3])

    def released_after(r: Run) -> bool:
        return any(t >= (r.end or r.start) for t in released_at.get((r.task_id, r.pid), []))

    twice_explained: list[str] = []
    twice_unexplained: list[str] = []
    for task_id, rs in done_runs.items():
        if len(rs) < 2:
            continue
        rs.sort(key=lambda r: r.start)
        first = rs[0]
        killed_in_window = not released_after(first) and first.pid in deaths and deaths[first.pid] >= (first.end or 0)
        (twice_explained if killed_in_window else twice_unexplained).append(task_id)

    # Lost jobs: every task id's final state, explained. A REVOKED duplicate's job is done when its holder's is: the
    # holder may itself have been skipped later (killed, then redelivered while a newer message held the lock), so
    # the chain of holders is followed to the run that completed the job.
    completed = set(done_runs)
    sent_at = {s.task_id: s.at for s in sent}
    worker_kills = [f for f in faults if f.kind == "worker_kill"]

    def holder_of(task_id: str) -> str | None:
        meta = metas.get(task_id)
        m = HELD_BY.search(json.dumps(meta.get("result") if meta else None))
        return m.group(1) if m else None

    def resolve(task_id: str) -> tuple[str | None, int, str]:
        """(the task id whose run completed this message's job, or None; holders followed; why not)."""
        hops: list[str] = []
        current = task_id
        for _ in range(50):  # bounded: a chain of holders is short
            st = states.get(current)
            if current in completed:  # its body completed: the job is done, whatever state was stored
                return current, len(hops), ""
            if st != "REVOKED":
                return None, len(hops), f"chain ends at {current}: {st}, no completed run"
            holder = holder_of(current)
            if holder is None or holder == current or holder in hops:
                return None, len(hops), f"{current} REVOKED with holder {holder}"
            if holder not in states:
                return None, len(hops), f"holder {holder} was never sent by the soak"
            hops.append(holder)
            current = holder
        return None, len(hops), "holder chain too long"

    accounting: Counter[str] = Counter()
    lost_jobs: list[tuple[str, str]] = []
    lost_in_transport: list[str] = []
    result_missing: list[str] = []
    notes: list[str] = []
    for task_id in ids:
        st = states[task_id]
        if st == "PENDING" and task_id not in received:
            # No worker's consumer ever logged it. The Redis transport hands a message over destructively (BRPOP):
            # a worker SIGKILLed between the server's pop and its own bookkeeping (the unacked hash, a second round
            # trip), or killed while its BRPOP was still registered on the server, loses the message for good.
            sent_time = sent_at[task_id]
            near = [f for f in worker_kills if sent_time - 2.0 <= f.at <= sent_time + 30.0 and task_id not in f.unacked]
            if near:
                kill = min(near, key=lambda f: abs(f.at - sent_at[task_id]))
                lost_in_transport.append(task_id)
                offset = sent_at[task_id] - kill.at
                notes.append(
                    f"{task_id}: never received by any worker; sent {abs(offset):.3f} s "
                    f"{'after' if offset >= 0 else 'before'} worker {kill.target} was SIGKILLed, and not in the "
                    "broker's unacked hash then: lost by the broker transport"
                )
            else:
                lost_jobs.append((task_id, "PENDING, never received by any worker, no worker kill near its send"))
            continue
        settled = st == "REVOKED" and "stored no result" in str((metas.get(task_id) or {}).get("result", ""))
        if settled and task_id in completed:
            # The run that finished was killed before storing SUCCESS; its redelivered copy stopped on the done
            # marker and stored REVOKED saying so (_delivery.settle_done): the caller was told, nobody waits.
            accounting["REVOKED: finished, its run killed before storing the result; the caller told so"] += 1
            continue
        if st != "SUCCESS" and task_id in completed:
            # The body completed and its SUCCESS was never stored (see docs/reliability.md, "Findings"): the state is
            # PENDING, or RETRY when an earlier delivery had retried.
            r = done_runs[task_id][-1]
            death = deaths.get(r.pid)
            if death is not None and death >= (r.end or r.start):
                why = (
                    f"its process was SIGKILLed {death - (r.end or r.start):.4f} s after the body returned, "
                    + ("after" if released_after(r) else "before")
                    + " lock_released was recorded, before the tracer stored SUCCESS"
                )
            else:
                why = "its process was not killed after the body"
            result_missing.append(task_id)
            notes.append(f"{task_id}: body completed in pid {r.pid}; {why}; final state {st}")
        done_by, hops, why = resolve(task_id)
        if done_by is None:
            lost_jobs.append((task_id, f"{st}: {why}"))
        elif hops == 0:
            accounting[f"{st}, its own body completed"] += 1
        elif hops == 1:
            accounting[f"{st}, duplicate of a task id whose body completed"] += 1
        else:
            accounting[f"{st}, duplicate of a holder that was itself skipped later; a later holder completed"] += 1
        if done_by is not None and hops and states.get(done_by) != "SUCCESS":
            accounting["(of those duplicates: the completing task id has no stored result)"] += 1

    # Figures.
    skip_kinds: Counter[str] = Counter()
    for row in skips:
        reason = str(row[3])
        if reason.startswith("duplicate of"):
            skip_kinds["duplicate (REVOKED)"] += 1
        elif reason.startswith("already succeeded"):
            skip_kinds["already succeeded"] += 1
        elif reason.startswith("re-sent"):
            skip_kinds["re-sent (" + reason.rsplit("(", 1)[-1].rstrip(")")] += 1
        else:
            skip_kinds[reason[:40]] += 1
    fence_regressions = 0
    for rs in by_key.values():
        fences = [r.fence for r in sorted(rs, key=lambda r: r.start) if r.fence is not None]
        fence_regressions += sum(1 for a, b in itertools.pairwise(fences) if b <= a)
    fault_counts: Counter[str] = Counter(f.kind for f in faults)
    killed_runs = [r for r in runs if r.end is None]
    killed_pids = {r.pid for r in killed_runs}
    mid_body = sum(1 for f in faults if f.kind == "child_kill" and f.pids[0] in killed_pids)
    # Kills that hit a process after its body returned and before it took the next message: between the body's end
    # and the end of the tracer's work (lock release + done marker, result store, ack).
    last_run_of_pid = {r.pid: r for r in sorted(runs, key=lambda r: r.start)}
    after_body = [
        r for r in last_run_of_pid.values() if r.end is not None and r.end <= deaths.get(r.pid, 0.0) <= r.end + 1.0
    ]

    def show(pairs: list[tuple[Run, Run]]) -> list[str]:
        return [
            f"{a.key}: {a.task_id} pid {a.pid} [{a.start:.3f}, {a.guaranteed_end:.3f}] end={a.end} "
            f"vs {b.task_id} pid {b.pid} start {b.start:.3f} ({b.start - a.start:.3f} s after)"
            for a, b in pairs[:10]
        ]

    checks = {
        "no overlapping runs of one key (strict bound)": (len(strict_clean), show(strict_clean)),
        "no overlap by a run whose lock was lost and that did not notice": (len(lost_unnoticed), show(lost_unnoticed)),
        "every completed job has a stored result (no caller waits forever)": (
            len(result_missing),
            result_missing[:20],
        ),
        "no lost job (once a worker received the message)": (
            len(lost_jobs),
            [f"{t}: {why}" for t, why in lost_jobs[:20]],
        ),
        "no task id completed twice (outside the kill-after-body window)": (
            len(twice_unexplained),
            twice_unexplained[:20],
        ),
        "every run without an end was killed": (
            len(unexplained_unfinished),
            [f"{r.key} {r.task_id} pid {r.pid} start {r.start:.3f}" for r in unexplained_unfinished[:20]],
        ),
    }
    return {
        "messages": len(sent),
        "distinct_task_ids": len(set(ids)),
        "keys_used": len({s.key for s in sent}),
        "runs_started": len(runs),
        "runs_completed": sum(1 for r in runs if r.outcome == "done"),
        "runs_retrying": sum(1 for r in runs if r.outcome == "retry"),
        "runs_abandoned_lock_lost": sum(1 for r in runs if r.outcome == "abandoned"),
        "runs_long": sum(1 for r in runs if r.renewed_until is not None),
        "runs_killed": len(killed_runs),
        "runs_killed_after_first_renewal": sum(
            1 for r in killed_runs if r.death is not None and r.death - r.start > ttl / 3
        ),
        "runs_lock_lost": sum(1 for r in runs if r.lost),
        "lock_lost_signals": len(lost),
        "skips": dict(skip_kinds),
        "skips_total": len(skips),
        "re_sends": dict(Counter(str(w[5]) for w in waits)),
        "re_sends_total": len(waits),
        "lock_unavailable": len(unavailable),
        "final_states": dict(Counter(states.values())),
        "accounting": dict(accounting),
        "completed_twice_in_kill_window": twice_explained,
        "lost_by_broker_transport": lost_in_transport,
        "faults": dict(fault_counts),
        "child_kills_mid_body": mid_body,
        "kills_within_1s_after_a_body_returned": len(after_body),
        "node_pause_seconds": round(sum(f.seconds for f in faults if f.kind == "node_pause"), 2),
        "overlaps_strict_lost_lock": len(strict_lost),
        "overlaps_loose_start_plus_ttl": len(loose_pairs),
        "overlaps_widest_death_plus_ttl": len(widest_pairs),
        "fence_regressions": fence_regressions,
        "notes": notes[:20],
        "checks": {name: {"failures": n, "examples": ex} for name, (n, ex) in checks.items()},
    }


def worker_errors(text: str) -> tuple[int, Counter[str]]:
    """ERROR/CRITICAL lines of the worker logs: (expected after kills, unexpected by first 100 chars)."""
    expected, unexpected = 0, Counter[str]()
    for line in text.splitlines():
        if "ERROR/" not in line and "CRITICAL/" not in line:
            continue
        if any(e in line for e in EXPECTED_ERRORS):
            expected += 1
        else:
            unexpected[re.sub(r"\[[0-9a-f-]{36}\]", "[<id>]", line.split("] ", 1)[-1])[:100]] += 1
    return expected, unexpected


# -- the run ------------------------------------------------------------------------------------------------------


def last_worker_event(record: redis.Redis) -> float | None:
    """Wall-clock time of the last thing a worker recorded (a run's end, a skip, a re-send), or None."""
    times = []
    for name, index in (("ends", 4), ("skips", 2), ("waits", 3), ("started", 3)):
        rows = [json.loads(x) for x in record.lrange(name, -200, -1)]
        times += [float(r[index]) for r in rows]
    return max(times, default=None)


def import_app(env: dict[str, str]) -> ModuleType:
    os.environ.update(env)
    if str(TOOLS) not in sys.path:
        sys.path.insert(0, str(TOOLS))
    sys.modules.pop("soak_app", None)
    return importlib.import_module("soak_app")


def unacked_ids(broker: redis.Redis) -> set[str]:
    """Task ids of the messages in the broker's unacked hash (delivered to a worker, not acked yet)."""
    out = set()
    for raw in broker.hvals("unacked"):
        with contextlib.suppress(ValueError, KeyError, TypeError, IndexError):
            out.add(str(json.loads(raw)[0]["headers"]["id"]))
    return out


def broker_load(broker: redis.Redis) -> tuple[int, int]:
    """(messages queued, messages delivered and not yet acked) on the broker."""
    pipe = broker.pipeline(transaction=False)
    pipe.llen("celery")
    pipe.hlen("unacked")
    queued, unacked = pipe.execute()
    return int(queued), int(unacked)


def wait_drained(
    cfg: Config, broker: redis.Redis, record: redis.Redis, backend: redis.Redis, ids: list[str], deadline: float
) -> tuple[bool, float]:
    """Wait until nothing is queued or unacked for 3 s in a row (or every state is final); (drained, when)."""
    quiet_since: float | None = None
    last_report = 0.0
    last_activity = time.time()
    last_counts: tuple[int, ...] = ()
    for _ in range(int(cfg.drain_timeout / 0.5) + 2):  # bounded by count and by deadline
        if time.monotonic() > deadline:
            break
        queued, unacked = broker_load(broker)
        counts = (queued, unacked, int(record.llen("started")), int(record.llen("skips")))
        if counts != last_counts:
            last_activity, last_counts = time.time(), counts
        if queued or unacked:
            quiet_since = None
        elif quiet_since is None:
            quiet_since = time.monotonic()
        elif time.monotonic() - quiet_since >= 3.0:
            return True, last_activity
        if time.monotonic() - last_report > 10:
            last_report = time.monotonic()
            states = Counter(status(m) for m in read_states(backend, ids).values())
            log(f"draining: {queued} queued, {unacked} unacked, states {dict(states)}")
        time.sleep(0.5)
    return False, last_activity


def run(cfg: Config) -> int:
    cfg.out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(cfg.seed)  # noqa: S311 - a reproducible schedule, not crypto
    log(f"soak: seed {cfg.seed}, output in {cfg.out}")
    hard_deadline = time.monotonic() + cfg.timeout
    with contextlib.ExitStack() as stack:
        servers = [stack.enter_context(RedisServer()) for _ in range(6)]
        broker_srv, backend_srv, record_srv, locks = servers[0], servers[1], servers[2], servers[3:]
        env = {
            "SOAK_BROKER": broker_srv.url,
            "SOAK_BACKEND": backend_srv.url,
            "SOAK_RECORD": record_srv.url,
            "SOAK_LOCK_URLS": ",".join(s.url for s in locks),
            "SOAK_TTL": str(cfg.ttl),
            "SOAK_VISIBILITY": str(cfg.visibility),
            "SOAK_SOCKET_TIMEOUT": str(cfg.socket_timeout),
        }
        broker = stack.enter_context(contextlib.closing(broker_srv.client(socket_timeout=10)))
        record = stack.enter_context(contextlib.closing(record_srv.client(socket_timeout=10)))
        backend = stack.enter_context(contextlib.closing(backend_srv.client(socket_timeout=10)))
        workers = Workers(cfg, env)
        stack.callback(workers.stop_all)
        for i in range(cfg.workers):
            workers.start(f"w{i + 1}")
        log(f"{cfg.workers} workers ready: {[w.process.pid for w in workers.live() if w.process]}")
        mod = import_app(env)
        stack.callback(mod.app.close)
        span = cfg.messages / cfg.rate
        sender = Sender(cfg, rng, mod.job, hard_deadline)
        fault_thread = FaultThread(cfg, random.Random(rng.random()), workers, locks, record, broker, span)  # noqa: S311
        t0 = time.time()
        sender.start()
        fault_thread.start()
        for _ in range(int(cfg.timeout / 10) + 2):  # bounded: one pass per 10 s at most
            if not sender.is_alive() and not fault_thread.is_alive():
                break
            if time.monotonic() > hard_deadline:
                sender.stop_event.set()
                fault_thread.stop_event.set()
                break
            (sender if sender.is_alive() else fault_thread).join(10)
            queued, unacked = broker_load(broker)
            log(
                f"sent {len(sender.sent)}/{cfg.messages}, queued {queued}, unacked {unacked}, "
                f"runs {record.llen('ends')}, skips {record.llen('skips')}, faults injected {len(fault_thread.faults)}"
            )
        fault_thread.join(120)
        sent_done = sender.finished_at or time.time()
        log(
            f"sending done: {len(sender.sent)} messages in {sent_done - t0:.1f} s; faults done after "
            f"{time.time() - t0:.1f} s; waiting for the queue to drain"
        )
        ids = [s.task_id for s in sender.sent]
        drain_deadline = min(hard_deadline, time.monotonic() + cfg.drain_timeout)
        drained, drained_at = wait_drained(cfg, broker, record, backend, ids, drain_deadline)
        last_event = last_worker_event(record)
        drain_time = (last_event or drained_at) - t0
        log(f"{'drained' if drained else 'NOT drained'} after {drain_time:.1f} s; stopping the workers")
        workers.stop_all()
        stats = {
            "date_utc": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "machine": f"{os.cpu_count()} cores, {platform.platform()}, Python {platform.python_version()}",
            "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in dataclasses.asdict(cfg).items()},
            "bursts": sender.bursts,
            "send_seconds": round(sent_done - t0, 1),
            "drained": drained,
            "drain_seconds": round(drain_time, 1),
            "left_on_broker": dict(zip(("queued", "unacked"), broker_load(broker), strict=True)),
            "harness_errors": [e for e in (sender.error,) if e] + fault_thread.errors,
        }
        save(cfg.out, stats, sender.sent, fault_thread.faults, record, backend)
    return report_from(cfg.out)


RECORD_LISTS = ("started", "ends", "skips", "waits", "lost", "released", "unavailable")


def save(
    out: Path, stats: dict[str, Any], sent: list[Sent], faults: list[Fault], record: redis.Redis, backend: redis.Redis
) -> None:
    """Everything the checks need, in ``out``: ``--reanalyse out`` runs the checks again from these files."""
    (out / "run.json").write_text(
        json.dumps({**stats, "fault_log": [dataclasses.asdict(f) for f in faults]}, indent=1, default=str)
    )
    with open(out / "sent.jsonl", "w", encoding="utf-8") as f:
        f.writelines(json.dumps(dataclasses.asdict(s)) + "\n" for s in sent)
    for name in RECORD_LISTS:
        with open(out / f"{name}.jsonl", "w", encoding="utf-8") as f:
            f.writelines(json.dumps(row) + "\n" for row in read_list(record, name))
    metas = read_states(backend, [s.task_id for s in sent])
    (out / "states.json").write_text(json.dumps(metas))
    progress = {k.decode(): json.loads(v) for k, v in record.hgetall("progress").items()}
    (out / "progress.json").write_text(json.dumps(progress))


def report_from(out: Path) -> int:
    """Run the checks on a saved run (``out``), print and save the report; the exit status."""
    stats = json.loads((out / "run.json").read_text())
    faults = [Fault(**f) for f in stats.pop("fault_log")]
    sent = [Sent(**json.loads(line)) for line in (out / "sent.jsonl").read_text().splitlines()]
    lists = {
        name: [json.loads(line) for line in (out / f"{name}.jsonl").read_text().splitlines()] for name in RECORD_LISTS
    }
    metas = json.loads((out / "states.json").read_text())
    progress_file = out / "progress.json"
    progress = json.loads(progress_file.read_text()) if progress_file.exists() else {}
    logs = "".join(p.read_text(errors="replace") for p in sorted(out.glob("w*.log")))
    report = analyse(float(stats["config"]["ttl"]), sent, faults, lists, metas, set(RECEIVED.findall(logs)), progress)
    expected_errors, unexpected_errors = worker_errors(logs)
    drain_time = stats["drain_seconds"]
    report.update(stats)
    report.update(
        {
            "throughput_messages_per_s": round(len(sent) / drain_time, 1) if drain_time > 0 else None,
            "throughput_runs_per_s": round(report["runs_completed"] / drain_time, 1) if drain_time > 0 else None,
            "fault_log": [dataclasses.asdict(f) for f in faults],
            "worker_log_errors_expected": expected_errors,
            "worker_log_errors_unexpected": dict(unexpected_errors.most_common(20)),
        }
    )
    left = stats["left_on_broker"]
    report["checks"]["the queue drained within the timeout"] = {
        "failures": 0 if stats["drained"] else 1,
        "examples": [] if stats["drained"] else [f"{left['queued']} queued, {left['unacked']} unacked"],
    }
    report["checks"]["every message was sent"] = {
        "failures": int(stats["config"]["messages"]) - len(sent),
        "examples": [],
    }
    (out / "report.json").write_text(json.dumps(report, indent=2, default=str))
    print_report(report)
    if stats["harness_errors"]:
        log("harness errors:\n" + "\n".join(stats["harness_errors"]))
        return 2
    return 1 if any(c["failures"] for c in report["checks"].values()) else 0


def print_report(r: dict[str, Any]) -> None:
    cfg = r["config"]
    lines = [
        "",
        f"soak report ({r['date_utc']}, {r['machine']}, seed {cfg['seed']})",
        f"  setup: {cfg['workers']} workers x prefork 2, 3 lock nodes, ttl {cfg['ttl']} s, visibility timeout "
        f"{cfg['visibility']} s, socket timeout {cfg['socket_timeout']} s",
        f"  messages: {r['messages']} in {r['bursts']} bursts over {r['keys_used']} keys, "
        f"sent in {r['send_seconds']} s",
        f"  drained: {r['drained']} after {r['drain_seconds']} s: {r['throughput_messages_per_s']} messages/s, "
        f"{r['throughput_runs_per_s']} completed runs/s; left on broker {r['left_on_broker']}",
        f"  runs: {r['runs_started']} started ({r['runs_long']} long, renewed), {r['runs_completed']} completed, "
        f"{r['runs_abandoned_lock_lost']} abandoned on a lost lock, {r['runs_retrying']} ended in "
        f"self.retry(), {r['runs_killed']} killed mid-body ({r['runs_killed_after_first_renewal']} after their first "
        f"renewal), {r['runs_lock_lost']} lost their lock ({r['lock_lost_signals']} lock_lost signals)",
        f"  skips: {r['skips_total']} {r['skips']}",
        f"  re-sends (lock_waiting): {r['re_sends_total']} {r['re_sends']}; lock_unavailable: {r['lock_unavailable']}",
        f"  faults: {r['faults']}, {r['child_kills_mid_body']} child kills hit a body, "
        f"{r['kills_within_1s_after_a_body_returned']} came within 1 s after a body returned, "
        f"{r['node_pause_seconds']} s of node pauses",
        f"  final states: {r['final_states']}",
        f"  accounted for: {r['accounting']}",
        f"  informational: overlaps with a killed run spanning [start, start + ttl]: "
        f"{r['overlaps_loose_start_plus_ttl']}; [start, death + ttl]: {r['overlaps_widest_death_plus_ttl']}; "
        f"strict overlaps involving a lost lock: {r['overlaps_strict_lost_lock']}; fencing-token regressions per key: "
        f"{r['fence_regressions']}; completed twice in the kill window: {len(r['completed_twice_in_kill_window'])}",
        f"  worker log ERROR lines: {r['worker_log_errors_expected']} expected after kills, unexpected: "
        f"{r['worker_log_errors_unexpected'] or 'none'}",
    ]
    lines.append(
        f"  lost by the broker transport (never reached a worker; see docs/reliability.md): "
        f"{len(r['lost_by_broker_transport'])}"
    )
    lines += [f"  note: {n}" for n in r["notes"]]
    lines.append("checks:")
    for name, c in r["checks"].items():
        lines.append(f"  [{'PASS' if not c['failures'] else 'FAIL'}] {name}: {c['failures']}")
        lines += [f"      {e}" for e in c["examples"]]
    lines.append(f"report: {cfg['out']}/report.json")
    print("\n".join(lines), flush=True)


def main(argv: list[str] | None = None) -> int:
    cfg = parse_args(argv)
    try:
        if cfg.reanalyse is not None:
            return report_from(cfg.reanalyse)
        return run(cfg)
    except KeyboardInterrupt:
        log("interrupted")
        return 2
    except Exception:
        log("harness error:\n" + traceback.format_exc())
        return 2


if __name__ == "__main__":
    sys.exit(main())
