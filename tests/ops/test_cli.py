"""``celery -A app locks ...`` against real throwaway redis-servers.

Locks are written with Redlock the way the library writes them (holder records: LockedTask-shaped ``state``,
``job``, ``name``, ``worker``, ``at`` fields; beat claims and plain locks with owner and fence only), under a prefix
of the test's own; one test runs the real ``celery`` program in a subprocess, the others call the click group
in-process (CliRunner) or the pure functions it is built on.
"""

from __future__ import annotations

import json
import logging
import os
import re
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery
from celery.bin.base import CLIContext
from click.testing import CliRunner, Result

from celery_singleton_lock import Redlock
from celery_singleton_lock.lock import metrics
from celery_singleton_lock.lock.config import settings_for
from celery_singleton_lock.lock.redlock import done_key_for, fence_key_for
from celery_singleton_lock.ops.cli import (
    _TASK_STATES,
    STATES,
    done_marker_of,
    list_locks,
    locks,
    read_stats,
    release_lock,
    show_lock,
)
from celery_singleton_lock.policies import decision
from celery_singleton_lock.testing import RedisServer, free_port

CELERY = str(Path(sys.executable).parent / "celery")
WORKER = f"{os.getpid()}@{socket.gethostname()}"
COLUMNS = ["KEY", "STATE", "KIND", "TASK", "TASK ID", "WORKER", "AGE", "TTL", "FENCE", "NODES"]


@pytest.fixture
def prefix() -> str:
    """A key prefix no other test uses."""
    return f"clitest-{uuid.uuid4().hex[:12]}:"


def make_app(urls: Sequence[str], prefix: str) -> Celery:
    app = Celery("cli_test", broker="memory://", set_as_current=False)
    app.conf.update(singleton_lock_urls=list(urls), singleton_lock_prefix=prefix)
    return app


def task_lock(
    urls: Sequence[str],
    key: str,
    task_id: str = "task-1",
    *,
    ttl: float = 30.0,
    state: str = "run",
    fence_key: str | None = None,
    fencing: bool = True,
    at_ms: int | None = None,
) -> Redlock:
    """A Redlock writing the record LockedTask writes (not acquired yet)."""
    at = str(int(time.time() * 1000) if at_ms is None else at_ms)
    record = {"state": state, "name": "reports.rebuild", "worker": WORKER, "at": at}
    return Redlock(list(urls), key, ttl=ttl, job=task_id, record=record, fence_key=fence_key, fencing=fencing)


def hold(urls: Sequence[str], key: str, task_id: str = "task-1", **kwargs: Any) -> Redlock:
    """Acquire ``key`` as a LockedTask run of ``task_id`` would."""
    lock = task_lock(urls, key, task_id, **kwargs)
    assert lock.acquire(blocking=False)
    return lock


def run(app: Celery, *args: str, stdin: str | None = None) -> Result:
    return CliRunner().invoke(locks, list(args), obj=CLIContext(app=app, no_color=True, workdir=None), input=stdin)


def table(result: Result) -> dict[str, dict[str, str]]:
    """The rows of `locks list` by key, each as column -> value (columns split on two or more spaces)."""
    assert result.exit_code == 0, result.output
    header, *rows = result.stdout.splitlines()
    assert re.split(r" {2,}", header) == COLUMNS
    starts = [header.index(c) for c in COLUMNS]
    out: dict[str, dict[str, str]] = {}
    for row in rows:
        cells = [row[a:b].strip() for a, b in zip(starts, [*starts[1:], None], strict=True)]
        out[cells[0]] = dict(zip(COLUMNS, cells, strict=True))
    return out


def listed(app: Celery, *args: str) -> dict[str, dict[str, Any]]:
    """`locks list --json` by key."""
    result = run(app, "list", "--json", *args)
    assert result.exit_code == 0, result.output
    return {e["key"]: e for e in json.loads(result.stdout)}


@pytest.fixture
def trio_urls(redis_trio: list[RedisServer]) -> list[str]:
    return [s.url for s in redis_trio]


