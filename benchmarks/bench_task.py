"""End-to-end task benchmark: LockedTask against a plain Task, celery-once and celery-singleton, in real workers.

Throughput. One broker (a throwaway redis-server), one result backend (db 1 of it), lock nodes on three more
throwaway redis-servers, one app module (``benchmarks/bench_apps.py``) and one worker command line for everyone::

    celery -A bench_apps worker -P solo -Q <queue> -l WARNING --without-gossip --without-mingle --without-heartbeat

Contenders: a no-op task with one int argument, unique per call (no duplicates: this is the cost of the guard),

* ``plain Task``                 no lock
* ``LockedTask 1 node``          acquire in before_start + release in __call__: 2 round trips, in the worker
* ``LockedTask 3 nodes``         the same fanned out to 3 nodes at once (quorum 2)
* ``celery-once QueueOnce``      lock at apply_async (client), DEL in after_return (worker)
* ``celery-singleton Singleton`` lock at apply_async (client), DEL in on_success (worker)

For each (round, contender): N tasks are enqueued first, on a queue of their own, *then* a fresh worker process is
started on it, so the worker always has a backlog and never waits on the client. The worker measures itself (see
``bench_apps``): from the end of its 1st task to the end of its N-th, i.e. N-1 tasks, wall clock and CPU time
(utime+stime of the worker's processes from /proc), with no I/O per task; start-up and shutdown are outside the
window, and so is the client. Contenders are interleaved, the order rotating each round; the table shows medians
over rounds, and ratios are medians of per-round *paired* ratios (vs plain Task in the same round). CPU per task is
the steadiest figure on a shared machine: it does not count the time the worker waits for a CPU.

The client's CPU per ``apply_async`` is shown apart (celery-once and celery-singleton take their lock there), and
worker + client CPU together, as a ratio to plain Task's.

Duplicate storm. Two workers ``-P prefork -c 2`` on one lock node; once both are ready they are SIGSTOPped, 2000
copies of ONE job (same arguments; its body sleeps 0.2 s and records its run) are enqueued, and the workers are
SIGCONTinued: drain time runs from SIGCONT to the last stored outcome (``date_done`` of the last result), runs are
checked never to overlap, and the workers' total CPU (both process groups) is divided by the messages.

    python benchmarks/bench_task.py                                   # ~4 min: 5 rounds x 5 contenders + storm
    python benchmarks/bench_task.py --pools solo,prefork --rounds 3   # also prefork -c 1 (the pool's IPC counted)
    python benchmarks/bench_task.py --tasks 500 --rounds 1 --json /tmp/bench_task.json
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import itertools
import json
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from typing import Any

import _common  # benchmarks/_common.py: run as `python benchmarks/<script>.py`
import harness
import redis

from celery_singleton_lock.testing import redis_servers

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
POLL = 0.05


BASE = [
    ("plain Task", "plain", 1),
    ("LockedTask 1 node", "locked", 1),
    ("LockedTask 3 nodes", "locked", 3),
    ("celery-once QueueOnce", "once", 1),
    ("celery-singleton Singleton", "singleton", 1),
]


def contenders_for(pools: list[str]) -> list[harness.Contender]:
    """Every BASE contender on every pool, each compared with the plain Task on its pool."""

    def label(name: str, pool: str) -> str:
        return name if pool == "solo" else f"{name} (prefork -c 1)"

    return [
        harness.Contender(
            label(name, pool),
            lambda: None,  # a run is a whole worker: Bench.throughput_run
            refs={"plain": label(BASE[0][0], pool)},
            info={"task": task, "nodes": nodes, "pool": pool, "slug": f"{task}{nodes}-{pool}"},
        )
        for pool in pools
        for name, task, nodes in BASE
    ]


def load_apps(broker: str, lock_urls: list[str], **extra: str) -> tuple[Any, dict[str, str]]:
    """``bench_apps`` imported here (the client sends; celery-once and celery-singleton lock in apply_async) and the
    environment it read, for the workers too: broker (db 0), result backend (db 1), record (db 2) of one server."""
    base = broker.rsplit("/", 1)[0]
    env = {"BENCH_BROKER": broker, "BENCH_BACKEND": base + "/1", "BENCH_RECORD": base + "/2",
           "BENCH_LOCK_URLS": ",".join(lock_urls), **extra}  # fmt: skip
    os.environ.update({**env, "BENCH_N": "0"})
    sys.path.insert(0, HERE)
    return importlib.import_module("bench_apps"), env


# --- processes ------------------------------------------------------------------------------------------------------


def _group_pids(pgid: int) -> list[int]:
    """Every live process of process group ``pgid``."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", encoding="ascii") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid:  # field 5 of proc(5): pgrp
            pids.append(int(entry))
    return pids


