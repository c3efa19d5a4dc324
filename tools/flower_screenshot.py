"""Show what Flower tells about skipped duplicates, on real parts, and take the screenshots the docs use.

::

    .venv/bin/python tools/flower_screenshot.py                  # RabbitMQ broker (a vhost of its own), docs/img/
    .venv/bin/python tools/flower_screenshot.py --broker redis   # a throwaway redis-server as the broker
    .venv/bin/python tools/flower_screenshot.py --out /tmp/shots --events

What it starts (all on 127.0.0.1, torn down on exit, even after a failure): a redis-server lock node; the broker
(a throwaway RabbitMQ vhost made with ``rabbitmqctl`` on the local RabbitMQ, or a throwaway redis-server); real
Flower (``celery -A tools.flower_app flower``, its HTTP API open: FLOWER_UNAUTHENTICATED_API=true); two real
``celery worker -E`` processes running ``tools/flower_app.py``.

What it does (:func:`run_scenario`): charges one order and, while that run holds the order's lock, sends three
duplicates of it (skip); restocks one item and sends one duplicate of it (reschedule); refunds one order and sends one
duplicate of it (fail); then sends the finished charge's own message again (same task id: a copy of a job that
already succeeded). It waits (bounded) until Flower's API (``/api/tasks``) reports every final state and checks it
(:func:`problems`): the duplicates REVOKED, the charge SUCCESS (also after its copy), the rescheduled restock SUCCESS
after RETRY, the refund's duplicate FAILURE. Then headless Chromium takes three screenshots (``--out``): Flower's
task list (``/tasks``), one skipped duplicate's page and the rescheduled duplicate's page (``/task/<id>``).

``--events`` also prints the Celery event stream of each task id, as a receiver of its own saw it.

Exit status: 0 when every check passed and the screenshots were written, 1 when a check failed, 2 on a harness error.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

TOOLS = Path(__file__).resolve().parent
ROOT = TOOLS.parent
if str(ROOT) not in sys.path:  # run from a checkout: python tools/flower_screenshot.py
    sys.path.insert(1, str(ROOT))

from celery_singleton_lock import testing  # noqa: E402
from celery_singleton_lock.testing import CeleryWorker, RedisServer, free_port, wait_for  # noqa: E402

APP = "tools.flower_app"
RABBITMQ_PORT = int(os.environ.get("CSL_RABBITMQ_PORT", "5672"))
# The task list's columns (Flower sorts by "received", newest first, when it is one of them).
COLUMNS = "name,uuid,state,args,result,received,worker"
FINAL = ("SUCCESS", "FAILURE", "REVOKED")
# Three pool processes a worker: three first runs hold their locks while the duplicates reach free processes.
CONCURRENCY = 3


def log(message: str) -> None:
    print(f"[flower_screenshot] {message}", flush=True)


# -- the broker -----------------------------------------------------------------------------------------------------


def _rabbitmqctl(*args: str) -> None:
    subprocess.run(["rabbitmqctl", "-q", *args], check=True, capture_output=True, timeout=60)  # noqa: S603, S607


@contextlib.contextmanager
def rabbitmq_vhost(port: int = RABBITMQ_PORT) -> Iterator[str]:
    """A throwaway vhost on the local RabbitMQ (guest/guest); yields its broker URL. Deleted on exit."""
    if shutil.which("rabbitmqctl") is None:
        raise RuntimeError("rabbitmqctl is not on PATH: install RabbitMQ, or run with --broker redis")
    name = f"csl-flower-{uuid.uuid4().hex[:10]}"
    _rabbitmqctl("add_vhost", name)
    try:
        _rabbitmqctl("set_permissions", "-p", name, "guest", ".*", ".*", ".*")
        yield f"amqp://guest:guest@127.0.0.1:{port}/{name}"
    finally:
        with contextlib.suppress(subprocess.SubprocessError):
            _rabbitmqctl("delete_vhost", name)


@contextlib.contextmanager
def redis_broker() -> Iterator[str]:
    """A throwaway redis-server as the broker; yields its URL."""
    with RedisServer() as server:
        yield server.url


# -- Flower ---------------------------------------------------------------------------------------------------------


class Flower:
    """A real Flower process (its own process group) on a free loopback port, its HTTP API open."""

    def __init__(self, *, env: dict[str, str], log_path: Path, port: int | None = None) -> None:
        self.port = port or free_port()
        self.env = {**env, "FLOWER_UNAUTHENTICATED_API": "true"}
        self.log_path = log_path
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 30.0) -> Flower:
        args = [
            sys.executable, "-m", "celery", "-A", APP, "flower",
            f"--port={self.port}", "--address=127.0.0.1", f"--tasks_columns={COLUMNS}",
        ]  # fmt: skip
        with open(self.log_path, "ab") as out:
            self.process = subprocess.Popen(  # noqa: S603 - our own argv
                args, cwd=ROOT, env=self.env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"flower exited with {self.process.returncode}:\n{self.log()[-3000:]}")
            with contextlib.suppress(OSError, ValueError):
                self.tasks()
                return self
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"flower did not answer within {timeout} s:\n{self.log()[-3000:]}")

    def get(self, path: str, timeout: float = 5.0) -> Any:
        with urllib.request.urlopen(self.url + path, timeout=timeout) as response:  # noqa: S310 - our loopback URL
            return json.loads(response.read())

    def tasks(self) -> dict[str, dict[str, Any]]:
        """Flower's ``/api/tasks``: every task it knows, by task id, as Celery's event state has it."""
        answer: dict[str, dict[str, Any]] = self.get("/api/tasks")
        return answer

    def log(self) -> str:
        try:
            return self.log_path.read_text(encoding="utf-8", errors="replace")
        except FileNotFoundError:
            return ""

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.process.pid, signal.SIGTERM)
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.process.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(10)


# -- the stack ------------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Stack:
    broker_url: str
    lock_url: str
    flower: Flower
    workers: list[CeleryWorker]
    app: Any  # tools/flower_app.py, imported in this process with this stack's configuration

    def logs(self) -> str:
        """The tail of each worker's log and of Flower's, for a failure message."""
        tails = [f"--- {w.name} ---\n{w.log()[-4000:]}" for w in self.workers]
        flower = "\n".join(line for line in self.flower.log().splitlines() if "Inspect method" not in line)
        return "\n".join([*tails, f"--- flower ---\n{flower[-2000:]}"])


def import_app(env: dict[str, str]) -> Any:
    """tools/flower_app.py imported afresh with ``env`` (it reads its configuration at import); os.environ is kept."""
    saved = {name: os.environ.get(name) for name in env}
    os.environ.update(env)
    try:
        sys.modules.pop(APP, None)
        return importlib.import_module(APP)
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _start(worker: CeleryWorker, errors: list[BaseException]) -> None:
    try:
        worker.start(timeout=60)
    except BaseException as exc:  # handed to the caller's thread, which raises it
        errors.append(exc)


@contextlib.contextmanager
def stack(broker_url: str, workdir: Path, *, workers: int = 2) -> Iterator[Stack]:
    """A lock node, Flower, then ``workers`` workers (``-E``) on ``broker_url``; all stopped on exit, even on failure.

    Flower starts first, so its event receiver is consuming before any worker can send an event.
    """
    with RedisServer() as node:
        env = {"FLOWER_DEMO_BROKER": broker_url, "FLOWER_DEMO_LOCK_URLS": node.url}
        full_env = {**os.environ, **env}
        full_env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), full_env.get("PYTHONPATH", "")]))
        flower = Flower(env=full_env, log_path=workdir / "flower.log")
        started: list[CeleryWorker] = []
        try:
            flower.start()
            for i in range(1, workers + 1):
                log_path = str(workdir / f"w{i}.log")
                worker = CeleryWorker(
                    APP, f"w{i}", cwd=str(ROOT), log_path=log_path, concurrency=CONCURRENCY, env=env, extra=["-E"]
                )
                started.append(worker)
            # Start them side by side (each start waits for its worker's "ready" line, bounded).
            errors: list[BaseException] = []
            threads = [threading.Thread(target=_start, args=(w, errors)) for w in started]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(90)
            if errors:
                raise errors[0]
            module = import_app(env)
            try:
                yield Stack(broker_url, node.url, flower, started, module)
            finally:
                module.app.close()
        finally:
            for worker in started:
                worker.stop(timeout=10)
            flower.stop()


# -- the scenario ---------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Scenario:
    job: str  # charge("order-1"): runs, SUCCESS
    duplicates: list[str]  # charge("order-1") while it runs: REVOKED
    restock: str  # restock("sku-1"): runs, SUCCESS
    rescheduled: str  # restock("sku-1") while it runs: RETRY, then SUCCESS (same task id)
    refund: str  # refund("order-2"): runs, SUCCESS
    failed: str  # refund("order-2") while it runs: FAILURE (DuplicateTaskError)
    done_copy: str  # the job's own message sent again after it succeeded: stays SUCCESS

    def expected(self) -> dict[str, str]:
        """Each task id's final state in Flower."""
        want = {self.job: "SUCCESS", self.restock: "SUCCESS", self.rescheduled: "SUCCESS", self.refund: "SUCCESS"}
        want.update(dict.fromkeys(self.duplicates, "REVOKED"))
        want[self.failed] = "FAILURE"
        return want


