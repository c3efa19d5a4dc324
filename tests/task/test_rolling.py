"""A rolling upgrade: workers of the old version (commit fd86d2e, the last before the package moved into wings) and of
this checkout side by side on one broker and the same Redis lock node, running the same tasks
(tests/apps/rolling_app.py, public API only).

One throwaway redis-server is the broker (db 0), the result backend (db 1), the run records (db 2) and the lock node.
The OLD worker consumes queue ``old`` with fd86d2e's package first on its PYTHONPATH (``git archive`` into a temporary
directory); the NEW worker consumes queue ``new`` with this checkout's. Each side proves which package it imported.
Every wait is bounded; no timing assertions (figures measured are printed, and stated in docs/migration.md).
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import redis
from celery import Celery
from celery.bin.base import CLIContext
from click.testing import CliRunner
from worker_cluster import AppImport, polling

from celery_singleton_lock.ops.cli import locks
from celery_singleton_lock.testing import CeleryWorker, RedisServer, redis_servers

pytestmark = pytest.mark.slow
OLD_COMMIT = "fd86d2e"
ROOT = Path(__file__).resolve().parents[2]
APPS = ROOT / "tests" / "apps"
TTL = 2.0


class Sides:
    """The server, both workers and the client's app module (this checkout's package)."""

    def __init__(self, server: RedisServer, old_root: Path, tmp: Path) -> None:
        self.server, self.old_root = server, old_root
        self.env = {"CSL_BROKER": server.url, "CSL_LOCK_URLS": server.url, "CSL_TTL": str(TTL)}
        self.record = redis.Redis.from_url(server.url.rsplit("/", 1)[0] + "/2")
        self.lock = redis.Redis.from_url(server.url)
        self.workers: list[CeleryWorker] = []
        self.tmp = tmp
        self._app = AppImport("rolling_app")

    def start(self, side: str, root: Path, **extra: str) -> CeleryWorker:
        env = {**self.env, "CSL_SIDE": side, "PYTHONPATH": f"{root}{os.pathsep}{APPS}", **extra}
        worker = CeleryWorker(
            "rolling_app",
            side,
            cwd=str(APPS),
            log_path=str(self.tmp / f"{side}.log"),
            concurrency=3,
            env=env,
            extra=["-Q", side],
        )
        self.workers.append(worker)
        return worker.start()

    def client(self) -> ModuleType:
        return self._app.load({**self.env, "CSL_SIDE": "client"})

    def close(self) -> None:
        for w in self.workers:
            w.kill()
        self.record.close()
        self.lock.close()
        self._app.close()

    # -- records -------------------------------------------------------------------------------------------------

    def runs(self, name: str, key: str) -> list[list[Any]]:
        """[task, key, task_id, side, start, end, extra] of the finished runs of ``key``."""
        return [r for r in map(json.loads, self.record.lrange("rolling:runs", 0, -1)) if r[:2] == [name, key]]

    def started(self, name: str, key: str) -> list[list[Any]]:
        return [r for r in map(json.loads, self.record.lrange("rolling:started", 0, -1)) if r[:2] == [name, key]]

    def wait_runs(self, name: str, key: str, count: int, timeout: float = 15.0) -> list[list[Any]]:
        for _ in polling(timeout, 0.05):
            if len(self.runs(name, key)) >= count:
                break
        return self.runs(name, key)

    def wait_started(self, name: str, key: str, count: int = 1, timeout: float = 15.0) -> list[list[Any]]:
        for _ in polling(timeout, 0.02):
            if len(self.started(name, key)) >= count:
                break
        started = self.started(name, key)
        assert len(started) >= count, f"{name}({key}) did not start {count} time(s) within {timeout} s"
        return started


def has_commit(root: Path, commit: str) -> bool:
    if not (root / ".git").exists():
        return False
    probe = subprocess.run(
        ["git", "-C", str(root), "cat-file", "-e", f"{commit}^{{commit}}"], capture_output=True, check=False
    )
    return probe.returncode == 0


@pytest.fixture(scope="module")
def sides(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Sides]:
    if not has_commit(ROOT, OLD_COMMIT):
        pytest.skip(
            f"no git history with commit {OLD_COMMIT} (a shallow clone?): the old version cannot be checked out"
        )
    old_root = tmp_path_factory.mktemp("rolling-old")
    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", OLD_COMMIT, "celery_singleton_lock"], capture_output=True, check=True
    )
    subprocess.run(["tar", "-x", "-C", str(old_root)], input=archive.stdout, check=True)
    with redis_servers(1) as servers:
        s = Sides(servers[0], old_root, tmp_path_factory.mktemp("rolling-logs"))
        try:
            with ThreadPoolExecutor(3) as pool:  # the three start side by side (each waits for its "ready" line)
                started = [
                    pool.submit(s.start, "old", old_root),
                    pool.submit(s.start, "new", ROOT),
                    # a new worker set for the upgrade: singleton_lock_hand_on=False
                    pool.submit(s.start, "compat", ROOT, CSL_HAND_ON="0"),
                ]
                for f in started:
                    f.result()
            s.client()
            yield s
        finally:
            s.close()


def key() -> str:
    return f"k-{uuid.uuid4().hex[:10]}"


def overlapping(runs: list[list[Any]]) -> list[tuple[str, str]]:
    spans = sorted((r[4], r[5], r[2]) for r in runs)
    return [(a[2], b[2]) for a, b in itertools.pairwise(spans) if b[0] < a[1]]


def most_at_once(runs: list[list[Any]]) -> int:
    """The largest number of runs whose [start, end] intervals overlap at one instant."""
    events = sorted([(r[4], 1) for r in runs] + [(r[5], -1) for r in runs], key=lambda e: (e[0], e[1]))
    now = best = 0
    for _, step in events:
        now += step
        best = max(best, now)
    return best


OTHER = {"old": "new", "new": "old"}


def test_each_worker_runs_its_own_version(sides: Sides) -> None:
    """The old worker imported fd86d2e's package from the temporary checkout, the new one this checkout's."""
    mod = sides.client()
    old_file, old_side = mod.where.apply_async(queue="old").get(timeout=15)
    new_file, new_side = mod.where.apply_async(queue="new").get(timeout=15)
    assert (old_side, new_side) == ("old", "new")
    assert Path(old_file).resolve() == (sides.old_root / "celery_singleton_lock" / "__init__.py").resolve()
    assert Path(new_file).resolve() == (ROOT / "celery_singleton_lock" / "__init__.py").resolve()
    assert not (sides.old_root / "celery_singleton_lock" / "lock").exists()  # really the layout before the wings


@pytest.mark.parametrize("first", ["old", "new"])
def test_skip_across_versions(sides: Sides, first: str) -> None:
    """One side holds the key; the other side's duplicate is skipped (REVOKED), never run beside it."""
    mod = sides.client()
    k = key()
    holder = mod.hold.apply_async((k, 2.0), queue=first)
    sides.wait_started("hold", k)
    dup = mod.hold.apply_async((k, 0.0), queue=OTHER[first])
    for _ in polling(10, 0.05):
        if dup.state != "PENDING":
            break
    assert dup.state == "REVOKED", dup.state
    assert holder.get(timeout=15) == first
    runs = sides.wait_runs("hold", k, 1)
    assert [r[2] for r in runs] == [holder.id]


