"""FaultProxy on its own, with a plain redis-py client: each fault observably does what it says.

The server behind the proxy is the shared ``redis_node`` (faults act on the proxy, never on the server); every
test uses its own keys. Clients never retry (redis-py retries three times by default, which would hide a cut).
Latencies are bounded from below only (a delay is at least what it says); that a fault left some bytes alone is
seen in its byte counter, never in a round trip being fast (the machine is small and shared).
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from celery_singleton_lock.testing import RedisServer, free_port, wait_for
from celery_singleton_lock.testing.faults import FaultProxy

pytestmark = pytest.mark.timeout(60)


def client(url: str, timeout: float = 2.0) -> redis.Redis:
    # RESP2 and no retries: one command is one round trip on one connection, and a cut surfaces as an error.
    return redis.Redis.from_url(
        url, socket_timeout=timeout, socket_connect_timeout=timeout, retry=Retry(NoBackoff(), 0), protocol=2
    )


def round_trip(c: redis.Redis, tries: int = 5) -> float:
    """The fastest of a few PINGs, in seconds."""
    best = float("inf")
    for _ in range(tries):
        t = time.monotonic()
        c.ping()
        best = min(best, time.monotonic() - t)
    return best


@pytest.fixture
def proxy(redis_node: RedisServer) -> Iterator[FaultProxy]:
    with FaultProxy(redis_node.port) as p:
        yield p


@pytest.fixture
def key() -> str:
    return f"proxy-test:{uuid.uuid4().hex}"


@pytest.fixture
def direct(redis_node: RedisServer) -> Iterator[redis.Redis]:
    """A client straight to the server, to see what the proxied commands did."""
    c = redis_node.client(socket_timeout=5)
    yield c
    c.close()


def test_forwards_commands_and_counts_bytes(proxy: FaultProxy, direct: redis.Redis, key: str) -> None:
    """Without faults the proxy is transparent, and its counters see the traffic."""
    c = client(proxy.url)
    assert c.set(key, "v") is True
    assert c.get(key) == b"v"
    assert direct.get(key) == b"v"
    stats = proxy.stats
    assert stats.accepted == 1 and stats.open == 1
    assert stats.bytes_up > 0 and stats.bytes_down > 0 and stats.pending == 0
    assert proxy.url == f"redis://127.0.0.1:{proxy.port}/0"
    c.close()


def test_delay_adds_latency_in_each_direction(proxy: FaultProxy) -> None:
    """A delay is paid once per direction: upstream only delays the requests (a round trip pays it once), both
    directions delay the replies too (twice); a stopped delay catches nothing more."""
    c = client(proxy.url)
    c.ping()  # connected (and redis-py's handshake done): the faults below see PINGs and PONGs only

    def traffic() -> tuple[int, int]:
        info = proxy.connections()[0]
        return info.bytes_up, info.bytes_down

    up = proxy.delay(0.1, direction="upstream")
    start = traffic()
    one_way = round_trip(c, 3)
    up.stop()
    end = traffic()
    assert one_way >= 0.1, one_way
    assert up.bytes == end[0] - start[0] > 0, (up.bytes, start, end)  # every request, and no reply
    both = proxy.delay(0.1)
    start = traffic()
    two_ways = round_trip(c, 3)
    both.stop()
    end = traffic()
    assert two_ways >= 0.2, two_ways
    assert both.bytes == (end[0] - start[0]) + (end[1] - start[1]), (both.bytes, start, end)  # requests and replies
    caught = (up.bytes, both.bytes)
    round_trip(c)
    assert (up.bytes, both.bytes) == caught  # stopped: the later PINGs went through untouched
    c.close()


def test_timed_hold_delivers_a_command_late_after_its_client_gave_up(
    proxy: FaultProxy, direct: redis.Redis, key: str
) -> None:
    """A held SET times out at the client, which closes the connection; the server still applies it, late."""
    c = client(proxy.url, timeout=0.2)
    c.ping()  # connect first: the hold then catches the command itself
    proxy.hold(0.8)
    sent = time.monotonic()
    with pytest.raises(redis.TimeoutError):
        c.set(key, "late")
    assert direct.get(key) is None, "applied before the hold ended"
    assert wait_for(lambda: direct.get(key) == b"late", timeout=5.0), "the held command was never applied"
    # Polled every 10 ms: the command landed no earlier than the hold's end.
    assert time.monotonic() - sent >= 0.8 - 0.05
    c.close()


def test_manual_hold_keeps_order_until_released(proxy: FaultProxy, direct: redis.Redis, key: str) -> None:
    """Bytes held until release() are delivered then, in order, even after their client closed the connection."""
    c = client(proxy.url, timeout=0.2)
    c.ping()
    hold = proxy.hold()
    pipe = c.pipeline(transaction=False)
    pipe.set(key, "first").append(key, "+second").incr(f"{key}:n").incr(f"{key}:n")
    with pytest.raises(redis.TimeoutError):
        pipe.execute()
    c.close()
    time.sleep(0.3)
    assert direct.get(key) is None and hold.bytes > 0
    assert proxy.pending_bytes() > 0
    hold.release()
    assert proxy.wait_idle(5.0)
    assert direct.get(key) == b"first+second"
    assert direct.get(f"{key}:n") == b"2"


def test_stopped_hold_lets_new_bytes_through_behind_what_it_holds(
    proxy: FaultProxy, direct: redis.Redis, key: str
) -> None:
    """stop() catches nothing new, but a connection's later bytes still wait behind its held ones (no reordering)."""
    held_client = client(proxy.url, timeout=0.2)
    held_client.ping()
    hold = proxy.hold()
    with pytest.raises(redis.TimeoutError):
        held_client.set(key, "held")
    hold.stop()
    fresh = client(proxy.url)
    assert fresh.set(f"{key}:fresh", "1") is True  # a new connection flows
    assert direct.get(key) is None  # the held one still waits
    hold.release()
    assert wait_for(lambda: direct.get(key) == b"held")
    held_client.close()
    fresh.close()


