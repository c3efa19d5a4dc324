"""Beat slots across DST changes: every instance names the same run alike, and each run is claimed once.

A calendar schedule's runs are derived here without celery (``wall_clock_runs``): each local wall-clock minute the
crontab matches, at its first pass when the fall-back repeats it, and a minute the spring-forward skips at the
offset before the change (02:30 is 03:30 summer time). Celery's own beat, never restarted, sends exactly these; the
tests check that ``slot_for`` names the latest of them for instances with any ``last_run_at`` (up to date, periods
or days old, none, on the repeated hour's second pass), and that simulated instances restarted before, during and
after the change claim each of them once. Europe/Berlin and America/New_York, spring and autumn, hourly, quarter-
hourly and daily crontabs, and a solar schedule.
"""

from __future__ import annotations

import datetime as dt
import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from zoneinfo import ZoneInfo

import needs
import pytest
from beat_sim import UTC, Instance, simulate
from celery import Celery
from celery.beat import ScheduleEntry
from celery.schedules import crontab, solar

from celery_singleton_lock.task.beat import SingletonSchedulerMixin, slot_for

HOUR = 3600.0
DAY = 86400.0


@functools.cache
def zone_app(zone: str) -> Celery:
    app = Celery(f"beat_dst_{zone}", set_as_current=False)
    app.conf.timezone = zone
    return app


@dataclass(frozen=True)
class Change:
    """One DST change: where, and the UTC instant the clocks jump."""

    name: str
    zone: str
    at: dt.datetime
    autumn: bool  # clocks go back: an hour of wall-clock times is shown twice


CHANGES = [
    Change("Berlin-spring", "Europe/Berlin", dt.datetime(2026, 3, 29, 1, tzinfo=UTC), autumn=False),  # 02:00->03:00
    Change("Berlin-autumn", "Europe/Berlin", dt.datetime(2026, 10, 25, 1, tzinfo=UTC), autumn=True),  # 03:00->02:00
    Change("NewYork-spring", "America/New_York", dt.datetime(2026, 3, 8, 7, tzinfo=UTC), autumn=False),  # 02->03
    Change("NewYork-autumn", "America/New_York", dt.datetime(2026, 11, 1, 6, tzinfo=UTC), autumn=True),  # 02->01
]
# Crontab fields and their nominal period. Berlin repeats (or skips) 02:00-02:59, New York skips 02:00-02:59 in
# spring and repeats 01:00-01:59 in autumn: 01:30 and 02:30 fall inside one or the other in every change.
CRONTABS = {
    "hourly-at-30": ({"minute": 30}, HOUR),
    "every-15-min": ({"minute": "*/15"}, HOUR / 4),
    "daily-02:30": ({"hour": 2, "minute": 30}, DAY),
    "daily-01:30": ({"hour": 1, "minute": 30}, DAY),
}
CASES = [
    pytest.param(change, spec, period, id=f"{change.name}-{name}")
    for change in CHANGES
    for name, (spec, period) in CRONTABS.items()
]


def wall_clock_runs(cron: crontab, tz: ZoneInfo, lo: dt.datetime, hi: dt.datetime) -> list[dt.datetime]:
    """The crontab's runs in [lo, hi] as UTC, without celery: every local minute its fields match, read with
    fold=0 (a repeated minute at its first pass; a skipped one at the offset before the change)."""
    runs = set()
    local = lo.astimezone(tz).replace(tzinfo=None, second=0, microsecond=0) - dt.timedelta(hours=3)
    stop = hi.astimezone(tz).replace(tzinfo=None) + dt.timedelta(hours=3)
    for _ in range(60 * 24 * 40):  # a bound: the ranges used here are a few days
        if local > stop:
            break
        if (
            local.minute in cron.minute
            and local.hour in cron.hour
            and local.isoweekday() % 7 in cron.day_of_week
            and local.day in cron.day_of_month
            and local.month in cron.month_of_year
        ):
            t = local.replace(tzinfo=tz).astimezone(UTC)
            if lo <= t <= hi:
                runs.add(t)
        local += dt.timedelta(minutes=1)
    else:
        raise AssertionError("range too long")
    return sorted(runs)


def celery_alone(schedule: Any, start: dt.datetime, end: dt.datetime) -> list[dt.datetime]:
    """When celery's own beat sends the runs in (start, end]: one instance, never restarted, each tick 0.3 s late."""
    schedule.nowfun = lambda: start
    sent: list[dt.datetime] = []
    last = start
    for _ in range(10_000):
        due = start + schedule.remaining_estimate(last)
        if due > end:
            return sent
        sent.append(due)
        last = due + dt.timedelta(seconds=0.3)
    raise AssertionError("more than 10000 runs")


def nows_around(change: Change, period: float) -> list[dt.datetime]:
    """Clock readings from 1.5 periods before the change to 1.5 after, plus every 7 minutes for 2 h around it."""
    span = dt.timedelta(seconds=1.5 * period)
    step = dt.timedelta(seconds=period / 13 + 17)
    grid = [change.at - span + k * step for k in range(40) if k * step <= 2 * span]
    dense = [change.at + dt.timedelta(minutes=7 * k + 0.5) for k in range(-9, 18)]
    return sorted(set(grid + dense))


