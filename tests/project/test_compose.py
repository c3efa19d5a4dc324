"""docker-compose.yml is consistent with the repository (Docker itself is not needed: the file is only parsed).

Three independent lock nodes, a broker, two workers, two beat instances on SingletonScheduler and a one-shot demo;
every module a command names exists, the scheduler class imports, every Redis has a health check, and every
dependency waits for its service to be healthy.
"""

from __future__ import annotations

import importlib
import itertools
import re
import shlex
from pathlib import Path
from typing import Any

import needs
import pytest

yaml = needs.module("yaml", "pyyaml reads the compose file (the test extra has it)")

ROOT = Path(__file__).resolve().parent.parent.parent
LOCK_NODES = ("lock1", "lock2", "lock3")
REDIS = (*LOCK_NODES, "broker")
WORKERS = ("worker1", "worker2")
BEATS = ("beat1", "beat2")
SCHEDULER = "celery_singleton_lock.beat.SingletonScheduler"


@pytest.fixture(scope="module")
def services() -> dict[str, Any]:
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    return dict(compose["services"])


def default(value: Any) -> str:
    """A value as it reads with none of the file's variables set: ``${VAR:-redis:7}`` -> ``redis:7``."""
    return re.sub(r"\$\{[A-Z0-9_]+:-([^}]*)\}", r"\1", str(value))


def tokens(command: Any) -> list[str]:
    """A command (string or list) as words, with ``sh -c "..."`` scripts split too."""
    words = shlex.split(command) if isinstance(command, str) else [str(c) for c in command]
    out: list[str] = []
    for word in words:
        out.extend(tokens(word) if any(c.isspace() for c in word) else [word])
    return out


def option_values(command: Any, *flags: str) -> list[str]:
    words = tokens(command)
    return [value for flag, value in itertools.pairwise(words) if flag in flags]


