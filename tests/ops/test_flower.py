"""What real Flower shows for each kind of duplicate, read from its HTTP API (``/api/tasks``).

The scenario of ``tools/flower_screenshot.py`` (which also takes the docs' screenshots), on real parts: a RabbitMQ
vhost of its own as the broker (tests/rabbitmq.py: skipped where no RabbitMQ runs, failed under CI=true), a
redis-server lock node, real Flower (``celery flower``) and two real ``celery worker -E`` processes running
``tools/flower_app.py``. One scenario per module; each test reads one part of Flower's answer.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import needs
import pytest
import rabbitmq

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent.parent


def _tool() -> ModuleType:
    """tools/flower_screenshot.py as a module (tools/ is no package of ours: loaded by path)."""
    name = "flower_screenshot"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, ROOT / "tools" / "flower_screenshot.py")
        assert spec is not None
        assert spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses look their module up here
        spec.loader.exec_module(module)
    return sys.modules[name]


@pytest.fixture(scope="module")
def flower(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Any, dict[str, dict[str, Any]]]]:
    """The scenario run once against real Flower: (its task ids, Flower's ``/api/tasks`` at the end)."""
    needs.module("flower", "pip install -e '.[test]' (the test extra has it)")
    tool = _tool()
    with rabbitmq.vhost() as url, tool.stack(url, tmp_path_factory.mktemp("flower")) as s:
        try:
            outcome = tool.run_scenario(s, timeout=30.0)
        except TimeoutError as exc:
            pytest.fail(f"{exc}\n{s.logs()}", pytrace=False)
        finally:
            sys.modules.pop(tool.APP, None)
        yield outcome


def test_skipped_duplicates_are_revoked_not_success(flower: tuple[Any, dict[str, dict[str, Any]]]) -> None:
    """Three duplicates of a running charge are REVOKED in Flower (a task-revoked event), never SUCCESS, and Flower
    shows why: the reason, naming the holder's task id, in its Exception field."""
    scenario, tasks = flower
    for task_id in scenario.duplicates:
        task = tasks[task_id]
        assert task["state"] == "REVOKED", task
        assert f"held by task {scenario.job}" in (task["exception"] or ""), task
        assert task["revoked"], task
        assert task["succeeded"] is None, f"a task-succeeded event reached Flower: {task}"
        assert task["result"] is None, task


def test_the_job_is_success_and_its_done_copy_changes_nothing(flower: tuple[Any, dict[str, dict[str, Any]]]) -> None:
    """The charge that ran is SUCCESS with its result, and stays so after its own message came back and was
    skipped as already done."""
    scenario, tasks = flower
    job = tasks[scenario.job]
    assert job["state"] == "SUCCESS", job
    assert job["result"] == "'charged order-1'", job


def test_a_rescheduled_duplicate_is_success_after_retry(flower: tuple[Any, dict[str, dict[str, Any]]]) -> None:
    """A reschedule duplicate is RETRY (task-retried, its reason naming the holder), then SUCCESS under the same
    task id once its re-sent copy ran."""
    scenario, tasks = flower
    task = tasks[scenario.rescheduled]
    assert task["state"] == "SUCCESS", task
    assert task["retried"], f"no task-retried event reached Flower: {task}"
    assert task["result"] == "'restocked sku-1'", task
    assert f"held by task {scenario.restock}" in task["exception"], task
    assert tasks[scenario.restock]["state"] == "SUCCESS", tasks[scenario.restock]


def test_a_fail_policy_duplicate_is_failure(flower: tuple[Any, dict[str, dict[str, Any]]]) -> None:
    """With lock_on_duplicate='fail' the duplicate is FAILURE with DuplicateTaskError naming the holder."""
    scenario, tasks = flower
    task = tasks[scenario.failed]
    assert task["state"] == "FAILURE", task
    assert "DuplicateTaskError" in task["exception"], task
    assert scenario.refund in task["exception"], task
    assert tasks[scenario.refund]["state"] == "SUCCESS", tasks[scenario.refund]


def test_the_tool_finds_nothing_wrong(flower: tuple[Any, dict[str, dict[str, Any]]]) -> None:
    """tools/flower_screenshot.py's own check (what it asserts before taking the screenshots) passes."""
    scenario, tasks = flower
    assert _tool().problems(scenario, tasks) == []
