"""The lease, written once: what :class:`~celery_singleton_lock.redlock.Redlock` (sync) and
:class:`~celery_singleton_lock.aio.AsyncRedlock` (asyncio) share, the algorithms included.

Both faces hold the same lease (the same scripts, keys, holder records and fencing counter, the same quorum,
validity and drift rules), so a sync and an async holder of one name exclude each other. This module holds all of
it but the I/O: the arguments' checks and the keys built from them (:class:`_LeaseSpec`), the lease held
(:class:`_Lease`), the pure judges of an acquire's answers (:func:`_tally`, :func:`_settle`, :func:`_findings`), and
the algorithms themselves, acquire (with its back-off), extend (batched: the watchdog's renewal), release, finish,
hand-over (transfer) and the status reads, as *step machines*.

The shape: sans-I/O. A step machine is a generator that yields requests, "run this script with these keys and
arguments on these nodes" (a :data:`~celery_singleton_lock.nodes.Request`) or "wait this many seconds" (a float),
is sent each request's per-node answers, and returns the operation's result. The sync face drives it with
``NodeSet.drive`` (the write-all-then-read-all fan-out), the async face with ``AsyncNodes.drive``
(``asyncio.gather``). A face only takes its mutex, checks for a fork and hands a machine to its driver; no face
sends a script itself (``tests/project/test_layout.py`` holds them to it).

Why this and not one source generated into the other (httpcore's ``unasync``): the faces are not the same code
with ``await`` taken out. Their I/O differs in kind (one fan-out writes every command before reading any reply on
raw connections, the other gathers coroutines each bounded by ``asyncio.timeout``), their mutexes differ (a thread
lock held across a batched renewal of many leases, an ``asyncio.Lock`` per loop), and so do their lives (the sync
lock is renewed by the process's watchdog thread, the async one by a task of its own, with cancellation to undo).
A generated copy would carry all of that as branches on "am I async", plus a second file to keep in step with a
check; a step machine keeps the algorithm in one place that both run as it is, testable without I/O. Its cost is
one generator per operation: requests are plain tuples and a one-attempt acquire is one machine, not two, which
keeps it to a few tenths of a microsecond of Python per lock cycle (docs/benchmarks.md, "The lease once").
Cancellation (the async face's own concern) rides on the requests: an acquire's requests carry the undo to send
from a background task if the caller is cancelled while they are in flight (their ``abandon``).

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

import itertools
import random
import secrets
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol

from redis.exceptions import TimeoutError as RedisTimeoutError

from ..errors import ConfigurationError, LockError, LockNotAcquiredError, LockUnavailableError
from .nodes import NodeError, Steps, current_pid
from .record import _brief, _merged, _prefixed, done_key_for, record_of, slot_keys
from .scripts import (
    ACQUIRE,
    ACQUIRED,
    DONE,
    EXTEND,
    EXTENDED,
    FENCE,
    FINISH,
    HAND_ON,
    LOST,
    REFILL,
    RELEASE,
    REPAIRED,
    STATUS,
    TRANSFER,
    UNDO,
)

__all__ = ["Fanout"]


class Fanout(Protocol):
    """What the step machines read of a face's nodes (``NodeSet``, ``AsyncNodes``); the I/O is the driver's."""

    quorum: int

    def __len__(self) -> int: ...

    def error(self, index: int, exc: BaseException) -> NodeError:
        """A redacted description of node ``index``'s failure."""
        ...


@dataclass(slots=True)
class _Lease:
    token: str
    ttl_ms: int
    fence: int
    deadline: float  # monotonic; the lock is ours until then under Redlock's assumptions
    renewable: bool = True  # False once handed over (transfer): the marker is never extended
    fields: tuple[str, ...] = ()  # the record's fields (field, value, ...) besides owner and fence, for a refill
    key: str = ""  # the key the record lives under: the name, or with a limit the slot taken
    pid: int = field(default_factory=current_pid)  # the process that took it: a forked child never renews or frees it


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


