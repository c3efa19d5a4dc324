"""Run docker-compose.yml's whole set-up, check the demo's verdict, optionally kill a lock node mid-run; clean up.

    bash tools/docker_images.sh              # engine, local base images, docker/local.env (no registry needed)
    python tools/docker_demo.py              # up, verdict, down -v
    python tools/docker_demo.py --kill lock2 # then the demo once more, lock2 killed while it runs and started again

Every run is a compose project of its own (``csl-<pid>-<random>``): its containers, network and volumes carry that
project's label, and only they are ever stopped, killed or removed (``down -v --remove-orphans``), in a ``finally``
that also runs on SIGTERM / SIGINT. The workers' metrics ports are free loopback ports picked for the run, so two
runs side by side do not collide.

The verdict:

* the demo container exits 0: every example saw each duplicate skipped and each distinct job run
  (``examples/_harness.py``: ``run_example`` exits 1 otherwise);
* each beat slot was sent once: across both workers' logs, no ``heartbeat for slot S`` or ``report for the minute
  starting at S`` line appears twice; at least two heartbeat slots were run, and both beats were at work (runs
  were sent, and at least one was left to the other beat: ``was claimed by another beat instance``).

Uses ``docker compose`` (the plugin) if it answers, else Debian's ``docker-compose`` (1.29).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType

ROOT = Path(__file__).resolve().parent.parent
ENV_FILE = ROOT / "docker" / "local.env"
COMPOSE_FILE = ROOT / "docker-compose.yml"
_SLOT = re.compile(r"(heartbeat for slot|report for the minute starting at) (\S+),? task")
_CLAIMED = re.compile(r"was claimed by another beat instance")
_SENT = re.compile(r"Scheduler: Sending due task")


def compose_command() -> list[str]:
    """``docker compose`` if the plugin answers, else ``docker-compose``; raises if neither does."""
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        if (
            subprocess.run(["docker", "compose", "version"], capture_output=True, timeout=20, check=False).returncode
            == 0
        ):
            return ["docker", "compose"]
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    raise RuntimeError(
        "neither `docker compose` nor `docker-compose` is installed (tools/docker_images.sh installs one)"
    )


def local_env() -> dict[str, str]:
    """docker/local.env's variables (written by tools/docker_images.sh), or none when it is absent."""
    if not ENV_FILE.is_file():
        return {}
    pairs = (line.split("=", 1) for line in ENV_FILE.read_text().splitlines() if "=" in line and line[0] != "#")
    return {k.strip(): v.strip() for k, v in pairs}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Verdict:
    demo_exit: int | None = None
    slots: dict[str, int] = field(default_factory=dict)  # "heartbeat 1764121000" -> times run
    timings: dict[str, float] = field(default_factory=dict)
    killed: str | None = None
    demo_log: str = ""
    beats_sent: dict[str, int] = field(default_factory=dict)  # beat service -> "Sending due task" lines
    beats_claimed_elsewhere: int = 0  # "... was claimed by another beat instance ...; not sending it" lines

    @property
    def duplicated_slots(self) -> list[str]:
        return sorted(s for s, n in self.slots.items() if n > 1)

    @property
    def heartbeats(self) -> int:
        return sum(1 for s in self.slots if s.startswith("heartbeat"))

    @property
    def ok(self) -> bool:
        return (
            self.demo_exit == 0
            and not self.duplicated_slots
            and self.heartbeats >= 2
            and sum(self.beats_sent.values()) >= 2
            and self.beats_claimed_elsewhere >= 1  # both beats were at work: each run claimed once between them
        )

    def summary(self) -> str:
        times = ", ".join(f"{k} {v:.1f} s" for k, v in self.timings.items())
        return (
            f"demo exit {self.demo_exit}; beat slots run {len(self.slots)} ({self.heartbeats} heartbeats), "
            f"duplicated {self.duplicated_slots or 'none'}; beats sent {self.beats_sent}, "
            f"{self.beats_claimed_elsewhere} runs left to the other beat; killed {self.killed or 'nothing'}; {times}"
        )


