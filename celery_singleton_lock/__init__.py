"""celery_singleton_lock: stop Celery tasks from running twice, on a Redlock with fencing tokens."""

from importlib.metadata import PackageNotFoundError, version

from ._startup import ConfigurationRefusedError
from .aio import AsyncRedlock
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
from .policies.rate import Rate
from .redlock import NodeSet, Redlock
from .task import LockedRequest, LockedTask, Skipped

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
