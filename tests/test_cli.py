"""``celery -A app locks ...`` against real throwaway redis-servers.

Locks are written directly with Redlock and LockedTask-shaped holder tokens under a prefix of the test's own; one
test runs the real ``celery`` program in a subprocess, the others call the click group in-process (CliRunner) or
the pure functions it is built on.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import uuid
from collections.abc import Sequence
from pathlib import Path

import pytest
import redis
from celery import Celery
from celery.bin.base import CLIContext
from click.testing import CliRunner, Result

from celery_singleton_lock import Redlock, keys
from celery_singleton_lock.cli import list_locks, locks, read_stats, release_lock, show_lock
from celery_singleton_lock.config import settings_for
from celery_singleton_lock.redlock import fence_key_for
from celery_singleton_lock.testing import RedisServer, free_port

CELERY = str(Path(sys.executable).parent / "celery")


@pytest.fixture
def prefix() -> str:
    """A key prefix no other test uses."""
    return f"clitest-{uuid.uuid4().hex[:12]}:"


def make_app(urls: Sequence[str], prefix: str) -> Celery:
    app = Celery("cli_test", broker="memory://", set_as_current=False)
    app.conf.update(singleton_lock_urls=list(urls), singleton_lock_prefix=prefix)
    return app


def hold(
    urls: Sequence[str], key: str, task_id: str = "task-1", ttl: float = 30.0, fence_key: str | None = None
) -> Redlock:
    token = keys.holder_token(task_id, "reports.rebuild")
    lock = Redlock(list(urls), key, ttl=ttl, token=token, fence_key=fence_key)
    assert lock.acquire(blocking=False)
    return lock


def run(app: Celery, *args: str, stdin: str | None = None) -> Result:
    return CliRunner().invoke(locks, list(args), obj=CLIContext(app=app, no_color=True, workdir=None), input=stdin)


@pytest.fixture
def trio_urls(redis_trio: list[RedisServer]) -> list[str]:
    return [s.url for s in redis_trio]


def test_list_json_in_a_real_celery_process(tmp_path: Path, trio_urls: list[str], prefix: str) -> None:
    """`celery -A app locks list --json` lists a held lock with its task id and fencing token, not its counters."""
    key = f"{prefix}reports.rebuild:abc"
    lock = hold(trio_urls, key, "task-42", fence_key=f"{prefix}fence")  # as LockedTask: the prefix's counter
    for url in trio_urls[:2]:
        redis.Redis.from_url(url).hincrby(f"{prefix}stats", "acquired", 1)
    (tmp_path / "cli_app.py").write_text(
        "from celery import Celery\n"
        "app = Celery('cli_app', broker='memory://')\n"
        f"app.conf.singleton_lock_urls = {trio_urls!r}\n"
        f"app.conf.singleton_lock_prefix = {prefix!r}\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run(
        [CELERY, "-A", "cli_app", "locks", "list", "--json"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    listed = json.loads(proc.stdout)
    assert [e["key"] for e in listed] == [key]
    (entry,) = listed
    assert entry["state"] == "held"
    assert entry["task_id"] == "task-42"
    assert entry["task_name"] == "reports.rebuild"
    assert entry["fencing_token"] == lock.fencing_token
    assert entry["holding"] == entry["total"] == 3
    assert entry["worker"] == f"{os.getpid()}@{keys._HOST}"
    assert 0 < entry["ttl"] <= 30


def test_table_shows_held_and_partial_locks(trio_urls: list[str], prefix: str) -> None:
    """The default table shows a quorum-held lock as held and a key on one node only as partial; --match filters."""
    hold(trio_urls, f"{prefix}reports.rebuild:held", "task-held")
    hold(trio_urls[:1], f"{prefix}beat:nightly", "task-partial")
    app = make_app(trio_urls, prefix)

    result = run(app, "list")
    assert result.exit_code == 0, result.output
    header, *rows = result.stdout.splitlines()
    assert header.split() == ["KEY", "TASK", "TASK", "ID", "WORKER", "AGE", "TTL", "FENCE", "NODES", "STATE"]
    by_key = {row.split()[0]: row.split() for row in rows}
    assert len(by_key) == 2
    task, task_id, _, _, _, _, nodes, state = by_key[f"{prefix}reports.rebuild:held"][1:]
    assert (task, task_id, nodes, state) == ("reports.rebuild", "task-held", "3/3", "held")
    assert by_key[f"{prefix}beat:nightly"][-2:] == ["1/3", "partial"]

    only = run(app, "list", "--match", "beat:*", "--json")
    assert [e["key"] for e in json.loads(only.stdout)] == [f"{prefix}beat:nightly"]


def test_release_yes_frees_every_node_and_logs_who(
    trio_urls: list[str], prefix: str, caplog: pytest.LogCaptureFixture
) -> None:
    """`release KEY --yes` deletes the key on every node, keeps the fencing counters, and logs who did it."""
    key = f"{prefix}reports.rebuild:stuck"
    lock = hold(trio_urls, key)
    app = make_app(trio_urls, prefix)
    clients = settings_for(app).nodes.clients

    with caplog.at_level(logging.WARNING, logger="celery_singleton_lock.cli"):
        result = run(app, "release", key, "--yes")
    assert result.exit_code == 0, result.output
    assert "released on 3 of 3 node(s)" in result.stdout
    assert [c.exists(key) for c in clients] == [0, 0, 0]
    assert [int(c.get(fence_key_for(key)) or 0) for c in clients] == [lock.fencing_token] * 3
    (record,) = [r for r in caplog.records if r.name == "celery_singleton_lock.cli"]
    assert record.levelno == logging.WARNING
    assert key in record.getMessage()
    assert f"(pid {os.getpid()})" in record.getMessage()
    assert run(app, "list", "--json").stdout.strip() == "[]"


def test_release_leaves_a_newer_holder_alone(trio_urls: list[str], prefix: str) -> None:
    """A holder that acquired between the read and the release keeps its lock: the delete compares the token."""
    key = f"{prefix}reports.rebuild:race"
    old = hold(trio_urls, key, "task-old")
    settings = settings_for(make_app(trio_urls, prefix))
    seen = show_lock(settings, key).value[1]

    # The old lease ends (expired, or released) and a new run acquires before the operator confirms.
    assert old.release()
    new = hold(trio_urls, key, "task-new")

    report = release_lock(settings, key, seen)
    assert [r.outcome for r in report.value] == ["changed"] * 3
    assert all(r.token == new.token for r in report.value)
    assert new.owned()


def test_refusing_the_confirmation_keeps_the_lock(redis_node: RedisServer, prefix: str) -> None:
    """On one node, answering 'n' to the prompt releases nothing and exits non-zero."""
    key = f"{prefix}reports.rebuild:keep"
    lock = hold([redis_node.url], key)
    result = run(make_app([redis_node.url], prefix), "release", key, stdin="n\n")
    assert result.exit_code == 1
    assert "Force-release" in result.stdout
    assert "nothing released" in result.stdout
    assert lock.owned()


def test_unreachable_node_is_named_without_its_password(trio_urls: list[str], prefix: str) -> None:
    """A dead node gets one error line with its redacted address; the others' answers are still listed."""
    key = f"{prefix}reports.rebuild:dead"
    hold(trio_urls, key, "task-dead")
    port = free_port()
    app = make_app([*trio_urls, f"redis://:s3cret@127.0.0.1:{port}/0"], prefix)

    result = run(app, "list")
    assert result.exit_code == 0, result.output  # 3 of 4 answered: a quorum
    assert "task-dead" in result.stdout
    assert f"127.0.0.1:{port}" in result.stderr
    assert "s3cret" not in result.output
    for args in (("show", key), ("stats",), ("release", key, "--yes")):
        assert "s3cret" not in run(app, *args).output