@pytest.mark.parametrize("first", ["old", "new"])
def test_reschedule_across_versions(sides: Sides, first: str) -> None:
    """The other side's duplicate waits in the key's line and runs after the holder, never beside it."""
    mod = sides.client()
    k = key()
    holder = mod.later.apply_async((k, 1.5), queue=first)
    sides.wait_started("later", k)
    dup = mod.later.apply_async((k, 0.0), queue=OTHER[first])
    assert holder.get(timeout=15) == first
    assert dup.get(timeout=20) == OTHER[first]
    runs = sides.wait_runs("later", k, 2)
    assert [r[2] for r in sorted(runs, key=lambda r: r[4])] == [holder.id, dup.id]
    assert not overlapping(runs)


def test_lock_limit_two_is_shared_across_versions(sides: Sides) -> None:
    """lock_limit=2: one slot taken by the old worker, one by the new; six more calls split across both sides are
    refused while both run: never three runs at once across the versions."""
    mod = sides.client()
    k = key()
    holders = [mod.limited.apply_async((k, 0, 2.0), queue="old")]
    sides.wait_started("limited", k, 1)
    holders.append(mod.limited.apply_async((k, 1, 2.0), queue="new"))
    sides.wait_started("limited", k, 2)
    extras = [mod.limited.apply_async((k, i, 0.1), queue=("old", "new")[i % 2]) for i in range(2, 8)]
    for _ in polling(20, 0.1):
        if all(c.state != "PENDING" for c in extras):
            break
    states = [c.state for c in extras]
    assert [h.get(timeout=15) for h in holders] == ["old", "new"]
    runs = sides.wait_runs("limited", k, 2 + states.count("SUCCESS"), 5)
    assert most_at_once(runs) <= 2, runs
    assert states.count("REVOKED") >= 1, states


