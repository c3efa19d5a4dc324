"""Our RESP2 reader for the lock's own connections (``_resp``): the parser against redis-py's, and real servers.

The parser is checked on every prefix of random nested replies (a reply cut anywhere asks for more, never returns a
wrong value) and against redis-py's own parser on the same bytes. On real redis-server processes: replies larger
than one read, error replies keeping redis-py's exception types (NOSCRIPT, NOPERM, WRONGTYPE), a paused node timing
out, a node that closes the connection, and that the lock path really takes the fast reader.
"""

from __future__ import annotations

import socket
import threading
import time
import uuid
from typing import Any

import pytest
import redis
from hypothesis import given, settings
from hypothesis import strategies as st
from redis._parsers import _RESP2Parser
from redis._parsers.socket import SocketBuffer
from redis.connection import Encoder
from redis.exceptions import (
    ConnectionError as RedisConnectionError,
)
from redis.exceptions import (
    NoPermissionError,
    NoScriptError,
    ResponseError,
)
from redis.exceptions import (
    TimeoutError as RedisTimeoutError,
)

from celery_singleton_lock.lock import _resp
from celery_singleton_lock.lock.nodes import NodeSet
from celery_singleton_lock.lock.redlock import Redlock
from celery_singleton_lock.lock.scripts import Script
from celery_singleton_lock.testing import RedisServer, redis_servers
from celery_singleton_lock.testing.faults import FaultProxy

pytestmark = pytest.mark.timeout(60)

replies = st.recursive(
    st.one_of(
        st.none(),
        st.integers(min_value=-(2**63), max_value=2**63 - 1),
        st.binary(max_size=40),
        st.just(b"\r\n"),
        st.builds(ResponseError, st.text(alphabet="ABCxyz :", min_size=1, max_size=12)),
    ),
    lambda inner: st.lists(inner, max_size=5),
    max_leaves=20,
)


def encode(value: Any) -> bytes:
    if value is None:
        return b"$-1\r\n"
    if isinstance(value, int):
        return b":%d\r\n" % value
    if isinstance(value, bytes):
        return b"$%d\r\n%s\r\n" % (len(value), value)
    if isinstance(value, ResponseError):
        return b"-" + str(value).encode() + b"\r\n"
    return b"*%d\r\n" % len(value) + b"".join(encode(v) for v in value)


def same(a: Any, b: Any) -> bool:
    if isinstance(a, ResponseError) or isinstance(b, ResponseError):
        return type(a) is type(b) and str(a) == str(b)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


