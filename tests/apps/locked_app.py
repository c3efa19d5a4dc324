"""The Celery app the LockedTask tests run in real worker processes.

Configured from the environment (the test writes it): CSL_BROKER, CSL_LOCK_URLS (comma-separated), CSL_RECORD
(a Redis URL where runs are recorded), CSL_TTL; optionally CSL_BACKEND (default: db 1 of a Redis broker),
CSL_QUEUE_TYPE (``quorum`` on RabbitMQ), CSL_PREFIX, CSL_VISIBILITY (seconds), CSL_MAX_TASKS_PER_CHILD and
CSL_LIVENESS (a liveness file).
Every run records ``[key, task_id, pid, start, end]`` so the test
can check, after the fact, that no two runs of one key overlapped in time.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import threading
import time
from typing import Any

import redis
from celery import Celery
from celery.signals import task_postrun
from kombu.utils.json import register_type

from celery_singleton_lock import LockedTask, LockLostError
from celery_singleton_lock.lock import aio

BROKER = os.environ["CSL_BROKER"]
app = Celery("locked_app", broker=BROKER, backend=os.environ.get("CSL_BACKEND") or BROKER.rsplit("/", 1)[0] + "/1")
app.conf.update(
    singleton_lock_urls=os.environ["CSL_LOCK_URLS"].split(","),
    singleton_lock_ttl=float(os.environ.get("CSL_TTL", "5")),
    singleton_lock_prefix=os.environ.get("CSL_PREFIX", "singleton_lock:"),
    singleton_lock_retry_delay=0.5,
    singleton_lock_retry_max_delay=2.0,
    task_acks_late=True,
    task_reject_on_worker_lost=True,
    worker_prefetch_multiplier=1,
    broker_connection_retry_on_startup=True,
    result_expires=600,
    worker_max_tasks_per_child=int(os.environ.get("CSL_MAX_TASKS_PER_CHILD", "0")) or None,
    # How long the main process waits, after a pool child died, for a result it may have sent (Celery's 10 s).
    worker_lost_wait=float(os.environ.get("CSL_LOST_WAIT", "10")),
)
if os.environ.get("CSL_LIVENESS"):
    app.conf.singleton_lock_liveness_file = os.environ["CSL_LIVENESS"]
if BROKER.startswith("redis"):
    app.conf.broker_transport_options = {
        "visibility_timeout": float(os.environ.get("CSL_VISIBILITY", "3600")),
        # With a short visibility timeout, sweep for unacked messages every second (kombu's default sweep is every
        # unacked_restore_interval * unacked_restore_throttle = 100 s), so a redelivery happens in bounded time.
        **({"unacked_restore_interval": 1, "unacked_restore_throttle": 1} if "CSL_VISIBILITY" in os.environ else {}),
    }
if os.environ.get("CSL_QUEUE_TYPE") == "quorum":
    # RabbitMQ quorum queues as Celery 5.5+ documents them: countdowns go through native delayed delivery, which
    # needs a topic exchange (a direct one only gets a warning, and ETA copies then wait in the worker).
    app.conf.update(task_default_queue_type="quorum", task_default_exchange_type="topic")
record = redis.Redis.from_url(os.environ["CSL_RECORD"])


def _run(task: Any, key: str, duration: float) -> None:
    """Hold for ``duration`` s, recording the start and the end. A key named ``bounded-...`` (new_key("bounded")) is
    a test's that may end its runs sooner, by setting ``release:<key>`` once it saw what the run had to outlive (its
    duration then only a bound); no other run asks the record anything in between."""
    start = time.time()
    record.rpush("started", json.dumps([key, task.request.id, os.getpid(), start]))
    end_by = time.monotonic() + duration
    bounded = isinstance(key, str) and key.startswith("bounded-")
    while time.monotonic() < end_by:  # bounded by duration
        if bounded and record.exists(f"release:{key}"):
            break
        time.sleep(min(0.05, max(0.0, end_by - time.monotonic())))
    record.rpush("runs", json.dumps([key, task.request.id, os.getpid(), start, time.time()]))


@app.task(shared=False, base=LockedTask, bind=True, lock_unique_on=["key"])
def work(self: Any, key: str, duration: float = 0.0, fail: bool = False) -> str:
    """Hold ``key`` for ``duration`` seconds, record the run, optionally fail."""
    _run(self, key, duration)
    if fail:
        raise RuntimeError("failing on purpose")
    return key


@app.task(shared=False, base=LockedTask, bind=True, lock_ttl=30, lock_unique_on=["key"])
def long_lease(self: Any, key: str, duration: float = 0.0) -> str:
    """``work`` with a 30 s lease: a killed run's redelivery that waited it out would start 30 s late."""
    _run(self, key, duration)
    return key


