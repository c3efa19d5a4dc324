"""``lock_on_duplicate="fail"``: a duplicate is an error: ``DuplicateTaskError`` naming the holder, at ``delay()``
in queue scope, else FAILURE at the worker (errbacks run)."""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

from .facts import Act, Decision, Facts

if TYPE_CHECKING:
    from . import Duplicate

__all__ = ["Fail"]


class Fail:
    name: ClassVar[str] = "fail"
    waits_in_line: ClassVar[bool] = False
    replaces: ClassVar[bool] = False
    hands_on: ClassVar[bool] = False
    raises: ClassVar[bool] = True

    def decide(self, f: Facts, remaining: float) -> Decision:
        return Decision(Act.FAIL_DUPLICATE)

    def act(self, duplicate: Duplicate, decision: Decision) -> None:
        duplicate.fail()