def wait_until(
    flower: Flower, done: Callable[[dict[str, dict[str, Any]]], bool], timeout: float, what: str
) -> dict[str, dict[str, Any]]:
    """Poll Flower's task list until ``done(tasks)``: at most ``timeout`` s (every 0.2 s); raise saying ``what``."""
    deadline = time.monotonic() + timeout
    tasks: dict[str, dict[str, Any]] = {}
    for _ in range(int(timeout / 0.2) + 1):
        with contextlib.suppress(OSError, ValueError):
            tasks = flower.tasks()
            if done(tasks):
                return tasks
        if time.monotonic() >= deadline:
            break
        time.sleep(0.2)
    states = {task_id: t.get("state") for task_id, t in tasks.items()}
    raise TimeoutError(f"Flower did not show {what} within {timeout} s; it shows {states}")


def _state(tasks: dict[str, dict[str, Any]], task_id: str) -> str | None:
    return tasks.get(task_id, {}).get("state")


def run_scenario(s: Stack, timeout: float = 30.0) -> tuple[Scenario, dict[str, dict[str, Any]]]:
    """Fire the jobs and their duplicates; return their ids and Flower's task list once every state is final."""
    mod = s.app
    job = mod.charge.delay("order-1").id
    restock = mod.restock.delay("sku-1").id
    refund = mod.refund.delay("order-2").id
    # The duplicates must reach a worker while the first runs hold their locks: wait until Flower says STARTED.
    first = (job, restock, refund)
    wait_until(s.flower, lambda t: all(_state(t, i) == "STARTED" for i in first), timeout, "the first runs")
    duplicates = [mod.charge.delay("order-1").id for _ in range(3)]
    rescheduled = mod.restock.delay("sku-1").id
    failed = mod.refund.delay("order-2").id
    wait_until(s.flower, lambda t: _state(t, job) == "SUCCESS", timeout, "the charge's SUCCESS")
    # The finished job's own message again (same task id): a copy of a job that already succeeded.
    mod.charge.apply_async(("order-1",), task_id=job)
    scenario = Scenario(job, duplicates, restock, rescheduled, refund, failed, done_copy=job)
    # Wait for a final state, whichever it is: the checks (problems(), the tests) say which state is wrong.
    ids = list(scenario.expected())
    wait_until(s.flower, lambda t: all(_state(t, i) in FINAL for i in ids), timeout, f"a final state for {ids}")
    # The done copy is skipped quietly (no final event): wait for its worker's log line, let its events (if any)
    # reach Flower, then read again: the charge must still be SUCCESS.
    said = f"charge[{job}] skipped: already done"
    if not wait_for(lambda: said in "".join(w.log() for w in s.workers), timeout=timeout, interval=0.2):
        raise TimeoutError(f"no worker logged {said!r} within {timeout} s")
    time.sleep(1.0)
    return scenario, s.flower.tasks()