def timeline(change: Change, period: float) -> tuple[dt.datetime, dt.datetime]:
    """From 1.5 periods (at least 2 h) before the change to 1.5 periods (at least 3 h) after it; 7 min off the
    hour, so no run is near either end (where skewed clocks would disagree about being inside)."""
    before = dt.timedelta(seconds=max(1.5 * period, 2 * HOUR), minutes=-7)
    after = dt.timedelta(seconds=max(1.5 * period, 3 * HOUR), minutes=7)
    return change.at - before, change.at + after


def assert_every_instance_names_the_latest_run(
    schedule: Any, runs: list[dt.datetime], change: Change, period: float
) -> int:
    """For many clock readings and every kind of last_run_at that makes an instance due: the slot is the latest
    run <= now (whole seconds), and its period reaches the next run. Returns how many slots were checked."""
    checked = 0
    for now in nows_around(change, period):
        j = max(i for i, r in enumerate(runs) if r <= now)
        latest, following = runs[j], runs[j + 1]
        lasts: list[dt.datetime | None] = [
            None,  # a new entry (RedBeat), no schedule file
            runs[j - 1] + dt.timedelta(seconds=0.3),  # sent (or skipped) the previous run: up to date
            runs[j - 2] + dt.timedelta(seconds=0.3),  # a schedule file two runs old
            now - dt.timedelta(days=4, minutes=3),  # a schedule file days old
            change.at + dt.timedelta(minutes=5),  # last ticked 5 min after the change (autumn: the second pass)
            change.at + dt.timedelta(minutes=35),
        ]
        for last in lasts:
            if last is not None and not last < latest:
                continue  # not due: no run in (last, now]
            slot = slot_for(schedule, last, now=now)
            where = f"now {now:%m-%d %H:%M:%S}Z, last_run_at {last}: slot {slot.iso} ({slot.period} s)"
            assert slot.due == latest.replace(microsecond=0), f"{where}, want {latest}"
            assert abs(slot.period - (following - latest).total_seconds()) <= 1, f"{where}, next run {following}"
            checked += 1
    return checked


@pytest.mark.parametrize(("change", "spec", "period"), CASES)
def test_every_instance_names_the_latest_crontab_run_across_the_change(
    change: Change, spec: dict[str, Any], period: float
) -> None:
    """Up-to-date, stale (two runs or days old), absent and second-pass last_run_at values name the same slot at
    every clock reading across the change: the latest run by the wall clock, never an older one; and those runs are
    the ones celery's own never-restarted beat sends."""
    app = zone_app(change.zone)
    cron = crontab(app=app, **spec)
    lo, hi = change.at - dt.timedelta(days=6), change.at + dt.timedelta(days=4)
    runs = wall_clock_runs(cron, ZoneInfo(change.zone), lo, hi)
    start, end = timeline(change, period)
    assert celery_alone(crontab(app=app, **spec), start, end) == [r for r in runs if start < r <= end]
    assert assert_every_instance_names_the_latest_run(cron, runs, change, period) > 100


def test_what_a_0230_run_does_on_the_change_days_in_berlin() -> None:
    """The documented cases: 02:30 daily runs at 03:30 CEST on the spring day and once, at 02:30 CEST, on the
    autumn day; hourly at :30 runs every real hour in spring (03:30 CEST standing for the skipped 02:30) and skips
    the second 02:30 in autumn (02:30 CEST, then 03:30 CET, two hours apart)."""
    app = zone_app("Europe/Berlin")
    tz = ZoneInfo("Europe/Berlin")

    def local_runs(spec: dict[str, Any], day: dt.date) -> list[str]:
        """The runs from 00:00 to 04:00 local on ``day``, as local times; slot_for names each alike."""
        start = dt.datetime(day.year, day.month, day.day, tzinfo=tz).astimezone(UTC)
        end = dt.datetime(day.year, day.month, day.day, 4, tzinfo=tz).astimezone(UTC)
        cron = crontab(app=app, **spec)
        sent = celery_alone(cron, start, end)
        slots = [slot_for(cron, None, now=r + dt.timedelta(seconds=20)).due for r in sent]
        assert slots == sent
        return [r.astimezone(tz).strftime("%H:%M%Z") for r in sent]

    assert local_runs({"hour": 2, "minute": 30}, dt.date(2026, 3, 29)) == ["03:30CEST"]
    assert local_runs({"hour": 2, "minute": 30}, dt.date(2026, 10, 25)) == ["02:30CEST"]
    assert local_runs({"minute": 30}, dt.date(2026, 3, 29)) == ["00:30CET", "01:30CET", "03:30CEST"]
    assert local_runs({"minute": 30}, dt.date(2026, 10, 25)) == ["00:30CEST", "01:30CEST", "02:30CEST", "03:30CET"]