def test_lock_rate_window_is_shared_across_versions(sides: Sides) -> None:
    """lock_rate=(3, 4.0): eight calls split across both sides; no 4 s window ever holds more than three starts."""
    mod = sides.client()
    k = key()
    calls = [mod.rated.apply_async((k, i), queue=("old", "new")[i % 2]) for i in range(8)]
    runs = sides.wait_runs("rated", k, 4, 12)
    for c in calls:
        c.forget()
    starts = sorted(r[4] for r in runs)
    assert len(starts) >= 4, runs
    for i, t in enumerate(starts):
        in_window = [s for s in starts[i:] if s < t + 4.0 - 0.05]  # 50 ms of clock slack between processes
        assert len(in_window) <= 3, (starts, runs)
    assert {r[3] for r in runs} == {"old", "new"}, runs


def test_debounce_burst_from_both_versions_runs_once_with_the_newest_args(sides: Sides) -> None:
    """A burst sent alternately by the old code (relayed through the old worker) and the new code runs once, 1 s
    after its last call, with the last call's arguments."""
    mod = sides.client()
    k = key()
    last = 0
    for i in range(1, 7):
        if i % 2:
            mod.relay.apply_async(("rolling_app.settle", [k, i], {"queue": "new"}), queue="old").get(timeout=10)
        else:
            mod.settle.apply_async((k, i), queue="old")
        last = i
    runs = sides.wait_runs("settle", k, 1, 10)
    time.sleep(1.5)
    runs = sides.runs("settle", k)
    assert len(runs) == 1, runs
    assert runs[0][6] == last, runs


def test_queue_scope_reservation_is_shared_across_versions(sides: Sides) -> None:
    """lock_scope="queue": a job reserved at send by one version is the job a duplicate send by the other version
    gets (same task id, nothing published), in both directions; each job runs once."""
    mod = sides.client()
    k1, k2 = key(), key()
    first = mod.queued.apply_async((k1, 0.3), queue="old", countdown=1)  # new code reserves
    relayed = mod.relay.apply_async(("rolling_app.queued", [k1, 0.3], {"queue": "new"}), queue="old")
    assert relayed.get(timeout=10) == first.id  # old code's duplicate send got the new code's job
    old_first = mod.relay.apply_async(("rolling_app.queued", [k2, 0.3], {"queue": "new", "countdown": 1}), queue="old")
    old_id = old_first.get(timeout=10)
    assert mod.queued.apply_async((k2, 0.3), queue="old").id == old_id  # new code's duplicate got the old job
    assert len(sides.wait_runs("queued", k1, 1)) == 1
    assert len(sides.wait_runs("queued", k2, 1)) == 1
    time.sleep(0.5)
    assert [r[2] for r in sides.runs("queued", k1)] == [first.id]
    assert [r[2] for r in sides.runs("queued", k2)] == [old_id]


def test_cli_lists_a_lock_the_old_worker_holds(sides: Sides) -> None:
    """The new CLI (`locks list --json`) reads a lock taken by the old worker: its task id, name and worker."""
    mod = sides.client()
    k = key()
    holder = mod.hold.apply_async((k, 2.0), queue="old")
    sides.wait_started("hold", k)
    app = Celery("rolling_cli", broker="memory://", set_as_current=False)
    app.conf.update(singleton_lock_urls=[sides.server.url], singleton_lock_prefix="rolling:")
    result = CliRunner().invoke(locks, ["list", "--json"], obj=CLIContext(app=app, no_color=True, workdir=None))
    assert result.exit_code == 0, result.output
    entries = [e for e in json.loads(result.stdout) if holder.id in json.dumps(e)]
    assert len(entries) == 1, result.stdout
    print("CLI entry of the old worker's lock:", entries[0])
    entry = entries[0]
    assert (entry["key"], entry["task_id"], entry["state"]) == (mod.hold.lock_key_for(k, 0.0), holder.id, "running")
    assert entry["record"]["name"] == "rolling_app.hold"
    assert holder.get(timeout=15) == "old"
    app.close()