@app.task(shared=False, base=LockedTask, bind=True, lock_ttl=0.6, lock_unique_on=["key"])
def long_work(self: Any, key: str, duration: float) -> list[bool]:
    """Run 10x past a short ttl, checking the lock at every step."""
    held = []
    start = time.time()
    record.rpush("started", json.dumps([key, self.request.id, os.getpid(), start]))
    end_by = time.monotonic() + duration
    while time.monotonic() < end_by:
        held.append(self.lock_held())
        time.sleep(0.1)
    record.rpush("runs", json.dumps([key, self.request.id, os.getpid(), start, time.time()]))
    return [all(held), self.fencing_token is not None]


@app.task(shared=False, base=LockedTask, bind=True, max_retries=3, lock_unique_on=["key"])
def flaky(self: Any, key: str, failures: int, countdown: float) -> int:
    """Retry ``failures`` times with ``countdown``, then succeed."""
    _run(self, key, 0.1)
    if self.request.retries < failures:
        raise self.retry(countdown=countdown)
    return self.request.retries


@app.task(shared=False, base=LockedTask, bind=True, soft_time_limit=1.0, time_limit=2.0, lock_unique_on=["key"])
def overrun(self: Any, key: str, duration: float, ignore_soft: bool = False) -> None:
    """Run past the time limits (soft: SoftTimeLimitExceeded unless swallowed; hard: the child is killed)."""
    from celery.exceptions import SoftTimeLimitExceeded  # noqa: PLC0415

    try:
        _run(self, key, duration)
    except SoftTimeLimitExceeded:
        if not ignore_soft:
            raise
        _run(self, key, duration)


@app.task(shared=False, base=LockedTask, bind=True)
def echo(self: Any, account_id: int, month: str = "current") -> int:
    """Defaults and keyword calls map to one key."""
    _run(self, f"echo:{account_id}:{month}", 0.5)
    return account_id


@app.task(shared=False, base=LockedTask, bind=True, lock_unique_on=["key"], lock_on_unavailable="fail")
def work_or_fail(self: Any, key: str, duration: float = 0.0) -> str:
    """Like ``work``, but FAILURE (LockUnavailableError) when no quorum of lock nodes answers."""
    _run(self, key, duration)
    return key


@app.task(shared=False, base=LockedTask, bind=True, lock_unique_on=["key"], lock_on_unavailable="run")
def work_unguarded(self: Any, key: str, duration: float = 0.0) -> str:
    """Like ``work``, but runs unguarded (with a warning) when no quorum of lock nodes answers."""
    _run(self, key, duration)
    return key


@app.task(shared=False, base=LockedTask, bind=True, lock_unique_on=["key"], lock_on_duplicate="reschedule")
def work_later(self: Any, key: str, duration: float = 0.0) -> str:
    """Like ``work``, but a duplicate is rescheduled to run after the holder instead of skipped."""
    _run(self, key, duration)
    return key


@app.task(shared=False, base=LockedTask, bind=True, lock_unique_on=["key"])
def watch_lock(self: Any, key: str, duration: float) -> dict[str, Any]:
    """Poll ``self.lock_held()`` for up to ``duration`` s; report when it turned False and what check_lock said."""
    record.rpush("started", json.dumps([key, self.request.id, os.getpid(), time.time()]))
    lost_at, error = None, None
    end_by = time.monotonic() + duration
    for _ in range(int(duration / 0.02) + 1):  # bounded by count and by duration
        if time.monotonic() >= end_by:
            break
        if not self.lock_held():
            lost_at = time.time()
            try:
                self.check_lock()
            except Exception as exc:  # report whatever it raised
                error = f"{type(exc).__name__}: {exc}"
            break
        time.sleep(0.02)
    return {"lost_at": lost_at, "error": error}


def _until_lost(task: Any, key: str, after: float) -> dict[str, Any]:
    """Sleep in short steps until the lock is lost (20 s at most), then ``after`` s more; record a LockLostError
    that reaches the body, and the end marker when the body reaches its end."""
    record.rpush("started", json.dumps([key, task.request.id, os.getpid(), time.time()]))
    try:
        for _ in range(400):  # bounded: 20 s
            if not task.lock_held():
                break
            time.sleep(0.05)
        end_by = time.monotonic() + after
        for _ in range(int(after / 0.05) + 2):  # bounded by count and by ``after``
            if time.monotonic() >= end_by:
                break
            time.sleep(0.05)
    except LockLostError as exc:
        record.rpush("interrupted", json.dumps([key, task.request.id, str(exc)]))
        raise
    record.rpush("ended", json.dumps([key, task.request.id]))
    return {"held": task.lock_held()}


@app.task(shared=False, base=LockedTask, bind=True, lock_unique_on=["key"], lock_ttl=1.5, lock_on_lost="interrupt")
def interruptible(self: Any, key: str, after: float = 10.0) -> dict[str, Any]:
    """lock_on_lost="interrupt" with a short ttl (renewed every 0.5 s): a loss is raised inside the sleep loop."""
    return _until_lost(self, key, after)


