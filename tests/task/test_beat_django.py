"""SingletonDatabaseScheduler: two real ``celery beat`` processes over django-celery-beat's tables in a real
PostgreSQL database send each run of a schedule created through the ORM once, while one is SIGKILLed and restarted.

PostgreSQL: 127.0.0.1:5432, user postgres, trust auth; a throwaway database per test run, dropped after. Without
PostgreSQL the module is skipped, except under CI=true, where it fails.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
from worker_cluster import APPS

from celery_singleton_lock.ops.health import liveness
from celery_singleton_lock.task.beat import SLOT_HEADER
from celery_singleton_lock.testing import RedisServer, redis_servers

SCHEDULER = "celery_singleton_lock.beat:SingletonDatabaseScheduler"
PG = {"host": "127.0.0.1", "port": 5432, "user": "postgres"}


@pytest.fixture(scope="module")
def database() -> Iterator[str]:
    """A throwaway PostgreSQL database with django-celery-beat's tables and a 1 s interval task made via the ORM."""
    psycopg = pytest.importorskip("psycopg")
    pytest.importorskip("django_celery_beat")
    name = f"csl_beat_{uuid.uuid4().hex[:12]}"
    try:
        admin = psycopg.connect(**PG, dbname="postgres", autocommit=True, connect_timeout=5)
    except psycopg.OperationalError as exc:
        if os.environ.get("CI") == "true":
            pytest.fail(f"PostgreSQL at 127.0.0.1:5432 is unreachable under CI: {exc}")
        pytest.skip(f"no PostgreSQL at 127.0.0.1:5432: {exc}")
    with admin:
        admin.execute(f'CREATE DATABASE "{name}"')
        try:
            _migrate_and_schedule(name)
            yield name
        finally:
            admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def _migrate_and_schedule(name: str) -> None:
    """Migrate and create the schedule in a child process (Django's settings are process-wide)."""
    script = (
        "import django; django.setup()\n"
        "from django.core.management import call_command\n"
        "call_command('migrate', verbosity=0)\n"
        "from django_celery_beat.models import IntervalSchedule, PeriodicTask\n"
        "every = IntervalSchedule.objects.create(every=1, period=IntervalSchedule.SECONDS)\n"
        "PeriodicTask.objects.create(name='tick', task='django_beat_app.tick', interval=every)\n"
    )
    env = {**os.environ, "CSL_PG_DB": name, "DJANGO_SETTINGS_MODULE": "django_beat_settings"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(APPS), os.environ.get("PYTHONPATH")]))
    subprocess.run([sys.executable, "-c", script], env=env, check=True, timeout=120)


class Beats:
    """Real ``celery beat`` processes of the Django app; SIGKILLed on exit, whatever happened."""

    def __init__(self, tmp: Path, env: dict[str, str]) -> None:
        self.tmp, self.procs = tmp, []
        self.env = {**os.environ, **env}
        self.env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(APPS), os.environ.get("PYTHONPATH")]))
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(self) -> subprocess.Popen[bytes]:
        n = len(self.procs)
        env = {**self.env, "CSL_LIVENESS": str(self.tmp / f"live-{n}.json")}
        args = [sys.executable, "-m", "celery", "-A", "django_beat_app", "beat", "-l", "INFO", "-S", SCHEDULER]
        with (self.tmp / f"beat-{n}.log").open("wb") as log:
            proc = subprocess.Popen(
                args, cwd=self.tmp, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        self.procs.append(proc)
        return proc

    def logs(self) -> str:
        return "\n".join(p.read_text(errors="replace") for p in sorted(self.tmp.glob("beat-*.log")))

    def kill(self, proc: subprocess.Popen[bytes]) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(10)


def sent(broker: RedisServer) -> list[tuple[str, int]]:
    """(slot, sender pid) of every run waiting in the broker's default queue."""
    out = []
    for raw in broker.client().lrange("celery", 0, -1):
        headers = json.loads(raw)["headers"]
        pid = re.fullmatch(r"gen(\d+)@.*", headers["origin"])
        assert pid is not None, headers["origin"]
        out.append((headers[SLOT_HEADER], int(pid.group(1))))
    return out


def wait_runs(broker: RedisServer, after: float, count: int, group: Beats, what: str) -> None:
    """Wait (at most 60 s, polled every 0.2 s) for ``count`` runs of slots later than ``after``."""
    deadline = time.monotonic() + 60
    while len([s for s, _ in sent(broker) if float(s) > after]) < count:
        if time.monotonic() > deadline:
            pytest.fail(f"{what}: not within 60 s; beat logs:\n{group.logs()[-4000:]}")
        time.sleep(0.2)


def test_two_database_beats_send_each_run_once_across_a_kill_and_restart(database: str, tmp_path: Path) -> None:
    """Two beats read one PostgreSQL schedule: every 1 s slot is sent once; SIGKILL the latest sender and its
    runs go on from the other; a restarted instance joins without a run sent twice, and its liveness file is
    alive."""
    with redis_servers(3) as nodes:
        group = Beats(
            tmp_path,
            {"CSL_BROKER": nodes[0].url, "CSL_LOCK_URLS": ",".join(s.url for s in nodes), "CSL_PG_DB": database},
        )
        try:
            group.start()
            group.start()
            wait_runs(nodes[0], 0, 4, group, "four runs from two beats")
            before = sent(nodes[0])
            last, sender = max(before, key=lambda m: float(m[0]))
            victim = next(p for p in group.procs if p.pid == sender)
            group.kill(victim)
            wait_runs(nodes[0], float(last), 3, group, "three runs after the kill")
            killed_at = max(float(s) for s, _ in sent(nodes[0]))
            restarted = group.start()
            wait_runs(nodes[0], killed_at, 6, group, "six runs after the restart")
            for _ in range(300):  # the restarted instance's beat ticked (bounded: 300 x 0.1 s)
                if liveness(str(tmp_path / f"live-{len(group.procs) - 1}.json")).ok:
                    break
                time.sleep(0.1)
            assert liveness(str(tmp_path / f"live-{len(group.procs) - 1}.json")).ok, group.logs()[-3000:]
            assert all(p.poll() is None for p in group.procs if p is not victim), group.logs()[-3000:]
            messages = sent(nodes[0])
        finally:
            for proc in group.procs:
                group.kill(proc)
    slots = [s for s, _ in messages]
    assert len(slots) == len(set(slots)), f"a run sent twice: {Counter(slots).most_common(3)}"
    after_kill = {pid for s, pid in messages if float(s) > float(last)}
    assert sender not in after_kill
    span = int(max(float(s) for s in slots)) - int(min(float(s) for s in slots)) + 1
    # At most the run the killed instance had claimed and not yet sent is lost (at most once, never twice).
    assert len(slots) >= span - 2, f"runs missing beyond the killed one's: {sorted(slots, key=float)}"
    assert restarted.pid in {pid for _, pid in messages} or "was claimed by another beat instance" in group.logs()


def test_the_beat_module_imports_without_django_and_names_what_to_install() -> None:
    """Without django-celery-beat the beat module still imports; asking for SingletonDatabaseScheduler raises an
    ImportError saying what to install."""
    code = (
        "import sys; sys.modules['django_celery_beat'] = None; sys.modules['django'] = None\n"
        "import celery_singleton_lock, celery_singleton_lock.beat as beat\n"
        "try:\n    beat.SingletonDatabaseScheduler\nexcept ImportError as exc:\n    print(exc)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert "needs django-celery-beat (pip install django-celery-beat)" in out.stdout
