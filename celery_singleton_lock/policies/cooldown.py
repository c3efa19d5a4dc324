"""``lock_cooldown``: the job stays locked this many seconds after a *success* ("at most once per cooldown").

One feature behind the port (:class:`~celery_singleton_lock.policies.Feature`): its option check, what a release
does with it (the ``cooldown`` state of the holder record: docs/protocol.md, lua/task_release.lua), and what the
doctor asks of it (its records must outlive a node's restart). The rest of the package names it only through here.
"""

from __future__ import annotations

from typing import Any, ClassVar

from ..errors import ConfigurationError
from .port import Feature

__all__ = ["COOLDOWN_FEATURE", "Cooldown"]


class Cooldown(Feature):
    """``lock_cooldown`` (seconds, default 0: no cooldown). A failure never holds the lock."""

    name: ClassVar[str] = "cooldown"
    options: ClassVar[tuple[str, ...]] = ("lock_cooldown",)

    def check(self, cls: Any) -> None:
        """A number of seconds >= 0."""
        value = cls.lock_cooldown
        if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
            raise ConfigurationError(f"lock_cooldown of {cls.name} must be a number of seconds >= 0, got {value!r}")

    def active(self, cls: Any) -> bool:
        return bool(cls.lock_cooldown)

    def resolve(self, task: Any) -> float:
        """The cooldown a success starts (resolved once, into the task's options)."""
        return float(task.lock_cooldown)

    def at_release(self, ctx: Any, run: Any, *, succeeded: bool) -> float:
        """How long the released lock stays held (as ``cooldown``): only after a success."""
        return float(ctx.options.conf[self.name]) if succeeded else 0.0

    def keeps_records(self, task: Any) -> bool:
        """The task's promise rests on records kept across time (no second run within the cooldown)."""
        return bool(getattr(task, "lock_cooldown", 0))


COOLDOWN_FEATURE = Cooldown()
