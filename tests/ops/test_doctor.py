"""``celery -A app locks doctor`` against real redis-servers configured wrongly on purpose, and its checks one by one.

Servers are started with the flags a wrong deployment has (``--maxmemory 10mb --maxmemory-policy volatile-lru``,
``--appendonly no``, ``--cluster-enabled yes``), shared per module; an unreachable node is a port nothing listens
on, or a paused (SIGSTOP) server. The Celery side is real app configuration: broker URLs name ports where nothing
listens, which the checks never connect to. The command runs as users run it (``celery -A app locks doctor`` in a
subprocess) for a correct setup, a wrong one, and ``--json``; the other cases call the functions it is built on.

The clock check cannot skew a real server's clock (that needs root and would move this host's clock too): it is
tested on injected times, and end to end by reading a real server's TIME against a local clock set 5 s off.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery
from celery.bin.base import CLIContext
from celery.utils.quorum_queues import detect_quorum_queues
from click.testing import CliRunner
from kombu import Exchange, Queue

from celery_singleton_lock import LockedTask
from celery_singleton_lock.lock.config import settings_for
from celery_singleton_lock.ops.cli import locks
from celery_singleton_lock.ops.doctor import (
    CODES,
    Finding,
    NodeFacts,
    acks_late_finding,
    broker_findings,
    clock_finding,
    cluster_findings,
    duplicate_findings,
    eviction_finding,
    format_findings,
    gather_node,
    gather_nodes,
    node_count_finding,
    node_findings,
    persistence_finding,
    queue_findings,
    run_doctor,
    server_findings,
    to_json,
    visibility_finding,
)
from celery_singleton_lock.testing import RedisServer, find_redis_server, free_port

CELERY = str(Path(sys.executable).parent / "celery")
APPS = str(Path(__file__).parent.parent / "apps")


class Server:
    """A redis-server on 127.0.0.1 started with extra flags (the wrong, or right, configuration under test)."""

    def __init__(self, *flags: str) -> None:
        self.port = free_port()
        self.dir = tempfile.mkdtemp(prefix=f"csl-doctor-{self.port}-")
        args = [find_redis_server(), "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--dir", self.dir]
        args += ["--protected-mode", "no", "--loglevel", "warning", *flags]
        self.process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        probe = redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=0.5)
        try:
            for _ in range(500):  # at most ~10 s
                if self.process.poll() is not None:
                    raise RuntimeError(f"redis-server {flags} exited with {self.process.returncode}")
                with contextlib.suppress(redis.RedisError):
                    if probe.ping():
                        return
                time.sleep(0.02)
        finally:
            probe.close()
        self.close()
        raise RuntimeError(f"redis-server {flags} did not answer")

    def url(self, db: int = 0, userinfo: str = "") -> str:
        return f"redis://{userinfo}127.0.0.1:{self.port}/{db}"

    @property
    def name(self) -> str:
        """The node's redacted address, as the doctor names it."""
        return f"redis://127.0.0.1:{self.port}/0"

    def client(self) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=2)

    def close(self) -> None:
        self.process.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(5)
        shutil.rmtree(self.dir, ignore_errors=True)


@contextlib.contextmanager
def servers(*configs: tuple[str, ...]) -> Iterator[list[Server]]:
    started: list[Server] = []
    try:
        for flags in configs:
            started.append(Server(*flags))
        yield started
    finally:
        for server in started:
            server.close()


@pytest.fixture(scope="module")
def good() -> Iterator[list[Server]]:
    """Three correctly configured nodes: noeviction (the default), appendonly yes."""
    with servers(*[("--appendonly", "yes")] * 3) as nodes:
        yield nodes


@pytest.fixture(scope="module")
def evicting() -> Iterator[Server]:
    """A node that evicts keys with a TTL when full, without an append-only file."""
    with servers(("--maxmemory", "10mb", "--maxmemory-policy", "volatile-lru", "--appendonly", "no")) as nodes:
        yield nodes[0]


def app_for(urls: list[str], broker: str = "memory://", **conf: Any) -> Celery:
    app = Celery(f"doctor-{free_port()}", broker=broker, set_as_current=False)
    app.conf.update(singleton_lock_urls=urls, **conf)
    return app


