"""``lock_max_waiting``: at most this many duplicates wait in a key's line; a new one that finds it full is skipped.

One feature behind the port (:class:`~celery_singleton_lock.policies.Feature`): its option check, the cap the line
room hands its park script (lua/park.lua, lua/park_replacing.lua: the ``line`` rows of docs/protocol.md) and the
words a skipped duplicate and ``celery locks show`` say. The rest of the package names it only through here.
"""

from __future__ import annotations

from typing import Any, ClassVar

from ..errors import ConfigurationError
from .port import Feature

__all__ = ["WAITING", "MaxWaiting"]


class MaxWaiting(Feature):
    """``lock_max_waiting`` (a whole number >= 1; None: no cap). A waiting call's own re-sends never count as new."""

    name: ClassVar[str] = "max_waiting"
    options: ClassVar[tuple[str, ...]] = ("lock_max_waiting",)

    def check(self, cls: Any) -> None:
        """A whole number >= 1, or None. The policies it needs: the matrix's."""
        check_cap(cls.name, cls.lock_max_waiting)

    def cap(self, task: Any) -> int | None:
        """The task's cap (None: none, or not a LockedTask)."""
        return getattr(task, "lock_max_waiting", None)

    @staticmethod
    def full(waiting: int | None, cap: int | None) -> str:
        """Why a new duplicate that found its line full is skipped."""
        return f"({waiting} waiting, lock_max_waiting={cap})"

    @staticmethod
    def shown(cap: int | None) -> str:
        """What ``celery locks show`` adds to a line's length."""
        return f" (cap {cap}: lock_max_waiting)" if cap else ""


def check_cap(name: str, cap: object) -> None:
    """``lock_max_waiting`` of task ``name``: a whole number >= 1 (None: no cap)."""
    if cap is None:
        return
    if isinstance(cap, bool) or not isinstance(cap, int) or cap < 1:
        raise ConfigurationError(f"lock_max_waiting of {name} must be a whole number >= 1 (or None), got {cap!r}")


WAITING = MaxWaiting()
