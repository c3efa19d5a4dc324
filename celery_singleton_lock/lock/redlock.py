"""Redlock: a lease on one Redis node, or on N independent nodes with a majority quorum.

One node is a plain ``SET NX PX`` lock. N nodes follow antirez's Redlock: the request goes to every node *at
once* (all commands are written before any reply is read, no threads), the lock is ours when a majority
``N // 2 + 1`` said yes, and its validity is ``ttl - elapsed - drift`` measured on a monotonic clock. A failed
attempt is undone on every node that may have said yes.

Only the owner releases or extends: each operation is one Lua script comparing the random owner token, never a
plain ``DEL``. The scripts (``lua/*.lua``, loaded by ``scripts.py``) are sent by SHA (``EVALSHA``) and loaded on a
node only when it says ``NOSCRIPT``. The record and its keys are ``record.py``'s, the fan-out is ``nodes.py``'s;
docs/protocol.md writes the protocol down.

The algorithms (acquire, extend, release, finish, hand-over, the reads) are ``lease.py``'s step machines, which
this face drives with :meth:`NodeSet.drive` and ``aio.AsyncRedlock`` with ``AsyncNodes.drive``: written once for
both. ``lease.py``'s docstring tells how the fencing tokens stay strictly increasing.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time as mod_time
from collections.abc import Callable, Mapping, Sequence
from types import TracebackType
from typing import Literal

import redis

from ..errors import ConfigurationError, LockError, LockLostError
from ._urls import redact_url
from .interrupt import Target, outside_body
from .lease import _Lease, _LeaseSpec
from .nodes import NodeSet
from .record import done_key_for, fence_key_for, record_of, sibling_key, slot_keys
from .renewal import Lease, watchdog

logger = logging.getLogger("celery_singleton_lock.redlock")

__all__ = ["NodeSet", "Redlock", "done_key_for", "fence_key_for", "record_of", "redact_url", "sibling_key", "slot_keys"]


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
        return self.nodes.drive(self._acquire_steps(blocking, timeout, self.replaces), self._sleep)

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
        return nodes.drive(_LeaseSpec._extend_steps(locks, unanswered))

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
            return self.nodes.drive(self._release_steps(lease))

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
            return self.nodes.drive(self._finish_steps(done_for, waited_for, cooldown))

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
            return self.nodes.drive(self._transfer_steps(ttl, record, renewable))

    def hand_on(self, ttl: float, record: Mapping[str, str], *, done_for: float) -> bool:
        """Hand the lease on to another job, as :meth:`transfer`, and mark this lock's ``job`` done (``done_for`` s,
        unless its marker exists) in the same step on each node (``hand_on.lua``). On fewer than a quorum nothing
        stays handed: both tokens are released (the lock is free). LockedTask uses it for ``lock_on_duplicate=
        "cancel"``: a stopped run's lock goes to the newest waiting call (``state: handed``, ``job``: its task id).
        A node holding that job's done marker (it was cancelled by task id, or ran) hands nothing."""
        if self.job is None:
            raise LockError(f"lock {self.name!r} has no job to mark done", key=self.name)
        if not record.get("job"):
            raise LockError(f"lock {self.name!r}: hand_on needs record['job'], the job it hands to", key=self.name)
        if self._forked():
            return False
        with self._mutex:
            return self.nodes.drive(self._hand_on_steps(ttl, record, done_for))

    def owned(self) -> bool:
        """True when the lease is valid by our clock and a quorum of nodes still holds our token."""
        return self.nodes.drive(self._owned_steps())

    def locked(self) -> bool:
        """True when a quorum of nodes holds the key (by anyone); with a limit, when every slot is held."""
        if self.limit == 1:
            return self.holder() is not None
        return len(self.holders()) == self.limit

    def holder(self) -> dict[str, str] | None:
        """The holder record a quorum of nodes holds right now (same owner), or None (free, split, few answers).

        With a limit: the record of the slot this instance holds (or last held), else of slot 0; see ``holders``.
        """
        return self.nodes.drive(self._holders_steps((self.key,)))[0]

    def holders(self) -> list[dict[str, str]]:
        """The holder record of each slot a quorum of nodes holds right now (one entry at most without a limit)."""
        return [r for r in self.nodes.drive(self._holders_steps(self._slots)) if r is not None]

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
            raise self._refusal()
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