#: Seconds a ``blocked`` body blocks in one system call when nothing interrupts it (its socket read is ended then
#: by a timer): far past tests/task/test_lock_on_lost.py's WAIT, so an interrupt that waits for the call to return is
#: seen as none.
BLOCK = 120.0


@app.task(shared=False, base=LockedTask, bind=True, lock_unique_on=["key"], lock_ttl=1.5, lock_on_lost="interrupt")
def blocked(self: Any, key: str, how: str) -> None:
    """lock_on_lost="interrupt" on a body blocked in one long system call: a sleep, or a read on a socket (no timeout)
    that no data reaches (a timer sends a byte after BLOCK s: bounded)."""
    record.rpush("started", json.dumps([key, self.request.id, os.getpid(), time.time()]))
    try:
        if how == "sleep":
            time.sleep(BLOCK)
        else:
            a, b = socket.socketpair()
            timer = threading.Timer(BLOCK, b.send, (b"x",))
            timer.daemon = True
            timer.start()
            with a, b:
                try:
                    a.recv(1)
                finally:
                    timer.cancel()
    except LockLostError as exc:
        record.rpush("interrupted", json.dumps([key, self.request.id, str(exc)]))
        raise
    record.rpush("ended", json.dumps([key, self.request.id]))


@app.task(shared=False, base=LockedTask, bind=True, lock_unique_on=["key"], lock_ttl=1.5)
def uninterrupted(self: Any, key: str, after: float = 1.0) -> dict[str, Any]:
    """The default lock_on_lost ("continue"): the body runs to its end after a loss; it reports lock_held()."""
    return _until_lost(self, key, after)


@app.task(
    shared=False, base=LockedTask, bind=True, soft_time_limit=1.0, time_limit=2.0, lock_ttl=6.15, lock_unique_on=["key"]
)
def stubborn(self: Any, key: str, duration: float) -> None:
    """Ignore SIGTERM and the soft time limit: only the hard time limit's SIGKILL ends this run.

    The renewal interval (6.15 / 3 = 2.05 s) ends just after the 2 s hard limit, so the watchdog renews the lease
    between the parent's after_return (which ends the lease) and the SIGKILL that follows it 0.1 s later.
    """
    from celery.exceptions import SoftTimeLimitExceeded  # noqa: PLC0415

    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the pool child is killed after this task anyway
    record.rpush("started", json.dumps([key, self.request.id, os.getpid(), time.time()]))
    end_by = time.monotonic() + duration
    for _ in range(int(duration / 0.05) + 2):  # bounded by count and by duration
        if time.monotonic() >= end_by:
            break
        try:
            time.sleep(0.05)
        except SoftTimeLimitExceeded:
            continue


@app.task(shared=False)
def collect(results: list[Any]) -> list[Any]:
    """A chord callback: return the header's results."""
    return results


class Opaque:
    """A value the app taught kombu's JSON serializer to carry (below), which the lock key cannot encode."""

    def __init__(self, value: str) -> None:
        self.value = value


register_type(Opaque, "csl_opaque", lambda o: o.value, Opaque)


@app.task(shared=False, base=LockedTask, bind=True)
def take_opaque(self: Any, key: str, thing: Opaque) -> str:
    """Keyed on every argument, an Opaque one included."""
    _run(self, key, 0.0)
    return key


@app.task(shared=False, base=LockedTask, bind=True, lock_unique_on=["key"], lock_enqueue_check=True)
def enq_work(self: Any, key: str, duration: float = 0.0) -> str:
    """Like work, but a call sent while its job runs returns the running job's result handle."""
    _run(self, key, duration)
    return key


@app.task(shared=False, base=LockedTask, bind=True, max_retries=0, lock_unique_on=["key"])
def give_up(self: Any, key: str) -> str:
    """The common body that retries and gives up at once (max_retries=0): it ends in SUCCESS, "gave up"."""
    _run(self, key, 0.05)
    try:
        raise self.retry(countdown=5)
    except self.MaxRetriesExceededError:
        return "gave up"


@app.task(shared=False, base=LockedTask, bind=True, lock_unique_on=["key"])
def no_throw(self: Any, key: str, rest: float) -> int:
    """retry(throw=False) on the first attempt, then go on for ``rest`` seconds: the retry must not run meanwhile."""
    if self.request.retries == 0:
        self.retry(countdown=0, throw=False)
        _run(self, key, rest)
        return 0
    _run(self, key, 0.05)
    return self.request.retries


@app.task(shared=False, base=LockedTask, bind=True, lock_unique_on=["key"], max_retries=None)
def poll_no_throw(self: Any, key: str, until: int, rest: float) -> int:
    """Poll with retry(throw=False): every attempt but the last sends its retry and goes on for ``rest`` s."""
    _run(self, key, 0.01)
    if self.request.retries < until:
        self.retry(countdown=0, throw=False)
        _run(self, key, rest)
    return self.request.retries


