"""lock_on_duplicate="reschedule" and "replace": a duplicate waits in its key's line and is woken by the release.

Real workers on a Redis broker and three lock nodes, ttl 4 s (renewal every 1.33 s: the old behaviour re-sent a
waiting duplicate about that often). The workers run locked_app's tasks (``work_later``, ``latest``, ...) plus a few
of this module's own (``attack_app``, written to a temporary directory at module start): exactly once under twenty
duplicates, a line node restarted empty, long holders, the caller's arguments, eager apply, replace's order and its
revokes, chord members, the documented ACL user, lock_max_waiting across a killed job's redelivery. A woken copy's
parent_id (the holder that woke it) and a woken older call held up in a backlog running after a newer call that
found the lock free are documented limits, not tested here.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import re
import signal
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest
from worker_cluster import APPS, Cluster, cluster, new_key, overlapping, polling

from celery_singleton_lock.lock.redlock import sibling_key
from celery_singleton_lock.testing import CeleryWorker

pytestmark = pytest.mark.slow
TTL = 4.0
#: docs/nodes.md's ACL command set, as documented (the same string tests/lock/test_topologies.py checks against the
# docs).
ACL_COMMANDS = (
    "+evalsha +eval +exists +type +get +set +incr +del +pexpire +pttl +time "
    "+hget +hmget +hset +hdel +hgetall +hexists +hlen +hincrby +scan +zadd +zrem +zrange +zrangebyscore +zpopmin"
)

ATTACK_APP = '''
from typing import Any

from locked_app import _run, app, record  # noqa: F401 - every locked_app task is registered too
from celery_singleton_lock import LockedTask

app.conf.accept_content = ["json", "pickle"]


@app.task(base=LockedTask, bind=True, lock_unique_on=["key"], lock_on_duplicate="reschedule", max_retries=1)
def a_later(self: Any, key: str, duration: float = 0.0, fail: bool = False, retry: bool = False) -> Any:
    """reschedule; optionally fail, or retry once (0.5 s countdown); reports the delivery's parent and root."""
    _run(self, key, duration)
    if retry and self.request.retries == 0:
        raise self.retry(countdown=0.5)
    if fail:
        raise RuntimeError("failing on purpose")
    return {"id": self.request.id, "parent": self.request.parent_id, "root": self.request.root_id}


@app.task(
    base=LockedTask, bind=True, lock_unique_on=["key"], lock_on_duplicate="reschedule", lock_max_waiting=1, lock_ttl=2
)
def a_capped_one(self: Any, key: str, duration: float = 0.0) -> str:
    """reschedule with at most 1 waiting duplicate per key, a 2 s lease."""
    _run(self, key, duration)
    return self.request.id


@app.task(base=LockedTask, bind=True, lock_unique_on=["key"], lock_on_duplicate="reschedule", serializer="pickle")
def a_pickled(self: Any, key: str, duration: float = 0.0, info: Any = None) -> str:
    """reschedule, sent with pickle: returns the repr of what it was given."""
    _run(self, key, duration)
    return repr(info)
