"""Invalid configuration stops ``celery worker``, ``celery beat -S singleton`` and ``celery locks doctor`` alike,
each with one line naming what to change, never a traceback: real ``celery`` processes on a real redis-server.

The worker's start checks and the doctor's are one function (``task.start_problems``), so each configuration a
worker refuses is refused by the doctor too; a misspelt ``lock_*`` task option is refused when the task is
registered (Celery binds decorated tasks when it finalizes the app: at worker and beat start, or at ``app.tasks``).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any, ClassVar

import pytest
from celery import Celery
from matrix_cases import GROUP_CASES, refusal_classes, resolved
from worker_cluster import polling

from celery_singleton_lock import ConfigurationError, LockedTask
from celery_singleton_lock.task import start_problems
from celery_singleton_lock.testing import CeleryWorker, RedisServer, free_port

APPS = Path(__file__).parent.parent / "apps"
PASSWORD = "s3cr3t-start-pw"

# name -> (app.conf, the task's decorator options, what the one line must say)
INVALID: dict[str, tuple[dict[str, Any], dict[str, Any], str]] = {
    "bad setting value": ({"singleton_lock_ttl": -1}, {}, "singleton_lock_ttl must be a number of seconds"),
    "misspelt setting": ({"singleton_lock_tll": 5}, {}, "unknown setting(s) singleton_lock_tll"),
    "not a URL in singleton_lock_urls": (
        {"singleton_lock_urls": [5]},
        {},
        "singleton_lock_urls[0] must be a Redis URL",
    ),
    "bad task option value": ({}, {"lock_on_duplicate": "skipp"}, "lock_on_duplicate of config_app.noop must be one"),
    "misspelt task option": ({}, {"lock_ttll": 5}, "unknown option(s) of config_app.noop: lock_ttll (did you mean"),
    "celery-singleton's option": ({}, {"lock_expiry": 60}, "lock_expiry: use lock_ttl"),
    "limit with replace on the task": (
        {},
        {"lock_limit": 2, "lock_on_duplicate": "replace"},
        "lock_limit of config_app.noop cannot be used with lock_on_duplicate='replace'",
    ),
    "limit with replace in the settings": (
        {"singleton_lock_on_duplicate": "replace"},
        {"lock_limit": 2},
        "lock_limit of config_app.noop cannot be used with lock_on_duplicate='replace'",
    ),
    "limit in queue scope": ({}, {"lock_limit": 2, "lock_scope": "queue"}, "works with lock_scope='run' only"),
}


def _env(node: RedisServer, conf: dict[str, Any], task: dict[str, Any]) -> dict[str, str]:
    conf = {"singleton_lock_urls": [f"redis://:{PASSWORD}@127.0.0.1:{node.port}/0"], **conf}
    return {"CSL_BROKER": node.url, "CSL_CONF": json.dumps(conf), "CSL_TASK": json.dumps(task)}


def _celery(args: list[str], env: dict[str, str], timeout: float = 60.0) -> tuple[int, str]:
    """Run ``celery -A config_app ARGS`` to its end (killed, with its group, after ``timeout`` s): status, output."""
    path = os.pathsep.join(filter(None, [str(APPS), os.environ.get("PYTHONPATH")]))
    proc = subprocess.Popen(
        [sys.executable, "-m", "celery", *args],
        cwd=APPS,
        env={**os.environ, "PYTHONPATH": path, **env},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate(timeout=10)
        pytest.fail(f"celery {' '.join(args)} still running after {timeout} s:\n{out.decode(errors='replace')[-3000:]}")
    return proc.returncode, out.decode(errors="replace")


def _one_error_line(output: str, says: str) -> str:
    errors = [line for line in output.splitlines() if "Error: celery_singleton_lock: " in line]
    assert len(errors) == 1, output
    assert says in errors[0], output
    assert "Traceback" not in output
    assert PASSWORD not in output
    return errors[0]


@pytest.mark.parametrize("case", list(INVALID))
def test_what_the_worker_refuses_the_doctor_refuses_each_with_one_line(
    redis_node: RedisServer, tmp_path: Path, case: str
) -> None:
    """A configuration the worker refuses stops it before it is ready with one line naming the fix, and makes
    ``locks doctor`` fail (exit 1) with an error finding saying the same; neither prints a traceback."""
    conf, task, says = INVALID[case]
    env = _env(redis_node, conf, task)
    worker = CeleryWorker(
        "config_app", "refused", cwd=str(APPS), log_path=str(tmp_path / "worker.log"), pool="solo", env=env
    )
    try:
        with pytest.raises(RuntimeError, match=r"worker refused exited with [1-9]"):
            worker.start(timeout=60)
    finally:
        worker.kill()
    output = worker.log()
    assert " ready." not in output
    _one_error_line(output, says)

    status, output = _celery(["-A", "config_app", "locks", "doctor", "--timeout", "2"], env)
    assert status == 1, output
    assert "doctor FAILED" in output
    assert any(line.split()[:1] == ["error"] and says in line for line in output.splitlines()), output
    assert "Traceback" not in output
    assert PASSWORD not in output


BEAT_CASES = ["bad setting value", "misspelt setting", "bad task option value", "misspelt task option"]


@pytest.mark.parametrize("quiet", [False, True], ids=["banner", "quiet"])
@pytest.mark.parametrize("case", BEAT_CASES)
def test_beat_stops_with_one_line_on_what_the_worker_refuses(
    redis_node: RedisServer, tmp_path: Path, case: str, quiet: bool
) -> None:
    """``celery beat -S singleton`` with a bad setting or task option exits non-zero with one line naming it and no
    traceback, with its banner (the scheduler's info) and with ``-q`` (the scheduler made inside Service.start)."""
    conf, task, says = INVALID[case]
    args = [*(["-q"] if quiet else []), "-A", "config_app", "beat", "-S", "singleton"]
    status, output = _celery([*args, "--schedule", str(tmp_path / "schedule")], _env(redis_node, conf, task))
    assert status != 0, output
    _one_error_line(output, says)
    assert "beat: Starting" not in output


def test_a_valid_configuration_passes_the_start_checks(redis_node: RedisServer) -> None:
    """The start checks find nothing in a valid app, so the refusals above are about the one thing each case
    changes."""
    app = Celery("start-ok", broker="memory://", set_as_current=False)
    app.conf.singleton_lock_urls = [redis_node.url]
    app.task(base=LockedTask, shared=False, name="ok", lock_ttl=5, lock_limit=2, lock_on_duplicate="reschedule")(_body)
    assert start_problems(app) == []


def _body() -> None: ...


def _key_of(n: int) -> str:
    return str(n)


def _registered(conf: dict[str, Any] | None = None, **options: Any) -> Celery:
    app = Celery("start-options", broker="memory://", set_as_current=False)
    app.conf.update(singleton_lock_urls=["redis://127.0.0.1:1/0"], **(conf or {}))
    app.task(base=LockedTask, shared=False, name="job", **options)(_body)
    return app


def test_unknown_options_are_refused_at_registration_naming_the_closest() -> None:
    """A misspelt option on the decorator (a value or a function) or in task_annotations is refused when the app
    registers the task, naming the closest known option and listing them all."""
    with pytest.raises(ConfigurationError, match=r"lock_ttll \(did you mean lock_ttl\?\); LockedTask's options are"):
        _ = _registered(lock_ttll=5).tasks
    with pytest.raises(ConfigurationError, match=r"lock_kye \(did you mean lock_key\?\)"):
        _ = _registered(lock_kye=_key_of).tasks
    with pytest.raises(ConfigurationError, match=r"lock_on_duplcate \(did you mean lock_on_duplicate\?\)"):
        _ = _registered({"task_annotations": {"job": {"lock_on_duplcate": "skip"}}}).tasks
    with pytest.raises(ConfigurationError, match=r"unknown option\(s\) of job: lock_zzz; LockedTask's options"):
        _ = _registered(lock_zzz=1).tasks


def test_a_subclass_keeps_its_lock_methods_and_declares_options_by_annotation() -> None:
    """In a LockedTask subclass a ``lock_*`` method or property is its own and an annotated ``lock_*`` attribute
    is a new option; a plain ``lock_*`` value that is no option is refused."""

    class Tenanted(LockedTask):  # type: ignore[misc]
        lock_tenant_field: ClassVar[str] = "tenant"

        def lock_tenant(self) -> str:
            return self.lock_tenant_field

        @property
        def lock_label(self) -> str:
            return "label"

    class Misspelt(LockedTask):  # type: ignore[misc]
        lock_tll = 5

    app = Celery("start-subclass", broker="memory://", set_as_current=False)
    app.conf.singleton_lock_urls = ["redis://127.0.0.1:1/0"]
    app.task(base=Tenanted, shared=False, name="tenanted", lock_tenant_field="org")(_body)
    assert start_problems(app) == []
    # The app is finalized now: a task decorated from here on is registered, and refused, at once.
    with pytest.raises(ConfigurationError, match=r"lock_tll \(did you mean lock_ttl\?\)"):
        app.task(base=Misspelt, shared=False, name="misspelt")(_body)
    (problem,) = start_problems(app)
    assert (problem.subject, problem.code) == ("task misspelt", "task-options")
    assert "lock_tll (did you mean lock_ttl?)" in problem.message


def _expected_line(task: dict[str, Any], task2: dict[str, Any] | None = None) -> str:
    """The line registration refuses config_app's tasks with (registered in-process as config_app registers them)."""
    app = Celery("config_app", broker="memory://", set_as_current=False)
    app.conf.singleton_lock_urls = ["redis://127.0.0.1:1/0"]

    @app.task(shared=False, base=LockedTask, bind=True, name="config_app.noop", **resolved(task))
    def noop(self: Any, key: str) -> str: ...

    if task2 is not None:

        @app.task(shared=False, base=LockedTask, bind=True, name="config_app.other", **resolved(task2))
        def other(self: Any, key: str, email: str = "") -> str: ...

    with pytest.raises(ConfigurationError) as info:
        _ = app.tasks
    return str(info.value)


# Each refusal class of the options matrix (one per refused line), each way a group's tasks can disagree, and a
# misspelt argument name: (the task's options, the second task's options or None).
REFUSED: dict[str, tuple[dict[str, Any], dict[str, Any] | None]] = {
    **{case: (options, None) for case, options in refusal_classes().items()},
    **GROUP_CASES,
    "misspelt lock_unique_on": ({"lock_unique_on": ["kye"]}, None),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_each_refusal_of_the_options_matrix_stops_the_worker_and_fails_the_doctor(
    redis_node: RedisServer, tmp_path: Path, case: str
) -> None:
    """A combination the options matrix refuses (and a group whose tasks disagree, and an argument name the task
    does not have) stops a real ``celery worker`` before it is ready with the one line registration raises, and
    fails ``celery locks doctor`` with an error finding saying the same."""
    task, task2 = REFUSED[case]
    says = _expected_line(task, task2)
    env = _env(redis_node, {}, task)
    if task2 is not None:
        env["CSL_TASK2"] = json.dumps(task2)
    worker = CeleryWorker(
        "config_app", "refused", cwd=str(APPS), log_path=str(tmp_path / "worker.log"), pool="solo", env=env
    )
    try:
        with pytest.raises(RuntimeError, match=r"worker refused exited with [1-9]"):
            worker.start(timeout=60)
    finally:
        worker.kill()
    output = worker.log()
    assert " ready." not in output
    _one_error_line(output, says)

    status, output = _celery(["-A", "config_app", "locks", "doctor", "--timeout", "2"], env)
    assert status == 1, output
    assert any(line.split()[:1] == ["error"] and says in line for line in output.splitlines()), output
    assert "Traceback" not in output


# -- unreachable lock nodes: said at worker and beat start (a warning, never a refusal) ------------------------------


def _reach_env(trio: list[RedisServer], dead: int) -> tuple[dict[str, str], list[str]]:
    """``config_app`` on three lock nodes, the last ``dead`` of them where nothing listens (with a password)."""
    ports = [free_port() for _ in range(dead)]
    urls = [s.url for s in trio[: 3 - dead]] + [f"redis://:{PASSWORD}@127.0.0.1:{p}/0" for p in ports]
    env = {"CSL_BROKER": trio[0].url, "CSL_CONF": json.dumps({"singleton_lock_urls": urls}), "CSL_TASK": "{}"}
    return env, [f"redis://127.0.0.1:{p}/0" for p in ports]


@pytest.mark.parametrize("dead", [1, 2], ids=["one-down", "no-quorum"])
def test_the_worker_names_unreachable_lock_nodes_and_the_quorum_at_start(
    redis_trio: list[RedisServer], tmp_path: Path, dead: int
) -> None:
    """A worker whose lock nodes do not all answer still starts ("ready"), but says at start which ones do not
    (redacted: no password) and whether a quorum still answers: a WARNING with one down, an ERROR with no quorum."""
    env, names = _reach_env(redis_trio, dead)
    worker = CeleryWorker("config_app", "reach", cwd=str(APPS), log_path=str(tmp_path / "w.log"), pool="solo", env=env)
    try:
        worker.start(timeout=60)
    finally:
        worker.kill()
    output = worker.log()
    assert " ready." in output
    (line,) = [x for x in output.splitlines() if "lock node(s) unreachable" in x]
    assert f"{dead} of 3 lock node(s) unreachable" in line and "at worker start" in line
    assert all(name in line for name in names) and redis_trio[0].url not in line
    if dead == 1:
        assert "WARNING" in line and "quorum 2 of 3 still reachable" in line
    else:
        assert "ERROR" in line and "NO QUORUM: 1 of 3 answer, 2 needed" in line
    assert PASSWORD not in output


def test_beat_names_an_unreachable_lock_node_at_start(redis_trio: list[RedisServer], tmp_path: Path) -> None:
    """``celery beat -S singleton`` with one of three lock nodes down starts and says so once, naming the node
    (redacted) and that the quorum still answers."""
    env, names = _reach_env(redis_trio, 1)
    path = os.pathsep.join(filter(None, [str(APPS), os.environ.get("PYTHONPATH")]))
    log = tmp_path / "beat.log"
    args = ["-A", "config_app", "beat", "-S", "singleton", "--schedule", str(tmp_path / "s"), "-f", str(log)]
    proc = subprocess.Popen(
        [sys.executable, "-m", "celery", *args],
        cwd=APPS,
        env={**os.environ, "PYTHONPATH": path, **env},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    output = ""
    try:
        for _ in polling(60, 0.2):
            output = log.read_text(errors="replace") if log.exists() else ""
            if "unreachable" in output or proc.poll() is not None:
                break
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
    (line,) = [x for x in output.splitlines() if "lock node(s) unreachable" in x]
    assert "WARNING" in line and "1 of 3 lock node(s) unreachable" in line and names[0] in line
    assert "quorum 2 of 3 still reachable" in line and "at beat start" in line
    assert PASSWORD not in output
