"""A delivery's own state, a task's resolved options, and the headers the library's re-sent copies carry.

The lowest room of the Celery side: every other one (enqueue, delivery, line, hand-over) reads these, and this
module reads nothing of theirs.
"""

from __future__ import annotations

import os
import socket
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .config import DuplicatePolicy, LockSettings, LostPolicy, UnavailablePolicy

if TYPE_CHECKING:
    from ._monitoring import Skipped
    from .interrupt import Target
    from .keys import Binder
    from .policies import Policy
    from .policies.rate import Rate
    from .redlock import Redlock
    from .renewal import Lease

__all__ = [
    "ATTEMPT_HEADER",
    "CLAIM_HEADER",
    "DEBOUNCE_HEADER",
    "DONE_MARGIN",
    "END_LEASE",
    "HOST",
    "OWN_HEADERS",
    "PARKED_HEADER",
    "RATE_HEADER",
    "REDELIVERY_HEADER",
    "RESERVED_HEADER",
    "SETTLE_HEADER",
    "SINCE_HEADER",
    "VERSION_HEADER",
    "WOKEN_HEADER",
    "Options",
    "Run",
    "is_locked_task",
    "mark_joined",
    "since",
    "text",
    "try_of",
    "worker_id",
]

#: Seconds of the lease that ends a killed or revoked run's hold (nobody renews it).
END_LEASE = 1.0
HOST = socket.gethostname()
_worker = f"{os.getpid()}@{HOST}"


def _after_fork() -> None:
    global _worker  # noqa: PLW0603 - one per process
    _worker = f"{os.getpid()}@{HOST}"


os.register_at_fork(after_in_child=_after_fork)


def worker_id() -> str:
    """The holder record's ``worker`` field: this process (a prefork child, not the parent that imported us)."""
    return _worker


ATTEMPT_HEADER = "singleton_lock_attempt"  # earlier re-sends of this delivery for want of a quorum
REDELIVERY_HEADER = "singleton_lock_waited"  # a copy of a job that may have run: it asks before it runs
SETTLE_HEADER = "singleton_lock_settle"  # the second look of a copy that found its job done and no result stored
# A rescheduled duplicate's copies: the fallback re-send ("parked") and the copy a releasing holder wakes ("woken").
PARKED_HEADER = "singleton_lock_parked"
WOKEN_HEADER = "singleton_lock_woken"
SINCE_HEADER = "singleton_lock_since"  # when a call first reached a worker (ms): "replace" keeps the newest
RESERVED_HEADER = "singleton_lock_reserved"  # queue scope: published under a reservation made at apply_async
DEBOUNCE_HEADER = "singleton_lock_debounce"  # lock_debounce: a burst's job message (the seq of the call it carries)
VERSION_HEADER = "singleton_lock_version"  # lock_debounce: the stamp of the call whose arguments a message carries
CLAIM_HEADER = "singleton_lock_debounce_claims"  # lock_debounce: claims re-sent for want of the nodes holding versions
RATE_HEADER = "singleton_lock_rate_waits"  # lock_rate: how many times this call waited for the window
#: A retry is a new attempt: it inherits none of these (see LockedTask.retry).
OWN_HEADERS = frozenset(
    {
        ATTEMPT_HEADER,
        REDELIVERY_HEADER,
        SETTLE_HEADER,
        PARKED_HEADER,
        WOKEN_HEADER,
        SINCE_HEADER,
        RESERVED_HEADER,
        DEBOUNCE_HEADER,
        VERSION_HEADER,
        CLAIM_HEADER,
        RATE_HEADER,
    }
)
#: A finished job's done marker outlives the longest wait we create (a ttl), or the broker's visibility timeout,
#: by this margin: a copy that starts this much later than it was due may run the job again (without a backend).
DONE_MARGIN = 300.0


def is_locked_task(task: Any) -> bool:
    """``task`` is a LockedTask (told without importing the task module, which imports the rooms that ask)."""
    return getattr(task, "_singleton_lock_task", False) is True


