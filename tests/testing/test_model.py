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
    RATE_SEEDS,
    UNDRAWN,
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


def test_the_rate_seeds_draw_every_supported_pair_of_stacked_limits_and_costs() -> None:
    """Issue 33, every pair supported or refused: each pair the options matrix supports of rate_stacked or rate_cost
    with a facet the model draws is held by a task of a RATE_SEEDS deployment (drawn, registered: no servers)."""
    from celery_singleton_lock.policies import matrix  # noqa: PLC0415

    want = {frozenset(p) for p in matrix.pairs() if {"rate_stacked", "rate_cost"} & set(p) and not UNDRAWN & set(p)
            and isinstance(matrix.verdict(*p), matrix.Supported)}  # fmt: skip
    seen: list[frozenset[str]] = []
    for seed in RATE_SEEDS:
        assert not refused(draw_deployment(seed, known_open=False).tasks, seen), seed
    missing = sorted(sorted(p) for p in want if not any(p <= f for f in seen))
    assert not missing, missing


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


def _rated(opts: dict[str, object], starts: list[tuple[str, float, dict[str, object]]]) -> list[str]:
    """The broken promises of a synthetic history of one rated task: each start (key, node time, extra fields; "of":
    the index of the call whose re-sent copy it is)."""
    ids = [int(x.get("of", i)) for i, (_, _, x) in enumerate(starts)]  # type: ignore[call-overload]
    calls = [Call(i, "r", k, i, at - 0.1, f"id{i}", duration=float(x.get("duration", 0.0)))  # type: ignore[arg-type]
             for i, (k, at, x) in enumerate(starts) if "of" not in x]  # fmt: skip
    attempts = [Attempt(f"id{ids[i]}", "r", k, ids[i], 0, 1, at, at, at + 0.01, None,
                        *[x.get(n) for n in ("spent", "spent_at", "slowed")])  # type: ignore[arg-type]
                for i, (k, at, x) in enumerate(starts)]  # fmt: skip
    outcomes = {f"id{i}": Outcome("SUCCESS", "", at + 0.02) for i, (_, at, x) in enumerate(starts) if "of" not in x}
    return check(History({"r": TaskOpts("r", {"lock_limit": None, **opts})}, calls, attempts, outcomes))


STACK = {"lock_rate": [[3, 2.0], {"rate": [2, 1.0], "on": ["key"]}]}


def test_the_stacked_rate_promise_counts_every_limit_and_the_cost() -> None:
    """rates.check_windows is not vacuous: a third start of one key within the per-key limit's 1 s window breaks it
    (the task-wide limit 3/2 s holds); two keys' starts keep it; a cost of 2 makes two starts within the task-wide
    window one too many (4 units of 3), and a cost "by_duration" counts a 1 s run's 2 units."""
    assert _rated(STACK, [("k-a", 10.0, {}), ("k-bp", 10.1, {}), ("k-a", 10.5, {})]) == []
    broken = _rated(STACK, [("k-a", 10.0, {}), ("k-a", 10.2, {}), ("k-a", 10.5, {})])
    assert any("rate r/1/k-a: 3 units estimated" in v for v in broken), broken
    assert _rated({**STACK, "lock_rate_cost": 2}, [("k-a", 10.0, {}), ("k-bp", 12.0, {})]) == []
    broken = _rated({**STACK, "lock_rate_cost": 2}, [("k-a", 10.0, {}), ("k-bp", 10.5, {})])
    assert any("rate r/0/*: 4 units estimated" in v for v in broken), broken
    broken = _rated({**STACK, "lock_rate_cost": "by_duration"}, [("k-a", 10.0, {"duration": 1.0}), ("k-a", 10.5, {})])
    assert any("3 units estimated" in v for v in broken), broken


