"""``lock_fair_on``: fair turns. A key's waiting line is served round-robin across the values of these arguments.

Several tenants share a key's slots (``lock_unique_on`` without the tenant, or a ``lock_group``; ``lock_limit=N``;
``lock_on_duplicate="reschedule"``): without this, a waiting call is woken in the order calls first reached a worker,
so 1,000 calls of tenant A queued before tenant B's 10 make B wait for all of them. With ``lock_fair_on=["tenant"]``
each waiting call's place in the line is its value's next *turn* (virtual-time fair queueing, lua/park_fair.lua):

- a value's next turn is the turn after its last one, or the line's current turn (the turn of the call served last)
  when that is later: a value that arrives late is owed no backlog, one that was idle gets no credit, one whose last
  call just ran takes the next turn;
- the line pops the lowest turn first (lua/pop_waiter.lua), so each turn serves at most one call of each value; at
  most the key's limit of woken calls are on their way at once.

A slot runs a call only on its turn (lua/fair_turn.lua): nobody waits, or its place is the lowest of every call
waiting in the line or woken and on its way (being woken gives no right of its own); otherwise it parks at its
place, gives the slot back, and wakes the head. The line's node counts each start and notes when each call joined,
so a call's turns waited are counted where they happen (:class:`Turn`, in ``run.state["fair"]``). The bound and its
argument (docs/policies.md, "Fair turns"): a call that joined the line with ``k`` calls of its own value waiting
waits at most ``(k + 2) * (W - 1) + k + L - 1`` starts (``W`` values, ``L`` the limit): 3k + 5 for three tenants on
two slots. The line's node down: the turn cannot be read, and every call runs when it gets a slot, in any order, none
lost (each waiting call keeps its fallback copy). A feature imports nothing of Celery: the rooms call
:meth:`FairTurns.after_lock`, and the line (``_line``) asks :meth:`FairTurns.value`.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, ClassVar

from ..errors import ConfigurationError
from ..lock.keys import lock_key
from ..lock.record import sibling_key
from ..lock.scripts import FAIR_TURN_CODE
from .port import Delivery, Feature, check_names, parameters

__all__ = ["FAIR", "FairConf", "FairTurns", "Turn"]

logger = logging.getLogger("celery_singleton_lock.task")

#: A turn's width in a line's scores: score = turn * TURN + the order of parking within the turn.
TURN = 1_000_000


@dataclass(frozen=True)
class FairConf:
    """A task's resolved ``lock_fair_on``: the argument names whose values take turns."""

    on: tuple[str, ...]


class FairTurns(Feature):
    """``lock_fair_on`` (a list of argument names of the task; None: arrival order)."""

    name: ClassVar[str] = "fair"
    options: ClassVar[tuple[str, ...]] = ("lock_fair_on",)
    scripts: ClassVar[tuple[str, ...]] = ("park_fair", "unpark_fair", "fair_turn")

    def check(self, cls: Any) -> None:
        """A non-empty list of the task's argument names, none of which makes the key (a key per value would give
        each value a line of its own: nothing to share). The policies and options it needs: the matrix's."""
        on = cls.lock_fair_on
        if on is None:
            return
        option = self.options[0]
        if isinstance(on, str) or not on or not all(isinstance(n, str) for n in on):
            raise ConfigurationError(f"{option} of {cls.name} must be a non-empty list of argument names")
        check_names(cls, option, on, parameters(cls))
        unique = cls.lock_unique_on
        inside = [n for n in on if unique is not None and cls.lock_key is None and n in unique]
        if inside:  # without lock_unique_on or lock_key, the matrix refuses it (a key per call: nothing shared)
            raise ConfigurationError(
                f"{option} of {cls.name} names {inside}, which make the lock key: each value gets its own key and "
                f"line, so there are no turns to share; set lock_unique_on to the other arguments (or [])"
            )

    def active(self, cls: Any) -> bool:
        return getattr(cls, "lock_fair_on", None) is not None

    def resolve(self, task: Any) -> FairConf:
        return FairConf(tuple(task.lock_fair_on))

    def value(self, options: Any, args: Any, kwargs: Any) -> str | None:
        """The value of a call's fair arguments, as the line stores it (a short hash); None: the task is not fair."""
        conf: FairConf | None = options.conf.get(self.name)
        if conf is None:
            return None
        return lock_key("", "", options.binder, args or (), kwargs or {}, unique_on=list(conf.on)).rsplit(":", 1)[-1]

    @staticmethod
    def keys(key: str) -> tuple[str, str]:
        """The line's turns (hash) and the woken jobs on their way (sorted set), beside the line of ``key``."""
        return sibling_key(key, ":turns"), sibling_key(key, ":woken")

    def after_lock(self, delivery: Delivery) -> bool:
        """A slot runs a call only on its turn (lua/fair_turn.lua): else the call waits in line at its place.

        True: the body runs (its turn, nobody waits, or the line cannot be read: any order then, none lost), with
        :class:`Turn` in ``run.state["fair"]``; False: it parked, gave the slot back and woke the head when needed
        (``Delivery.wait_turn``).
        """
        if delivery.lock is None:
            return True
        ctx, run = delivery.ctx, delivery.run
        options = ctx.options
        try:
            client = options.settings.nodes.clients[0]
            line = sibling_key(run.key, ":waiters")
            turns, woken_key = self.keys(run.key)
            answer = client.eval(
                FAIR_TURN_CODE, 3, line, woken_key, turns, run.task_id, int(time.time() * 1000), run.limit or 1
            )
        except Exception:  # the line's node down: no turns to keep, the call runs on the slot it has
            logger.debug("cannot read the fair turn of lock %s: running", run.key, exc_info=True)
            return True
        if int(answer[0]) == 1:
            self._note(run, Turn(*(int(x) for x in answer[1:4])))
            return True
        if delivery.wait_turn(wake=int(answer[0]) == 2):
            return False
        # lock_max_waiting: the line is full, and this call runs on the slot it holds, out of its turn: the start
        # is counted all the same, so every call's count of turns waited stays true.
        try:
            start = int(client.hincrby(turns, "starts", 1)) if client.exists(turns) else 0
        except Exception:  # the count is the line's node's: unreachable, nothing to count on
            logger.debug("cannot count the start of lock %s", run.key, exc_info=True)
            start = 0
        self._note(run, Turn(start, -1, -1))
        return True

    def _note(self, run: Any, turn: Turn) -> None:
        if run.state is None:
            run.state = {}
        run.state[self.name] = turn


@dataclass(frozen=True)
class Turn:
    """A call's wait in its key's fair line, counted by the line's node (``run.state["fair"]`` when it ran)."""

    start: int  #: its number among the line's starts (0: not counted, nobody had parked lately)
    waited: int  #: the line's starts between this call first joining it and its own start (-1: it never joined)
    ahead: int  #: the calls of its own value that waited (in line or on their way) when it joined (-1: never)


FAIR = FairTurns()
