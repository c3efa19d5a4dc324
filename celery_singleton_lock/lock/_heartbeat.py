"""The liveness file's writer (stdlib only: the watchdog imports it, and it imports nothing of the package).

What the file says and how a probe judges it: :mod:`celery_singleton_lock.health`.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import tempfile
import time

__all__ = ["write_heartbeat"]

_HOST = socket.gethostname()


def write_heartbeat(path: str, *, role: str, due_in: float, leases: int = 0, overdue: float = 0.0) -> None:
    """Atomically (write a sibling, then rename) record that this process is alive and writes again within ``due_in``
    seconds. Errors propagate to the caller (which logs them without stopping)."""
    now = time.time()
    data = {
        "pid": os.getpid(),
        "host": _HOST,
        "role": role,
        "at": round(now, 3),
        "due": round(now + due_in, 3),
        "leases": leases,
        "overdue": round(max(0.0, overdue), 3),
    }
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".liveness-", dir=directory)
    try:
        with os.fdopen(fd, "w") as out:
            json.dump(data, out)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