class ComposeRun:
    """One compose project: ``up``, commands on its services, and ``down -v`` however it ends."""

    def __init__(self, project: str | None = None, *, log: Path | None = None) -> None:
        self.project = project or f"csl-{os.getpid()}-{secrets.token_hex(3)}"
        self.base = [*compose_command(), "-p", self.project, "-f", str(COMPOSE_FILE)]
        self.env = {
            **os.environ,
            **local_env(),
            "CSL_METRICS_PORT1": str(free_port()),
            "CSL_METRICS_PORT2": str(free_port()),
            "COMPOSE_HTTP_TIMEOUT": "300",
        }
        self.log = log

    def run(self, *args: str, timeout: float = 600, check: bool = True) -> subprocess.CompletedProcess[str]:
        proc = subprocess.run(
            [*self.base, *args],
            cwd=ROOT,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
        if self.log is not None:
            with self.log.open("a") as f:
                f.write(f"$ {' '.join(args)} -> {proc.returncode}\n{proc.stdout}{proc.stderr}\n")
        if check and proc.returncode != 0:
            raise RuntimeError(f"compose {' '.join(args)} exited {proc.returncode}: {proc.stderr[-2000:]}")
        return proc

    def container(self, service: str) -> str:
        ids = self.run("ps", "-q", service).stdout.split()
        if not ids:
            raise RuntimeError(f"no container for service {service} in project {self.project}")
        return ids[0]

    def down(self) -> None:
        """Stop and remove this project's containers, network and volumes (only this project's: by its label)."""
        self.run("kill", timeout=120, check=False)  # no graceful stop needed: everything is thrown away
        self.run("down", "-v", "--remove-orphans", "-t", "1", timeout=300, check=False)
        label = f"label=com.docker.compose.project={self.project}"
        for kind, rm in (("container", ["rm", "-f", "-v"]), ("network", ["rm"]), ("volume", ["rm", "-f"])):
            ids = subprocess.run(
                ["docker", kind, "ls", "-q", *(["-a"] if kind == "container" else []), "--filter", label],
                capture_output=True,
                text=True,
                check=False,
                timeout=60,
            ).stdout.split()
            if ids:
                subprocess.run(["docker", kind, *rm, *ids], capture_output=True, check=False, timeout=120)

    def leftovers(self) -> list[str]:
        """What of this project is still in the engine (containers, networks, volumes): empty after down()."""
        label = f"label=com.docker.compose.project={self.project}"
        out = []
        for kind in ("container", "network", "volume"):
            args = ["docker", kind, "ls", "-q", *(["-a"] if kind == "container" else []), "--filter", label]
            ids = subprocess.run(args, capture_output=True, text=True, check=False, timeout=60).stdout.split()
            out += [f"{kind} {i}" for i in ids]
        return out


@contextlib.contextmanager
def compose_project(project: str | None = None, *, log: Path | None = None) -> Iterator[ComposeRun]:
    """A ComposeRun that is always taken down, on SIGTERM too (turned into SystemExit while it is open)."""
    run = ComposeRun(project, log=log)

    def on_term(signum: int, frame: FrameType | None) -> None:
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, on_term) if _main_thread() else None
    try:
        yield run
    finally:
        run.down()
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _main_thread() -> bool:
    import threading  # noqa: PLC0415

    return threading.current_thread() is threading.main_thread()


def count_slots(logs: str) -> dict[str, int]:
    slots: collections.Counter[str] = collections.Counter()
    for match in _SLOT.finditer(logs):
        slots[f"{match.group(1).split()[0]} {match.group(2)}"] += 1
    return dict(slots)


def up(run: ComposeRun, *, timeout: float = 600) -> dict[str, float]:
    """Build the app image and bring the whole file up; returns once every service is started (``up -d`` starts
    the demo only after both workers are healthy, and the demo starts running its examples at once)."""
    timings = {}
    t = time.monotonic()
    run.run("build", "--force-rm", timeout=timeout)  # --force-rm: no container left by a failed step
    timings["build"] = time.monotonic() - t
    t = time.monotonic()
    run.run("up", "-d", "--no-build", timeout=timeout)
    timings["up"] = time.monotonic() - t
    return timings


def demo_verdict(run: ComposeRun, *, kill: str | None = None, down_for: float = 3.0, timeout: float = 420) -> Verdict:
    """Wait for the demo container to exit and read the verdict (beat slots over both workers' whole logs).

    With ``kill``: while the demo runs, ``kill`` that service's container (SIGKILL), wait ``down_for`` seconds and
    start it again; the demo goes on meanwhile.
    """
    verdict = Verdict(killed=kill)
    demo_id = run.container("demo")
    t = time.monotonic()
    if kill is not None:
        run.run("kill", kill)
        time.sleep(down_for)
        run.run("start", kill)
    wait = subprocess.run(
        ["docker", "wait", demo_id], capture_output=True, text=True, timeout=timeout, check=False
    ).stdout.strip()
    verdict.demo_exit = int(wait) if wait.lstrip("-").isdigit() else None
    verdict.timings["demo"] = time.monotonic() - t
    verdict.demo_log = run.run("logs", "--no-color", "demo", check=False).stdout
    verdict.slots = count_slots(run.run("logs", "--no-color", "worker1", "worker2", check=False).stdout)
    for beat in ("beat1", "beat2"):
        log = run.run("logs", "--no-color", beat, check=False).stdout
        verdict.beats_sent[beat] = len(_SENT.findall(log))
        verdict.beats_claimed_elsewhere += len(_CLAIMED.findall(log))
    return verdict


def demo_again(run: ComposeRun) -> None:
    """Run the demo once more on the running services (a new demo container)."""
    run.run("up", "-d", "--no-build", "--no-deps", "--force-recreate", "demo")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kill", metavar="SERVICE", help="kill this service's container mid-run (e.g. lock2)")
    parser.add_argument("--log", type=Path, help="append every compose command's output here")
    args = parser.parse_args(argv)
    t = time.monotonic()
    with compose_project(log=args.log) as run:
        print(f"project {run.project} ({' '.join(run.base[:-4])})", flush=True)
        timings = up(run)
        verdicts = [demo_verdict(run)]
        verdicts[0].timings.update(timings)
        if args.kill:
            demo_again(run)
            verdicts.append(demo_verdict(run, kill=args.kill))
        for verdict in verdicts:
            print(verdict.demo_log[-3000:])
    for verdict in verdicts:
        print(f"{'OK' if verdict.ok else 'FAILED'}: {verdict.summary()}")
    print(f"in all, down -v included: {time.monotonic() - t:.1f} s")
    return 0 if all(v.ok for v in verdicts) else 1


if __name__ == "__main__":
    sys.exit(main())
