"""Sentry Crons under the singleton scheduler (celery_singleton_lock.sentry, issue 34).

Real redis-server processes (a broker, three lock nodes), two real ``celery beat`` processes under
``SingletonScheduler`` and a real prefork worker, all running tests/apps/sentry_app.py: ``sentry_sdk`` with
``CeleryIntegration(monitor_beat_tasks=True)`` and a transport that pushes every envelope item to Redis (no network).
Two monitored entries tick every 2 s: ``report`` (5 s, duplicates skipped) and ``report_later`` (2.5 s, duplicates
rescheduled). The two variants (the worker skipping duplicates before the pool, or in it) run side by side, each on
its own servers, in one module set-up.
"""

from __future__ import annotations

import contextlib
import json
import re
import subprocess
import sys
from collections import Counter, defaultdict
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import redis
from worker_cluster import APPS, polling

from celery_singleton_lock.testing import CeleryWorker, redis_servers

pytest.importorskip("sentry_sdk")

pytestmark = pytest.mark.slow

SLOTS = 6  # check-ins opened per entry before the beats stop (a slot every 2 s)


def items(r: redis.Redis) -> list[dict[str, Any]]:
    return [json.loads(x) for x in r.lrange("envelopes", 0, -1)]


def check_ins(r: redis.Redis) -> list[dict[str, Any]]:
    return [i for i in items(r) if i["type"] == "check_in"]


def opened(r: redis.Redis) -> dict[str, dict[str, Any]]:
    return {i["payload"]["check_in_id"]: i for i in check_ins(r) if i["payload"]["status"] == "in_progress"}


def closed(r: redis.Redis) -> dict[str, list[dict[str, Any]]]:
    found: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for i in check_ins(r):
        if i["payload"]["status"] != "in_progress":
            found[i["payload"]["check_in_id"]].append(i)
    return found


VARIANTS = {"before-pool": "1", "in-pool": "0"}  # CSL_SKIP_BEFORE_POOL of the worker


class Run:
    """One variant's servers, worker and two beat instances (its own broker and lock nodes: nothing shared)."""

    def __init__(self, stack: contextlib.ExitStack, tmp: Path, skip_before_pool: str) -> None:
        broker, *locks = stack.enter_context(redis_servers(4))
        self.tmp = tmp
        self.before_pool = skip_before_pool == "1"
        self.env = {
            "CSL_BROKER": broker.url,
            "CSL_LOCK_URLS": ",".join(s.url for s in locks),
            "CSL_RECORD": broker.url.rsplit("/", 1)[0] + "/2",
            "CSL_SKIP_BEFORE_POOL": skip_before_pool,
        }
        self.r = redis.Redis.from_url(self.env["CSL_RECORD"])
        self.worker = CeleryWorker(
            "sentry_app", "w1", cwd=str(APPS), log_path=str(tmp / "w.log"), env=self.env, concurrency=4
        )
        self.beats: list[subprocess.Popen[bytes]] = []
        stack.callback(self.close)

    def start_beats(self) -> None:
        for n in (1, 2):
            with (self.tmp / f"beat-{n}.log").open("wb") as out:
                self.beats.append(
                    subprocess.Popen(
                        [
                            sys.executable,
                            "-m",
                            "celery",
                            "-A",
                            "sentry_app",
                            "beat",
                            "-l",
                            "INFO",
                            "-S",
                            "celery_singleton_lock.beat.SingletonScheduler",
                            "--schedule",
                            str(self.tmp / f"schedule-{n}"),
                        ],
                        cwd=APPS,
                        env={**self.worker.env, **self.env, "CSL_PROC": f"beat-{n}"},
                        stdout=out,
                        stderr=subprocess.STDOUT,
                    )
                )

    def slots_opened(self) -> bool:
        slugs = Counter(i["payload"]["monitor_slug"] for i in opened(self.r).values())
        return min(slugs.get("report", 0), slugs.get("report-later", 0)) >= SLOTS

    def stop_beats(self) -> None:
        for beat in self.beats:
            assert beat.poll() is None, "beat must keep running"
            beat.kill()
            beat.wait(10)

    def all_closed(self) -> bool:
        return set(opened(self.r)) <= set(closed(self.r))

    def close(self) -> None:
        # What Sentry was sent, and what ran, for a failure's post-mortem.
        (self.tmp / "envelopes.json").write_text(json.dumps(items(self.r), indent=1))
        (self.tmp / "runs.json").write_text(json.dumps([json.loads(x) for x in self.r.lrange("runs", 0, -1)]))
        for beat in self.beats:
            if beat.poll() is None:
                beat.kill()
                beat.wait(10)
        self.worker.kill()


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Run]]:
    """Both variants side by side (each its own servers, worker and beats, so one module set-up, not two): two beat
    instances and a worker each, until SLOTS check-ins per entry were opened; the beats are stopped then, and every
    check-in sent has reached its end."""
    with contextlib.ExitStack() as stack:
        found = {v: Run(stack, tmp_path_factory.mktemp(v), skip) for v, skip in VARIANTS.items()}
        with ThreadPoolExecutor(len(found)) as pool:  # the two workers start at once
            list(pool.map(lambda one: one.worker.start(timeout=60), found.values()))
        for one in found.values():
            one.start_beats()
        waiting = set(found)
        for _ in polling(90, 0.25):
            for v in [v for v in waiting if found[v].slots_opened()]:
                found[v].stop_beats()
                waiting.discard(v)
            if not waiting:
                break
        for v in waiting:  # the bound was reached: stop them all the same (the test then says what is missing)
            found[v].stop_beats()
        # Every run sent, and every copy it re-sent, has reached its end: no check-in is left open.
        for _ in polling(60, 0.25):
            if all(one.all_closed() for one in found.values()):
                break
        yield found


