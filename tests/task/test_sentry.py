"""Sentry Crons under the singleton scheduler (celery_singleton_lock.sentry, issue 34).

Real redis-server processes (a broker, three lock nodes), two real ``celery beat`` processes under
``SingletonScheduler`` and a real prefork worker, all running tests/apps/sentry_app.py: ``sentry_sdk`` with
``CeleryIntegration(monitor_beat_tasks=True)`` and a transport that pushes every envelope item to Redis (no network).
Two monitored entries tick every 2 s: ``report`` (5 s, duplicates skipped) and ``report_later`` (2.5 s, duplicates
rescheduled).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections import Counter, defaultdict
from collections.abc import Iterator
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


@pytest.fixture
def beats_and_worker(
    tmp_path: Path, request: pytest.FixtureRequest
) -> Iterator[tuple[redis.Redis, CeleryWorker, bool]]:
    """Two beat instances and a worker, until SLOTS check-ins per entry were opened; the beats are stopped then."""
    with redis_servers(4) as (broker, *locks):
        env = {
            "CSL_BROKER": broker.url,
            "CSL_LOCK_URLS": ",".join(s.url for s in locks),
            "CSL_RECORD": broker.url.rsplit("/", 1)[0] + "/2",
            "CSL_SKIP_BEFORE_POOL": request.param,
        }
        r = redis.Redis.from_url(env["CSL_RECORD"])
        worker = CeleryWorker(
            "sentry_app", "w1", cwd=str(APPS), log_path=str(tmp_path / "w.log"), env=env, concurrency=4
        )
        beats: list[subprocess.Popen[bytes]] = []
        try:
            worker.start(timeout=60)
            for n in (1, 2):
                with (tmp_path / f"beat-{n}.log").open("wb") as out:
                    beats.append(
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
                                str(tmp_path / f"schedule-{n}"),
                            ],
                            cwd=APPS,
                            env={**worker.env, **env, "CSL_PROC": f"beat-{n}"},
                            stdout=out,
                            stderr=subprocess.STDOUT,
                        )
                    )
            for _ in polling(90, 0.25):
                slugs = Counter(i["payload"]["monitor_slug"] for i in opened(r).values())
                if min(slugs.get("report", 0), slugs.get("report-later", 0)) >= SLOTS:
                    break
            for beat in beats:
                assert beat.poll() is None, "beat must keep running"
                beat.kill()
                beat.wait(10)
            # Every run sent, and every copy it re-sent, has reached its end: no check-in is left open.
            for _ in polling(60, 0.25):
                if set(opened(r)) <= set(closed(r)):
                    break
            yield r, worker, request.param == "1"
        finally:
            # What Sentry was sent, and what ran, for a failure's post-mortem.
            (tmp_path / "envelopes.json").write_text(json.dumps(items(r), indent=1))
            (tmp_path / "runs.json").write_text(json.dumps([json.loads(x) for x in r.lrange("runs", 0, -1)]))
            for beat in beats:
                if beat.poll() is None:
                    beat.kill()
                    beat.wait(10)
            worker.kill()


@pytest.mark.parametrize("beats_and_worker", ["1", "0"], indirect=True, ids=["before-pool", "in-pool"])
def test_each_run_checks_in_once_from_one_beat_and_a_skipped_duplicate_is_no_failure(
    beats_and_worker: tuple[redis.Redis, CeleryWorker, bool], tmp_path: Path
) -> None:
    """Each beat slot's check-in is opened by the one beat instance that sent the run, and closed once, ``ok``: a
    duplicate skipped (before the pool, or in it) or re-sent to wait is neither an error nor left open."""
    r, worker, before_pool = beats_and_worker
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