def register(app: Celery, name: str, **options: Any) -> None:
    """Register a LockedTask named ``name`` on ``app`` with these task options."""

    def body() -> None: ...

    app.task(base=LockedTask, shared=False, name=name, **options)(body)


def codes(findings: list[Finding], *levels: str) -> set[tuple[str, str]]:
    """(code, subject) of the findings at these levels."""
    return {(f.code, f.subject) for f in findings if f.level in levels}


def run_cli(conf: dict[str, Any], *args: str, broker: str) -> subprocess.CompletedProcess[str]:
    """`celery -A doctor_app locks doctor ARGS` in a real process, the app configured from CSL_CONF."""
    env = {**os.environ, "CSL_BROKER": broker, "CSL_CONF": json.dumps(conf)}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [APPS, env.get("PYTHONPATH")]))
    return subprocess.run(
        [CELERY, "-A", "doctor_app", "locks", "doctor", *args],
        cwd=APPS,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


DEAD_REDIS_BROKER = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens: the checks never connect to it
CORRECT_CELERY = {"task_acks_late": True, "task_reject_on_worker_lost": True, "singleton_lock_ttl": 60}


# --- the command, as users run it -------------------------------------------------------------------------------------


def test_a_correct_setup_passes(good: list[Server]) -> None:
    """Three noeviction, appendonly nodes, acks_late with reject_on_worker_lost, ttl under the visibility timeout:
    exit 0, every check ok, nothing to fix."""
    conf = {"singleton_lock_urls": [s.url() for s in good], **CORRECT_CELERY}
    proc = run_cli(conf, broker=DEAD_REDIS_BROKER)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert "doctor passed: 0 error(s), 0 warning(s)" in out
    for s in good:
        assert s.name in out
    for code in ("server-version", "eviction-policy", "persistence", "clock-drift", "node-count"):
        assert f"  ok       {code}" in out
    assert "visibility-timeout  lock_ttl 60 s, broker visibility timeout 3600 s" in out  # kombu's Redis default
    assert "fix:" not in out
    assert "\n  error " not in out and "\n  warning " not in out


def test_a_wrong_setup_fails_naming_each_problem(good: list[Server], evicting: Server) -> None:
    """An evicting node without AOF, an unreachable one, one server listed twice, four nodes, ttl over the visibility
    timeout and acks_late alone: exit 1, each named with what to change, human-readable and as --json."""
    dead = f"redis://127.0.0.1:{free_port()}/0"
    urls = [evicting.url(), good[0].url(), good[0].url(db=1), dead]
    conf = {
        "singleton_lock_urls": urls,
        "singleton_lock_ttl": 60,
        "broker_transport_options": {"visibility_timeout": 30},
        "task_acks_late": True,
    }
    proc = run_cli(conf, broker=DEAD_REDIS_BROKER)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    out = proc.stdout
    assert "doctor FAILED: 3 error(s), 4 warning(s)" in out, out
    assert "error    eviction-policy     maxmemory-policy volatile-lru with maxmemory 10mb" in out
    assert "warning  persistence         appendonly no" in out
    assert f"{dead}\n  error    node-unreachable    did not answer: ConnectionError" in out
    assert "warning  node-count          4 nodes, quorum 3" in out
    assert "error    node-duplicate" in out
    assert "warning  visibility-timeout  lock_ttl 60 s, broker visibility timeout 30 s" in out
    assert "warning  acks-late           acks_late without task_reject_on_worker_lost" in out
    assert out.count("fix: ") == 7  # one per error and warning

    proc = run_cli(conf, "--json", broker=DEAD_REDIS_BROKER)
    assert proc.returncode == 1, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["format"] == 1
    assert doc["ok"] is False
    assert doc["summary"] == {"error": 3, "warning": 4, "ok": 10, "info": 0}
    found = {(f["level"], f["code"], f["subject"]) for f in doc["findings"]}
    assert found >= {
        ("error", "eviction-policy", evicting.name),
        ("warning", "persistence", evicting.name),
        ("error", "node-unreachable", dead),
        ("error", "node-duplicate", "singleton_lock_urls"),
        ("warning", "node-count", "singleton_lock_urls"),
        ("warning", "visibility-timeout", "task doctor_app.job"),
        ("warning", "acks-late", "task doctor_app.job"),
    }
    for f in doc["findings"]:
        assert set(f) == {"level", "code", "subject", "message", "fix"}
        assert f["code"] in CODES
        assert (f["fix"] is None) == (f["level"] in ("ok", "info"))


def test_warnings_alone_exit_zero(good: list[Server]) -> None:
    """Two correct nodes (an even count) and nothing else wrong: a warning, and exit status 0."""
    app = app_for([s.url() for s in good[:2]])
    result = CliRunner().invoke(locks, ["doctor"], obj=CLIContext(app=app, no_color=True, workdir=None))
    assert result.exit_code == 0, result.output
    assert "doctor passed with warnings: 0 error(s), 1 warning(s)" in result.output
    assert "warning  node-count" in result.output


def test_invalid_settings_are_an_error_and_the_rest_still_runs() -> None:
    """A misspelt singleton_lock_* setting is an error finding (exit 1); the Celery checks still run."""
    app = app_for([f"redis://127.0.0.1:{free_port()}/0"], singleton_lock_tll=5)

    register(app, "job", lock_ttl=10)

    result = CliRunner().invoke(locks, ["doctor", "--json"], obj=CLIContext(app=app, no_color=True, workdir=None))
    assert result.exit_code == 1, result.output
    findings = json.loads(result.stdout)["findings"]
    (settings,) = [f for f in findings if f["code"] == "settings"]
    assert settings["level"] == "error"
    assert "singleton_lock_tll" in settings["message"]
    assert {f["code"] for f in findings} >= {"visibility-timeout", "acks-late"}


# --- node checks on real servers --------------------------------------------------------------------------------------


def test_unreachable_nodes_never_hang() -> None:
    """A paused node (SIGSTOP) is reported as not answering within the socket timeout; with a longer socket timeout,
    --timeout cuts the node's checks short all the same."""
    with RedisServer() as paused:
        paused.pause()
        try:
            facts = gather_nodes(settings_for(app_for([paused.url])), timeout=5.0)
            assert facts[0].error is not None and facts[0].error.startswith("TimeoutError"), facts
            slow = app_for([paused.url], singleton_lock_socket_timeout=30)
            (fact,) = gather_nodes(settings_for(slow), timeout=0.3)
            assert fact.error == "timed out after 0.3 s (--timeout)"
            findings = node_findings([fact], prefix="p:")
            assert codes(findings, "error") == {("node-unreachable", paused.url)}
        finally:
            paused.resume()


def test_refused_info_and_config_are_warnings_not_a_crash(good: list[Server]) -> None:
    """An ACL user without INFO and CONFIG: each unread check is a warning saying what to allow, and the password
    appears nowhere in the output."""
    password = "Dr0ctPwqZ"
    good[0].client().acl_setuser(
        "doctor",
        enabled=True,
        passwords=[f"+{password}"],
        keys=["*"],
        categories=["+@all"],
        commands=["-info", "-config"],
    )
    app = app_for([good[0].url(userinfo=f"doctor:{password}@"), good[1].url(), good[2].url()])
    findings = run_doctor(app)
    node = good[0].name
    unread = [f for f in findings if f.subject == node and f.code == "unreadable"]
    assert [f.level for f in unread] == ["warning"] * 3
    assert "could not read INFO (NoPermissionError" in unread[0].message
    assert "could not read maxmemory-policy" in unread[1].message
    assert "could not read appendonly" in unread[2].message
    assert ("clock-drift", node) in codes(findings, "ok")  # TIME is allowed: still checked
    assert not codes(findings, "error")

    wrong = app_for([good[0].url(userinfo="doctor:Wr0ngPwqZ@"), good[1].url(), good[2].url()])
    findings = run_doctor(wrong)
    (refused,) = [f for f in findings if f.subject == node]
    assert (refused.level, refused.code) == ("error", "node-unreachable")
    assert "AuthenticationError" in refused.message
    text = format_findings(findings) + json.dumps(to_json(findings))
    for secret in (password, "Wr0ngPwqZ"):
        for i in range(len(secret) - 3):
            assert secret[i : i + 4] not in text


def test_a_cluster_node_listed_as_one_server() -> None:
    """A node in cluster mode listed as redis:// (it answers MOVED for other slots' keys) is an error."""
    # The cluster bus port defaults to port + 10000, which may be taken or past 65535: name a free one.
    with servers(("--cluster-enabled", "yes", "--cluster-port", str(free_port()), "--appendonly", "yes")) as (node,):
        findings = run_doctor(app_for([node.url()]))
        assert codes(findings, "error") == {("cluster-url", node.name)}
        (error,) = [f for f in findings if f.code == "cluster-url"]
        assert f"redis+cluster://127.0.0.1:{node.port}" in (error.fix or "")
        # Redis's default cluster-require-full-coverage yes: one failed master stops every lock (docs/nodes.md).
        assert ("cluster-full-coverage", node.name) in codes(findings, "warning")
        node.client().config_set("cluster-require-full-coverage", "no")
        assert ("cluster-full-coverage", node.name) in codes(run_doctor(app_for([node.url()])), "ok")


def test_a_replica_is_an_error(good: list[Server]) -> None:
    """A replica listed as a lock node (it refuses writes), configured right otherwise, is a node-role error and
    only that (with AOF on: whether no AOF is an error depends on the process's tasks, a shared one included)."""
    with servers(("--replicaof", "127.0.0.1", str(good[0].port), "--appendonly", "yes")) as (replica,):
        findings = run_doctor(app_for([replica.url()]))
        assert codes(findings, "error") == {("node-role", replica.name)}


def test_task_modules_are_imported_as_the_worker_imports_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, good: list[Server]
) -> None:
    """A LockedTask in a module named by `include` is checked; a module that fails to import is an error."""
    urls = [s.url() for s in good]
    app = app_for(urls, include=["doctor_included_tasks"])
    # The module registers its task on this app (not a shared_task: that would join every app made later).
    monkeypatch.setitem(sys.modules, "doctor_test_app", types.SimpleNamespace(app=app))
    (tmp_path / "doctor_included_tasks.py").write_text(
        "from doctor_test_app import app\n"
        "from celery_singleton_lock import LockedTask\n"
        "@app.task(base=LockedTask, acks_late=True, name='included.job', shared=False)\n"
        "def job():\n"
        "    return None\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "doctor_included_tasks", raising=False)
    findings = run_doctor(app)
    assert ("acks-late", "task included.job") in codes(findings, "warning")

    broken = app_for(urls, include=["doctor_no_such_module"])
    (error,) = [f for f in run_doctor(broken) if f.level == "error"]
    assert (error.code, error.subject) == ("task-import", "app")
    assert "doctor_no_such_module" in error.message


def test_a_real_node_against_a_skewed_local_clock(good: list[Server]) -> None:
    """A real server's TIME read against a local clock 5 s behind: a clock-drift warning; against the true clock ok."""
    client = good[0].client()
    skewed = gather_node(client, good[0].name, clock=lambda: time.time() - 5.0)
    (finding,) = [f for f in node_findings([skewed], prefix="p:") if f.code == "clock-drift"]
    assert finding.level == "warning"
    # The offset as measured (the server's TIME against the skewed clock, half a round trip either way): +4.999 once.
    shown = re.search(r"clock is ([+-][0-9.]+) s", finding.message)
    assert shown is not None and abs(float(shown.group(1)) - 5.0) < 0.1, finding.message
    true = gather_node(client, good[0].name)
    assert [f.level for f in node_findings([true], prefix="p:") if f.code == "clock-drift"] == ["ok"]


# --- the Celery side, on real app configuration -----------------------------------------------------------------------


def test_lock_ttl_against_the_brokers_visibility_timeout() -> None:
    """A lock_ttl over the visibility timeout warns; kombu's Redis default (3600 s) counts when none is set; a
    broker without one (memory, RabbitMQ) gives info only."""
    app = app_for(["redis://127.0.0.1:1/0"], broker=DEAD_REDIS_BROKER, singleton_lock_ttl=60)
    app.conf.broker_transport_options = {"visibility_timeout": 120}

    register(app, "long", lock_ttl=300)
    register(app, "short")

    @app.task(shared=False, name="plain")
    def plain() -> None: ...

    found = {(f.code, f.subject): f for f in broker_findings(app)}
    assert found["visibility-timeout", "task long"].level == "warning"
    assert "lock_ttl 300 s, broker visibility timeout 120 s" in found["visibility-timeout", "task long"].message
    assert found["visibility-timeout", "task short"].level == "ok"  # singleton_lock_ttl 60
    assert not any(subject == "task plain" for _, subject in found)  # not a LockedTask

    default = app_for(["redis://127.0.0.1:1/0"], broker=DEAD_REDIS_BROKER)
    register(default, "slow", lock_ttl=7200)
    # Only this test's tasks: shared tasks other modules registered join every app finalized later.
    (vt,) = [f for f in broker_findings(default) if f.code == "visibility-timeout" and f.subject == "task slow"]
    assert (vt.level, "visibility timeout 3600 s" in vt.message) == ("warning", True)

    for broker in ("memory://", f"amqp://guest:guest@127.0.0.1:{free_port()}//"):
        other = app_for(["redis://127.0.0.1:1/0"], broker=broker)
        register(other, "slow", lock_ttl=7200)
        (vt,) = [f for f in broker_findings(other) if f.code == "visibility-timeout" and f.subject == "task slow"]
        assert vt.level == "info"


def test_acks_late_without_reject_on_worker_lost() -> None:
    """acks_late (task or app level) without reject_on_worker_lost warns; with it, or retry_on_worker_lost, ok."""
    app = app_for(["redis://127.0.0.1:1/0"])
    register(app, "late", acks_late=True)
    register(app, "rejects", acks_late=True, reject_on_worker_lost=True)
    register(app, "retries", acks_late=True, retry_on_worker_lost=True)
    register(app, "early")
    mine = {"task late", "task rejects", "task retries", "task early"}
    levels = {f.subject: f.level for f in broker_findings(app) if f.code == "acks-late" and f.subject in mine}
    assert levels == {"task late": "warning", "task rejects": "ok", "task retries": "ok", "task early": "ok"}

    whole = app_for(["redis://127.0.0.1:1/0"], task_acks_late=True)
    register(whole, "any")
    assert [f.level for f in broker_findings(whole) if f.code == "acks-late" and f.subject == "task any"] == ["warning"]
    fixed = app_for(["redis://127.0.0.1:1/0"], task_acks_late=True, task_reject_on_worker_lost=True)
    register(fixed, "any")
    assert [f.level for f in broker_findings(fixed) if f.code == "acks-late" and f.subject == "task any"] == ["ok"]


def test_quorum_queues_with_a_direct_exchange() -> None:
    """RabbitMQ quorum queues (as Celery detects them) with a direct exchange warn per queue; a topic exchange is ok;
    other brokers are not checked. The broker is never contacted."""
    amqp = f"amqp://guest:guest@127.0.0.1:{free_port()}//"
    app = app_for(["redis://127.0.0.1:1/0"], broker=amqp, task_default_queue_type="quorum")
    assert detect_quorum_queues(app, "amqp")[0]  # Celery's own detection agrees: quorum queues are in use
    found = [f for f in broker_findings(app) if f.code == "quorum-direct-exchange"]
    assert [(f.level, f.subject) for f in found] == [("warning", "queue celery")]

    topic = app_for(
        ["redis://127.0.0.1:1/0"], broker=amqp, task_default_queue_type="quorum", task_default_exchange_type="topic"
    )
    assert [f.level for f in broker_findings(topic) if f.code == "quorum-direct-exchange"] == ["ok"]

    mixed = app_for(["redis://127.0.0.1:1/0"], broker=amqp)
    mixed.conf.task_queues = [
        Queue("jobs", Exchange("jobs", type="topic"), routing_key="jobs", queue_arguments={"x-queue-type": "quorum"}),
        Queue("plain", Exchange("plain", type="direct"), routing_key="plain"),
    ]
    found = [f for f in broker_findings(mixed) if f.code == "quorum-direct-exchange"]
    assert [(f.level, f.subject) for f in found] == [("warning", "queue plain")]

    classic = app_for(["redis://127.0.0.1:1/0"], broker=amqp)
    assert [f.message for f in broker_findings(classic) if f.code == "quorum-direct-exchange"] == ["no quorum queues"]
    redis_broker = app_for(["redis://127.0.0.1:1/0"], broker=DEAD_REDIS_BROKER, task_default_queue_type="quorum")
    assert not [f for f in broker_findings(redis_broker) if f.code == "quorum-direct-exchange"]


# --- the pure checks --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("maxmemory", "policy", "level"),
    [
        (0, "noeviction", "ok"),
        (10 << 20, "noeviction", "ok"),
        (10 << 20, "volatile-lru", "error"),
        (10 << 20, "volatile-lfu", "error"),
        (10 << 20, "volatile-random", "error"),
        (10 << 20, "volatile-ttl", "error"),
        (10 << 20, "allkeys-lru", "error"),
        (10 << 20, "allkeys-lfu", "error"),
        (10 << 20, "allkeys-random", "error"),
        (None, "volatile-lru", "error"),  # limit unknown: assume one
        (0, "volatile-lru", "warning"),  # no limit: dormant
        (0, "allkeys-lru", "warning"),
        ("0", "volatile-ttl", "warning"),  # as CONFIG GET returns it
    ],
)
def test_eviction_policy(maxmemory: int | str | None, policy: str, level: str) -> None:
    """Any policy but noeviction evicts lock keys once memory is full: an error with a limit, a warning without."""
    finding = eviction_finding("n", maxmemory, policy)
    assert finding is not None
    assert finding.level == level
    if policy.startswith("allkeys"):
        assert "fencing counters" in finding.message
    assert eviction_finding("n", 0, None) is None  # unknown policy: reported as unreadable instead


