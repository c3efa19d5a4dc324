"""One exception hierarchy for the package.

Every exception derives from :class:`LockError`; subclasses carry the context a
caller needs (the lock key, the holder, the nodes' errors) and have a useful
``str()``. None of them ever contains a password: node addresses are redacted
before they get here.
"""

from __future__ import annotations

import datetime
import email.utils
import time
from collections.abc import Sequence

__all__ = [
    "ConfigurationError",
    "DuplicateTaskError",
    "JobCancelledError",
    "LockError",
    "LockLostError",
    "LockNotAcquiredError",
    "LockUnavailableError",
    "RateLimitedError",
    "SlowDown",
    "UnserializableArgumentsError",
]


class LockError(Exception):
    """Base class of every error raised by celery_singleton_lock."""

    def __init__(self, message: str, *, key: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.key = key


class ConfigurationError(LockError, ValueError):
    """A setting or argument is invalid; the message says what to change."""


class LockNotAcquiredError(LockError):
    """The lock could not be acquired (held by someone else, or no quorum in time)."""

    def __init__(self, key: str, holder: str | None = None, node_errors: Sequence[str] = ()) -> None:
        parts = [f"could not acquire lock {key!r}"]
        if holder is not None:
            parts.append(f"held by {holder!r}")
        if node_errors:
            parts.append("node errors: " + "; ".join(node_errors))
        super().__init__(", ".join(parts), key=key)
        self.holder = holder
        self.node_errors = tuple(node_errors)
        # args are the constructor's, so the error survives pickling and Celery's result backends.
        self.args = (key, holder, list(node_errors))

    def __str__(self) -> str:
        return self.message


class LockUnavailableError(LockNotAcquiredError):
    """Too few Redis nodes answered to decide: the lock state is unknown."""


class LockLostError(LockError):
    """A lock we held is no longer ours (expired, deleted, or quorum lost)."""


class JobCancelledError(LockLostError):
    """The running job was asked to stop (``lock_on_duplicate="cancel"``: a newer call of its key, ``cancelled_by``).

    Raised inside the body where it can be (as ``lock_on_lost="interrupt"`` raises :class:`LockLostError`), and by
    ``self.check_lock()``; a body that lets it propagate ends REVOKED, its reason naming the newer call."""

    def __init__(self, key: str, cancelled_by: str, task_name: str = "") -> None:
        who = (
            f"(by {cancelled_by.removeprefix('cancel:')})"
            if cancelled_by.startswith("cancel:")
            else f"by a newer call, task {cancelled_by}"
        )
        super().__init__(f"{task_name} cancelled {who} (lock {key!r})", key=key)
        self.cancelled_by = cancelled_by
        self.task_name = task_name
        self.args = (key, cancelled_by, task_name)

    def __str__(self) -> str:
        return self.message


class DuplicateTaskError(LockError):
    """A task was skipped because a different job holds its lock."""

    def __init__(self, key: str, task_name: str = "", holder_task_id: str | None = None) -> None:
        super().__init__(
            f"duplicate of {task_name} skipped: lock {key!r} is held by task {holder_task_id}",
            key=key,
        )
        self.task_name = task_name
        self.holder_task_id = holder_task_id
        self.args = (key, task_name, holder_task_id)  # rebuilt as cls(*args) by pickle and Celery

    def __str__(self) -> str:
        return self.message


class UnserializableArgumentsError(LockError, TypeError):
    """A task's arguments cannot be encoded into a lock key."""


class RateLimitedError(LockError):
    """A task's start was refused by its ``lock_rate`` (``lock_on_rate_limit="fail"``, or an eager call)."""

    def __init__(self, key: str, task_name: str = "", rate: str = "", wait: float = 0.0) -> None:
        super().__init__(
            f"{task_name} not started: rate {rate} of {key!r} reached (the window lets one in after {wait:.3f} s)",
            key=key,
        )
        self.task_name = task_name
        self.rate = rate
        self.wait = wait
        self.args = (key, task_name, rate, wait)  # rebuilt as cls(*args) by pickle and Celery

    def __str__(self) -> str:
        return self.message


class SlowDown(LockError):
    """Raised by a body that a ``lock_rate``-limited API told to slow down (an HTTP 429): every start of the task's
    rate (every limit of this call, or only ``limit``: its index in ``lock_rate``, or its notation, ``"60/m"``)
    waits ``retry_after`` seconds, cluster-wide, and this call is re-sent to run once after the pause.

    ``SlowDown.from_retry_after(response.headers.get("Retry-After"))`` reads the header (seconds or an HTTP-date).
    """

    def __init__(self, retry_after: float, limit: int | str | None = None) -> None:
        if isinstance(retry_after, bool) or not isinstance(retry_after, int | float) or not retry_after >= 0:
            raise ValueError(f"SlowDown(retry_after=) must be a number of seconds >= 0, got {retry_after!r}")
        retry_after = min(float(retry_after), 30 * 86400.0)
        which = "" if limit is None else f" (limit {limit!r})"
        super().__init__(f"slow down: the task's rate{which} pauses for {retry_after:g} s")
        self.retry_after = retry_after
        self.limit = limit
        self.args = (retry_after, limit)  # rebuilt as cls(*args) by pickle and Celery

    def __str__(self) -> str:
        return self.message

    @classmethod
    def from_retry_after(
        cls, value: str | None, *, default: float = 1.0, limit: int | str | None = None, now: float | None = None
    ) -> SlowDown:
        """A SlowDown for an HTTP ``Retry-After`` header: delay seconds (``"120"``) or an HTTP-date (``"Wed, 21 Oct
        2015 07:28:00 GMT"``, relative to ``now``, Unix seconds, default the local clock); ``default`` seconds when
        it is missing or unreadable, never less than 0."""
        seconds = default
        text = (value or "").strip()
        if text.isdigit():
            seconds = float(text)
        elif text:
            try:
                when = email.utils.parsedate_to_datetime(text)
            except (TypeError, ValueError, IndexError):
                when = None
            if when is not None:
                if when.tzinfo is None:
                    when = when.replace(tzinfo=datetime.timezone.utc)
                seconds = when.timestamp() - (time.time() if now is None else now)
        return cls(max(0.0, seconds), limit)
