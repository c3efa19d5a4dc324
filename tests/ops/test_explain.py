"""``celery locks explain TASK --args --kwargs``: what a call would meet now, read from real nodes while a real
worker holds the lock (and after the rate of a real worker's starts is used up)."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from worker_cluster import APPS, Cluster, cluster, new_key

CELERY = [sys.executable, "-m", "celery", "-A", "locked_app", "locks", "explain"]


@pytest.fixture(scope="module")
def workers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """A broker, three lock nodes and one real worker (prefork, two processes)."""
    with cluster(tmp_path_factory.mktemp("explain"), ttl=5.0) as cl:
        cl.worker("explain", concurrency=2)
        yield cl


def explain(cl: Cluster, task: str, *args: str) -> subprocess.CompletedProcess[str]:
    """Run the real ``celery -A locked_app locks explain TASK ...`` program."""
    env = {**os.environ, **cl.env}
    env["PYTHONPATH"] = os.pathsep.join(
        [str(APPS), str(Path(__file__).parent.parent.parent), env.get("PYTHONPATH", "")]
    )
    return subprocess.run([*CELERY, task, *args], env=env, capture_output=True, text=True, timeout=60, check=False)


def explained(cl: Cluster, task: str, **kwargs: Any) -> dict[str, Any]:
    result = explain(cl, task, "--kwargs", json.dumps(kwargs), "--json")
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)  # type: ignore[no-any-return]


def test_a_held_key_names_its_holder_and_the_nodes_that_disagree(workers: Cluster) -> None:
    """While a worker runs the job, the call would be skipped: the holder's task id, worker, start and fencing
    token are named; with the record gone from one node, each node's answer is shown."""
    mod = workers.app_module()
    key = new_key("explain")
    running = mod.work.delay(key=key, duration=20.0)
    workers.wait_started(key)
    found = explained(workers, "locked_app.work", key=key)
    assert found["verdict"] == "skipped"
    holder = found["slots"][0]
    assert found["key"] == holder["key"] == mod.work.lock_key_for(key=key)
    assert holder["task_id"] == running.id
    assert "explain@" in holder["worker"] or "@" in holder["worker"]
    assert isinstance(holder["fencing_token"], int)
    assert holder["acquired_at"] is not None
    assert any(running.id in why for why in found["why"])
    assert found["disagreements"] == {}
    text = explain(workers, "locked_app.work", "--kwargs", json.dumps({"key": key}))
    assert text.stdout.startswith("locked_app.work: skipped\n  because ")
    assert running.id in text.stdout
    # Another owner's record on one node (renewal re-takes a node where the key is gone, never another's record).
    with contextlib.closing(workers.lock_client(workers.locks[0])) as node:
        node.delete(found["key"])
        node.hset(found["key"], mapping={"owner": "other", "job": "other-job", "state": "run", "fence": "1"})
        node.pexpire(found["key"], 30_000)
    split = explained(workers, "locked_app.work", key=key)
    assert split["verdict"] == "skipped"  # two of three still hold it: a quorum
    answers = split["disagreements"][found["key"]]
    assert len(answers) == 3
    assert sum("other-job" in a for a in answers) == 1
    assert sum(running.id in a for a in answers) == 2
    mod.app.control.revoke(running.id, terminate=True)


def test_a_used_up_rate_says_when_a_share_frees(workers: Cluster) -> None:
    """After two starts of a 2-per-minute rate key, the next call would wait, and the answer says in how long a
    share frees (within the minute) and what each node counted."""
    mod = workers.app_module()
    key = new_key("rated")
    assert explained(workers, "locked_app.rated_work", key=key)["verdict"] == "runs"
    for _ in range(2):
        mod.rated_work.delay(key=key).get(timeout=30)
    found = explained(workers, "locked_app.rated_work", key=key)
    assert found["verdict"] == "rate-waits"
    assert 0 < found["rate"]["frees_in"] <= 60
    assert [len(n["starts_ago"]) for n in found["rate"]["nodes"]] == [2, 2, 2]
    assert found["rate"]["key"] == mod.rated_work.lock_rate_key_for(key=key)


def test_arguments_that_are_not_json_or_not_a_locked_task_say_what_to_change(workers: Cluster) -> None:
    """Bad --args and an unknown task are one-line usage errors."""
    bad = explain(workers, "locked_app.work", "--args", "[1,")
    assert bad.returncode == 2
    assert "not JSON" in bad.stderr
    unknown = explain(workers, "locked_app.nope")
    assert unknown.returncode == 1
    assert "is not a LockedTask of this app" in unknown.stderr


@pytest.mark.parametrize(
    ("task", "kwargs", "verdict", "says"),
    [
        ("locked_app.latest", {"value": "v"}, "replaces", "an older waiting call is superseded by it"),
        ("locked_app.rebuild", {"n": 1}, "cancels", "the running holder is asked to stop"),
    ],
)
def test_replace_and_cancel_say_what_they_do_to_the_holder(
    workers: Cluster, task: str, kwargs: dict[str, Any], verdict: str, says: str
) -> None:
    """While a job runs, a call under 'replace' waits behind it (the holder runs to its end; an older waiting call
    is superseded), and one under 'cancel' asks the running holder to stop and runs after it: explain says which."""
    mod = workers.app_module()
    key = new_key("explain")
    holder = getattr(mod, task.split(".")[1]).delay(key=key, duration=20.0, **kwargs)
    workers.wait_started(key)
    try:
        found = explained(workers, task, key=key, **kwargs)
        assert found["verdict"] == verdict, found
        assert any(says in why for why in found["why"]), found["why"]
        assert not any("the holder is revoked" in why for why in found["why"]), found["why"]
    finally:
        mod.app.control.revoke(holder.id, terminate=True)
