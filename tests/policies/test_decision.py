"""The delivery decision: every combination of facts, checked against the guarantees, plus the table's rows."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterator
from typing import Any, get_args

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from celery_singleton_lock.lock.config import DuplicatePolicy, UnavailablePolicy
from celery_singleton_lock.policies.decision import (
    COOLDOWN,
    ENDING,
    HANDED,
    HANDOVER,
    QUEUED,
    RUNNING,
    SENDING,
    SPLIT_RETRIES,
    Act,
    Decision,
    Facts,
    Outcome,
    decide,
)
from celery_singleton_lock.policies.facts import facts_of

ME, OTHER = "task-1", "task-2"
STATES = (RUNNING, HANDOVER, ENDING, COOLDOWN, QUEUED, SENDING, HANDED, None)
HOLDERS = (ME, OTHER, None)


def every_fact() -> Iterator[Facts]:
    """The full product of the facts that change a decision (about a million combinations, generated lazily)."""
    for (
        outcome,
        holder,
        state,
        redelivered,
        ended,
        (chord, dup),
        unav,
        split,
        took,
        (attempt, maxr),
        remaining,
        cap,
        retries,
        holder_try,
    ) in itertools.product(
        get_args(Outcome),
        HOLDERS,
        STATES,
        (False, True),
        (None, False, True),
        [(False, d) for d in get_args(DuplicatePolicy)] + [(True, "skip")],
        get_args(UnavailablePolicy),
        (0, SPLIT_RETRIES),
        (False, True),
        ((0, None), (5, 3)),
        (None, 50.0),
        (None, 30.0),
        (0, 1),
        (None, 0, 1),
    ):
        yield Facts(
            outcome=outcome,
            task_id=ME,
            holder_job=holder,
            holder_state=state,
            holder_remaining=remaining,
            redelivered=redelivered,
            retries=retries,
            holder_try=holder_try,
            ended=ended,
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


def check(f: Facts, d: Decision) -> None:
    """Every guarantee the decision must keep, for one combination of facts."""
    act = d.act
    known_success = f.ended and f.retries == 0  # the backend speaks for a first attempt only
    # The body runs only under the lock, and never after a known success (but our own retry's hand-over runs).
    if act is Act.RUN:
        assert f.outcome == "acquired"
        assert not known_success or f.took_over
        assert not (f.redelivered and f.retries == 0 and f.ended is None and not f.took_over)
    if act is Act.RUN_UNGUARDED:
        assert f.outcome == "unavailable" and f.on_unavailable == "run"
    # Never skipped as its own duplicate, nor as the duplicate of a record that names no job, nor of a reservation
    # whose message may never be sent.
    if f.outcome == "held" and (f.holder_job in (ME, None) or f.holder_state == SENDING):
        assert act not in (Act.SKIP, Act.FAIL_DUPLICATE)
    # A split vote is retried or re-sent; no quorum follows the outage policy.
    if f.outcome == "split":
        assert act in (Act.RETRY_NOW, Act.DEFER)
        assert (act is Act.RETRY_NOW) == (f.split_retries < SPLIT_RETRIES)
    if f.outcome == "unavailable":
        assert act in (Act.DEFER, Act.FAIL_UNAVAILABLE, Act.RUN_UNGUARDED)
    # A done job is never run again; DONE only on proof of a success.
    if f.outcome == "done" or (f.outcome == "held" and f.holder_job == ME and f.holder_state == COOLDOWN):
        assert act is Act.DONE
    if act is Act.DONE:
        assert f.outcome == "done" or known_success or f.holder_state == COOLDOWN
    # The backend is asked about a first attempt only, and once.
    if act is Act.LOOK_UP:
        assert f.retries == 0 and f.ended is None
    # The attempt that sent this retry is never waited for a whole ttl.
    if f.outcome == "held" and f.holder_job == ME and f.holder_try is not None and f.holder_try < f.retries:
        # (A HANDED record names no try: hand_on.lua drops the stopped run's; it is this waiting call's to take.)
        if f.holder_state not in (COOLDOWN, HANDED) and (f.holder_state != HANDOVER or f.took_over):
            assert act in (Act.RETRY_NOW, Act.DEFER)
            assert d.countdown <= 1.25
    # Every re-send waits a bounded, positive time within the broker's cap.
    if act is Act.DEFER:
        assert d.countdown > 0
        if f.max_countdown is not None:
            assert d.countdown <= f.max_countdown
        remaining = f.holder_remaining or f.ttl
        if d.reason == "redelivered":
            assert d.countdown >= min(remaining, f.max_countdown or remaining)
        if d.reason in ("unknown holder", "sending"):
            assert d.countdown <= f.interval + 0.25
        if d.reason == "duplicate":  # the fallback: when the holder's lease would end (its release wakes it sooner)
            assert d.countdown <= remaining + 0.25
            if f.on_duplicate in ("reschedule", "replace", "cancel"):
                assert d.countdown >= min(remaining, f.max_countdown or remaining)
            else:  # a chord member of a skip/fail task: no holder wakes it, so it looks again every interval
                assert d.countdown <= f.interval + 0.25
                assert d.countdown >= min(remaining, f.interval, f.max_countdown or remaining)
    # Duplicates follow the policy; chord members always wait.
    if f.outcome == "held" and f.holder_job == OTHER and f.holder_state != SENDING:
        expected = "reschedule" if f.in_chord or (f.resumed and f.on_duplicate in ("skip", "fail")) else f.on_duplicate
        acts = {
            "skip": Act.SKIP,
            "fail": Act.FAIL_DUPLICATE,
            "reschedule": Act.DEFER,
            "replace": Act.DEFER,
            "cancel": Act.DEFER,
        }
        assert acts[expected] is act
    # Acting on LOOK_UP / TAKE_OVER changes the facts so that no delivery loops.
    if act is Act.LOOK_UP:
        for answer in (False, True):
            assert decide(dataclasses.replace(f, ended=answer)).act is not Act.LOOK_UP
    if act is Act.TAKE_OVER:
        assert f.holder_job == ME
        if f.holder_state in (QUEUED, SENDING):  # the queue-scope reservation of this message: its first attempt
            assert f.retries == 0
        elif f.holder_state == HANDED:  # a stopped run's lock handed to this waiting call: whichever try it is
            pass
        else:  # only a later attempt takes a hand-over
            assert f.holder_state == HANDOVER
            assert f.holder_try is None or f.retries > f.holder_try
        assert not f.took_over
        assert decide(dataclasses.replace(f, took_over=True)).act is not Act.TAKE_OVER


def test_every_combination_of_facts_keeps_every_guarantee() -> None:
    """About a million combinations of facts: the body runs only under the lock and never after a known success;
    a delivery is never its own duplicate; splits and outages are never skips; done jobs are never re-run; the
    backend is asked only about first attempts; re-sends wait a bounded time; duplicates follow the policy; and
    acting on a look-up or a take-over always settles."""
    count = 0
    for f in every_fact():
        d = decide(f)
        try:
            check(f, d)
        except AssertionError:
            pytest.fail(f"{d} for {f}")
        count += 1
    assert count > 1_000_000


@pytest.mark.parametrize(
    ("facts", "act", "reason"),
    [
        (Facts("acquired", ME), Act.RUN, ""),
        (Facts("acquired", ME, redelivered=True), Act.LOOK_UP, ""),
        (Facts("acquired", ME, redelivered=True, ended=True), Act.DONE, "already ran"),
        (Facts("acquired", ME, redelivered=True, ended=False), Act.RUN, ""),
        (Facts("acquired", ME, redelivered=True, ended=True, took_over=True), Act.RUN, ""),
        (Facts("acquired", ME, redelivered=True, retries=2), Act.RUN, ""),
        (Facts("held", ME, holder_job=ME, holder_state=RUNNING, holder_try=0, retries=1), Act.RETRY_NOW, ""),
        (
            Facts("held", ME, holder_job=ME, holder_try=0, retries=1, split_retries=SPLIT_RETRIES),
            Act.DEFER,
            "predecessor",
        ),
        (Facts("held", ME, holder_job=ME, holder_try=1, retries=1, ended=None), Act.DEFER, "redelivered"),
        (Facts("held", ME, holder_job=None, attempt=3, max_retries=3), Act.FAIL_UNAVAILABLE, ""),
        (Facts("done", ME), Act.DONE, "already ran"),
        (Facts("split", ME), Act.RETRY_NOW, ""),
        (Facts("split", ME, split_retries=SPLIT_RETRIES), Act.DEFER, "split vote"),
        (Facts("unavailable", ME), Act.DEFER, "unavailable"),
        (Facts("unavailable", ME, on_unavailable="fail"), Act.FAIL_UNAVAILABLE, ""),
        (Facts("unavailable", ME, on_unavailable="run"), Act.RUN_UNGUARDED, ""),
        (Facts("unavailable", ME, attempt=3, max_retries=3), Act.FAIL_UNAVAILABLE, ""),
        (Facts("held", ME, holder_job=ME, holder_state=HANDOVER), Act.TAKE_OVER, ""),
        (Facts("held", ME, holder_job=ME, holder_state=HANDOVER, holder_try=0, retries=1), Act.TAKE_OVER, ""),
        (Facts("held", ME, holder_job=ME, holder_state=HANDOVER, holder_try=0, retries=0), Act.LOOK_UP, ""),
        (Facts("held", ME, holder_job=ME, holder_state=HANDOVER, took_over=True), Act.LOOK_UP, ""),
        (Facts("held", ME, holder_job=ME, holder_state=COOLDOWN), Act.DONE, "already ran"),
        (Facts("held", ME, holder_job=ME, holder_state=QUEUED), Act.TAKE_OVER, ""),
        (Facts("held", ME, holder_job=ME, holder_state=HANDED), Act.TAKE_OVER, ""),
        (Facts("held", ME, holder_job=ME, holder_state=HANDED, retries=2, holder_try=5), Act.TAKE_OVER, ""),
        (Facts("held", ME, holder_job=ME, holder_state=HANDED, took_over=True), Act.LOOK_UP, ""),
        (Facts("held", ME, holder_job=OTHER, holder_state=HANDED, on_duplicate="cancel"), Act.DEFER, "duplicate"),
        (Facts("held", ME, holder_job=ME, holder_state=QUEUED, redelivered=True), Act.TAKE_OVER, ""),
        (Facts("held", ME, holder_job=ME, holder_state=QUEUED, took_over=True), Act.LOOK_UP, ""),
        (Facts("held", ME, holder_job=OTHER, holder_state=QUEUED), Act.SKIP, ""),
        (Facts("held", ME, holder_job=ME, holder_state=SENDING), Act.TAKE_OVER, ""),
        (Facts("held", ME, holder_job=OTHER, holder_state=SENDING), Act.DEFER, "sending"),
        (Facts("held", ME, holder_job=ME, holder_state=RUNNING), Act.LOOK_UP, ""),
        (Facts("held", ME, holder_job=ME, holder_state=RUNNING, ended=False), Act.DEFER, "redelivered"),
        (Facts("held", ME, holder_job=ME, holder_state=ENDING, ended=True), Act.DONE, "already ran"),
        (Facts("held", ME, holder_job=OTHER, holder_state=RUNNING), Act.SKIP, ""),
        (Facts("held", ME, holder_job=OTHER, holder_state=HANDOVER), Act.SKIP, ""),
        (Facts("held", ME, holder_job=OTHER, holder_state=COOLDOWN), Act.SKIP, ""),
        (Facts("held", ME, holder_job=None), Act.DEFER, "unknown holder"),
        (Facts("held", ME, holder_job=OTHER, on_duplicate="fail"), Act.FAIL_DUPLICATE, ""),
        (Facts("held", ME, holder_job=OTHER, on_duplicate="reschedule"), Act.DEFER, "duplicate"),
        (Facts("held", ME, holder_job=OTHER, in_chord=True), Act.DEFER, "duplicate"),
        # A SlowDown's copy (resumed) waits as a chord member does, never skipped or failed as a duplicate.
        (Facts("held", ME, holder_job=OTHER, resumed=True), Act.DEFER, "duplicate"),
        (Facts("held", ME, holder_job=OTHER, resumed=True, on_duplicate="fail"), Act.DEFER, "duplicate"),
    ],
)
def test_the_table(facts: Facts, act: Act, reason: str) -> None:
    """Each row of the module's table, as written there."""
    decision = decide(facts)
    assert decision.act is act
    if reason:
        assert decision.reason == reason