class _Section:
    """A critical section whose exit takes a while (a transaction's rollback, a flush): recorded as one run."""

    def __init__(self, task: Any, key: str) -> None:
        self.task, self.key = task, key

    def __enter__(self) -> None:
        self.start = time.time()

    def __exit__(self, *exc: object) -> None:
        time.sleep(0.5)
        record.rpush("runs", json.dumps([self.key, self.task.request.id, os.getpid(), self.start, time.time()]))


@app.task(shared=False, base=LockedTask, bind=True, lock_unique_on=["key"], max_retries=1)
def retry_in_section(self: Any, key: str) -> int:
    """raise self.retry() inside a with-block whose exit takes 0.5 s: the retry must not enter before it ends."""
    with _Section(self, key):
        if self.request.retries == 0:
            raise self.retry(countdown=0)
    return self.request.retries


@app.task(shared=False, base=LockedTask, bind=True, lock_unique_on=["key"], max_retries=1)
def header_probe(self: Any, key: str) -> list[Any]:
    """Retry once; the retry reports which of our lock headers it inherited."""
    if self.request.retries == 0:
        raise self.retry(countdown=0)
    return [self.request.get("singleton_lock_attempt"), self.request.get("singleton_lock_waited")]


@app.task(shared=False, base=LockedTask, bind=True, lock_unique_on=["key"], lock_on_duplicate="reschedule")
def deaths_seen(self: Any, key: str, duration: float) -> int:
    """Like ``work_later``; returns how many dead-letterings RabbitMQ recorded in this delivery's x-death header."""
    _run(self, key, duration)
    deaths = (self.request.headers or {}).get("x-death") or []
    return sum(int(d.get("count", 1)) for d in deaths)


@app.task(shared=False, base=LockedTask, bind=True, lock_unique_on=["key"], lock_scope="queue")
def q_work(self: Any, key: str, duration: float = 0.0, note: Any = None) -> str:
    """Queue scope: reserved at delay() until it runs."""
    _run(self, key, duration)
    return key


@app.task(shared=False, base=LockedTask, bind=True, lock_unique_on=["key"], lock_scope="queue")
def q_next_async(self: Any, key: str, next_id: str | None = None) -> str | None:
    """Queue scope: a run that sends its key's next run from an event loop in its body (``aapply_async`` with its
    own task id and a countdown); returns the id the call returned."""
    _run(self, key, 0.0)
    if next_id is None:
        return None

    async def send_next() -> str:
        try:
            return str((await self.aapply_async((key,), task_id=next_id, countdown=0.3)).id)
        finally:
            await aio.aclose()

    return asyncio.run(send_next())


@app.task(shared=False, base=LockedTask, bind=True, lock_unique_on=["key"])
def child_of(self: Any, key: str) -> None:
    """Records (key, id, parent id) as q_child does."""
    record.rpush("children", json.dumps([key, self.request.id, self.request.parent_id]))


@app.task(shared=False, base=LockedTask, bind=True, lock_unique_on=["key"], lock_scope="queue")
def q_child(self: Any, key: str, how: str = "") -> str | None:
    """Queue scope: records (key, id, parent id); with ``how`` ("sync" or "async": ``apply_async``, or
    ``aapply_async`` from an event loop in the body) sends its key's next run (own task id, a countdown)."""
    record.rpush("children", json.dumps([key, self.request.id, self.request.parent_id]))
    if not how:
        return None
    next_id = f"{self.request.id}-next"
    if how == "other":  # another task's job, sent from an event loop in this body

        async def send_other() -> str:
            try:
                return str((await child_of.aapply_async((key,), task_id=next_id)).id)
            finally:
                await aio.aclose()

        return asyncio.run(send_other())
    if how == "sync":
        return str(self.apply_async((key,), task_id=next_id, countdown=0.3).id)

    async def send_next() -> str:
        try:
            return str((await self.aapply_async((key,), task_id=next_id, countdown=0.3)).id)
        finally:
            await aio.aclose()

    return asyncio.run(send_next())


@app.task(
    shared=False, base=LockedTask, bind=True, lock_unique_on=["key"], lock_scope="queue", lock_on_duplicate="fail"
)
def q_fail(self: Any, key: str, duration: float = 0.0) -> str:
    """Queue scope; a duplicate delay() raises DuplicateTaskError."""
    _run(self, key, duration)
    return key


@app.task(shared=False, base=LockedTask, bind=True, lock_unique_on=["key"], lock_scope="queue", max_retries=3)
def q_flaky(self: Any, key: str, failures: int, countdown: float) -> int:
    """Queue scope; retry ``failures`` times with ``countdown``, then succeed."""
    _run(self, key, 0.1)
    if self.request.retries < failures:
        raise self.retry(countdown=countdown)
    return self.request.retries


