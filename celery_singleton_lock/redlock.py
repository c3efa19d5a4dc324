"""Redlock: a lease on one Redis node, or on N independent nodes with a majority quorum.

One node is a plain ``SET NX PX`` lock. N nodes follow antirez's Redlock: the request goes to every node *at
once* (all commands are written before any reply is read, no threads), the lock is ours when a majority
``N // 2 + 1`` said yes, and its validity is ``ttl - elapsed - drift`` measured on a monotonic clock. A failed
attempt is undone on every node that may have said yes.

Only the owner releases or extends: each operation is one Lua script comparing the random owner token, never a
plain ``DEL``. The scripts (``lua/*.lua``, loaded by ``scripts.py``) are sent by SHA (``EVALSHA``) and loaded on a
node only when it says ``NOSCRIPT``. The record and its keys are ``record.py``'s, the fan-out is ``nodes.py``'s;
docs/protocol.md writes the protocol down.

Fencing tokens. Each node keeps a counter per lock name, bumped by the acquire script in the same atomic step as
the ``SET``. The max over the quorum is *not* enough on its own: a failed attempt raises the counters of the
nodes it reached, so a later quorum that misses those nodes can come out with a smaller max. So before acquire
returns, every node of the quorum is made to hold at least the returned token (a second, owner-checked script,
sent only to the nodes that are behind; in the common case none is and it costs nothing). Any later quorum
intersects ours in a node whose counter is already >= our token, and that node's ``INCR`` happens after our
lease on it ended (its ``SET NX`` succeeded), so the later token is strictly greater. A node that loses its data
(restart without persistence) forgets its counters: if it is the only node shared by two quorums, the later token
can be smaller. Run the nodes with ``appendonly yes`` (or delay restarts by more than the ttl *and* keep the
counters) where fencing tokens must never go back.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import random
import secrets
import threading
import time as mod_time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, ClassVar, Literal

import redis
from redis.exceptions import TimeoutError as RedisTimeoutError

from ._urls import redact_url
from .errors import ConfigurationError, LockError, LockLostError, LockNotAcquiredError, LockUnavailableError
from .interrupt import Target, outside_body
from .nodes import NodeError, NodeSet
from .record import (
    _brief,
    _merged,
    _prefixed,
    done_key_for,
    fence_key_for,
    record_of,
    sibling_key,
    slot_keys,
)
from .renewal import Lease, watchdog
from .scripts import ACQUIRE as _ACQUIRE
from .scripts import ACQUIRED, DONE, EXTENDED, LOST, REPAIRED
from .scripts import EXTEND as _EXTEND
from .scripts import FENCE as _FENCE
from .scripts import FINISH as _FINISH
from .scripts import REFILL as _REFILL
from .scripts import RELEASE as _RELEASE
from .scripts import STATUS as _STATUS
from .scripts import TRANSFER as _TRANSFER
from .scripts import UNDO as _UNDO

logger = logging.getLogger("celery_singleton_lock.redlock")

__all__ = ["NodeSet", "Redlock", "done_key_for", "fence_key_for", "record_of", "redact_url", "sibling_key", "slot_keys"]


@dataclass
class _Lease:
    token: str
    ttl_ms: int
    fence: int
    deadline: float  # monotonic; the lock is ours until then under Redlock's assumptions
    renewable: bool = True  # False once handed over (transfer): the marker is never extended
    fields: tuple[str, ...] = ()  # the record's fields (field, value, ...) besides owner and fence, for a refill
    key: str = ""  # the key the record lives under: the name, or with a limit the slot taken
    pid: int = field(default_factory=os.getpid)  # the process that took it: a forked child never renews or frees it


#: One node's findings of an acquire's answers, parsed (see :func:`_tally`).
_Holder = tuple[str, int, dict[str, str]]  # owner, remaining ms, brief record


def _tally(
    answers: Sequence[Any],
) -> tuple[dict[int, int], dict[int, int], list[_Holder], list[list[str]], list[tuple[int, BaseException]], bool]:
    """An acquire's answers (one per node, or its exception) parsed: the fencing token and slot each granting node
    gave (by node index), the holders the refusing nodes named, the slots' owners as nodes saw them (with a limit),
    the nodes that failed, and whether a node said the job is done. Pure: shared by Redlock and AsyncRedlock."""
    fences: dict[int, int] = {}
    slots: dict[int, int] = {}
    holders: list[_Holder] = []
    slot_owners: list[list[str]] = []  # with a limit: the slots' owners as nodes saw them ('' = free)
    failed: list[tuple[int, BaseException]] = []
    done = False
    for i, answer in enumerate(answers):
        if isinstance(answer, BaseException):
            failed.append((i, answer))
        elif answer[0] == ACQUIRED:
            fences[i] = int(answer[1])
            slots[i] = int(answer[2])
            if len(answer) > 3:
                slot_owners.append(_prefixed(answer[3]))
        elif answer[0] == DONE:
            done = True
        else:
            record = _brief(answer[1])
            holders.append((record.get("owner", ""), int(answer[2]), record))
            if len(answer) > 3:
                slot_owners.append(_prefixed(answer[3]))
    return fences, slots, holders, slot_owners, failed, done


def _settle(fences: dict[int, int], slots: dict[int, int], slot_keys: Sequence[str]) -> tuple[str, dict[int, int]]:
    """The key the lease is on and the nodes that granted it: with a limit, nodes may grant different slots (one
    restarted empty), and the lease is on the slot most nodes granted."""
    if len(slot_keys) > 1 and fences:
        best, _ = Counter(slots.values()).most_common(1)[0]
        return slot_keys[best], {i: f for i, f in fences.items() if slots[i] == best}
    return slot_keys[0], fences


def _findings(
    holders: list[_Holder],
    slot_owners: list[list[str]],
    fences: dict[int, int],
    errors: bool,  # noqa: FBT001
    size: int,
    quorum: int,
    limit: int,
    job: str | None,
) -> tuple[str | None, float | None, dict[str, str] | None, bool, bool]:
    """A failed attempt's findings: (held_by, held_for, holder_record, contended, split), see Redlock's attributes."""
    held_by: str | None = None
    held_for: float | None = None
    holder_record: dict[str, str] | None = None
    # Held by someone else only when one holder has a quorum of the nodes. Refusals that deny us the quorum
    # without any single holder having one are a split vote (contenders that arrived together): nobody holds
    # the lock, and skipping because of it would skip every contender.
    refused = len(holders) > size - quorum
    count = 0
    if holders:
        holder, count = holders[0][0], len(holders)
        if any(h != holder for h, _, _ in holders):  # not one owner everywhere: the most reported one
            holder, count = Counter(h for h, _, _ in holders).most_common(1)[0]
        held_by = holder
        held_for = max(ms for h, ms, _ in holders if h == holder) / 1000.0
        holder_record = _merged(r for h, _, r in holders if h == holder)
    contended = count >= quorum
    split = refused and not contended
    if limit > 1:
        # The limit is reached when every slot has one owner on a quorum of the nodes, as the nodes that
        # refused (every slot busy) and those that granted us a free slot saw them (each slot is a lock of its
        # own: at most one owner holds it on a quorum); or when this job's own holder has a quorum of refusals
        # (a job never holds two slots). Refusals short of that are contenders that split the free slots, as
        # are grants on some nodes without a quorum for one slot: try again.
        per_slot = [Counter(o[s] for o in slot_owners if s < len(o) and o[s]) for s in range(limit)]
        limit_reached = all(c and c.most_common(1)[0][1] >= quorum for c in per_slot)
        same_job = [h for h, _, r in holders if job and r.get("job") == job]
        job_held = bool(same_job) and Counter(same_job).most_common(1)[0][1] >= quorum
        contended = limit_reached or (refused and job_held)
        split = not contended and (refused or (not errors and bool(fences)))
    return held_by, held_for, holder_record, contended, split


class _LeaseSpec:
    """What :class:`Redlock` and :class:`~celery_singleton_lock.aio.AsyncRedlock` share, I/O aside: the arguments'
    checks, the keys and script arguments built from them (so a sync and an async holder of one name use the same
    keys, records and fencing counter), the lease held, and the findings of the last failed attempt."""

    DRIFT_FACTOR: ClassVar[float] = 0.01
    DRIFT_FLOOR: ClassVar[float] = 0.002
    RETRY_BASE: ClassVar[float] = 0.005
    RETRY_CAP: ClassVar[float] = 0.2

    nodes: Any
    name: str

    @staticmethod
    def _check(name: str, ttl: float, timeout: float | None, limit: int, record: Mapping[str, str] | None) -> None:
        """Refuse bad arguments in one line each, before anything is built."""
        if not isinstance(name, str) or not name:
            raise ConfigurationError(f"the lock name must be a non-empty string, got {name!r}")
        if not ttl > 0.01:
            raise ConfigurationError(f"ttl must be more than 0.01 seconds, got {ttl!r}")
        if timeout is not None and timeout < 0:
            raise ConfigurationError(f"timeout must be >= 0 or None, got {timeout!r}")
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
            raise ConfigurationError(f"limit must be a whole number >= 1, got {limit!r}")
        if record and ("owner" in record or "fence" in record or "waiting" in record):
            raise ConfigurationError("record fields 'owner', 'fence' and 'waiting' are the lock's own")

    def _setup(
        self,
        name: str,
        *,
        ttl: float,
        timeout: float | None,
        token: str | None,
        record: Mapping[str, str] | None,
        job: str | None,
        fencing: bool,
        fence_key: str,
        limit: int,
        clock: Callable[[], float],
        scan: int = 0,
    ) -> None:
        """The lease's spec from checked arguments (``fence_key`` resolved by the caller, who knows its nodes).

        ``scan`` (> ``limit``): the acquire also looks at the slots above the limit, up to ``scan``, for this job's own
        record (a slot it took while the limit was higher), never taking one of them.
        """
        self.name = name
        self.fence_key = fence_key
        self.ttl = float(ttl)
        self.timeout = timeout
        self.job = job
        self._label = f"{token}:" if token else ""
        fields = dict(record) if record else {}
        if job is not None:
            fields["job"] = job
        self._fields: tuple[str, ...] = tuple(itertools.chain.from_iterable(fields.items()))
        self.limit = limit
        self._slots = slot_keys(name, max(limit, scan))
        self._keys: tuple[str, ...] = (
            (name, fence_key, *self._slots[1:])
            if job is None
            else (name, fence_key, *self._slots[1:], done_key_for(name, job))
        )
        self._limit_arg = f"{limit}/{scan}" if scan > limit else str(limit)
        self._fencing = "1" if fencing else "0"
        self._clock = clock
        self._lease: _Lease | None = None
        self._fence: int | None = None
        self._last_key = self._slots[0]
        # The attempt's findings (split, done, held_by...) start as the class's defaults: none.

    #: After a failed attempt: no single holder had a quorum either (simultaneous contenders split the vote).
    split: bool = False
    #: After a failed attempt: a node said this lock's ``job`` is done (its done marker exists).
    done: bool = False
    #: After a failed attempt: the owner token of the holder most nodes reported, the fields of its record that a
    #: decision needs (owner, job, state, try, worker; ``holder()`` reads the whole record), and its remaining
    #: lease (s).
    held_by: str | None = None
    holder_record: dict[str, str] | None = None
    held_for: float | None = None
    #: After a failed attempt: the nodes that did not answer (redacted), empty when all answered.
    node_errors: tuple[NodeError, ...] = ()
    #: After a failed attempt: True when the refusals alone denied the quorum (someone else holds the lock), False
    #: when unanswered nodes could have made the difference (the lock state is unknown).
    contended: bool = False
    #: True once the renewal of a ``with`` / ``async with`` block found the lease lost (reset by the next block).
    lost: bool = False

    def _reset_failure(self) -> None:
        """Back to the class's defaults (no finding), whatever an earlier attempt found."""
        self.split = self.done = self.contended = False
        self.held_by = self.holder_record = self.held_for = None
        self.node_errors = ()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r}, nodes={len(self.nodes)}, ttl={self.ttl})"

    @property
    def key(self) -> str:
        """The key holding the current (or last) lease's record: the name, or with a limit the slot's key."""
        return self._lease.key if self._lease else self._last_key

    @property
    def slot(self) -> int:
        """The slot (0-based) of the current (or last) lease: always 0 without a limit."""
        return self._slots.index(self.key)

    @property
    def token(self) -> str | None:
        """The owner token of the current (or last) lease, None before the first acquire."""
        return self._lease.token if self._lease else None

    @property
    def fencing_token(self) -> int:
        """Greater than every fencing token returned earlier for this name (sync or async); raises before an
        acquire."""
        if self._fence is None:
            raise LockError(f"lock {self.name!r} has no fencing token: it was never acquired", key=self.name)
        return self._fence

    @property
    def validity(self) -> float:
        """Seconds the lease is still ours by the local clock (0 when not held)."""
        if self._lease is None or self._lease.pid != os.getpid():
            return 0.0
        return max(0.0, self._lease.deadline - self._clock())

    def _forked(self) -> bool:
        """True (and the lease dropped here) when the lease was taken by the process this one was forked from: it is
        the parent's, still held and renewed there; a child that released or extended it would free the parent's lock
        for a second holder (or wait forever on a mutex a parent's thread held at the fork)."""
        lease = self._lease
        if lease is not None and lease.pid != os.getpid():
            self._lease = None
            return True
        return False

    def _drift(self) -> float:
        return self.ttl * self.DRIFT_FACTOR + self.DRIFT_FLOOR

    def _new_token(self) -> str:
        return f"{self._label}{secrets.token_hex(16)}"

    def _won(self, lease: _Lease) -> bool:
        """An attempt took ``lease``: it is this lock's now, and nothing of an earlier attempt's findings stays."""
        self._lease = lease
        self._last_key = lease.key
        self._fence = lease.fence
        self._reset_failure()
        return True


