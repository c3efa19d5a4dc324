"""Throwaway servers for the web examples: four redis-servers (three lock nodes, one store) and two uvicorn
instances of ``examples.fastapi_app:app`` as real processes on free loopback ports (two app instances behind one
address, as a load balancer would spread clicks). Shared by the examples' ``__main__`` and
tests/project/test_examples.py.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx

from celery_singleton_lock.testing import example_port, redis_servers, spawn

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Web:
    """The running example: the app instances' base URLs and the store's URL."""

    instances: tuple[str, ...]
    store_url: str
    lock_urls: tuple[str, ...]


@contextlib.contextmanager
def web_instances(count: int = 2, *, log_dir: Path | None = None) -> Iterator[Web]:
    with redis_servers(4, ports=example_port) as servers:
        lock_urls, store_url = tuple(s.url for s in servers[:3]), servers[3].url
        env = {**os.environ, "EXAMPLES_LOCK_URLS": ",".join(lock_urls), "EXAMPLES_STORE_URL": store_url}
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
        procs: list[subprocess.Popen[bytes]] = []
        urls: list[str] = []
        try:
            for i in range(count):
                port = example_port()
                log = open(log_dir / f"uvicorn-{i}.log", "wb") if log_dir else subprocess.DEVNULL  # noqa: SIM115
                args = ["-m", "uvicorn", "examples.fastapi_app:app", "--host", "127.0.0.1", "--port", str(port)]
                procs.append(
                    spawn(
                        [sys.executable, *args, "--log-level", "warning"],
                        cwd=ROOT,
                        env={**env, "EXAMPLES_INSTANCE": f"web-{i}"},
                        stdout=log,
                        stderr=subprocess.STDOUT,
                    )
                )
                urls.append(f"http://127.0.0.1:{port}")
            for url, proc in zip(urls, procs, strict=True):
                _wait_ready(url, proc)
            yield Web(tuple(urls), store_url, lock_urls)
        finally:
            for proc in procs:
                proc.terminate()
            for proc in procs:
                try:
                    proc.wait(15)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(5)


def _wait_ready(url: str, proc: subprocess.Popen[bytes], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    for _ in range(int(timeout / 0.05) + 1):
        if proc.poll() is not None:
            raise RuntimeError(f"uvicorn for {url} exited with {proc.returncode}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{url}/health", timeout=2.0).status_code == 200:
                return
        if time.monotonic() > deadline:
            break
        time.sleep(0.05)
    raise RuntimeError(f"uvicorn for {url} did not answer within {timeout} s")
