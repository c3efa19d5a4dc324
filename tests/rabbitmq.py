"""A throwaway RabbitMQ virtual host per test module (not a test module itself).

The tests use the RabbitMQ server of the machine (127.0.0.1, ``CSL_RABBITMQ_PORT`` or 5672, guest/guest) and keep
their runs apart with a vhost of their own, created and deleted with ``rabbitmqctl``. Where no RabbitMQ runs, the
tests skip with the reason; under ``CI=true`` they fail instead: CI must run them.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import uuid
from collections.abc import Iterator

import needs

PORT = int(os.environ.get("CSL_RABBITMQ_PORT", "5672"))


def unavailable() -> str | None:
    """Why RabbitMQ cannot be used here, or None."""
    if shutil.which("rabbitmqctl") is None:
        return "rabbitmqctl is not on PATH (RabbitMQ is not installed here)"
    try:
        with socket.create_connection(("127.0.0.1", PORT), timeout=2):
            pass
    except OSError as exc:
        return f"nothing answers on 127.0.0.1:{PORT} ({exc})"
    return None


def require() -> None:
    """Skip (or, under CI=true, fail) the calling test when RabbitMQ is not usable."""
    reason = unavailable()
    if reason is None:
        return
    needs.missing(f"RabbitMQ tests need a RabbitMQ server: {reason}", "the RabbitMQ tests")


def _ctl(*args: str) -> None:
    subprocess.run(["rabbitmqctl", "-q", *args], check=True, capture_output=True, timeout=60)


@contextlib.contextmanager
def vhost() -> Iterator[str]:
    """An empty vhost of this module's own; yields its broker URL. Deleted (with its queues) on exit."""
    require()
    name = f"csl-test-{uuid.uuid4().hex[:10]}"
    _ctl("add_vhost", name)
    try:
        _ctl("set_permissions", "-p", name, "guest", ".*", ".*", ".*")
        yield f"amqp://guest:guest@127.0.0.1:{PORT}/{name}"
    finally:
        with contextlib.suppress(subprocess.SubprocessError):
            _ctl("delete_vhost", name)