def test_persistence_and_node_count() -> None:
    """appendonly no warns; an even node count warns, one node is info, an odd count is ok."""
    assert persistence_finding("n", 1).level == "ok"  # type: ignore[union-attr]
    assert persistence_finding("n", "0").level == "warning"  # type: ignore[union-attr]
    assert persistence_finding("n", None) is None
    assert [node_count_finding(n).level for n in range(1, 8)] == [
        "info", "warning", "ok", "warning", "ok", "warning", "ok",
    ]  # fmt: skip
    assert "still only 1 may be down, as with 3" in node_count_finding(4).message


def test_clock_drift_on_injected_times() -> None:
    """An offset beyond max_drift warns either way; the round trip's uncertainty is given to the node."""
    ok = clock_finding("n", before=1000.0, server=1000.3, after=1000.0, max_drift=0.5)
    assert ok.level == "ok"
    assert clock_finding("n", before=1000.0, server=1000.6, after=1000.0, max_drift=0.5).level == "warning"
    assert clock_finding("n", before=1000.0, server=998.0, after=1000.0, max_drift=0.5).level == "warning"
    # 0.7 s off the midpoint, but TIME may have been read anywhere in a 0.6 s round trip: 0.4 s for sure, ok.
    assert clock_finding("n", before=1000.0, server=1001.0, after=1000.6, max_drift=0.5).level == "ok"
    assert clock_finding("n", before=1000.0, server=1001.0, after=1000.6, max_drift=0.3).level == "warning"