def test_drop_upstream_means_the_command_never_runs(proxy: FaultProxy, direct: redis.Redis, key: str) -> None:
    """Dropped client bytes are gone for good: the command never runs, even after the fault stops."""
    c = client(proxy.url, timeout=0.3)
    c.ping()
    drop = proxy.drop(direction="upstream")
    with pytest.raises(redis.TimeoutError):
        c.set(key, "dropped")
    drop.stop()
    c.close()
    assert proxy.wait_idle(5.0)
    time.sleep(0.2)
    assert direct.get(key) is None
    assert drop.bytes > 0 and proxy.stats.dropped > 0


def test_drop_downstream_runs_the_command_but_loses_the_reply(proxy: FaultProxy, direct: redis.Redis, key: str) -> None:
    """Dropped replies: the client times out although the server did apply the command."""
    c = client(proxy.url, timeout=0.3)
    c.ping()
    drop = proxy.drop(direction="downstream")
    with pytest.raises(redis.TimeoutError):
        c.set(key, "applied")
    assert wait_for(lambda: direct.get(key) == b"applied")
    drop.stop()
    c.close()


@pytest.mark.parametrize("reset", [False, True], ids=["fin", "rst"])
def test_cut_fails_a_waiting_command_with_connection_error(proxy: FaultProxy, key: str, reset: bool) -> None:
    """Cutting a connection while a command waits for its reply fails it with ConnectionError, at once."""
    c = client(proxy.url, timeout=10.0)
    c.ping()
    errors: list[BaseException] = []
    done = threading.Event()

    def blocked() -> None:
        try:
            c.blpop([key], timeout=8)
        except BaseException as exc:
            errors.append(exc)
        done.set()

    # The BLPOP is on the wire once the proxy has delivered more than the PING.
    sent = proxy.connections()[0].bytes_up
    thread = threading.Thread(target=blocked, daemon=True)
    thread.start()
    assert wait_for(lambda: proxy.connections()[0].bytes_up > sent)
    assert proxy.cut(reset=reset) == 1
    # Ended by the cut, not by the BLPOP's own 8 s timeout (nor the 10 s socket timeout): within 5 s, and with
    # ConnectionError (a BLPOP that times out returns None; a socket timeout raises TimeoutError).
    assert done.wait(5.0)
    assert len(errors) == 1 and isinstance(errors[0], redis.ConnectionError), errors
    assert proxy.stats.cut == 1 and proxy.stats.open == 0
    thread.join(5)
    c.close()