def problems(scenario: Scenario, tasks: dict[str, dict[str, Any]]) -> list[str]:
    """What Flower's task list gets wrong about the scenario (empty when it is all as documented)."""
    found = []
    for task_id, want in scenario.expected().items():
        got = _state(tasks, task_id)
        if got != want:
            found.append(f"{task_id}: Flower shows {got}, expected {want}")
    for task_id in scenario.duplicates:
        task = tasks.get(task_id, {})
        if not task.get("revoked"):
            found.append(f"duplicate {task_id}: no revoked time")
        if task.get("succeeded"):
            found.append(f"duplicate {task_id}: has a succeeded time (a task-succeeded event was sent)")
    rescheduled = tasks.get(scenario.rescheduled, {})
    if not rescheduled.get("retried"):
        found.append(f"rescheduled {scenario.rescheduled}: no retried time (no task-retried event)")
    if scenario.restock not in str(rescheduled.get("exception")):
        found.append(f"rescheduled {scenario.rescheduled}: its reason does not name the holder {scenario.restock}")
    if "DuplicateTaskError" not in str(tasks.get(scenario.failed, {}).get("exception")):
        found.append(f"failed duplicate {scenario.failed}: no DuplicateTaskError")
    if tasks.get(scenario.job, {}).get("result") != "'charged order-1'":
        found.append(f"job {scenario.job}: result {tasks.get(scenario.job, {}).get('result')!r}")
    return found


# -- events (--events) ----------------------------------------------------------------------------------------------


