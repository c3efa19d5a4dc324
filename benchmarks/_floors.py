"""Low-level lock floors: what a lock costs written straight on redis-py's ``Connection``, nothing around it.

Each floor uses persistent connections (one per node, connected and with its scripts loaded before it is timed)
and only ``Connection.send_command`` / ``Connection.read_response``: no pool checkout, no retry layer, no
response callbacks. On N nodes every command is written to all connections before any reply is read (the
fan-out), then the same for the next command. Every reply is checked, so each floor is a correct (if bare) lock:

``str``   ``SET key tok NX PX ttl``, then ``EVALSHA`` compare-and-delete (``GET`` == tok -> ``DEL``): 2 round trips.
          The classic floor; its value is a plain string, so it cannot say who holds the lock beyond a token.
``hash``  ``EVALSHA`` acquire (``EXISTS``, else ``HSET owner tok [fields]`` + ``PEXPIRE``; a refusal returns the
          holder record, ``HGETALL``), then ``EVALSHA`` release (``HGET owner`` == tok -> ``DEL``): 2 round trips.
          The least a lock whose value is a *holder record* (a hash, as ours is) has to do.
``task``  ``hash`` with the fields LockedTask writes (job, state, name, worker, at, try) and a release that also
          sets the job's done marker (``SET done 1 PX``), as LockedTask's success path does: the server-side work
          of LockedTask's features, at the least client cost.
``raw``   the ``str`` floor on a bare socket: pre-encoded commands with the token spliced in, replies compared as
          bytes, no redis-py at all: what the 2 round trips cost in system calls, near zero Python.
``delex`` Redis >= 8.4 only: ``SET key tok NX PX ttl``, then ``DELEX key IFEQ tok`` (compare-and-delete without Lua).

Two helpers for the contenders around the floors: ``redis_py_str_cycle`` (the ``str`` floor through redis-py's
high-level client) and ``lock_cycle`` (one ``acquire(blocking=False)`` + ``release()`` of a reused lock object:
ours, redis-py's ``Lock`` and the peers share that API).

Skip floors (the key is held by someone else; one round trip, the holder learned in the same reply):
``SET key tok NX PX ttl GET`` (Redis >= 7.0: returns the holder's value) and the ``hash`` acquire (returns the
holder record).
"""

from __future__ import annotations

import secrets
import socket
from collections.abc import Callable, Sequence
from typing import Any

import redis
from redis.connection import Connection
from redis.exceptions import ResponseError

STR_RELEASE = "if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end return 0"
HASH_ACQUIRE = """
if redis.call('EXISTS', KEYS[1]) == 1 then
  return redis.call('HGETALL', KEYS[1])
end
redis.call('HSET', KEYS[1], 'owner', ARGV[1], unpack(ARGV, 3))
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return 1
"""
HASH_RELEASE = "if redis.call('HGET', KEYS[1], 'owner') == ARGV[1] then return redis.call('DEL', KEYS[1]) end return 0"
TASK_RELEASE = """
redis.call('SET', KEYS[2], '1', 'PX', ARGV[2])
if redis.call('HGET', KEYS[1], 'owner') == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
"""
TASK_FIELDS = ("job", "state", "name", "worker", "at", "try")
DONE_MS = 120_000  # LockedTask's short done window (2 x ttl 60 s)


class FloorFailedError(RuntimeError):
    """A floor's reply was not what an uncontended lock (or a held key) gives: it measures the wrong thing."""


def connect(port: int) -> Connection:
    """One persistent RESP2 connection to 127.0.0.1:``port``, connected now."""
    conn = Connection(host="127.0.0.1", port=port, protocol=2, socket_timeout=5)
    conn.connect()
    return conn


def load(conns: Sequence[Connection], body: str) -> bytes:
    """``SCRIPT LOAD`` ``body`` on every connection; its SHA."""
    sha = b""
    for conn in conns:
        conn.send_command("SCRIPT", "LOAD", body)
        sha = conn.read_response()
    return sha


def supports_set_nx_get(port: int) -> bool:
    """Redis >= 7.0 accepts ``SET ... NX ... GET``."""
    client = redis.Redis(host="127.0.0.1", port=port)
    try:
        client.execute_command("SET", "floor:probe:nxget", "x", "NX", "PX", 1000, "GET")
    except ResponseError:
        return False
    finally:
        client.delete("floor:probe:nxget")
        client.close()
    return True


