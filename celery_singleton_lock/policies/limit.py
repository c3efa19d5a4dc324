"""``lock_limit``: at most this many runs of one key at once (default 1: never two at once; None: no lock at all).

One feature behind the port (:class:`~celery_singleton_lock.policies.Feature`): its option check, the limit of a
call (a number, or a function's answer for the call's arguments), the slots a lock looks at, and whether the
main process's skip before the pool applies. Its scripts are the lock's own (slots: docs/protocol.md, the ``slot``
rows). The rest of the package names it only through here.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

from ..errors import ConfigurationError
from .port import Feature

__all__ = ["LIMIT", "Limit"]


class Limit(Feature):
    """``lock_limit``: an int >= 1, a function of the call's arguments returning one, or None (a rate only)."""

    name: ClassVar[str] = "limit"
    options: ClassVar[tuple[str, ...]] = ("lock_limit",)

    def check(self, cls: Any) -> None:
        """A whole number >= 1, a function, or None."""
        limit = cls.lock_limit
        if (
            limit is not None
            and not callable(limit)
            and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1)
        ):
            raise ConfigurationError(f"lock_limit of {cls.name} must be a whole number >= 1 or None, got {limit!r}")

    # ``cls``: the task's class (``__class__``: a callable lock_limit read on the class is not bound as a method).

    def static(self, cls: Any) -> int:
        """The limit a lock takes when no call's answer is known: the number, else 1."""
        limit = cls.lock_limit
        return limit if isinstance(limit, int) else 1

    def varies(self, cls: Any) -> bool:
        """The limit is a function: each call's key may have its own."""
        return callable(cls.lock_limit)

    def plain(self, cls: Any) -> bool:
        """The default: one run at a time (what the main process's skip before the pool knows how to check)."""
        return bool(cls.lock_limit == 1)

    def for_call(self, cls: Any, name: str, args: Sequence[Any], kwargs: Mapping[str, Any]) -> int | None:
        """The limit of a call with these arguments: the option, or the function's answer for them."""
        limit = cls.lock_limit
        if not callable(limit):
            return limit  # type: ignore[no-any-return]
        value = limit(*args, **kwargs)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigurationError(f"lock_limit of {name} must return a whole number >= 1, got {value!r}")
        return value


LIMIT = Limit()