@app.task(shared=False, base=LockedTask, bind=True, lock_unique_on=["key"], lock_scope="queue", lock_cooldown=4.0)
def q_charge(self: Any, key: str) -> str:
    """Queue scope with a cooldown: a second click within 4 s of the charge gets the charge's result."""
    _run(self, key, 0.3)
    return f"charged {key} as {self.request.id}"


@app.task(shared=False, base=LockedTask, bind=True, lock_unique_on=["key"], lock_cooldown=60.0)
def cooled(self: Any, key: str) -> str:
    """One run per ``key`` a minute: the lock stays in its cooldown for 60 s after the run (the page explains it)."""
    _run(self, key, 0.0)
    return key


@app.task(shared=False, base=LockedTask, bind=True, lock_unique_on=["key"], lock_on_duplicate="replace")
def latest(self: Any, key: str, value: str, duration: float = 0.0) -> str:
    """Keep-latest: while one runs, the newest waiting call replaces the one before it."""
    _run(self, key, duration)
    return value


@app.task(
    shared=False, base=LockedTask, bind=True, lock_limit=3, lock_on_duplicate="reschedule", lock_unique_on=["key"]
)
def limited(self: Any, key: str, duration: float = 0.0) -> str:
    """At most 3 runs of ``key`` at once; one that finds 3 running waits in line (lock_limit=3, reschedule)."""
    _run(self, key, duration)
    return key


@app.task(
    shared=False,
    base=LockedTask,
    bind=True,
    lock_limit=2,
    lock_on_duplicate="reschedule",
    lock_max_waiting=1,
    lock_unique_on=["key"],
)
def capped_limited(self: Any, key: str, duration: float = 0.0) -> str:
    """At most 2 runs of ``key`` at once, at most 1 call waiting for a slot; another is skipped at once."""
    _run(self, key, duration)
    return key


@app.task(shared=False, base=LockedTask, bind=True, lock_limit=2, lock_unique_on=["key"])
def limited_skip(self: Any, key: str, duration: float = 0.0) -> str:
    """At most 2 runs of ``key`` at once; a third is skipped (lock_limit=2, skip)."""
    _run(self, key, duration)
    return key


# -- one job however many messages of it exist (tests/task/test_copies.py) ---------------------------------------------


@app.task(shared=False, base=LockedTask, bind=True, lock_unique_on=["key"], lock_on_duplicate="reschedule")
def later_or_fail(self: Any, key: str, duration: float = 0.0, fail: bool = False) -> str:
    """Reschedule; records its run, then fails when ``fail`` (a waiting call whose run fails)."""
    _run(self, key, duration)
    if fail:
        raise RuntimeError("failing on purpose")
    return key


@app.task(shared=False, base=LockedTask, bind=True, lock_unique_on=["key"], lock_on_duplicate="replace")
def latest_or_fail(self: Any, key: str, value: str, duration: float = 0.0, fail: bool = False) -> str:
    """Replace; records its run, then fails when ``fail``."""
    _run(self, key, duration)
    if fail:
        raise RuntimeError("failing on purpose")
    return value


@app.task(shared=False, base=LockedTask, bind=True, lock_unique_on=["key"], lock_on_duplicate="replace", lock_ttl=9.0)
def latest_slow(self: Any, key: str, value: str, duration: float = 0.0) -> str:
    """Replace with a 9 s ttl: a delivery re-sent for a "sending" holder comes back a renewal interval (3 s) later."""
    _run(self, key, duration)
    return value


_HANDLED = {
    "locked_app.later_or_fail",
    "locked_app.latest_or_fail",
    "locked_app.latest_slow",
    "locked_app.q_work",
    "locked_app.debounced",
}


@task_postrun.connect
def _record_handled(task_id: str = "", task: Any = None, **_: Any) -> None:
    """Every delivery of the tasks above, run or not (a skipped copy too): tests wait for a copy to be handled."""
    if task is not None and task.name in _HANDLED:
        record.rpush("handled", task_id)


@app.task(shared=False, bind=True)
def gate(self: Any, name: str, timeout: float = 60.0) -> bool:
    """A plain task that keeps its pool process busy until the test opens ``gate:<name>`` (or ``timeout`` s)."""
    end_by = time.monotonic() + timeout
    record.rpush("gated", name)
    while time.monotonic() < end_by:  # bounded by timeout
        if record.get(f"gate:{name}"):
            return True
        time.sleep(0.05)
    return False


@app.task(shared=False, base=LockedTask, bind=True, lock_unique_on=["key"], lock_ttl=15.0)
def work_long_lease(self: Any, key: str, duration: float = 0.0) -> str:
    """Like ``work`` with a 15 s lease: a killed run's lease outlives any broker's redelivery on a busy machine."""
    _run(self, key, duration)
    return key