def test_list_json_in_a_real_celery_process(tmp_path: Path, trio_urls: list[str], prefix: str) -> None:
    """`celery -A app locks list --json` lists a running task's lock with its record's fields and own fence."""
    key = f"{prefix}reports.rebuild:abc"
    at_ms = int(time.time() * 1000) - 5000
    lock = hold(trio_urls, key, "task-42", fence_key=f"{prefix}fence", at_ms=at_ms)  # as LockedTask: the prefix's
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
    entries = json.loads(proc.stdout)
    assert [e["key"] for e in entries] == [key]  # not the counter, not the stats hash
    (entry,) = entries
    assert (entry["kind"], entry["state"]) == ("task", "running")
    assert (entry["task_id"], entry["task_name"], entry["worker"]) == ("task-42", "reports.rebuild", WORKER)
    assert entry["fencing_token"] == lock.fencing_token
    assert entry["owner"] == lock.token
    assert entry["holding"] == entry["total"] == 3
    assert entry["acquired_at"] == at_ms / 1000
    assert 5 <= entry["age"] < 60
    assert 0 < entry["ttl"] <= 30
    assert entry["waiting"] is False
    assert (entry["lock_key"], entry["type"]) == (key, "hash")
    assert entry["record"]["job"] == "task-42"
    assert entry["record"]["fence"] == str(lock.fencing_token)


def test_each_lock_shows_its_own_fencing_token(trio_urls: list[str], prefix: str) -> None:
    """Two jobs sharing the prefix's counter show their own tokens (75 and 76), not the counter's value twice."""
    app = make_app(trio_urls, prefix)
    settings = settings_for(app)
    for client in settings.nodes.clients:
        client.set(settings.fence_key, 74)
    first = hold(trio_urls, f"{prefix}reports.rebuild:first", "task-a", fence_key=settings.fence_key)
    second = hold(trio_urls, f"{prefix}reports.rebuild:second", "task-b", fence_key=settings.fence_key)
    assert (first.fencing_token, second.fencing_token) == (75, 76)

    rows = table(run(app, "list"))
    assert rows[first.name]["FENCE"] == "75"
    assert rows[second.name]["FENCE"] == "76"
    entries = listed(app)
    assert entries[first.name]["fencing_token"] == 75
    assert entries[second.name]["fencing_token"] == 76


def test_every_state_is_named(trio_urls: list[str], prefix: str) -> None:
    """Running, retry hand-over, ending, cooldown, beat claim and plain lock each show their own STATE and KIND."""
    running = hold(trio_urls, f"{prefix}reports.rebuild:running", "task-run")
    handed = hold(trio_urls, f"{prefix}reports.rebuild:retry", "task-retry")
    assert handed.transfer(60, {"state": "retry"})  # what LockedTask does on self.retry()
    ending = hold(trio_urls, f"{prefix}reports.rebuild:ending", "task-ending", ttl=30, state="ending", fencing=False)
    cooling = hold(trio_urls, f"{prefix}reports.rebuild:cool", "task-cool")
    assert cooling.finish(done_for=60, waited_for=60, cooldown=30)
    beat = Redlock(trio_urls, f"{prefix}beat:nightly:1732252800", ttl=30, fencing=False, token="beat@host:1:ab")
    assert beat.acquire(blocking=False)
    plain = Redlock(trio_urls, f"{prefix}invoice:42", ttl=30)
    assert plain.acquire(blocking=False)

    rows = table(run(make_app(trio_urls, prefix), "list"))
    assert {k: (r["STATE"], r["KIND"], r["FENCE"], r["NODES"]) for k, r in rows.items()} == {
        running.name: ("running", "task", str(running.fencing_token), "3/3"),
        handed.name: ("retry-wait", "task", str(handed.fencing_token), "3/3"),
        ending.name: ("ending", "task", "-", "3/3"),
        cooling.name: ("cooldown", "task", str(cooling.fencing_token), "3/3"),
        beat.name: ("held", "beat", "-", "3/3"),
        plain.name: ("held", "lock", str(plain.fencing_token), "3/3"),
    }
    assert rows[cooling.name]["TASK ID"] == "task-cool"
    assert rows[beat.name]["TASK ID"] == rows[beat.name]["WORKER"] == rows[beat.name]["AGE"] == "-"


def test_a_handed_lock_names_the_waiting_call_not_the_stopped_run_s_worker(trio_urls: list[str], prefix: str) -> None:
    """lock_on_duplicate="cancel": a run stopped for a newer call hands its lock to the waiting call (hand_on.lua).
    `locks list` shows it handed, under that call's task id, and names no worker: the waiting call runs nowhere yet,
    and the stopped run's worker is not its worker."""
    stopped = hold(trio_urls, f"{prefix}reports.rebuild:handed", "task-stopped")
    assert stopped.hand_on(30, {"state": "handed", "job": "task-waiting", "open": "1", "at": "1"}, done_for=60)
    rows = table(run(make_app(trio_urls, prefix), "list"))
    row = rows[stopped.name]
    assert (row["STATE"], row["KIND"], row["TASK ID"], row["NODES"]) == ("handed", "task", "task-waiting", "3/3"), row
    assert row["WORKER"] == "-", row
    assert listed(make_app(trio_urls, prefix))[stopped.name]["worker"] is None


