"""SingletonScheduler: N beat instances side by side send each due run of each entry exactly once.

The slot arithmetic is tested in-process across simulated clocks (skewed, late, stale schedule files; the
simulation is tests/beat_sim.py, DST changes are tests/task/test_beat_dst.py); the claim against real Redis nodes
in-process with a stand-in scheduler, including instances that claim together and split the nodes' votes; and the
whole thing with real ``celery beat`` processes, counting the messages they left in the broker's queue (no worker
needed).
"""

from __future__ import annotations

import contextlib
import datetime as dt
import itertools
import json
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from beat_sim import Instance, at, simulate
from celery import Celery
from celery.beat import ScheduleEntry, Service
from celery.schedules import crontab, schedule

from celery_singleton_lock.lock.redlock import Redlock
from celery_singleton_lock.task.beat import (
    SLOT_HEADER,
    SingletonScheduler,
    SingletonSchedulerMixin,
    claim_ttl,
    slot_for,
)
from celery_singleton_lock.testing import RedisServer, free_port, redis_servers


@pytest.fixture(scope="module")
def kolkata() -> Celery:
    """An app in a +05:30 timezone: crontab fields are local, slots are UTC."""
    app = Celery("beat_slots", set_as_current=False)
    app.conf.timezone = "Asia/Kolkata"
    return app


def test_crontab_slot_is_the_same_on_skewed_clocks_and_stale_schedule_files(kolkata: Celery) -> None:
    """Clocks a few seconds apart, late ticks and last_run_at values from 5 minutes to years old all name the
    12:05 run of a */5 crontab alike, as a UTC time."""
    cron = crontab(minute="*/5", app=kolkata)
    due_local = dt.datetime(2026, 11, 22, 12, 5, tzinfo=dt.timezone(dt.timedelta(hours=5, minutes=30)))
    labels = {
        slot_for(cron, last, now=due_local + dt.timedelta(seconds=late))
        for last in (
            due_local - dt.timedelta(minutes=5, seconds=-0.3),  # sent the 12:00 run
            due_local - dt.timedelta(minutes=4, seconds=10),  # skipped the 12:00 run, advanced anyway
            due_local - dt.timedelta(hours=7),  # down for hours
            due_local - dt.timedelta(days=900),  # a schedule file from years ago
            None,  # never ran (RedBeat's fresh entry)
        )
        for late in (0.001, 2.5, 59.0, 299.0)
    }
    assert {(s.iso, s.label, s.period) for s in labels} == {("2026-11-22T06:35:00Z", "1795329300", 300.0)}


def test_crontab_runs_across_simulated_instances_are_each_claimed_exactly_once(kolkata: Celery) -> None:
    """Three instances with clocks up to 3 s apart and different tick latency, plus one restarted from a schedule
    file three hours old, over six simulated hours of an every-minute crontab: every minute is claimed, and no
    claim names anything but a scheduled minute (so no run is sent twice under two names)."""
    instances = [
        Instance(lambda f: crontab(app=kolkata, nowfun=f), offset, latency, stale)
        for offset, latency, stale in ((0.0, 0.001, 0.0), (-3.0, 0.4, 0.0), (2.0, 0.02, 0.0), (1.0, 0.003, 3 * 3600.0))
    ]
    claims = simulate(instances, at(2026, 3, 1, 22, 0, 10), seconds=6 * 3600)
    expected = [at(2026, 3, 1, 22, 0) + dt.timedelta(minutes=i) for i in range(6 * 60 + 1)]  # 22:00 (stale) .. 04:00
    assert claims == [t.strftime("%Y-%m-%dT%H:%M:%SZ") for t in expected]


def test_interval_slots_are_epoch_aligned_whatever_each_instance_started_at() -> None:
    """Interval runs are named floor(now / run_every): instances started at different moments, with clocks a few
    ms apart and drifting with their tick latency, claim nearly every 1 s slot of a long run, each once."""
    app = Celery("beat_interval", set_as_current=False)
    instances = [
        Instance(lambda f: schedule(dt.timedelta(seconds=1), nowfun=f, app=app), offset, latency)
        for offset, latency in ((0.0, 0.0013), (0.003, 0.0021), (-0.002, 0.0007))
    ]
    claims = simulate(instances, at(2026, 11, 22, 0, 0, 0), seconds=1000)
    starts = [dt.datetime.strptime(c, "%Y-%m-%dT%H:%M:%SZ") for c in claims]
    assert all(b > a for a, b in itertools.pairwise(starts)), "one claim per slot"
    assert len(claims) >= 990, f"{1000 - len(claims)} slots unclaimed of ~1000"
    first = slot_for(schedule(2.5, app=app), None, now=at(2026, 11, 22, 0, 0, 7, micro=400_000))
    assert (first.iso, first.period) == ("2026-11-22T00:00:05Z", 2.5)
    assert (
        slot_for(schedule(0.25, app=app), None, now=at(2026, 11, 22, 0, 0, 7, micro=800_000)).label == "1795305607.750"
    )