@app.task(
    shared=False, base=LockedTask, bind=True, lock_unique_on=["key"], lock_on_duplicate="reschedule", lock_max_waiting=2
)
def capped(self: Any, key: str, duration: float = 0.0) -> str:
    """Like ``work_later``, but at most 2 duplicates wait in the key's line; a third is skipped at once."""
    _run(self, key, duration)
    return key


@app.task(shared=False, base=LockedTask, bind=True, lock_unique_on=["key"], lock_debounce=1)
def debounced(self: Any, key: str, version: int = 0, duration: float = 0.0) -> list[Any]:
    """A burst of calls of one key runs once, 1 s after its last call, with its last call's ``version``."""
    record.rpush("debounced", json.dumps([key, self.request.id, version]))
    _run(self, key, duration)
    return [key, version]


@app.task(shared=False, base=LockedTask, bind=True, lock_unique_on=["key"], lock_debounce=1, lock_debounce_max=2)
def debounced_max(self: Any, key: str, version: int = 0, duration: float = 0.0) -> list[Any]:
    """Like ``debounced``, but a steady stream of calls still runs at least every 2 s."""
    record.rpush("debounced", json.dumps([key, self.request.id, version]))
    _run(self, key, duration)
    return [key, version]


@app.task(shared=False, base=LockedTask, bind=True, lock_unique_on=["key"], lock_debounce=1, lock_queue_ttl=1)
def debounced_short_queue_ttl(self: Any, key: str, version: int = 0) -> list[Any]:
    """``debounced`` with ``lock_queue_ttl=1``: the burst must still outlive a message held up to the done window."""
    record.rpush("debounced", json.dumps([key, self.request.id, version]))
    return [key, version]


@app.task(
    shared=False,
    base=LockedTask,
    bind=True,
    lock_unique_on=["key"],
    lock_debounce=0.5,
    lock_rate=(1, 3.0),
    lock_rate_on=["key"],
    lock_on_rate_limit="skip",
)
def debounced_rated(self: Any, key: str, version: int = 0) -> list[Any]:
    """``debounced`` with one start per 3 s per key (the rate); a burst due while the window is full is skipped."""
    record.rpush("debounced", json.dumps([key, self.request.id, version]))
    return [key, version]


@app.task(shared=False, base=LockedTask, bind=True, lock_unique_on=["key"], lock_debounce=1, lock_on_unavailable="fail")
def debounced_failing(self: Any, key: str, version: int = 0) -> list[Any]:
    """``debounced`` that fails at once when its lock has no quorum of nodes (lock_on_unavailable='fail')."""
    record.rpush("debounced", json.dumps([key, self.request.id, version]))
    return [key, version]


@app.task(shared=False, base=LockedTask, bind=True, lock_unique_on=["key"], lock_debounce=1, max_retries=2)
def debounced_retrying(self: Any, key: str, version: int = 0) -> list[Any]:
    """``debounced`` whose first try retries (countdown 0.5 s): the retry runs with the burst's last arguments."""
    record.rpush("debounced", json.dumps([key, self.request.id, version, self.request.retries]))
    if self.request.retries == 0:
        raise self.retry(countdown=0.5)
    return [key, version]


@app.task(
    shared=False,
    base=LockedTask,
    bind=True,
    lock_unique_on=["key"],
    lock_scope="queue",
    lock_rate=(1, 3.0),
    lock_rate_on=["key"],
)
def q_rated(self: Any, key: str, duration: float = 0.0) -> str:
    """Queue scope and 1 start per 3 s per ``key``: a job waiting for its window stays the key's job."""
    _run(self, key, duration)
    return key


def _dialed_limit(key: str, duration: float = 0.0) -> int:
    """The limit the test dials for ``key`` (record key ``limit:<key>``), 1 when none."""
    return int(record.get(f"limit:{key}") or 1)


@app.task(shared=False, base=LockedTask, bind=True, lock_limit=_dialed_limit, lock_unique_on=["key"], lock_ttl=2.0)
def dialed(self: Any, key: str, duration: float = 0.0) -> str:
    """At most ``_dialed_limit(key)`` runs of ``key`` at once (a callable limit the test changes while runs hold)."""
    _run(self, key, duration)
    return key


@app.task(shared=False, base=LockedTask, bind=True, lock_unique_on=["key"], lock_rate=(2, 60.0), lock_rate_on=["key"])
def rated_work(self: Any, key: str) -> str:
    """At most two starts per key in any minute (``celery locks explain`` reads its windows)."""
    _run(self, key, 0.0)
    return key


