"""Fault injection for lock tests: a loopback TCP proxy with settable faults (the history checker that goes with
it is :mod:`celery_singleton_lock.history`).

:class:`FaultProxy` sits between lock clients and one redis-server (in the spirit of Toxiproxy). Tests set faults
on it at any time, for every connection or for chosen ones: added latency, hold-then-release (a command delivered
late, after its client gave up), drop, cut, and a bandwidth limit. Its ``url`` is a lock node URL::

    with RedisServer() as server, FaultProxy(server.port) as proxy:
        lock = Redlock([proxy.url, ...], "name", ttl=5.0)
        slow = proxy.delay(0.05)                 # every connection, both directions, from now on
        held = proxy.hold(target="open")         # the connections open now: client->server bytes wait ...
        ...
        held.release()                           # ... until now: delivered late, in order
        slow.stop()
        proxy.cut()                              # close every open connection

Only loopback addresses are ever used. Everything here is test code: bounded loops, daemon threads, and every
socket closed on ``stop``.
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import math
import random
import selectors
import socket
import struct
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Literal, Union

__all__ = [
    "ConnectionInfo",
    "Fault",
    "FaultProxy",
    "ProxyStats",
]

#: Which way a fault acts: ``upstream`` is client -> server (commands), ``downstream`` server -> client (replies).
Direction = Literal["upstream", "downstream", "both"]
#: Which connections a fault acts on: ``"all"`` (every connection, open now or accepted later), ``"open"`` (the
#: ones open now), ``"next"`` (the next one the proxy accepts), connection number ``k`` (0-based, in the order the
#: proxy accepted them; may be a future one), or several numbers.
Target = Union[Literal["all", "open", "next"], int, Sequence[int]]  # noqa: UP007 - a runtime alias on Python 3.10

_UP = "upstream"
_DOWN = "downstream"
_CHUNK = 65536
#: Bytes queued in one direction of one connection before the proxy stops reading that side (back-pressure).
BUFFER_LIMIT = 8 << 20
#: Seconds a connection whose client has gone may wait for its server to close (a paused server) before the proxy
#: closes it anyway.
LINGER = 30.0
_LOOPBACK = "127.0.0.1"
_serials = itertools.count(1)


class Fault:
    """One fault set on a :class:`FaultProxy`; the handle that stops it (and delivers what a hold holds).

    A fault acts on bytes as they arrive: stopping it changes nothing for bytes it already delayed or held (they
    keep their delivery time), and the proxy never reorders the bytes of one direction of a connection.
    """

    def __init__(
        self,
        proxy: FaultProxy,
        kind: Literal["delay", "hold", "drop", "bandwidth"],
        *,
        direction: Direction,
        indices: frozenset[int] | None,
        seconds: float | None = 0.0,
        jitter: float = 0.0,
        rate: float = 0.0,
    ) -> None:
        self.kind = kind
        self.direction = direction
        #: The connection numbers it acts on; None for every connection, open now or accepted later.
        self.indices = indices
        self.seconds = seconds
        self.jitter = jitter
        self.rate = rate
        #: Bytes it caught so far (delayed, held, dropped or throttled).
        self.bytes = 0
        self.serial = next(_serials)
        #: True while it catches new bytes.
        self.active = True
        #: A hold without ``seconds`` keeps what it caught until release(): the monotonic time it was released.
        self.released_at: float | None = None
        self._proxy = proxy

    def __repr__(self) -> str:
        target = "all" if self.indices is None else sorted(self.indices)
        return f"Fault({self.kind}, {self.direction}, target={target}, active={self.active}, bytes={self.bytes})"

    def applies(self, index: int, direction: str) -> bool:
        """True when it acts on bytes of connection ``index`` going ``direction`` (``upstream``/``downstream``)."""
        if not self.active or self.direction not in ("both", direction):
            return False
        return self.indices is None or index in self.indices

    def stop(self) -> None:
        """Catch no more bytes. What a hold without ``seconds`` caught stays held until :meth:`release`."""
        self._proxy.remove(self)

    def release(self) -> None:
        """Stop, and deliver now everything this hold holds (after what each connection had queued before)."""
        self._proxy.remove(self, release=True)


@dataclass(frozen=True)
class ConnectionInfo:
    """A snapshot of one proxied connection."""

    index: int
    open: bool
    bytes_up: int  # client -> server, delivered
    bytes_down: int  # server -> client, delivered
    pending_up: int  # read from the client, not yet delivered (delayed, held, throttled)
    pending_down: int
    dropped: int


@dataclass(frozen=True)
class ProxyStats:
    """A snapshot of a proxy's counters."""

    accepted: int
    open: int
    bytes_up: int
    bytes_down: int
    pending: int
    dropped: int
    cut: int


