"""The lock's hot path on the connections we own: write a packed command, read one RESP2 reply, no redis-py layers.

redis-py's connection does the connecting (TLS, AUTH, SELECT, CLIENT SETNAME: everything a URL may ask), and we
keep using its socket afterwards. A lock call is one command and one reply on a connection nobody else uses
(``redlock._take``), so a reply is read whole into one buffer and parsed there: no per-line buffering, no decoding
layer, no health-check bookkeeping. redis-py's own path measured ~15 µs of client CPU per round trip more than this
(``benchmarks/bench_hotpath.py``, "raw socket" floor). Errors keep redis-py's types: ``-NOSCRIPT`` is a
``NoScriptError``, ``-NOPERM`` a ``NoPermissionError`` (its ``parse_error``), a timeout a ``TimeoutError``, a closed
or broken socket a ``ConnectionError``, and the connection is dropped by the caller as before.

Only for RESP2 connections that do not decode replies and hold no unread bytes in redis-py's buffer
(:func:`usable`); anything else goes through redis-py's ``read_response``.
"""

from __future__ import annotations

import socket
from typing import Any

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import InvalidResponse, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

__all__ = ["parse", "read_reply", "send", "usable"]

_READ_SIZE = 65536


class _Incomplete(Exception):
    """The buffer ends inside the reply: read more."""


def usable(conn: Any) -> bool:
    """Whether ``conn`` (connected) can be read by :func:`read_reply`: RESP2, raw bytes, nothing buffered."""
    if getattr(conn, "_sock", None) is None or str(getattr(conn, "protocol", 2) or 2) != "2":
        return False
    encoder = getattr(conn, "encoder", None)
    if encoder is None or encoder.decode_responses:
        return False
    buffer = getattr(getattr(conn, "_parser", None), "_buffer", None)
    if buffer is None:
        # hiredis, or a parser we do not know: it may hold bytes we cannot see
        return False
    unread = getattr(buffer, "unread_bytes", None)
    return callable(unread) and unread() == 0


def send(conn: Any, data: bytes) -> None:
    """Write ``data`` on ``conn``'s socket (connected): redis-py's errors, and the connection dropped on one."""
    try:
        conn._sock.sendall(data)  # noqa: SLF001 - redis-py keeps its socket there (5.x to 8.x)
    except TimeoutError:
        conn.disconnect()
        raise RedisTimeoutError("Timeout writing to socket") from None
    except OSError as exc:
        conn.disconnect()
        raise RedisConnectionError(f"Error while writing to socket: {exc}") from None


def read_reply(conn: Any, timeout: float | None = None) -> Any:
    """One reply from ``conn``'s socket; ``timeout`` (s) overrides the socket's own for this read.

    A top-level error reply is raised (redis-py's type for it); an error inside an array is returned in its place,
    as redis-py does. The caller drops the connection on any exception (its state is then unknown).
    """
    sock: socket.socket = conn._sock  # noqa: SLF001
    if sock is None:
        raise RedisConnectionError("Connection closed")
    if timeout is not None:
        sock.settimeout(timeout)
    try:
        data = b""
        while True:
            try:
                chunk = sock.recv(_READ_SIZE)
            except TimeoutError:
                raise RedisTimeoutError("Timeout reading from socket") from None
            except OSError as exc:
                raise RedisConnectionError(f"Error while reading from socket: {exc}") from None
            if not chunk:
                raise RedisConnectionError("Connection closed by server.")
            data = data + chunk if data else chunk
            try:
                value, end = parse(data, 0, conn._parser.parse_error)  # noqa: SLF001
            except _Incomplete:
                continue
            if end != len(data):
                # One command is in flight per connection: bytes after its reply mean we lost track of the stream.
                raise RedisConnectionError("Protocol error: unexpected bytes after a reply")
            break
    finally:
        if timeout is not None:
            sock.settimeout(conn.socket_timeout)
    if isinstance(value, ResponseError):
        raise value
    return value


def parse(data: bytes, pos: int, parse_error: Any = ResponseError) -> tuple[Any, int]:
    """The RESP2 value starting at ``data[pos]`` and the index after it; raises ``_Incomplete`` when cut short."""
    eol = data.find(b"\r\n", pos)
    if eol < 0:
        raise _Incomplete
    kind = data[pos]
    if kind == 58:  # ':' integer
        return int(data[pos + 1 : eol]), eol + 2
    if kind == 36:  # '$' bulk string
        size = int(data[pos + 1 : eol])
        if size < 0:
            return None, eol + 2
        end = eol + 2 + size
        if len(data) < end + 2:
            raise _Incomplete
        return data[eol + 2 : end], end + 2
    if kind == 42:  # '*' array
        count = int(data[pos + 1 : eol])
        if count < 0:
            return None, eol + 2
        items = []
        at = eol + 2
        for _ in range(count):
            item, at = parse(data, at, parse_error)
            items.append(item)
        return items, at
    if kind == 43:  # '+' simple string
        return data[pos + 1 : eol], eol + 2
    if kind == 45:  # '-' error
        error = parse_error(data[pos + 1 : eol].decode("utf-8", "replace"))
        if isinstance(error, RedisConnectionError):
            raise error
        return error, eol + 2
    raise InvalidResponse(f"Protocol Error: {data[pos : eol + 2]!r}")
