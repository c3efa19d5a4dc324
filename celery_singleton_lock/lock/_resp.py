"""The lock's hot path on the connections we own: write a packed command, read one RESP2 reply, no redis-py layers.

redis-py's connection does the connecting (TLS, AUTH, SELECT, CLIENT SETNAME: everything a URL may ask), and we
keep using its socket afterwards. A lock call is one command and one reply on a connection nobody else uses
(``nodes._take``), so a reply that comes whole in the first read is parsed in one pass, and a longer one by
:class:`Reader` as its bytes arrive: no per-line buffering, no decoding layer, no health-check bookkeeping. It
saves ~3 µs of client CPU per round trip (``benchmarks/bench_hotpath.py``, docs/benchmarks.md). Errors keep
redis-py's types: ``-NOSCRIPT`` is a
``NoScriptError``, ``-NOPERM`` a ``NoPermissionError`` (its ``parse_error``), a timeout a ``TimeoutError``, a closed
or broken socket a ``ConnectionError``, and the connection is dropped by the caller as before.

Only for RESP2 connections that do not decode replies and hold no unread bytes in redis-py's buffer
(:func:`usable`); anything else (RESP3, ``decode_responses``, hiredis's parser, a client passed in) goes through
redis-py's ``read_response``.
"""

from __future__ import annotations

import socket
import time
from typing import Any

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import InvalidResponse, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

__all__ = ["Reader", "parse", "read_reply", "send", "usable"]

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


def read_reply(conn: Any, deadline: float, timeout: float | None = None) -> Any:
    """One reply from ``conn``'s socket, by ``deadline`` (``time.monotonic()``); ``timeout`` (s) overrides the
    socket's own for the first read.

    The first read keeps the socket's timeout (setting one costs a system call): a lock call's reply nearly always
    comes whole in it. A reply that needs more reads gets what is left until ``deadline`` for each, so a node that
    trickles bytes cannot hold the caller past it. A top-level error reply is raised (redis-py's type for it); an
    error inside an array is returned in its place, as redis-py does. The caller drops the connection on any
    exception (its state is then unknown).
    """
    sock: socket.socket = conn._sock  # noqa: SLF001
    if sock is None:
        raise RedisConnectionError("Connection closed")
    parse_error = conn._parser.parse_error  # noqa: SLF001
    reader: Reader | None = None
    changed = timeout is not None
    if changed:
        sock.settimeout(timeout)
    try:
        while True:
            try:
                chunk = sock.recv(_READ_SIZE)
            except TimeoutError:
                raise RedisTimeoutError("Timeout reading from socket") from None
            except OSError as exc:
                raise RedisConnectionError(f"Error while reading from socket: {exc}") from None
            if not chunk:
                raise RedisConnectionError("Connection closed by server.")
            if reader is None:
                # The common case, a whole reply in the first read: one pass, no parser state.
                try:
                    value, end = parse(chunk, 0, parse_error)
                except _Incomplete:
                    reader = Reader(parse_error)
                    done = reader.feed(chunk)
                else:
                    if end != len(chunk):
                        raise _stream_lost()
                    break
            else:
                done = reader.feed(chunk)
            if done:
                if reader.pos != len(reader.buffer):
                    raise _stream_lost()
                value = reader.value
                break
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise RedisTimeoutError("Timeout reading from socket")
            sock.settimeout(remaining)
            changed = True
    finally:
        if changed:
            sock.settimeout(conn.socket_timeout)
    if isinstance(value, ResponseError):
        raise value
    return value


def _stream_lost() -> RedisConnectionError:
    # One command is in flight per connection: bytes after its reply mean we lost track of the stream.
    return RedisConnectionError("Protocol error: unexpected bytes after a reply")


def parse(data: bytes, pos: int, parse_error: Any = ResponseError) -> tuple[Any, int]:
    """The RESP2 value at ``data[pos]`` and the index after it, in one recursive pass; ``_Incomplete`` when cut."""
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


class Reader:
    """A RESP2 reply parsed as its bytes arrive: each value once, whatever the number of chunks (re-parsing the
    whole buffer per chunk made a large reply cost quadratic time). ``feed`` returns True when the reply is whole;
    it is then in ``value``, and ``pos`` is the index after it in ``buffer``."""

    def __init__(self, parse_error: Any = ResponseError) -> None:
        self.buffer = bytearray()
        self.pos = 0
        self.value: Any = None
        self.parsed = 0  # elements (not arrays) parsed so far, each exactly once
        self._open: list[list[Any]] = []  # the arrays being filled: [items, still expected]
        self._parse_error = parse_error

    def feed(self, chunk: bytes) -> bool:
        self.buffer += chunk
        buf = self.buffer
        while True:
            pos = self.pos
            eol = buf.find(b"\r\n", pos)
            if eol < 0:
                return False
            kind = buf[pos]
            value: Any
            if kind == 36:  # '$' bulk string
                size = int(buf[pos + 1 : eol])
                if size < 0:
                    value, end = None, eol + 2
                else:
                    end = eol + 4 + size
                    if len(buf) < end:
                        return False
                    value = bytes(buf[eol + 2 : end - 2])
            elif kind == 58:  # ':' integer
                value, end = int(buf[pos + 1 : eol]), eol + 2
            elif kind == 42:  # '*' array
                count = int(buf[pos + 1 : eol])
                self.pos = eol + 2
                if count > 0:
                    self._open.append([[], count])
                    continue
                value, end = (None if count < 0 else []), eol + 2
            elif kind == 43:  # '+' simple string
                value, end = bytes(buf[pos + 1 : eol]), eol + 2
            elif kind == 45:  # '-' error
                value = self._parse_error(bytes(buf[pos + 1 : eol]).decode("utf-8", "replace"))
                if isinstance(value, RedisConnectionError):
                    raise value
                end = eol + 2
            else:
                raise InvalidResponse(f"Protocol Error: {bytes(buf[pos : eol + 2])!r}")
            self.pos = end
            self.parsed += 1
            while self._open:  # put the value in its array; a full array is itself a value of the one around it
                top = self._open[-1]
                top[0].append(value)
                top[1] -= 1
                if top[1]:
                    break
                self._open.pop()
                value = top[0]
            else:
                self.value = value
                return True