class _Chunk:
    __slots__ = ("data", "due", "gates")

    def __init__(self, data: bytes, due: float, gates: tuple[Fault, ...]) -> None:
        self.data = data
        self.due = due
        self.gates = gates

    def ready_at(self) -> float:
        due = self.due
        for gate in self.gates:
            if gate.released_at is None:
                return math.inf
            due = max(due, gate.released_at)
        return due


class _Pipe:
    """One direction of a connection: bytes read from ``src``, queued until due, then written to ``dst``."""

    def __init__(self, direction: str, src: socket.socket, dst: socket.socket) -> None:
        self.direction = direction
        self.src = src
        self.dst = dst
        self.queue: deque[_Chunk] = deque()
        self.queued = 0  # bytes in queue
        self.out = bytearray()  # due, not yet written
        self.src_eof = False  # the source ended (or reset): nothing more will be read
        self.dst_shut = False  # our write side towards dst is shut (after everything was delivered)
        self.dead = False  # dst cannot take bytes any more: what comes is discarded
        self.last_due = 0.0  # keeps the direction in order whatever the faults
        self.bw_free = 0.0  # when the throttled "wire" is free again
        self.hold_until: dict[int, float] = {}  # per timed hold (by serial): until when it holds this direction
        self.delivered = 0
        self.dropped = 0

    @property
    def pending(self) -> int:
        return self.queued + len(self.out)

    def finished(self) -> bool:
        return self.src_eof and (self.dead or (self.dst_shut and not self.queue and not self.out))


class _Conn:
    def __init__(self, index: int, client: socket.socket, server: socket.socket) -> None:
        self.index = index
        self.client = client
        self.server = server
        self.connecting = True
        self.closed = False
        self.up = _Pipe(_UP, client, server)
        self.down = _Pipe(_DOWN, server, client)
        self.client_gone_at: float | None = None  # when the client side ended (bounds the linger)
        self.masks: dict[socket.socket, int] = {client: 0, server: 0}

    def info(self) -> ConnectionInfo:
        return ConnectionInfo(
            self.index,
            not self.closed,
            self.up.delivered,
            self.down.delivered,
            self.up.pending,
            self.down.pending,
            self.up.dropped + self.down.dropped,
        )


def _nodelay(sock: socket.socket) -> None:
    # Small commands must not wait for Nagle's algorithm: latency faults are measured in milliseconds.
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