@dataclass
class Run:
    """Per-delivery state, kept on the request (one Task instance serves every thread of a process)."""

    key: str
    task_id: str = ""
    retries: int = 0  # the request's retries (read once: each ``self.request`` is a thread-local stack lookup)
    lock: Redlock | None = None
    lease: Lease | None = None
    outcome: Skipped | None = None
    entered: bool = False
    redelivered: bool = False  # the broker redelivered it, or we re-sent it to wait for its twin
    handover_ttl: float | None = None  # retry(throw=False): hand over when the body ends, for this long
    parked: bool = False  # this delivery's job waits in the key's waiting line (see _line.park)
    superseded_by: str | None = None  # "replace": the newer job that took this one's place in the line
    interrupt: Target | None = None  # lock_on_lost="interrupt": the body to interrupt when the lock is lost
    line_full: int | None = None  # lock_max_waiting: the length of the full line this new duplicate found
    debounced: tuple[Any, Any] | None = None  # lock_debounce: the (args, kwargs) of the burst's last call
    rate_key: str | None = None  # lock_rate: the key of the rate this delivery's start counts under
    rate_at: float | None = None  # lock_rate: when this start was counted, by a counting node's clock (Unix s)
    rate_slot: tuple[int, dict[int, float]] | None = (
        None  # lock_rate: the slot held, and each holding node's count time
    )
    rate_token: str = ""  # lock_rate: the owner token of this delivery's counted start (to uncount it)
    limit: int | None = 1  # the run's lock_limit (a callable's answer for this call); None: no lock, a rate only


@dataclass(frozen=True)
class Options:
    """A task's resolved options: the app's settings overlaid with the task's ``lock_*`` attributes."""

    settings: LockSettings
    ttl: float
    interval: float
    on_duplicate: DuplicatePolicy
    policy: Policy  # what a duplicate of this task does: the policy called on_duplicate
    on_unavailable: UnavailablePolicy
    on_lost: LostPolicy
    binder: Binder | None  # the body's signature, ready to bind calls to (None: no usable signature)
    max_countdown: float | None  # half the broker's visibility timeout, if it has one
    done_window: float  # how long a finished job's done marker lives when a copy of it is known to wait
    done_window_short: float  # ... and when none is
    whole_seconds: bool  # countdowns go through native delayed delivery (RabbitMQ quorum queues): whole seconds >= 1
    max_waiting: int | None = None  # lock_max_waiting: at most this many new duplicates wait in the key's line
    rate: Rate | None = None  # lock_rate, parsed (None: no rate)
    on_rate_limit: str = "wait"  # lock_on_rate_limit

    @property
    def waits_in_line(self) -> bool:
        """A duplicate waits in its key's line, woken by a holder's release (only these policies' holders wake it)."""
        return self.policy.waits_in_line


def mark_joined(result: Any, holder_id: str | None) -> Any:
    """Say on the ``AsyncResult`` a call returns whether it joined an existing job: ``result.joined`` (bool) and
    ``result.holder_id`` (that job's task id, also ``result.id``; None for a new job). Plain attributes of this one
    object: it stays the app's own ``AsyncResult`` class, pickled and serialized as before (without them)."""
    try:
        result.joined = holder_id is not None
        result.holder_id = holder_id
    except (AttributeError, TypeError):  # a result class of the app's own that takes no attributes: left as it is
        pass
    return result


def since(request: Any) -> int:
    """When this call first reached a worker (ms), carried by its re-sent copies; now for a first delivery."""
    value = getattr(request, SINCE_HEADER, None)
    return int(value) if isinstance(value, int | str) and str(value).isdigit() else int(time.time() * 1000)


def text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def try_of(record: dict[str, str]) -> int | None:
    """The holder record's ``try`` (its delivery's retries), None when absent or not a plain decimal number."""
    value = record.get("try", "")
    return int(value) if value.isascii() and value.isdigit() else None
