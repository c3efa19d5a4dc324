"""lock_on_duplicate="reschedule" without polling: a duplicate waits in its key's line and is woken by the release.

Real workers (tests/apps/locked_app.py, ``work_later``) on a Redis broker and three lock nodes, ttl 4 s (renewal
every 1.33 s: the old behaviour re-sent a waiting duplicate about that often).
"""

from __future__ import annotations

import itertools
import os
import re
import signal
from collections.abc import Iterator

import pytest
from worker_cluster import Cluster, cluster, new_key, overlapping, polling

pytestmark = pytest.mark.slow
TTL = 4.0


@pytest.fixture(scope="module")
def c(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with cluster(tmp_path_factory.mktemp("reschedule"), ttl=TTL) as c:
        c.worker("w1")
        c.worker("w2")
        c.app_module()
        yield c


def logs(c: Cluster) -> str:
    return "".join(w.log() for w in c.workers)


def line_of(c: Cluster, key: str) -> int:
    """How many jobs wait in ``key``'s line on the first lock node."""
    mod = c.app_module()
    from celery_singleton_lock.redlock import sibling_key  # noqa: PLC0415

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
            if waiting[-1].id in line_ids(c, k):
                break
        assert waiting[-1].id in line_ids(c, k), f"{value} did not wait in line"
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


def line_ids(c: Cluster, key: str) -> list[str]:
    mod = c.app_module()
    from celery_singleton_lock.redlock import sibling_key  # noqa: PLC0415

    with c.lock_client(c.locks[0]) as client:
        return [x.decode() for x in client.zrange(sibling_key(mod.latest.lock_key_for(key, "any"), ":waiters"), 0, -1)]