@pytest.fixture(params=list(VARIANTS))
def run(runs: dict[str, Run], request: pytest.FixtureRequest) -> Run:
    return runs[request.param]


def test_each_run_checks_in_once_from_one_beat_and_a_skipped_duplicate_is_no_failure(run: Run) -> None:
    """Each beat slot's check-in is opened by the one beat instance that sent the run, and closed once, ``ok``: a
    duplicate skipped (before the pool, or in it) or re-sent to wait is neither an error nor left open."""
    r, worker, before_pool, tmp_path = run.r, run.worker, run.before_pool, run.tmp
    runs = opened(r)
    logs = [(tmp_path / f"beat-{n}.log").read_text(errors="replace") for n in (1, 2)]
    sent = sum(log.count("Sending due task") for log in logs)
    # One check-in per run sent, each from a beat process; the other instance, due for the same slot, said nothing.
    assert len(runs) == sent, (len(runs), sent)
    assert {i["proc"] for i in runs.values()} <= {"beat-1", "beat-2"}
    assert sum(log.count("was claimed by another beat instance") for log in logs) >= 1
    # Every check-in closed exactly once, ok, by the worker; no error event anywhere.
    ends = closed(r)
    assert set(ends) == set(runs), f"left open: {set(runs) - set(ends)}"
    for check_in_id, found in ends.items():
        assert [i["payload"]["status"] for i in found] == ["ok"], (runs[check_in_id]["payload"], found)
        assert {i["proc"] for i in found} == {"worker"}
    assert not [i for i in items(r) if i["type"] == "event"]
    # The test saw the paths it is about: skipped duplicates, and rescheduled ones that ran later.
    log = worker.log()
    assert log.count("skipped duplicate") >= 2, log[-3000:]
    if before_pool:
        assert re.search(r"MainProcess\] Task sentry_app\.report\[[^]]+\] skipped duplicate", log), log[-3000:]
    assert re.search(r"Task sentry_app\.report_later\[[^]]+\] deferred", log), log[-3000:]
    later = [json.loads(x) for x in r.lrange("runs", 0, -1) if json.loads(x)[0] == "report_later"]
    assert len(later) >= 2