def test_no_quorum_answering_exits_non_zero(redis_node: RedisServer, prefix: str) -> None:
    """With two of three nodes down the command still shows what the third says, and exits 1."""
    key = f"{prefix}reports.rebuild:minority"
    hold([redis_node.url], key, "task-minority")
    ports = {free_port()}
    while len(ports) < 2:
        ports.add(free_port())
    dead = [f"redis://127.0.0.1:{port}/0" for port in ports]
    result = run(make_app([redis_node.url, *dead], prefix), "list", "--json")
    assert result.exit_code == 1
    (entry,) = json.loads(result.stdout)
    assert (entry["task_id"], entry["state"], entry["holding"]) == ("task-minority", "partial", 1)
    assert "only 1 of 3 node(s) answered" in result.stderr


def test_stats_sum_the_hash_over_the_nodes(trio_urls: list[str], prefix: str) -> None:
    """`stats` adds up the workers' counters flushed to different nodes."""
    settings = settings_for(make_app(trio_urls, prefix))
    first, second, _ = settings.nodes.clients
    first.hset(f"{prefix}stats", mapping={"acquired": 5, "skipped": 2})
    second.hset(f"{prefix}stats", mapping={"acquired": 1, "lost": 1})

    assert read_stats(settings).value == {"acquired": 6, "skipped": 2, "lost": 1, "released": 0, "unavailable": 0}
    result = run(make_app(trio_urls, prefix), "stats", "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["acquired"] == 6


def test_list_locks_skips_counters_and_other_types(trio_urls: list[str], prefix: str) -> None:
    """The pure listing ignores fencing counters, the stats hash and non-string keys under the prefix."""
    hold(trio_urls, f"{prefix}{{tagged}}job:1")  # a hash-tagged key: its counter is KEY:fence, under the prefix
    settings = settings_for(make_app(trio_urls, prefix))
    settings.nodes.clients[0].rpush(f"{prefix}some-list", "x")
    assert [i.key for i in list_locks(settings).value] == [f"{prefix}{{tagged}}job:1"]
