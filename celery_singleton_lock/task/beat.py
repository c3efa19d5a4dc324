"""Several ``celery beat`` instances side by side: each due run of each entry is sent exactly once across them.

Every instance keeps ticking on its own (its own schedule file, its own clock). When an entry is due, the instance
first *claims the run* with ``SET NX`` (a Redlock over ``singleton_lock_urls``) on a key naming the entry and the
run's slot, and sends only if the claim is its own::

    celery -A app beat -S celery_singleton_lock.beat.SingletonScheduler --schedule /var/run/beat-a
    celery -A app beat -S singleton --schedule /var/run/beat-b   # same class, by its entry-point name

The slot is derived from the *schedule*, never from an instance's own ``last_run_at`` or raw clock reading, so all
instances name the same run alike (see :func:`slot_for`):

* an interval (``schedule``, a number of seconds): ``floor(now / run_every)``, slots aligned to the Unix epoch;
* a crontab, solar or any other schedule with ``remaining_estimate``: the latest scheduled time ``<= now``, whatever
  the instance's ``last_run_at``; a wall-clock time that a DST fall-back shows twice is one run, at its first pass.

Instances that claim a run together can split the lock nodes' votes so that none has a quorum: the claim is then
retried after a jittered pause, for a bounded time. A claim is never released: it expires after :func:`claim_ttl`
seconds, once no instance can be due for that slot any more. See ``docs/beat.md`` for the reasoning, the DST
rules, django-celery-beat and RedBeat.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import logging
import os
import random
import secrets
import socket
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, ClassVar, Final, cast

from celery.beat import PersistentScheduler
from celery.schedules import crontab
from celery.schedules import schedule as interval_schedule
from celery.utils.time import maybe_make_aware
from celery.utils.time import timezone as celery_timezone

from ..lock._heartbeat import write_heartbeat
from ..lock.config import LockSettings, settings_for
from ..lock.redlock import Redlock
from ._reach import warn_unreachable
from ._startup import StartError, check_start

__all__ = [
    "MIN_CLAIM_TTL",
    "SLOT_HEADER",
    "SingletonScheduler",
    "SingletonSchedulerMixin",
    "Slot",
    "claim_ttl",
    "slot_for",
]

logger = logging.getLogger("celery_singleton_lock.beat")

#: Message header carrying the run's slot label (``self.request.get(SLOT_HEADER)`` in the task).
SLOT_HEADER: Final = "singleton_lock_beat_slot"
#: A claim lives at least this long (s): clock skew and a late tick must not outlast a one-second slot.
MIN_CLAIM_TTL: Final = 60.0
#: ... at most one more period past its slot, and that margin at most a day ...
MAX_CLAIM_MARGIN: Final = 86_400.0
#: ... and never more than this (s), whatever a broken schedule says its period is.
MAX_CLAIM_TTL: Final = 400 * 86_400.0

_UTC: Final = dt.timezone.utc
_EPOCH: Final = dt.datetime(1970, 1, 1, tzinfo=_UTC)
_MS: Final = dt.timedelta(milliseconds=1)
# How far back a schedule's latest due time is searched (a Feb 29 crontab fires every 4 years).
_LOOKBACK: Final = dt.timedelta(days=1830)
# A forward walk checking the latest run steps over at most this many runs (a broken schedule raises instead).
_MAX_WALK: Final = 1000
# The period assumed when a schedule has no next run after this one (a one-off, e.g. django-celery-beat's clocked).
_ONE_OFF_PERIOD: Final = 86_400.0
_HOST: Final = socket.gethostname()
_Runs = tuple[dt.datetime, dt.datetime]
# A split vote is retried after a jittered pause, from 5-10 ms growing to 5-80 ms: two contenders then rarely
# arrive together again, even with a few ms between beat and the lock nodes ...
_SPLIT_PAUSE: Final = 0.005
# ... for at most this long (s) per run, and at most this share of the entry's period: beat ticks on one thread,
# so the other due entries wait meanwhile.
_SPLIT_BUDGET: Final = 2.0
_SPLIT_SHARE: Final = 0.1


@dataclass(frozen=True)
class Slot:
    """One scheduled run of an entry, named alike on every beat instance.

    >>> slot = Slot(dt.datetime(2026, 11, 22, 12, 5, tzinfo=dt.timezone.utc), 60.0)
    >>> slot.label, slot.iso
    ('1795349100', '2026-11-22T12:05:00Z')
    """

    due: dt.datetime  #: the run's scheduled time (crontab) or its interval slot's start, in UTC
    period: float  #: seconds to the entry's next slot (sizes the claim's ttl)

    @property
    def label(self) -> str:
        """The slot in the claim key and the message header: Unix seconds, with milliseconds only when not zero."""
        ms = (self.due - _EPOCH) // _MS
        return str(ms // 1000) if ms % 1000 == 0 else f"{ms // 1000}.{ms % 1000:03d}"

    @property
    def iso(self) -> str:
        """The slot for people (logs): ISO 8601 UTC."""
        text = self.due.astimezone(_UTC).strftime("%Y-%m-%dT%H:%M:%S")
        ms = self.due.microsecond // 1000
        return f"{text}.{ms:03d}Z" if ms else f"{text}Z"


def _utc(schedule: Any, when: dt.datetime) -> dt.datetime:
    aware = schedule.maybe_make_aware(when) if hasattr(schedule, "maybe_make_aware") else maybe_make_aware(when)
    return cast(dt.datetime, aware.astimezone(_UTC))


@contextlib.contextmanager
def _frozen_clock(schedule: Any, now: dt.datetime) -> Iterator[None]:
    """Make ``schedule.now()`` return ``now`` for a while, so ``now + remaining_estimate(t)`` is exact.

    Celery's schedules read their clock through ``nowfun`` (django-celery-beat's TzAwareCrontab too). Swapping the
    attribute, not copying the schedule, keeps its app and so its timezone. Beat ticks on one thread.
    """
    if not hasattr(schedule, "nowfun"):
        yield
        return
    saved = schedule.nowfun
    schedule.nowfun = lambda: now
    try:
        yield
    finally:
        schedule.nowfun = saved


def slot_for(schedule: Any, last_run_at: dt.datetime | None, now: dt.datetime | None = None) -> Slot:
    """The slot of the run of ``schedule`` that is due at ``now`` (default: the schedule's own clock).

    Instances whose clocks differ by less than the gap between two runs, and whose ``last_run_at`` differ (each
    advances its own, one may have been down for hours), compute the same slot:

    >>> from celery import Celery
    >>> from celery.schedules import crontab
    >>> every_5_min = crontab(minute="*/5", app=Celery(set_as_current=False))
    >>> utc = dt.timezone.utc
    >>> slot_for(every_5_min, dt.datetime(2026, 11, 22, 12, 0, 0, 400_000, tzinfo=utc),
    ...          now=dt.datetime(2026, 11, 22, 12, 5, 0, 300_000, tzinfo=utc)).iso
    '2026-11-22T12:05:00Z'
    >>> slot_for(every_5_min, dt.datetime(2026, 11, 20, 7, 0, tzinfo=utc),  # a stale schedule file
    ...          now=dt.datetime(2026, 11, 22, 12, 7, 12, tzinfo=utc)).iso
    '2026-11-22T12:05:00Z'
    """
    now_utc = _utc(schedule, schedule.now() if now is None else now)
    if isinstance(schedule, interval_schedule):
        return _interval_slot(schedule, now_utc)
    return _calendar_slot(schedule, last_run_at, now_utc)


def _interval_slot(schedule: Any, now: dt.datetime) -> Slot:
    # Each instance's interval runs drift with its own start time and tick latency, so "last_run_at + run_every"
    # differs between instances: the run is named by the epoch-aligned slot it falls in instead. Integer
    # milliseconds, so every instance computes the very same number.
    period_ms = max(1, round(schedule.run_every.total_seconds() * 1000))
    now_ms = (now - _EPOCH) // _MS
    return Slot(_EPOCH + (now_ms // period_ms * period_ms) * _MS, period_ms / 1000)


def _wall_clock(schedule: Any) -> dt.tzinfo | None:
    """The timezone whose wall clock a crontab's fields are read in; None for other schedules (solar is UTC)."""
    if not isinstance(schedule, crontab):
        return None
    tz = schedule.tz  # what crontab.remaining_delta reads (django-celery-beat's TzAwareCrontab sets its own)
    return cast(dt.tzinfo, celery_timezone.get_timezone(tz) if isinstance(tz, str) else tz)


def _first_pass(tz: dt.tzinfo, t: dt.datetime) -> dt.datetime:
    """``t`` (UTC); or, if ``tz``'s clocks show ``t`` for the second time (the stretch a DST fall-back repeats),
    the last millisecond of that stretch's first pass.

    Celery's crontab reads a time on the second pass as if it were on the first: "the next run after 02:10" (the
    second 02:10 of a Berlin fall-back night) comes out as the first 02:30, an hour in the past. Asked from the end
    of the first pass instead, it answers the first run that is really ahead (03:00 or later). A wall-clock time
    therefore names one run, at its first pass, whatever time the question is asked from.

    >>> from zoneinfo import ZoneInfo
    >>> second_0210 = dt.datetime(2026, 10, 25, 1, 10, tzinfo=dt.timezone.utc)  # 02:10 CET, after 02:10 CEST
    >>> _first_pass(ZoneInfo("Europe/Berlin"), second_0210).isoformat(timespec="milliseconds")
    '2026-10-25T00:59:59.999+00:00'
    """
    local = t.astimezone(tz)
    if not local.fold:
        return t
    first, second = local.replace(fold=0).utcoffset(), local.utcoffset()
    if first is None or second is None or not first > second:
        return t
    lo, hi = t - (first - second), t  # invariant: lo on the first pass (the same wall time), hi on the second
    for _ in range(64):  # ~22 halvings to 1 ms over an hour's repeat
        if hi - lo <= _MS:
            break
        mid = lo + (hi - lo) / 2
        if mid.astimezone(tz).fold:
            hi = mid
        else:
            lo = mid
    # The stretch starts at a whole second (tzdata's transitions do): name the same millisecond on every call.
    return hi.replace(microsecond=0) - _MS


def _before_repeat(schedule: Any, when: dt.datetime) -> dt.datetime | None:
    """For a crontab, ``when`` moved to the end of the first pass if it is on the second pass of a repeated
    stretch (see :func:`_first_pass`), in UTC; None when it is not (or for any other schedule)."""
    tz = _wall_clock(schedule)
    if tz is None:
        return None
    t = _utc(schedule, when)
    moved = _first_pass(tz, t)
    return None if moved is t else moved


def _walk(next_after: Callable[[dt.datetime], dt.datetime], due: dt.datetime, now: dt.datetime) -> _Runs:
    """From a run ``due`` <= ``now``, step forward to the latest run <= ``now``; that run and the one after it."""
    for _ in range(_MAX_WALK):
        after = next_after(due)
        if not due < after <= now:
            return due, after
        due = after
    raise ValueError(f"more than {_MAX_WALK} runs between a run the search found and {now:%Y-%m-%dT%H:%M:%SZ}")


def _latest_run(next_after: Callable[[dt.datetime], dt.datetime], hint: dt.datetime | None, now: dt.datetime) -> _Runs:
    """The schedule's latest run at or before ``now``, and the run after it.

    With ``next_after(t)`` the first run after ``t``, it never decreases as ``t`` grows, and the latest run is
    ``next_after(t)`` for the last ``t`` where that is still ``<= now``. Usually the run after ``hint`` (this
    instance's ``last_run_at``) is already it: two calls. Otherwise (a stale schedule file, no file, a clock set
    back) bisect on ``t``, but only once its precondition is checked, and check the answer too: walk forward,
    a bounded number of runs, while the run after it is still ``<= now``. Every instance thus names the latest run,
    never an older one, whatever its ``last_run_at``.
    """
    floor = now - _LOOKBACK
    lo = floor
    if hint is not None and floor < hint < now:
        due = next_after(hint)
        if due <= now:
            after = next_after(due)
            if not due < after <= now:
                return due, after  # the run after the previous one is the latest: the usual case
            lo = due
    after_now = next_after(now)
    if not after_now > now:
        # No run after now, whatever it is asked: a one-off (django-celery-beat's clocked) names its own time.
        return _walk(next_after, after_now, now)
    if not next_after(lo) <= now:
        raise ValueError(f"no run in the {_LOOKBACK.days} days before {now:%Y-%m-%dT%H:%M:%SZ}")
    hi = now  # invariant: next_after(lo) <= now < next_after(hi)
    for _ in range(64):  # 1 ms resolution over _LOOKBACK takes ~37 halvings
        if hi - lo <= _MS:
            break
        mid = lo + (hi - lo) / 2
        if next_after(mid) <= now:
            lo = mid
        else:
            hi = mid
    return _walk(next_after, next_after(lo), now)  # the only run in (lo, hi]: runs are more than 1 ms apart


def _calendar_slot(schedule: Any, last_run_at: dt.datetime | None, now: dt.datetime) -> Slot:
    tz = _wall_clock(schedule)
    with _frozen_clock(schedule, now):

        def next_after(t: dt.datetime) -> dt.datetime:
            """The schedule's first run after ``t`` (crontab: strictly after ``t``'s minute; a wall-clock time the
            fall-back repeats is one run, at its first pass)."""
            asked = t if tz is None else _first_pass(tz, t)
            return now + cast(dt.timedelta, schedule.remaining_estimate(asked))

        hint = None if last_run_at is None else _utc(schedule, last_run_at)
        due, after = _latest_run(next_after, hint, now)
    period = (after - due).total_seconds()
    if not period > 0:  # a one-off (clocked) schedule has no next run
        period = _ONE_OFF_PERIOD
    # Whole seconds: crontab times are whole minutes anyway; solar times are computed numerically from each
    # instance's own start point and may differ in the last microseconds.
    due = (due + dt.timedelta(microseconds=500_000)).replace(microsecond=0)
    return Slot(due, period)


def claim_ttl(period: float) -> float:
    """Seconds a claim on a slot of an entry with this ``period`` lives.

    An instance is due for slot S only while its clock is in [S, next slot), give or take clock skew and a late
    tick: an instance restarted from a stale schedule file computes the *current* slot, not S. So the claim must
    outlive one period plus that slack; one more period (at most a day more) is ample, and at least 60 s covers
    skew and a slow tick for one-second slots. A longer claim costs nothing but one small key per entry per period
    (claims never renew); a shorter one would let a late instance send S a second time.

    >>> claim_ttl(1.0), claim_ttl(3600.0), claim_ttl(30 * 86400.0) / 86400
    (60.0, 7200.0, 31.0)
    """
    return min(max(MIN_CLAIM_TTL, period + min(period, MAX_CLAIM_MARGIN)), MAX_CLAIM_TTL)


def _split_budget(period: float) -> float:
    """Seconds an instance keeps retrying a split vote on a run of an entry with this ``period``.

    >>> _split_budget(1.0), _split_budget(5.0), _split_budget(300.0)
    (0.1, 0.5, 2.0)
    """
    return min(_SPLIT_BUDGET, _SPLIT_SHARE * period)


def _split_vote(lock: Redlock) -> bool:
    """After a failed attempt: no holder has a quorum, but other claimers hold some of the nodes that answered.

    Contenders that arrived together shared the nodes out. ``lock.split`` says so when the refusals alone denied
    the quorum. With a node down, two contenders split the two nodes left, one each: Redlock calls that unknown
    (the missing node might have given one of them a quorum), but most likely nobody holds the run, and a retry
    settles it either way.
    """
    return not lock.contended and (lock.split or lock.held_by is not None)


def _nodes(settings: LockSettings) -> str:
    urls = ", ".join(settings.redacted_urls)
    return f"{len(settings.urls)} node(s) [{urls}], quorum {settings.nodes.quorum}"


class _OneLineStartError(logging.Filter):
    """On Celery's ``celery.beat`` logger: drop its record of a failed start check, which carries a traceback.

    ``celery -q beat`` (no banner) makes the scheduler inside ``Service.start``, whose caller logs whatever it raises
    at CRITICAL with its traceback before re-raising it; the ``celery`` command then prints the error's one line,
    ``Error: ...``, to stderr, which beat redirects to its log by default (``worker_redirect_stdouts``).
    """

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.exc_info and isinstance(record.exc_info[1], StartError))


