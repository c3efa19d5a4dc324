"""The distribution builds, passes ``twine check``, and works installed from the wheel.

The build runs on a copy of the source tree (nothing is written into the repository) with build isolation, so the
declared build requirements are what gets tested. The wheel goes into a fresh venv without its dependencies; the
dependencies are borrowed from the running environment through a ``.pth`` line, which keeps the test fast and
offline while the package itself can only come from the wheel. One build and one venv serve every test here,
among them docs/testing.md's example test file, run there with pytest as a user runs it.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import sysconfig
import tarfile
import zipfile
from pathlib import Path

import pytest

from celery_singleton_lock.testing import RedisServer, wait_for

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    tomllib = pytest.importorskip("tomli")

ROOT = Path(__file__).resolve().parent.parent.parent
PACKAGE = "celery_singleton_lock"
_SKIP = shutil.ignore_patterns(
    ".git", ".venv", "build", "dist", "*.egg-info", "__pycache__", ".*_cache", ".hypothesis", "celerybeat-schedule*"
)


@pytest.fixture(scope="module")
def dist(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("packaging")
    src, out = tmp / "src", tmp / "dist"
    shutil.copytree(ROOT, src, ignore=_SKIP)
    subprocess.run(
        [sys.executable, "-m", "build", "--outdir", str(out), str(src)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    return out


def project() -> dict[str, str]:
    return dict(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"])


def only(directory: Path, pattern: str) -> Path:
    (found,) = directory.glob(pattern)
    return found


def test_twine_check_passes(dist: Path) -> None:
    """The wheel and the sdist have valid metadata and a README that renders on PyPI."""
    files = sorted(str(p) for p in dist.iterdir())
    assert len(files) == 2
    result = subprocess.run(
        [sys.executable, "-m", "twine", "check", "--strict", *files],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_wheel_and_sdist_contents(dist: Path) -> None:
    """The wheel ships the package with py.typed, every Lua script (lua/*.lua, read at import) and no tests; the
    sdist carries the sources, the scripts and the README."""
    names = zipfile.ZipFile(only(dist, "*.whl")).namelist()
    scripts = {f"{PACKAGE}/lock/lua/{p.name}" for p in (ROOT / PACKAGE / "lock" / "lua").glob("*.lua")}
    assert scripts, "no Lua scripts found in the source tree"
    assert scripts <= set(names), sorted(scripts - set(names))
    assert f"{PACKAGE}/py.typed" in names
    assert f"{PACKAGE}/__init__.py" in names
    assert all(n.startswith((f"{PACKAGE}/", f"{PACKAGE}-")) for n in names), names
    with tarfile.open(only(dist, "*.tar.gz")) as sdist:
        members = {m.split("/", 1)[1] for m in sdist.getnames() if "/" in m}
    assert {"pyproject.toml", "README.md", f"{PACKAGE}/py.typed", f"{PACKAGE}/task/__init__.py"} <= members
    assert scripts <= members, sorted(scripts - members)


@pytest.fixture(scope="module")
def venv(dist: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh venv holding the wheel (shared by the tests below: one build, one install)."""
    venv = tmp_path_factory.mktemp("installed") / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    wheel = str(only(dist, "*.whl"))
    subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "--no-index", "-q", wheel],
        check=True,
        capture_output=True,
        timeout=120,
    )
    site = Path(
        subprocess.check_output([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"])
        .decode()
        .strip()
    )
    # The dependencies (celery, redis) from this environment; a .pth line does not run this environment's own
    # .pth files, so its editable install of the package stays out of the way.
    (site / "_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return venv


def run_installed(venv: Path, code: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """``code`` run by the venv's python, isolated (-I: no PYTHON* variables, no current directory on sys.path)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    return subprocess.run(
        [str(venv / "bin" / "python"), "-I", "-c", code],
        check=False,
        capture_output=True,
        text=True,
        cwd=cwd,
        env=env,
        timeout=300,
    )


def test_installed_wheel_imports_with_the_project_version(venv: Path, tmp_path: Path) -> None:
    """Installed from the wheel into a fresh venv, the package imports from there, reports pyproject's version,
    and its Celery and pytest entry points resolve."""
    probe = f"""
import json, importlib.metadata as md, celery_singleton_lock as p
eps = [ep for ep in md.distribution("{project()["name"]}").entry_points]
print(json.dumps({{"file": p.__file__, "version": p.__version__, "eps": {{ep.name: str(ep.load()) for ep in eps}}}}))
"""
    out = run_installed(venv, probe, tmp_path)
    assert out.returncode == 0, out.stderr
    seen = json.loads(out.stdout)
    assert Path(seen["file"]).is_relative_to(venv)
    assert seen["version"] == project()["version"]
    assert set(seen["eps"]) == {"locks", "singleton", "celery_singleton_lock"}


_RUN_EXAMPLE = """
import json, sys
import pytest
code = pytest.main(["-q", "-p", "no:cacheprovider"])
import celery_singleton_lock, celery_singleton_lock.pytest_plugin as plugin
print(json.dumps({"code": int(code), "package": celery_singleton_lock.__file__, "plugin": plugin.__file__,
                  "path": sys.path}))
"""


def test_the_testing_example_passes_against_the_installed_wheel(venv: Path, tmp_path: Path) -> None:
    """docs/testing.md's example (examples/testing/, copied out of the source tree) passes as a user runs it, with
    the plugin registered by the wheel's pytest11 entry point: the plugin and the package load from the venv, and
    this source tree is not on sys.path."""
    example = tmp_path / "example"
    shutil.copytree(ROOT / "examples" / "testing", example, ignore=_SKIP)
    out = run_installed(venv, _RUN_EXAMPLE, example)
    *report, last = out.stdout.strip().splitlines() or [""]
    assert last.startswith("{"), out.stdout + out.stderr
    seen = json.loads(last)
    assert seen["code"] == 0, "\n".join(report) + out.stderr
    assert Path(seen["package"]).is_relative_to(venv)
    assert Path(seen["plugin"]).is_relative_to(venv)
    assert not any(Path(p).resolve() == ROOT for p in seen["path"] if p)
    assert re.search(r"\b4 passed\b", "\n".join(report)), report


FRESH_APP = """
import os

from celery import Celery

from celery_singleton_lock import LockedTask

base = os.environ["CSL_REDIS"]
app = Celery("fresh_app", broker=base + "/0", backend=base + "/1")
app.conf.singleton_lock_urls = [base + "/2"]


@app.task(base=LockedTask, bind=True)
def locked_add(self, x, y):
    return [x + y, self.fencing_token is not None]
"""

_PRODUCE = """
import json
from fresh_app import locked_add
print(json.dumps(locked_add.delay(2, 3).get(timeout=60)))
"""


@pytest.mark.slow
def test_the_wheel_installed_with_its_dependencies_runs_a_worker_on_a_redis_broker(
    dist: Path, tmp_path: Path, fresh_node: RedisServer
) -> None:
    """The wheel installed WITH the dependencies it declares (resolved by pip, nothing borrowed) into a fresh venv
    runs a real worker on a Redis broker that executes a LockedTask, and the doctor reads the broker's visibility
    timeout: kombu's Redis transport imports there."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = str(venv / "bin" / "python")
    install = subprocess.run(
        [sys.executable, "-m", "pip", "--python", python, "install", "-q", str(only(dist, "*.whl"))],
        check=False,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert install.returncode == 0, install.stdout + install.stderr
    app_dir = tmp_path / "app"
    app_dir.mkdir()
    (app_dir / "fresh_app.py").write_text(FRESH_APP)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    env.update(PYTHONPATH=str(app_dir), CSL_REDIS=f"redis://127.0.0.1:{fresh_node.port}")
    log = tmp_path / "worker.log"
    argv = [python, "-m", "celery", "-A", "fresh_app", "worker", "-P", "prefork", "-c", "1", "-l", "INFO"]
    argv += ["--without-gossip", "--without-mingle", "--without-heartbeat"]
    with log.open("wb") as out:
        worker = subprocess.Popen(
            argv, cwd=app_dir, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        ready = wait_for(lambda: " ready." in log.read_text() or worker.poll() is not None, 60, 0.1)
        assert ready and worker.poll() is None, log.read_text()[-3000:]
        produced = subprocess.run(
            [python, "-c", _PRODUCE], cwd=app_dir, env=env, capture_output=True, text=True, check=False, timeout=120
        )
        assert produced.returncode == 0, produced.stderr + log.read_text()[-3000:]
        assert json.loads(produced.stdout) == [5, True]
        doctor = subprocess.run(
            [python, "-m", "celery", "-A", "fresh_app", "locks", "doctor", "--json"],
            cwd=app_dir,
            env=env,
            capture_output=True,
            text=True,
            check=False,
            timeout=120,
        )
        findings = json.loads(doctor.stdout)["findings"]
        visibility = [f for f in findings if f["code"] == "visibility-timeout"]
        assert [(f["level"], f["subject"]) for f in visibility] == [("ok", "task fresh_app.locked_add")], visibility
    finally:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(worker.pid, signal.SIGKILL)
        worker.wait(30)


_DOCTOR_WITHOUT_PACKAGING = """
import json, sys
sys.modules["packaging"] = None  # as in a venv without kombu's redis extra: importing it raises ImportError
from celery import Celery
from celery_singleton_lock import LockedTask
from celery_singleton_lock.doctor import broker_findings

app = Celery("no_extra", broker="redis://:hunter2@127.0.0.1:1/0")


@app.task(base=LockedTask, lock_ttl=30)
def job():
    pass


print(json.dumps([f.to_json() for f in broker_findings(app) if f.code == "visibility-timeout"]))
"""


def test_the_doctor_names_a_broker_transport_that_failed_to_import(tmp_path: Path) -> None:
    """With kombu's Redis transport unimportable, the doctor says so as an error naming what to install, not that
    the broker has no visibility timeout, and shows no part of the broker URL."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    out = subprocess.run(
        [sys.executable, "-c", _DOCTOR_WITHOUT_PACKAGING],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    (finding,) = json.loads(out.stdout)
    assert finding["level"] == "error"
    assert "redis transport failed to import" in finding["message"]
    assert "packaging" in finding["message"]
    assert "pip install 'kombu[redis]'" in finding["fix"]
    assert "hunter2" not in out.stdout