@pytest.mark.parametrize("tagged", [False, True], ids=["untagged-prefix", "tagged-prefix"])
def test_done_markers_are_not_locks(trio_urls: list[str], prefix: str, tagged: bool) -> None:
    """A finished run's done marker is never listed as a lock; `--done` lists it as kind done; release refuses it."""
    if tagged:
        prefix = f"{{{prefix[:-1]}}}:"  # markers then live under the prefix itself: {p}:KEY:done:ID
    app = make_app(trio_urls, prefix)
    lock = hold(trio_urls, f"{prefix}reports.rebuild:finished", "task-done")
    assert lock.finish(done_for=60, waited_for=60)  # no cooldown: the lock is gone, only the marker is left
    marker = done_key_for(lock.name, "task-done")
    assert marker.startswith(prefix) is tagged
    assert done_marker_of(marker) == (lock.name, "task-done")
    assert all(c.exists(marker) for c in settings_for(app).nodes.clients)

    assert run(app, "list").stdout.strip() == f"no locks under {prefix!r}"
    assert listed(app) == {}
    rows = table(run(app, "list", "--done"))
    assert {k: (r["STATE"], r["KIND"], r["TASK ID"], r["NODES"]) for k, r in rows.items()} == {
        marker: ("done", "done", "task-done", "3/3"),
    }
    (entry,) = listed(app, "--done", "--match", "reports.rebuild:finished").values()
    assert (entry["key"], entry["lock_key"], entry["task_id"], entry["owner"]) == (marker, lock.name, "task-done", None)

    shown = run(app, "show", marker)
    assert "done: this task id finished: a done marker, not a lock" in shown.stdout
    refused = run(app, "release", marker, "--yes")
    assert refused.exit_code == 1
    assert "is a done marker: not released" in refused.stderr
    assert all(c.exists(marker) for c in settings_for(app).nodes.clients)


def test_cooldown_is_listed_once_as_cooling_down(trio_urls: list[str], prefix: str) -> None:
    """A success with lock_cooldown leaves one row, cooldown (not held), and its done marker is no second row."""
    app = make_app(trio_urls, prefix)
    lock = hold(trio_urls, f"{prefix}reports.rebuild:cool", "task-cool")
    assert lock.finish(done_for=60, waited_for=60, cooldown=30)

    (entry,) = listed(app).values()
    assert (entry["key"], entry["kind"], entry["state"]) == (lock.name, "task", "cooldown")
    assert entry["task_id"] == "task-cool"
    assert entry["owner"] != lock.token  # the finished run gave up its owner token
    assert entry["fencing_token"] == lock.fencing_token
    assert 0 < entry["ttl"] <= 30
    shown = run(app, "show", lock.name).stdout
    assert "cooldown: the run finished; the lock is kept for the task's lock_cooldown" in shown
    assert "held by" not in shown


def test_partial_and_split_locks_show_as_partial(trio_urls: list[str], prefix: str) -> None:
    """A record on one node of three, and two owners on one node each, are partial; two of three nodes is held."""
    app = make_app(trio_urls, prefix)
    lonely = hold(trio_urls[:1], f"{prefix}reports.rebuild:lonely", "task-lonely")
    split = f"{prefix}reports.rebuild:split"
    hold(trio_urls[:1], split, "task-x")
    hold(trio_urls[1:2], split, "task-y")
    majority = hold(trio_urls[:2], f"{prefix}reports.rebuild:two", "task-two")

    rows = table(run(app, "list"))
    assert (rows[lonely.name]["STATE"], rows[lonely.name]["NODES"]) == ("partial", "1/3")
    assert (rows[split]["STATE"], rows[split]["NODES"]) == ("partial", "1/3")
    assert (rows[majority.name]["STATE"], rows[majority.name]["NODES"]) == ("running", "2/3")
    entry = listed(app)[lonely.name]
    assert (entry["state"], entry["kind"], entry["record"]["state"]) == ("partial", "task", "run")
    assert "partial: a run record on 1/3 nodes (quorum 2), no owner has a quorum" in run(app, "show", split).stdout


