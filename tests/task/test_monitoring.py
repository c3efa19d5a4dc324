"""What monitors and operators are told: skips as task-revoked / task-retried (never task-succeeded), and the worker
start error. Regression tests for the adversarial review of that change; each names what it found.

Real redis-server processes, real ``celery worker`` processes (Redis broker, ``-E``), Celery events captured from
the broker and fed to Celery's own ``State`` (what Flower shows).
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest
from celery import Celery
from celery.exceptions import TaskRevokedError
from test_rabbitmq import Events
from worker_cluster import APPS, Cluster, cluster, new_key, polling

from celery_singleton_lock import LockedTask
from celery_singleton_lock.errors import ConfigurationError
from celery_singleton_lock.testing import CeleryWorker

pytestmark = pytest.mark.slow

TTL = 5.0


@pytest.fixture(scope="module")
def ac(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """Redis broker, three lock nodes, one worker (``-E``) running tests/apps/monitoring_app.py."""
    tmp = tmp_path_factory.mktemp("monitoring")
    with cluster(tmp, ttl=TTL) as c:
        c.app_module()
        worker = CeleryWorker(
            "monitoring_app", "a1", cwd=str(APPS), log_path=str(tmp / "a1.log"), env=c.env, extra=["-E"]
        )
        c.workers.append(worker)
        worker.start(timeout=60)
        events = Events(c.app_module().app).start()
        c.events = events  # type: ignore[attr-defined]
        try:
            yield c
        finally:
            events.stop()
            sys.modules.pop("monitoring_app", None)


def monitoring_module(c: Cluster) -> ModuleType:
    c.app_module()
    return importlib.import_module("monitoring_app")


def logs(c: Cluster) -> str:
    return "".join(w.log() for w in c.workers)


def logs_since(c: Cluster, lengths: list[int]) -> str:
    """What each worker logged after its log was ``lengths`` long."""
    return "".join(w.log()[n:] for w, n in zip(c.workers, lengths, strict=True))


# -- FINDING 1: the worker start error is no longer a ConfigurationError outside `celery worker` ----------------------


@pytest.mark.filterwarnings("ignore::celery.exceptions.SecurityWarning")  # CI may run as root
def test_finding1_worker_start_error_stays_a_configuration_error(tmp_path: Path) -> None:
    """Starting a worker from Python (``app.Worker()``, ``celery.contrib.testing.worker.start_worker``,
    pytest-celery, ``app.worker_main()``) with a bad setting used to raise ConfigurationError; it now raises
    click.ClickException, which ``except ConfigurationError`` no longer caught: it is both."""
    app = Celery("attack9-bad", broker="memory://", set_as_current=False)
    app.conf.singleton_lock_urls = ["bogus://:s3cret@127.0.0.1/0"]

    @app.task(base=LockedTask, shared=False)  # type: ignore[untyped-decorator]
    def noop() -> None: ...

    with pytest.raises(ConfigurationError, match="invalid Redis URL"):
        app.Worker(pool="solo", hostname="attack9@localhost", loglevel="WARNING")


# -- FINDING 2: a task's own Request class silently turned every skip back into task-succeeded ----------------------


def test_finding2_a_request_class_not_derived_from_locked_request_is_refused() -> None:
    """A LockedTask with ``Request=`` a plain Celery Request subclass would report its skipped duplicates as
    task-succeeded (SUCCESS in Flower): it is refused when the task is registered, with what to change."""
    from celery.worker.request import Request  # noqa: PLC0415

    from celery_singleton_lock import LockedRequest  # noqa: PLC0415

    class AuditRequest(Request):  # type: ignore[misc]
        pass

    class GoodRequest(LockedRequest):
        pass

    app = Celery("monitoring-request", broker="memory://", set_as_current=False)

    @app.task(base=LockedTask, Request=AuditRequest, shared=False)  # type: ignore[untyped-decorator]
    def audited() -> None: ...

    with pytest.raises(ConfigurationError, match=r"must subclass celery_singleton_lock\.LockedRequest"):
        app.tasks[audited.name]

    @app.task(base=LockedTask, Request=GoodRequest, shared=False)  # type: ignore[untyped-decorator]
    def fine() -> None: ...

    assert app.tasks[fine.name].Request is GoodRequest


# -- FINDING 3: a truncated result repr (resultrepr_maxsize, a long holder id) is reported as task-succeeded ----------


def test_finding3a_a_small_resultrepr_maxsize_still_reports_the_skip(ac: Cluster) -> None:
    """With the task option ``resultrepr_maxsize=64`` Celery cuts the Skipped repr at the last space before 64 chars
    (plus '...'), inside the holder id: the kind must survive, so the skip is still task-revoked / 'skipped'."""
    mod = monitoring_module(ac)
    events: Events = ac.events  # type: ignore[attr-defined]
    k = new_key()
    first = mod.terse.delay(k, 1.5)
    ac.wait_started(k)
    dup = mod.terse.delay(k, 0.0)
    with pytest.raises(TaskRevokedError):
        dup.get(timeout=20)
    assert first.get(timeout=20) == k
    for _ in polling(10):
        if {"task-succeeded", "task-revoked"} & set(events.types(dup.id)):
            break
    assert f"terse[{dup.id}] skipped duplicate in" in logs(ac), logs(ac)[-1500:]
    assert "task-revoked" in events.types(dup.id), events.types(dup.id)


def test_finding3b_a_long_holder_id_still_reports_the_skip(ac: Cluster) -> None:
    """The default resultrepr_maxsize (1024) and a holder whose task id is 1000 characters: the repr is cut inside the
    holder id: still task-revoked, never task-succeeded."""
    mod = monitoring_module(ac)
    events: Events = ac.events  # type: ignore[attr-defined]
    k = new_key()
    holder = "h" * 990 + new_key()[:10]
    first = mod.work.apply_async((k, 1.5), task_id=holder)
    ac.wait_started(k)
    dup = mod.work.delay(k, 0.0)
    with pytest.raises(TaskRevokedError):
        dup.get(timeout=20)
    assert first.get(timeout=20) == k
    events.wait(dup.id, "task-revoked")
    # The worker sends one terminal event per delivery: give a task-succeeded sent with or after it time to arrive.
    events.wait(first.id, "task-succeeded")
    for _ in polling(2):
        if "task-succeeded" in events.types(dup.id):
            break
    assert "task-succeeded" not in events.types(dup.id), events.types(dup.id)


# -- FINDING 4: a copy of a succeeded job deferred by a lock outage ends REVOKED in Flower ---------------------------


def test_finding4_copy_of_a_succeeded_job_deferred_by_an_outage_stays_success(ac: Cluster) -> None:
    """monitoring.md: 'copy of a job that already succeeded: stays SUCCESS'. A copy arriving while no lock node answers
    is deferred first: a task-retried after task-succeeded would put Celery's State in RETRY (RETRY is exempt from
    its precedence rule), and the copy's later events would leave the job REVOKED or STARTED. A copy (redelivered,
    or re-sent by us) says nothing when it waits or stops on DONE: the job stays SUCCESS."""
    mod = monitoring_module(ac)
    events: Events = ac.events  # type: ignore[attr-defined]
    k = new_key()
    first = mod.work.delay(k, 0.0)
    assert first.get(timeout=20) == k
    events.wait(first.id, "task-succeeded")
    assert events.state().tasks[first.id].state == "SUCCESS"
    for server in ac.locks:
        server.pause()
    try:
        # A copy of the finished job, as a broker restores it (the redelivered flag) or our own re-send marks it.
        # Its "waits" line is followed by the re-send's own line under the same id: look at all that came after.
        before = [len(w.log()) for w in ac.workers]
        mod.work.apply_async((k, 0.0), task_id=first.id, headers={"singleton_lock_waited": 1})
        said = f"[{first.id}] waits"
        for _ in polling(15):
            if said in logs_since(ac, before):
                break
        assert said in logs_since(ac, before), "the copy was not deferred by the outage"
    finally:
        for server in ac.locks:
            server.resume()
    for _ in polling(20):
        if "skipped: already done in" in logs(ac).split(first.id)[-1]:
            break
    assert f"work[{first.id}] skipped: already done in" in logs(ac)
    assert "task-retried" not in events.types(first.id)  # a copy of a job that may have run says nothing
    assert events.types(first.id).count("task-succeeded") == 1
    assert len(ac.runs(k)) == 1
    assert first.state == "SUCCESS"
    assert events.state().tasks[first.id].state == "SUCCESS", events.types(first.id)


# -- FINDING 5: under `celery multi` / `--detach` the worker start error goes nowhere ----------------------------------

BAD_APP = """
from celery import Celery
from celery_singleton_lock import LockedTask
app = Celery("attack9_detached", broker="memory://")
app.conf.singleton_lock_urls = ["bogus://:s3cret@127.0.0.1/0"]
@app.task(base=LockedTask)
def noop() -> None: ...
"""


def test_finding5_detached_worker_start_error_reaches_the_logfile(tmp_path: Path) -> None:
    """``celery multi start`` (which runs ``celery worker --detach``) says OK, the worker exits at once, and its
    --logfile stays empty: click prints the one line to stderr, which a detached worker has sent to /dev/null. The
    logfile handler is already set up when the settings step runs (its own INFO line about the nodes lands there),
    so the error could be logged there too."""
    (tmp_path / "attack9_detached.py").write_text(BAD_APP)
    logfile = tmp_path / "worker.log"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))}
    argv = [sys.executable, "-m", "celery", "-A", "attack9_detached", "worker", "-P", "solo", "--detach"]
    subprocess.run(
        [*argv, f"--logfile={logfile}", f"--pidfile={tmp_path / 'worker.pid'}"],
        cwd=tmp_path,
        env=env,
        check=True,
        timeout=30,
    )
    for _ in polling(10, 0.2):
        if "celery_singleton_lock:" in (logfile.read_text() if logfile.exists() else ""):
            break
    text = logfile.read_text() if logfile.exists() else ""
    assert "celery_singleton_lock: invalid Redis URL" in text, text
    assert "s3cret" not in text
