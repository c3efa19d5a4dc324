"""AsyncRedlock: Redlock on ``redis.asyncio``, for ``async def`` code (web handlers, asyncio workers).

The same lease as :class:`~celery_singleton_lock.redlock.Redlock`, run by the same algorithms: ``lease.py``'s step
machines (acquire, extend, release, hand-over), which :meth:`AsyncNodes.drive` runs here and ``NodeSet.drive`` there.
So a sync and an async holder of one name exclude each other and share one fencing sequence. What differs is I/O
only: the fan-out is ``asyncio.gather`` over the nodes, each node's exchange bounded by ``socket_timeout``
(``asyncio.timeout``), so a paused node costs the loop nothing and the attempt at most ``socket_timeout``; and a
caller cancelled mid-attempt has its attempt undone from a background task (a request's ``abandon``).

Clients built from URLs are shared per event loop (a ``redis.asyncio`` connection belongs to the loop that opened
it); :func:`aclose` closes the running loop's (an app's shutdown hook).
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import time as mod_time
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from types import TracebackType
from typing import Any, Literal, TypeVar, cast

import redis.asyncio as aioredis
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.asyncio.sentinel import Sentinel
from redis.exceptions import NoScriptError, RedisError

from ..errors import ConfigurationError, LockLostError
from ._urls import NodeURL, credentials_for, parse_node_url, redact_url, validate_url
from .lease import _Lease, _LeaseSpec
from .nodes import NodeError, Request, Steps, _pack, _pack_call, _url_options
from .record import fence_key_for, fence_key_in_slot
from .scripts import Script

_T = TypeVar("_T")

__all__ = ["AsyncNodes", "AsyncRedlock", "aclose"]

_NO_SETINFO: dict[str, Any] = (
    {"driver_info": None}
    if "driver_info" in inspect.signature(aioredis.Redis.__init__).parameters
    else {"lib_name": None, "lib_version": None}
)

# redis < 5.3 wants a command name (ignored); later versions warn when given one.
_GET_ARGS: tuple[str, ...] = (
    ()
    if inspect.signature(aioredis.ConnectionPool.get_connection).parameters["command_name"].default
    is not inspect.Parameter.empty
    else ("EVALSHA",)
)

_timeout: Any = getattr(asyncio, "timeout", None)
_untyped_sentinel: Any = Sentinel  # untyped in redis-py

# One client per URL and timeout for each event loop (redis.asyncio connections cannot move between loops).
_loop_clients: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[tuple[str, float], Any]] = (
    weakref.WeakKeyDictionary()
)
# At most a pool's max_connections exchanges at once per client pool and loop: redis.asyncio's pool refuses the
# ones beyond (MaxConnectionsError, at once; 100 by default since redis-py 7), which would read as a node down
# when it is only many coroutines of one process acquiring at once. FIFO: a waiter is bounded by the exchanges ahead.
# Kept on the pool itself (attribute _GATE: the loop, weakly, and its semaphore), so no global holds a loop.
_GATE = "_celery_singleton_lock_gate"
# Background work (a cancelled caller's release, a cancelled attempt's undo) must not be garbage-collected mid-flight.
_background: set[asyncio.Task[Any]] = set()


def _spawn(coro: Any) -> asyncio.Task[Any]:
    task: asyncio.Task[Any] = asyncio.ensure_future(coro)
    _background.add(task)
    task.add_done_callback(_background.discard)
    return task


async def aclose() -> None:
    """Close the connections the running event loop opened from URLs (call it from your app's shutdown)."""
    clients = _loop_clients.pop(asyncio.get_running_loop(), {})
    for client in clients.values():
        await client.aclose()


def _wire(values: Sequence[str | int]) -> tuple[bytes | int, ...]:
    """Script keys and arguments as the sync lock sends them (``nodes._pack``): UTF-8 with surrogatepass, since a
    name or task id may hold a lone surrogate (JSON admits "\\ud800") that redis-py's strict encoder refuses."""
    return tuple(v.encode("utf-8", "surrogatepass") if isinstance(v, str) else v for v in values)


def _client_name(client: aioredis.Redis) -> str:
    kwargs = client.connection_pool.connection_kwargs
    if "path" in kwargs:
        return f"unix://{kwargs['path']}"
    return f"{kwargs.get('host', '?')}:{kwargs.get('port', '?')}"


def _sentinel_master(spec: NodeURL, options: dict[str, Any]) -> aioredis.Redis:
    """A client of the master of ``spec.service`` on redis.asyncio, as ``nodes._sentinel_master`` builds it."""
    kwargs = _url_options(spec, options)
    sentinel_kwargs = {k: v for k, v in options.items() if k != "credential_provider"} | {"retry": None}
    sentinel_kwargs.update((name.removeprefix("sentinel_"), value) for name, value in spec.sentinel_options)
    if spec.tls:
        sentinel_kwargs.update({k: v for k, v in kwargs.items() if k.startswith("ssl")})
    sentinel: Any = _untyped_sentinel(list(spec.hosts), sentinel_kwargs=sentinel_kwargs)
    return cast(aioredis.Redis, sentinel.master_for(spec.service, redis_class=aioredis.Redis, **kwargs))


def _cluster_client(spec: NodeURL, options: dict[str, Any]) -> RedisCluster:
    """A redis.asyncio Cluster client of a ``redis+cluster://`` URL, as ``nodes._cluster_client`` builds the sync one
    (one logical Redlock node: each script call goes to the master of its keys' slot)."""
    kwargs = _url_options(spec, options)
    kwargs.pop("db", None)  # validate_url allows db 0 only, and RedisCluster refuses the argument
    kwargs.pop("protocol", None)
    startup = [ClusterNode(host, port) for host, port in spec.hosts]
    return RedisCluster(startup_nodes=startup, require_full_coverage=False, **kwargs)


def _cluster_name(client: RedisCluster) -> str:
    nodes = client.get_nodes() or list(client.nodes_manager.startup_nodes.values())
    return f"redis+cluster://{','.join(sorted(n.name for n in nodes))}"


_Client = aioredis.Redis | RedisCluster


class AsyncNodes:
    """The Redis masters of an :class:`AsyncRedlock`: URLs (``redis://``, ``rediss://``, ``unix://``,
    ``redis+sentinel://``, ``redis+cluster://``; see docs/nodes.md) or ``redis.asyncio.Redis`` clients (a Sentinel
    master too: ``redis.asyncio.sentinel.Sentinel(...).master_for(...)``) and ``redis.asyncio.cluster.RedisCluster``
    clients (a whole Cluster is ONE node of the Redlock, as for :class:`NodeSet`)."""

    def __init__(self, urls: str | _Client | Sequence[str | _Client], *, socket_timeout: float = 0.5) -> None:
        if socket_timeout <= 0:
            raise ConfigurationError(f"socket_timeout must be > 0 seconds, got {socket_timeout!r}")
        items: list[str | _Client] = [urls] if isinstance(urls, str | aioredis.Redis | RedisCluster) else list(urls)
        if not items:
            raise ConfigurationError("at least one Redis node is needed, e.g. 'redis://127.0.0.1:6379/0'")
        names: list[str] = []
        cluster = False
        for i, item in enumerate(items):
            if isinstance(item, str):
                url = validate_url(item)
                spec = parse_node_url(url)
                cluster = cluster or (spec is not None and spec.kind == "cluster")
                items[i] = url
                names.append(redact_url(url))
            elif isinstance(item, aioredis.Redis):
                names.append(_client_name(item))
            elif isinstance(item, RedisCluster):
                cluster = True
                names.append(_cluster_name(item))
            else:
                raise ConfigurationError(
                    "AsyncRedlock nodes are URLs, redis.asyncio.Redis or redis.asyncio.cluster.RedisCluster clients, "
                    f"got {type(item).__name__}"
                )
        if len(set(names)) < len(names):
            raise ConfigurationError("a Redis node is listed twice: Redlock needs independent nodes")
        self._items = tuple(items)
        self.names: tuple[str, ...] = tuple(names)
        self.quorum = len(items) // 2 + 1
        self.socket_timeout = socket_timeout
        self.cluster = cluster

    def same_slot(self, key: str, name: str) -> str:
        """``key`` for a lock named ``name``, kept in ``name``'s slot when a node is a Cluster (NodeSet.same_slot)."""
        return fence_key_in_slot(key, name) if self.cluster else key

    def __len__(self) -> int:
        return len(self._items)

    def __repr__(self) -> str:
        return f"AsyncNodes({list(self.names)!r}, quorum={self.quorum})"

    def clients(self) -> list[_Client]:
        """The clients for the running loop (built from URLs on first use in that loop; nothing connects here)."""
        shared = _loop_clients.setdefault(asyncio.get_running_loop(), {})
        out: list[_Client] = []
        for item in self._items:
            if not isinstance(item, str):
                out.append(item)
                continue
            client = shared.get((item, self.socket_timeout))
            if client is None:
                # RESP2 and no CLIENT SETINFO: a new connection writes nothing before our command, so connecting to
                # a paused node does not wait on a handshake (as nodes.py's clients).
                options: dict[str, Any] = {
                    "socket_timeout": self.socket_timeout,
                    "socket_connect_timeout": self.socket_timeout,
                    "protocol": 2,
                    **_NO_SETINFO,
                }
                provider = credentials_for(item)  # singleton_lock_credential_provider (asked per new connection)
                if provider is not None:
                    options["credential_provider"] = provider
                spec = parse_node_url(item)
                client = (
                    aioredis.Redis.from_url(item, **options)
                    if spec is None
                    else _sentinel_master(spec, options)
                    if spec.kind == "sentinel"
                    else _cluster_client(spec, options)
                )
                shared[(item, self.socket_timeout)] = client
            out.append(client)
        return out

    def error(self, index: int, exc: BaseException) -> NodeError:
        """A redacted description of node ``index``'s failure."""
        if isinstance(exc, asyncio.TimeoutError):
            return NodeError(self.names[index], f"TimeoutError: no answer within {self.socket_timeout} s")
        return NodeError(self.names[index], f"{type(exc).__name__}: {exc}")

    async def drive(self, steps: Steps[_T]) -> _T:
        """Run the step machine ``steps`` to its end (``NodeSet.drive``, awaited): each request fanned out
        by :meth:`run`, each pause slept. A request's ``abandon`` is sent from a background task when the caller is
        cancelled (or fails) while that request is in flight."""
        answers: Any = None
        step: Request | float = 0.0
        try:
            while True:
                step = steps.send(answers)
                call = asyncio.sleep(step) if isinstance(step, float) else self.run(*step[:5])
                answers = await call
        except StopIteration as stop:
            return cast(_T, stop.value)
        except BaseException:
            if not isinstance(step, float) and step[5] is not None:
                _spawn(self.run(*step[5]))
            raise

    async def run(
        self,
        script: Script,
        keys: Sequence[str],
        args: Sequence[str | int],
        nodes: Iterable[int] | None = None,
        undo_on_timeout: tuple[Script, Sequence[str], Sequence[str | int]] | None = None,
    ) -> list[Any]:
        """Run ``script`` on the given nodes (default: all) concurrently; one answer or exception per node (None
        for a node not asked). Each node's exchange is bounded by ``socket_timeout``; ``undo_on_timeout`` is written
        on the same connection when a node timed out after the command was sent (as ``NodeSet.run``)."""
        clients = self.clients()
        indices = range(len(clients)) if nodes is None else list(nodes)
        results: list[Any] = [None] * len(clients)
        if len(indices) == 1:  # one node: no tasks to gather
            results[indices[0]] = await self._call(clients[indices[0]], script, keys, args, undo_on_timeout)
            return results
        answers = await asyncio.gather(*(self._call(clients[i], script, keys, args, undo_on_timeout) for i in indices))
        for i, answer in zip(indices, answers, strict=True):
            results[i] = answer
        return results

    @staticmethod
    def _gate(pool: Any) -> asyncio.Semaphore:
        """The running loop's semaphore for ``pool``: as many slots as the pool has connections."""
        loop = asyncio.get_running_loop()
        gate: tuple[weakref.ref[asyncio.AbstractEventLoop], asyncio.Semaphore] | None = getattr(pool, _GATE, None)
        if gate is None or gate[0]() is not loop:
            size = getattr(pool, "max_connections", None)
            gate = (weakref.ref(loop), asyncio.Semaphore(size if isinstance(size, int) and size > 0 else 2**31))
            setattr(pool, _GATE, gate)
        return gate[1]

    async def _call(
        self,
        client: _Client,
        script: Script,
        keys: Sequence[str],
        args: Sequence[str | int],
        undo: tuple[Script, Sequence[str], Sequence[str | int]] | None,
    ) -> Any:
        if isinstance(client, RedisCluster):
            # Sent as bytes through redis-py's Cluster client (str and int arguments are typed so for the callers;
            # redis-py passes bytes through as is). A plain node's call is packed by nodes._pack_call instead.
            keys, args = cast(Sequence[str], _wire(keys)), cast(Sequence[str | int], _wire(args))
            if undo is not None:
                undo = (undo[0], cast(Sequence[str], _wire(undo[1])), cast(Sequence[str | int], _wire(undo[2])))
            async with self._gate(client):
                return await self._call_cluster(client, script, keys, args, undo)
        pool: Any = client.connection_pool  # untyped in redis-py
        # The wait for a free connection is not the node's time: it is outside the node's deadline.
        async with self._gate(pool):
            return await self._call_gated(client, pool, script, keys, args, undo)

    async def _call_gated(
        self,
        client: aioredis.Redis,
        pool: Any,
        script: Script,
        keys: Sequence[str],
        args: Sequence[str | int],
        undo: tuple[Script, Sequence[str], Sequence[str | int]] | None,
    ) -> Any:
        state: list[Any] = [None, False]  # the connection, and whether the command was sent on it
        try:
            if _timeout is not None:  # Python >= 3.11: a deadline on this task, no task of its own (wait_for's)
                async with _timeout(self.socket_timeout):
                    answer = await self._exchange(pool, state, script, keys, args)
            else:  # pragma: no cover - Python 3.10
                answer = await asyncio.wait_for(self._exchange(pool, state, script, keys, args), self.socket_timeout)
        except (RedisError, OSError, asyncio.TimeoutError) as exc:
            conn = state[0]
            if conn is not None:
                if state[1] and undo is not None and isinstance(exc, asyncio.TimeoutError):
                    # A paused node runs what its socket holds when it wakes up: the undo right after our command.
                    body, undo_keys, undo_args = undo
                    packed = _pack(("EVAL", body.body, len(undo_keys), *undo_keys, *undo_args))
                    with contextlib.suppress(RedisError, OSError, asyncio.TimeoutError):
                        await asyncio.wait_for(conn.send_packed_command(packed, check_health=False), 0.05)
                await self._drop(pool, conn)
            return exc
        except BaseException:  # cancelled: the connection's state is unknown, never reuse it
            if state[0] is not None:
                _spawn(self._drop(pool, state[0]))
            raise
        await pool.release(state[0])
        return answer

    async def _call_cluster(
        self,
        client: RedisCluster,
        script: Script,
        keys: Sequence[str],
        args: Sequence[str | int],
        undo: tuple[Script, Sequence[str], Sequence[str | int]] | None,
    ) -> Any:
        """One script call on a Cluster node: redis-py routes it to the master of the keys' slot (every key of one
        lock is in the name's slot). A timed-out call's undo is sent again in the background: on another connection
        than the call, so a master that was paused (not just slow) may run the undo first and keep the attempt's key
        until its ttl (the plain nodes' same-connection undo is not available through redis-py's Cluster client)."""
        untyped: Any = client  # redis-py's async Cluster client is loosely typed
        try:
            if _timeout is not None:
                async with _timeout(self.socket_timeout):
                    return await self._cluster_exchange(untyped, script, keys, args)
            return await asyncio.wait_for(  # pragma: no cover - Python 3.10
                self._cluster_exchange(untyped, script, keys, args), self.socket_timeout
            )
        except (RedisError, OSError, asyncio.TimeoutError) as exc:
            if undo is not None and isinstance(exc, asyncio.TimeoutError):
                body, undo_keys, undo_args = undo
                _spawn(self._late_undo(untyped, body, undo_keys, undo_args))
            return exc

    async def _late_undo(self, client: Any, body: Script, keys: Sequence[str], args: Sequence[str | int]) -> None:
        with contextlib.suppress(RedisError, OSError, asyncio.TimeoutError):
            await asyncio.wait_for(self._cluster_exchange(client, body, keys, args), self.socket_timeout)

    @staticmethod
    async def _cluster_exchange(client: Any, script: Script, keys: Sequence[str], args: Sequence[str | int]) -> Any:
        try:
            return await client.evalsha(script.sha, len(keys), *keys, *args)
        except NoScriptError:
            return await client.eval(script.body, len(keys), *keys, *args)

    @staticmethod
    async def _exchange(
        pool: Any, state: list[Any], script: Script, keys: Sequence[str], args: Sequence[str | int]
    ) -> Any:
        conn = state[0] = await pool.get_connection(*_GET_ARGS)
        # Packed as the sync face packs it (UTF-8 with surrogatepass, the head cached per script and keys): redis-py's
        # pack_command encodes argument by argument, a fifth of the async cycle's client time (issue 35).
        await conn.send_packed_command(_pack_call(script, keys, args), check_health=False)
        state[1] = True
        try:
            return await conn.read_response(disconnect_on_error=False)
        except NoScriptError:
            await conn.send_packed_command(_pack(("EVAL", script.body, len(keys), *keys, *args)), check_health=False)
            return await conn.read_response(disconnect_on_error=False)

    @staticmethod
    async def _drop(pool: Any, conn: Any) -> None:
        with contextlib.suppress(RedisError, OSError):
            await conn.disconnect(nowait=True)
        await pool.release(conn)


class AsyncRedlock(_LeaseSpec):
    """A distributed lock on one or N independent Redis masters, for asyncio: :class:`Redlock`'s lease, awaited.

    ``async with AsyncRedlock(urls, "invoice:42", ttl=10.0) as lock:`` acquires (waiting ``timeout`` s, ``None``:
    until acquired), renews the lease every ``ttl / 3`` s from a task of its own while the block runs
    (``auto_renewal=False`` turns that off) and releases at the end. With ``cancel_on_loss=True``, a lease lost
    while the block runs (a renewal that finds it held by someone else or gone on too many nodes, or its validity
    run out before a quorum answered) cancels the block at its next ``await`` and ``async with`` raises
    :class:`LockLostError`; without, ``lost`` is set and the block runs on.

    The other arguments are :class:`Redlock`'s (``record``, ``job``, ``fencing``, ``fence_key``, ``limit``,
    ``token``, ``socket_timeout``). Nodes are URLs (``redis://``, ``rediss://``, ``unix://``), ``redis.asyncio.Redis``
    clients, or an :class:`AsyncNodes`. ``release()`` frees the lock even when the awaiting task is cancelled (it is
    sent again from a background task, bounded by ``socket_timeout``); what it cannot reach expires after ``ttl``.
    """

    nodes: AsyncNodes

    def __init__(
        self,
        urls: str | _Client | Sequence[str | _Client] | AsyncNodes,
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
        socket_timeout: float = 0.5,
        auto_renewal: bool = True,
        cancel_on_loss: bool = False,
        clock: Callable[[], float] = mod_time.monotonic,
    ) -> None:
        self._check(name, ttl, timeout, limit, record)
        self.nodes = urls if isinstance(urls, AsyncNodes) else AsyncNodes(urls, socket_timeout=socket_timeout)
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
        )
        self.auto_renewal = auto_renewal
        self.cancel_on_loss = cancel_on_loss
        self._mutex: asyncio.Lock | None = None  # made in the loop: orders release against an extend in flight
        self._mutex_loop: weakref.ref[asyncio.AbstractEventLoop] | None = None
        self._renewer: asyncio.Task[None] | None = None
        self._owner: asyncio.Task[Any] | None = None
        self._cancelled_by_us = False

    def _lock(self) -> asyncio.Lock:
        """The running loop's mutex (an asyncio.Lock that waited once belongs to its loop: one lock used by one
        ``asyncio.run`` after another gets a new one; the old loop has nothing in flight any more)."""
        loop = asyncio.get_running_loop()
        if self._mutex is None or self._mutex_loop is None or self._mutex_loop() is not loop:
            self._mutex = asyncio.Lock()
            self._mutex_loop = weakref.ref(loop)
        return self._mutex

    async def acquire(self, blocking: bool = True, timeout: float | None = None) -> bool:  # noqa: FBT001, FBT002
        """Try to take the lock; with ``blocking``, retry with jittered back-off for at most ``timeout`` s.

        A blocking acquire stops early, returning False, when the job is done (``done``): waiting cannot help.
        A caller cancelled mid-attempt has the attempt undone (in the background, bounded by ``socket_timeout``).
        """
        return await self.nodes.drive(self._acquire_steps(blocking, timeout, None))

    async def extend(self) -> bool:
        """Reset the lease to ``ttl`` if we still hold it; False when not extended (lost: ``validity`` is 0; or
        too few nodes answered: try again before the lease ends)."""
        if self._forked():
            return False
        return await self._renew() is True

    async def _renew(self) -> bool | None:
        """True (extended), False (lost) or None (undecided: too few answers, the lease stands until its deadline).

        ``_LeaseSpec._extend_steps`` for one lease (the watchdog's batched renewal of Redlocks runs it too): only
        nodes that still held our token vote; a node that had lost the key is repaired (and refilled) but does not
        count.
        """
        async with self._lock():
            return (await self.nodes.drive(self._extend_steps([self], None)))[0]

    async def release(self) -> bool:
        """Give the lock up on every node; True if we still held it (on a quorum). Idempotent.

        A caller cancelled while it awaits still frees the lock (the release is sent again from a background task,
        bounded by ``socket_timeout``); a node it cannot reach lets the lease expire after ``ttl``.
        """
        if self._forked():  # the lease of the process this one was forked from: forgotten here, never freed
            return False
        lease = self._lease
        if lease is None:
            return False
        self._lease = None  # a renewal in flight or to come now leaves the lease alone
        lease.renewable = False  # given up, not lost: the renewal must not take it for a loss
        try:
            return await self._release(lease)
        except asyncio.CancelledError:
            # The caller was cancelled mid-release: release again from a task of its own (RELEASE compares the
            # owner token, so a second one is harmless), bounded by socket_timeout. No task in the common case.
            _spawn(self._release(lease))
            raise

    def _release_in_background(self) -> None:
        """Give the lease up from a task of its own (the caller cannot await any more: it is being cancelled)."""
        if self._forked():
            return
        lease, self._lease = self._lease, None
        if lease is not None:
            lease.renewable = False
            _spawn(self._release(lease))

    async def _release(self, lease: _Lease) -> bool:
        async with self._lock():  # after an extend in flight: it could otherwise repair the key just deleted
            return await self.nodes.drive(self._release_steps(lease))

    async def transfer(self, ttl: float, record: Mapping[str, str] | None = None) -> bool:
        """Hand the lease on under a fresh owner token for ``ttl`` s, changing the ``record`` fields, on a quorum
        (:meth:`Redlock.transfer`; the lease is no longer renewed, and ``release()`` still cancels the hand-over)."""
        if self._forked():
            return False
        async with self._lock():
            return await self.nodes.drive(self._transfer_steps(ttl, record, False))  # noqa: FBT003

    async def owned(self) -> bool:
        """True when the lease is valid by our clock and a quorum of nodes still holds our token."""
        return await self.nodes.drive(self._owned_steps())

    async def _renewal(self) -> None:
        """The lease's watchdog while ``async with`` runs: extend every ttl/3 (sooner after an undecided round, and
        never later than the lease's deadline); on loss, cancel the block when ``cancel_on_loss``. With
        ``auto_renewal=False`` it only waits for the lease's end by our clock: that is its loss."""
        interval = self.ttl / 3
        while True:
            lease = self._lease
            if lease is None:
                return
            if not self.auto_renewal:
                await asyncio.sleep(max(0.0, lease.deadline - self._clock()))
                if self._lease is not lease or not lease.renewable:
                    return  # released or handed on meanwhile
                if lease.deadline > self._clock():
                    continue  # extended by hand meanwhile: wait for its new end
                self._lost()
                return
            await asyncio.sleep(max(0.0, min(interval, lease.deadline - self._clock())))
            if self._lease is not lease:
                return  # released meanwhile
            verdict = await self._renew()
            if verdict is False:
                if lease.renewable:  # not released by us meanwhile: lost
                    self._lost()
                return
            interval = max(0.01, self.ttl / 10) if verdict is None else self.ttl / 3

    def _lost(self) -> None:
        self.lost = True
        owner = self._owner
        if self.cancel_on_loss and owner is not None and not owner.done():
            self._cancelled_by_us = True
            owner.cancel()

    async def __aenter__(self) -> AsyncRedlock:
        if not await self.acquire(blocking=True, timeout=self.timeout):
            raise self._refusal()
        self.lost = self._cancelled_by_us = False
        self._owner = asyncio.current_task()
        # Renews the lease (or with auto_renewal=False, only watches for its end: lost, cancel_on_loss).
        self._renewer = asyncio.ensure_future(self._renewal())
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> Literal[False]:
        renewer, self._renewer = self._renewer, None
        try:
            if renewer is not None and not renewer.done():
                renewer.cancel()
                try:
                    await asyncio.wait([renewer])
                except asyncio.CancelledError:
                    # Cancelled while the renewal ends (a second cancel: a TaskGroup's, a timeout's): release anyway,
                    # from a task of its own, or the name would stay blocked for a whole ttl by nobody.
                    self._release_in_background()
                    raise
            await self.release()
        except asyncio.CancelledError:
            # The renewal's cancel arrived after the block's last await: the loss is known at the exit itself.
            if not self._cancelled_by_us:
                raise
            exc_type = asyncio.CancelledError
        if self._cancelled_by_us:
            self._cancelled_by_us = False
            uncancel = getattr(self._owner, "uncancel", None)
            if uncancel is not None:
                uncancel()  # our cancel, not the caller's: Python >= 3.11 counts cancel requests per task
            if exc_type is not None and issubclass(exc_type, asyncio.CancelledError):
                raise LockLostError(f"lock {self.name!r} was lost while the block ran", key=self.name) from None
        return False
