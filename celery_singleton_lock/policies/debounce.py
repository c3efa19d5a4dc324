"""``lock_debounce=S`` (and ``lock_debounce_max=M``): a burst of calls of one job runs once, S s after its last
call, with the last call's arguments; BullMQ's debounce mode (delay + extend + replace) is the model.

The burst lives on the lock nodes, never only in a process (docs/protocol.md, "Debounce"):

* at ``apply_async`` (the front door, ``_debounced.send``): one round trip (``lua/debounce_join``) starts the key's
  burst, whose job is this call's task id (its message is published with a countdown of S), or joins the burst
  under way (its due time moves to S from now, at most M after its first call; its arguments become this call's;
  nothing is published, and the call gets the burst's ``AsyncResult``);
* at the worker: the job's message takes the key's lock as any run does (a run of the previous burst still
  running holds it: the job waits in the key's line, as ``reschedule``), then claims its burst
  (``lua/debounce_claim``): not due yet, it gives the lock back and is re-sent for the due time, carrying the newest
  arguments; due, the burst ends and the job runs with its last call's arguments. A call from then on starts a new
  burst, which runs after this run (never beside it: the lock). A job refused by its rate (``lock_on_rate_limit``
  skip or fail) or revoked or expired ends its burst too: every way a burst's run ends, a call from then on starts
  a new burst.

Each call is a *version* of its burst (named by its own task id, kept on each node it reached). Promises, with one
lock node out at a time (paused, or restarted empty):

* every call's arguments run at least once: as its burst's last call (the newest version a quorum of the nodes
  holds), or on its own when no quorum agreed on a burst at its call (it then takes its version back from every
  node: the burst never runs it too);
* no version runs twice (a SIGKILLed run's redelivery aside: the lock's at-least-once);
* a run carries only a call whose caller was given its task id;
* older versions never run after a newer one: a delivery about to run whose version is older than the key's newest
  run is REVOKED, "superseded by task <the job that ran the newer one>" (the burst's last call's arguments did run:
  a newer call's); a job's burst is then not run at all, which debounce allows (the last call's arguments run);
* ``expires`` counts from the call whose arguments a message carries (a burst re-sent for its due time carries its
  newest version's call's expiry; its first message, the first call's).

Why the order holds (docs/protocol.md, "Debounce", Order): each call is stamped by the nodes' clocks when they take
it (its stamp: the earliest a node gave it), so a call made after another returned has the larger stamp. Every
debounced delivery, holding the lock, writes its version's stamp as the key's newest run on every node that
answers (``lua/debounce_claim``, ``ran``) unless one has a larger one there: then a newer version ran and this one
is superseded. One node's note suffices (only a run that started writes one), and a note written under the lock is
on a quorum but the node out, which any later check (a quorum answers) meets. A claim that finds no version a
quorum holds while a node did not answer asks again rather than run the message's older arguments; a burst's job
that fails for want of a quorum (``lock_on_unavailable="fail"``) ends its burst.

This module is the policy's pure part: its options' check, and how the nodes' answers are counted.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any, NamedTuple

from ..errors import ConfigurationError

__all__ = [
    "CLAIM_GONE",
    "CLAIM_LATER",
    "CLAIM_START",
    "CLAIM_SUPERSEDED",
    "JOIN_STANDIN",
    "JOIN_STARTED",
    "Version",
    "check_debounce",
    "choose",
    "majority",
    "stamp",
]

#: debounce_join's first answer: this call started the burst / joined it and publishes a stand-in copy.
JOIN_STARTED, JOIN_STANDIN = 1, 2
#: debounce_claim's first answer (claim; SUPERSEDED: 'ran', a newer version ran).
CLAIM_GONE, CLAIM_START, CLAIM_LATER, CLAIM_SUPERSEDED = 0, 1, 2, 3


def _seconds(value: object) -> bool:
    return not isinstance(value, bool) and isinstance(value, int | float) and value > 0


def check_debounce(cls: Any, settings: Any = None) -> None:
    """Validate ``lock_debounce`` and ``lock_debounce_max`` of a LockedTask class (ConfigurationError naming the first
    bad one, in one line). What they cannot be combined with is the options matrix's (``policies.matrix``)."""
    name = cls.name
    debounce, most = cls.lock_debounce, cls.lock_debounce_max
    if debounce is None:
        if most is not None:
            raise ConfigurationError(f"lock_debounce_max of {name} needs lock_debounce (the quiet period, seconds)")
        return
    if not _seconds(debounce):
        raise ConfigurationError(f"lock_debounce of {name} must be a number of seconds > 0, e.g. 5, got {debounce!r}")
    if most is not None and (not _seconds(most) or most < debounce):
        raise ConfigurationError(
            f"lock_debounce_max of {name} must be a number of seconds >= lock_debounce ({debounce}), got {most!r}"
        )
    serializer = getattr(cls, "serializer", None)
    app = getattr(cls, "_app", None)
    if serializer is None and app is not None:
        serializer = app.conf.task_serializer
    if serializer not in (None, "json"):
        raise ConfigurationError(
            f"lock_debounce of {name} needs the json serializer (the burst keeps its last call's arguments as "
            f"JSON on the lock nodes), got serializer={serializer!r}"
        )


def majority(answers: Sequence[Any], quorum: int, key: Any) -> tuple[Any, list[Any]] | None:
    """The value of ``key(answer)`` that at least ``quorum`` answers share, and those answers; None when none does.

    ``answers`` holds one entry per node: an exception (a node that did not answer) counts for nothing."""
    values = [key(a) for a in answers if not isinstance(a, BaseException) and a is not None]
    if not values:
        return None
    value, count = Counter(values).most_common(1)[0]
    if count < quorum:
        return None
    return value, [a for a in answers if not isinstance(a, BaseException) and a is not None and key(a) == value]


class Version(NamedTuple):
    """One call of a burst as a node keeps it: its number on that node, its task id (the version's name), its
    arguments (JSON ``[args, kwargs]``), the burst's due time after it (node ms), its expiry (Unix ms, 0: none) and
    its stamp (when the node took the call, its clock's µs; 0: unknown, a version written before stamps)."""

    n: int
    call: str
    args: str
    due: int
    expires: int
    at: int = 0


def choose(nodes_versions: Sequence[Sequence[Version]], quorum: int) -> Version | None:
    """The newest version that at least ``quorum`` of the nodes hold (one list per node that answered); None when
    none does. Newest: the highest number any node gave it (calls that raced may be numbered differently on two
    nodes: the tie goes to the larger task id, the same on every reader). Its stamp: the earliest a node that
    answered took it (see :func:`stamp`)."""
    held: Counter[str] = Counter()
    best: dict[str, Version] = {}
    first: dict[str, int] = {}
    for versions in nodes_versions:
        for v in {v.call: v for v in versions}.values():
            held[v.call] += 1
            if v.call not in best or v.n > best[v.call].n:
                best[v.call] = v
            if v.at > 0:
                first[v.call] = min(first.get(v.call, v.at), v.at)
    agreed = [best[c] for c, count in held.items() if count >= quorum]
    if not agreed:
        return None
    chosen = max(agreed, key=lambda v: (v.n, v.call))
    return chosen._replace(at=first.get(chosen.call, 0))


def stamp(times: Sequence[int]) -> int:
    """A call's stamp from the stamps the nodes gave it (their clocks' µs when each took it): the earliest (0: none).

    A call made after another one returned is stamped later on every node, so the earliest of its stamps is later
    than the earliest of the other's (up to the nodes' clocks' skew): the order of calls one after the other."""
    known = [t for t in times if t > 0]
    return min(known) if known else 0