def test_claim_ttl_outlives_the_slot_and_is_bounded() -> None:
    """A claim lives one more period past its slot (at least 60 s, the extra at most a day, at most 400 days)."""
    assert claim_ttl(0.5) == 60.0
    assert claim_ttl(600.0) == 1200.0
    assert claim_ttl(7 * 86400.0) == 8 * 86400.0
    assert claim_ttl(10 * 365 * 86400.0) == 400 * 86400.0


# -- the claim, in-process, against a real Redis -------------------------------------------------------------------


class _Recorder:
    """Stands in for a celery Scheduler: apply_entry -> apply_async(advance=False), both recorded."""

    def __init__(self, app: Celery, *, lazy: bool = False) -> None:
        self.app = app
        self.sent: list[dict[str, Any]] = []
        self.reserved: list[str] = []

    def apply_entry(self, entry: ScheduleEntry, producer: Any = None) -> None:
        self.apply_async(entry, producer=producer, advance=False)

    def apply_async(self, entry: ScheduleEntry, producer: Any = None, advance: bool = True, **kwargs: Any) -> str:
        if advance:
            self.reserve(entry)
        self.sent.append(dict(entry.options))
        return "sent"

    def reserve(self, entry: ScheduleEntry) -> None:
        self.reserved.append(entry.name)

    @property
    def info(self) -> str:
        return ""


class _Scheduler(SingletonSchedulerMixin, _Recorder):
    pass


class _FailOpen(_Scheduler):
    send_when_unavailable = True


def _app(urls: list[str]) -> Celery:
    app = Celery("beat_claims", set_as_current=False, broker="memory://")
    app.conf.singleton_lock_urls = urls
    app.conf.singleton_lock_socket_timeout = 0.2
    return app


def _entry(app: Celery, name: str, now: dt.datetime) -> ScheduleEntry:
    cron = crontab(minute="*/5", nowfun=lambda: now, app=app)
    return ScheduleEntry(name=name, task="t", schedule=cron, last_run_at=now - dt.timedelta(minutes=5), app=app)


