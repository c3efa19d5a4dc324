"""``lock_on_lost="interrupt"``: raise :class:`LockLostError` inside the body whose lock was lost.

The watchdog learns of a loss in its own thread (a greenlet, under gevent's monkey-patching), never in the body's.
How the error gets into the body depends on where the body runs:

prefork and solo
    The body runs in its process's main thread. Python runs signal handlers in the main thread, between two
    bytecodes, and a signal sent to that thread (``pthread_kill``) also breaks a blocking system call (a sleep, a
    socket read) out with EINTR: the way billiard raises ``SoftTimeLimitExceeded`` in a pool child. The watchdog
    marks the run's :class:`Target` and signals the main thread with :data:`INTERRUPT_SIGNAL`; the handler raises
    only if that run is still in its body, so a loss noticed after the body ended (while it releases or its result
    is stored), or a signal meant for a run that has ended, does nothing.
gevent
    The body is a greenlet: the hub throws the error into it at its next switch (``gevent.Timeout`` raises the
    soft time limit the same way).
threads, eventlet
    Python cannot raise in another thread: the body is not interrupted (a warning at worker start and once per task
    and process); ``self.check_lock()`` still raises.

Best effort everywhere: a body busy in C code (a long computation, a blocking call that retries on EINTR itself)
sees the error when it returns to Python, a CPU-bound greenlet when it yields, and a body that catches
``Exception`` may swallow it. Fencing tokens stay the guard against a stale writer.
"""

from __future__ import annotations

import logging
import signal
import sys
import threading
from collections.abc import Callable
from types import CodeType, FrameType
from typing import Any, Final

from ..errors import LockLostError

try:  # the C function: signal.getsignal also tries to turn its answer into a Handlers enum, which for a Python
    # handler (ours, once installed) fails inside the enum machinery: ~5 µs on every armed run (profile_task.py)
    from _signal import getsignal as _getsignal  # type: ignore[import-not-found,unused-ignore]
except ImportError:  # pragma: no cover - another interpreter
    _getsignal = signal.getsignal

__all__ = ["INTERRUPT_SIGNAL", "Target", "outside_body"]

logger = logging.getLogger("celery_singleton_lock.interrupt")

#: The signal that carries an interrupt to the main thread. A real-time signal where there are some (Linux): Celery
#: and billiard use SIGUSR1 (soft time limit, stack dump) and SIGUSR2 (rdb, billiard's full signal protection) in the
#: processes that run bodies, and no real-time one. Elsewhere SIGUSR2; either way, a signal that is not ours is passed
#: on to the handler installed before ours.
INTERRUPT_SIGNAL: Final[int | None] = (
    int(signal.SIGRTMIN) + 3 if hasattr(signal, "SIGRTMIN") else getattr(signal, "SIGUSR2", None)
)

# The run whose body the main thread is in (signal mode); a body that runs a LockedTask inline (apply()) nests.
_current: Target | None = None
_sent = False  # an interrupt signal is on its way: the handler must not pass it on
_previous: Any = None  # the handler ours replaced
# Functions whose own code runs around a body, never inside it (LockedTask.__call__): see outside_body.
_OUTSIDE: set[CodeType] = set()


def outside_body(function: Callable[..., Any]) -> None:
    """Declare ``function`` the frame that calls the body: a signal handled while its own code runs comes after the
    body ended (in its ``finally``, before the release disarms the run), and is dropped, not raised there. (Or just
    before the body starts, a few bytecodes after the acquire: that loss is then left to ``check_lock()``.)"""
    _OUTSIDE.add(function.__code__)


class Target:
    """The body of one run, to be interrupted if the run's lock is lost (one per run; never re-armed)."""

    __slots__ = ("armed", "error", "greenlet", "hub", "outer", "thread")

    def __init__(self) -> None:
        self.armed = False
        self.error: LockLostError | None = None  # the interrupt on its way
        self.thread: int | None = None  # signal mode: the main thread's id
        self.greenlet: Any = None  # gevent mode: the body's greenlet, and its hub
        self.hub: Any = None
        self.outer: Target | None = None  # signal mode: the run whose body this one's was called from

    def arm(self) -> bool:
        """Called where the body is about to run; False when nothing can interrupt it there (a thread, eventlet)."""
        gevent = sys.modules.get("gevent")
        if gevent is not None:
            current = gevent.getcurrent()
            if isinstance(current, gevent.Greenlet):  # a gevent pool's body (the pool spawns one per task)
                self.greenlet, self.hub = current, gevent.get_hub()
                self.armed = True
                return True
        if INTERRUPT_SIGNAL is None or threading.current_thread() is not threading.main_thread():
            return False
        global _current  # noqa: PLW0603 - one main thread per process
        _install(INTERRUPT_SIGNAL)
        self.thread = threading.get_ident()
        self.outer = _current if _current is not None and _current.armed else None
        self.armed = True
        _current = self
        return True

    def disarm(self) -> None:
        """The body has ended: an interrupt from now on does nothing. Called in the body's thread or greenlet."""
        global _current  # noqa: PLW0603
        self.armed = False
        if _current is self:
            _current = self.outer
        self.outer = None

    def fire(self, error: LockLostError) -> None:
        """Raise ``error`` in the body if it still runs. Called in the watchdog's thread."""
        global _sent  # noqa: PLW0603
        if not self.armed:
            return
        self.error = error
        if self.hub is not None:
            self.hub.loop.run_callback_threadsafe(self._throw)
        elif self.thread is not None and INTERRUPT_SIGNAL is not None:
            _sent = True
            signal.pthread_kill(self.thread, INTERRUPT_SIGNAL)

    def _take(self) -> LockLostError | None:
        """The interrupt to raise now, once: None when there is none or the body has ended."""
        error = self.error
        if not self.armed or error is None:
            return None
        self.armed = False
        self.error = None
        return error

    def _throw(self) -> None:
        # In the hub: the body's greenlet is switched out, so it cannot end between this check and the throw.
        if self.greenlet.dead:
            return
        error = self._take()
        if error is not None:
            try:
                self.greenlet.throw(error)
            except BaseException:  # never let the hub's loop die of it
                logger.debug("interrupting a greenlet raised", exc_info=True)


# disarm() is called where its target's body has ended (first thing in Redlock.__exit__, after LockedTask's body): a
# signal that arrived just before it is handled at its first instruction, in its own frame, before ``armed`` is
# cleared. That target's interrupt is dropped there; the runs it was nested in still get theirs.
_DISARM: Final[CodeType] = Target.disarm.__code__


def _install(signum: int) -> None:
    """Install the handler in this process once (it survives fork: a prefork child inherits it)."""
    global _previous  # noqa: PLW0603
    if _getsignal(signum) is not _handler:
        _previous = signal.signal(signum, _handler)


def _handler(signum: int, frame: FrameType | None) -> None:
    global _sent
    ours, _sent = _sent, False
    target = _current
    if frame is not None and frame.f_code is _DISARM:
        ending = frame.f_locals.get("self")
        if isinstance(ending, Target):
            ending._take()  # noqa: SLF001 - its body has ended: drop its interrupt, not the outer runs'
    elif frame is not None and frame.f_code in _OUTSIDE and target is not None:
        target._take()  # noqa: SLF001 - the body has ended: drop its interrupt
        target = None
    for _ in range(64):  # bounded: nested inline runs
        if target is None:
            break
        error = target._take()  # noqa: SLF001
        if error is not None:
            raise error
        target = target.outer
    if not ours and callable(_previous):
        _previous(signum, frame)