def test_server_kind_version_and_role() -> None:
    """Valkey is named from valkey_version or server_name; Redis below 5.0, a replica and a Sentinel are errors."""
    (valkey,) = server_findings("n", {"redis_version": "7.2.4", "valkey_version": "8.1.1", "role": "master"})
    assert valkey.message.startswith("Valkey 8.1.1")
    (named,) = server_findings("n", {"redis_version": "7.2.4", "server_name": "valkey", "role": "master"})
    assert named.message.startswith("Valkey 7.2.4")
    (redis7,) = server_findings("n", {"redis_version": "7.0.15", "role": "master"})
    assert (redis7.level, redis7.message) == ("ok", "Redis 7.0.15 (standalone, master)")
    (old,) = server_findings("n", {"redis_version": "4.0.14", "role": "master"})
    assert (old.level, old.code) == ("error", "server-version")
    replica = server_findings("n", {"redis_version": "7.0.15", "role": "slave"})
    assert [(f.level, f.code) for f in replica] == [("ok", "server-version"), ("error", "node-role")]
    (sentinel,) = server_findings("n", {"redis_version": "7.0.15", "redis_mode": "sentinel"})
    assert (sentinel.level, sentinel.code) == ("error", "node-role")


def test_duplicates_and_hash_tags() -> None:
    """One run_id under two URLs is an error; a cluster-mode node must be listed as redis+cluster://, where a hash
    tag in the prefix (every lock on one shard) is info and no tag ok."""
    (dup,) = duplicate_findings({"redis://a:1/0": "x" * 40, "redis://a:1/1": "x" * 40, "redis://b:1/0": "y"})
    assert "redis://a:1/0, redis://a:1/1 are one server" in dup.message
    assert duplicate_findings({"redis://a:1/0": None, "redis://b:1/0": None}) == []
    cluster = "redis+cluster://c:7000,c:7001"
    for prefix, level in [("{locks}:", "info"), ("app:{locks}:", "info"), ("singleton_lock:", "ok"),
                          ("{}:", "ok"), ("app:{locks:", "ok")]:  # fmt: skip
        assert [f.level for f in cluster_findings(prefix, [cluster])] == [level], prefix
        assert [f.code for f in cluster_findings(prefix, ["redis://c:7000/0"])] == ["cluster-url"]
    (tls,) = cluster_findings("p:", ["rediss+cluster://c:7000"])
    assert tls.level == "ok"
    assert [f.code for f in cluster_findings("p:", ["redis://c:7000/0", cluster])] == [
        "cluster-url",
        "cluster-hash-tag",
    ]
    assert cluster_findings("singleton_lock:", []) == []