class FaultProxy:
    """A TCP proxy on 127.0.0.1 in front of one server on 127.0.0.1, with faults settable at any time.

    One selector thread (a daemon) moves the bytes; it never blocks on a socket. Each direction of a connection
    keeps its bytes in order, whatever the faults. When a client closes its connection, whatever the proxy still
    holds for the server is delivered first, then the server's side is shut for writing: a command the client
    gave up on still runs, late, like a packet still in flight. ``stop()`` (or leaving the ``with`` block) closes
    every socket and joins the thread.
    """

    def __init__(self, upstream_port: int, *, upstream_host: str = _LOOPBACK, port: int = 0) -> None:
        if upstream_host not in (_LOOPBACK, "localhost"):
            raise ValueError(f"FaultProxy forwards to 127.0.0.1 only, not {upstream_host!r}")
        self.upstream = (_LOOPBACK, int(upstream_port))
        self.host = _LOOPBACK
        self._requested_port = port
        self.port = 0
        self._lock = threading.RLock()
        self._faults: list[Fault] = []
        self._pending_cuts: dict[int, bool] = {}  # connection number -> reset, for connections not accepted yet
        self._cuts: deque[tuple[frozenset[int] | None, bool, threading.Event, list[int]]] = deque()
        self._conns: list[_Conn] = []
        self._open: dict[int, _Conn] = {}
        self._accepted = 0
        self._cut_count = 0
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._listener: socket.socket | None = None
        self._wake_r: socket.socket | None = None
        self._wake_w: socket.socket | None = None
        self._sel: selectors.BaseSelector | None = None
        self._error: BaseException | None = None

    # -- life cycle ------------------------------------------------------------------------------------------------

    @property
    def url(self) -> str:
        """``redis://127.0.0.1:<port>/0``: use it as a lock node URL."""
        if not self.port:
            raise RuntimeError("the proxy is not started")
        return f"redis://{self.host}:{self.port}/0"

    def start(self) -> FaultProxy:
        """Listen on a free port (or the one given) and start forwarding."""
        if self._thread is not None:
            return self
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind((self.host, self._requested_port))
            listener.listen(128)
            listener.settimeout(0.0)
        except OSError:
            listener.close()
            raise
        self.port = int(listener.getsockname()[1])
        self._listener = listener
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.settimeout(0.0)
        self._wake_w.settimeout(0.0)
        self._sel = selectors.DefaultSelector()
        self._sel.register(listener, selectors.EVENT_READ, None)
        self._sel.register(self._wake_r, selectors.EVENT_READ, None)
        self._thread = threading.Thread(target=self._run, name=f"FaultProxy:{self.port}", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float = 5.0) -> None:
        """Close every connection and the listener; join the thread. Idempotent."""
        thread = self._thread
        if thread is None:
            return
        with self._lock:
            self._stopping = True
        self._wake()
        thread.join(timeout)
        if thread.is_alive():  # pragma: no cover - the loop wakes at least every 0.25 s
            raise RuntimeError(f"FaultProxy on port {self.port} did not stop within {timeout} s")

    close = stop

    def __enter__(self) -> FaultProxy:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"FaultProxy(127.0.0.1:{self.port} -> 127.0.0.1:{self.upstream[1]})"

    # -- faults ------------------------------------------------------------------------------------------------------

    def delay(
        self, seconds: float, *, jitter: float = 0.0, direction: Direction = "both", target: Target = "all"
    ) -> Fault:
        """Deliver each chunk ``seconds`` (plus up to ``jitter``) after it arrived: latency per chunk and direction."""
        if seconds < 0 or jitter < 0:
            raise ValueError("delay and jitter must be >= 0")
        indices = self._indices(target)
        return self._add(Fault(self, "delay", direction=direction, indices=indices, seconds=seconds, jitter=jitter))

    def hold(self, seconds: float | None = None, *, direction: Direction = "upstream", target: Target = "all") -> Fault:
        """Hold back a connection's bytes, then deliver them together, late and in order.

        With ``seconds``, each connection caught is held from the first byte caught, for ``seconds``; it then
        flows again (the fault catches each connection once). Without, everything caught waits for
        :meth:`Fault.release`. Either way the client may have given up and closed meanwhile: what was held is
        still delivered to the server.
        """
        if seconds is not None and seconds < 0:
            raise ValueError("seconds must be >= 0 or None")
        return self._add(Fault(self, "hold", direction=direction, indices=self._indices(target), seconds=seconds))

    def drop(self, *, direction: Direction = "both", target: Target = "all") -> Fault:
        """Swallow bytes silently: the connection stays open, nothing arrives."""
        return self._add(Fault(self, "drop", direction=direction, indices=self._indices(target)))

    def bandwidth(self, bytes_per_second: float, *, direction: Direction = "both", target: Target = "all") -> Fault:
        """Deliver at most ``bytes_per_second`` per connection and direction."""
        if bytes_per_second <= 0:
            raise ValueError("bytes_per_second must be > 0")
        indices = self._indices(target)
        return self._add(Fault(self, "bandwidth", direction=direction, indices=indices, rate=float(bytes_per_second)))

    def cut(self, target: Target = "all", *, reset: bool = False, timeout: float = 5.0) -> int:
        """Close connections now (``reset``: with a TCP RST instead of a FIN); the number closed.

        ``"all"`` and ``"open"`` close the connections open now; ``"next"`` and numbers not accepted yet close
        those connections as soon as they are accepted. Bytes held for a cut connection are lost.
        """
        indices = self._indices(target)
        done = threading.Event()
        closed: list[int] = []
        with self._lock:
            if self._stopping or self._thread is None:
                return 0  # nothing is open on a proxy that is not running
            if indices is not None:
                for index in indices:
                    if index >= self._accepted:
                        self._pending_cuts[index] = reset
            self._cuts.append((indices, reset, done, closed))
        self._wake()
        if not done.wait(timeout):
            raise RuntimeError(f"FaultProxy on port {self.port} did not cut within {timeout} s")
        return len(closed)

    def faults(self) -> list[Fault]:
        """The faults still active."""
        with self._lock:
            return [f for f in self._faults if f.active]

    def clear(self) -> None:
        """Stop every fault; bytes already delayed or held keep their delivery time (see :meth:`heal`)."""
        with self._lock:
            for fault in self._faults:
                fault.active = False
            self._faults = []
            self._pending_cuts.clear()
        self._wake()

    def heal(self) -> None:
        """Stop every fault and deliver everything held now."""
        with self._lock:
            now = time.monotonic()
            for conn in self._open.values():
                for pipe in (conn.up, conn.down):
                    for chunk in pipe.queue:
                        chunk.due = min(chunk.due, now)
                        chunk.gates = ()
                    pipe.hold_until.clear()
                    pipe.bw_free = min(pipe.bw_free, now)
                    pipe.last_due = min(pipe.last_due, now)
        self.clear()

    # -- introspection ----------------------------------------------------------------------------------------------

    @property
    def accepted(self) -> int:
        """Connections accepted so far; the next one gets this number."""
        with self._lock:
            return self._accepted

    def connections(self) -> list[ConnectionInfo]:
        """Every connection so far, open or closed, in the order accepted."""
        with self._lock:
            return [c.info() for c in self._conns]

    def open_connections(self) -> list[int]:
        """The numbers of the connections open now."""
        with self._lock:
            return sorted(self._open)

    @property
    def stats(self) -> ProxyStats:
        with self._lock:
            infos = [c.info() for c in self._conns]
            return ProxyStats(
                accepted=self._accepted,
                open=len(self._open),
                bytes_up=sum(i.bytes_up for i in infos),
                bytes_down=sum(i.bytes_down for i in infos),
                pending=sum(i.pending_up + i.pending_down for i in infos),
                dropped=sum(i.dropped for i in infos),
                cut=self._cut_count,
            )

    def pending_bytes(self) -> int:
        """Bytes read and not yet delivered (delayed, held, throttled), over every open connection."""
        with self._lock:
            return sum(c.up.pending + c.down.pending for c in self._open.values())

    def wait_idle(self, timeout: float = 5.0) -> bool:
        """Wait until nothing is pending and every connection its client closed is closed on the server's side.

        When it returns True, a command delivered late on a connection its client had closed has been run: the
        server read up to the end of that connection's stream, and redis-server runs what it read before closing.
        """
        deadline = time.monotonic() + timeout
        for _ in range(int(timeout / 0.005) + 2):
            with self._lock:
                self._check_error()
                busy = any(c.up.pending or c.down.pending or c.client_gone_at is not None for c in self._open.values())
            if not busy:
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.005)
        return False

    # -- internals ---------------------------------------------------------------------------------------------------

    def _check_error(self) -> None:
        if self._error is not None:
            raise RuntimeError(f"FaultProxy on port {self.port} failed: {self._error!r}") from self._error

    def _indices(self, target: Target) -> frozenset[int] | None:
        with self._lock:
            if target == "all":
                return None
            if target == "open":
                return frozenset(self._open)
            if target == "next":
                return frozenset({self._accepted})
            if isinstance(target, int) and not isinstance(target, bool):
                return frozenset({target})
            if isinstance(target, Sequence) and not isinstance(target, str):
                return frozenset(int(i) for i in target)
        raise ValueError(f"target must be 'all', 'open', 'next', a connection number or numbers, not {target!r}")

    def _add(self, fault: Fault) -> Fault:
        if fault.direction not in (_UP, _DOWN, "both"):
            raise ValueError(f"direction must be 'upstream', 'downstream' or 'both', not {fault.direction!r}")
        with self._lock:
            self._check_error()
            self._faults.append(fault)
        self._wake()
        return fault

    def remove(self, fault: Fault, *, release: bool = False) -> None:
        """Stop ``fault`` (``fault.stop()``); with ``release``, deliver what it holds now (``fault.release()``)."""
        with self._lock:
            fault.active = False
            if fault in self._faults:
                self._faults.remove(fault)
            if release and fault.released_at is None:
                fault.released_at = time.monotonic()
        self._wake()

    def _wake(self) -> None:
        if self._wake_w is not None:
            with contextlib.suppress(OSError):
                self._wake_w.send(b"x")

    def _run(self) -> None:
        sel = self._sel
        assert sel is not None
        try:
            while True:
                with self._lock:
                    if self._stopping:
                        break
                    now = time.monotonic()
                    self._do_cuts()
                    for conn in list(self._open.values()):
                        self._pump(conn, now)
                    timeout = self._next_timer(now)
                for key, mask in sel.select(timeout):
                    with self._lock:
                        self._event(key.fileobj, key.data, mask)  # type: ignore[arg-type]
        except BaseException as exc:  # pragma: no cover - a bug in the proxy: reported by the next call
            self._error = exc
        finally:
            with self._lock:
                for conn in list(self._open.values()):
                    self._close(conn, reset=False)
                for sock in (self._listener, self._wake_r, self._wake_w):
                    if sock is not None:
                        with contextlib.suppress(KeyError, ValueError):
                            sel.unregister(sock)
                        sock.close()
                sel.close()

    def _next_timer(self, now: float) -> float:
        timeout = 0.25  # wake now and then whatever happens: stop() is never left waiting long
        for conn in self._open.values():
            for pipe in (conn.up, conn.down):
                if pipe.queue:
                    timeout = min(timeout, pipe.queue[0].ready_at() - now)
            if conn.client_gone_at is not None:
                timeout = min(timeout, conn.client_gone_at + LINGER - now)
        return max(timeout, 0.0)

    def _event(self, sock: socket.socket, conn: _Conn | None, mask: int) -> None:
        if sock is self._wake_r:
            with contextlib.suppress(OSError):
                while sock.recv(4096):
                    pass
            return
        if sock is self._listener:
            self._accept()
            return
        if conn is None or conn.closed:
            return
        if sock is conn.server and conn.connecting and mask & selectors.EVENT_WRITE:
            err = conn.server.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
            if err:
                self._close(conn, reset=False)  # the server refused (down): the client sees its connection end
                return
            conn.connecting = False
        if mask & selectors.EVENT_READ:
            self._read(conn, conn.up if sock is conn.client else conn.down)

    def _accept(self) -> None:
        assert self._listener is not None
        for _ in range(64):
            try:
                client, _addr = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:  # pragma: no cover - e.g. out of file descriptors: try again on the next event
                return
            index = self._accepted
            self._accepted += 1
            client.settimeout(0.0)
            _nodelay(client)
            if index in self._pending_cuts:
                reset = self._pending_cuts.pop(index)
                self._cut_count += 1
                server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                conn = _Conn(index, client, server)
                self._conns.append(conn)
                conn.closed = True
                self._hang_up(client, reset=reset)
                server.close()
                continue
            server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            server.settimeout(0.0)
            _nodelay(server)
            conn = _Conn(index, client, server)
            self._conns.append(conn)
            self._open[index] = conn
            err = server.connect_ex(self.upstream)
            if err not in (0, errno.EINPROGRESS, errno.EWOULDBLOCK):
                self._close(conn, reset=False)
                continue
            self._update(conn)

    def _read(self, conn: _Conn, pipe: _Pipe) -> None:
        try:
            data = pipe.src.recv(_CHUNK)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""  # a reset ends the stream like a FIN: what was read already is still delivered
        now = time.monotonic()
        if not data:
            pipe.src_eof = True
            if pipe is conn.up:
                conn.client_gone_at = now
            return
        self._admit(conn, pipe, data, now)

    def _admit(self, conn: _Conn, pipe: _Pipe, data: bytes, now: float) -> None:
        """Queue ``data`` with the delivery time the faults give it."""
        faults = [f for f in self._faults if f.applies(conn.index, pipe.direction)]
        if pipe.dead or any(f.kind == "drop" for f in faults):
            for f in faults:
                if f.kind == "drop":
                    f.bytes += len(data)
            pipe.dropped += len(data)
            return
        due = now
        gates: list[Fault] = []
        rate = 0.0
        for f in faults:
            if f.kind == "delay":
                due = max(due, now + (f.seconds or 0.0) + random.uniform(0.0, f.jitter))  # noqa: S311
                f.bytes += len(data)
            elif f.kind == "hold":
                if f.seconds is None:
                    gates.append(f)
                    f.bytes += len(data)
                    continue
                until = pipe.hold_until.setdefault(f.serial, now + f.seconds)
                if now < until:
                    due = max(due, until)
                    f.bytes += len(data)
            elif f.kind == "bandwidth":
                rate = f.rate if rate == 0.0 else min(rate, f.rate)
                f.bytes += len(data)
        pieces = [data]
        if rate:
            # Small pieces, each due when the throttled wire has carried it: delivery is smooth, not bursty.
            size = max(1, int(rate * 0.02))
            pieces = [data[i : i + size] for i in range(0, len(data), size)]
        for piece in pieces:
            at = max(due, pipe.last_due)
            if rate:
                at = max(at, pipe.bw_free) + len(piece) / rate
                pipe.bw_free = at
            pipe.last_due = at
            pipe.queue.append(_Chunk(piece, at, tuple(gates)))
            pipe.queued += len(piece)

    def _pump(self, conn: _Conn, now: float) -> None:
        """Deliver what is due, shut a finished direction, close a finished connection."""
        if conn.closed:
            return
        for pipe in (conn.up, conn.down):
            while pipe.queue and pipe.queue[0].ready_at() <= now:
                chunk = pipe.queue.popleft()
                pipe.queued -= len(chunk.data)
                if not pipe.dead:
                    pipe.out += chunk.data
            if pipe.out and not pipe.dead and not (pipe is conn.up and conn.connecting):
                try:
                    sent = pipe.dst.send(pipe.out)
                except (BlockingIOError, InterruptedError):
                    sent = 0
                except OSError:
                    sent = 0
                    pipe.dead = True
                    pipe.out.clear()
                    pipe.queue.clear()
                    pipe.queued = 0
                pipe.delivered += sent
                del pipe.out[:sent]
            if pipe.src_eof and not pipe.dst_shut and not pipe.queue and not pipe.out and not pipe.dead:
                if pipe is conn.up and conn.connecting:
                    continue
                with contextlib.suppress(OSError):
                    pipe.dst.shutdown(socket.SHUT_WR)
                pipe.dst_shut = True
        if conn.up.dead:
            self._close(conn, reset=False)  # the server is gone: nothing more can be delivered to it
            return
        if conn.up.finished() and conn.down.finished():
            self._close(conn, reset=False)
            return
        if conn.client_gone_at is not None and now >= conn.client_gone_at + LINGER:
            self._close(conn, reset=False)
            return
        self._update(conn)

    def _update(self, conn: _Conn) -> None:
        """Register the sockets for what the connection waits on now."""
        sel = self._sel
        assert sel is not None
        want = {
            conn.client: (
                (selectors.EVENT_READ if not conn.up.src_eof and conn.up.pending < BUFFER_LIMIT else 0)
                | (selectors.EVENT_WRITE if conn.down.out and not conn.down.dead else 0)
            ),
            conn.server: (
                selectors.EVENT_WRITE
                if conn.connecting
                else (
                    (selectors.EVENT_READ if not conn.down.src_eof and conn.down.pending < BUFFER_LIMIT else 0)
                    | (selectors.EVENT_WRITE if conn.up.out and not conn.up.dead else 0)
                )
            ),
        }
        for sock, mask in want.items():
            old = conn.masks[sock]
            if mask == old:
                continue
            if old == 0:
                sel.register(sock, mask, conn)
            elif mask == 0:
                sel.unregister(sock)
            else:
                sel.modify(sock, mask, conn)
            conn.masks[sock] = mask

    def _do_cuts(self) -> None:
        while self._cuts:
            indices, reset, done, closed = self._cuts.popleft()
            for index, conn in list(self._open.items()):
                if indices is None or index in indices:
                    self._close(conn, reset=reset)
                    self._cut_count += 1
                    closed.append(index)
            done.set()

    def _close(self, conn: _Conn, *, reset: bool) -> None:
        if conn.closed:
            return
        conn.closed = True
        self._open.pop(conn.index, None)
        sel = self._sel
        for sock in (conn.client, conn.server):
            if conn.masks.get(sock) and sel is not None:
                with contextlib.suppress(KeyError, ValueError):
                    sel.unregister(sock)
            conn.masks[sock] = 0
            self._hang_up(sock, reset=reset)
        for pipe in (conn.up, conn.down):
            pipe.dropped += pipe.pending
            pipe.queue.clear()
            pipe.queued = 0
            pipe.out.clear()

    @staticmethod
    def _hang_up(sock: socket.socket, *, reset: bool) -> None:
        if reset:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        sock.close()