def supports_delex(port: int) -> bool:
    """Redis >= 8.4 has ``DELEX key IFEQ value`` (``COMMAND INFO`` answers nil for a command it does not know)."""
    conn = connect(port)
    try:
        conn.send_command("COMMAND", "INFO", "DELEX")
        info = conn.read_response()
    except ResponseError:
        return False
    finally:
        conn.disconnect()
    return bool(info and info[0])


# --- acquire + release cycles -------------------------------------------------------------------------------------


def str_cycle(conns: Sequence[Connection], key: str, ttl_ms: int) -> Callable[[], None]:
    """``SET NX PX`` + ``EVALSHA`` compare-and-delete, on one node or fanned out to all of ``conns``."""
    sha = load(conns, STR_RELEASE)
    token_hex = secrets.token_hex
    if len(conns) == 1:
        (conn,) = conns
        send, read = conn.send_command, conn.read_response

        def cycle() -> None:
            token = token_hex(16)
            send("SET", key, token, "NX", "PX", ttl_ms)
            if read() != b"OK":
                raise FloorFailedError(f"SET NX refused on {key}")
            send("EVALSHA", sha, 1, key, token)
            if read() != 1:
                raise FloorFailedError(f"release did not delete {key}")

        return cycle

    def fan_cycle() -> None:
        token = token_hex(16)
        for c in conns:
            c.send_command("SET", key, token, "NX", "PX", ttl_ms)
        for c in conns:
            if c.read_response() != b"OK":
                raise FloorFailedError(f"SET NX refused on {key}")
        for c in conns:
            c.send_command("EVALSHA", sha, 1, key, token)
        for c in conns:
            if c.read_response() != 1:
                raise FloorFailedError(f"release did not delete {key}")

    return fan_cycle


def hash_cycle(
    conns: Sequence[Connection], key: str, ttl_ms: int, fields: Sequence[str] = (), done_key: str | None = None
) -> Callable[[], None]:
    """``EVALSHA`` hash acquire + ``EVALSHA`` owner-checked delete, on one node or fanned out to all of ``conns``.

    ``fields`` (field, value, ...) go into the record besides ``owner``; with ``done_key`` the release also sets
    that done marker (the ``task`` floor).
    """
    acquire = load(conns, HASH_ACQUIRE)
    release = load(conns, TASK_RELEASE if done_key else HASH_RELEASE)
    token_hex = secrets.token_hex
    extra = tuple(fields)
    if done_key is None:
        release_args: tuple[object, ...] = (1, key)
        release_tail: tuple[object, ...] = ()
    else:
        release_args = (2, key, done_key)
        release_tail = (DONE_MS,)
    if len(conns) == 1:
        (conn,) = conns
        send, read = conn.send_command, conn.read_response

        def cycle() -> None:
            token = token_hex(16)
            send("EVALSHA", acquire, 1, key, token, ttl_ms, *extra)
            if read() != 1:
                raise FloorFailedError(f"hash acquire refused on {key}")
            send("EVALSHA", release, *release_args, token, *release_tail)
            if read() != 1:
                raise FloorFailedError(f"hash release did not delete {key}")

        return cycle

    def fan_cycle() -> None:
        token = token_hex(16)
        for c in conns:
            c.send_command("EVALSHA", acquire, 1, key, token, ttl_ms, *extra)
        for c in conns:
            if c.read_response() != 1:
                raise FloorFailedError(f"hash acquire refused on {key}")
        for c in conns:
            c.send_command("EVALSHA", release, *release_args, token, *release_tail)
        for c in conns:
            if c.read_response() != 1:
                raise FloorFailedError(f"hash release did not delete {key}")

    return fan_cycle


def redis_py_str_cycle(client: redis.Redis, key: str, ttl_ms: int) -> Callable[[], None]:
    """The ``str`` floor through redis-py's high-level client (``set`` + ``evalsha``): its pool and callbacks."""
    sha = client.script_load(STR_RELEASE)
    token_hex = secrets.token_hex

    def cycle() -> None:
        token = token_hex(16)
        if not client.set(key, token, nx=True, px=ttl_ms):
            raise FloorFailedError(f"redis-py: SET NX failed on {key}")
        if client.evalsha(sha, 1, key, token) != 1:
            raise FloorFailedError(f"redis-py: release did not delete {key}")

    return cycle