def test_the_corrected_units_may_exceed_a_limit_by_the_unseen_under_estimates_only() -> None:
    """rates.check_windows, rate_spent (docs/rate.md, promises 1-3): an extra charge of the last start of a window may
    take the window past N; one reported before a later start was counted may not (the later start should have
    waited for it); a refund reported before a later start's count frees its units, one reported after does not."""
    one = {"lock_rate": [2, 1.0]}
    last_charged = [("k-a", 10.0, {}), ("k-a", 10.3, {"spent": [2, 3], "spent_at": 10.31})]
    assert _rated(one, last_charged) == []
    seen = [("k-a", 10.0, {"spent": [1, 2], "spent_at": 10.01}), ("k-a", 10.3, {})]
    broken = _rated(one, seen)
    assert any("3 units held (charges seen)" in v for v in broken), broken
    # Seed 113: a refund frees its slots for the next start (a retry of cost 2 after rate_spent(0), at (3, 2.0)).
    cost = {"lock_rate": [3, 2.0], "lock_rate_cost": 2}
    assert _rated(cost, [("k-a", 10.0, {"spent": [-2, 0], "spent_at": 10.01}), ("k-a", 11.2, {})]) == []
    broken = _rated(cost, [("k-a", 10.0, {"spent": [-2, 0], "spent_at": 11.3}), ("k-a", 11.2, {})])
    assert any("4 units estimated (refunds seen)" in v for v in broken), broken
    # Seed 13: a refund reported 20 ms before a later start's count is seen (a charge that close may not be).
    refund = [("k-a", 10.0, {"duration": 1.0, "spent": [-1, 1], "spent_at": 10.005}), ("k-a", 10.02, {})]
    assert _rated({"lock_rate": [2, 1.5], "lock_rate_cost": "by_duration"}, refund) == []


def test_the_slowdown_promises_catch_a_start_within_the_pause_and_a_lost_call() -> None:
    """rates.check_slowdown: a start of a paused rate key within the pause breaks it (with limit=None the task-wide
    limit is paused too: another key's start breaks it; naming the per-key limit leaves other keys going); a raising
    call that never runs again is lost; its copy starting after the pause keeps the promise."""

    def run(limit: int | None, other: str, again: bool) -> list[str]:
        starts = [("k-a", 10.0, {"slowed": [1.2, limit]}), (other, 10.8, {})]
        return _rated(STACK, starts + ([("k-a", 11.3, {"of": 0})] if again else []))

    assert any("k-bp v1 started" in v for v in run(None, "k-bp", True)), run(None, "k-bp", True)
    assert run(1, "k-bp", True) == []
    assert any("k-a v1 started" in v for v in run(1, "k-a", True)), run(1, "k-a", True)
    assert any("raised SlowDown and never ran after it" in v for v in run(1, "k-bp", False)), run(1, "k-bp", False)


def test_a_call_joining_a_debounced_burst_that_waits_for_its_rate_is_that_burst() -> None:
    """lock_debounce x lock_rate (wait), seed 120's storm: a due burst waiting for its rate window gathers a call sent
    2.5 s later and runs its arguments once (docs/options.md); a call given a burst's id after its run started is a
    broken promise still."""
    opts = {"lock_debounce": 0.8, "lock_on_duplicate": "reschedule", "lock_rate": [3, 2.0], "lock_rate_cost": 2}
    calls = [Call(0, "d", "k-a", 0, 10.0, "x"), Call(1, "d", "k-a", 1, 12.5, "x")]
    outcomes = {"x": Outcome("SUCCESS", "", 13.6)}

    def broken(start: float) -> list[str]:
        attempts = [Attempt("x", "d", "k-a", 1, 0, 1, start, start, start + 0.01)]
        return check(History({"d": TaskOpts("d", opts)}, calls, attempts, outcomes))

    assert broken(13.5) == []
    assert any("got an earlier burst's AsyncResult" in v for v in broken(11.0)), broken(11.0)


def test_a_debounced_burst_failed_for_a_full_rate_window_is_no_lost_run() -> None:
    """lock_debounce x lock_on_rate_limit="fail" (seed 37): a burst refused by its rate ends (docs/policies.md); its
    FAILURE RateLimitedError while its window held its own SlowDown start's charge (3 units of 3) is no lost run."""
    opts = {
        "lock_debounce": 0.8,
        "lock_on_duplicate": "reschedule",
        "lock_rate": [3, 2.0],
        "lock_on_rate_limit": "fail",
    }
    calls = [Call(0, "d", "k-a", 0, 10.0, "x")]
    attempts = [Attempt("x", "d", "k-a", 0, 0, 1, 10.8, 10.8, 10.81, None, [2, 3], 10.805, [1.2, None])]
    outcomes = {"x": Outcome("FAILURE", "RateLimitedError: singleton_lock:rate:{d}:2s:v2:ab d 3 per 2 s 0.77", 12.05)}
    assert check(History({"d": TaskOpts("d", opts)}, calls, attempts, outcomes)) == []