class EventLog(testing.EventLog):
    """Every Celery event on the broker (celery_singleton_lock.testing.EventLog), and a dump of the scenario's."""

    def dump(self, scenario: Scenario) -> str:
        names = {scenario.job: "job (and its done copy)", scenario.restock: "restock", scenario.refund: "refund"}
        names.update({d: f"duplicate {n}" for n, d in enumerate(scenario.duplicates, 1)})
        names.update({scenario.rescheduled: "rescheduled duplicate", scenario.failed: "failed duplicate"})
        keep = ("result", "exception", "reason", "holder", "lock_skip", "terminated", "expired")
        lines = []
        for task_id, name in names.items():
            lines.append(f"{name} {task_id}:")
            for event in [e for e in list(self.events) if e.get("uuid") == task_id]:
                extra = {k: event[k] for k in keep if event.get(k) not in (None, "")}
                lines.append(f"  {event['type']:<15} {event.get('hostname', '')} {json.dumps(extra)}")
        return "\n".join(lines)


# -- screenshots ----------------------------------------------------------------------------------------------------


def chromium() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        found = shutil.which(name)
        if found:
            return found
    raise RuntimeError("no headless Chromium: apt-get install -y chromium")


def screenshot(url: str, path: Path, *, width: int, height: int, budget_ms: int = 5000) -> None:
    """Headless Chromium renders ``url`` (running its scripts for ``budget_ms`` of virtual time) into ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="csl-chromium-") as profile:
        args = [
            chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
            "--disable-background-networking", "--disable-component-update", "--disable-sync",
            "--hide-scrollbars", f"--user-data-dir={profile}", f"--window-size={width},{height}",
            f"--virtual-time-budget={budget_ms}", f"--screenshot={path}", url,
        ]  # fmt: skip
        done = subprocess.run(args, capture_output=True, timeout=90, check=False)  # noqa: S603 - our own argv
    if done.returncode != 0 or not path.exists():
        raise RuntimeError(f"chromium failed ({done.returncode}): {done.stderr.decode(errors='replace')[-2000:]}")


# -- main -----------------------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    p.add_argument("--broker", choices=("rabbitmq", "redis"), default="rabbitmq", help="the broker (rabbitmq)")
    p.add_argument("--out", type=Path, default=ROOT / "docs" / "img", help="where the PNGs go (docs/img)")
    p.add_argument("--events", action="store_true", help="also print each task id's Celery event stream")
    p.add_argument("--timeout", type=float, default=30.0, help="seconds to wait for each state in Flower (30)")
    a = p.parse_args(argv)
    try:
        with contextlib.ExitStack() as stack_:
            workdir = Path(stack_.enter_context(tempfile.TemporaryDirectory(prefix="csl-flower-")))
            broker = stack_.enter_context(rabbitmq_vhost() if a.broker == "rabbitmq" else redis_broker())
            s = stack_.enter_context(stack(broker, workdir))
            log(f"flower at {s.flower.url}, workers {[w.name for w in s.workers]}, broker {a.broker}")
            events = stack_.enter_context(EventLog(s.app.app)) if a.events else None
            try:
                scenario, tasks = run_scenario(s, timeout=a.timeout)
            except TimeoutError as exc:
                log(f"FAILED: {exc}\n{s.logs()}")
                return 1
            if events is not None:
                log("events:\n" + events.dump(scenario))
            found = problems(scenario, tasks)
            for task_id in [scenario.job, *scenario.duplicates, scenario.rescheduled, scenario.failed]:
                t = tasks[task_id]
                log(f"{t['name']}{t['args']} {task_id}: {t['state']} (exception={t.get('exception')!r})")
            if found:
                log("FAILED:\n  " + "\n  ".join(found))
                return 1
            url = s.flower.url
            shots = [  # (file, page, window width, height): each cropped to what it shows
                ("flower-skipped-duplicates.png", f"{url}/tasks", 1400, 740),
                ("flower-skipped-duplicate-detail.png", f"{url}/task/{scenario.duplicates[0]}", 1000, 900),
                ("flower-rescheduled-detail.png", f"{url}/task/{scenario.rescheduled}", 1000, 950),
            ]
            for name, page, width, height in shots:
                screenshot(page, a.out / name, width=width, height=height)
                log(f"wrote {a.out / name} ({(a.out / name).stat().st_size // 1024} KiB)")
            log("OK: duplicates REVOKED, the job SUCCESS, the rescheduled one SUCCESS after RETRY, fail: FAILURE")
            return 0
    except KeyboardInterrupt:
        log("interrupted")
        return 2
    except Exception:
        log("harness error:\n" + traceback.format_exc())
        return 2


if __name__ == "__main__":
    sys.exit(main())
