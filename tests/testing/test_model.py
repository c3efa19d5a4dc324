"""The model-based suite: drawn deployments and schedules run on real prefork workers and three real lock nodes,
and each record is checked against the README's promises written as code (tests/model/promises.py).

The CI budget (default) is short and seeded: CSL_MODEL_DEPLOYMENTS deployments (2) of CSL_MODEL_EXAMPLES schedules
(3) each, no deployment holding a KNOWN_OPEN pair of options. ``CSL_MODEL_BUDGET=long`` (``make soak-model``) draws
more, random seeds, the known-open pairs too, and shrinks a failure. A failure prints the deployment's seed, the
Hypothesis replay blob and a JSON schedule that ``python -m tests.model.replay FILE`` runs again (docs/testing.md).
"""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest
from hypothesis import HealthCheck, Phase, example, given, settings

from tests.model.promises import Attempt, Call, History, Outcome, TaskOpts, check
from tests.model.suite import (
    CI_DEPLOYMENTS,
    PAIR_DEPLOYMENTS,
    bench,
    check_schedule,
    draw_deployment,
    open_pairs,
    refused,
    report,
    schedules,
    shrink,
    storm,
)

pytestmark = pytest.mark.slow
LONG = os.environ.get("CSL_MODEL_BUDGET") == "long"
DEPLOYMENTS = int(os.environ.get("CSL_MODEL_DEPLOYMENTS", "20" if LONG else "2"))
EXAMPLES = int(os.environ.get("CSL_MODEL_EXAMPLES", "10" if LONG else "3"))
CI = {d.seed: d for d in CI_DEPLOYMENTS + PAIR_DEPLOYMENTS}
SEEDS = [random.randrange(100, 10**6) for _ in range(DEPLOYMENTS)] if LONG else sorted(d.seed for d in CI_DEPLOYMENTS)
SEEDS = [int(s) for s in os.environ["CSL_MODEL_SEEDS"].split(",")] if os.environ.get("CSL_MODEL_SEEDS") else SEEDS


def test_the_ci_deployments_are_supported_and_hold_no_known_open_pair() -> None:
    """The CI budget's deployments are accepted by the matrix and hold no KNOWN_OPEN pair of options."""
    for d in CI_DEPLOYMENTS:
        assert not refused(d.tasks), d
        assert not open_pairs(d.tasks, bool(d.faults)), d


def test_the_fair_promise_catches_a_call_waiting_past_its_bound() -> None:
    """promises._check_fair is not vacuous: a call that waited past (k + 2)(W - 1) + k + L - 1 turns, and two starts
    counted as one, are reported (W = 2 values of duration, L = 2, k = 0: a bound of 3)."""
    opts = {"lock_on_duplicate": "reschedule", "lock_limit": 2, "lock_fair_on": ["duration"]}
    calls = [Call(i, "f", "k-a", i, float(i), f"id{i}", duration=float(i % 2)) for i in range(4)]
    turns = [[1, -1, -1], [2, 0, 0], [3, 3, 0], [3, 4, 0]]
    attempts = [Attempt(f"id{i}", "f", "k-a", i, 0, 1, 10.0 + i, None, 11.0 + i, t) for i, t in enumerate(turns)]
    h = History({"f": TaskOpts("f", opts)}, calls, attempts, {f"id{i}": Outcome("SUCCESS") for i in range(4)})
    broken = check(h)
    assert any("counted two starts as one" in v for v in broken), broken
    assert [v for v in broken if "past the bound 3" in v] == [v for v in broken if "v3 waited 4 turns" in v], broken
    assert len([v for v in broken if "past the bound" in v]) == 1, broken


@pytest.mark.parametrize("seed", SEEDS)
def test_drawn_schedules_keep_every_promise(seed: int, tmp_path: Path) -> None:
    """Every drawn schedule of a drawn supported deployment ends as the promises say (no broken promise)."""
    d = CI[seed] if seed in CI else draw_deployment(seed, known_open=LONG)
    print(f"deployment seed {seed}: {d}")
    with bench(tmp_path, d) as b:

        @settings(
            max_examples=EXAMPLES,
            deadline=None,
            database=None,
            derandomize=not LONG,
            phases=(Phase.explicit, Phase.generate),
            suppress_health_check=list(HealthCheck),
            print_blob=True,
            report_multiple_bugs=False,
        )
        @given(schedules(d))
        @example(storm(d))
        def one(steps: list[dict[str, object]]) -> None:
            # A failure is kept, not raised: Hypothesis would run it again to confirm it, and a real worker's
            # timing does not promise the same interleaving twice. The first one found ends the search.
            if failures:
                return
            _, violations = check_schedule(b, steps)
            if violations:
                failures.append((steps, violations))

        if d.schedule:
            one = example(d.schedule)(one)
        failures: list[tuple[list[dict[str, object]], list[str]]] = []
        one()
        if failures:
            steps, violations = failures[0]
            small = shrink(b, steps, 8 if LONG else 0)
            path = report(d, small, violations, Path(os.environ.get("CSL_MODEL_OUT", tmp_path)))
            pytest.fail(
                f"deployment seed {seed}: {len(violations)} broken promise(s):\n  "
                + "\n  ".join(violations[:20])
                + f"\nreplay: PYTHONPATH=$PWD python -m tests.model.replay {path}",
                pytrace=False,
            )
