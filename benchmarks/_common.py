"""What every benchmark records about the machine and the code it ran on, and the clocks they all read.

Read by the harness (harness.py: the rounds, the samples, the tables) and by every benchmark.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import json
import os
import platform
import resource
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from celery_singleton_lock.testing import RedisServer, find_redis_server, redis_servers


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


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def code_identity() -> dict[str, str]:
    """The commit, and a hash of the package's sources as they are on disk (they may differ from the commit).

    Of the package this process imports: this checkout's, or another's put first on ``PYTHONPATH`` (a worktree).
    """
    import celery_singleton_lock  # noqa: PLC0415 - the package's location, not this file's

    package = os.path.dirname(os.path.abspath(celery_singleton_lock.__file__))
    root = os.path.dirname(package)
    digest = hashlib.sha256()
    for name in sorted(os.listdir(package)):
        if name.endswith(".py"):
            with open(os.path.join(package, name), "rb") as f:
                digest.update(name.encode() + b"\0" + f.read())
    try:
        head = subprocess.run(
            ["git", "-C", root, "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10, check=False
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", root, "status", "--porcelain", "--", "celery_singleton_lock"],
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        head, dirty = "unknown", ""
    return {
        "git_head": head or "unknown",
        "package_modified": str(bool(dirty)),
        "package_sha256": digest.hexdigest()[:12],
        "package_path": package,
    }


def environment(*dists: str) -> dict[str, Any]:
    """Date, machine, Python, redis-server, redis-py and hiredis, the versions of ``dists``, and the code's identity
    (git HEAD, whether the package differs from it, a hash of its sources)."""
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
        **code_identity(),
    }


def percentile(sorted_values: list[int] | list[float], q: float) -> float:
    """Nearest-rank percentile of an already sorted list."""
    if not sorted_values:
        return float("nan")
    index = min(len(sorted_values) - 1, max(0, round(q * (len(sorted_values) - 1))))
    return float(sorted_values[index])


# --- clocks ---------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CpuStamp:
    """This process's CPU clocks at one moment: ``cpu`` (``time.process_time``, ns resolution, all threads) and the
    user/system split of ``getrusage`` (the kernel splits its precise total by tick samples: good over a second or
    more, not over one call)."""

    cpu: float
    user: float
    system: float

    @staticmethod
    def now() -> CpuStamp:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        return CpuStamp(time.process_time(), usage.ru_utime, usage.ru_stime)

    def __sub__(self, other: CpuStamp) -> CpuStamp:
        return CpuStamp(self.cpu - other.cpu, self.user - other.user, self.system - other.system)


def process_cpu_seconds(pid: int) -> float:
    """CPU time of another process's main thread: ``/proc/<pid>/schedstat`` (ns), else utime+stime of
    ``/proc/<pid>/stat`` (clock ticks). For redis-server the main thread is where commands and scripts run."""
    try:
        with open(f"/proc/{pid}/schedstat", encoding="ascii") as f:
            return int(f.read().split()[0]) / 1e9
    except (OSError, ValueError, IndexError):
        pass
    return stat_cpu_seconds(pid)


def stat_cpu_seconds(pid: int) -> float:
    """utime + stime of every thread of ``pid`` (``/proc/<pid>/stat``, clock ticks), in seconds."""
    with open(f"/proc/{pid}/stat", encoding="ascii") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # fields 14 and 15 of proc(5)


# --- CPU placement --------------------------------------------------------------------------------------------------

PIN_MODES = ("split", "same", "none")
PIN_HELP = (
    "CPU placement: 'split' (default) = this client on one CPU, the redis-servers on another: every round trip "
    "wakes the other CPU, as a reply from another host would, and the figures are steady; 'same' = client and "
    "servers share one CPU: no cross-CPU wake-ups, the cheapest round trips, so the client's own Python work weighs "
    "the most; 'none' = the scheduler decides, and on this VM it flips between the two (bimodal figures)"
)


@contextlib.contextmanager
def pinned_servers(count: int, pin: str, binary: str | None = None) -> Iterator[list[RedisServer]]:
    """``redis_servers(count, binary=binary)``, with this process and the servers placed on CPUs as ``pin`` says
    (see PIN_HELP).

    The servers inherit the affinity they are started with (every thread of theirs); threads this process starts
    later inherit the client's. The original affinity is restored on exit.
    """
    if pin not in PIN_MODES:
        raise ValueError(f"pin must be one of {PIN_MODES}, got {pin!r}")
    original = os.sched_getaffinity(0)
    cpus = sorted(original)
    if pin == "split" and len(cpus) < 2:
        pin = "same"
    try:
        if pin == "split":
            os.sched_setaffinity(0, {cpus[1]})
        elif pin == "same":
            os.sched_setaffinity(0, {cpus[0]})
        # Without a binary, the call older checkouts' redis_servers takes too (bench_check.py runs against them).
        with redis_servers(count, binary=binary) if binary else redis_servers(count) as servers:
            if pin == "split":
                os.sched_setaffinity(0, {cpus[0]})
            yield servers
    finally:
        os.sched_setaffinity(0, original)


def placement(servers: list[RedisServer]) -> dict[str, Any]:
    """Where this process and the servers may run (CPU sets), for the record."""
    out: dict[str, Any] = {"client_cpus": sorted(os.sched_getaffinity(0))}
    with contextlib.suppress(OSError):
        out["server_cpus"] = sorted({c for s in servers if s.process for c in os.sched_getaffinity(s.process.pid)})
    return out


def write_json(path: str, env: dict[str, Any], args: Any, **results: Any) -> None:
    """Write a run's record: its environment, command line and parsed arguments, then the script's own results."""
    with open(path, "w", encoding="utf-8") as f:
        json.dump({"environment": env, "argv": sys.argv, "args": vars(args), **results}, f, indent=2)
