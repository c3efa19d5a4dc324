"""The redis-servers the pytest plugin and ``celery_singleton_lock.testing`` start die with the process that owns
them, even when that process never reaches its teardown: pytest stopped by SIGTERM (a CI timeout, a cancelled job),
and on Linux any death of the owner, SIGKILL included.

Each test runs the owner as a subprocess of its own, kills it, and then looks for the servers it had started: by
pid (a zombie left unreaped by a container's init counts as gone) and by port. A server that survives is killed
here, so a failing run leaves nothing behind either.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from celery_singleton_lock.testing import RedisServer, wait_for

ROOT = Path(__file__).resolve().parent.parent.parent
WAIT = 60.0  # a bound, not an expectation: a pytest start on two busy cores can take long


def alive(pid: int) -> bool:
    """The process exists and is not a zombie."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # a recycled pid of another user's: ours is gone
        return False
    stat = Path(f"/proc/{pid}/stat")
    if stat.exists():
        with contextlib.suppress(OSError):
            return stat.read_text().rsplit(")", 1)[1].split()[0] != "Z"
    return True


def listening(port: int) -> bool:
    with socket.socket() as sock:
        sock.settimeout(0.5)
        return sock.connect_ex(("127.0.0.1", port)) == 0


def who(port: int) -> str:
    """What listens on ``port``, for the failure message (``ss`` where it exists)."""
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        out = subprocess.run(
            ["ss", "-ltnpH", f"sport = :{port}"], capture_output=True, text=True, timeout=10, check=False
        )
        return out.stdout.strip() or "ss shows no listener"
    return "ss unavailable"


def env(**extra: str) -> dict[str, str]:
    """This environment with the source tree first on the path (the package the owner imports is this one)."""
    out = {**os.environ, **extra}
    out["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), out.get("PYTHONPATH", "")]))
    return out


@contextlib.contextmanager
def owner(args: list[str], cwd: Path, **extra: str) -> Iterator[subprocess.Popen[bytes]]:
    proc = subprocess.Popen(args, cwd=cwd, env=env(**extra), stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)
        if proc.stdout is not None:
            proc.stdout.close()


def read_servers(path: Path, proc: subprocess.Popen[bytes]) -> list[tuple[int, int]]:
    """The ``pid port`` lines the owner wrote once its servers answered, waiting for them (bounded)."""
    assert wait_for(lambda: path.exists() or proc.poll() is not None, WAIT, 0.05)  # written whole (os.replace)
    assert proc.poll() is None, proc.stdout.read().decode() if proc.stdout else ""
    return [(int(pid), int(port)) for pid, port in (line.split() for line in path.read_text().splitlines())]


def assert_gone(servers: list[tuple[int, int]]) -> None:
    try:
        for pid, port in servers:
            assert wait_for(lambda pid=pid: not alive(pid), WAIT, 0.05), f"redis-server {pid} outlived its owner"
            # Polled, not probed once: a single connect to a closed port in the ephemeral range can meet itself
            # (TCP simultaneous open) and "answer"; a server that outlived its owner answers for the whole bound.
            assert wait_for(lambda port=port: not listening(port), WAIT, 0.2), f"port {port} still answers: {who(port)}"
    finally:
        for pid, _ in servers:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)


SLEEPING_TEST = """
import os, time

def test_sleeps(singleton_lock_node):
    path = os.environ["CSL_SERVERS"]
    with open(path + ".tmp", "w") as f:
        f.write(f"{singleton_lock_node.process.pid} {singleton_lock_node.port}\\n")
    os.replace(path + ".tmp", path)
    time.sleep(60)
"""


def test_a_sigtermed_pytest_leaves_no_plugin_server_behind(tmp_path: Path) -> None:
    """pytest stopped by SIGTERM while a test that uses singleton_lock_node sleeps: its redis-server dies too."""
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    (tmp_path / "test_sleeps.py").write_text(SLEEPING_TEST)
    servers_file = tmp_path / "servers"
    args = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:celery", "test_sleeps.py"]
    with owner(args, tmp_path, CSL_SERVERS=str(servers_file)) as proc:
        servers = read_servers(servers_file, proc)
        assert alive(servers[0][0])
        proc.send_signal(signal.SIGTERM)
        proc.wait(WAIT)
        assert_gone(servers)


KILLED_OWNER = """
import os, sys, threading, time
from celery_singleton_lock.testing import RedisServer

servers = [RedisServer().start()]
# A server started by a thread that then ends: it must live on, for as long as the process does.
thread = threading.Thread(target=lambda: servers.append(RedisServer().start()))
thread.start()
thread.join()
time.sleep(0.3)
assert servers[1].client().ping()
with open(sys.argv[1] + ".tmp", "w") as f:
    f.writelines(f"{s.process.pid} {s.port}\\n" for s in servers)
os.replace(sys.argv[1] + ".tmp", sys.argv[1])
time.sleep(60)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the parent-death signal is Linux's")
def test_on_linux_a_sigkilled_owner_takes_its_servers_along(tmp_path: Path) -> None:
    """On Linux a SIGKILLed owner's servers die too, the one a short-lived thread started included (and that one
    outlives its thread)."""
    servers_file = tmp_path / "servers"
    with owner([sys.executable, "-c", KILLED_OWNER, str(servers_file)], tmp_path) as proc:
        servers = read_servers(servers_file, proc)
        assert len(servers) == 2
        assert all(listening(port) for _, port in servers)
        proc.send_signal(signal.SIGKILL)
        proc.wait(WAIT)
        assert_gone(servers)


FORKED_CHILD = """
import os, signal, sys, warnings
import redis
from celery_singleton_lock.testing import RedisServer

server = RedisServer(unixsocket=True).start()  # its socket file lives in the server's own temporary directory
with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)  # Python 3.12+ warns of fork() in a process with threads
    pid = os.fork()
if pid == 0:  # a forked child (multiprocessing's fork start method) that is terminated
    os.kill(os.getpid(), signal.SIGTERM)
    os._exit(3)
_, status = os.waitpid(pid, 0)
print(os.WTERMSIG(status) if os.WIFSIGNALED(status) else -1, redis.Redis.from_url(server.unix_url).ping())
server.close()
"""


@pytest.mark.skipif(not hasattr(os, "fork"), reason="fork() only")
def test_a_forked_child_s_sigterm_leaves_its_parent_s_servers_alone(tmp_path: Path) -> None:
    """A child forked from the owner inherits the SIGTERM handler: terminated, it dies of SIGTERM and leaves the
    owner's server alone (it still answers on its unix socket, which lives in the directory a reap removes)."""
    with owner([sys.executable, "-c", FORKED_CHILD], tmp_path) as proc:
        out, _ = proc.communicate(timeout=WAIT)
    assert out.decode().split()[-2:] == [str(int(signal.SIGTERM)), "True"], out.decode()


def test_a_missing_binary_is_still_named_at_start(tmp_path: Path) -> None:
    """A redis-server binary that does not exist fails the start with FileNotFoundError naming it (not an exit
    status of the launcher)."""
    missing = str(tmp_path / "no-such-redis-server")
    with pytest.raises(FileNotFoundError, match="no-such-redis-server"), RedisServer(binary=missing):
        pytest.fail("the server must not start")
