"""What a duplicate does: one small module per policy, behind one interface.

A delivery whose lock another job holds is a duplicate. Its task's ``lock_on_duplicate`` names the policy; the
policy answers three questions, each at one place of a job's life:

* at ``apply_async`` in queue scope (``_enqueue``): does a duplicate call get the existing job (``waits_in_line``
  False), or is it sent, to wait at the worker (True)? Does it raise (``raises``)?
* in :func:`~celery_singleton_lock.decision.decide` (pure, no I/O): :meth:`Policy.decide`, the act for the facts;
* at the worker (``_delivery``): :meth:`Policy.act`, carried out through a :class:`Duplicate`, the delivery's
  side of the conversation (so a policy imports nothing of Celery).

Policies that wait (``reschedule``, ``replace``, ``cancel``) join the key's waiting line (``_line``), and their
holders' releases wake it. A new policy is a new module here, registered in :data:`POLICIES`; the config's
``DuplicatePolicy`` names it.
"""

from __future__ import annotations

from typing import Any, ClassVar, NoReturn, Protocol

from ..facts import Decision, Facts
from .cancel import Cancel
from .cooldown import COOLDOWN_FEATURE
from .fail import Fail
from .limit import LIMIT
from .replace import Replace
from .reschedule import Reschedule
from .skip import Skip
from .waiting import WAITING

__all__ = [
    "FEATURES",
    "POLICIES",
    "Cancel",
    "Duplicate",
    "Fail",
    "Feature",
    "Policy",
    "Replace",
    "Reschedule",
    "Skip",
    "policy_for",
]


class Duplicate(Protocol):
    """A duplicate delivery at the worker, as a policy sees it (implemented by the delivery room)."""

    @property
    def woken(self) -> bool:
        """This copy was woken from the key's line by a holder's release (and lost the race for the lock)."""

    def revoke(self) -> None:
        """Stop: REVOKED is stored at once, naming the holder (for a caller who can read it)."""

    def fail(self) -> NoReturn:
        """Fail the delivery with DuplicateTaskError naming the holder (FAILURE, errbacks run)."""

    def wait(self, countdown: float) -> None:
        """Re-send this delivery to run after ``countdown`` s, its fallback if no release wakes it first."""

    def back_in_line(self) -> None:
        """Stop quietly: a woken copy that lost the race waits in line again (its fallback copy is on its way)."""

    def stop_holder(self) -> None:
        """Ask the running holder to stop for this call (``cancel``): written on the lock nodes, seen by the holder's
        watchdog at its next renewal (see :mod:`.cancel`)."""


class Policy(Protocol):
    """One value of ``lock_on_duplicate``."""

    name: ClassVar[str]
    #: The duplicate waits for the holder, in the key's line (and is sent at enqueue, to wait at the worker).
    waits_in_line: ClassVar[bool]
    #: A newer waiting call takes an older one's place in the line (keep-latest).
    replaces: ClassVar[bool]
    #: A duplicate raises DuplicateTaskError (at ``delay()`` in queue scope, else FAILURE at the worker).
    raises: ClassVar[bool]

    def decide(self, f: Facts, remaining: float) -> Decision:
        """The act for a delivery whose lock another job holds, ``remaining`` s more (pure)."""

    def act(self, duplicate: Duplicate, decision: Decision) -> None:
        """Carry ``decision`` out at the worker."""


POLICIES: dict[str, Policy] = {p.name: p for p in (Skip(), Fail(), Reschedule(), Replace(), Cancel())}


class Feature(Protocol):
    """A feature behind the port: one module here owns its ``lock_*`` options, their checks, its hooks at the points
    of a call's and a delivery's life, and its scripts' rows in docs/protocol.md; the rooms reach it through here
    (and the options matrix holds its verdicts with the other options). Its hooks are its own methods, called by the
    room of that moment with what the room's context gives: ``cooldown`` at release (:meth:`Cooldown.at_release`),
    ``limit`` where a call's lock is made (:meth:`Limit.for_call`), ``max_waiting`` where a duplicate parks."""

    name: ClassVar[str]
    #: The task options it owns (the only place outside task.py's declarations and the matrix that names them).
    options: ClassVar[tuple[str, ...]]

    def check(self, cls: Any) -> None:
        """Refuse an invalid value of its options in one line (ConfigurationError), at registration and start."""


#: The features behind the port, in the order their option checks run.
FEATURES: tuple[Feature, ...] = (COOLDOWN_FEATURE, LIMIT, WAITING)


def policy_for(name: str) -> Policy:
    """The policy called ``name`` (one of ``DuplicatePolicy``; the config refuses any other at start)."""
    return POLICIES[name]
