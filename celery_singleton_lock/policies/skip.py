"""``lock_on_duplicate="skip"`` (the default): a duplicate does not run; its caller learns so at once (REVOKED,
naming the holder); its link callbacks and chain do not run."""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

from .facts import Act, Decision, Facts

if TYPE_CHECKING:
    from . import Duplicate

__all__ = ["Skip"]


class Skip:
    name: ClassVar[str] = "skip"
    waits_in_line: ClassVar[bool] = False
    replaces: ClassVar[bool] = False
    hands_on: ClassVar[bool] = False
    raises: ClassVar[bool] = False

    def decide(self, f: Facts, remaining: float) -> Decision:
        return Decision(Act.SKIP)

    def act(self, duplicate: Duplicate, decision: Decision) -> None:
        duplicate.revoke()