def test_unreadable_facts_are_warnings() -> None:
    """A node that refused INFO and CONFIG GET: warnings naming what was not checked and why; nothing else."""
    facts = NodeFacts(
        "redis://n:1/0",
        unread={"INFO": "NoPermissionError: no info", "maxmemory-policy": "ResponseError: unknown command 'CONFIG'",
                "appendonly": "ResponseError: unknown command 'CONFIG'", "TIME": "NoPermissionError: no time"},
    )  # fmt: skip
    findings = node_findings([facts], prefix="p:")
    unread = [f for f in findings if f.code == "unreadable"]
    assert len(unread) == 4
    assert all(f.level == "warning" and f.fix for f in unread)
    assert "unknown command 'CONFIG'" in unread[1].message
    assert [f.code for f in findings if f.code != "unreadable"] == ["node-count"]


def test_output_formats() -> None:
    """Human output groups by subject with each fix under its finding; --json has format, ok, summary, findings."""
    findings = [
        Finding("ok", "server-version", "redis://a:1/0", "Redis 7.0.15 (standalone, master)"),
        visibility_finding("t", 7200, 3600),
        Finding("warning", "persistence", "redis://a:1/0", "appendonly no", "set appendonly yes"),
        acks_late_finding("t", acks_late=False, reject_on_worker_lost=False, retry_on_worker_lost=False),
        *queue_findings("amqp", [("celery", "quorum", "direct")]),
    ]
    lines = format_findings(findings).splitlines()
    assert lines[0] == "redis://a:1/0"
    assert lines[2] == "  warning  persistence             appendonly no"
    assert lines[3] == "                                   fix: set appendonly yes"
    assert lines[4] == "task t"
    assert lines[-1] == "doctor passed with warnings: 0 error(s), 3 warning(s), 2 ok"
    doc = to_json(findings)
    assert (doc["format"], doc["ok"]) == (1, True)
    assert doc["summary"] == {"error": 0, "warning": 3, "ok": 2, "info": 0}
    assert doc["findings"][2] == {
        "level": "warning",
        "code": "persistence",
        "subject": "redis://a:1/0",
        "message": "appendonly no",
        "fix": "set appendonly yes",
    }


@pytest.mark.parametrize("option", [{"lock_cooldown": 600}, {"lock_scope": "queue"}], ids=["cooldown", "queue"])
def test_no_persistence_is_an_error_for_an_app_with_cooldowns_or_queue_scope(
    good: list[Server], evicting: Server, option: dict[str, Any]
) -> None:
    """A node without AOF is a warning in general, but an error (exit 1) when a task uses lock_cooldown or queue
    scope: a majority restarted empty would leave its cooldowns partial and a second charge would run."""
    urls = [good[0].url(), good[1].url(), evicting.url()]
    plain = run_cli({"singleton_lock_urls": urls, **CORRECT_CELERY}, "--json", broker=DEAD_REDIS_BROKER)
    (finding,) = [f for f in json.loads(plain.stdout)["findings"] if f["code"] == "persistence" and f["level"] != "ok"]
    assert finding["level"] == "warning"
    conf = {"singleton_lock_urls": urls, **CORRECT_CELERY, "task_annotations": {"doctor_app.job": option}}
    proc = run_cli(conf, broker=DEAD_REDIS_BROKER)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "error    persistence" in proc.stdout and "doctor_app.job rely on lock records kept" in proc.stdout
    assert "doctor FAILED" in proc.stdout
