"""What every benchmark records about the machine it ran on (shared by bench_lock.py and bench_task.py)."""

from __future__ import annotations

import importlib.metadata
import os
import platform
import subprocess
import sys
from datetime import datetime, timezone
from typing import Any

from celery_singleton_lock.testing import find_redis_server


def version(dist: str) -> str:
    """An installed distribution's version, or 'not installed'."""
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def environment(*dists: str) -> dict[str, Any]:
    """Date, machine, Python, redis-server, redis-py and hiredis, plus the versions of ``dists``."""
    binary = find_redis_server()
    try:
        server = subprocess.run(
            [binary, "--version"], capture_output=True, text=True, timeout=10, check=False
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError) as exc:
        server = f"unknown ({exc})"
    return {
        "date_utc": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "nproc": os.cpu_count(),
        "cpu_model": cpu_model(),
        "python": sys.version.split()[0],
        "redis_server": server,
        "redis_server_binary": binary,
        "redis_py": version("redis"),
        "hiredis": version("hiredis"),
        **{dist.replace("-", "_"): version(dist) for dist in dists},
    }
