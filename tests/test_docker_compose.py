"""docker-compose.yml, run for real: three lock nodes, the broker, two workers, two beat instances and the demo.

One compose project for the module (named after this run, so nothing else is ever touched and two runs side by
side do not collide), taken down with ``down -v`` however the module ends; the last test checks nothing of it is
left. The demo's verdict (tools/docker_demo.py): it exits 0 (every example saw each duplicate skipped and each
distinct job run) and no beat slot ran twice across the two workers. Then the demo runs again while lock node
``lock2`` is killed (SIGKILL) and started again: with two of three nodes a quorum, the verdict still holds.

Needs a Docker engine (tools/docker_images.sh starts one and builds local base images where there is no
registry): skipped, saying why, where none answers; under CI=true it must run.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import dockerenv
import pytest
from docker_demo import ComposeRun, compose_project, demo_again, demo_verdict, up

pytestmark = dockerenv.marks()


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ComposeRun]:
    dockerenv.require()
    log = Path(tmp_path_factory.mktemp("compose")) / "compose.log"
    with compose_project(f"csl-{dockerenv.RUN_ID}", log=log) as run:
        run.timings = up(run)  # type: ignore[attr-defined]
        yield run
    assert run.leftovers() == [], f"left behind by {run.project}"


def test_the_demo_s_verdict_holds(stack: ComposeRun) -> None:
    """Every duplicate skipped, every distinct job run (the demo exits 0), each beat slot sent once."""
    verdict = demo_verdict(stack)
    print(f"compose up: {stack.timings}; {verdict.summary()}")  # type: ignore[attr-defined]
    assert verdict.demo_exit == 0, verdict.demo_log[-4000:]
    assert verdict.duplicated_slots == [], verdict.slots
    assert verdict.heartbeats >= 2, verdict.slots
    assert verdict.ok


def test_the_verdict_holds_with_a_lock_node_killed_mid_run(stack: ComposeRun) -> None:
    """``kill lock2`` while the demo runs, ``start lock2`` 3 s later: the demo's verdict still holds."""
    demo_again(stack)
    verdict = demo_verdict(stack, kill="lock2")
    print(verdict.summary())
    assert verdict.demo_exit == 0, verdict.demo_log[-4000:]
    assert verdict.duplicated_slots == [], verdict.slots
    assert verdict.ok
    assert stack.run("ps", "-q", "lock2").stdout.strip()  # lock2 runs again