def test_only_the_instance_that_claims_a_run_sends_it_and_the_others_log_it(
    redis_node: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    """Two instances due for one run, by either dispatch path: one sends it (the slot in its headers), the other
    logs at INFO who sent it, does not send, and still advances the entry."""
    app = _app([redis_node.url])
    app.conf.singleton_lock_prefix = f"t{os.getpid()}-{time.monotonic_ns()}:"
    first, second = _Scheduler(app), _Scheduler(app)
    now = at(2026, 11, 22, 12, 5, 3)
    entry = _entry(app, "report", now)
    entry.options = {"headers": {"mine": 1}}
    with caplog.at_level(logging.INFO, logger="celery_singleton_lock.beat"):
        first.apply_entry(entry)
        second.apply_entry(_entry(app, "report", now + dt.timedelta(seconds=2)))
        assert second.apply_async(_entry(app, "report", now), advance=True) is None  # RedBeat's path
    label = str(int(at(2026, 11, 22, 12, 5).timestamp()))
    assert first.sent == [{"headers": {"mine": 1, SLOT_HEADER: label}}]
    assert entry.options == {"headers": {"mine": 1}}, "the entry's own options are left alone"
    assert second.sent == [] and second.reserved == ["report"]
    assert "report run 2026-11-22T12:05:00Z was claimed by another beat instance (beat@" in caplog.text
    key = f"{app.conf.singleton_lock_prefix}beat:report:{label}"
    assert 0 < redis_node.client().pttl(key) <= 600_000, "never released: expires after two periods"


def test_without_a_lock_quorum_a_run_is_not_sent_and_a_warning_names_the_nodes(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """With no lock node answering, the run is not sent (a miss, never a double) and a warning shows the
    redacted node errors; send_when_unavailable=True sends it unguarded instead, with a warning."""
    app = _app([f"redis://:s3cret@127.0.0.1:{free_port()}/0"])
    entry = _entry(app, "nightly", at(2026, 11, 22, 0, 0, 1))
    closed, open_ = _Scheduler(app), _FailOpen(app)
    with caplog.at_level(logging.INFO, logger="celery_singleton_lock.beat"):
        closed.apply_entry(entry)
        open_.apply_entry(entry)
    assert closed.sent == []
    assert len(open_.sent) == 1
    assert "NOT sending nightly run 2026-11-22T00:00:00Z: fewer than 1 of 1 lock nodes answered" in caplog.text
    assert "sending nightly run 2026-11-22T00:00:00Z UNGUARDED" in caplog.text
    assert "127.0.0.1" in caplog.text and "s3cret" not in caplog.text


SPLIT_SLOTS = 300


@pytest.mark.parametrize(
    ("claimers", "down"),
    [pytest.param(2, 1, id="2-claimers-1-node-down"), pytest.param(3, 1, id="3-claimers-1-node-down"),
     pytest.param(3, 0, id="3-claimers-all-up")],
)  # fmt: skip
def test_claimers_that_split_the_lock_nodes_retry_so_every_run_is_sent_exactly_once(claimers: int, down: int) -> None:
    """Instances claiming the same runs at the same instant (a barrier per run) split the lock nodes' votes often;
    they retry with jitter, so each of 300 runs is sent by exactly one of them: none lost, none doubled."""
    with redis_servers(3) as nodes:
        for node in nodes[:down]:
            node.stop()
        prefix = f"split{os.getpid()}-{time.monotonic_ns()}:"
        schedulers = []
        for i in range(claimers):
            # One app each, as separate beat processes have; each lists the nodes in another order, so each node
            # tends to get another claimer's command first (the same nodes, the same quorum).
            app = _app([n.url for n in nodes[i:] + nodes[:i]])
            app.conf.singleton_lock_prefix = prefix
            schedulers.append(_Scheduler(app))
        now = at(2026, 11, 22, 12, 5, 3)
        barrier = threading.Barrier(claimers, timeout=20)
        sent: list[list[int]] = [[] for _ in range(claimers)]
        failures: list[BaseException] = []

        def claim_all(i: int) -> None:
            scheduler = schedulers[i]
            try:
                for run in range(SPLIT_SLOTS):
                    barrier.wait()
                    before = len(scheduler.sent)
                    scheduler.apply_entry(_entry(scheduler.app, f"split-{run}", now))
                    if len(scheduler.sent) > before:
                        sent[i].append(run)
            except BaseException as exc:  # the test thread reports it; the others then fail at the barrier
                failures.append(exc)
                barrier.abort()

        threads = [threading.Thread(target=claim_all, args=(i,), daemon=True) for i in range(claimers)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        assert not any(t.is_alive() for t in threads), "claimers still running after 60 s"
        assert not failures, failures
    counts = Counter(run for runs in sent for run in runs)
    lost = [run for run in range(SPLIT_SLOTS) if counts[run] == 0]
    doubled = [run for run, n in counts.items() if n > 1]
    assert (len(lost), len(doubled)) == (0, 0), f"{len(lost)} runs lost, {len(doubled)} sent twice of {SPLIT_SLOTS}"


def test_a_split_that_never_resolves_is_given_up_within_its_budget_and_logged_as_a_split_vote(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A partial claim left on one node (an instance that died mid-claim) and another node down: every attempt
    splits, so the instance retries for at most a tenth of the period (0.2 s for a 2 s entry), then logs a split
    vote, not "nodes did not answer", and does not send; send_when_unavailable=True sends it unguarded."""
    with redis_servers(3) as nodes:
        nodes[0].stop()
        app = _app([n.url for n in nodes])
        app.conf.singleton_lock_prefix = f"t{os.getpid()}-{time.monotonic_ns()}:"
        now = at(2026, 11, 22, 12, 5, 3)
        every_2s = schedule(dt.timedelta(seconds=2), nowfun=lambda: now, app=app)
        entry = ScheduleEntry(name="ticker", task="t", schedule=every_2s, last_run_at=now, app=app)
        key = f"{app.conf.singleton_lock_prefix}beat:ticker:{slot_for(every_2s, now).label}"
        assert Redlock(nodes[1].url, key, ttl=60, fencing=False, token="beat@ghost:1").acquire(blocking=False)
        closed, open_ = _Scheduler(app), _FailOpen(app)
        with caplog.at_level(logging.INFO, logger="celery_singleton_lock.beat"):
            started = time.monotonic()
            closed.apply_entry(entry)
            took = time.monotonic() - started
            open_.apply_entry(entry)
    assert closed.sent == [] and len(open_.sent) == 1
    # The budget of a 2 s entry is 0.2 s (a tenth of it), and every pause is 5-80 ms, checked against the budget
    # before it is taken: the pauses add up to at most 0.2 s, so at most 41 attempts (not a timing figure).
    attempts = re.search(r"split vote: for [0-9.]+ s \((\d+) attempts\)", caplog.text)
    assert attempts, caplog.text
    assert 2 <= int(attempts[1]) <= 0.2 / 0.005 + 1, attempts[0]
    # It stops once the budget less one pause (0.2 - 0.08 s) has passed; the only upper bound, very generous, is
    # what tells the 0.2 s budget from the 2 s cap it would have without the tenth-of-the-period share: that one
    # ends after at least 1.92 s.
    assert 0.1 < took < 1.9, f"gave up after {took:.2f} s"
    assert "NOT sending ticker run 2026-11-22T12:05:02Z: split vote: for 0." in caplog.text
    assert "none with a quorum (2 of 3); unanswered, so another instance may hold the run there: redis:" in caplog.text
    assert "sending ticker run 2026-11-22T12:05:02Z UNGUARDED: split vote" in caplog.text
    assert "fewer than" not in caplog.text


# -- real beat processes ---------------------------------------------------------------------------------------------

APP_SOURCE = '''
"""A beat app for tests/task/test_beat.py, configured from the environment."""
import datetime as dt
import os
import time

from celery import Celery
from celery.schedules import crontab, schedule

SPEED = float(os.environ["CSL_SPEED"])  # simulated seconds per real second
T0 = float(os.environ["CSL_T0"])  # shared by every instance, so they share one simulated clock


def now():
    return dt.datetime.fromtimestamp(T0 + (time.time() - T0) * SPEED, tz=dt.timezone.utc)


app = Celery("beat_app", broker=os.environ["CSL_BROKER"])
app.conf.update(
    singleton_lock_urls=os.environ["CSL_LOCK_URLS"].split(","),
    broker_connection_retry_on_startup=True,
    # Beat sleeps for min(time to the next run, max interval) REAL seconds; on a fast clock keep it short.
    beat_max_loop_interval=0.1 if SPEED > 1 else 0,
    beat_schedule={
        # One real second whatever SPEED; every entry on one clock, or celery's heap mixes up the times.
        "tick": {"task": "beat_app.tick", "schedule": schedule(dt.timedelta(seconds=SPEED), nowfun=now)},
        "minutely": {"task": "beat_app.minutely", "schedule": crontab(nowfun=now)},
    },
)


@app.task
def tick():
    pass


@app.task
def minutely():
    pass
'''


class Beats:
    """``celery beat`` processes with their own schedule files and logs; SIGKILLed on exit, whatever happened."""

    def __init__(self, tmp_path: Path, env: dict[str, str]) -> None:
        (tmp_path / "beat_app.py").write_text(APP_SOURCE)
        self.tmp_path = tmp_path
        # The caller's PYTHONPATH stays behind the app's directory: the package under test, not an installed one.
        self.env = {**os.environ, **env}
        self.env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(self, count: int, scheduler: str = "celery_singleton_lock.beat.SingletonScheduler") -> None:
        for n in range(count):
            args = [sys.executable, "-m", "celery", "-A", "beat_app", "beat", "-l", "INFO", "-S", scheduler,
                    "--schedule", str(self.tmp_path / f"schedule-{n}")]  # fmt: skip
            with (self.tmp_path / f"beat-{n}.log").open("wb") as log:
                proc = subprocess.Popen(
                    args, cwd=self.tmp_path, env=self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
                )
                self.procs.append(proc)

    def logs(self) -> str:
        return "\n".join(p.read_text(errors="replace") for p in sorted(self.tmp_path.glob("beat-*.log")))

    def kill(self, proc: subprocess.Popen[bytes]) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(10)

    def close(self) -> None:
        for proc in self.procs:
            self.kill(proc)


@contextlib.contextmanager
def beats(tmp_path: Path, broker: RedisServer, locks: list[RedisServer], speed: float) -> Iterator[Beats]:
    group = Beats(
        tmp_path,
        {
            "CSL_BROKER": broker.url,
            "CSL_LOCK_URLS": ",".join(s.url for s in locks),
            "CSL_SPEED": str(speed),
            "CSL_T0": str(int(time.time())),
        },
    )
    try:
        yield group
    finally:
        group.close()


def sent(broker: RedisServer) -> list[tuple[str, str, int]]:
    """(task, slot, sender pid) of every message waiting in the broker's default queue."""
    out = []
    for raw in broker.client().lrange("celery", 0, -1):
        headers = json.loads(raw)["headers"]
        pid = re.fullmatch(r"gen(\d+)@.*", headers["origin"])
        assert pid is not None, headers["origin"]
        out.append((headers["task"], headers[SLOT_HEADER], int(pid.group(1))))
    return out


def wait_for(condition: Callable[[], bool], timeout: float, what: str, group: Beats) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"{what}: not within {timeout} s; beat logs:\n{group.logs()[-4000:]}")
        assert all(p.poll() is None for p in group.procs if p.returncode is None), group.logs()[-4000:]
        time.sleep(0.2)


def slots_of(messages: list[tuple[str, str, int]], task: str) -> list[str]:
    return sorted((slot for name, slot, _ in messages if name == task), key=float)


def seconds(label: str) -> int:
    return int(float(label))


def test_two_beat_processes_send_every_crontab_and_interval_run_once(tmp_path: Path) -> None:
    """Two beat instances on one Redis, on a clock running 60x (a simulated minute per second): every crontab
    minute and every interval slot is sent exactly once, and the loser of each race logs it."""
    with redis_servers(1) as (node,), beats(tmp_path, node, [node], speed=60.0) as group:
        group.start(2)
        wait_for(lambda: len(slots_of(sent(node), "beat_app.minutely")) >= 6, 60, "six crontab runs", group)
        assert all(p.poll() is None for p in group.procs), "both instances stay up"
        messages = sent(node)
    for task in ("beat_app.minutely", "beat_app.tick"):
        slots = slots_of(messages, task)
        assert len(slots) == len(set(slots)), f"{task}: a slot sent twice: {Counter(slots).most_common(3)}"
        span = (seconds(slots[-1]) - seconds(slots[0])) // 60 + 1
        assert len(slots) >= span - (0 if task == "beat_app.minutely" else 1), f"{task}: runs missing: {slots}"
    assert "was claimed by another beat instance" in group.logs(), "the two instances did race for the runs"


def test_three_beats_on_three_lock_nodes_keep_sending_after_the_sender_is_killed(tmp_path: Path) -> None:
    """Three beat instances (``-S singleton``) on a 3-node Redlock, 1 s interval on the real clock: each slot is
    sent once; SIGKILL the instance that sent the latest run and the next runs still arrive, from the others."""
    with redis_servers(3) as nodes, beats(tmp_path, nodes[0], nodes, speed=1.0) as group:
        group.start(3, scheduler="singleton")  # the entry point's short name
        wait_for(lambda: len(slots_of(sent(nodes[0]), "beat_app.tick")) >= 3, 60, "three interval runs", group)
        before = [m for m in sent(nodes[0]) if m[0] == "beat_app.tick"]
        sender = max(before, key=lambda m: float(m[1]))[2]
        victim = next(p for p in group.procs if p.pid == sender)
        group.kill(victim)
        last = max(float(m[1]) for m in before)
        wait_for(
            lambda: len([m for m in sent(nodes[0]) if m[0] == "beat_app.tick" and float(m[1]) > last]) >= 3,
            10,
            "three runs after the kill",
            group,
        )
        messages = sent(nodes[0])
    ticks = [m for m in messages if m[0] == "beat_app.tick"]
    slots = [m[1] for m in ticks]
    assert len(slots) == len(set(slots)), f"a slot sent twice: {Counter(slots).most_common(3)}"
    after = [m for m in ticks if float(m[1]) > last]
    assert sender not in {pid for _, _, pid in after}
    assert {pid for _, _, pid in after} <= {p.pid for p in group.procs if p.pid != sender}
    span = seconds(max(slots, key=float)) - seconds(min(slots, key=float)) + 1
    assert len(slots) >= span - 2, f"runs missing beyond the killed one's: {sorted(slots)}"


def test_short_scheduler_name_resolves_through_the_entry_point() -> None:
    """``celery beat -S singleton`` finds SingletonScheduler through the celery.beat_schedulers entry point."""
    app = Celery("beat_alias", set_as_current=False, broker="memory://")
    app.conf.singleton_lock_urls = ["redis://127.0.0.1:1/0"]
    scheduler = Service(app, scheduler_cls="singleton").get_scheduler(lazy=True)
    assert type(scheduler) is SingletonScheduler
    assert "runs claimed on 1 node(s) [redis://127.0.0.1:1/0], quorum 1" in scheduler.info