logging.getLogger("celery.beat").addFilter(_OneLineStartError())


@contextlib.contextmanager
def _slot_header(entry: Any, slot: Slot) -> Iterator[None]:
    """Send the entry's run with the slot in its headers, without touching the options the entry shares.

    ``next(entry)`` copies ``options`` by reference into the next entry, and celery's ``apply_async`` adds its
    ``celery_beat_task`` header into the headers dict in place: so rebind a fresh copy, then put the original back.
    """
    options = entry.options
    headers = dict(options.get("headers") or {})
    headers[SLOT_HEADER] = slot.label
    entry.options = {**options, "headers": headers}
    try:
        yield
    finally:
        entry.options = options


class SingletonSchedulerMixin:
    """Put before any celery beat scheduler class: a due run is sent only by the instance that claims its slot.

    ``class MyScheduler(SingletonSchedulerMixin, DatabaseScheduler): ...``. Both of celery's dispatch paths are
    guarded: ``Scheduler.tick`` reserves the next entry, then calls ``apply_entry`` (which logs "Sending due task"
    and calls ``apply_async(advance=False)``); RedBeat's ``maybe_due`` calls ``apply_async`` directly. A run that is
    not ours is not sent, but the entry still advances, exactly as if it had been sent. ``is_due`` is celery's,
    except in the hour a DST fall-back repeats (see :meth:`is_due`).
    """

    #: When too few lock nodes answer to know whether another instance claimed the run: False (the default) does
    #: not send it (a run may be missed, never doubled); True sends it unguarded (never missed, maybe doubled).
    send_when_unavailable: ClassVar[bool] = False

    app: Any
    #: The entry ``apply_entry`` claimed, so its own call to ``apply_async`` does not claim it a second time.
    _claimed: tuple[Any, Slot] | None = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        cast(Any, super()).__init__(*args, **kwargs)
        if not kwargs.get("lazy", False):
            # Run the worker's start checks (settings, every LockedTask's options) when beat starts, not at the first
            # due run: a bad setting stops beat with one line, as it stops a worker.
            settings = check_start(self.app)
            logger.info("beat: each due run is claimed before it is sent, on %s", _nodes(settings))
            warn_unreachable(settings.nodes, "beat")

    def tick(self, *args: Any, **kwargs: Any) -> Any:
        """Celery's ``tick``; then, with ``singleton_lock_liveness_file`` set, rewrite that file, due again after the
        sleep the tick returned (``celery locks health --liveness``; see :mod:`celery_singleton_lock.health`)."""
        interval = cast(Any, super()).tick(*args, **kwargs)
        path = settings_for(self.app).liveness_file
        if path:
            try:
                write_heartbeat(path, role="beat", due_in=float(interval or 0))
            except OSError as exc:
                logger.warning("beat: cannot write the liveness file: %s", exc)
        return interval

    def is_due(self, entry: Any) -> Any:
        """Celery's ``is_due``; but a ``last_run_at`` on the second pass of a repeated (DST fall-back) hour is read
        as the end of its first pass.

        Celery's crontab maps "the next run after the second 02:10" onto the first pass, an hour in the past, so
        such an entry (restarted in that hour, or late into it) is due on every tick until the hour is over: a busy
        loop of refused claims here, and with celery's own scheduler a flood of sends. Read from the end of the
        first pass, its next run is the one really ahead: the run :func:`slot_for` names next.
        """
        last = entry.last_run_at
        moved = None if last is None else _before_repeat(entry.schedule, last)
        if moved is None:
            return cast(Any, super()).is_due(entry)
        entry.last_run_at = moved  # only for this question: celery's entry (and DatabaseScheduler's) reads it
        try:
            return cast(Any, super()).is_due(entry)
        finally:
            entry.last_run_at = last

    def apply_entry(self, entry: Any, producer: Any = None) -> None:
        """Claim the due run of ``entry``, then send it as celery does; log and skip when it is not ours."""
        slot = self._claim(entry)
        if slot is None:
            return
        self._claimed = (entry, slot)
        try:
            cast(Any, super()).apply_entry(entry, producer=producer)
        finally:
            self._claimed = None

    def apply_async(
        self,
        entry: Any,
        producer: Any = None,
        advance: bool = True,  # noqa: FBT001, FBT002 - celery's signature
        **kwargs: Any,
    ) -> Any:
        """Send the run of ``entry`` if it is ours (claimed here, or already by ``apply_entry``); None if not."""
        claimed = self._claimed
        if claimed is not None and claimed[0] is entry:
            slot = claimed[1]
        else:
            found = self._claim(entry)
            if found is None:
                if advance:
                    self.reserve(entry)  # type: ignore[attr-defined]
                return None
            slot = found
        with _slot_header(entry, slot):
            return cast(Any, super()).apply_async(entry, producer, advance, **kwargs)

    def _claim(self, entry: Any) -> Slot | None:
        """The slot of the run of ``entry`` due now if this instance claimed it (or must send anyway), else None."""
        name = entry.name
        try:
            slot = slot_for(entry.schedule, entry.last_run_at)
        except Exception:
            logger.exception("beat: cannot tell which run of %s is due, so it is not sent", name)
            return None
        settings = settings_for(self.app)
        key = f"{settings.prefix}beat:{name}:{slot.label}"
        # Never released, and no fencing counter (one key per run, nothing that outlives it): the claim expires
        # after claim_ttl(), once no instance can be due for this slot any more. Releasing it after sending would
        # let an instance that ticks a moment later send the same run again. The label names this instance in
        # the holder token (Redlock adds a fresh random owner per attempt).
        label = f"beat@{_HOST}:{os.getpid()}:{secrets.token_hex(6)}"
        lock = Redlock(
            settings.nodes,
            key,
            ttl=claim_ttl(slot.period),
            fencing=False,
            token=label,
            record={"worker": f"{os.getpid()}@{_HOST}", "at": str(int(time.time() * 1000))},
        )
        nodes = settings.nodes
        started = time.monotonic()
        attempts = 0
        try:
            while True:
                attempts += 1
                if lock.acquire(blocking=False):
                    logger.debug("beat: claimed %s run %s (%s) at attempt %d", name, slot.iso, key, attempts)
                    return slot
                if not _split_vote(lock):
                    break
                # Instances due for the same run claim it within a round trip of each other: each can win some
                # nodes and none a quorum. Nobody holds the run, so skipping it would skip it on every instance:
                # retry after a jittered pause (Redlock's rule), the pause growing, within the slot's budget.
                pause = random.uniform(_SPLIT_PAUSE, _SPLIT_PAUSE * 2 ** min(attempts, 4))  # noqa: S311 - jitter
                if time.monotonic() - started + pause > _split_budget(slot.period):
                    break
                time.sleep(pause)
        except Exception:
            logger.exception("beat: claiming %s run %s failed", name, slot.iso)
        else:
            if lock.contended:
                logger.info(
                    "beat: %s run %s was claimed by another beat instance (%s); not sending it",
                    name,
                    slot.iso,
                    lock.held_by or "unknown",
                )
                return None
        errors = "; ".join(str(e) for e in lock.node_errors)
        if _split_vote(lock):
            # Every attempt found the run unclaimed but the nodes shared out: a contender that keeps arriving
            # together with us, or a partial claim left by an instance that died mid-claim (with nodes down, the
            # rest cannot make a quorum without it).
            why = (
                f"split vote: for {time.monotonic() - started:.2f} s ({attempts} attempts) the lock nodes that "
                f"answered were shared out between beat instances, none with a quorum ({nodes.quorum} of {len(nodes)})"
            )
            if errors:
                why += f"; unanswered, so another instance may hold the run there: {errors}"
        else:
            why = (
                f"fewer than {nodes.quorum} of {len(nodes)} lock nodes answered, so it is unknown whether another "
                f"beat instance sent it ({errors or 'no quorum'})"
            )
        if self.send_when_unavailable:
            logger.warning(
                "beat: sending %s run %s UNGUARDED: %s; another beat instance may send it too", name, slot.iso, why
            )
            return slot
        logger.warning("beat: NOT sending %s run %s: %s", name, slot.iso, why)
        return None

    @property
    def info(self) -> str:
        """Beat's banner lines: the underlying scheduler's, then where runs are claimed."""
        # Beat's banner asks a lazy scheduler for this before it starts: the start checks stop it here, one line.
        settings = check_start(self.app)
        base = cast(str, cast(Any, super()).info)
        line = f"    . singleton -> runs claimed on {_nodes(settings)}"
        return f"{base}\n{line}" if base else line