def test_targets_next_numbered_and_open_connections(proxy: FaultProxy, direct: redis.Redis, key: str) -> None:
    """A fault aimed at connection k, at the next connection, or at the open ones leaves the others alone."""
    c0, c1 = client(proxy.url), client(proxy.url, timeout=0.3)
    c0.ping()
    c1.ping()
    assert proxy.open_connections() == [0, 1]
    hold = proxy.hold(target=1)
    assert c0.set(key, "0") is True  # connection 0 flows
    with pytest.raises(redis.TimeoutError):
        c1.set(key, "1")
    hold.release()
    assert wait_for(lambda: direct.get(key) == b"1")
    assert proxy.wait_idle()  # connection 1 (its client gave up) is closed once its late SET ran
    # "next": only the connection accepted after the call (number 2).
    slow = proxy.delay(0.15, target="next")
    c2 = client(proxy.url)
    assert round_trip(c2, 2) >= 0.3
    caught = slow.bytes
    round_trip(c0, 2)
    assert slow.bytes == caught > 0  # connection 0's PINGs went through untouched
    slow.stop()
    # "open": the ones open now (0 and 2; 1 was closed by its timeout), not a later one.
    late = proxy.delay(0.15, target="open")
    c3 = client(proxy.url)
    round_trip(c3, 2)
    assert late.bytes == 0  # connection 3's handshake and PINGs went through untouched
    assert round_trip(c0, 1) >= 0.3
    assert late.bytes > 0
    late.stop()
    # A cut of one number closes only that connection.
    assert proxy.cut(target=0) == 1
    assert proxy.open_connections() == [2, 3]
    # A cut aimed at a connection not accepted yet closes it as soon as it comes.
    proxy.cut(target="next")
    c4 = client(proxy.url)
    with pytest.raises(redis.ConnectionError):
        c4.ping()
    for c in (c0, c1, c2, c3, c4):
        c.close()


def test_bandwidth_limit_slows_a_large_value(proxy: FaultProxy, direct: redis.Redis, key: str) -> None:
    """A 200 kB SET through a 500 kB/s limit takes at least about 0.4 s, and every byte of it went through the
    limit."""
    c = client(proxy.url, timeout=10.0)
    c.ping()
    limit = proxy.bandwidth(500_000, direction="upstream")
    t = time.monotonic()
    c.set(key, b"x" * 200_000)
    took = time.monotonic() - t
    limit.stop()
    assert took >= 0.35, took
    assert limit.bytes > 200_000, limit.bytes
    assert direct.strlen(key) == 200_000
    c.close()


def test_server_down_behind_the_proxy_looks_like_a_dropped_connection(key: str) -> None:
    """With nothing listening upstream, a client connects to the proxy and then sees the connection end."""
    with FaultProxy(free_port()) as p:
        c = client(p.url)
        with pytest.raises(redis.ConnectionError):
            c.get(key)
        c.close()


def test_stop_closes_everything(redis_node: RedisServer, key: str) -> None:
    """Leaving the with block closes the client connections and the listener, and ends the thread."""
    with FaultProxy(redis_node.port) as p:
        c = client(p.url, timeout=1.0)
        c.ping()
        p.hold()  # bytes held at stop are simply dropped
        url = p.url
        thread = p._thread
    assert thread is not None and not thread.is_alive()
    with pytest.raises(redis.ConnectionError):
        c.ping()
    with pytest.raises(redis.ConnectionError):
        client(url, timeout=1.0).ping()


def test_only_loopback_upstreams() -> None:
    """The proxy refuses to forward anywhere but 127.0.0.1."""
    with pytest.raises(ValueError, match=r"127\.0\.0\.1"):
        FaultProxy(6379, upstream_host="10.0.0.1")
