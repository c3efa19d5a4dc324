"""``lock_on_duplicate="replace"`` (keep-latest): like ``reschedule``, but at most one call waits per key: a newer
duplicate takes the waiting one's place (REVOKED, "superseded by"). Calls are ordered by when they first reached a
worker (every re-sent copy carries it); the line's script (lua/park_replacing) decides who is newer, atomically.
"""

from __future__ import annotations

from typing import ClassVar

from .reschedule import Reschedule

__all__ = ["Replace"]


class Replace(Reschedule):
    name: ClassVar[str] = "replace"
    replaces: ClassVar[bool] = True
