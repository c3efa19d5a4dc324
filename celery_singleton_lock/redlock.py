"""Redlock: a lease on one Redis node, or on N independent nodes with a majority quorum.

One node is a plain ``SET NX PX`` lock. N nodes follow antirez's Redlock: the request goes to every node *at
once* (all commands are written before any reply is read, no threads), the lock is ours when a majority
``N // 2 + 1`` said yes, and its validity is ``ttl - elapsed - drift`` measured on a monotonic clock. A failed
attempt is undone on every node that may have said yes.

Only the owner releases or extends: each operation is one Lua script comparing the random owner token, never a
plain ``DEL``. Scripts are sent by SHA (``EVALSHA``) and loaded on a node only when it says ``NOSCRIPT``.

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
import functools
import hashlib
import inspect
import itertools
import os
import random
import re
import secrets
import threading
import time as mod_time
from binascii import crc_hqx
from collections import Counter, deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from types import SimpleNamespace, TracebackType
from typing import Any, ClassVar, Literal, cast

import redis
import redis.connection
from redis.cluster import ClusterNode, RedisCluster
from redis.connection import ConnectionPool
from redis.crc import key_slot
from redis.exceptions import AskError, MovedError, NoScriptError, RedisClusterException, RedisError, ResponseError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.sentinel import Sentinel, SentinelConnectionPool

from . import _resp
from ._urls import NodeURL, parse_node_url, redact_url, validate_url
from .errors import ConfigurationError, LockError, LockNotAcquiredError, LockUnavailableError

__all__ = ["NodeSet", "Redlock", "done_key_for", "fence_key_for", "record_of", "redact_url", "sibling_key", "slot_keys"]

ACQUIRE_SCRIPT = """
-- KEYS[1] - lock key: a hash, the holder record (owner, fence, and the fields of ARGV[7..]); slot 0 of a limit
-- KEYS[2] - fencing counter key (never expires)
-- KEYS[3..n+1] - the other slots of a lock with a limit of n (ARGV[6]): each one holder record, like KEYS[1]
-- KEYS[n+2] - optional: the done marker of this job (present when a run of the job finished, see FINISH_SCRIPT)
-- ARGV[1] - owner token, fresh for every attempt
-- ARGV[2] - lease in milliseconds
-- ARGV[3] - '1' to bump the fencing counter, '0' for a lock without fencing tokens (no counter key is created)
-- ARGV[4] - the owner token of a record we may take over (handed over to us, see TRANSFER_SCRIPT), or ''
-- ARGV[5] - this job's id, or '': a refusal by a holder of the same job marks that record 'waiting' (unless the
--           record is 'open': handed over for this job to take over, so the refused attempt is the job's own)
-- ARGV[6] - n, the number of slots (the limit; 1 for a plain lock)
-- ARGV[7..] - field, value pairs of our holder record
-- A slot is taken in this order: the one holding our token or the token we may take over; else, when a slot is
-- held by this same job, none (refused by that holder: a job never holds two slots); else the first free one.
-- returns {ACQUIRED, fencing token (0 without fencing), slot index (0-based)} when the lease is ours (new, or
--          taken over); with a limit, and a free slot taken, a 4th element: the other slots' owners as below
--          ('0:' for a free slot), which tell a contender that fails its quorum whether the limit is reached;
--         {HELD, the holder's owner, job, state, try and worker fields, each as '<length>:<value>' ('' for a key
--          that is not a record), remaining ms}: one bulk string, not the whole record (a refusal is a duplicate's
--          hot path, and parsing a reply costs per element); with a limit, the holder of this job's slot or else of
--          the lowest busy slot; with a limit and every slot busy, a 4th element: each slot's owner in slot
--          order, as '<length>:<value>' ('#' for a key that is not a record), so the client can tell a limit
--          reached on a quorum of the nodes from contenders that split the free slots;
--         {DONE} when the done marker exists: this job already finished (nothing is changed)
-- A record taken over is kept in our record's '_prev' field (its fields and its expiry, absolute ms), so that
-- UNDO_SCRIPT can put it back if this attempt fails its quorum.
local n = tonumber(ARGV[6])
if #KEYS > n + 1 and redis.call('EXISTS', KEYS[n + 2]) == 1 then
  return {2}
