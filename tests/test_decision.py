"""The delivery decision: every combination of facts, checked against the guarantees, plus the table's rows."""

from __future__ import annotations

import itertools
from typing import get_args

import pytest

from celery_singleton_lock.config import DuplicatePolicy, UnavailablePolicy
from celery_singleton_lock.decision import (
    COOLDOWN,
    ENDING,
    HANDOVER,
    RUNNING,
    SPLIT_RETRIES,
    Act,
    Facts,
    Outcome,
    decide,
)

ME, OTHER = "task-1", "task-2"
STATES = (RUNNING, HANDOVER, ENDING, COOLDOWN, None)
HOLDERS = (ME, OTHER, None)


def every_fact() -> list[Facts]:
    """The full product of the facts that change a decision (about 100,000 combinations)."""
    out = []
    for (
        outcome,
        holder,
        state,
        redelivered,
        succeeded,
        chord,
        dup,
        unav,
        split,
        took,
        attempt,
        maxr,
        remaining,
        cap,
    ) in itertools.product(
        get_args(Outcome),
        HOLDERS,
        STATES,
        (False, True),
        (None, False, True),
        (False, True),
        get_args(DuplicatePolicy),
        get_args(UnavailablePolicy),
        (0, SPLIT_RETRIES),
        (False, True),
        (0, 5),
        (None, 3),
        (None, 0.4, 50.0),
        (None, 30.0),
    ):
        out.append(
            Facts(
                outcome=outcome,
                task_id=ME,
                holder_job=holder,
                holder_state=state,
                holder_remaining=remaining,
                redelivered=redelivered,
                succeeded=succeeded,
                in_chord=chord,
                on_duplicate=dup,
                on_unavailable=unav,
                split_retries=split,
                took_over=took,
                attempt=attempt,
                max_retries=maxr,
                ttl=60.0,
                interval=20.0,
                max_countdown=cap,
                jitter=0.999,
            )
        )
    return out


FACTS = every_fact()


def test_the_body_runs_only_under_the_lock_and_never_after_a_success() -> None:
    """RUN only when the lock was acquired, never when the result backend says this id succeeded, and a redelivery
    is looked up first; RUN_UNGUARDED only with no quorum and the 'run' policy."""
    for f in FACTS:
        act = decide(f).act
        if act is Act.RUN:
            assert f.outcome == "acquired", f
            # ... and after a success only as the retry that took over its own hand-over
            assert not f.succeeded or f.took_over, f
            assert not (f.redelivered and f.succeeded is None and not f.took_over), f
        if act is Act.RUN_UNGUARDED:
            assert f.outcome == "unavailable" and f.on_unavailable == "run", f


def test_a_delivery_is_never_skipped_as_its_own_duplicate() -> None:
    """A holder with this very task id (a redelivery's twin, our retry's hand-over), or a record naming no job
    (a repaired node's partial record, another tool's key), never makes it a duplicate."""
    for f in FACTS:
        if f.outcome == "held" and f.holder_job in (ME, None):
            assert decide(f).act not in (Act.SKIP, Act.FAIL_DUPLICATE), f


def test_a_split_vote_or_an_outage_is_never_a_duplicate() -> None:
    """Split votes are retried or re-sent; no quorum follows the outage policy; neither is skipped or run."""
    for f in FACTS:
        act = decide(f).act
        if f.outcome == "split":
            assert act in (Act.RETRY_NOW, Act.DEFER), f
            assert (act is Act.RETRY_NOW) == (f.split_retries < SPLIT_RETRIES), f
        if f.outcome == "unavailable":
            assert act in (Act.DEFER, Act.FAIL_UNAVAILABLE, Act.RUN_UNGUARDED), f


def test_a_done_job_is_never_run_again() -> None:
    """The job's done marker, a cooldown record of this id, or SUCCESS in the backend: DONE, nothing else."""
    for f in FACTS:
        act = decide(f).act
        if f.outcome == "done" or (f.outcome == "held" and f.holder_job == ME and f.holder_state == COOLDOWN):
            assert act is Act.DONE, f
        if act is Act.DONE:
            assert f.outcome == "done" or f.succeeded or f.holder_state == COOLDOWN, f
            assert not (f.outcome == "acquired" and f.took_over), f


def test_a_re_sent_copy_waits_a_bounded_positive_time() -> None:
    """Every DEFER has a countdown > 0, within the broker's cap; a redelivery waits out its twin's lease (or the
    cap), a rescheduled duplicate at most one renewal interval."""
    for f in FACTS:
        d = decide(f)
        if d.act is not Act.DEFER:
            continue
        assert d.countdown > 0, f
        if f.max_countdown is not None:
            assert d.countdown <= f.max_countdown, f
        remaining = f.holder_remaining or f.ttl
        if d.reason == "redelivered":
            assert d.countdown >= min(remaining, f.max_countdown or remaining), f
        if d.reason in ("duplicate", "unknown holder"):
            assert d.countdown <= f.interval + 0.25, f


