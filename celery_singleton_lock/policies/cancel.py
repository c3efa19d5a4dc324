"""``lock_on_duplicate="cancel"`` (newest wins, also while it runs): a newer call of a key that is running asks the
running job to stop, and runs after it has stopped, never beside it.

The whole of it, in the order it happens::

    newer call's delivery   its acquire is refused (held by job A, running): it asks A to stop (``ask``: cancel.lua
      |                     writes the record's ``cancel`` field, the newer call's task id, on every node), then
      |                     waits in the key's line as with "replace": the newest waiting call keeps its place,
      |                     the ones in between are superseded (REVOKED, "superseded by")
    A's watchdog            its next renewal's answer carries the request (extend.lua answers the field's value in
      |                     place of EXTENDED: the same round trip, nothing more for a lease nobody asked): the run
      |                     is told (``seen``), and its body is interrupted with JobCancelledError the way
      |                     ``lock_on_lost="interrupt"`` does (prefork and solo: a signal to the main thread;
      |                     gevent: thrown into the body's greenlet)
    A's body ends           ``stopped``: REVOKED, "cancelled by a newer call, task <id>"; counted ``cancelled``; A's
      |                     release frees the lock and wakes the line: the newer call runs, with its own arguments
    a body that goes on     (C code, a swallowed exception) one renewal interval of grace, then its lease is no
                            longer renewed: it ends by itself, and the newer call runs then, with a greater fencing
                            token than A's (a store that checks tokens refuses A's late writes)

Threads and eventlet pools: Python cannot raise in another thread, so the body is not interrupted there (a warning,
as for ``lock_on_lost="interrupt"``); ``self.check_lock()`` raises JobCancelledError once the request was seen (the
body's flag to check), and the grace above still keeps the newer call from ever running beside it. Not refused at
registration: the pool is the worker's, not the task's (unknown when the task is registered).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, ClassVar

from ..errors import JobCancelledError
from ..scripts import CANCEL
from .replace import Replace

if TYPE_CHECKING:
    from ..facts import Decision
    from ..nodes import NodeSet
    from . import Duplicate

__all__ = ["Cancel", "ask", "error_for"]

logger = logging.getLogger("celery_singleton_lock.task")


class Cancel(Replace):
    name: ClassVar[str] = "cancel"

    def act(self, duplicate: Duplicate, decision: Decision) -> None:
        if not duplicate.woken:
            # A woken copy found another job (the newest waiting one's) already running: nothing to ask of it.
            duplicate.stop_holder()
        super().act(duplicate, decision)


def ask(nodes: NodeSet, key: str, holder: str, by: str) -> bool:
    """Ask job ``holder``, running under ``key``, to stop for task ``by``: True when a node marked its record.

    Written on every node that answers (a request, not a vote: the holder acts on one node's word); a node that does
    not answer loses nothing but speed (the others carry it). Never raises: a request that reached no node leaves
    the newer call waiting for the holder's end, as "replace" would."""
    try:
        answers = nodes.run(CANCEL, (key,), (holder, by))
    except Exception:
        logger.debug("asking %s to stop failed", holder, exc_info=True)
        return False
    return any(a == 1 for a in answers if not isinstance(a, BaseException))


def error_for(key: str, by: str, task_name: str) -> JobCancelledError:
    """The error a cancelled body is interrupted with (and ``check_lock()`` raises)."""
    return JobCancelledError(key, by, task_name)


def reason(task_name: str, key: str, by: str) -> str:
    """What the stopped run's REVOKED state says (Flower, the result backend, ``AsyncResult.get()``)."""
    return f"cancelled by a newer call, task {by}: {task_name} of lock {key} stopped so that it runs next"


def cancelled_by(exc: BaseException) -> Any:
    """The task id a :class:`JobCancelledError` names, else None (any other exception)."""
    return exc.cancelled_by if isinstance(exc, JobCancelledError) else None
