"""Nodes: connections to the lock's Redis masters, and the one fan-out every lock operation goes through.

A node is a Redis master (a URL, a ``redis.Redis``, a Sentinel-managed master) or a whole Redis Cluster (ONE
logical node whose script calls go to the master of their keys' slot). :class:`NodeSet` sends a script to every node
at once (all commands written before any reply is read, no threads) and gathers one answer or exception per node.
Connections of the pools built from URLs are checked out on a lean path of our own (``_take``/``_give``) and read
by our own RESP2 reader (``_resp``) where it can.

:meth:`NodeSet.drive` runs one of the lease's step machines (``lease.py``): each :data:`Request` it yields is one
fan-out (:meth:`NodeSet.run`), each number a sleep. ``aio.AsyncNodes.drive`` runs the same machines with
``asyncio``: the acquire, extend, release and hand-over are written once, in ``lease.py``.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
import re
import threading
import time as mod_time
from collections import deque
from collections.abc import Callable, Generator, Iterable, Mapping, Sequence
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, ClassVar, TypeVar, cast

import redis
import redis.connection
from redis.cluster import ClusterNode, RedisCluster
from redis.connection import ConnectionPool
from redis.exceptions import AskError, MovedError, NoScriptError, RedisClusterException, RedisError, ResponseError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.sentinel import Sentinel, SentinelConnectionPool

from ..errors import ConfigurationError
from . import _resp
from ._urls import NodeURL, credentials_for, credentials_version, parse_node_url, redact_url, validate_url
from .record import _key_slot, fence_key_in_slot
from .scripts import Script

__all__ = ["IDLE_MAX", "NodeError", "NodeSet", "Request", "Steps", "Undo", "current_pid"]

_T = TypeVar("_T")

#: A script call as :meth:`NodeSet.run` takes it: the script, its keys, its arguments.
Undo = tuple[Script, Sequence[str], Sequence[str | int]]


#: A step machine's request, a plain tuple (cheap: the hot path makes two per lock cycle):
#: ``(script, keys, args, nodes, undo_on_timeout, abandon)``. Run ``script`` with ``keys`` and ``args`` on ``nodes``
#: (None: all) at once and send back one answer per node (an exception for a node that failed, None for a node not
#: asked); ``undo_on_timeout`` as :meth:`NodeSet.run` takes it; ``abandon`` (the async face only) is sent from a
#: background task when the caller is cancelled (or fails) while the request is in flight (a cancelled attempt takes
#: its token back off the nodes). Its first five items are :meth:`NodeSet.run`'s arguments, in order.
Request = tuple[Script, Sequence[str], Sequence[str | int], Iterable[int] | None, Undo | None, Undo | None]

#: A step machine (see ``lease.py``): a generator yielding a :data:`Request` (sent the nodes' answers) or a float
#: (seconds to wait: an acquire's back-off; sent None), and returning the operation's result.
Steps = Generator[Request | float, Any, _T]


_NO_SETINFO: dict[str, Any] = (
    {"driver_info": None}
    if "driver_info" in inspect.signature(redis.Redis.__init__).parameters
    else {"lib_name": None, "lib_version": None}
)

# redis-py functions without type annotations, called through Any (mypy --strict refuses untyped calls).
_untyped: Any = SimpleNamespace(parse_url=redis.connection.parse_url, Sentinel=Sentinel, ClusterNode=ClusterNode)


class _Key(tuple[object, ...]):
    """A cache key holding URLs: a plain tuple to the dict, whose repr shows every URL redacted (no password)."""

    __slots__ = ()

    def __repr__(self) -> str:
        return f"_Key({_redacted(tuple(self))!r})"


def _redacted(value: object) -> object:
    if isinstance(value, str):
        return redact_url(value)
    if isinstance(value, tuple):
        return tuple(_redacted(v) for v in value)
    return value


_clients: dict[_Key, redis.Redis | _Cluster] = {}
_clients_lock = threading.Lock()

# What a NodeSet built from URL strings holds (its instance dict), per (URLs, socket_timeout, connect_timeout,
# credential providers' version): parsing and validating a URL list costs ~10-50 µs, more than a lock call's client
# Python, and ``with Redlock(url, ...)`` builds one per use. Only immutable things are cached (the process-wide
# clients of _client_for, names, flags); a forked child keeps them as it keeps the clients (redis-py's pool and
# _take start afresh on a new pid). Bounded: a process building NodeSets of ever new URL lists drops the oldest.
_built: dict[_Key, dict[str, Any]] = {}
_BUILT_MAX = 256


def _client_for(url: str, socket_timeout: float, connect_timeout: float) -> redis.Redis | _Cluster:
    """One client (and so one connection pool) per URL and timeouts, shared by every lock in the process.

    redis-py's pool notices a fork (it compares the pid) and starts afresh in the child, so sharing is safe across
    ``fork()``, and the pool itself is thread-safe. Nothing here connects: a node that is down when the worker
    starts is a node that does not answer yet, not an error.
    """
    provider = credentials_for(url)  # singleton_lock_credential_provider: asked on every new connection
    cache_key = _Key((url, socket_timeout, connect_timeout, id(provider)))
    with _clients_lock:
        client = _clients.get(cache_key)
        if client is None:
            spec = parse_node_url(url)
            # RESP2 and no CLIENT SETINFO: a new connection then writes nothing before our command (no HELLO), so
            # connecting to a paused node does not block on a handshake reply before the fan-out is sent.
            options: dict[str, Any] = {
                "socket_timeout": socket_timeout,
                "socket_connect_timeout": connect_timeout,
                "protocol": 2,
                **_NO_SETINFO,
                **({"credential_provider": provider} if provider is not None else {}),
            }
            if spec is None:
                client = redis.Redis.from_url(url, **options)
            elif spec.kind == "sentinel":
                client = _sentinel_master(spec, options)
            else:
                client = _Cluster(spec.name, factory=functools.partial(_cluster_client, spec, options))
            _clients[cache_key] = client
        return client


def _url_options(spec: NodeURL, options: Mapping[str, Any]) -> dict[str, Any]:
    """Connection options of a Sentinel or Cluster URL's data nodes: ours, then the URL's (redis-py's parser)."""
    parsed = dict(_untyped.parse_url(spec.plain))
    for name in ("host", "port", "connection_class", "path"):
        parsed.pop(name, None)
    if spec.tls:
        parsed["ssl"] = True
    return {**options, **parsed}


def _sentinel_master(spec: NodeURL, options: Mapping[str, Any]) -> redis.Redis:
    """A client of the master of ``spec.service``, asking the Sentinels where it is on every new connection."""
    kwargs = _url_options(spec, options)
    # No retries: redis.Redis retries a refused connect 3 times with back-off by default, and a Sentinel that is down
    # would then cost seconds on every new connection to the master (the next Sentinel is asked at once instead).
    sentinel_kwargs = {k: v for k, v in options.items() if k != "credential_provider"} | {"retry": None}
    sentinel_kwargs.update((name.removeprefix("sentinel_"), value) for name, value in spec.sentinel_options)
    if spec.tls:  # the Sentinels of a TLS deployment listen on TLS too, with the same certificates
        sentinel_kwargs.update({k: v for k, v in kwargs.items() if k.startswith("ssl")})
    sentinel: Any = _untyped.Sentinel(list(spec.hosts), sentinel_kwargs=sentinel_kwargs)
    return cast(redis.Redis, sentinel.master_for(spec.service, redis_class=redis.Redis, **kwargs))


def _cluster_client(spec: NodeURL, options: Mapping[str, Any]) -> RedisCluster:
    kwargs = _url_options(spec, options)
    kwargs.pop("db", None)  # validate_url allows db 0 only, and RedisCluster refuses the argument
    startup = [_untyped.ClusterNode(host, port) for host, port in spec.hosts]
    # require_full_coverage=False: with one master down, the slots of the others still work.
    return RedisCluster(startup_nodes=startup, require_full_coverage=False, **kwargs)


@dataclass
class _Call:
    """One script call to one Cluster slot: the items of a batch (None: the whole call) it carries."""

    slot: int
    command: tuple[str | int, ...]
    items: list[int] | None


class _Cluster:
    """A Redis Cluster as ONE logical Redlock node: each script call goes to the master of its keys' slot.

    Built from a ``redis+cluster://`` URL, the ``RedisCluster`` client (which reads the slot map when it is made)
    is made on first use, so a cluster that is down when the worker starts is a node that does not answer yet.
    As a member of ``NodeSet.clients`` it stands for that client (attribute access is passed on): the CLI's SCAN
    and the stats flush use it as one.
    """

    REFRESH_EVERY: ClassVar[float] = 1.0  # at most one re-read of the slot map per second, after a failure

    def __init__(
        self, name: str, *, client: RedisCluster | None = None, factory: Callable[[], RedisCluster] | None = None
    ) -> None:
        self.name = name
        self._client = client
        self._factory = factory
        self._lock = threading.Lock()
        self._stale = False
        self._refreshed = 0.0

    def __repr__(self) -> str:
        return f"<Redis Cluster {self.name}>"

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("_"):
            raise AttributeError(attr)
        return getattr(self.get(), attr)

    def get(self) -> RedisCluster:
        """The client, made now if it was not yet; raises redis's ConnectionError when no startup node answers."""
        client = self._client
        if client is None:
            with self._lock:
                if self._client is None:
                    assert self._factory is not None
                    try:
                        self._client = self._factory()
                    except RedisClusterException as exc:
                        raise RedisConnectionError(f"Redis Cluster {self.name} did not answer: {exc}") from None
                client = self._client
        if self._stale and mod_time.monotonic() - self._refreshed >= self.REFRESH_EVERY:
            self._stale = False
            self._refreshed = mod_time.monotonic()
            try:
                client.nodes_manager.initialize()
            except (RedisError, RedisClusterException, OSError):
                self._stale = True
        return client

    def stale(self) -> None:
        """A master failed or a slot moved: re-read the slot map before the next call (at most once a second)."""
        self._stale = True

    def pool(self, slot: int) -> ConnectionPool:
        """The connection pool of the master serving ``slot``."""
        client = self.get()
        try:
            node = client.nodes_manager.get_node_from_slot(slot)
        except RedisClusterException as exc:  # a slot no master serves (the cluster is down or resharding)
            self.stale()
            raise RedisConnectionError(f"Redis Cluster {self.name}: {exc}") from None
        return client.get_redis_connection(node).connection_pool

    def pool_at(self, host: str, port: int) -> ConnectionPool:
        """The connection pool of the node at ``host:port`` (an ASK redirection's target)."""
        client = self.get()
        node = cast(Any, client).get_node(host=host, port=port) or _untyped.ClusterNode(host, port)
        return client.get_redis_connection(node).connection_pool

    @staticmethod
    def calls(script: Script, keys: Sequence[str], args: Sequence[str | int]) -> list[_Call]:
        """``script`` on ``keys`` and ``args`` as calls of one slot each (a batch split by slot, in item order)."""
        if script.batch is None:
            slots = {_key_slot(k) for k in keys} or {0}
            if len(slots) > 1:
                raise ResponseError(
                    "CROSSSLOT: the keys of one lock call hash to different Redis Cluster slots: give them one hash "
                    "tag (see docs/nodes.md)"
                )
            return [_Call(slots.pop(), ("EVALSHA", script.sha, len(keys), *keys, *args), None)]
        per_key, per_arg = script.batch
        count = len(keys) // per_key
        shared = args[count * per_arg :] if per_arg else args
        by_slot: dict[int, list[int]] = {}
        for item in range(count):
            item_keys = keys[item * per_key : (item + 1) * per_key]
            slot = _key_slot(item_keys[0])
            if any(_key_slot(k) != slot for k in item_keys[1:]):
                raise ResponseError("CROSSSLOT: the keys of one lock hash to different Redis Cluster slots")
            by_slot.setdefault(slot, []).append(item)
        out = []
        for slot, items in by_slot.items():
            call_keys = [k for i in items for k in keys[i * per_key : (i + 1) * per_key]]
            call_args = [a for i in items for a in args[i * per_arg : (i + 1) * per_arg]] if per_arg else []
            out.append(_Call(slot, ("EVALSHA", script.sha, len(call_keys), *call_keys, *call_args, *shared), items))
        return out or [_Call(0, ("EVALSHA", script.sha, 0, *shared), [])]


#: The packed ``EVALSHA <sha> <numkeys> <keys...>`` of a script call, per (script, keys): a lock's calls repeat their
#: keys (every cycle of one name, every lock built per use on it), so only the arguments are packed per call. Bounded:
#: a process locking ever new names clears it when full (a dict lookup costs less than packing the head again).
_heads: dict[tuple[Script, tuple[str, ...]], bytes] = {}
_HEADS_MAX = 4096


def _pack_call(script: Script, keys: Sequence[str], args: Sequence[str | int]) -> bytes:
    """``_pack(("EVALSHA", script.sha, len(keys), *keys, *args))``, the head taken from ``_heads`` when ``keys`` is
    a tuple, the arguments packed in one pass (one ASCII check for them all: a lock call's arguments nearly always
    are)."""
    if type(keys) is not tuple:  # a batch's keys (a list, built per call): nothing to reuse
        return _pack(("EVALSHA", script.sha, len(keys), *keys, *args))
    cache_key = (script, keys)
    head = _heads.get(cache_key)
    if head is None:
        if len(_heads) >= _HEADS_MAX:
            _heads.clear()
        head = _heads[cache_key] = _pack(("EVALSHA", script.sha, len(keys), *keys)).partition(b"\r\n")[2]
    text = "".join([f"${len(a)}\r\n{a}\r\n" if type(a) is str else f"${len(str(a))}\r\n{a}\r\n" for a in args])
    if not text.isascii():
        return _pack(("EVALSHA", script.sha, len(keys), *keys, *args))
    return b"*%d\r\n%b%b" % (3 + len(keys) + len(args), head, text.encode())


def _pack(command: Sequence[str | int]) -> bytes:
    """The RESP encoding of a command of str/int arguments, built once and sent to every node.

    Built as one str and encoded once (a task's acquire has ~20 arguments: a bytes format per argument cost about
    a quarter more). A RESP length counts bytes: only an argument that is not ASCII needs its own encode for it.
    surrogatepass: a JSON message may carry a lone surrogate ("\ud800") in a task id, which strict UTF-8 refuses.
    """
    parts = [f"*{len(command)}\r\n"]
    for arg in command:
        text = arg if isinstance(arg, str) else str(arg)
        size = len(text) if text.isascii() else len(text.encode("utf-8", "surrogatepass"))
        parts.append(f"${size}\r\n{text}\r\n")
    return "".join(parts).encode("utf-8", "surrogatepass")


# Idle connections of the pools we built from URLs, per process. Checking a connection out of redis-py's pool costs
# a lock, a can_read() poll (a recv and two settimeout calls), observability hooks and a pid check: about 40% of a
# lock cycle's client CPU. A connection goes back on this list only after its reply was read in full, so none
# holds stale data; deque.pop/append are atomic, so threads need no lock; a forked child starts a list of its own.
_idle: dict[ConnectionPool, tuple[int, deque[Any]]] = {}


_idle_lock = threading.Lock()

# os.getpid() is a system call (glibc no longer caches it), and a lock cycle asked it six times (the checkouts, the
# lease's owner process): the pid is kept here, renewed in a forked child (os.fork's hook; billiard and
# multiprocessing fork through it), as _run's worker id is.
_pid = os.getpid()


def _after_fork() -> None:
    global _pid  # noqa: PLW0603 - one per process
    _pid = os.getpid()


os.register_at_fork(after_in_child=_after_fork)


def current_pid() -> int:
    """This process's id, without a system call (renewed after a fork)."""
    return _pid


IDLE_MAX = 64  # idle connections kept per node and process; more (a burst of threads) are closed when returned


def _take(pool: ConnectionPool) -> tuple[Any, bool]:
    """An idle connection of ours to the pool's node (reused: True), or a new one (not yet connected)."""
    entry = _idle.get(pool)
    pid = _pid
    if entry is None or entry[0] != pid:
        with _idle_lock:
            entry = _idle.get(pool)
            if entry is None or entry[0] != pid:
                entry = _idle[pool] = (pid, deque())
    try:
        return entry[1].pop(), True
    except IndexError:
        return pool.connection_class(**pool.connection_kwargs), False


def _fast(conn: Any) -> bool:
    """Whether our own RESP2 reader can serve ``conn`` (see ``_resp``): checked once per connection, once connected."""
    if conn._sock is None:
        return False
    flag = conn.__dict__.get("_csl_fast")
    if flag is None:
        flag = conn._csl_fast = _resp.usable(conn)
    return bool(flag)


def _give(pool: ConnectionPool, conn: Any) -> None:
    entry = _idle.get(pool)
    if entry is not None and entry[0] == _pid and len(entry[1]) < IDLE_MAX:
        entry[1].append(conn)
    else:
        conn.disconnect()


def _describe(client: redis.Redis | RedisCluster | _Cluster) -> str:
    """A node's name in errors and listings: its address, never a password."""
    if isinstance(client, _Cluster):
        return client.name
    if isinstance(client, RedisCluster):
        nodes = cast(Any, client).get_primaries() or list(client.nodes_manager.startup_nodes.values())
        tls = client.nodes_manager.connection_kwargs.get("ssl") or any(
            n.redis_connection is not None and _tls(n.redis_connection.connection_pool) for n in nodes
        )
        return f"{'rediss' if tls else 'redis'}+cluster://{','.join(sorted(n.name for n in nodes))}"
    pool = client.connection_pool
    kwargs = pool.connection_kwargs
    if isinstance(pool, SentinelConnectionPool):
        hosts = ",".join(
            _address(s.connection_pool.connection_kwargs["host"], s.connection_pool.connection_kwargs["port"])
            for s in pool.sentinel_manager.sentinels
        )
        return f"{'rediss' if _tls(pool) else 'redis'}+sentinel://{hosts}/{pool.service_name}/{kwargs.get('db', 0)}"
    if "path" in kwargs:
        return f"unix://{kwargs['path']}"
    scheme = "rediss" if _tls(pool) else "redis"
    return f"{scheme}://{kwargs.get('host', '?')}:{kwargs.get('port', '?')}/{kwargs.get('db', 0)}"


def _address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _tls(pool: ConnectionPool) -> bool:
    return "SSL" in pool.connection_class.__name__


@dataclass(frozen=True)
class NodeError:
    """A node that did not answer: its redacted address and what went wrong."""

    node: str
    error: str

    def __str__(self) -> str:
        return f"{self.node}: {self.error}"


class NodeSet:
    """The Redis masters of a lock, and the one fan-out helper every operation goes through.

    ``urls`` is a URL, a sequence of URLs, or a sequence of clients: ``redis.Redis`` (a master, or a
    ``redis.sentinel`` master client) and ``redis.cluster.RedisCluster`` (a whole cluster is ONE node of the
    Redlock). They must be independent of each other, not replicas of one another. Clients built from URLs are
    shared per process. See docs/nodes.md for the URL forms.
    """

    def __init__(
        self,
        urls: str | redis.Redis | RedisCluster | Sequence[str | redis.Redis | RedisCluster],
        *,
        socket_timeout: float = 0.5,
        connect_timeout: float | None = None,
    ) -> None:
        if socket_timeout <= 0:
            raise ConfigurationError(f"socket_timeout must be > 0 seconds, got {socket_timeout!r}")
        key: _Key | None = None
        if type(urls) is str:
            key = _Key(((urls,), socket_timeout, connect_timeout, credentials_version()))
        elif isinstance(urls, list | tuple) and all(type(u) is str for u in urls):
            key = _Key((tuple(urls), socket_timeout, connect_timeout, credentials_version()))
        if key is not None:
            state = _built.get(key)
            if state is not None:  # this URL list was parsed and validated before, in this process
                self.__dict__.update(state)
                return
        self._build(urls, socket_timeout, connect_timeout)
        if key is not None:
            if len(_built) >= _BUILT_MAX:
                with contextlib.suppress(KeyError, StopIteration, RuntimeError):  # another thread dropped it first
                    del _built[next(iter(_built))]
            _built[key] = dict(self.__dict__)

    def _build(
        self,
        urls: str | redis.Redis | RedisCluster | Sequence[str | redis.Redis | RedisCluster],
        socket_timeout: float,
        connect_timeout: float | None,
    ) -> None:
        items: list[str | redis.Redis | RedisCluster]
        items = [urls] if isinstance(urls, str | redis.Redis | RedisCluster) else list(urls)
        if not items:
            raise ConfigurationError("at least one Redis node is needed, e.g. 'redis://127.0.0.1:6379/0'")
        clients: list[redis.Redis | _Cluster] = []
        names: list[str] = []
        for item in items:
            client: redis.Redis | _Cluster
            if isinstance(item, redis.Redis):
                client = item
            elif isinstance(item, RedisCluster):
                client = _Cluster(_describe(item), client=item)
            else:
                url = validate_url(item)
                try:
                    client = _client_for(url, socket_timeout, connect_timeout or socket_timeout)
                except ValueError:  # validate_url names every problem it knows; redis-py's message may quote a password
                    raise ConfigurationError(
                        f"invalid Redis URL {redact_url(url)!r}: redis-py refused it (its message is not shown, as it "
                        "may quote the password): check the port, the db and the query options against "
                        "'redis://127.0.0.1:6379/0?socket_timeout=0.5'"
                    ) from None
            name = _describe(client)
            if name in names:
                raise ConfigurationError(f"Redis node {name} is listed twice: Redlock needs independent nodes")
            names.append(name)
            clients.append(client)
        self._clusters: tuple[_Cluster | None, ...] = tuple(c if isinstance(c, _Cluster) else None for c in clients)
        #: One client per node: a ``redis.Redis``, or for a Cluster node a stand-in for its ``RedisCluster``
        #: (made on first use) that passes every attribute on to it.
        self.clients: tuple[redis.Redis | RedisCluster, ...] = tuple(
            cast("redis.Redis | RedisCluster", c) for c in clients
        )
        # Pools we built ourselves take the lean checkout (_take/_give); a client you pass keeps redis-py's pool,
        # with its max_connections, client-side cache and maintenance handling, and so do a Sentinel master's (its
        # pool asks the Sentinels where the master is) and a Cluster's masters'.
        self._own = tuple(
            isinstance(item, str)
            and isinstance(c, redis.Redis)
            and not isinstance(c.connection_pool, SentinelConnectionPool)
            for item, c in zip(items, clients, strict=True)
        )
        # Each plain node's pool (a Cluster node's is None): the fan-out reads it per call.
        self._pools: tuple[Any, ...] = tuple(None if isinstance(c, _Cluster) else c.connection_pool for c in clients)
        self.names: tuple[str, ...] = tuple(names)
        #: NodeSets with equal ``peers`` talk to the same nodes through the same clients (clients built from URLs are
        #: shared per process): the watchdog renews their leases together, one round trip per node.
        self.peers: tuple[tuple[int, ...], float] = (tuple(id(c) for c in clients), socket_timeout)
        self.quorum = len(clients) // 2 + 1
        self.socket_timeout = socket_timeout
        self.cluster = any(c is not None for c in self._clusters)

    def same_slot(self, key: str, name: str) -> str:
        """``key`` for a lock named ``name``: itself, or on a NodeSet with a Redis Cluster node and ``key`` in another
        slot, its per-slot stand-in (:func:`fence_key_in_slot`). Without a Cluster node, keys never change."""
        return fence_key_in_slot(key, name) if self.cluster else key

    def __len__(self) -> int:
        return len(self.clients)

    def __repr__(self) -> str:
        return f"NodeSet({list(self.names)!r}, quorum={self.quorum})"

    def drive(self, steps: Steps[_T], sleep: Callable[[float], object] = mod_time.sleep) -> _T:
        """Run the step machine ``steps`` to its end: each :data:`Request` fanned out by :meth:`run` and its answers
        sent back, each pause slept with ``sleep``; returns what the machine returns."""
        answers: Any = None
        try:
            while True:
                step = steps.send(answers)
                answers = sleep(step) if isinstance(step, float) else self.run(*step[:5])
        except StopIteration as stop:
            return stop.value  # type: ignore[no-any-return]

    def run(
        self,
        script: Script,
        keys: Sequence[str],
        args: Sequence[str | int],
        nodes: Iterable[int] | None = None,
        undo_on_timeout: Undo | None = None,
    ) -> list[Any]:
        """Run ``script`` on the given nodes (default: all) at once; one answer or exception per node.

        Every command is written before any reply is read, so the cost is the slowest node's round trip, not the
        sum. A node that is down fails at connect; one that is paused or slow costs at most ``socket_timeout``
        in total, however many such nodes there are (a shared deadline bounds the reads; on a client passed in,
        redis-py's reader applies it per read, so a node trickling a reply byte by byte can take longer there).

        A node that timed out may still run the command later (a paused server reads its socket when it resumes).
        ``undo_on_timeout`` is then written on the *same* connection before it is closed, so the node runs it
        right after the command, in order, whenever it wakes up; nobody waits for it.
        """
        indices = range(len(self.clients)) if nodes is None else list(nodes)
        packed = [_pack_call(script, keys, args)]
        results: list[Any] = [None] * len(self.clients)
        pending: list[tuple[int, ConnectionPool, Any, bool]] = []
        spread: list[tuple[int, _Spread]] = []
        for i in indices:
            cluster = self._clusters[i]
            if cluster is not None:
                spread.append((i, _Spread(cluster, script, keys, args)))
                continue
            pool = self._pools[i]
            conn: Any = None
            own = self._own[i]
            try:
                conn, reused = self._send(pool, own, packed)
            except (RedisError, OSError) as exc:
                results[i] = self._failed(pool, conn, exc, own=own)
                continue
            pending.append((i, pool, conn, reused))
        deadline = mod_time.monotonic() + self.socket_timeout
        for i, pool, sent, reused in pending:
            conn = sent
            try:
                try:
                    try:
                        results[i] = self._read(conn, deadline, own=self._own[i])
                    except RedisConnectionError:
                        if not reused:
                            raise
                        # An idle connection the server closed meanwhile (an idle timeout, a restart): the server
                        # closed it before our command arrived, or lost its data with it, so the command did not
                        # take effect: send it once more on a new connection.
                        conn.disconnect()
                        conn = pool.connection_class(**pool.connection_kwargs)
                        conn.send_packed_command(packed, check_health=False)
                        results[i] = self._read(conn, mod_time.monotonic() + self.socket_timeout, own=self._own[i])
                except NoScriptError:
                    # Packed as the EVALSHA was (surrogatepass: a task id may hold a lone surrogate, which redis-py's
                    # own encoder refuses).
                    conn.send_packed_command(
                        [_pack(("EVAL", script.body, len(keys), *keys, *args))], check_health=False
                    )
                    results[i] = self._read(conn, mod_time.monotonic() + self.socket_timeout, own=self._own[i])
            except RedisTimeoutError as exc:
                if undo_on_timeout is not None:
                    undo, undo_keys, undo_args = undo_on_timeout
                    with contextlib.suppress(RedisError, OSError):
                        conn.send_packed_command(
                            [_pack(("EVAL", undo.body, len(undo_keys), *undo_keys, *undo_args))], check_health=False
                        )
                results[i] = self._failed(pool, conn, exc, own=self._own[i])
                continue
            except (RedisError, OSError) as exc:
                results[i] = self._failed(pool, conn, exc, own=self._own[i])
                continue
            if self._own[i]:
                _give(pool, conn)
            else:
                pool.release(conn)
        for i, sent in spread:
            results[i] = sent.collect(self, deadline, undo_on_timeout)
        return results

    @staticmethod
    def _send(pool: ConnectionPool, own: bool, packed: list[bytes]) -> tuple[Any, bool]:  # noqa: FBT001
        conn: Any
        if not own:
            conn = pool.get_connection()
            try:
                conn.send_packed_command(packed, check_health=False)
            except BaseException:
                # The caller's pool lends connections by count (max_connections): one not given back is lost.
                conn.disconnect()
                pool.release(conn)
                raise
            return conn, False
        conn, reused = _take(pool)
        try:
            if reused and _fast(conn):
                _resp.send(conn, packed[0])
            else:
                conn.send_packed_command(packed, check_health=False)
        except (RedisError, OSError):
            if not reused:
                raise
            conn.disconnect()  # stale idle connection: one more try on a new one
            conn, reused = pool.connection_class(**pool.connection_kwargs), False
            conn.send_packed_command(packed, check_health=False)
        return conn, reused

    def _read(self, conn: Any, deadline: float, *, own: bool = False) -> Any:
        remaining = deadline - mod_time.monotonic()
        # The common case: keep the socket's own timeout. Only when it is no longer than ours: a redis.Redis client
        # passed in may have none (or redis-py's 5 s default), and a frozen node would then hold the fan-out.
        timeout = conn.socket_timeout
        keep = timeout is not None and timeout <= self.socket_timeout and remaining >= 0.9 * self.socket_timeout
        if own and _fast(conn):
            return _resp.read_reply(conn, deadline, None if keep else max(remaining, 0.001))
        if keep:
            return conn.read_response(disconnect_on_error=False)
        return conn.read_response(timeout=max(remaining, 0.001), disconnect_on_error=False)

    @staticmethod
    def _failed(pool: ConnectionPool, conn: Any, exc: BaseException, *, own: bool) -> BaseException:
        """Drop a connection whose state is unknown (never reused); returns ``exc`` as the node's answer."""
        if conn is not None:
            conn.disconnect()
            if not own:
                pool.release(conn)
        return exc

    def error(self, index: int, exc: BaseException) -> NodeError:
        """A redacted description of node ``index``'s failure (redis-py's messages carry no password)."""
        text = str(exc)
        if type(exc).__name__ == "MasterNotFoundError":
            # redis-py puts its whole Sentinel client's repr in this message (redacted, but ~600 characters that
            # bury the reason): keep the service and the reason.
            text = _CLIENT_REPR.sub("<sentinel>", text)
            if "AuthenticationError" in text:
                text += " (check sentinel_username/sentinel_password: the Sentinels refused them)"
        return NodeError(self.names[index], f"{type(exc).__name__}: {text}")


_CLIENT_REPR = re.compile(r"<redis\.client\.Redis\(.*\)>", re.DOTALL)


class _Spread:
    """One script call to a Redis Cluster node, in flight: its calls per slot, written per master at once.

    Made in :meth:`NodeSet.run`'s write phase (every call is written before any reply of any node is read), read in
    its read phase under the same deadline. A slot that moved (MOVED: a failover or a resharding) is re-read from
    the cluster and its call sent once more to the new master; an ASK (a slot being migrated) is followed once.
    """

    def __init__(self, cluster: _Cluster, script: Script, keys: Sequence[str], args: Sequence[str | int]) -> None:
        self.cluster = cluster
        self.script = script
        self.calls: list[_Call] = []
        self.replies: list[Any] = []
        self.sent: list[tuple[ConnectionPool, Any, list[int]]] = []  # pool, connection, indices into calls
        self.error: BaseException | None = None
        try:
            self.calls = cluster.calls(script, keys, args)
            self.replies = [None] * len(self.calls)
            by_pool: dict[ConnectionPool, list[int]] = {}
            for n, call in enumerate(self.calls):
                by_pool.setdefault(cluster.pool(call.slot), []).append(n)
        except (RedisError, OSError) as exc:
            self.error = exc
            return
        for pool, members in by_pool.items():
            conn: Any = None
            try:
                conn = pool.get_connection()
                # One write for all of them: one segment on the wire, so the master reads them in one go.
                conn.send_packed_command([b"".join(_pack(self.calls[n].command) for n in members)], check_health=False)
            except (RedisError, OSError) as exc:
                self._drop(pool, conn, members, exc)
                continue
            self.sent.append((pool, conn, members))

    def _drop(self, pool: ConnectionPool, conn: Any, members: Iterable[int], exc: BaseException) -> None:
        if conn is not None:
            conn.disconnect()
            pool.release(conn)
        for n in members:
            self.replies[n] = exc
        if isinstance(exc, (RedisConnectionError, RedisTimeoutError, OSError)):
            self.cluster.stale()

    def collect(
        self,
        nodes: NodeSet,
        deadline: float,
        undo_on_timeout: Undo | None,
    ) -> Any:
        """The node's answer: the reply (a batch: one entry per item, in item order), or an exception."""
        if self.error is not None:
            return self.error
        for pool, conn, members in self.sent:
            self._read(nodes, pool, conn, members, deadline, undo_on_timeout)
        for n, reply in enumerate(self.replies):
            if isinstance(reply, (MovedError, AskError)):
                self.replies[n] = self._redirected(nodes, n, reply)
        if self.script.batch is None:
            return self.replies[0]
        out: list[Any] = [None] * sum(len(c.items or ()) for c in self.calls)
        for call, reply in zip(self.calls, self.replies, strict=True):
            if isinstance(reply, BaseException):
                if not self.script.partial:
                    return reply
                for item in call.items or ():
                    out[item] = reply
                continue
            for item, entry in zip(call.items or (), reply, strict=True):
                out[item] = entry
        return out

    def _read(
        self,
        nodes: NodeSet,
        pool: ConnectionPool,
        conn: Any,
        members: list[int],
        deadline: float,
        undo_on_timeout: Undo | None,
    ) -> None:
        missing: list[int] = []
        for k, n in enumerate(members):
            try:
                self.replies[n] = nodes._read(conn, deadline)
            except NoScriptError:
                missing.append(n)
            except ResponseError as exc:  # one call's error reply; the connection is still in step
                self.replies[n] = exc
            except (RedisError, OSError) as exc:
                if isinstance(exc, RedisTimeoutError) and undo_on_timeout is not None:
                    undo, undo_keys, undo_args = undo_on_timeout
                    with contextlib.suppress(RedisError, OSError):
                        conn.send_packed_command(
                            [_pack(("EVAL", undo.body, len(undo_keys), *undo_keys, *undo_args))], check_health=False
                        )
                self._drop(pool, conn, members[k:], exc)
                return
        if missing:
            # The master lost its scripts (a restart, a failover to a replica that never ran them): EVAL loads them.
            done = 0
            try:
                conn.send_packed_command(
                    [_pack(("EVAL", self.script.body, *self.calls[n].command[2:])) for n in missing], check_health=False
                )
                for n in missing:
                    try:
                        self.replies[n] = nodes._read(conn, mod_time.monotonic() + nodes.socket_timeout)
                    except ResponseError as exc:
                        self.replies[n] = exc
                    done += 1
            except (RedisError, OSError) as exc:
                self._drop(pool, conn, missing[done:], exc)
                return
        pool.release(conn)

    def _redirected(self, nodes: NodeSet, n: int, redirect: AskError) -> Any:
        """Send call ``n`` once more where the cluster said its slot is (MOVED: re-read the slot map first)."""
        call = self.calls[n]
        conn: Any = None
        pool: ConnectionPool | None = None
        try:
            if isinstance(redirect, MovedError):
                self.cluster.stale()
                self.cluster._refreshed = 0.0  # a MOVED is news: re-read the slot map now
                pool = self.cluster.pool(call.slot)
                prefix: tuple[bytes, ...] = ()
            else:
                # ASKING lets the importing node run the next command on the connection, once.
                pool = self.cluster.pool_at(redirect.host, redirect.port)
                prefix = (_pack(("ASKING",)),)
            conn = pool.get_connection()
            reply = self._exchange(nodes, conn, prefix, call.command)
            if isinstance(reply, NoScriptError):
                reply = self._exchange(nodes, conn, prefix, ("EVAL", self.script.body, *call.command[2:]))
        except (RedisError, OSError) as exc:
            if conn is not None and pool is not None:
                conn.disconnect()
                pool.release(conn)
            return exc
        pool.release(conn)
        return reply

    @staticmethod
    def _exchange(nodes: NodeSet, conn: Any, prefix: tuple[bytes, ...], command: tuple[str | int, ...]) -> Any:
        """Write ``prefix`` (ASKING or nothing) and ``command`` in one write; the command's reply or error reply."""
        conn.send_packed_command([b"".join((*prefix, _pack(command)))], check_health=False)
        for _ in prefix:
            nodes._read(conn, mod_time.monotonic() + nodes.socket_timeout)
        try:
            return nodes._read(conn, mod_time.monotonic() + nodes.socket_timeout)
        except ResponseError as exc:  # NOSCRIPT included: the caller sends the body
            return exc