@settings(max_examples=300, deadline=None)
@given(
    holder_job=st.sampled_from([None, ME, OTHER]),
    holder_state=st.sampled_from(STATES),
    holder_remaining=st.one_of(st.none(), st.floats(0, 100)),
    retries=st.integers(0, 5),
    holder_try=st.one_of(st.none(), st.integers(0, 5)),
    in_chord=st.booleans(),
    on_duplicate=st.sampled_from(get_args(DuplicatePolicy)),
    on_unavailable=st.sampled_from(get_args(UnavailablePolicy)),
    attempt=st.integers(0, 5),
    max_retries=st.one_of(st.none(), st.integers(0, 5)),
    max_countdown=st.one_of(st.none(), st.floats(0.5, 100)),
    jitter=st.floats(0, 1, exclude_max=True),
)
def test_the_fast_path_in_before_start_is_the_table_s_answer(**seen: Any) -> None:
    """LockedTask skips building the facts for a first delivery that got the lock (task.py: ``acquired and not
    redelivered``): the table says RUN for every such delivery, whatever else its facts would hold."""
    facts = Facts("acquired", ME, redelivered=False, **seen)  # not looked up yet, no split retry, no take-over
    assert decide(facts).act is Act.RUN, facts


@settings(max_examples=200, deadline=None)
@given(
    outcome=st.sampled_from(get_args(Outcome)),
    holder_job=st.one_of(st.none(), st.sampled_from([ME, OTHER])),
    holder_state=st.one_of(st.none(), st.sampled_from([RUNNING, HANDOVER, HANDED, QUEUED, SENDING, COOLDOWN])),
    holder_remaining=st.one_of(st.none(), st.floats(0, 100)),
    redelivered=st.booleans(),
    retries=st.integers(0, 5),
    in_chord=st.booleans(),
    resumed=st.booleans(),
    on_duplicate=st.sampled_from(get_args(DuplicatePolicy)),
    max_retries=st.one_of(st.none(), st.integers(0, 5)),
    jitter=st.floats(0, 1, exclude_max=True),
)
def test_facts_of_is_the_same_facts_as_the_constructor(**seen: Any) -> None:
    """``facts_of`` (what before_start builds a skip's facts with, without the frozen ``__init__``) gives the object
    ``Facts(**values)`` gives: equal, the same decision, the same ``replace`` and repr, and still frozen."""
    values = {"task_id": ME, **seen}
    fast, built = facts_of(values), Facts(**values)
    assert fast == built
    assert repr(fast) == repr(built)
    assert decide(fast) == decide(built)
    assert dataclasses.replace(fast, reserved=True) == dataclasses.replace(built, reserved=True)
    assert {f.name: getattr(fast, f.name) for f in dataclasses.fields(Facts)} == dataclasses.asdict(built)
    with pytest.raises(dataclasses.FrozenInstanceError):
        fast.ended = True  # type: ignore[misc]