def group_cpu(pgids: list[int]) -> float:
    total = 0.0
    for pgid in pgids:
        for pid in _group_pids(pgid):
            with contextlib.suppress(OSError):
                total += _common.stat_cpu_seconds(pid)
    return total


class Worker:
    """``celery worker`` on bench_apps in a session of its own (its pid is the process group id)."""

    def __init__(
        self,
        name: str,
        env: dict[str, str],
        queue: str,
        pool: str,
        concurrency: int,
        log: str,
        loglevel: str = "WARNING",
        events: bool = False,
    ) -> None:
        self.env = {**os.environ, **env}
        # A PYTHONPATH given to the benchmark comes before this checkout: the workers then import the package from
        # there (another checkout's, e.g. a `git worktree` of an older commit), as the benchmark itself does.
        self.env["PYTHONPATH"] = os.pathsep.join(filter(None, [HERE, self.env.get("PYTHONPATH", ""), ROOT]))
        self.argv = [
            sys.executable, "-m", "celery", "-A", "bench_apps", "worker",
            "-P", pool, "-c", str(concurrency), "-Q", queue, "-n", f"{name}@%h", "-l", loglevel,
            "--without-gossip", "--without-mingle", "--without-heartbeat",
        ]  # fmt: skip
        if events:
            self.argv.append("-E")  # task events, as Flower users run workers
        self.log_path = log
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> Worker:
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(
                self.argv, cwd=HERE, env=self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        return self

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def log_tail(self, chars: int = 3000) -> str:
        try:
            with open(self.log_path, encoding="utf-8", errors="replace") as f:
                return f.read()[-chars:]
        except OSError:
            return ""

    def signal(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, sig)

    def stop(self, timeout: float = 15.0) -> None:
        if self.process is None:
            return
        if self.alive():
            self.process.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(timeout)
        self.signal(signal.SIGKILL)  # and any pool child left behind
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(10)


def wait_for(check: Any, timeout: float, worker_list: list[Worker], what: str) -> Any:
    """Poll ``check()`` until it returns something truthy; bounded by ``timeout``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        for w in worker_list:
            if not w.alive():
                raise RuntimeError(f"worker exited while waiting for {what}:\n{w.log_tail()}")
        time.sleep(POLL)
    raise RuntimeError(f"timed out after {timeout:.0f} s waiting for {what}:\n{worker_list[0].log_tail()}")


# --- throughput -----------------------------------------------------------------------------------------------------


class Bench:
    def __init__(self, args: argparse.Namespace, broker: str, lock_urls: list[str], tmp: str) -> None:
        self.args = args
        self.broker = broker
        self.lock_urls = lock_urls
        self.tmp = tmp
        self.nonce = secrets.token_hex(4)
        store = "1" if args.store_results else "0"
        self.apps, self.base_env = load_apps(broker, lock_urls, BENCH_STORE_RESULTS=store)  # runs pick their nodes
        self.backend, self.record_url = self.base_env["BENCH_BACKEND"], self.base_env["BENCH_RECORD"]
        self.record = redis.Redis.from_url(self.record_url)
        self.broker_client = redis.Redis.from_url(broker)
        self.lock_clients = [redis.Redis.from_url(u) for u in lock_urls]
        self.serial = 0

    def close(self) -> None:
        for c in [self.record, self.broker_client, *self.lock_clients]:
            c.close()

    def reset(self) -> None:
        """Every run starts from empty servers (LockedTask keeps a fencing counter per key; peers keep nothing)."""
        for c in [self.broker_client, *self.lock_clients]:
            c.flushall()

    def warm_up_client(self) -> None:
        """First calls build connections, producers and caches: keep them out of the measured enqueues."""
        for name in ("plain", "locked", "once", "singleton"):
            task = getattr(self.apps, name, None)
            if task is None:  # a peer that is not installed (see bench_apps)
                continue
            for i in range(200):
                task.apply_async((-1 - i,), queue="bench.warmup")
        self.reset()

    def leftover_locks(self) -> list[bytes]:
        """Lock keys still held after a run: LockedTask's holder records (hashes) and the peers' lock strings.

        Fencing counters, the stats counters (``singleton_lock:stats...``: totals, per-minute buckets and their
        batch markers) and the done markers a successful LockedTask run leaves (``{key}:done:<task id>``, a few
        minutes) are meant to stay and do not count.
        """
        keys = []
        for c in self.lock_clients:
            for k in c.keys("*"):
                if k.endswith((b":fence", b"stats", b"fence")) or b":done:" in k or b"singleton_lock:stats" in k:
                    continue
                keys.append(k)
        return keys

    def throughput_run(self, contender: harness.Contender, rnd: int) -> harness.Sample:
        n = self.args.tasks
        self.serial += 1
        run = f"{self.nonce}-{contender['slug']}-{rnd}-{self.serial}"
        queue = f"bench.{run}"
        self.reset()
        task = getattr(self.apps, contender["task"])
        first = self.serial * 1_000_000
        t0, c0 = time.perf_counter(), time.process_time()
        for i in range(first, first + n):
            task.apply_async((i,), queue=queue)
        enqueue, client_cpu = time.perf_counter() - t0, time.process_time() - c0
        queued = self.broker_client.llen(queue)
        if queued != n:
            raise RuntimeError(f"{contender.name}: {queued} messages queued, expected {n}")
        env = {
            **self.base_env,
            "BENCH_LOCK_URLS": ",".join(self.lock_urls[: contender["nodes"]]),
            "BENCH_N": str(n),
            "BENCH_RUN": run,
        }
        if self.args.profile and contender["task"] == "locked" and contender["nodes"] == 1 and rnd == 0:
            env["BENCH_PROFILE"] = os.path.join(self.tmp, f"profile-{contender['slug']}.pstats")
            print(f"# profiling this run to {env['BENCH_PROFILE']}", file=sys.stderr)
        worker = Worker(f"bench-{run}", env, queue, contender["pool"], 1, os.path.join(self.tmp, f"{run}.log"))
        try:
            worker.start()
            raw = wait_for(
                lambda: self.record.get(f"bench:done:{run}"), 30 + n * 0.01, [worker], f"{contender.name} to drain"
            )
        finally:
            worker.stop()
        report = json.loads(raw)
        if report["not_none"]:
            raise RuntimeError(f"{contender.name}: {report['not_none']} tasks returned something (skipped?)")
        leftover = self.leftover_locks()
        if leftover:
            raise RuntimeError(f"{contender.name}: lock keys left behind: {leftover[:5]} ({len(leftover)})")
        tasks = report["tasks"]
        return harness.Sample(
            ops=tasks,
            seconds=report["seconds"],
            values={
                "tasks_per_s": tasks / report["seconds"],
                "cpu_us_per_task": report["cpu_seconds"] / tasks * 1e6,
                "enqueue_us_per_task": enqueue / n * 1e6,
                "client_cpu_us_per_task": client_cpu / n * 1e6,
            },
        )

    # --- duplicate storm --------------------------------------------------------------------------------------------

    def swarm(self, kind: str, rnd: int) -> harness.Sample:
        """``kind`` "storm": copies of ONE LockedTask job; "reference": as many distinct plain no-ops storing their
        result, through the very same set-up (what a message costs these workers when nothing is locked)."""
        copies, duration = self.args.storm_copies, self.args.storm_sleep
        self.serial += 1
        run = f"{self.nonce}-{kind}-{rnd}-{self.serial}"
        queue = f"bench.{run}"
        self.reset()
        env = {**self.base_env, "BENCH_LOCK_URLS": self.lock_urls[0], "BENCH_N": "0", "BENCH_RUN": run}
        workers = [
            Worker(f"{kind}{i}-{run}", env, queue, "prefork", 2, os.path.join(self.tmp, f"{run}-{i}.log"))
            for i in range(2)
        ]
        backend = redis.Redis.from_url(self.backend)
        try:
            for w in workers:
                w.start()
            for w in workers:
                wait_for(lambda w=w: self.record.get(f"bench:ready:{run}:{w.pid}"), 60, workers, f"{kind} workers")
            time.sleep(0.5)  # let the pools settle after "ready"
            pgids = [w.pid for w in workers]
            for w in workers:
                w.signal(signal.SIGSTOP)
            cpu_before = group_cpu(pgids)
            t0 = time.perf_counter()
            if kind == "storm":
                for _ in range(copies):
                    self.apps.storm.apply_async(("the-one-job", duration), queue=queue)
            else:
                for i in range(copies):
                    self.apps.plain_stored.apply_async((i,), queue=queue)
            enqueue = time.perf_counter() - t0
            started = time.time()
            for w in workers:
                w.signal(signal.SIGCONT)
            wait_for(lambda: backend.dbsize() >= copies, 60 + copies * 0.05, workers, f"the {kind} to drain")
            cpu = group_cpu(pgids) - cpu_before
            processes = sum(len(_group_pids(p)) for p in pgids)
        finally:
            for w in workers:
                w.signal(signal.SIGCONT)
                w.stop()
        metas = [json.loads(m) for m in backend.mget(backend.keys("celery-task-meta-*"))]
        backend.close()
        states: dict[str, int] = {}
        for m in metas:
            states[m["status"]] = states.get(m["status"], 0) + 1
        ends = [datetime.fromisoformat(m["date_done"]).timestamp() for m in metas]
        runs = sorted(json.loads(r) for r in self.record.lrange(f"bench:storm:{run}", 0, -1))
        overlaps = sum(1 for a, b in itertools.pairwise(runs) if b[0] < a[1])
        drain = max(ends) - started
        skipped = states.get("REVOKED", 0)
        return harness.Sample(ops=copies, seconds=drain, values={
            "kind": kind,
            "round": rnd,
            "copies": copies,
            "processes_measured": processes,
            "enqueue_seconds": enqueue,
            "drain_seconds": drain,
            "messages_per_s": copies / drain,
            "runs": len(runs),
            "overlapping_runs": overlaps,
            "states": states,
            "skipped": skipped,
            "lock_windows_fit": int(drain / duration) + 1,
            "worker_cpu_seconds": cpu,
            "cpu_us_per_message": cpu / copies * 1e6,
            "run_pids": sorted({r[2] for r in runs}),
        })  # fmt: skip

    def storms(self) -> dict[str, Any]:
        """The storm and its reference, interleaved over ``--storm-rounds``; medians."""
        results = harness.interleave(
            [harness.Contender(kind, self.swarm) for kind in ("storm", "reference")],
            self.args.storm_rounds,
            lambda c, rnd: c.op(c.name, rnd),
            on_sample=lambda s: print(f"# {s.contender} round {s.round + 1}: {json.dumps(s.values)}", file=sys.stderr),
        )
        storm = [s.values for s in results["storm"]]
        return {
            "copies": self.args.storm_copies,
            "body_seconds": self.args.storm_sleep,
            "workers": "2 x prefork -c 2",
            "rounds": self.args.storm_rounds,
            "drain_seconds": results.median("storm", "drain_seconds"),
            "runs": [s["runs"] for s in storm],
            "lock_windows_fit": [s["lock_windows_fit"] for s in storm],
            "overlapping_runs": sum(s["overlapping_runs"] for s in storm),
            "states": [s["states"] for s in storm],
            "cpu_us_per_message": results.median("storm", "cpu_us_per_message"),
            "skips_per_s": results.median("storm", lambda s: s["skipped"] / s["drain_seconds"]),
            "reference_cpu_us_per_message": results.median("reference", "cpu_us_per_message"),
            "reference_messages_per_s": results.median("reference", "messages_per_s"),
            "skip_cpu_ratio": results.paired("storm", "reference", "cpu_us_per_message"),
            "samples": {kind: [s.values for s in samples] for kind, samples in results.samples.items()},
        }


# --- report ---------------------------------------------------------------------------------------------------------


def table(results: harness.Results) -> tuple[str, list[dict[str, Any]]]:
    """Medians over rounds and ratios paired with plain Task on the same pool; the rows for the record too."""
    rows: list[dict[str, Any]] = []
    lines: list[list[str]] = []
    for c in results.contenders:
        if not results[c.name]:
            rows.append({"contender": c.name, "failures": results.failures[c.name]})
            lines.append([c.name, "failed", "", "", "", "", "", ""])
            continue
        plain = c.refs["plain"]
        low, high = results.spread(c.name, "tasks_per_s")
        row = {
            "contender": c.name,
            **{k: results.median(c.name, k) for k in ("tasks_per_s", "cpu_us_per_task", "enqueue_us_per_task",
                                                      "client_cpu_us_per_task")},
            "tasks_per_s_min": low,
            "tasks_per_s_max": high,
            "throughput_ratio": results.paired(c.name, plain, "tasks_per_s"),
            "cpu_ratio": results.paired(c.name, plain, "cpu_us_per_task"),
            "total_cpu_ratio": results.paired(
                c.name, plain, lambda s: s["cpu_us_per_task"] + s["client_cpu_us_per_task"]
            ),
            "failures": results.failures[c.name],
        }  # fmt: skip
        rows.append(row)
        lines.append([
            c.name, f"{row['tasks_per_s']:,.0f}", f"{row['throughput_ratio']:.2f}x",
            f"{low:,.0f}-{high:,.0f}", f"{row['cpu_us_per_task']:,.0f}", f"{row['cpu_ratio']:.2f}x",
            f"{row['client_cpu_us_per_task']:,.0f}", f"{row['total_cpu_ratio']:.2f}x",
        ])  # fmt: skip
    header = ["contender", "tasks/s", "vs plain", "min-max tasks/s", "worker CPU µs/task", "CPU vs plain",
              "client CPU µs/task (enqueue)", "worker+client CPU vs plain"]  # fmt: skip
    return harness.markdown(header, lines), rows


def storm_text(s: dict[str, Any]) -> str:
    parts = [
        f"Duplicate storm: {s['copies']} copies of ONE LockedTask job",
        f"(1 lock node, body sleeps {s['body_seconds']} s),",
        f"{s['workers']}, {s['rounds']} round(s).",
        f"Drain (SIGCONT to last outcome stored): {s['drain_seconds']:.2f} s median;",
        f"runs per round {s['runs']} (lock windows that fit in the drain: {s['lock_windows_fit']});",
        f"overlapping runs: {s['overlapping_runs']}; outcomes {s['states']}.",
        f"Worker CPU per message (all worker processes): {s['cpu_us_per_message']:,.0f} µs;",
        f"{s['skips_per_s']:,.0f} skips/s.",
        f"Reference, same set-up, {s['copies']} distinct plain no-op tasks storing their result:",
        f"{s['reference_cpu_us_per_message']:,.0f} µs CPU per message, {s['reference_messages_per_s']:,.0f} msg/s;",
        f"skip / plain CPU per message: {s['skip_cpu_ratio']:.2f}x (paired median).",
    ]
    return " ".join(parts)


def main(argv: list[str] | None = None) -> int:
    parser = harness.Cli(__doc__, quick={"tasks": 20, "rounds": 1, "no_storm": True})
    parser.add_argument("--tasks", type=int, default=2000, help="tasks per run (default 2000)")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds (default 5)")
    parser.add_argument("--pools", default="solo", help="comma-separated: solo, prefork (-c 1); default solo")
    parser.add_argument("--store-results", action="store_true", help="store results (default: task_ignore_result)")
    parser.add_argument("--storm-copies", type=int, default=2000, help="duplicate storm messages (default 2000)")
    parser.add_argument("--storm-sleep", type=float, default=0.2, help="the storm job's body, s (default 0.2)")
    parser.add_argument("--storm-rounds", type=int, default=2, help="storm + reference rounds (default 2)")
    parser.add_argument("--no-storm", action="store_true", help="skip the duplicate storm")
    parser.add_argument("--profile", action="store_true", help="cProfile LockedTask 1 node's worker in round 1")
    args = parser.parse(argv)
    pools = [p.strip() for p in args.pools.split(",") if p.strip()]
    if args.tasks < 10 or args.rounds < 1 or not set(pools) <= {"solo", "prefork"} or not pools:
        parser.error("--tasks >= 10, --rounds >= 1, --pools from solo,prefork")

    contenders = contenders_for(pools)
    env = harness.start("task benchmark", "celery", "kombu", "celery_once", "celery-singleton")
    storm: dict[str, Any] | None = None
    with tempfile.TemporaryDirectory(prefix="bench-task-") as tmp, redis_servers(4) as servers:
        bench = Bench(args, servers[0].url, [s.url for s in servers[1:]], tmp)
        for c in [c for c in contenders if not hasattr(bench.apps, c["task"])]:
            print(f"# {c.name}: not installed (pip install -e '.[bench]'), left out", file=sys.stderr)
            contenders.remove(c)
        try:
            bench.warm_up_client()

            def said(s: harness.Sample) -> None:
                print(
                    f"# round {s.round + 1}/{args.rounds} {s.contender}: {s['tasks_per_s']:,.0f} tasks/s, "
                    f"{s['cpu_us_per_task']:,.0f} µs CPU/task, enqueue {s['enqueue_us_per_task']:,.0f} µs/task "
                    f"({s['client_cpu_us_per_task']:,.0f} µs client CPU)",
                    file=sys.stderr,
                )

            results = harness.interleave(
                contenders, args.rounds, bench.throughput_run, catch=(RuntimeError,), on_sample=said
            )
            if not args.no_storm:
                storm = bench.storms()
            if args.profile:
                for name in os.listdir(tmp):
                    if name.endswith(".pstats"):
                        import pstats  # noqa: PLC0415 - only with --profile

                        pstats.Stats(os.path.join(tmp, name), stream=sys.stderr).sort_stats("cumulative").print_stats(
                            40
                        )
        finally:
            bench.close()

    text, rows = table(results)
    print(text)
    print(
        f"\n{args.tasks} no-op tasks per run, one fresh worker per run; medians over {args.rounds} interleaved "
        "rounds; ratios are medians of per-round paired ratios vs plain Task on the same pool; CPU = worker "
        "processes' utime+stime over the measured window"
    )
    if storm is not None:
        print("\n" + storm_text(storm))
    harness.save(args, env, results=rows, samples=results.record(), storm=storm)
    failed = any(results.failures.values()) or (storm is not None and storm["overlapping_runs"])
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
