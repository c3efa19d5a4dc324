"""Whether the Docker tier can run here, and with which images (shared by tests/test_docker_*.py).

``tools/docker_images.sh`` starts an engine where it can and writes ``docker/local.env`` (local base images built
from Debian's packages, an offline pip install). Without that file the registry's images are used (redis:7,
python:3.12-slim). Where no engine answers, the Docker tests skip, saying why; under ``CI=true`` (or with
``CSL_DOCKER=required``) they fail instead, so a broken set-up cannot pass as skipped.

Every container, network and volume these tests create carries the label ``csl.run=RUN_ID`` (or is a compose
project named after it): only those are ever stopped or removed.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import secrets
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from types import FrameType

import needs
import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))

import docker_demo  # noqa: E402  - tools/docker_demo.py: compose runs, their verdict and their clean-up

LOCAL = docker_demo.local_env()
PYTHON_IMAGE = os.environ.get("CSL_PYTHON_IMAGE") or LOCAL.get("CSL_PYTHON_IMAGE", "python:3.12-slim")
REDIS_IMAGE = os.environ.get("CSL_REDIS_IMAGE") or LOCAL.get("CSL_REDIS_IMAGE", "redis:7")
APP_IMAGE = os.environ.get("CSL_APP_IMAGE") or LOCAL.get("CSL_APP_IMAGE", "celery-singleton-lock/app:local")
PIP_OFFLINE = os.environ.get("CSL_PIP_OFFLINE") or LOCAL.get("CSL_PIP_OFFLINE", "")
RUN_ID = f"{os.getpid()}-{secrets.token_hex(3)}"
LABEL = "csl.run"
# CI must run the Docker tier (as needs.py holds for every optional dependency): there, no engine is a failure.
REQUIRED = os.environ.get("CSL_DOCKER") == "required" or needs.in_ci()


def why_not() -> str | None:
    """None when a Docker engine answers a ping; otherwise why not (one line)."""
    try:
        import docker  # noqa: PLC0415 - pytest-celery's dependency; only asked here

        client = docker.from_env(timeout=5)
        try:
            client.ping()
        finally:
            client.close()
    except Exception as exc:  # no socket, no permission, no daemon: all mean "no engine here"
        return f"no Docker engine answers ({type(exc).__name__}: {str(exc)[:160]}); run tools/docker_images.sh as root"
    return None


NO_ENGINE = why_not()


def marks() -> list[pytest.MarkDecorator]:
    """The ``docker`` marker, and a skip naming the reason where no engine answers (unless it is required)."""
    out = [pytest.mark.docker]
    if NO_ENGINE is not None and not REQUIRED:
        out.append(pytest.mark.skip(reason=NO_ENGINE))
    return out


def require() -> None:
    """Fail (CI, or CSL_DOCKER=required) when no engine answers: called by each Docker module's first fixture."""
    if NO_ENGINE is not None:
        pytest.fail(f"the Docker tier must run here (CI=true or CSL_DOCKER=required) but {NO_ENGINE}", pytrace=False)


def leftovers(label: str = f"{LABEL}={RUN_ID}") -> list[str]:
    """Containers, networks and volumes still carrying ``label``."""
    out = []
    for kind in ("container", "network", "volume"):
        args = ["docker", kind, "ls", "-q", *(["-a"] if kind == "container" else []), "--filter", f"label={label}"]
        ids = subprocess.run(args, capture_output=True, text=True, check=False, timeout=60).stdout.split()
        out += [f"{kind} {i}" for i in ids]
    return out


def remove_labelled(label: str = f"{LABEL}={RUN_ID}") -> None:
    """Remove whatever carries ``label`` (this run's only): containers first, then networks and volumes."""
    for entry in leftovers(label):
        kind, ident = entry.split()
        rm = {"container": ["rm", "-f", "-v"], "network": ["rm"], "volume": ["rm", "-f"]}[kind]
        subprocess.run(["docker", kind, *rm, ident], capture_output=True, check=False, timeout=120)


@contextlib.contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """While open, SIGTERM (a CI time-out, ``kill PID``) stops pytest as Ctrl-C does: fixtures are torn down, so
    this run's containers, networks and volumes are removed. Not always: a SIGTERM that landed while a worker
    container was starting was seen to end pytest with 143 and leave that test's containers (cause not found); they
    carry ``csl.run=RUN_ID``, as after a SIGKILL: ``docker rm -f $(docker ps -aq --filter label=csl.run=RUN_ID)``."""

    def on_term(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, on_term)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _remove_at_exit() -> None:
    with contextlib.suppress(Exception):  # at exit, best effort: what is left is named in sigterm_as_interrupt's doc
        remove_labelled()


def _cleanup_for_the_whole_session() -> None:
    """From the first import on (collection: before pytest-celery's session-scoped containers start, which a module
    fixture's handler came too late for), a SIGTERM stops pytest as Ctrl-C does, and at exit (after a SIGTERM, a
    failed set-up, any end but SIGKILL) whatever still carries this run's label is removed."""
    if NO_ENGINE is not None or threading.current_thread() is not threading.main_thread():
        return
    atexit.register(_remove_at_exit)
    if signal.getsignal(signal.SIGTERM) in (signal.SIG_DFL, None):

        def on_term(signum: int, frame: FrameType | None) -> None:
            raise KeyboardInterrupt(f"signal {signum}")

        signal.signal(signal.SIGTERM, on_term)


_cleanup_for_the_whole_session()
