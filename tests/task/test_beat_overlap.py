"""A periodic LockedTask longer than its interval never overlaps itself, and beat keeps sending."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis

from celery_singleton_lock.testing import CeleryWorker, redis_servers

APPS = Path(__file__).parent.parent / "apps"
TICKS = 6  # beat's sends the test waits for: a 1 s interval, so ~6 s of a 2.5 s job's runs


@pytest.mark.parametrize("scope", ["run", "queue"])
def test_slow_periodic_job_never_overlaps_and_beat_keeps_running(tmp_path: Path, scope: str) -> None:
    """Ticks every 1 s of a 2.5 s LockedTask: runs never overlap, and beat goes on sending for the whole window.

    Run scope: the ticks in between reach the worker and are skipped with a log line. Queue scope: beat's own
    ``apply_async`` finds the job queued or running and publishes nothing (it gets the job's AsyncResult back, never
    None), so the worker receives one message per run.
    """
    with redis_servers(2) as (broker, lock):
        env = {
            "CSL_BROKER": broker.url,
            "CSL_LOCK_URLS": lock.url,
            "CSL_RECORD": broker.url.rsplit("/", 1)[0] + "/2",
            "CSL_SCOPE": scope,
        }
        worker = CeleryWorker("beat_overlap_app", "w1", cwd=str(APPS), log_path=str(tmp_path / "w.log"), env=env)
        beat_log = tmp_path / "beat.log"
        beat = None
        try:
            worker.start()
            with beat_log.open("wb") as out:
                beat = subprocess.Popen(
                    [sys.executable, "-m", "celery", "-A", "beat_overlap_app", "beat", "-l", "INFO",
                     "--schedule", str(tmp_path / "schedule")],
                    cwd=APPS, env={**worker.env, **env}, stdout=out, stderr=subprocess.STDOUT,
                )  # fmt: skip
                # Six ticks sent, however long beat took to start on a busy machine (bounded: 40 s).
                deadline = time.monotonic() + 40.0
                while time.monotonic() < deadline and beat.poll() is None:
                    if beat_log.read_text(errors="replace").count("Sending due task slow-tick") >= TICKS:
                        break
                    time.sleep(0.25)
                assert beat.poll() is None, "beat must keep running"
        finally:
            if beat is not None:
                beat.kill()
                beat.wait(10)
            worker.stop()
            worker.kill()
        runs = sorted(json.loads(r)[1:] for r in redis.Redis.from_url(env["CSL_RECORD"]).lrange("runs", 0, -1))
        log = worker.log()
        beat_text = beat_log.read_text()
        sent = beat_text.count("Sending due task slow-tick")
    assert sent >= TICKS
    assert "Traceback" not in beat_text
    assert len(runs) >= 2
    assert all(b[0] >= a[1] for a, b in itertools.pairwise(runs)), f"overlapping runs: {runs}"
    received = log.count("] received")
    if scope == "run":
        assert log.count("skipped duplicate in") >= 3
    else:
        assert log.count("skipped duplicate in") == 0
        # one message per run (a run may still be queued or running when the test stops the worker)
        assert len(runs) <= received <= len(runs) + 1 < sent