# A store that checks fencing tokens (what examples/rebuild_newest_wins.py shows): a write whose token is older than
# the newest one it has seen is refused.
FENCED_SET = """
local seen = tonumber(redis.call('HGET', KEYS[1], 'token') or '0')
if tonumber(ARGV[1]) < seen then return 0 end
redis.call('HSET', KEYS[1], 'token', ARGV[1], 'value', ARGV[2])
return 1
"""


def _cancellable(task: Any, key: str, n: int, duration: float, stubborn: bool) -> int:
    """Sleep ``duration`` s in short steps, then write ``n`` to a fenced store; record the span as
    ``[key, task id, pid, start, end, n, fencing token, how it ended]`` under "spans"."""
    from celery_singleton_lock import JobCancelledError  # noqa: PLC0415

    start = time.time()
    record.rpush("started", json.dumps([key, task.request.id, os.getpid(), start]))
    token = task.fencing_token or 0
    how = "ran"
    end_by = time.monotonic() + duration
    for _ in range(int(duration / 0.02) + 2):  # bounded by count and by duration
        if time.monotonic() >= end_by:
            break
        try:
            time.sleep(0.02)
        except JobCancelledError:
            if not stubborn:
                record.rpush(
                    "spans", json.dumps([key, task.request.id, os.getpid(), start, time.time(), n, token, "cancelled"])
                )
                raise
            how = "ignored the stop"  # a body that swallows it goes on, past its lease's end
    wrote = record.eval(FENCED_SET, 1, f"store:{key}", token, n)
    record.rpush("spans", json.dumps([key, task.request.id, os.getpid(), start, time.time(), n, token, how, wrote]))
    return n


@app.task(shared=False, base=LockedTask, bind=True, lock_unique_on=["key"], lock_on_duplicate="cancel", lock_ttl=1.5)
def rebuild(self: Any, key: str, n: int, duration: float = 0.0) -> int:
    """Newest wins while it runs: a newer call of ``key`` stops this one (renewed every 0.5 s), then runs."""
    return _cancellable(self, key, n, duration, stubborn=False)


@app.task(shared=False, base=LockedTask, bind=True, lock_unique_on=["key"], lock_on_duplicate="cancel", lock_ttl=1.5)
def rebuild_stubborn(self: Any, key: str, n: int, duration: float = 0.0) -> int:
    """Like rebuild, but the body swallows the stop and goes on: its successor runs at its lease's end."""
    return _cancellable(self, key, n, duration, stubborn=True)


@app.task(shared=False, base=LockedTask, bind=True, lock_unique_on=["key"], lock_on_duplicate="cancel", lock_ttl=9.0)
def rebuild_slow(self: Any, key: str, n: int, duration: float = 0.0) -> int:
    """Like rebuild, renewed every 3 s: a newer call's request is seen up to 3 s after it is made (a body may end by
    itself first), a waiting call's fallback copy comes ~9 s later, a handed lock lasts 30 s."""
    return _cancellable(self, key, n, duration, stubborn=False)


@app.task(
    shared=False,
    base=LockedTask,
    bind=True,
    lock_unique_on=["key"],
    lock_on_duplicate="cancel",
    lock_ttl=9.0,
    lock_cooldown=3.0,
)
def rebuild_cool(self: Any, key: str, n: int, duration: float = 0.0) -> int:
    """rebuild_slow with a 3 s cooldown after a success: a call waiting through it, and a newer one after it."""
    return _cancellable(self, key, n, duration, stubborn=False)


@app.task(shared=False, base=LockedTask, bind=True, lock_unique_on=["key"], lock_ttl=1.5)
def build(self: Any, key: str, n: int, duration: float = 0.0) -> int:
    """A plain LockedTask (skip): cancelled durably by ``build.cancel`` / ``locks cancel`` (records its span)."""
    return _cancellable(self, key, n, duration, stubborn=False)


def _retrying(task: Any, key: str, n: int, duration: float) -> int:
    from celery_singleton_lock import JobCancelledError  # noqa: PLC0415

    try:
        return _cancellable(task, key, n, duration, stubborn=False)
    except JobCancelledError:
        raise task.retry(countdown=0.3) from None


@app.task(shared=False, base=LockedTask, bind=True, lock_unique_on=["key"], lock_ttl=1.5, max_retries=2)
def build_retrying(self: Any, key: str, n: int, duration: float = 0.0) -> int:
    """A plain LockedTask whose body answers the stop with self.retry: a cancelled job must not come back."""
    return _retrying(self, key, n, duration)


@app.task(
    shared=False,
    base=LockedTask,
    bind=True,
    lock_unique_on=["key"],
    lock_on_duplicate="cancel",
    lock_ttl=1.5,
    max_retries=2,
)
def rebuild_retrying(self: Any, key: str, n: int, duration: float = 0.0) -> int:
    """rebuild whose body answers the stop with self.retry: the newer call still runs once, never beside it."""
    return _retrying(self, key, n, duration)


