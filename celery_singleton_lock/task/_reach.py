"""Saying at once when lock nodes do not answer: at worker and beat start (a probe), and at a queue-scope producer
whose reservation found no quorum (at most once per :data:`NO_QUORUM_EVERY` seconds per node set, not per call).

Warnings, never refusals: nodes may come up after the worker or beat. Nodes are named by their redacted addresses
(:attr:`~celery_singleton_lock.nodes.NodeSet.names`), never by a URL with its password.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from ..lock.nodes import NodeError, NodeSet
from ..lock.scripts import READ as _READ

if TYPE_CHECKING:
    from ..lock.aio import AsyncNodes

__all__ = ["NO_QUORUM_EVERY", "no_quorum_at_producer", "probe", "reach_line", "warn_unreachable"]

logger = logging.getLogger("celery_singleton_lock.task")

#: Seconds between two producer warnings about the same node set having no quorum.
NO_QUORUM_EVERY = 60.0

_last_said: dict[tuple[str, ...], float] = {}
_said_lock = threading.Lock()


def probe(nodes: NodeSet) -> list[NodeError]:
    """The nodes that do not answer now (one read-only script call on every node at once: at most one socket
    timeout in all)."""
    try:
        answers = nodes.run(_READ, (), (1,))
    except Exception as exc:  # a probe must never stop a worker or beat
        return [nodes.error(i, exc) for i in range(len(nodes))]
    return [nodes.error(i, a) for i, a in enumerate(answers) if isinstance(a, BaseException)]


def reach_line(nodes: NodeSet, down: Sequence[NodeError]) -> tuple[int, str]:
    """The log level and line for ``down`` unreachable nodes of ``nodes`` (empty line: all answer)."""
    if not down:
        return logging.INFO, ""
    total, up = len(nodes), len(nodes) - len(down)
    named = ", ".join(f"{x.node} ({x.error.splitlines()[0][:160]})" for x in down)
    head = f"celery_singleton_lock: {len(down)} of {total} lock node(s) unreachable: {named}; "
    if up >= nodes.quorum:
        return logging.WARNING, head + f"quorum {nodes.quorum} of {total} still reachable ({up} answer)"
    return logging.ERROR, head + (
        f"NO QUORUM: {up} of {total} answer, {nodes.quorum} needed: no lock can be taken until they do (each task "
        "follows its lock_on_unavailable); check the addresses, passwords and that the nodes are up"
    )


def warn_unreachable(nodes: NodeSet, who: str) -> list[NodeError]:
    """Probe ``nodes`` and log (``who``: "worker", "beat") which do not answer and whether a quorum still does."""
    down = probe(nodes)
    level, line = reach_line(nodes, down)
    if line:
        logger.log(level, "%s at %s start (a warning: nodes may come up later)", line, who)
    return down


def no_quorum_at_producer(task_name: str, nodes: NodeSet | AsyncNodes, errors: Sequence[NodeError], what: str) -> bool:
    """Log, at most once per :data:`NO_QUORUM_EVERY` s per node set, that a producer's ``what`` found no quorum
    (``errors``: the nodes that did not answer). True when this call logged."""
    total = len(nodes.names)
    if total - len(errors) >= nodes.quorum:
        return False
    now = time.monotonic()
    with _said_lock:
        last = _last_said.get(nodes.names)
        if last is not None and now - last < NO_QUORUM_EVERY:
            return False
        _last_said[nodes.names] = now
    named = ", ".join(x.node for x in errors)
    logger.warning(
        "celery_singleton_lock: %s: %s found no quorum of lock nodes (%d of %d answer, %d needed; not answering: %s): "
        "the message is published unreserved, so a duplicate call becomes a second message (the worker's check "
        "still guards the run); said at most once every %gs",
        task_name,
        what,
        total - len(errors),
        total,
        nodes.quorum,
        named,
        NO_QUORUM_EVERY,
    )
    return True