_database_scheduler: type | None = None


def __getattr__(name: str) -> Any:
    """``SingletonDatabaseScheduler``, built on first use: django-celery-beat's ``DatabaseScheduler`` whose due runs
    are sent once (``celery -A proj beat -S celery_singleton_lock.beat:SingletonDatabaseScheduler`` on every host).

    Built here, not at import, because it needs Django and django-celery-beat (which this package does not), with
    Django's settings configured (the Celery app module of a Django project does that). Every instance reads the
    same ``PeriodicTask`` rows; the slot of a run comes from its schedule and the clock, never from the
    ``last_run_at`` each instance writes back, so each run is claimed, and sent, once.
    """
    global _database_scheduler  # noqa: PLW0603 - built once per process
    if name != "SingletonDatabaseScheduler":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    if _database_scheduler is None:
        try:
            from django_celery_beat.schedulers import DatabaseScheduler  # noqa: PLC0415 - Django is optional
        except ImportError as exc:
            raise ImportError(
                f"SingletonDatabaseScheduler needs django-celery-beat (pip install django-celery-beat): {exc}"
            ) from exc
        _database_scheduler = type(
            "SingletonDatabaseScheduler",
            (SingletonSchedulerMixin, DatabaseScheduler),
            {"__module__": __name__, "__qualname__": "SingletonDatabaseScheduler", "__doc__": __getattr__.__doc__},
        )
    return _database_scheduler


class SingletonScheduler(SingletonSchedulerMixin, PersistentScheduler):  # type: ignore[misc]
    """Celery's default scheduler (a shelve file per instance) whose due runs are sent once across instances.

    ``celery -A app beat -S celery_singleton_lock.beat.SingletonScheduler`` (or ``-S singleton``, the entry point
    this package registers in ``celery.beat_schedulers``). Give every instance its own ``--schedule`` file.
    """