def instances_around(
    make: Callable[[Callable[[], dt.datetime]], Any], change: Change, start: dt.datetime, period: float
) -> list[Instance]:
    """Three up-to-date instances (skewed clocks, different tick latency), one restarted at the start from a file
    2.5 periods old, one restarted 10 min after the change from a file 4 days old (autumn: on the second pass),
    and one started 40 min after it with a new file."""
    after = (change.at - start).total_seconds()
    return [
        Instance(make, 0.0, 0.001),
        Instance(make, -3.0, 0.4),
        Instance(make, 2.0, 0.02),
        Instance(make, 1.0, 0.003, stale=2.5 * period),
        Instance(make, 0.5, 0.002, stale=4 * DAY, start=after + 600),
        Instance(make, -1.0, 0.01, start=after + 2400),
    ]


def claimed_once(claims: list[str], runs: list[dt.datetime], start: dt.datetime, end: dt.datetime) -> None:
    """The claims are exactly the runs from the latest one at ``start`` (the stale instance catches up on it) to
    ``end``: none missed, and none claimed under a second name (which would send it twice)."""
    first = max(r for r in runs if r <= start)
    expected = [r.strftime("%Y-%m-%dT%H:%M:%SZ") for r in runs if first <= r <= end]
    missed, extra = sorted(set(expected) - set(claims)), sorted(set(claims) - set(expected))
    assert claims == expected, f"missed {missed}, extra {extra}"


@pytest.mark.parametrize(("change", "spec", "period"), CASES)
def test_each_crontab_run_is_claimed_once_by_instances_restarted_around_the_change(
    change: Change, spec: dict[str, Any], period: float
) -> None:
    """Six simulated instances, some restarted before, during and after the change with stale or new schedule
    files, over three periods around it: every run is claimed exactly once, under its one name."""
    app = zone_app(change.zone)
    start, end = timeline(change, period)

    def make(nowfun: Callable[[], dt.datetime]) -> crontab:
        return crontab(app=app, nowfun=nowfun, **spec)

    claims = simulate(instances_around(make, change, start, period), start, (end - start).total_seconds())
    runs = wall_clock_runs(crontab(app=app, **spec), ZoneInfo(change.zone), start - dt.timedelta(days=4), end)
    claimed_once(claims, runs, start, end)


class _Beat:
    """Stands in for celery's Scheduler: is_due asks the entry, as celery's does."""

    def __init__(self, app: Celery, *, lazy: bool = False) -> None:
        self.app = app

    def is_due(self, entry: ScheduleEntry) -> Any:
        return entry.is_due()


class _Scheduler(SingletonSchedulerMixin, _Beat):
    pass


@pytest.mark.parametrize("change", [c for c in CHANGES if c.autumn], ids=lambda c: c.name)
def test_an_entry_last_run_on_the_repeated_hour_is_not_due_on_every_tick(change: Change) -> None:
    """Celery's crontab calls an entry whose last_run_at is on the repeated hour's second pass due on every tick
    (it reads "the next run" on the first pass, in the past); the mixin asks from the end of the first pass: not
    due until the next run really ahead, and the entry's last_run_at is left as it was."""
    app = zone_app(change.zone)
    now = change.at + dt.timedelta(minutes=12)
    last = change.at + dt.timedelta(minutes=10)
    entry = ScheduleEntry(
        name="e", task="t", schedule=crontab(minute="*/15", app=app, nowfun=lambda: now), last_run_at=last, app=app
    )
    assert entry.is_due() == (True, 0), "celery's own answer, on every tick of that hour"
    due, next_s = _Scheduler(app, lazy=True).is_due(entry)
    assert (due, next_s) == (False, (change.at + dt.timedelta(hours=1) - now).total_seconds())
    assert entry.last_run_at == last


SOLAR_CASES = [pytest.param(change, id=change.name) for change in CHANGES]
SITES = {"Europe/Berlin": (52.52, 13.40), "America/New_York": (40.71, -74.01)}


@pytest.mark.parametrize("change", SOLAR_CASES)
def test_solar_runs_are_named_alike_and_claimed_once_across_the_change(change: Change) -> None:
    """A sunrise schedule (computed in UTC, so the change is nothing to it): every kind of last_run_at names the
    latest sunrise at every clock reading, and simulated instances restarted around the change claim each once."""
    needs.module("ephem", "celery's solar schedules need it (the test extra has it)")

    app = zone_app(change.zone)
    lat, lon = SITES[change.zone]
    sunrise = solar("sunrise", lat, lon, app=app)
    # The runs, from celery itself: the chain of "next sunrise after" from a week before.
    lo = change.at - dt.timedelta(days=7)
    chain = celery_alone(solar("sunrise", lat, lon, app=app), lo, change.at + dt.timedelta(days=3))
    runs = [(r + dt.timedelta(microseconds=500_000)).replace(microsecond=0) for r in chain]
    # Whole seconds: solar times are computed numerically, a few ms apart from different starting points.
    assert assert_every_instance_names_the_latest_run(sunrise, runs, change, DAY) > 50
    start, end = timeline(change, DAY)

    def make(nowfun: Callable[[], dt.datetime]) -> solar:
        return solar("sunrise", lat, lon, app=app, nowfun=nowfun)

    claims = simulate(instances_around(make, change, start, DAY), start, (end - start).total_seconds())
    claimed_once(claims, runs, start, end)