@settings(max_examples=300, deadline=None)
@given(replies)
def test_the_parser_reads_what_redis_py_reads_and_waits_on_every_cut(value: Any) -> None:
    data = encode(value)
    parsed, end = _resp.parse(data, 0)
    assert end == len(data)
    assert same(parsed, value)
    ours, peer = socket.socketpair()  # redis-py's parser reads the same bytes from a real socket
    try:
        peer.sendall(data)
        theirs = _RESP2Parser(socket_read_size=65536)
        theirs._sock = ours
        theirs._buffer = SocketBuffer(ours, 65536, 1.0)
        theirs.encoder = Encoder("utf-8", "strict", decode_responses=False)
        assert same(theirs.read_response(disable_decoding=True), value)
    finally:
        ours.close()
        peer.close()
    for cut in range(len(data)):
        with pytest.raises(_resp._Incomplete):
            _resp.parse(data[:cut], 0)
    # the incremental reader (replies that take more than one read) agrees, fed in pieces of every size
    for size in {1, 2, 3, 7, max(1, len(data) // 2), len(data)}:
        reader = _resp.Reader()
        pieces = [data[i : i + size] for i in range(0, len(data), size)]
        assert [reader.feed(p) for p in pieces] == [False] * (len(pieces) - 1) + [True]
        assert reader.pos == len(data)
        assert same(reader.value, value)


def test_a_reply_in_many_chunks_is_parsed_once_not_again_per_chunk() -> None:
    """Review finding: every chunk re-parsed the buffer from its first byte, so a large reply in many reads cost
    quadratic time (800,000 elements: 15 s of CPU against 0.3 s). Each value is now parsed exactly once."""
    value = [[i, b"v" * (i % 7), None] for i in range(2_000)]
    data = encode(value)
    reader = _resp.Reader()
    chunks = [data[i : i + 97] for i in range(0, len(data), 97)]
    assert not any(reader.feed(chunk) for chunk in chunks[:-1])
    assert reader.feed(chunks[-1])
    assert same(reader.value, value)
    assert reader.parsed == 2_000 * 3  # every element of the 2,000 inner arrays, each once


def test_a_node_trickling_its_reply_cannot_hold_the_read_past_the_deadline(redis_node: RedisServer) -> None:
    """A reply that would take ~100 s at 50 bytes/s fails by the deadline (0.5 s): each read after the first gets
    only what is left of it (review finding: each read got the whole socket timeout again)."""
    key = f"resp:{uuid.uuid4().hex}"
    redis_node.client().set(key, b"x" * 5_000)
    with FaultProxy(redis_node.port) as proxy:
        proxy.start()
        nodes = NodeSet([proxy.url], socket_timeout=0.5)
        script = Script("return redis.call('GET', KEYS[1])")
        assert nodes.run(script, (key,), ()) == [b"x" * 5_000]  # warm: connected, script loaded
        proxy.bandwidth(50, direction="downstream")
        down = proxy.stats.bytes_down
        outcome: list[tuple[Any, int]] = []
        thread = threading.Thread(
            target=lambda: outcome.append((nodes.run(script, (key,), ())[0], proxy.stats.bytes_down - down)),
            daemon=True,
        )
        thread.start()
        thread.join(30)  # a bound on the wait: the reply would take ~100 s to trickle in
        assert outcome, "the read was still going after 30 s"
    answer, delivered = outcome[0]
    assert isinstance(answer, RedisTimeoutError), answer
    assert delivered < 5_000, delivered  # it gave up with the reply still trickling in


def test_a_redis_py_connection_error_reply_is_raised_not_returned() -> None:
    # redis-py maps some error replies to connection errors ("-LOADING" is BusyLoadingError, a ConnectionError)
    with pytest.raises(RedisConnectionError):
        _resp.parse(b"-LOADING Redis is loading the dataset in memory\r\n", 0, _RESP2Parser(65536).parse_error)


def _fast_connection(server: RedisServer) -> Any:
    conn = redis.Connection(host="127.0.0.1", port=server.port, socket_timeout=2.0, protocol=2)
    conn.connect()
    assert _resp.usable(conn)
    return conn


def _call(conn: Any, *args: str | int) -> Any:
    _resp.send(conn, b"".join(conn.pack_command(*args)))
    return _resp.read_reply(conn, time.monotonic() + 5.0)


def test_real_replies_larger_than_one_read_and_nested_arrays(redis_node: RedisServer) -> None:
    conn = _fast_connection(redis_node)
    try:
        key = f"resp:{uuid.uuid4().hex}"
        big = b"x" * 300_000  # several recv() calls
        assert _call(conn, "SET", key, big) == b"OK"
        assert _call(conn, "GET", key) == big
        assert _call(conn, "EVAL", "return {1, {KEYS[1], false}, 'a\\r\\nb', -7}", 1, key) == [
            1,
            [key.encode(), None],
            b"a\r\nb",
            -7,
        ]
        assert _call(conn, "GET", f"{key}:missing") is None
        assert _call(conn, "DEL", key) == 1
    finally:
        conn.disconnect()


def test_error_replies_keep_redis_py_types(redis_node: RedisServer) -> None:
    conn = _fast_connection(redis_node)
    admin = redis_node.client()
    user = f"u{uuid.uuid4().hex[:8]}"
    try:
        with pytest.raises(NoScriptError):
            _call(conn, "EVALSHA", "0" * 40, 0)
        key = f"resp:{uuid.uuid4().hex}"
        _call(conn, "SET", key, "v")
        with pytest.raises(ResponseError, match="WRONGTYPE"):
            _call(conn, "HGET", key, "f")
        # an error inside a reply is returned in place, as redis-py does
        reply = _call(conn, "EVAL", "return {1, redis.pcall('HGET', KEYS[1], 'f')}", 1, key)
        assert reply[0] == 1 and isinstance(reply[1], ResponseError)
        # still in step after the errors
        assert _call(conn, "PING") == b"PONG"
        admin.acl_setuser(user, enabled=True, passwords=["+pw-for-test"], commands=["+ping", "+auth"], keys=["*"])
        _call(conn, "AUTH", user, "pw-for-test")
        with pytest.raises(NoPermissionError):
            _call(conn, "GET", key)
    finally:
        conn.disconnect()
        admin.acl_deluser(user)
        admin.close()


def test_a_paused_node_times_out_and_a_closed_one_is_a_connection_error() -> None:
    with redis_servers(1) as (server,):
        conn = _fast_connection(server)
        server.pause()
        try:
            _resp.send(conn, b"*1\r\n$4\r\nPING\r\n")
            with pytest.raises(RedisTimeoutError):
                _resp.read_reply(conn, time.monotonic() + 0.2, 0.2)
            assert conn._sock.gettimeout() == 2.0  # the socket's own timeout is put back
        finally:
            server.resume()
            conn.disconnect()
        conn = _fast_connection(server)
        killer = server.client()
        killer.client_kill_filter(_type="normal", skipme=True)
        try:
            _resp.send(conn, b"*1\r\n$4\r\nPING\r\n")
        except RedisConnectionError:
            pass  # the write may fail already (a reset) or only the read
        else:
            with pytest.raises(RedisConnectionError):
                _resp.read_reply(conn, time.monotonic() + 5.0)
        conn.disconnect()
        killer.close()


def test_the_lock_path_takes_the_fast_reader_on_its_own_connections(redis_node: RedisServer, name: str) -> None:
    """Redlock from a URL reads with ``_resp`` (counted), and a client passed in keeps redis-py's reader."""
    calls = []
    real = _resp.read_reply

    def counting(*args: Any) -> Any:
        calls.append(threading.get_ident())
        return real(*args)

    _resp.read_reply = counting  # type: ignore[assignment]
    try:
        lock = Redlock(redis_node.url, name, ttl=5)
        assert lock.acquire(blocking=False)
        assert lock.release()
        assert len(calls) >= 2
        del calls[:]
        client = redis_node.client()
        passed = Redlock([client], f"{name}:passed", ttl=5)
        assert passed.acquire(blocking=False)
        assert passed.release()
        assert calls == []
        client.close()
    finally:
        _resp.read_reply = real  # type: ignore[assignment]


def test_a_decoding_or_resp3_connection_keeps_redis_py_s_reader(redis_node: RedisServer) -> None:
    for kwargs in ({"decode_responses": True}, {"protocol": 3}):
        conn = redis.Connection(host="127.0.0.1", port=redis_node.port, **kwargs)  # type: ignore[arg-type]
        conn.connect()
        try:
            assert not _resp.usable(conn)
        finally:
            conn.disconnect()
    unused = NodeSet([f"redis://127.0.0.1:{redis_node.port}/0?decode_responses=true"])
    script = Script("return 'ok'")
    assert unused.run(script, (), ()) == ["ok"]