def _granted_alike(answers: Sequence[Any]) -> int | None:
    """The fencing token every node granted the acquire with, or None when one did not grant or gave another."""
    fence = None
    for answer in answers:
        if type(answer) is not list or answer[0] != ACQUIRED:
            return None
        token = int(answer[1])
        if fence is None:
            fence = token
        elif token != fence:
            return None
    return fence


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
    if len(holders) == 1:  # one node (or one refusal): its holder, as below without the counting
        held_by, ms, record = holders[0]
        count = 1
        held_for = ms / 1000.0
        holder_record = _merged((record,))
    elif holders:
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

    nodes: Fanout
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
        if record:
            fields = dict(record)
            if job is not None:
                fields["job"] = job
            self._fields: tuple[str, ...] = tuple(itertools.chain.from_iterable(fields.items()))
        else:  # the common cases, built without a dict
            self._fields = () if job is None else ("job", job)
        self.limit = limit
        if limit == 1 and scan <= 1:  # a plain lock (the hot path: a lock built per use)
            self._slots: tuple[str, ...] = (name,)
            self._keys: tuple[str, ...] = (
                (name, fence_key) if job is None else (name, fence_key, done_key_for(name, job))
            )
            self._limit_arg = "1"
        else:
            self._slots = slot_keys(name, max(limit, scan))
            self._keys = (
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
    #: Who asked this lease's job to stop (``lock_on_duplicate="cancel"``): the task id a renewal found in the
    #: record's ``cancel`` field on any node (``extend.lua`` answers it in place of EXTENDED); None: nobody.
    cancel_by: str | None = None

    #: True while the findings of a failed attempt are set (a won attempt then resets them; otherwise it need not).
    _found: bool = False

    def _reset_failure(self) -> None:
        """Back to the class's defaults (no finding), whatever an earlier attempt found."""
        self.split = self.done = self.contended = self._found = False
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
        if self._lease is None or self._lease.pid != current_pid():
            return 0.0
        return max(0.0, self._lease.deadline - self._clock())

    def _forked(self) -> bool:
        """True (and the lease dropped here) when the lease was taken by the process this one was forked from: it is
        the parent's, still held and renewed there; a child that released or extended it would free the parent's lock
        for a second holder (or wait forever on a mutex a parent's thread held at the fork)."""
        lease = self._lease
        if lease is not None and lease.pid != current_pid():
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
        if self._found:
            self._reset_failure()
        return True

    def _refusal(self) -> LockError:
        """What a ``with`` / ``async with`` that could not acquire raises: held by someone else (or nobody answered
        wrongly), or the lock state unknown (too many nodes did not answer)."""
        errors = [str(e) for e in self.node_errors]
        if self.contended or not errors:
            return LockNotAcquiredError(self.name, holder=self.held_by, node_errors=errors)
        return LockUnavailableError(self.name, holder=self.held_by, node_errors=errors)

    # -- the step machines (see the module's docstring): each yields requests (or pauses), returns the result --------

    def _acquire_steps(self, blocking: bool, timeout: float | None, replaces: str | None) -> Steps[bool]:  # noqa: FBT001
        """Try to take the lock; with ``blocking``, retry with jittered back-off for at most ``timeout`` s (None:
        ``self.timeout``). A blocking acquire stops early, returning False, when the job is done (``done``)."""
        # A fresh owner token per attempt: attempt k's undo (or a late copy of its acquire, delivered after attempt
        # k+1 succeeded) then matches nothing of attempt k+1's, and cannot delete or re-set its lease.
        if not blocking:  # one attempt: its machine itself (the hot path: one generator, not two)
            return self._attempt_steps(self._new_token(), replaces)
        return self._retry_steps(timeout, replaces)

    def _retry_steps(self, timeout: float | None, replaces: str | None) -> Steps[bool]:
        if timeout is None:
            timeout = self.timeout
        deadline = None if timeout is None else self._clock() + timeout
        attempt = 0
        while True:
            if (yield from self._attempt_steps(self._new_token(), replaces)):
                return True
            if self.done:
                return False
            delay = random.uniform(self.RETRY_BASE, min(self.RETRY_CAP, self.RETRY_BASE * 2**attempt))  # noqa: S311
            if deadline is not None:
                remaining = deadline - self._clock()
                if remaining <= 0:
                    return False
                delay = min(delay, remaining)
            yield delay
            attempt += 1

    def _attempt_steps(self, token: str, replaces: str | None) -> Steps[bool]:
        """One attempt under ``token``: True (the lease is ours, ``_won``) or False (undone; the findings set)."""
        ttl_ms = int(self.ttl * 1000)
        nodes = self.nodes
        # Every request of the attempt carries its undo: the async face sends it from a background task when the
        # caller is cancelled meanwhile (some nodes may hold this token: the name would stay blocked for a ttl).
        undo = (UNDO, self._slots, (token,))
        start = self._clock()
        args: tuple[str | int, ...] = (
            token,
            ttl_ms,
            self._fencing,
            replaces or "",
            self.job or "",
            self._limit_arg,
            *self._fields,
        )
        answers = yield (ACQUIRE, self._keys, args, None, undo, undo)  # undone on a timeout, or if abandoned
        if len(self._slots) == 1:
            # The common case, every node granted the one key: the general path below with nothing to undo, fence
            # or settle, when every node gave the same fencing token (always so on one node).
            fence = _granted_alike(answers)
            deadline = start + self.ttl - self._drift()
            if fence is not None and deadline > self._clock():
                # Positional, the pid passed (no default factory called): a lease per cycle of a lock built per use.
                lease = _Lease(token, ttl_ms, fence, deadline, True, self._fields, self._slots[0], current_pid())  # noqa: FBT003
                return self._won(lease)
        fences, slots, holders, slot_owners, failed, done = _tally(answers)
        errors = [nodes.error(i, exc) for i, exc in failed]
        key, granted = _settle(fences, slots, self._slots)
        if len(granted) >= nodes.quorum and not done:
            if len(granted) < len(fences):
                others = [i for i in fences if i not in granted]
                yield (UNDO, self._slots, (token,), others, None, undo)
                fences = granted
            fence = max(fences.values())
            behind = [i for i, f in fences.items() if f < fence]
            confirmed = len(fences) - len(behind)
            if behind and confirmed < nodes.quorum:
                # Answers come by node index (None for nodes not asked), not by position in ``behind``.
                fenced = yield (FENCE, (key, self.fence_key), (token, fence), behind, None, undo)
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
            yield (UNDO, self._slots, (token,), fences, None, undo)
        # Every finding is set here (none of an earlier attempt's stays), and a won attempt resets them all.
        self._found = True
        self.node_errors = tuple(errors)
        self.done = done
        self.held_by, self.held_for, self.holder_record, self.contended, self.split = _findings(
            holders, slot_owners, fences, bool(errors), len(nodes), nodes.quorum, self.limit, self.job
        )
        return False

    def _release_steps(self, lease: _Lease) -> Steps[bool]:
        """Give ``lease`` up on every node (the caller has dropped it): True if we still held it on a quorum."""
        answers = yield (RELEASE, (lease.key,), (lease.token,), None, None, None)
        freed = answers.count(1)
        return freed >= self.nodes.quorum and lease.deadline > self._clock()

    def _finish_steps(self, done_for: float, waited_for: float, cooldown: float) -> Steps[bool]:
        """Release the lease (or keep it ``cooldown`` s) and mark ``job`` done, in one round trip (``finish``)."""
        assert self.job is not None
        lease = self._lease
        self._lease = None
        token = lease.token if lease is not None else ""
        answers = yield (
            FINISH,
            (lease.key if lease is not None else self.name, done_key_for(self.name, self.job)),
            (
                token,
                max(1, int(done_for * 1000)),
                max(1, int(waited_for * 1000)),
                int(cooldown * 1000),
                self._new_token() if cooldown > 0 else "",  # the cooldown record's owner, if one is kept
            ),
            None,
            None,
            None,
        )
        freed = answers.count(1)
        return lease is not None and freed >= self.nodes.quorum and lease.deadline > self._clock()

    def _transfer_steps(self, ttl: float, record: Mapping[str, str] | None, renewable: bool) -> Steps[bool]:  # noqa: FBT001
        """Hand the lease on under a fresh owner token for ``ttl`` s, changing the ``record`` fields, on a quorum."""
        lease = self._lease
        if lease is None:
            return False
        start = self._clock()
        token = self._new_token()
        changes = [x for kv in (record or {}).items() for x in kv]
        answers = yield (TRANSFER, (lease.key,), (lease.token, token, int(ttl * 1000), *changes), None, None, None)
        current = dict(zip(lease.fields[::2], lease.fields[1::2], strict=True)) | dict(record or {})
        moved = answers.count(1)
        held = moved >= self.nodes.quorum and lease.deadline > self._clock()
        lease.renewable = False  # handed on: a renewal waiting for its turn must not take it for a loss
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

    def _hand_on_steps(self, ttl: float, record: Mapping[str, str], done_for: float) -> Steps[bool]:
        """Hand the lease on as ``_transfer_steps`` does, marking ``job`` done on every node in the same step; on fewer
        than a quorum it is undone everywhere (both tokens released): the lock is free, never held by a minority. A
        node where the new owner (``record["job"]``) has ended (its done marker: cancelled by task id, or ran) hands
        nothing: a lock handed to a job that never runs would hold the key until the hand-over expires."""
        assert self.job is not None
        lease = self._lease
        if lease is None:
            return False
        start = self._clock()
        token = self._new_token()
        changes = [x for kv in record.items() for x in kv]
        answers = yield (
            HAND_ON,
            (lease.key, done_key_for(self.name, self.job), done_key_for(self.name, record["job"])),
            (lease.token, token, int(ttl * 1000), max(1, int(done_for * 1000)), *changes),
            None,
            None,
            None,
        )
        lease.renewable = False  # handed on: a renewal waiting for its turn must not take it for a loss
        if answers.count(1) >= self.nodes.quorum and lease.deadline > self._clock():
            current = dict(zip(lease.fields[::2], lease.fields[1::2], strict=True)) | dict(record)
            # The instance keeps the handed-on token, so release() can still cancel the hand-over.
            self._lease = _Lease(
                token,
                int(ttl * 1000),
                lease.fence,
                start + ttl - self._drift(),
                renewable=False,
                fields=tuple(x for kv in current.items() for x in kv),
                key=lease.key,
            )
            return True
        self._lease = None
        yield (RELEASE, (lease.key,), (token,), None, None, None)
        yield (RELEASE, (lease.key,), (lease.token,), None, None, None)
        return False

    def _owned_steps(self) -> Steps[bool]:
        """True when the lease is valid by our clock and a quorum of nodes still holds our token."""
        self._forked()
        lease = self._lease
        if lease is None or lease.deadline <= self._clock():
            return False
        answers = yield (STATUS, (lease.key, self.fence_key), (), None, None, None)
        mine = sum(
            1 for a in answers if not isinstance(a, BaseException) and record_of(a[0]).get("owner") == lease.token
        )
        return mine >= self.nodes.quorum

    def _holders_steps(self, keys: Sequence[str]) -> Steps[list[dict[str, str] | None]]:
        """For each of ``keys``: the holder record a quorum of nodes holds right now (same owner), or None."""
        out: list[dict[str, str] | None] = []
        for key in keys:
            answers = yield (STATUS, (key, self.fence_key), (), None, None, None)
            records = [record_of(a[0]) for a in answers if not isinstance(a, BaseException) and a[0]]
            owners = Counter(r.get("owner", "") for r in records)
            holder: dict[str, str] | None = None
            if owners:
                owner, count = owners.most_common(1)[0]
                if count >= self.nodes.quorum:
                    holder = _merged(r for r in records if r.get("owner", "") == owner)
            out.append(holder)
        return out

    @staticmethod
    def _extend_steps(locks: Sequence[_LeaseSpec], unanswered: set[int] | None) -> Steps[list[bool | None]]:
        """Extend the leases of ``locks`` (one set of nodes, each lock's mutex held) in one round trip per node.

        One answer per lock: True (extended), False (lost: too many nodes hold someone else's token or lost ours, or
        the lease ran out), or None (undecided: too few nodes answered; the lease stands until its deadline). A lease
        released or handed over meanwhile is left alone (False). A node where a key is missing (restarted, or
        unreachable at acquire) gets it back, with its fencing counter raised to our token (and its record refilled),
        but only a node that still held our token votes: a node that lost the key means someone else may have held
        the lock in between. ``unanswered``: the nodes not to ask (they failed an earlier batch of this renewal), to
        which the nodes failing now are added.
        """
        out: list[bool | None] = [False] * len(locks)
        # The leases as they are now: the async face's release drops its lease before it waits for the mutex, so
        # the lock's lease may be gone once the answers are in (the extend then judges the lease it sent).
        live: list[tuple[int, _Lease]] = []
        for i, lock in enumerate(locks):
            lease = lock._lease
            if lease is not None and lease.renewable and lease.deadline > lock._clock():
                live.append((i, lease))
            elif lease is not None and lease.renewable:
                lock._lease = None
        if not live:
            return out
        nodes = locks[0].nodes
        keys: list[str] = []
        args: list[str | int] = []
        for i, lease in live:
            keys += (lease.key, locks[i].fence_key)
            args += (lease.token, lease.ttl_ms, lease.fence)
        clock = locks[0]._clock
        start = clock()
        answers: list[Any]
        if unanswered:
            asked = [j for j in range(len(nodes)) if j not in unanswered]
            answers = yield (EXTEND, keys, args, asked, None, None)
            for j in unanswered:
                answers[j] = RedisTimeoutError("not asked: it did not answer an earlier batch of this renewal")
        else:
            answers = yield (EXTEND, keys, args, None, None, None)
        if unanswered is not None:
            unanswered.update(j for j, a in enumerate(answers) if isinstance(a, BaseException))
        now = clock()
        for n, (i, lease) in enumerate(live):
            lock = locks[i]
            codes = [None if isinstance(a, BaseException) else a[n] for a in answers]
            for j, c in enumerate(codes):
                if isinstance(c, bytes | str):  # extended, and asked to stop (one node's word suffices: a request)
                    lock.cancel_by = c.decode() if isinstance(c, bytes) else c
                    codes[j] = EXTENDED
            repaired = [j for j, c in enumerate(codes) if c == REPAIRED]
            if repaired and lease.fields:
                # A node that lost the key (restarted) now holds owner and fence only: give it the whole record
                # back, or a reader there (a redelivery, the CLI) could not tell whose job holds it.
                yield (REFILL, (lease.key,), (lease.token, *lease.fields), repaired, None, None)
            votes = codes.count(EXTENDED)
            # A node that answered LOST (someone else holds it) or REPAIRED (it had lost our key) no longer holds
            # our lease; one that did not answer may still hold it.
            gone = sum(1 for c in codes if c in (LOST, REPAIRED))
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
            if any(c is not None and c != LOST for c in codes):
                # Lost, yet some nodes still (or again, by repair) hold our token: take it back off them, or a
                # key nobody owns would block the name for a whole ttl (e.g. after `celery locks release`).
                yield (RELEASE, (lease.key,), (lease.token,), None, None, None)
        return out
