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

from typing import ClassVar, NoReturn, Protocol

from .cancel import Cancel
from .cooldown import COOLDOWN_FEATURE
from .debounce import DEBOUNCE_FEATURE
from .facts import Decision, Facts
from .fail import Fail
from .fair import FAIR
from .limit import LIMIT
from .port import NOT_ANSWERED, Call, Delivery, Feature, Hooks, conf_of, hooks_of
from .rate import RATE_FEATURE
from .replace import Replace
from .reschedule import Reschedule
from .skip import Skip
from .waiting import WAITING

__all__ = [
    "FEATURES",
    "NOT_ANSWERED",
    "POLICIES",
    "SENDING",
    "Call",
    "Cancel",
    "Delivery",
    "Duplicate",
    "Fail",
    "Feature",
    "Hooks",
    "Policy",
    "Replace",
    "Reschedule",
    "Skip",
    "conf_of",
    "hooks_of",
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

    def stop_holder(self) -> str:
        """Ask the running holder to stop for this call (``cancel``): written on the lock nodes, seen by the holder's
        watchdog at its next renewal (see :mod:`.cancel`). "asked", "newer" (the holder's call is newer than this
        one: nothing asked) or "none" (no running holder of that job)."""

    def superseded(self) -> None:
        """Stop: this call is superseded by the holder's newer call (REVOKED "superseded by"), and leaves the line."""


class Policy(Protocol):
    """One value of ``lock_on_duplicate``."""

    name: ClassVar[str]
    #: The duplicate waits for the holder, in the key's line (and is sent at enqueue, to wait at the worker).
    waits_in_line: ClassVar[bool]
    #: A newer waiting call takes an older one's place in the line (keep-latest).
    replaces: ClassVar[bool]
    #: A run stopped for a newer call hands its lock to the newest waiting call, never freeing it (``cancel``).
    hands_on: ClassVar[bool]
    #: A duplicate raises DuplicateTaskError (at ``delay()`` in queue scope, else FAILURE at the worker).
    raises: ClassVar[bool]

    def decide(self, f: Facts, remaining: float) -> Decision:
        """The act for a delivery whose lock another job holds, ``remaining`` s more (pure)."""

    def act(self, duplicate: Duplicate, decision: Decision) -> None:
        """Carry ``decision`` out at the worker."""


POLICIES: dict[str, Policy] = {p.name: p for p in (Skip(), Fail(), Reschedule(), Replace(), Cancel())}


#: The features behind the port (:class:`~celery_singleton_lock.policies.port.Feature`), in the order their option
#: checks run and their hooks are called (see policies/port.py for the hooks and where the rooms call them).
FEATURES: tuple[Feature, ...] = (COOLDOWN_FEATURE, LIMIT, WAITING, FAIR, RATE_FEATURE, DEBOUNCE_FEATURE)
#: The features that may answer a call at ``apply_async`` (``at_send``): LockedTask's plain path asks them only.
SENDING: tuple[Feature, ...] = tuple(f for f in FEATURES if type(f).at_send is not Feature.at_send)


def policy_for(name: str) -> Policy:
    """The policy called ``name`` (one of ``DuplicatePolicy``; the config refuses any other at start)."""
    return POLICIES[name]