def test_keys_that_are_not_holder_records_are_listed_as_foreign(trio_urls: list[str], prefix: str) -> None:
    """Other tools' keys and old-format string locks under the prefix are listed as foreign, never released."""
    app = make_app(trio_urls, prefix)
    clients = settings_for(app).nodes.clients
    old = f"{prefix}reports.rebuild:old-format"
    for client in clients[:2]:
        client.set(old, "1f0a|task-old|42@host|1732253052506|reports.rebuild", px=30_000)
    clients[2].rpush(f"{prefix}some-list", "x")
    clients[0].hset(f"{prefix}some-hash", mapping={"a": "1"})  # a hash, but no owner: not a record
    clients[0].hset(f"{prefix}stats", mapping={"acquired": "1"})  # the workers' counters: not listed
    clients[0].set(f"{prefix}fence", 9)
    tagged = hold(trio_urls, f"{prefix}{{tagged}}job:1")  # its counter KEY:fence is under the prefix: not listed
    assert all(c.exists(fence_key_for(tagged.name)) for c in clients)

    rows = table(run(app, "list"))
    assert {k: (r["STATE"], r["KIND"], r["NODES"]) for k, r in rows.items()} == {
        old: ("foreign", "foreign", "2/3"),
        f"{prefix}some-list": ("foreign", "foreign", "1/3"),
        f"{prefix}some-hash": ("foreign", "foreign", "1/3"),
        tagged.name: ("running", "task", "3/3"),
    }
    assert listed(app)[old]["type"] == "string"
    assert "a Redis string: never released by this command" in run(app, "show", old).stdout

    refused = run(app, "release", old, "--yes")
    assert refused.exit_code == 1
    assert "not a holder record of celery_singleton_lock: not released" in refused.stderr
    assert [c.exists(old) for c in clients] == [1, 1, 0]


def test_show_names_each_node_and_a_waiting_copy(trio_urls: list[str], prefix: str) -> None:
    """`show` gives the owner and the record's own fence per node, and says when a redelivered copy waits."""
    app = make_app(trio_urls, prefix)
    key = f"{prefix}reports.rebuild:shown"
    lock = hold(trio_urls, key, "task-shown")
    twin = task_lock(trio_urls, key, "task-shown")  # the same task id delivered again: refused, marks 'waiting'
    assert not twin.acquire(blocking=False)

    shown = run(app, "show", key)
    assert shown.exit_code == 0, shown.output
    assert "waiting        yes: a redelivered copy of this task id waits for this run" in shown.stdout
    assert f"fencing token  {lock.fencing_token}" in shown.stdout
    node_rows = [line.split() for line in shown.stdout.splitlines() if line.startswith("redis://")]
    assert [row[1:4] for row in node_rows] == [[lock.token, "run", str(lock.fencing_token)]] * 3

    doc = json.loads(run(app, "show", key, "--json").stdout)
    assert doc["lock"]["waiting"] is True
    assert [n["owner"] for n in doc["nodes"]] == [lock.token] * 3
    assert [n["fence"] for n in doc["nodes"]] == [lock.fencing_token] * 3
    assert {n["type"] for n in doc["nodes"]} == {"hash"}


def test_release_yes_frees_every_node_and_logs_who(
    trio_urls: list[str], prefix: str, caplog: pytest.LogCaptureFixture
) -> None:
    """`release KEY --yes` deletes the record on every node, keeps the fencing counters, and logs who did it."""
    key = f"{prefix}reports.rebuild:stuck"
    lock = hold(trio_urls, key, "task-stuck")
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
    assert "task-stuck" in record.getMessage()
    assert f"(pid {os.getpid()})" in record.getMessage()
    assert run(app, "list", "--json").stdout.strip() == "[]"


def test_release_leaves_a_newer_holder_alone(trio_urls: list[str], prefix: str) -> None:
    """A holder that acquired between the read and the release keeps its lock: the delete compares the owner."""
    key = f"{prefix}reports.rebuild:race"
    old = hold(trio_urls, key, "task-old")
    settings = settings_for(make_app(trio_urls, prefix))
    seen = show_lock(settings, key).value[1]

    # The old lease ends (expired, or released) and a new run acquires before the operator confirms.
    assert old.release()
    new = hold(trio_urls, key, "task-new")

    report = release_lock(settings, key, seen)
    assert [r.outcome for r in report.value] == ["changed"] * 3
    assert all(r.owner == new.token for r in report.value)
    assert new.owned()


