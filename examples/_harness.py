"""Throwaway servers and two real workers for the examples; shared by every example's ``__main__`` and the tests.

``with example_workers() as app_module:`` starts four redis-servers on free loopback ports (a broker and three
independent lock nodes: a 3-node Redlock), sets ``EXAMPLES_*`` in this process's environment, starts two ``celery
worker`` processes (prefork, two children each) for :mod:`examples.example_app`, and yields that module, imported;
everything is stopped on exit. Each worker also gets its own ``PROMETHEUS_MULTIPROC_DIR`` and metrics port (see
``examples/prometheus_metrics.py``); ``EXAMPLES_METRICS_URLS`` lists their ``/metrics`` endpoints. The ports are
random free ones, or taken in order from ``EXAMPLES_PORTS`` (e.g. ``EXAMPLES_PORTS=17000-17019``) when it is set.

:func:`run_example` is what ``python -m examples.<name>`` runs: against services that are already up when
``EXAMPLES_BROKER`` is set (``docker compose``), else inside :func:`example_workers`. The app module's
configuration is read once per process, so use one harness per process.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import re
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from celery_singleton_lock.testing import CeleryWorker, example_port, redis_servers

ROOT = Path(__file__).resolve().parent.parent
APP = "examples.example_app"
_HOLDER = re.compile(r"held by task (\S+)")


@contextlib.contextmanager
def example_workers(
    app: str = APP, *, workers: int = 2, concurrency: int = 2, log_dir: str | Path | None = None
) -> Iterator[ModuleType]:
    """Servers + ``workers`` real workers for ``app`` (a module under examples/); yields the imported module."""
    logs = Path(log_dir) if log_dir else Path(tempfile.mkdtemp(prefix="csl-examples-"))
    saved = {k: v for k, v in os.environ.items() if k.startswith("EXAMPLES_")}
    started: list[CeleryWorker] = []
    with redis_servers(4, ports=example_port) as servers:
        broker, locks = servers[0], servers[1:]
        env = {"EXAMPLES_BROKER": broker.url, "EXAMPLES_LOCK_URLS": ",".join(s.url for s in locks)}
        metrics = [example_port() for _ in range(workers)]
        env["EXAMPLES_METRICS_URLS"] = ",".join(f"http://127.0.0.1:{port}/metrics" for port in metrics)
        os.environ.update(env)
        if str(ROOT) not in sys.path:
            sys.path.insert(0, str(ROOT))
        try:
            for i, port in enumerate(metrics, 1):
                prom_dir = logs / f"prometheus-w{i}"
                prom_dir.mkdir(parents=True, exist_ok=True)
                worker_env = {
                    **env,
                    "PROMETHEUS_MULTIPROC_DIR": str(prom_dir),
                    "EXAMPLES_METRICS_PORT": str(port),
                    "EXAMPLES_METRICS_ADDR": "127.0.0.1",
                }
                started.append(
                    CeleryWorker(
                        app,
                        f"w{i}",
                        cwd=str(ROOT),
                        log_path=str(logs / f"w{i}.log"),
                        concurrency=concurrency,
                        env=worker_env,
                    )
                )
            _in_parallel(CeleryWorker.start, started)
            yield importlib.import_module(app)
        finally:
            _in_parallel(CeleryWorker.stop, started)
            for k in env:
                os.environ.pop(k, None)
            os.environ.update(saved)
            print(f"(worker logs: {logs})")


def _in_parallel(method: Callable[[CeleryWorker], Any], workers: Sequence[CeleryWorker]) -> None:
    """Start (each waits for its "ready" line) or stop the workers side by side; raise the first failure."""
    errors: list[BaseException] = []

    def call(w: CeleryWorker) -> None:
        try:
            method(w)
        except BaseException as exc:  # re-raised below, in the caller's thread
            errors.append(exc)

    threads = [threading.Thread(target=call, args=(w,)) for w in workers]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]


def run_example(main: Callable[[ModuleType], dict[str, Any]]) -> int:
    """Run an example's ``main``: against running services if ``EXAMPLES_BROKER`` is set, else on throwaway ones."""
    if os.environ.get("EXAMPLES_BROKER"):
        figures = main(importlib.import_module(APP))
    else:
        print("starting 4 redis-servers (broker + 3 lock nodes) and 2 workers (prefork, 2 children each) ...")
        with example_workers() as app_module:
            figures = main(app_module)
    print(f"\nfigures: {figures}")
    return 0 if figures.get("ok") else 1


@dataclass(frozen=True)
class Outcome:
    """What a caller saw for one sent task."""

    task_id: str
    state: str
    value: Any = None
    reason: str = ""

    @property
    def ran(self) -> bool:
        return self.state == "SUCCESS"

    @property
    def holder(self) -> str | None:
        """For a skipped duplicate: the task id that held the lock, as the REVOKED reason names it."""
        match = _HOLDER.search(self.reason)
        return match.group(1) if match else None


def outcomes(results: Sequence[Any], timeout: float = 60.0) -> list[Outcome]:
    """Wait (at most ``timeout`` s in all) for every result; a skipped duplicate's reason is kept."""
    deadline = time.monotonic() + timeout
    seen = []
    for r in results:
        try:
            value = r.get(timeout=max(0.1, deadline - time.monotonic()))
            seen.append(Outcome(r.id, r.state, value))
        except Exception as exc:  # REVOKED (a skipped duplicate), FAILURE or a timeout: all are outcomes here
            seen.append(Outcome(r.id, r.state, None, f"{type(exc).__name__}: {exc}"))
    return seen


def wait_for(predicate: Callable[[], bool], timeout: float, interval: float = 0.05) -> bool:
    """Poll ``predicate`` until it is true or ``timeout`` s passed; returns its last value."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()


def short(task_id: str | None) -> str:
    return task_id[:8] if task_id else "-"
