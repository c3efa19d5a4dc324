"""``celery locks health`` and ``/healthz`` ``/livez``: probes against real redis-servers and a real worker.

Readiness asks the lock nodes (password-protected: the line must name them redacted); liveness reads the heartbeat
file a real worker's watchdog writes (``singleton_lock_liveness_file``), paused with SIGSTOP to look stuck.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from worker_cluster import APPS, Cluster, cluster, polling

from celery_singleton_lock.ops.health import liveness, write_heartbeat
from celery_singleton_lock.ops.web import make_app, serve

PASSWORD = "probe-s3cret-pw"
CELERY = [sys.executable, "-m", "celery", "-A", "locked_app", "locks", "health"]


@pytest.fixture
def nodes(tmp_path: Path) -> Iterator[Cluster]:
    """A broker and three password-protected lock nodes of this test's own (free to kill)."""
    with cluster(tmp_path, ttl=5.0, password=PASSWORD) as cl:
        yield cl


def probe(cl: Cluster, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Run the real ``celery -A locked_app locks health ...`` program."""
    full = {**os.environ, **cl.env, **(env or {})}
    full["PYTHONPATH"] = os.pathsep.join(
        [str(APPS), str(Path(__file__).parent.parent.parent), full.get("PYTHONPATH", "")]
    )
    return subprocess.run([*CELERY, *args], env=full, capture_output=True, text=True, timeout=60, check=False)


def test_readiness_fails_with_a_node_quorum_lost_and_passes_once_restored(nodes: Cluster) -> None:
    """Exit 0 while a quorum answers; with two of three nodes killed, exit 1 and one line naming the quorum and the
    unreachable nodes, redacted; exit 0 again once they are restarted."""
    ok = probe(nodes, "--readiness")
    assert ok.returncode == 0, ok.stderr
    assert "ready: 3 of 3 lock node(s) answered (quorum 2)" in ok.stdout
    for server in nodes.locks[:2]:
        server.kill()
    down = probe(nodes, "--readiness")
    assert down.returncode == 1
    lines = [line for line in down.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, down.stderr
    assert lines[0].startswith("not ready: 1 of 3 lock node(s) answered (quorum 2); unreachable: ")
    for server in nodes.locks[:2]:
        assert f"127.0.0.1:{server.port}" in lines[0]
    assert PASSWORD not in down.stdout + down.stderr
    as_json = json.loads(probe(nodes, "--json").stdout)
    assert as_json["ok"] is False
    assert (as_json["answered"], as_json["quorum"], len(as_json["unreachable"])) == (1, 2, 2)
    nodes.start_locks()
    again = probe(nodes)
    assert again.returncode == 0, again.stderr


def _get(url: str) -> tuple[int, dict[str, object]]:
    try:
        with urllib.request.urlopen(url, timeout=10) as answer:
            return answer.status, json.loads(answer.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_healthz_answers_503_without_a_quorum_and_livez_200(nodes: Cluster) -> None:
    """The page's server answers /healthz 200 with a quorum, 503 (JSON naming the unreachable nodes, redacted)
    without one, 200 again once restored; /livez 200 throughout."""
    app = nodes.app_module().app
    server = serve(make_app(app, doctor=False), "127.0.0.1", 0)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        assert _get(base + "/healthz")[0] == 200
        for lock in nodes.locks[:2]:
            lock.kill()
        status, body = _get(base + "/healthz")
        assert status == 503
        assert body["ok"] is False
        assert PASSWORD not in json.dumps(body)
        assert _get(base + "/livez")[0] == 200
        nodes.start_locks()
        assert _get(base + "/healthz")[0] == 200
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)


def test_liveness_follows_a_real_workers_watchdog(nodes: Cluster, tmp_path: Path) -> None:
    """A worker with singleton_lock_liveness_file: the probe passes while its watchdog writes the file, fails
    (exit 1, one line) while the worker is stopped with SIGSTOP, and passes again after SIGCONT."""
    path = tmp_path / "liveness.json"
    env = {"CSL_LIVENESS": str(path)}
    worker = nodes.worker("live", pool="prefork", concurrency=1, env=env)
    for _ in polling(30, 0.1):
        if path.exists():
            break
    assert path.exists(), worker.log()[-2000:]
    first = probe(nodes, "--liveness", "--json", env=env)
    assert first.returncode == 0, first.stdout + first.stderr
    found = json.loads(first.stdout)
    assert found["ok"] is True
    assert found["heartbeat"]["role"] == "worker"
    assert found["heartbeat"]["pid"] == worker.process.pid  # type: ignore[union-attr]
    os.killpg(worker.process.pid, signal.SIGSTOP)  # type: ignore[union-attr]
    try:
        # The heartbeat says when it is due again (at most 5 s on): wait for that (bounded), then a 0.5 s grace.
        due = json.loads(path.read_text())["due"]
        for _ in polling(30, 0.2):
            if liveness(str(path), grace=0.5).ok is False:
                break
        stuck = probe(nodes, "--liveness", "--grace", "0.5", env=env)
        assert stuck.returncode == 1
        assert stuck.stderr.strip().startswith("not alive: worker pid ")
        assert "stuck or dead" in stuck.stderr
        assert json.loads(path.read_text())["due"] == due  # nothing wrote while stopped
    finally:
        os.killpg(worker.process.pid, signal.SIGCONT)  # type: ignore[union-attr]
    for _ in polling(30, 0.2):
        if liveness(str(path), grace=0.5).ok:
            break
    assert probe(nodes, "--liveness", "--grace", "0.5", env=env).returncode == 0


def test_liveness_without_a_file_says_what_to_set(nodes: Cluster) -> None:
    """--liveness with no singleton_lock_liveness_file and no --file: a usage error naming both."""
    result = probe(nodes, "--liveness")
    assert result.returncode == 2
    assert "set singleton_lock_liveness_file or pass --file PATH" in result.stderr


def test_a_heartbeat_later_than_its_own_due_time_is_not_alive(tmp_path: Path) -> None:
    """The file's own ``due`` and the grace decide: alive just within, not alive past it, and an overdue renewal
    fails too."""
    path = str(tmp_path / "hb.json")
    write_heartbeat(path, role="beat", due_in=5.0)
    at = json.loads(Path(path).read_text())["at"]
    assert liveness(path, grace=1.0, now=at + 5.9).ok
    late = liveness(path, grace=1.0, now=at + 6.1)
    assert not late.ok
    assert "beat pid" in late.reason
    write_heartbeat(path, role="worker", due_in=5.0, overdue=3.0)
    assert not liveness(path, grace=1.0).ok
    assert not liveness(str(tmp_path / "missing.json")).ok