def test_release_leaves_a_record_whose_owner_changed_in_place(trio_urls: list[str], prefix: str) -> None:
    """A run that finished into a cooldown after the read has a new owner: the release leaves the cooldown alone."""
    key = f"{prefix}reports.rebuild:finishing"
    lock = hold(trio_urls, key, "task-finishing")
    settings = settings_for(make_app(trio_urls, prefix))
    seen = show_lock(settings, key).value[1]
    assert lock.finish(done_for=60, waited_for=60, cooldown=30)

    report = release_lock(settings, key, seen)
    assert [r.outcome for r in report.value] == ["changed"] * 3
    assert "now owned by" in str(report.value[0])
    assert listed(make_app(trio_urls, prefix))[key]["state"] == "cooldown"


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
    assert result.exit_code == 1, result.output  # 3 of 4 answered: the listing lacks what the fourth holds
    assert "task-dead" in result.stdout
    assert f"127.0.0.1:{port}" in result.stderr
    assert "s3cret" not in result.output
    for args in (("show", key), ("stats",), ("list", "--done"), ("release", key, "--yes")):
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
    # Per task: what the workers' watchdogs write (metrics.write), to whichever node answered first.
    for client, counts in (
        (first, {("a.b", "acquired"): 5, ("a.b", "skipped"): 2}),
        (second, {("a.b", "acquired"): 1, ("c", "lost"): 1}),
    ):
        pipe = client.pipeline(transaction=False)
        metrics.write(pipe, prefix, counts)
        pipe.execute()
    result = run(make_app(trio_urls, prefix), "stats", "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout) == {
        "tasks": {"a.b": {"acquired": 6, "skipped": 2}, "c": {"lost": 1}},
        "total": {"acquired": 6, "skipped": 2, "lost": 1},
    }
    result = run(make_app(trio_urls, prefix), "stats", "--since", "10m")
    assert result.exit_code == 0, result.output
    assert "a.b" in result.stdout and "ACQUIRED" in result.stdout
    result = run(make_app(trio_urls, prefix), "stats", "--since", "soon")
    assert result.exit_code != 0 and "not a period" in result.output


def test_list_locks_reads_many_keys_in_batches(trio_urls: list[str], prefix: str) -> None:
    """More keys than one script call reads (BATCH) are all listed, each with its own record."""
    settings = settings_for(make_app(trio_urls, prefix))
    names = [f"{prefix}orders:{n:03d}" for n in range(230)]
    with settings.nodes.clients[0].pipeline(transaction=False) as pipe:
        for n, name in enumerate(names):
            pipe.hset(name, mapping={"owner": f"owner-{n}", "fence": str(n)})
            pipe.pexpire(name, 30_000)
        pipe.execute()
    infos = list_locks(settings).value
    assert [i.key for i in infos] == names
    assert [(i.owner, i.fencing_token, i.state, i.kind) for i in infos[:2]] == [
        ("owner-0", None, "partial", "lock"),
        ("owner-1", 1, "partial", "lock"),
    ]


def test_every_state_the_cli_can_show_is_explained(trio_urls: list[str], prefix: str) -> None:
    """Every state `locks list` can show (each record state LockedTask writes, queue scope's queued and sending
    too) has a meaning in `locks show` and a row in docs/cli.md's STATE table."""
    written = (decision.RUNNING, decision.HANDOVER, decision.ENDING, decision.COOLDOWN, decision.QUEUED)
    shown = {_TASK_STATES.get(s, s) for s in (*written, decision.SENDING)} | {"held", "partial", "foreign", "done"}
    assert shown <= set(STATES), shown - set(STATES)
    section = (Path(__file__).resolve().parent.parent.parent / "docs" / "cli.md").read_text().split("### STATE\n", 1)[1]
    documented = set(re.findall(r"^\| `([a-z-]+)` ", section.split("\n### ", 1)[0], flags=re.MULTILINE))
    assert shown <= documented, shown - documented
    app = make_app(trio_urls, prefix)
    for state in (decision.QUEUED, decision.SENDING):
        lock = hold(trio_urls, f"{prefix}reports.rebuild:{state}", f"task-{state}", state=state, fencing=False)
        result = run(app, "show", lock.name)
        assert result.exit_code == 0, result.output
        assert f"{state}: {STATES[state]}; on 3/3 nodes" in result.stdout, result.stdout
        lock.release()