end
-- A refusal's reply: the brief (owner, job, state, try, worker) of the record under k, or '' for a foreign key.
local function refusal(k, brief, owners)
  local text = ''
  if brief then
    local out = {}
    for i = 1, 5 do
      local v = brief[i] or ''
      out[i] = #v .. ':' .. v
    end
    text = table.concat(out)
  end
  if owners then
    return {0, text, redis.call('PTTL', k), table.concat(owners)}
  end
  return {0, text, redis.call('PTTL', k)}
end
local key, slot, owner, busy, busy_brief = nil, 0, nil, nil, nil
local owners = n > 1 and {} or nil
for s = 1, n do
  local k = KEYS[s == 1 and 1 or s + 1]
  if redis.call('EXISTS', k) == 0 then
    if not key then
      key, slot = k, s - 1
    end
    if owners then
      owners[s] = '0:'
    end
  elseif redis.call('TYPE', k).ok ~= 'hash' then
    busy = busy or k
    if owners then
      owners[s] = '1:#'
    end
  else
    local brief = redis.call('HMGET', k, 'owner', 'job', 'state', 'try', 'worker', 'open')
    if owners then
      local o = brief[1] or ''
      owners[s] = #o .. ':' .. o
    end
    if brief[1] == ARGV[1] or (ARGV[4] ~= '' and brief[1] == ARGV[4]) then
      key, slot, owner = k, s - 1, brief[1]
      break
    end
    if ARGV[5] ~= '' and brief[2] == ARGV[5] then
      if brief[6] ~= '1' then
        redis.call('HSET', k, 'waiting', '1')
      end
      return refusal(k, brief)
    end
    if not busy then
      busy, busy_brief = k, brief
    end
  end
end
if not key then
  return refusal(busy, busy_brief, owners)