'''


@pytest.fixture(scope="module")
def c(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    tmp = tmp_path_factory.mktemp("reschedule")
    appdir = tmp / "app"
    appdir.mkdir()
    (appdir / "attack_app.py").write_text(textwrap.dedent(ATTACK_APP))
    with cluster(tmp, ttl=TTL) as c:
        for name in ("w1", "w2"):
            _worker(c, appdir, name)
        c.app_module()
        sys.path.insert(0, str(appdir))
        c.appdir = appdir  # type: ignore[attr-defined]
        try:
            yield c
        finally:
            sys.modules.pop("attack_app", None)
            with contextlib.suppress(ValueError):
                sys.path.remove(str(appdir))


def _worker(
    c: Cluster,
    appdir: Path,
    name: str,
    *,
    queues: str | None = None,
    concurrency: int = 2,
    env: dict[str, str] | None = None,
) -> CeleryWorker:
    worker = CeleryWorker(
        "attack_app",
        name,
        cwd=str(appdir),
        log_path=str(c.tmp / f"{name}.log"),
        concurrency=concurrency,
        # The caller's PYTHONPATH stays (after the apps): the package under test, not an installed one.
        env={
            **c.env,
            "PYTHONPATH": os.pathsep.join(filter(None, [str(APPS), os.environ.get("PYTHONPATH")])),
            "C_FORCE_ROOT": "1",
            **(env or {}),
        },
        extra=["-Q", queues] if queues else [],
    )
    c.workers.append(worker)
    return worker.start()


def attack(c: Cluster) -> ModuleType:
    c.app_module()
    import attack_app  # noqa: PLC0415

    return attack_app


def logs(c: Cluster) -> str:
    return "".join(w.log() for w in c.workers)


def line_of(c: Cluster, key: str) -> int:
    """How many jobs wait in ``key``'s line on the first lock node."""
    mod = c.app_module()
    from celery_singleton_lock.lock.redlock import sibling_key  # noqa: PLC0415

    with c.lock_client(c.locks[0]) as client:
        return int(client.zcard(sibling_key(mod.work_later.lock_key_for(key), ":waiters")))


def test_waiting_duplicates_are_woken_by_the_release_not_by_polling(c: Cluster) -> None:
    """A 3 s holder and three duplicates: each runs once, one after another, each started by the release before it;
    the first duplicate was re-sent once (its fallback), where polling every renewal interval re-sent it 2-3 times.
    Nobody is left in the line."""
    mod = c.app_module()
    k = new_key()
    holder = mod.work_later.delay(k, 3.0)
    c.wait_started(k)
    dups = [mod.work_later.delay(k, 0.2) for _ in range(3)]
    for r in [holder, *dups]:
        assert r.get(timeout=40) == k
    runs = c.wait_runs(k, 4, 10)
    assert len(runs) == 4
    assert not overlapping(runs)
    assert sorted(r[1] for r in runs) == sorted(r.id for r in [holder, *dups])
    resent = re.findall(rf"work_later\[{dups[0].id}\] deferred in [^:]*: re-sent to run in", logs(c))
    assert len(resent) == 1, resent
    assert line_of(c, k) == 0


def test_a_dead_holder_s_waiters_run_after_its_lease_ends(c: Cluster) -> None:
    """The holder's pool child is SIGKILLed: no release wakes anyone, so the waiting duplicate's fallback copy runs it
    once the dead lease has ended; the holder's own redelivered message runs too. Each once, never together."""
    mod = c.app_module()
    k = new_key()
    holder = mod.work_later.delay(k, 3.0)
    pid = c.wait_started(k)[0][2]
    dup = mod.work_later.delay(k, 0.2)
    for _ in polling(10, 0.05):
        if line_of(c, k) == 1:
            break
    assert line_of(c, k) == 1, "the duplicate did not wait in line"
    os.kill(pid, signal.SIGKILL)
    assert dup.get(timeout=40) == k
    assert holder.get(timeout=40) == k
    runs = c.wait_runs(k, 2, 10)
    assert sorted(r[1] for r in runs) == sorted([holder.id, dup.id])
    assert not overlapping(runs)


def test_replace_keeps_the_newest_waiting_call_and_tells_the_replaced_callers(c: Cluster) -> None:
    """lock_on_duplicate="replace": three calls while one runs: each newer call takes the waiting one's place; the
    replaced callers get REVOKED naming the task that replaced them; the newest runs once, after the holder, with
    its own arguments; the replaced jobs' fallback copies stop without running."""
    from celery.exceptions import TaskRevokedError  # noqa: PLC0415

    mod = c.app_module()
    k = new_key()
    holder = mod.latest.delay(k, "v0", 2.0)
    c.wait_started(k)
    waiting = []
    for value in ("v1", "v2", "v3"):
        waiting.append(mod.latest.delay(k, value))
        for _ in polling(10, 0.05):  # the call is in line before the next is sent (arrival order is the point)
            if waiting[-1].id in latest_line_ids(c, k):
                break
        assert waiting[-1].id in latest_line_ids(c, k), f"{value} did not wait in line"
    assert holder.get(timeout=30) == "v0"
    assert waiting[2].get(timeout=30) == "v3"
    for older, newer in itertools.pairwise(waiting):
        with pytest.raises(TaskRevokedError, match=f"superseded by task {newer.id}"):
            older.get(timeout=10)
    for _ in polling(TTL + 3, 0.2):  # the replaced jobs' fallback copies come back and must stop
        pass
    runs = c.runs(k)
    assert sorted(r[1] for r in runs) == sorted([holder.id, waiting[2].id])
    assert not overlapping(runs)


def latest_line_ids(c: Cluster, key: str) -> list[str]:
    mod = c.app_module()
    from celery_singleton_lock.lock.redlock import sibling_key  # noqa: PLC0415

    with c.lock_client(c.locks[0]) as client:
        return [x.decode() for x in client.zrange(sibling_key(mod.latest.lock_key_for(key, "any"), ":waiters"), 0, -1)]


def line_ids(c: Cluster, lock_key: str) -> list[str]:
    with contextlib.closing(c.lock_client(c.locks[0])) as client:
        return [x.decode() for x in client.zrange(sibling_key(lock_key, ":waiters"), 0, -1)]


def wait_in_line(c: Cluster, lock_key: str, task_id: str, timeout: float = 10) -> None:
    for _ in polling(timeout, 0.05):
        if task_id in line_ids(c, lock_key):
            return
    raise AssertionError(f"{task_id} never waited in the line of {lock_key}")


def wait_log(c: Cluster, pattern: str, timeout: float = 10) -> None:
    for _ in polling(timeout, 0.05):
        if re.search(pattern, logs(c)):
            return
    raise AssertionError(f"no log line matching {pattern!r} within {timeout} s")


def run_ids(c: Cluster, key: str) -> list[str]:
    return [r[1] for r in sorted(c.runs(key), key=lambda r: r[3])]


# --- reschedule: exactly once --------------------------------------------------------------------------------------


@pytest.mark.parametrize("holder_does", ["succeed", "fail", "retry"])
def test_twenty_duplicates_each_run_exactly_once(c: Cluster, holder_does: str) -> None:
    """20 duplicates of a holder that succeeds, fails or retries once: every call runs exactly
    once, never two runs of the key at once, and the line is empty afterwards."""
    mod = attack(c)
    k = new_key()
    holder = mod.a_later.delay(k, 1.5, fail=holder_does == "fail", retry=holder_does == "retry")
    c.wait_started(k)
    dups = [mod.a_later.delay(k, 0.02) for _ in range(20)]
    for r in dups:
        assert r.get(timeout=40)["id"] == r.id
    expected = 22 if holder_does == "retry" else 21
    runs = c.wait_runs(k, expected, 10)
    ids = [r[1] for r in runs]
    assert sorted(ids) == sorted([holder.id] * (expected - 20) + [r.id for r in dups])
    assert not overlapping(runs)
    assert line_ids(c, mod.a_later.lock_key_for(k)) == []


def test_line_node_restarted_empty_mid_wait_still_runs_each_once(c: Cluster) -> None:
    """The line's node is stopped and restarted empty while three duplicates wait: each still runs
    exactly once (its fallback copy), the holder keeps its lock on the other two nodes."""
    mod = attack(c)
    k = new_key()
    holder = mod.a_later.delay(k, 3.0)
    c.wait_started(k)
    dups = [mod.a_later.delay(k, 0.1) for _ in range(3)]
    for r in dups:
        wait_in_line(c, mod.a_later.lock_key_for(k), r.id)
    c.stop_locks(1)
    time.sleep(0.3)
    c.start_locks()
    for r in [holder, *dups]:
        r.get(timeout=40)
    runs = c.wait_runs(k, 4, 10)
    assert sorted(r[1] for r in runs) == sorted(r.id for r in [holder, *dups])
    assert not overlapping(runs)


def test_a_long_holder_s_duplicate_is_re_sent_once_per_holder_lease(c: Cluster) -> None:
    """README said "one re-sent message per wait": a duplicate of a holder that runs 3 ttl is re-sent
    once per holder lease (its fallback copy finds the holder alive and sends another), each time to run when the
    lease it saw ends; not once per renewal interval, as before the line."""
    mod = attack(c)
    k = new_key()
    holder = mod.a_later.delay(k, 3 * TTL)
    c.wait_started(k)
    dup = mod.a_later.delay(k, 0.05)
    assert holder.get(timeout=40)
    assert dup.get(timeout=20)["id"] == dup.id
    resent = re.findall(rf"a_later\[{dup.id}\] deferred in [^:]*: re-sent to run in ([0-9.]+)s", logs(c))
    # Each re-send waits out the holder's lease as it saw it: renewed every ttl/3 to a full ttl, so about 2/3 ttl to
    # ttl away (plus up to 0.25 s of jitter; the low end is loose for a late renewal), never a renewal interval.
    assert all(TTL / 2 <= float(countdown) <= TTL + 0.3 for countdown in resent), resent
    # A holder 3 ttl long: at most one re-send per lease it started (3) and the one it ends in; at least two, since
    # it outlived the first lease (the first fallback found it alive).
    assert 2 <= len(resent) <= 4, resent


# --- the line's message ----------------------------------------------------------------------------------------------


def test_the_woken_copy_runs_with_the_caller_s_arguments(c: Cluster) -> None:
    """a task sent with serializer="pickle" whose argument is a dict with int keys: the line stores the
    woken copy as kombu JSON, which turned the keys into strings (and tuples into lists), so the job ran with
    different arguments than its caller sent ({'1': 'a'} instead of {1: 'a'}). Fixed: a task whose serializer is
    not JSON does not join the line (its fallback copy, sent with its own serializer, runs it)."""
    mod = attack(c)
    k = new_key()
    holder = mod.a_pickled.delay(k, 1.5)
    c.wait_started(k)
    dup = mod.a_pickled.delay(k, 0.0, info={1: "a"})
    holder.get(timeout=20)
    assert dup.get(timeout=20) == repr({1: "a"})


def test_eager_apply_of_a_duplicate_does_not_join_the_line(c: Cluster) -> None:
    """apply() (eager) of a rescheduled duplicate raises DuplicateTaskError at once, as documented, but
    before_start parked it first (_park has no is_eager check): its message waits in the line, and the holder's
    release publishes it, so the job the caller was told was NOT run runs on a worker."""
    from celery_singleton_lock import DuplicateTaskError  # noqa: PLC0415

    mod = attack(c)
    k = new_key()
    holder = mod.a_later.delay(k, 1.5)
    c.wait_started(k)
    eager = mod.a_later.apply(args=(k, 0.0))
    assert isinstance(eager.result, DuplicateTaskError)
    holder.get(timeout=20)
    for _ in polling(3, 0.1):
        pass
    assert eager.id not in run_ids(c, k)
    assert line_ids(c, mod.a_later.lock_key_for(k)) == []


# --- replace ------------------------------------------------------------------------------------------------------


def test_fifty_rapid_replaces_leave_one_run_and_forty_nine_revoked(c: Cluster) -> None:
    """(See the report.) 50 calls while one runs: exactly one of them runs, the other 49 are REVOKED "superseded
    by", none stays PENDING, none runs."""
    mod = c.app_module()
    k = new_key()
    holder = mod.latest.delay(k, "v0", 2.0)
    c.wait_started(k)
    calls = [mod.latest.delay(k, f"v{i}") for i in range(1, 51)]
    assert holder.get(timeout=30) == "v0"
    for _ in polling(TTL + 4, 0.2):  # every fallback copy has come back and stopped
        pass
    ran = [x for x in run_ids(c, k) if x != holder.id]
    states = c.states([r.id for r in calls])
    assert len(ran) == 1, ran
    assert sorted(states.values()) == ["REVOKED"] * 49 + ["SUCCESS"], states
    assert states[ran[0]] == "SUCCESS"


def test_an_older_call_never_replaces_a_newer_one(c: Cluster) -> None:
    """an older call that could not join the line (its node was down when it arrived) keeps only its
    fallback copy, which carries no "parked" header: it does not look for a supersession, and when it comes back
    (the node up again, a newer call waiting) _PARK_REPLACING replaces whatever waits, the NEWER call: the newer
    caller gets REVOKED "superseded by <older>" and the older call's arguments run."""
    from celery.exceptions import TaskRevokedError  # noqa: PLC0415

    mod = c.app_module()
    k = new_key()
    lock_key = mod.latest.lock_key_for(k, "any")
    holder = mod.latest.delay(k, "v0", 7.0)
    c.wait_started(k)
    c.stop_locks(1)
    try:
        old = mod.latest.delay(k, "old")
        wait_log(c, rf"latest\[{old.id}\] deferred")
    finally:
        c.start_locks()
    new = mod.latest.delay(k, "new")
    wait_in_line(c, lock_key, new.id)
    assert holder.get(timeout=30) == "v0"
    with pytest.raises(TaskRevokedError):
        old.get(timeout=20)
    assert new.get(timeout=20) == "new"


def test_a_chord_member_waiting_in_line_is_never_replaced(c: Cluster) -> None:
    """policies.md: "Chord members always reschedule: a skipped member would fail the chord, one that stored
    nothing would hang it". A chord member of a "replace" task waited in the line (plain ZADD); a newer plain call
    then parked with _PARK_REPLACING, which replaced EVERY other waiting id, the chord member's too: the chord
    never ended. Fixed: a chord member of a "replace" task never joins the line (its fallback copy runs it)."""
    from celery import chord  # noqa: PLC0415

    mod = c.app_module()
    k = new_key()
    lock_key = mod.latest.lock_key_for(k, "any")
    holder = mod.latest.delay(k, "v0", 2.0)
    c.wait_started(k)
    result = chord([mod.latest.s(k, "member")], mod.collect.s()).delay()
    time.sleep(0.5)  # the member has met the holder and waits (not in line)
    newer = mod.latest.delay(k, "newer")
    wait_in_line(c, lock_key, newer.id)
    assert holder.get(timeout=20) == "v0"
    assert result.get(timeout=25) == ["member"]


def test_documented_acl_user_keeps_replace_semantics(c: Cluster) -> None:
    """docs/nodes.md's ACL command set had no ZADD/ZRANGE/ZREM/ZPOPMIN: with that user, a "replace"
    duplicate could not join the line (the NOPERM swallowed at DEBUG), so nothing was ever replaced. Fixed in the
    docs; this runs replace with a user restricted to exactly the documented set."""
    from celery.exceptions import TaskRevokedError  # noqa: PLC0415

    mod = c.app_module()
    urls = []
    for server in c.locks:
        with contextlib.closing(server.client()) as admin:
            admin.execute_command(
                "ACL", "SETUSER", "locker", "reset", "on", ">AclPw7Zq", "~singleton_lock:*", "~{singleton_lock:*",
                "resetchannels", "-@all", *ACL_COMMANDS.split(),
            )  # fmt: skip
        urls.append(f"redis://locker:AclPw7Zq@127.0.0.1:{server.port}/0")
    worker = _worker(c, c.appdir, "wacl", queues="acl", env={"CSL_LOCK_URLS": ",".join(urls)})  # type: ignore[attr-defined]
    try:
        k = new_key()
        holder = mod.latest.apply_async((k, "v0", 2.0), queue="acl")
        c.wait_started(k)
        waiting = []
        for value in ("v1", "v2"):
            waiting.append(mod.latest.apply_async((k, value), queue="acl"))
            wait_log(c, rf"latest\[{waiting[-1].id}\] deferred")
        assert holder.get(timeout=20) == "v0"
        assert waiting[1].get(timeout=30) == "v2"
        with pytest.raises(TaskRevokedError):
            waiting[0].get(timeout=10)
    finally:
        worker.kill()


def _host() -> str:
    import socket  # noqa: PLC0415

    return socket.gethostname()


def test_a_killed_job_s_redelivery_keeps_its_place_against_lock_max_waiting(c: Cluster) -> None:
    """Issue 29 finding 4 (another re-send): a job whose whole worker was SIGKILLed comes back by the visibility
    timeout while another job holds its key and the line is full (lock_max_waiting=1): it is that job again, so it
    waits in line and runs; it is not REVOKED "line full" as a new duplicate."""
    mod = attack(c)
    appdir = c.appdir  # type: ignore[attr-defined]
    short = {"CSL_VISIBILITY": "15"}  # only these workers restore unacked messages, 15 s after their delivery
    doomed = _worker(c, appdir, "wdoomed", queues="redeliver", concurrency=1, env=short)
    k = new_key("bounded")  # its runs end early once the test sets release:<k> (locked_app._run)
    killed = mod.a_capped_one.apply_async((k, 8.0), queue="redeliver")
    c.wait_started(k)
    doomed.kill()  # its message stays unacked; its lease ends within 2 s (nobody renews it)
    heir = _worker(c, appdir, "wheir", queues="redeliver", concurrency=3, env=short)
    try:
        assert c.wait_lock_free(mod.a_capped_one.lock_key_for(k), 10) is not None
        holder = mod.a_capped_one.apply_async((k, 20.0), queue="redeliver")
        c.wait_started(k, 2)
        queued = mod.a_capped_one.apply_async((k, 0.0), queue="redeliver")
        wait_log(c, rf"a_capped_one\[{queued.id}\] deferred")  # it waits in line: the line is full
        # The killed job's redelivery (the visibility timeout) meets the holder and waits; the holder's 20 s is only a
        # bound for that: once the redelivery waits, the holder (and the job's run after it) ends at once. Not seen
        # before the holder's end: nothing is cut short, as before.
        for _ in polling(30, 0.1):
            if re.search(rf"a_capped_one\[{killed.id}\] deferred", logs(c)):
                c.record.set(f"release:{k}", 1)
                break
            if holder.ready():
                break
        assert killed.get(timeout=60) == killed.id
        assert holder.get(timeout=30) == holder.id
        assert queued.get(timeout=10) == queued.id
        assert not overlapping(c.runs(k))
    finally:
        heir.kill()
