"""celery_singleton_lock: stop Celery tasks from running twice, on a Redlock with fencing tokens."""

from importlib.metadata import PackageNotFoundError, version

from .errors import (
    ConfigurationError,
    DuplicateTaskError,
    JobCancelledError,
    LockError,
    LockLostError,
    LockNotAcquiredError,
    LockUnavailableError,
    RateLimitedError,
    SlowDown,
    UnserializableArgumentsError,
)
from .lock.aio import AsyncRedlock
from .lock.redlock import NodeSet, Redlock
from .policies.rate import Rate
from .task import LockedRequest, LockedTask, Skipped
from .task._startup import ConfigurationRefusedError

try:
    __version__ = version("celery-singleton-lock")
except PackageNotFoundError:  # pragma: no cover - running from a source tree without install
    __version__ = "0.0.0"

__all__ = [
    "AsyncRedlock",
    "ConfigurationError",
    "ConfigurationRefusedError",
    "DuplicateTaskError",
    "JobCancelledError",
    "LockError",
    "LockLostError",
    "LockNotAcquiredError",
    "LockUnavailableError",
    "LockedRequest",
    "LockedTask",
    "NodeSet",
    "Rate",
    "RateLimitedError",
    "Redlock",
    "Skipped",
    "SlowDown",
    "UnserializableArgumentsError",
    "__version__",
]