class Redlock(_LeaseSpec):
    """A distributed lock on one or N independent Redis masters.

    >>> lock = Redlock(redis_url, "doctest:invoice:42", ttl=10.0)
    >>> lock.acquire(blocking=False)
    True
    >>> lock.owned(), lock.fencing_token > 0
    (True, True)
    >>> Redlock(redis_url, "doctest:invoice:42").acquire(blocking=False)
    False
    >>> lock.release()
    True

    ``ttl`` is the lease in seconds: a holder that stops extending loses the lock after it. ``timeout`` is how long
    ``with`` (and ``acquire()`` without an explicit timeout) waits; ``None`` waits until acquired.

    ``with Redlock(...)`` renews the lease while the block runs: the process's watchdog (``renewal.py``, one thread,
    batched with every other lease it renews) extends it every ``ttl / 3``; ``auto_renewal=False`` turns that off
    (the lease then ends ``ttl`` after the acquire, whatever the block is doing). A renewal that finds the lease
    lost sets ``lost``, calls ``on_lost(lock)`` (in the watchdog's thread: keep it short) and, with
    ``interrupt_on_loss=True``, raises :class:`LockLostError` inside the block at its next bytecode (a signal to the
    main thread, as ``lock_on_lost="interrupt"``; a gevent greenlet gets it thrown in; any other thread is refused
    at ``with``, before acquiring). Best effort: C code sees it on return, and a block that catches ``Exception``
    may swallow it; fencing tokens stay the guard against a stale writer. ``acquire()``/``release()`` called
    directly are never renewed.

    The value stored under ``name`` is the *holder record*, a Redis hash: ``owner`` (the owner token), ``fence``
    (this holder's own fencing token), and the string fields of ``record`` (who holds it, in what state). Scripts
    compare fields, never substrings. The owner token is fresh (128 random bits) for every attempt, so a late
    packet of an earlier attempt (its acquire, or the undo of a failed one) can never touch a later attempt's
    lease; ``token``, when given, is only a readable label in front of it (``label:random``).

    ``job`` names the unit of work the lock protects (LockedTask: the task id). It is stored as the record's
    ``job`` field; an attempt refused by a holder of the same job marks that record ``waiting``; and an attempt
    for a job whose done marker exists (see :meth:`finish`) is refused with ``done`` set and changes nothing.

    ``fence_key`` names the fencing counter (default: one counter per name, ``fence_key_for(name)``, which never
    expires). Many short-lived names (one per order, say) are better served by one counter they share: the keys
    then stay one, not one per name ever locked, and the tokens still grow strictly per name (two names acquired at
    the same moment may get the same token: compare tokens per resource). With Cluster hash tags it must hash to
    the same slot as ``name``: on a NodeSet with a Cluster node, one that does not is kept per slot instead (see
    :func:`fence_key_in_slot`; ``fence_key`` then names that key).
    ``fencing=False`` skips the fencing counter (no extra key that outlives the lock; ``fencing_token`` is 0):
    right for many short-lived one-off names, such as one key per scheduled run.

    ``limit=N`` lets up to N holders hold the name at once (a counting semaphore on the same quorum): N slots, each
    a holder record of its own (``slot_keys(name, N)``), all tried in one script call per node. An acquire takes
    the first free slot, unless this ``job`` holds one already (it is then refused by itself, as with a plain
    lock: one job never holds two slots). ``key`` and ``slot`` say which slot the lease is on; renewal, release,
    hand-over and loss work per slot exactly as for a plain lock, and the fencing counter is the name's (shared by
    its slots). A refusal names one holder: this job's, or the lowest busy slot's. ``limit=1`` is the plain lock.
    Nodes that disagree on which slot is free (one restarted empty) settle on the slot a quorum granted, or retry.
    With a limit, a fencing token is larger than that of every acquisition of the name that ended before it began;
    holders that overlap (N may) can share a token when the nodes' counters diverged, so tokens order successive
    holders and do not tell concurrent ones apart. Every instance on one name must use the same N: one with a
    smaller N sees only its first slots (a plain lock sees slot 0), so while two deployed versions disagree, up to
    the larger N hold the name at once.
    """

    nodes: NodeSet

    def __init__(
        self,
        urls: str | redis.Redis | Sequence[str | redis.Redis] | NodeSet,
        name: str,
        *,
        ttl: float = 10.0,
        timeout: float | None = None,
        token: str | None = None,
        record: Mapping[str, str] | None = None,
        job: str | None = None,
        fencing: bool = True,
        fence_key: str | None = None,
        limit: int = 1,
        scan: int = 0,
        socket_timeout: float = 0.5,
        auto_renewal: bool = True,
        interrupt_on_loss: bool = False,
        on_lost: Callable[[Redlock], None] | None = None,
        clock: Callable[[], float] = mod_time.monotonic,
        sleep: Callable[[float], None] = mod_time.sleep,
    ) -> None:
        self._check(name, ttl, timeout, limit, record)
        self.nodes = urls if isinstance(urls, NodeSet) else NodeSet(urls, socket_timeout=socket_timeout)
        # On a Redis Cluster, a shared counter in another slot than the name is kept per slot (see same_slot).
        self._setup(
            name,
            ttl=ttl,
            timeout=timeout,
            token=token,
            record=record,
            job=job,
            fencing=fencing,
            fence_key=self.nodes.same_slot(fence_key, name) if fence_key else fence_key_for(name),
            limit=limit,
            clock=clock,
            scan=scan,
        )
        self._sleep = sleep
        self._mutex = threading.Lock()  # orders release/transfer against the watchdog's extend
        #: An owner token this lock may take over when it finds it holding the key (see ``transfer``).
        self.replaces: str | None = None
        self.auto_renewal = auto_renewal
        self.interrupt_on_loss = interrupt_on_loss
        self.on_lost = on_lost
        self._renewal: Lease | None = None  # the watchdog's lease while ``with`` runs
        self._target: Target | None = None  # interrupt_on_loss: the block to interrupt
        self._expiry: threading.Timer | None = None  # auto_renewal=False: the lease's end, told as its loss

    def acquire(self, blocking: bool = True, timeout: float | None = None) -> bool:  # noqa: FBT001, FBT002
        """Try to take the lock; with ``blocking``, retry with jittered back-off for at most ``timeout`` s.

        A blocking acquire stops early, returning False, when the job is done (``done``): waiting cannot help.
        """
        if timeout is None:
            timeout = self.timeout
        deadline = None if timeout is None else self._clock() + timeout
        attempt = 0
        while True:
            if self._attempt():
                return True
            if not blocking or self.done:
                return False
            delay = random.uniform(self.RETRY_BASE, min(self.RETRY_CAP, self.RETRY_BASE * 2**attempt))  # noqa: S311
            if deadline is not None:
                remaining = deadline - self._clock()
                if remaining <= 0:
                    return False
                delay = min(delay, remaining)
            self._sleep(delay)
            attempt += 1

    def _attempt(self) -> bool:
        # A fresh owner token per attempt: attempt k's undo (or a late copy of its acquire, delivered after attempt
        # k+1 succeeded) then matches nothing of attempt k+1's, and cannot delete or re-set its lease.
        token = self._new_token()
        ttl_ms = int(self.ttl * 1000)
        nodes = self.nodes
        start = self._clock()
        answers = nodes.run(
            _ACQUIRE,
            self._keys,
            (token, ttl_ms, self._fencing, self.replaces or "", self.job or "", self._limit_arg, *self._fields),
            undo_on_timeout=(_UNDO, self._slots, (token,)),
        )
        if len(self._slots) == 1 and all(type(a) is list and a[0] == ACQUIRED for a in answers):
            # The common case, every node granted the one key: the general path below with nothing to undo, fence
            # or settle, when every node gave the same fencing token (always so on one node).
            fence = int(answers[0][1])
            deadline = start + self.ttl - self._drift()
            if all(int(a[1]) == fence for a in answers) and deadline > self._clock():
                return self._won(_Lease(token, ttl_ms, fence, deadline, fields=self._fields, key=self._slots[0]))
        fences, slots, holders, slot_owners, failed, done = _tally(answers)
        errors = [nodes.error(i, exc) for i, exc in failed]
        key, granted = _settle(fences, slots, self._slots)
        if len(granted) >= nodes.quorum and not done:
            if len(granted) < len(fences):
                others = [i for i in fences if i not in granted]
                nodes.run(_UNDO, self._slots, (token,), others)
                fences = granted
            fence = max(fences.values())
            behind = [i for i, f in fences.items() if f < fence]
            confirmed = len(fences) - len(behind)
            if behind and confirmed < nodes.quorum:
                # run() answers by node index (None for nodes not asked), not by position in ``behind``.
                fenced = nodes.run(_FENCE, (key, self.fence_key), (token, fence), behind)
                for i in behind:
                    answer = fenced[i]
                    if answer == 1:
                        confirmed += 1
                    elif isinstance(answer, BaseException):
                        errors.append(nodes.error(i, answer))
            # Under Redlock's assumptions the lease is ours until start + ttl - drift on our clock.
            deadline = start + self.ttl - self._drift()
            if confirmed >= nodes.quorum and deadline > self._clock():
                return self._won(_Lease(token, ttl_ms, fence, deadline, fields=self._fields, key=key))
        # Failed: undo where we set the key, putting back a record we took over (a retry's hand-over that another
        # delivery must still find). A node that timed out got the undo already, on the same connection (see
        # NodeSet.run); a node that refused holds someone else's token; one we could not reach got nothing.
        if fences:
            nodes.run(_UNDO, self._slots, (token,), fences)
        self._reset_failure()
        self.node_errors = tuple(errors)
        self.done = done
        self.held_by, self.held_for, self.holder_record, self.contended, self.split = _findings(
            holders, slot_owners, fences, bool(errors), len(nodes), nodes.quorum, self.limit, self.job
        )
        return False

    def extend(self) -> bool:
        """Reset the lease to ``ttl`` if we still hold it.

        False when it was not extended: either the lock is no longer ours (``validity`` is then 0), or too few
        nodes answered to tell (``validity`` is then what is left of the current lease: try again before it ends).
        """
        if self._forked():
            return False
        return self.nodes_extend([self])[0] is True

    @staticmethod
    def nodes_extend(locks: Sequence[Redlock], *, unanswered: set[int] | None = None) -> list[bool | None]:
        """Extend many locks sharing one NodeSet (or NodeSets with equal ``peers``) in one round trip per node (the
        renewal watchdog's path).

        A node where a key is missing (restarted, or unreachable at acquire) gets it back, with its fencing
        counter raised to our token, but only a node that still held our token counts towards the quorum: a
        single node that lost the key means someone else may have held the lock in between.

        One answer per lock: True (extended), False (lost: too many nodes hold someone else's token or lost ours,
        or the lease ran out), or None (undecided: too few nodes answered; the lease stands until its deadline).
        A lease that was released or handed over meanwhile is left alone (False).

        ``unanswered`` (the watchdog's, shared by the batches of one renewal): the nodes that failed to answer an
        earlier batch are not asked again (a no-answer, no vote) and the ones that fail now are added, so a paused
        node costs one renewal ``socket_timeout`` once, not once per batch.
        """
        if not locks:
            return []
        nodes = locks[0].nodes
        if any(lock.nodes is not nodes and lock.nodes.peers != nodes.peers for lock in locks):
            raise LockError("nodes_extend: every lock must share one NodeSet (or NodeSets on the same clients)")
        # Hold each lock's mutex across the round trip: a release() racing with this extend could otherwise reach
        # a node first, and the extend would then find the key missing and "repair" a lock just given up.
        with contextlib.ExitStack() as stack:
            for lock in locks:
                stack.enter_context(lock._mutex)
            return Redlock._extend_locked(nodes, locks, unanswered)

    @staticmethod
    def _extend_locked(nodes: NodeSet, locks: Sequence[Redlock], unanswered: set[int] | None) -> list[bool | None]:
        out: list[bool | None] = [False] * len(locks)
        live: list[int] = []
        for i, lock in enumerate(locks):
            lease = lock._lease
            if lease is not None and lease.renewable and lease.deadline > lock._clock():
                live.append(i)
            elif lease is not None and lease.renewable:
                lock._lease = None
        if not live:
            return out
        keys: list[str] = []
        args: list[str | int] = []
        for i in live:
            lock = locks[i]
            lease = lock._lease
            assert lease is not None
            keys += (lease.key, lock.fence_key)
            args += (lease.token, lease.ttl_ms, lease.fence)
        clock = locks[0]._clock
        start = clock()
        if unanswered:
            asked = [j for j in range(len(nodes)) if j not in unanswered]
            answers = nodes.run(_EXTEND, keys, args, asked)
            for j in unanswered:
                answers[j] = RedisTimeoutError("not asked: it did not answer an earlier batch of this renewal")
        else:
            answers = nodes.run(_EXTEND, keys, args)
        if unanswered is not None:
            unanswered.update(j for j, a in enumerate(answers) if isinstance(a, BaseException))
        now = clock()
        for n, i in enumerate(live):
            lock = locks[i]
            lease = lock._lease
            assert lease is not None
            repaired = [j for j, a in enumerate(answers) if not isinstance(a, BaseException) and a[n] == REPAIRED]
            if repaired and lease.fields:
                # A node that lost the key (restarted) now holds owner and fence only: give it the whole record
                # back, or a reader there (a redelivery, the CLI) could not tell whose job holds it.
                nodes.run(_REFILL, (lease.key,), (lease.token, *lease.fields), repaired)
            votes = sum(1 for a in answers if not isinstance(a, BaseException) and a[n] == EXTENDED)
            # A node that answered LOST (someone else holds it) or REPAIRED (it had lost our key) no longer holds
            # our lease; one that did not answer may still hold it.
            gone = sum(1 for a in answers if not isinstance(a, BaseException) and a[n] in (LOST, REPAIRED))
            deadline = start + lock.ttl - lock._drift()
            if votes >= nodes.quorum and deadline > now and lease.deadline > now:
                lease.deadline = deadline
                out[i] = True
                continue
            if lease.deadline > now and gone <= len(nodes) - nodes.quorum:
                # Undecided (timeouts, a node down): the lease is still ours until its deadline, try again soon.
                out[i] = None
                continue
            lock._lease = None
            if any(not isinstance(a, BaseException) and a[n] != LOST for a in answers):
                # Lost, yet some nodes still (or again, by repair) hold our token: take it back off them, or a
                # key nobody owns would block the name for a whole ttl (e.g. after `celery locks release`).
                nodes.run(_RELEASE, (lease.key,), (lease.token,))
        return out

    def release(self) -> bool:
        """Give the lock up on every node; True if we still held it (on a quorum). Idempotent. In a process forked
        while the lease was held, it only forgets the parent's lease (False)."""
        if self._forked():
            return False
        with self._mutex:
            lease = self._lease
            if lease is None:
                return False
            self._lease = None
            answers = self.nodes.run(_RELEASE, (lease.key,), (lease.token,))
        freed = sum(1 for a in answers if a == 1)
        return freed >= self.nodes.quorum and lease.deadline > self._clock()

    def finish(self, *, done_for: float, waited_for: float, cooldown: float = 0.0) -> bool:
        """The job succeeded: release the lock (or keep it ``cooldown`` s) and mark the job done, in one round trip.

        The done marker (``done_key_for(name, job)``) makes a later attempt by the same ``job`` stop with ``done``
        set. It lives ``done_for`` s, or ``waited_for`` s when a copy of the job is known to wait (the record says
        ``waiting``) or the lease is no longer ours. It is written on every node that answers, held or not: the
        job did finish. True if we still held the lock on a quorum.
        """
        if self.job is None:
            raise LockError(f"lock {self.name!r} has no job to mark done", key=self.name)
        self._forked()
        with self._mutex:
            lease = self._lease
            self._lease = None
            token = lease.token if lease is not None else ""
            answers = self.nodes.run(
                _FINISH,
                (lease.key if lease is not None else self.name, done_key_for(self.name, self.job)),
                (
                    token,
                    max(1, int(done_for * 1000)),
                    max(1, int(waited_for * 1000)),
                    int(cooldown * 1000),
                    self._new_token() if cooldown > 0 else "",  # the cooldown record's owner, if one is kept
                ),
            )
        freed = sum(1 for a in answers if a == 1)
        return lease is not None and freed >= self.nodes.quorum and lease.deadline > self._clock()

    def transfer(self, ttl: float, record: Mapping[str, str] | None = None, *, renewable: bool = False) -> bool:
        """Hand the lease on under a fresh owner token, for ``ttl`` s, changing the ``record`` fields, on a quorum.

        Whoever acquires with ``replaces`` set to the new owner (read it from the record) takes the lock over
        atomically; otherwise it expires after ``ttl``, or this instance's ``release()`` cancels the hand-over.
        LockedTask uses this to keep a job protected across ``self.retry()`` (``state: retry``): the next delivery
        of the same task id takes the lock over. With ``renewable`` the lease stays this instance's to extend (a
        hand-over taken back).
        """
        if self._forked():
            return False
        with self._mutex:
            lease = self._lease
            if lease is None:
                return False
            start = self._clock()
            token = self._new_token()
            changes = [x for kv in (record or {}).items() for x in kv]
            answers = self.nodes.run(_TRANSFER, (lease.key,), (lease.token, token, int(ttl * 1000), *changes))
            current = dict(zip(lease.fields[::2], lease.fields[1::2], strict=True)) | dict(record or {})
            moved = sum(1 for a in answers if a == 1)
            held = moved >= self.nodes.quorum and lease.deadline > self._clock()
            # The instance keeps the handed-over token, so release() can still cancel the hand-over.
            self._lease = (
                _Lease(
                    token,
                    int(ttl * 1000),
                    lease.fence,
                    start + ttl - self._drift(),
                    renewable=renewable,
                    fields=tuple(x for kv in current.items() for x in kv),
                    key=lease.key,
                )
                if held
                else None
            )
        return held

    def owned(self) -> bool:
        """True when the lease is valid by our clock and a quorum of nodes still holds our token."""
        self._forked()
        lease = self._lease
        if lease is None or lease.deadline <= self._clock():
            return False
        answers = self.nodes.run(_STATUS, (lease.key, self.fence_key), ())
        mine = sum(
            1 for a in answers if not isinstance(a, BaseException) and record_of(a[0]).get("owner") == lease.token
        )
        return mine >= self.nodes.quorum

    def locked(self) -> bool:
        """True when a quorum of nodes holds the key (by anyone); with a limit, when every slot is held."""
        if self.limit == 1:
            return self.holder() is not None
        return len(self.holders()) == self.limit

    def holder(self) -> dict[str, str] | None:
        """The holder record a quorum of nodes holds right now (same owner), or None (free, split, few answers).

        With a limit: the record of the slot this instance holds (or last held), else of slot 0; see ``holders``.
        """
        return self._holder_of(self.key)

    def holders(self) -> list[dict[str, str]]:
        """The holder record of each slot a quorum of nodes holds right now (one entry at most without a limit)."""
        return [r for r in (self._holder_of(k) for k in self._slots) if r is not None]

    def _holder_of(self, key: str) -> dict[str, str] | None:
        answers = self.nodes.run(_STATUS, (key, self.fence_key), ())
        records = [record_of(a[0]) for a in answers if not isinstance(a, BaseException) and a[0]]
        owners = Counter(r.get("owner", "") for r in records)
        if not owners:
            return None
        owner, count = owners.most_common(1)[0]
        if count < self.nodes.quorum:
            return None
        return _merged(r for r in records if r.get("owner", "") == owner)

    def __enter__(self) -> Redlock:
        target: Target | None = None
        if self.interrupt_on_loss:
            target = Target()
            if not target.arm():  # checked before acquiring: nothing is held when this raises
                raise ConfigurationError(
                    f"Redlock {self.name!r}: interrupt_on_loss needs the main thread or a gevent greenlet (Python "
                    "raises in no other thread); use on_lost= or check lock.lost in this thread"
                )
        try:
            acquired = self.acquire(blocking=True, timeout=self.timeout)
        except BaseException:
            if target is not None:
                target.disarm()
            raise
        if not acquired:
            if target is not None:
                target.disarm()
            errors = [str(e) for e in self.node_errors]
            if self.contended or not errors:
                raise LockNotAcquiredError(self.name, holder=self.held_by, node_errors=errors)
            raise LockUnavailableError(self.name, holder=self.held_by, node_errors=errors)
        self.lost = False
        self._target = target
        if self.auto_renewal:
            # The process's watchdog renews it every ttl / 3, batched with every other lease it renews.
            self._renewal = watchdog().register(self, self.ttl / 3, self._renewal_lost)
        elif (self.on_lost is not None or target is not None) and self._lease is not None:
            # Not renewed: its end by our clock is its loss, told as a renewal's would be.
            self._expiry = threading.Timer(self.validity, self._ran_out, (self._lease,))
            self._expiry.daemon = True
            self._expiry.start()
        return self

    def _renewal_lost(self, _lease: Lease | None, reason: str) -> None:
        """The watchdog found the lease of this ``with`` block lost (in its thread): flag, callback, interrupt."""
        self.lost = True
        try:
            if self.on_lost is not None:
                self.on_lost(self)
        finally:  # a callback that raises must not keep the block from being interrupted
            target = self._target
            if target is not None:
                target.fire(LockLostError(f"lock {self.name!r} was lost while the block ran: {reason}", key=self.name))

    def _ran_out(self, lease: _Lease) -> None:
        """auto_renewal=False: the lease's end by our clock, in a timer's thread; its loss if still held."""
        if self._lease is lease and self._expiry is not None:
            left = lease.deadline - self._clock()
            if left > 0:  # extended by hand meanwhile: wait for its new end
                self._expiry = threading.Timer(left, self._ran_out, (lease,))
                self._expiry.daemon = True
                self._expiry.start()
                return
            try:
                self._renewal_lost(None, "its ttl ran out (auto_renewal=False)")
            except Exception:
                logger.exception("lock-lost callback for %s raised", self.name)

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> Literal[False]:
        try:
            # First: an interrupt arriving from now on must not raise in what follows (the release).
            target, self._target = self._target, None
            if target is not None:
                target.disarm()
            renewal, self._renewal = self._renewal, None
            if renewal is not None:
                watchdog().unregister(renewal)
            expiry, self._expiry = self._expiry, None
            if expiry is not None:
                expiry.cancel()
        finally:
            self.release()
        return False


outside_body(Redlock.__exit__)  # interrupt_on_loss: a signal handled in __exit__'s own code is not the block's