def test_cancel_old_run_stopped_by_a_newer_call_on_the_new_worker(sides: Sides) -> None:
    """lock_on_duplicate="cancel", old holds: the new worker's newer call stops the old run (old cancel field, old
    release) and runs after it, never beside it. The gap between the stopped run's end and its start is printed."""
    mod = sides.client()
    k = key()
    running = mod.newest.apply_async((k, 8.0), queue="old")
    sides.wait_started("newest", k)
    newer = mod.newest.apply_async((k, 0.2), queue="new")
    runs = sides.wait_runs("newest", k, 2, 20)
    by_id = {r[2]: r for r in runs}
    assert set(by_id) == {running.id, newer.id}, runs
    assert by_id[running.id][6] == "cut", runs
    assert by_id[newer.id][3] == "new", runs
    assert not overlapping(runs), runs
    gap = by_id[newer.id][4] - by_id[running.id][5]
    print(f"cancel old -> new: the newer call started {gap:.3f} s after the stopped run ended")
    assert newer.get(timeout=10) == "new"


def test_cancel_hand_over_to_an_old_worker_waits_out_the_hand_over(sides: Sides) -> None:
    """lock_on_duplicate="cancel", new holds, the newer call is on the OLD worker (a known incompatibility, see
    docs/migration.md "Rolling upgrade"): the new run stops and HANDS its lock to the waiting call (state ``handed``,
    job = that call, leased max(3 lock_ttl, 30 s)). fd86d2e does not know ``handed``: it takes the record for another
    delivery of its own job and defers until the record expires. Safe (nothing runs beside the lock: no second
    holder), but late by up to that hand-over lease, far more than one lock_ttl. This test pins the safe half and the
    cause; it does not wait the 30 s out (the module must stay short; measured once: 30.1 s). The fix for operators,
    ``singleton_lock_hand_on=False`` on the new workers during the upgrade, is the next test."""
    mod = sides.client()
    k = key()
    name = mod.newest.lock_key_for(k, 0.0)
    running = mod.newest.apply_async((k, 8.0), queue="new")
    sides.wait_started("newest", k)
    newer = mod.newest.apply_async((k, 0.2), queue="old")
    runs = sides.wait_runs("newest", k, 1, 15)
    assert [(r[2], r[6]) for r in runs] == [(running.id, "cut")], runs
    record: dict[bytes, bytes] = {}
    for _ in polling(5, 0.05):
        record = dict(sides.lock.hgetall(name))
        if record.get(b"state") == b"handed":
            break
    assert record.get(b"state") == b"handed" and record.get(b"job") == newer.id.encode(), record
    time.sleep(2 * 1.5)  # two of newest's leases: the old worker has met the handed record by now (it deferred)
    assert sides.started("newest", k)[1:] == [], "the old worker ran a second holder over a handed lock"
    assert dict(sides.lock.hgetall(name)).get(b"state") == b"handed"
    print(f"cancel new -> old: still handed {sides.lock.pttl(name) / 1000:.1f} s more; the newer call waits it out")
    newer.forget()


def test_cancel_hand_on_off_lets_an_old_waiter_run_after_the_stopped_run(sides: Sides) -> None:
    """The fix for the above: a new worker with ``singleton_lock_hand_on=False`` frees the stopped run's lock and
    wakes the line, as fd86d2e did: the newer call waiting on the OLD worker runs after the stopped run, never beside
    it, well within the 30 s hand-over (bounded wait: 12 s). Failed before hand_to_newest read the setting."""
    mod = sides.client()
    k = key()
    running = mod.newest.apply_async((k, 8.0), queue="compat")
    sides.wait_started("newest", k)
    newer = mod.newest.apply_async((k, 0.2), queue="old")
    runs = sides.wait_runs("newest", k, 2, 12)
    by_id = {r[2]: r for r in runs}
    assert set(by_id) == {running.id, newer.id}, runs
    assert (by_id[running.id][3], by_id[running.id][6]) == ("compat", "cut"), runs
    assert by_id[newer.id][3] == "old", runs
    assert not overlapping(runs), runs
    gap = by_id[newer.id][4] - by_id[running.id][5]
    print(f"cancel new (hand_on off) -> old: the newer call started {gap:.3f} s after the stopped run ended")
    assert newer.get(timeout=10) == "old"