end
local waiting, prev = false, false
if owner then
  if owner ~= ARGV[1] then
    local now = redis.call('TIME')
    local all, fields = redis.call('HGETALL', key), {}
    for i = 1, #all, 2 do
      if all[i] ~= '_prev' then  -- one level: an undo restores only the record it replaced
        fields[#fields + 1] = all[i]
        fields[#fields + 1] = all[i + 1]
      end
    end
    local expires = now[1] * 1000 + math.floor(now[2] / 1000) + redis.call('PTTL', key)
    prev = cjson.encode({fields, expires})
  end
  -- taken over: a copy of the job known to wait for it still waits for us
  waiting = redis.call('HGET', key, 'waiting')
  redis.call('DEL', key)
end
local fence = 0
if ARGV[3] == '1' then
  fence = redis.call('INCR', KEYS[2])
end
redis.call('HSET', key, 'owner', ARGV[1], 'fence', fence, unpack(ARGV, 7))
if waiting then
  redis.call('HSET', key, 'waiting', waiting)
end
if prev then
  redis.call('HSET', key, '_prev', prev)
end
redis.call('PEXPIRE', key, ARGV[2])
if owners and not owner then
  return {1, fence, slot, table.concat(owners)}
end
return {1, fence, slot}
"""

UNDO_SCRIPT = """
-- KEYS - lock keys (holder records): the slots of the lock (one for a plain lock)
-- ARGV[1] - owner token of a failed attempt
-- returns 1 when a record was that attempt's: it is deleted, and a record the attempt had taken over is put back
--   (with its own expiry, if it has not passed); 0 when none was (all left alone)
local undone = 0
for _, key in ipairs(KEYS) do
  if redis.call('HGET', key, 'owner') == ARGV[1] then
    local prev = redis.call('HGET', key, '_prev')
    redis.call('DEL', key)
    if prev then
      local p = cjson.decode(prev)
      local now = redis.call('TIME')
      local left = p[2] - (now[1] * 1000 + math.floor(now[2] / 1000))
      if left > 0 and #p[1] > 0 then
        redis.call('HSET', key, unpack(p[1]))
        redis.call('PEXPIRE', key, left)
      end
    end
    undone = 1
  end
end
return undone
"""

REFILL_SCRIPT = """
-- KEYS[1] - lock key (holder record)
-- ARGV[1] - owner token
-- ARGV[2..] - field, value pairs of the owner's record
-- returns 1 when the record is ours and now has those fields (a node that lost it and was repaired with owner and
--   fence only), 0 when it is not ours
if redis.call('HGET', KEYS[1], 'owner') ~= ARGV[1] then
  return 0
end
redis.call('HSET', KEYS[1], unpack(ARGV, 2))
return 1
"""

FENCE_SCRIPT = """
-- KEYS[1] - lock key (holder record)
-- KEYS[2] - fencing counter key
-- ARGV[1] - owner token
-- ARGV[2] - fencing token chosen by the quorum
-- returns 1 when the lease is still ours and the counter (and the record's fence) is now >= ARGV[2], 0 when the
--   lease is not ours
if redis.call('HGET', KEYS[1], 'owner') ~= ARGV[1] then
  return 0
end
if tonumber(redis.call('GET', KEYS[2]) or '0') < tonumber(ARGV[2]) then
  redis.call('SET', KEYS[2], ARGV[2])
end
redis.call('HSET', KEYS[1], 'fence', ARGV[2])
return 1
"""

TRANSFER_SCRIPT = """
-- KEYS[1] - lock key (holder record)
-- ARGV[1] - our owner token
-- ARGV[2] - the new owner token
-- ARGV[3] - lease of the handed-over lock in milliseconds
-- ARGV[4..] - field, value pairs to change in the record (e.g. state)
-- returns 1 when the record was ours and now names the new owner, 0 when it was not ours (left alone)
if redis.call('HGET', KEYS[1], 'owner') == ARGV[1] then
  redis.call('HSET', KEYS[1], 'owner', ARGV[2], unpack(ARGV, 4))
  redis.call('HDEL', KEYS[1], '_prev')  -- the take-over that wrote it succeeded long ago: nothing to undo
  redis.call('PEXPIRE', KEYS[1], ARGV[3])
  return 1
end
return 0
"""

RELEASE_SCRIPT = """
-- KEYS[1] - lock key (holder record)
-- ARGV[1] - owner token
-- returns 1 when the record was ours and is now deleted, 0 when it was not ours (left alone)
if redis.call('HGET', KEYS[1], 'owner') == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
"""

FINISH_SCRIPT = """
-- KEYS[1] - lock key (holder record)
-- KEYS[2] - the job's done marker
-- ARGV[1] - owner token
-- ARGV[2] - done marker lifetime (ms) when no copy of the job is known to wait
-- ARGV[3] - done marker lifetime (ms) when one waits (the record says 'waiting'), or the record is not ours
-- ARGV[4] - cooldown in ms: '0' deletes the record; more keeps it that long under ARGV[5], state 'cooldown'
-- ARGV[5] - owner token of the cooldown record
-- returns 1 when the record was ours (now deleted or cooling down), 0 when it was not (left alone); the done
--   marker is set either way: the job did finish
local mine = redis.call('HGET', KEYS[1], 'owner') == ARGV[1]
local ms = ARGV[3]
if mine and not redis.call('HGET', KEYS[1], 'waiting') then
  ms = ARGV[2]
end
redis.call('SET', KEYS[2], '1', 'PX', ms)
if not mine then
  return 0
end
if tonumber(ARGV[4]) > 0 then
  redis.call('HSET', KEYS[1], 'owner', ARGV[5], 'state', 'cooldown')
  redis.call('PEXPIRE', KEYS[1], ARGV[4])
else
  redis.call('DEL', KEYS[1])
end
return 1
"""

EXTEND_SCRIPT = """
-- KEYS[2i-1] - lock key of lease i (holder record)
-- KEYS[2i]   - fencing counter key of lease i
-- ARGV[3i-2] - owner token of lease i
-- ARGV[3i-1] - lease in milliseconds
-- ARGV[3i]   - fencing token of lease i
-- returns an array, one code per lease: EXTENDED (1) when the record was ours and its expiry is reset;
--   REPAIRED (2) when the key was missing (node restarted or never reached) and is now a record of ours (owner
--   and fence only), with the counter raised to our fencing token; LOST (0) when someone else holds it (or the
--   key is not a record at all: it must not fail the whole batch)
local out = {}
for i = 1, #KEYS / 2 do
  local key, fence = KEYS[2 * i - 1], KEYS[2 * i]
  local token, ms, fencing = ARGV[3 * i - 2], ARGV[3 * i - 1], ARGV[3 * i]
  local kind = redis.call('TYPE', key).ok
  if kind == 'none' then
    redis.call('HSET', key, 'owner', token, 'fence', fencing)
    redis.call('PEXPIRE', key, ms)
    if tonumber(redis.call('GET', fence) or '0') < tonumber(fencing) then
      redis.call('SET', fence, fencing)
    end
    out[i] = 2
  elseif kind == 'hash' and redis.call('HGET', key, 'owner') == token then
    redis.call('PEXPIRE', key, ms)
    out[i] = 1
  else
    out[i] = 0
  end
end
return out
"""

STATUS_SCRIPT = """
-- KEYS[1] - lock key (holder record)
-- KEYS[2] - fencing counter key
-- returns {holder record as a flat field/value array ({} when free or not a record), remaining ms, counter}
local record = {}
if redis.call('TYPE', KEYS[1]).ok == 'hash' then
  record = redis.call('HGETALL', KEYS[1])
end
return {record, redis.call('PTTL', KEYS[1]), tonumber(redis.call('GET', KEYS[2]) or '0')}
"""

EXTENDED, REPAIRED, LOST = 1, 2, 0
ACQUIRED, HELD, DONE = 1, 0, 2


def slot_keys(name: str, limit: int) -> tuple[str, ...]:
    """The keys of a lock with ``limit`` slots: ``name`` itself, then ``name:slot:<i>`` in ``name``'s Cluster slot.

    The slot keys start with ``name`` (so a SCAN of the prefix finds them). A name with a hash tag keeps it; one
    without gets a tag of the same Cluster slot at the end (``name:slot:1{<n>}``, see :func:`fence_key_in_slot`).
    """
    if limit <= 1:
        return (name,)
    start = name.find("{")
    end = name.find("}", start + 1) if start != -1 else -1
    if end > start + 1:
        return (name, *(f"{name}:slot:{i}" for i in range(1, limit)))
    if "{" in name:  # a brace that is no tag: the sibling form, tag in front
        return (name, *(sibling_key(name, f":slot:{i}") for i in range(1, limit)))
    tag = f"{{{_slot_twin(_key_slot(name))}}}"
    return (name, *(f"{name}:slot:{i}{tag}" for i in range(1, limit)))


def fence_key_for(key: str) -> str:
    """The fencing counter's key: in the same Redis Cluster slot as ``key``."""
    return sibling_key(key, ":fence")


def done_key_for(key: str, job: str) -> str:
    """The key that marks ``job`` finished under lock ``key`` (see ``Redlock.finish``): in the same slot as ``key``."""
    return sibling_key(key, f":done:{job}")


def sibling_key(key: str, suffix: str) -> str:
    """``key`` + ``suffix``, hashed to the same Redis Cluster slot as ``key`` whatever ``suffix`` holds.

    A key carrying a hash tag (``{...}`` with a non-empty body) keeps it; a key without one becomes the tag, so
    both keys hash to the same slot either way. Cluster reads only the *first* ``{`` and the first ``}`` after it
    (an empty ``{}`` there means no tag at all), so a tagless key that contains ``}`` cannot be a tag: its sibling
    is tagged with a short string of the same slot instead.
    """
    start = key.find("{")
    end = key.find("}", start + 1) if start != -1 else -1
    if end > start + 1:
        return f"{key}{suffix}"
    # No tag (an empty "{}" first counts as none: Cluster then hashes the whole key, it looks for no later tag).
    if "}" not in key:
        return f"{{{key}}}{suffix}"
    return f"{{{_slot_twin(key_slot(key.encode()))}}}{key}{suffix}"


@functools.lru_cache(maxsize=1024)
def _slot_twin(slot: int) -> str:
    """The smallest decimal number whose text hashes to ``slot`` (every slot has one below 110,000)."""
    for n in range(1 << 17):
        if crc_hqx(str(n).encode(), 0) % 16384 == slot:  # Cluster's slot of a key without braces
            return str(n)
    raise AssertionError(f"no decimal hash tag for Cluster slot {slot}")  # pragma: no cover - checked exhaustively


def _key_slot(key: str) -> int:
    """The Redis Cluster slot of ``key`` (its hash tag's, if it has one)."""
    return key_slot(key.encode("utf-8", "surrogatepass"))


def fence_key_in_slot(key: str, name: str) -> str:
    """``key``, or when it hashes to another Redis Cluster slot than ``name``, a key of its own in ``name``'s slot.

    The fencing counter a prefix shares (``<prefix>fence``) is one key: on a Cluster, a lock name without a hash
    tag lives in another slot, and a script may only touch keys of one slot. There the counter becomes one per
    slot, ``fence_key_for(key + "{<n>}")`` (``n`` the smallest number hashing to ``name``'s slot): at most 16,384
    counters, each shared by the names of its slot, so tokens still grow strictly per name. A key with a ``{``
    gets the tag in front instead (``{<n>}<key>:fence``), as a tag must be the key's first ``{...}``.
    """
    slot = _key_slot(name)
    if _key_slot(key) == slot:
        return key
    tag = f"{{{_slot_twin(slot)}}}"
    return fence_key_for(f"{tag}{key}" if "{" in key else f"{key}{tag}")


class _Script:
    """A Lua script sent by SHA; its body is sent only to a node that answers NOSCRIPT.

    ``batch=(k, a)`` marks a script that handles many items in one call (``k`` KEYS and ``a`` ARGV per item, any
    further ARGV shared by all; ``a == 0``: every ARGV is shared) and answers an array, one entry per item. On a
    Redis Cluster node such a call is split by slot, one call per slot (Cluster refuses a script whose keys span
    slots), and the calls for one master are written together: one round trip per master. With ``partial``, an
    item whose slot's master did not answer gets that error as its entry; without, the whole node's answer is it.
    """

    def __init__(self, body: str, *, batch: tuple[int, int] | None = None, partial: bool = False) -> None:
        self.body = body
        self.sha = hashlib.sha1(body.encode()).hexdigest()  # noqa: S324 - Redis names scripts by SHA1
        self.batch = batch
        self.partial = partial


_ACQUIRE = _Script(ACQUIRE_SCRIPT)
_FENCE = _Script(FENCE_SCRIPT)
_RELEASE = _Script(RELEASE_SCRIPT)
_TRANSFER = _Script(TRANSFER_SCRIPT)
_EXTEND = _Script(EXTEND_SCRIPT, batch=(2, 3), partial=True)
_STATUS = _Script(STATUS_SCRIPT)
_FINISH = _Script(FINISH_SCRIPT)
_UNDO = _Script(UNDO_SCRIPT)
_REFILL = _Script(REFILL_SCRIPT)


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def record_of(flat: Sequence[Any]) -> dict[str, str]:
    """A holder record from a script's flat field/value array (``HGETALL``'s reply in RESP2)."""
    return {_text(flat[i]): _text(flat[i + 1]) for i in range(0, len(flat) - 1, 2)}


_BRIEF_FIELDS = ("owner", "job", "state", "try", "worker")


def _prefixed(blob: bytes | str) -> list[str]:
    """The values of ``<length>:<value>...`` (lengths in bytes, so values may hold any character)."""
    data = blob.encode("utf-8", "surrogatepass") if isinstance(blob, str) else blob
    out: list[str] = []
    i = 0
    while i < len(data):
        colon = data.index(b":", i)
        end = colon + 1 + int(data[i:colon])
        out.append(data[colon + 1 : end].decode("utf-8", "surrogatepass"))
        i = end
    return out


def _brief(blob: bytes | str) -> dict[str, str]:
    """The fields of a refused acquire's answer: ``<length>:<value>`` each, in ``_BRIEF_FIELDS`` order (empty
    values, i.e. missing fields, are left out). Lengths are in bytes, so values may hold any character."""
    return {name: value for name, value in zip(_BRIEF_FIELDS, _prefixed(blob), strict=False) if value}


def _merged(records: Iterable[dict[str, str]]) -> dict[str, str]:
    """One owner's record as several nodes hold it: a node that lost the key and was repaired by a renewal holds
    only ``owner`` and ``fence`` until it is refilled, so the fuller records' fields win, never the stripped one's."""
    out: dict[str, str] = {}
    for record in sorted(records, key=len):
        out.update(record)
    out.pop("_prev", None)
    return out


# redis-py >= 7 takes driver_info (None disables CLIENT SETINFO); older ones take lib_name/lib_version.
_NO_SETINFO: dict[str, Any] = (
    {"driver_info": None}
    if "driver_info" in inspect.signature(redis.Redis.__init__).parameters
    else {"lib_name": None, "lib_version": None}
)

# redis-py functions without type annotations, called through Any (mypy --strict refuses untyped calls).
_untyped: Any = SimpleNamespace(parse_url=redis.connection.parse_url, Sentinel=Sentinel, ClusterNode=ClusterNode)

_clients: dict[tuple[str, float, float], redis.Redis | _Cluster] = {}
_clients_lock = threading.Lock()


def _client_for(url: str, socket_timeout: float, connect_timeout: float) -> redis.Redis | _Cluster:
    """One client (and so one connection pool) per URL and timeouts, shared by every lock in the process.

    redis-py's pool notices a fork (it compares the pid) and starts afresh in the child, so sharing is safe across
    ``fork()``, and the pool itself is thread-safe. Nothing here connects: a node that is down when the worker
    starts is a node that does not answer yet, not an error.
    """
    cache_key = (url, socket_timeout, connect_timeout)
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
    sentinel_kwargs = {**options, "retry": None}
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
    def calls(script: _Script, keys: Sequence[str], args: Sequence[str | int]) -> list[_Call]:
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
IDLE_MAX = 64  # idle connections kept per node and process; more (a burst of threads) are closed when returned


def _take(pool: ConnectionPool) -> tuple[Any, bool]:
    """An idle connection of ours to the pool's node (reused: True), or a new one (not yet connected)."""
    entry = _idle.get(pool)
    pid = os.getpid()
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
    if entry is not None and entry[0] == os.getpid() and len(entry[1]) < IDLE_MAX:
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
        self.names: tuple[str, ...] = tuple(names)
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

    def run(
        self,
        script: _Script,
        keys: Sequence[str],
        args: Sequence[str | int],
        nodes: Iterable[int] | None = None,
        *,
        undo_on_timeout: tuple[_Script, Sequence[str], Sequence[str | int]] | None = None,
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
        command = ("EVALSHA", script.sha, len(keys), *keys, *args)
        packed = [_pack(command)]
        results: list[Any] = [None] * len(self.clients)
        pending: list[tuple[int, ConnectionPool, Any, bool]] = []
        spread: list[tuple[int, _Spread]] = []
        for i in indices:
            cluster = self._clusters[i]
            if cluster is not None:
                spread.append((i, _Spread(cluster, script, keys, args)))
                continue
            pool = cast(redis.Redis, self.clients[i]).connection_pool
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
                    conn.send_command("EVAL", script.body, *command[2:])
                    results[i] = self._read(conn, mod_time.monotonic() + self.socket_timeout, own=self._own[i])
            except RedisTimeoutError as exc:
                if undo_on_timeout is not None:
                    undo, undo_keys, undo_args = undo_on_timeout
                    with contextlib.suppress(RedisError, OSError):
                        conn.send_command("EVAL", undo.body, len(undo_keys), *undo_keys, *undo_args)
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

    def __init__(self, cluster: _Cluster, script: _Script, keys: Sequence[str], args: Sequence[str | int]) -> None:
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
        undo_on_timeout: tuple[_Script, Sequence[str], Sequence[str | int]] | None,
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
        undo_on_timeout: tuple[_Script, Sequence[str], Sequence[str | int]] | None,
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
                        conn.send_command("EVAL", undo.body, len(undo_keys), *undo_keys, *undo_args)
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


@dataclass
class _Lease:
    token: str
    ttl_ms: int
    fence: int
    deadline: float  # monotonic; the lock is ours until then under Redlock's assumptions
    renewable: bool = True  # False once handed over (transfer): the marker is never extended
    fields: tuple[str, ...] = ()  # the record's fields (field, value, ...) besides owner and fence, for a refill
    key: str = ""  # the key the record lives under: the name, or with a limit the slot taken


class Redlock:
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

    DRIFT_FACTOR: ClassVar[float] = 0.01
    DRIFT_FLOOR: ClassVar[float] = 0.002
    RETRY_BASE: ClassVar[float] = 0.005
    RETRY_CAP: ClassVar[float] = 0.2

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
        socket_timeout: float = 0.5,
        clock: Callable[[], float] = mod_time.monotonic,
        sleep: Callable[[float], None] = mod_time.sleep,
    ) -> None:
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
        self.nodes = urls if isinstance(urls, NodeSet) else NodeSet(urls, socket_timeout=socket_timeout)
        self.name = name
        # On a Redis Cluster, a shared counter in another slot than the name is kept per slot (see same_slot).
        self.fence_key = self.nodes.same_slot(fence_key, name) if fence_key else fence_key_for(name)
        self.ttl = float(ttl)
        self.timeout = timeout
        self.job = job
        self._label = f"{token}:" if token else ""
        fields = dict(record) if record else {}
        if job is not None:
            fields["job"] = job
        self._fields: tuple[str, ...] = tuple(itertools.chain.from_iterable(fields.items()))
        self.limit = limit
        self._slots = slot_keys(name, limit)
        self._keys: tuple[str, ...] = (
            (name, self.fence_key, *self._slots[1:])
            if job is None
            else (name, self.fence_key, *self._slots[1:], done_key_for(name, job))
        )
        self._limit_arg = str(limit)
        self._fencing = "1" if fencing else "0"
        self._clock = clock
        self._sleep = sleep
        self._lease: _Lease | None = None
        self._mutex = threading.Lock()  # orders release/transfer against the watchdog's extend
        #: An owner token this lock may take over when it finds it holding the key (see ``transfer``).
        self.replaces: str | None = None
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

    def _reset_failure(self) -> None:
        """Back to the class's defaults (no finding), whatever an earlier attempt found."""
        self.split = self.done = self.contended = False
        self.held_by = self.holder_record = self.held_for = None
        self.node_errors = ()

    def __repr__(self) -> str:
        return f"Redlock({self.name!r}, nodes={len(self.nodes)}, ttl={self.ttl})"

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
        """Greater than every fencing token returned earlier for this name; raises before an acquire."""
        if self._fence is None:
            raise LockError(f"lock {self.name!r} has no fencing token: it was never acquired", key=self.name)
        return self._fence

    @property
    def validity(self) -> float:
        """Seconds the lease is still ours by the local clock (0 when not held)."""
        if self._lease is None:
            return 0.0
        return max(0.0, self._lease.deadline - self._clock())

    def _drift(self) -> float:
        return self.ttl * self.DRIFT_FACTOR + self.DRIFT_FLOOR

    def _new_token(self) -> str:
        return f"{self._label}{secrets.token_hex(16)}"

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
        if self.limit == 1 and all(type(a) is list and a[0] == ACQUIRED for a in answers):
            # The common case, every node granted the one key: the general path below with nothing to undo, fence
            # or settle, when every node gave the same fencing token (always so on one node).
            fence = int(answers[0][1])
            deadline = start + self.ttl - self._drift()
            if all(int(a[1]) == fence for a in answers) and deadline > self._clock():
                return self._won(_Lease(token, ttl_ms, fence, deadline, fields=self._fields, key=self._slots[0]))
        fences: dict[int, int] = {}
        slots: dict[int, int] = {}
        holders: list[tuple[str, int, dict[str, str]]] = []
        slot_owners: list[list[str]] = []  # with a limit: the slots' owners as nodes saw them ('' = free)
        errors: list[NodeError] = []
        done = False
        for i, answer in enumerate(answers):
            if isinstance(answer, BaseException):
                errors.append(nodes.error(i, answer))
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
        key = self._slots[0]
        granted = fences
        if self.limit > 1 and fences:
            # Nodes may grant different slots (one restarted empty): the lease is on the slot most nodes granted.
            best, _ = Counter(slots.values()).most_common(1)[0]
            key = self._slots[best]
            granted = {i: f for i, f in fences.items() if slots[i] == best}
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
        # Held by someone else only when one holder has a quorum of the nodes. Refusals that deny us the quorum
        # without any single holder having one are a split vote (contenders that arrived together): nobody holds
        # the lock, and skipping because of it would skip every contender.
        refused = len(holders) > len(nodes) - nodes.quorum
        count = 0
        if holders:
            holder, count = holders[0][0], len(holders)
            if any(h != holder for h, _, _ in holders):  # not one owner everywhere: the most reported one
                holder, count = Counter(h for h, _, _ in holders).most_common(1)[0]
            self.held_by = holder
            self.held_for = max(ms for h, ms, _ in holders if h == holder) / 1000.0
            self.holder_record = _merged(r for h, _, r in holders if h == holder)
        self.contended = count >= nodes.quorum
        self.split = refused and not self.contended
        if self.limit > 1:
            # The limit is reached when every slot has one owner on a quorum of the nodes, as the nodes that
            # refused (every slot busy) and those that granted us a free slot saw them (each slot is a lock of its
            # own: at most one owner holds it on a quorum); or when this job's own holder has a quorum of refusals
            # (a job never holds two slots). Refusals short of that are contenders that split the free slots, as
            # are grants on some nodes without a quorum for one slot: try again.
            per_slot = [Counter(o[s] for o in slot_owners if s < len(o) and o[s]) for s in range(self.limit)]
            limit_reached = all(c and c.most_common(1)[0][1] >= nodes.quorum for c in per_slot)
            same_job = [h for h, _, r in holders if self.job and r.get("job") == self.job]
            job_held = bool(same_job) and Counter(same_job).most_common(1)[0][1] >= nodes.quorum
            self.contended = limit_reached or (refused and job_held)
            self.split = not self.contended and (refused or (not errors and bool(fences)))
        return False

    def _won(self, lease: _Lease) -> bool:
        """An attempt took ``lease``: it is this lock's now, and nothing of an earlier attempt's findings stays."""
        self._lease = lease
        self._last_key = lease.key
        self._fence = lease.fence
        self._reset_failure()
        return True

    def extend(self) -> bool:
        """Reset the lease to ``ttl`` if we still hold it.

        False when it was not extended: either the lock is no longer ours (``validity`` is then 0), or too few
        nodes answered to tell (``validity`` is then what is left of the current lease: try again before it ends).
        """
        return self.nodes_extend([self])[0] is True

    @staticmethod
    def nodes_extend(locks: Sequence[Redlock]) -> list[bool | None]:
        """Extend many locks sharing one NodeSet in one round trip per node (the renewal watchdog's path).

        A node where a key is missing (restarted, or unreachable at acquire) gets it back, with its fencing
        counter raised to our token, but only a node that still held our token counts towards the quorum: a
        single node that lost the key means someone else may have held the lock in between.

        One answer per lock: True (extended), False (lost: too many nodes hold someone else's token or lost ours,
        or the lease ran out), or None (undecided: too few nodes answered; the lease stands until its deadline).
        A lease that was released or handed over meanwhile is left alone (False).
        """
        if not locks:
            return []
        nodes = locks[0].nodes
        if any(lock.nodes is not nodes for lock in locks):
            raise LockError("nodes_extend: every lock must share one NodeSet")
        # Hold each lock's mutex across the round trip: a release() racing with this extend could otherwise reach
        # a node first, and the extend would then find the key missing and "repair" a lock just given up.
        with contextlib.ExitStack() as stack:
            for lock in locks:
                stack.enter_context(lock._mutex)
            return Redlock._extend_locked(nodes, locks)

    @staticmethod
    def _extend_locked(nodes: NodeSet, locks: Sequence[Redlock]) -> list[bool | None]:
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
        answers = nodes.run(_EXTEND, keys, args)
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
        """Give the lock up on every node; True if we still held it (on a quorum). Idempotent."""
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
        if self.acquire(blocking=True, timeout=self.timeout):
            return self
        errors = [str(e) for e in self.node_errors]
        if self.contended or not errors:
            raise LockNotAcquiredError(self.name, holder=self.held_by, node_errors=errors)
        raise LockUnavailableError(self.name, holder=self.held_by, node_errors=errors)

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> Literal[False]:
        self.release()
        return False