def _cli_app(tmp_path: Path, urls: Sequence[str], prefix: str) -> dict[str, str]:
    """A ``cli_app`` module in ``tmp_path`` (a LockedTask ``shop.charge(order_id)``); the env to run ``celery -A``."""
    (tmp_path / "cli_app.py").write_text(
        "from celery import Celery\n"
        "from celery_singleton_lock import LockedTask\n"
        "app = Celery('cli_app', broker='memory://')\n"
        f"app.conf.singleton_lock_urls = {list(urls)!r}\n"
        f"app.conf.singleton_lock_prefix = {prefix!r}\n"
        "@app.task(base=LockedTask, name='shop.charge')\n"
        "def charge(order_id, currency='EUR'):\n"
        "    return order_id\n"
    )
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))}


def celery_locks(tmp_path: Path, env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    """``celery -A cli_app locks ARGS`` in a real process, to its end."""
    return subprocess.run(
        [CELERY, "-A", "cli_app", "locks", *args],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_exit_codes_say_a_node_is_down_and_a_key_holds_nothing(
    tmp_path: Path, trio_urls: list[str], prefix: str
) -> None:
    """`list` and `stats` with one of four nodes down print what the others answer and exit 1; `show` of a key
    nothing holds exits 1; `list --match X` that matches nothing names X."""
    key = f"{prefix}reports.rebuild:ok"
    hold(trio_urls, key, "task-ok")
    dead = f"redis://:s3cret@127.0.0.1:{free_port()}/0"
    down = _cli_app(tmp_path, [*trio_urls, dead], prefix)
    listing = celery_locks(tmp_path, down, "list")
    assert listing.returncode == 1 and "task-ok" in listing.stdout and "did not answer" in listing.stderr
    stats = celery_locks(tmp_path, down, "stats")
    assert stats.returncode == 1 and "did not answer" in stats.stderr
    assert "s3cret" not in listing.stdout + listing.stderr + stats.stdout + stats.stderr
    up = _cli_app(tmp_path, trio_urls, prefix)
    assert celery_locks(tmp_path, up, "list").returncode == 0
    assert celery_locks(tmp_path, up, "show", key).returncode == 0
    missing = celery_locks(tmp_path, up, "show", f"{prefix}nosuchkey")
    assert missing.returncode == 1 and "not held on any node" in missing.stdout
    nothing = celery_locks(tmp_path, up, "list", "--match", "billing.*")
    assert nothing.returncode == 0
    assert nothing.stdout.strip() == f"no locks under {prefix!r} matching 'billing.*'"


def test_show_finds_the_key_of_a_call(tmp_path: Path, trio_urls: list[str], prefix: str) -> None:
    """`locks show --task shop.charge --args '[7]' --kwargs '{}'` (celery call's convention) names the key that call
    locks and its state; a misspelt task name gets one line with the closest name."""
    env = _cli_app(tmp_path, trio_urls, prefix)
    free = celery_locks(tmp_path, env, "show", "--task", "shop.charge", "--args", "[7]", "--kwargs", "{}")
    assert free.returncode == 1, free.stderr
    first = free.stdout.splitlines()[0]
    assert first.startswith("shop.charge(*[7], **{}) locks ") and "not held on any node" in free.stdout
    key = first.rsplit(" ", 1)[1]
    assert key.startswith(f"{prefix}shop.charge:")
    hold(trio_urls, key, "task-7")
    held = celery_locks(tmp_path, env, "show", "--task", "shop.charge", "--args", "[7]", "--kwargs", "{}")
    assert held.returncode == 0, held.stderr
    assert "running" in held.stdout and "task-7" in held.stdout
    same = celery_locks(tmp_path, env, "show", "--task", "shop.charge", "--kwargs", '{"order_id": 7}', "--json")
    assert same.returncode == 0 and json.loads(same.stdout)["lock"]["key"] == key
    wrong = celery_locks(tmp_path, env, "show", "--task", "shop.charg", "--args", "[7]")
    assert wrong.returncode != 0 and "did you mean 'shop.charge'?" in wrong.stderr
    assert "Traceback" not in wrong.stderr and len(wrong.stderr.strip().splitlines()) == 1


def test_web_on_a_port_in_use_says_so_in_one_line(tmp_path: Path, trio_urls: list[str], prefix: str) -> None:
    """`locks web --port N` with N already taken exits non-zero with one line naming the port, no traceback."""
    env = _cli_app(tmp_path, trio_urls, prefix)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = celery_locks(tmp_path, env, "web", "--port", str(port))
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr, proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    assert f"cannot listen on 127.0.0.1:{port}" in line and "in use" in line