@app.task(
    shared=False,
    base=LockedTask,
    bind=True,
    lock_unique_on=["key"],
    lock_on_duplicate="cancel",
    lock_ttl=1.5,
    max_retries=1,
)
def rebuild_retry_first(self: Any, key: str, n: int, countdown: float = 2.0) -> int:
    """rebuild whose first try retries (``countdown`` s, the hand-over holding the key), then runs for 0.3 s."""
    if self.request.retries == 0 and countdown:
        record.rpush("started", json.dumps([key, self.request.id, os.getpid(), time.time()]))
        raise self.retry(countdown=countdown)
    return _cancellable(self, key, n, 0.3, stubborn=False)


@app.task(
    shared=False,
    base=LockedTask,
    bind=True,
    lock_unique_on=["key"],
    lock_fair_on=["tenant"],
    lock_limit=2,
    lock_on_duplicate="reschedule",
)
def fair_call(self: Any, key: str, tenant: str, item: int, duration: float = 0.0) -> int:
    """A call of ``tenant`` sharing ``key``'s two slots with other tenants (lock_fair_on,
    tests/policies/test_fair.py): records
    ``[key, tenant, item, task id, when its call first reached a worker (ms; None: this first delivery), start,
    [start number, turns waited, own calls ahead] as the line's node counted them (None: uncounted)]`` in start
    order, then runs for ``duration`` s."""
    arrived = getattr(self.request, "singleton_lock_since", None)
    record.rpush("fair", json.dumps([key, tenant, item, self.request.id, arrived, time.time(), _turn(self)]))
    _run(self, key, duration)
    return item


def _turn(task: Any) -> list[int] | None:
    """The call's start number, turns waited and own value's calls ahead, as the line's node counted them."""
    turn = (task.request._singleton_lock.state or {}).get("fair")
    return None if turn is None else [turn.start, turn.waited, turn.ahead]


@app.task(
    shared=False,
    base=LockedTask,
    bind=True,
    lock_unique_on=["key"],
    lock_fair_on=["tenant"],
    lock_limit=2,
    lock_max_waiting=2,
    lock_on_duplicate="reschedule",
)
def fair_capped(self: Any, key: str, tenant: str, item: int, duration: float = 0.0) -> int:
    """fair_call with ``lock_max_waiting=2``: records as fair_call."""
    arrived = getattr(self.request, "singleton_lock_since", None)
    record.rpush("fair", json.dumps([key, tenant, item, self.request.id, arrived, time.time(), _turn(self)]))
    _run(self, key, duration)
    return item


def fair_limit(key: str, *args: Any, **kwargs: Any) -> int:
    """A ``lock_limit`` the test dials mid-flood (record key ``fair-limit:<key>``, 2 when unset)."""
    return int(record.get(f"fair-limit:{key}") or 2)


def _fair_group_body(self: Any, key: str, tenant: str, item: int, duration: float, retry: bool) -> int:
    arrived = getattr(self.request, "singleton_lock_since", None)
    record.rpush("fair", json.dumps([key, tenant, item, self.request.id, arrived, time.time(), _turn(self), self.name]))
    _run(self, key, duration)
    if retry and not self.request.retries:
        raise self.retry(countdown=0.1, max_retries=1)
    return item


_FAIR_GROUP: dict[str, Any] = {
    "shared": False, "base": LockedTask, "bind": True, "lock_group": "fairg", "lock_unique_on": ["key"],
    "lock_fair_on": ["tenant"], "lock_limit": fair_limit, "lock_on_duplicate": "reschedule",
}  # fmt: skip


@app.task(**_FAIR_GROUP)
def fair_group_a(self: Any, key: str, tenant: str, item: int, duration: float = 0.0, retry: bool = False) -> int:
    """fair_call's group twin (``lock_group="fairg"`` with ``fair_group_b``, a limit dialed mid-flood by
    ``fair_limit``, and a body that retries itself once when ``retry``): records as fair_call, plus its task name."""
    return _fair_group_body(self, key, tenant, item, duration, retry)


@app.task(**_FAIR_GROUP)
def fair_group_b(self: Any, key: str, tenant: str, item: int, duration: float = 0.0, retry: bool = False) -> int:
    """The other task of fair_group_a's group."""
    return _fair_group_body(self, key, tenant, item, duration, retry)


@app.task(
    shared=False, base=LockedTask, bind=True, lock_unique_on=["key"], lock_limit=2, lock_on_duplicate="reschedule"
)
def arrival_call(self: Any, key: str, tenant: str, item: int, duration: float = 0.0) -> int:
    """fair_call without lock_fair_on: the line wakes calls in arrival order (benchmarks/bench_fair.py's "before")."""
    arrived = getattr(self.request, "singleton_lock_since", None)
    record.rpush("fair", json.dumps([key, tenant, item, self.request.id, arrived, time.time()]))
    _run(self, key, duration)
    return item