def module_file(dotted: str) -> Path | None:
    """The file of a module path in this repository (``a.b`` -> a/b.py or a/b/__init__.py), if it exists."""
    base = ROOT.joinpath(*dotted.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def test_the_file_reads_in_compose_v1_too() -> None:
    """No top-level ``name``: Debian's docker-compose 1.29 (what CI installs) rejects it; the project name is given
    with ``-p`` instead (tools/docker_demo.py gives each run its own)."""
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    assert set(compose) - {"services", "volumes", "networks"} <= {k for k in compose if k.startswith("x-")}


def test_all_services_exist(services: dict[str, Any]) -> None:
    """Lock nodes, broker, two workers, two beat instances and the demo are all defined."""
    assert set(services) >= {*REDIS, *WORKERS, *BEATS, "demo"}


def test_lock_nodes_are_independent_masters(services: dict[str, Any]) -> None:
    """Three redis:7 nodes, none a replica of another, each with its own data volume, none the broker."""
    volumes = []
    for name in LOCK_NODES:
        node = services[name]
        assert default(node["image"]) == "redis:7"
        words = " ".join(tokens(node.get("command", []))).lower()
        assert "replicaof" not in words
        assert "slaveof" not in words
        assert "cluster-enabled" not in words
        volumes += [str(v).split(":")[0] for v in node.get("volumes", [])]
    assert len(volumes) == len(set(volumes)), "lock nodes must not share a data volume"
    lock_urls = services["worker1"]["environment"]["EXAMPLES_LOCK_URLS"].split(",")
    assert sorted(url.split("//")[1].split(":")[0] for url in lock_urls) == sorted(LOCK_NODES)


def test_every_redis_has_a_ping_healthcheck(services: dict[str, Any]) -> None:
    """Each Redis service is health-checked with redis-cli ping."""
    for name in REDIS:
        check = services[name]["healthcheck"]["test"]
        assert "redis-cli" in tokens(check)
        assert "ping" in tokens(check)


def test_depends_on_waits_for_healthy_services(services: dict[str, Any]) -> None:
    """Every dependency uses condition: service_healthy, on a service that has a health check."""
    dependents = 0
    for name, service in services.items():
        depends = service.get("depends_on")
        if depends is None:
            continue
        dependents += 1
        assert isinstance(depends, dict), f"{name}: depends_on must be a mapping with conditions"
        for dependency, spec in depends.items():
            assert spec == {"condition": "service_healthy"}, f"{name} -> {dependency}"
            assert "healthcheck" in services[dependency], f"{dependency} has no health check"
    assert dependents >= len(WORKERS) + len(BEATS) + 1
    assert {"worker1", "worker2"} <= set(services["demo"]["depends_on"])


def test_commands_refer_to_modules_in_the_repo(services: dict[str, Any]) -> None:
    """Every ``-A app`` and ``-m module`` in a command or health check is a module file of this repository."""
    named = []
    for name in (*WORKERS, *BEATS, "demo"):
        service = services[name]
        commands = [service["command"]]
        if "healthcheck" in service:
            commands.append(service["healthcheck"]["test"])
        for command in commands:
            for module in option_values(command, "-A", "--app", "-m"):
                named.append(module)
                assert module_file(module) is not None, f"{name}: {module} is not a module in the repository"
    assert "examples.example_app" in named
    assert "examples.beat_app" in named


def test_workers_and_beats_run_what_they_claim(services: dict[str, Any]) -> None:
    """Workers run examples.example_app on prefork; both beats use SingletonScheduler, whose class imports."""
    for name in WORKERS:
        words = tokens(services[name]["command"])
        assert words[:4] == ["celery", "-A", "examples.example_app", "worker"]
        assert option_values(words, "-P", "--pool") == ["prefork"]
    for name in BEATS:
        words = tokens(services[name]["command"])
        assert "beat" in words
        assert option_values(words, "-S", "--scheduler") == [SCHEDULER]
    module, _, attr = SCHEDULER.rpartition(".")
    assert module_file(module) is not None
    assert isinstance(getattr(importlib.import_module(module), attr), type)


def test_demo_runs_every_example_against_the_services(services: dict[str, Any]) -> None:
    """The demo runs each example with ``python -m`` and the services' env (so no throwaway servers start), but those
    that say why they cannot run there (``NOT_IN_COMPOSE_DEMO = True``)."""
    demo = services["demo"]
    examples = option_values(demo["command"], "-m")
    expected = {
        f"examples.{p.stem}"
        for p in (ROOT / "examples").glob("*.py")
        if "def main(app_module" in p.read_text() and "NOT_IN_COMPOSE_DEMO = True" not in p.read_text()
    }
    assert set(examples) == expected
    assert demo["environment"]["EXAMPLES_BROKER"] == "redis://broker:6379/0"
    assert demo.get("restart") == "no"


def test_app_services_are_built_from_the_repo_dockerfile(services: dict[str, Any]) -> None:
    """Workers, beats and demo build the repository's Dockerfile, which installs the package and the examples."""
    for name in (*WORKERS, *BEATS, "demo"):
        build = services[name]["build"]
        assert build["context"] == "."
        assert default(build["args"]["BASE"]) == "python:3.12-slim"  # the registry's image unless told otherwise
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert "ARG BASE=python:3.12-slim" in dockerfile
    assert "pip install " in dockerfile
    assert " . " in dockerfile.split("pip install ", 1)[1].split("\n", 1)[0]
    assert "COPY examples/" in dockerfile


def test_every_published_app_port_is_served_by_its_command(services: dict[str, Any]) -> None:
    """A port published by an app service (not a Redis) is one its command listens on: the metrics service runs
    ``celery locks web`` on it (the library's /metrics, summed over every worker), and no worker publishes a port
    nothing listens on; the file's comments name the service that serves /metrics."""
    apps = {name: s for name, s in services.items() if "redis" not in str(s.get("command"))}
    published = {name: s["ports"] for name, s in apps.items() if s.get("ports")}
    assert set(published) == {"metrics"}, published
    words = tokens(services["metrics"]["command"])
    assert words[:4] == ["celery", "-A", "examples.example_app", "locks"] and "web" in words
    (port,) = published["metrics"]
    assert default(port).startswith("127.0.0.1:") and default(port).endswith(":" + option_values(words, "--port")[0])
    head = (ROOT / "docker-compose.yml").read_text().split("x-redis-healthcheck", 1)[0]
    assert "each worker serves /metrics" not in head and "locks web" in head