def lock_cycle(lock: Any, who: str) -> Callable[[], None]:
    """``lock.acquire(blocking=False)`` + ``lock.release()`` on one lock object, reused."""

    def cycle() -> None:
        if not lock.acquire(blocking=False):
            raise FloorFailedError(f"{who}: acquire failed: {getattr(lock, 'node_errors', '')}")
        if lock.release() is False:  # ours returns False; the peers raise when the lock was not theirs
            raise FloorFailedError(f"{who}: release failed")

    return cycle


def raw_str_cycle(port: int, key: str, ttl_ms: int) -> Callable[[], None]:
    """The ``str`` floor on a bare TCP socket (one node): 2 ``sendall`` + 2 ``recv``, nothing else."""
    sock = socket.create_connection(("127.0.0.1", port))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def bulk(arg: str | bytes) -> bytes:
        data = arg.encode() if isinstance(arg, str) else arg
        return b"$%d\r\n%s\r\n" % (len(data), data)

    sock.sendall(b"*3\r\n" + bulk("SCRIPT") + bulk("LOAD") + bulk(STR_RELEASE))
    sha = sock.recv(4096).split(b"\r\n")[1]
    token_len = 32
    set_head = b"*6\r\n" + bulk("SET") + bulk(key) + b"$%d\r\n" % token_len
    set_tail = b"\r\n" + bulk("NX") + bulk("PX") + bulk(str(ttl_ms))
    del_head = b"*5\r\n" + bulk("EVALSHA") + bulk(sha) + bulk("1") + bulk(key) + b"$%d\r\n" % token_len
    token_hex, sendall, recv = secrets.token_hex, sock.sendall, sock.recv

    def cycle() -> None:
        token = token_hex(token_len // 2).encode()
        sendall(set_head + token + set_tail)
        if recv(64) != b"+OK\r\n":  # a 5-byte reply on loopback arrives in one piece
            raise FloorFailedError(f"SET NX refused on {key}")
        sendall(del_head + token + b"\r\n")
        if recv(64) != b":1\r\n":
            raise FloorFailedError(f"release did not delete {key}")

    cycle.close = sock.close  # type: ignore[attr-defined]
    return cycle


def delex_cycle(conn: Connection, key: str, ttl_ms: int) -> Callable[[], None]:
    """Redis >= 8.4: ``SET NX PX`` + ``DELEX key IFEQ tok`` (no Lua at all), one node."""
    token_hex = secrets.token_hex
    send, read = conn.send_command, conn.read_response

    def cycle() -> None:
        token = token_hex(16)
        send("SET", key, token, "NX", "PX", ttl_ms)
        if read() != b"OK":
            raise FloorFailedError(f"SET NX refused on {key}")
        send("DELEX", key, "IFEQ", token)
        if read() != 1:
            raise FloorFailedError(f"DELEX did not delete {key}")

    return cycle


# --- refused attempts (the skip path's one round trip) --------------------------------------------------------------


def str_skip(conns: Sequence[Connection], key: str, ttl_ms: int) -> Callable[[], None]:
    """``SET key tok NX PX ttl GET`` on a key someone else holds (a string): refused, the holder's value returned."""
    token_hex = secrets.token_hex

    def attempt() -> None:
        token = token_hex(16)
        for c in conns:
            c.send_command("SET", key, token, "NX", "PX", ttl_ms, "GET")
        for c in conns:
            if c.read_response() is None:
                raise FloorFailedError(f"{key} was not held (SET NX GET returned nil)")

    return attempt


def hash_skip(conns: Sequence[Connection], key: str, ttl_ms: int) -> Callable[[], None]:
    """The ``hash`` acquire on a key someone else holds (a holder record): refused, the record returned."""
    acquire = load(conns, HASH_ACQUIRE)
    token_hex = secrets.token_hex

    def attempt() -> None:
        token = token_hex(16)
        for c in conns:
            c.send_command("EVALSHA", acquire, 1, key, token, ttl_ms)
        for c in conns:
            if not isinstance(c.read_response(), list):
                raise FloorFailedError(f"{key} was not held by a record")

    return attempt


def task_fields(job: str, name: str) -> tuple[str, ...]:
    """The record fields LockedTask writes (values of realistic length), flattened."""
    values = (job, "run", name, "12345@bench-host", "1763800000000", "0")
    return tuple(x for kv in zip(TASK_FIELDS, values, strict=True) for x in kv)