def test_duplicates_follow_the_policy_and_chords_always_wait() -> None:
    """Held by another job: skip / fail / reschedule as configured; a chord member always reschedules."""
    for f in FACTS:
        if f.outcome != "held" or f.holder_job in (ME, None):
            continue
        d = decide(f)
        expected = "reschedule" if f.in_chord else f.on_duplicate
        assert {"skip": Act.SKIP, "fail": Act.FAIL_DUPLICATE, "reschedule": Act.DEFER}[expected] is d.act, f


def test_every_combination_settles_in_a_few_steps() -> None:
    """Acting on LOOK_UP / RETRY_NOW / TAKE_OVER changes the facts so that no delivery loops: after a look-up the
    decision never asks again, and a take-over is tried once."""
    for f in FACTS:
        d = decide(f)
        if d.act is Act.LOOK_UP:
            for answer in (False, True):
                again = decide(Facts(**{**f.__dict__, "succeeded": answer}))
                assert again.act is not Act.LOOK_UP, f
        if d.act is Act.TAKE_OVER:
            assert not f.took_over, f
            assert decide(Facts(**{**f.__dict__, "took_over": True})).act is not Act.TAKE_OVER, f


@pytest.mark.parametrize(
    ("facts", "act", "reason"),
    [
        (Facts("acquired", ME), Act.RUN, ""),
        (Facts("acquired", ME, redelivered=True), Act.LOOK_UP, ""),
        (Facts("acquired", ME, redelivered=True, succeeded=True), Act.DONE, "already succeeded"),
        (Facts("acquired", ME, redelivered=True, succeeded=False), Act.RUN, ""),
        (Facts("acquired", ME, redelivered=True, succeeded=True, took_over=True), Act.RUN, ""),
        (Facts("done", ME), Act.DONE, "already succeeded"),
        (Facts("split", ME), Act.RETRY_NOW, ""),
        (Facts("split", ME, split_retries=SPLIT_RETRIES), Act.DEFER, "split vote"),
        (Facts("unavailable", ME), Act.DEFER, "unavailable"),
        (Facts("unavailable", ME, on_unavailable="fail"), Act.FAIL_UNAVAILABLE, ""),
        (Facts("unavailable", ME, on_unavailable="run"), Act.RUN_UNGUARDED, ""),
        (Facts("unavailable", ME, attempt=3, max_retries=3), Act.FAIL_UNAVAILABLE, ""),
        (Facts("held", ME, holder_job=ME, holder_state=HANDOVER), Act.TAKE_OVER, ""),
        (Facts("held", ME, holder_job=ME, holder_state=HANDOVER, took_over=True), Act.LOOK_UP, ""),
        (Facts("held", ME, holder_job=ME, holder_state=COOLDOWN), Act.DONE, "already succeeded"),
        (Facts("held", ME, holder_job=ME, holder_state=RUNNING), Act.LOOK_UP, ""),
        (Facts("held", ME, holder_job=ME, holder_state=RUNNING, succeeded=False), Act.DEFER, "redelivered"),
        (Facts("held", ME, holder_job=ME, holder_state=ENDING, succeeded=True), Act.DONE, "already succeeded"),
        (Facts("held", ME, holder_job=OTHER, holder_state=RUNNING), Act.SKIP, ""),
        (Facts("held", ME, holder_job=OTHER, holder_state=HANDOVER), Act.SKIP, ""),
        (Facts("held", ME, holder_job=OTHER, holder_state=COOLDOWN), Act.SKIP, ""),
        (Facts("held", ME, holder_job=None), Act.DEFER, "unknown holder"),
        (Facts("held", ME, holder_job=OTHER, on_duplicate="fail"), Act.FAIL_DUPLICATE, ""),
        (Facts("held", ME, holder_job=OTHER, on_duplicate="reschedule"), Act.DEFER, "duplicate"),
        (Facts("held", ME, holder_job=OTHER, in_chord=True), Act.DEFER, "duplicate"),
    ],
)
def test_the_table(facts: Facts, act: Act, reason: str) -> None:
    """Each row of the module's table, as written there."""
    decision = decide(facts)
    assert decision.act is act
    if reason:
        assert decision.reason == reason


def test_the_fast_path_in_before_start_is_the_table_s_answer() -> None:
    """LockedTask skips building the facts for a first delivery that got the lock: the table says RUN there."""
    assert decide(Facts("acquired", ME, redelivered=False)).act is Act.RUN
