"""``lock_rate``/``lock_rate_on``/``lock_on_rate_limit``/``lock_limit=None``/``lock_group`` options: refused at
registration in one line naming the task and the option, and by the start checks (worker start, doctor). No Redis."""

from __future__ import annotations

from typing import Any

import pytest
from celery import Celery

from celery_singleton_lock import LockedTask, Rate
from celery_singleton_lock.errors import ConfigurationError
from celery_singleton_lock.policies.rate import RATE_FEATURE, named_limits
from celery_singleton_lock.task import start_problems


def _app() -> Celery:
    app = Celery("rate_opts", broker="memory://", backend="cache+memory://", set_as_current=False)
    app.conf.singleton_lock_urls = ["redis://127.0.0.1:1/0"]
    return app


def _register(**options: Any) -> Any:
    app = _app()

    @app.task(base=LockedTask, shared=False, **options)
    def job(customer_id: int, payload: dict | None = None) -> None: ...

    return app, job


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"lock_rate": "10/w"}, r"lock_rate of .*job must be 'N/s'"),
        ({"lock_rate": (0, 1.0)}, r"lock_rate of .*job must be"),
        ({"lock_rate": "1/s", "lock_rate_on": "customer_id"}, r"lock_rate_on of .*job must be a list"),
        (
            {"lock_rate": "1/s", "lock_rate_on": ["nope"]},
            r"lock_rate_on of .*job names unknown argument\(s\): \['nope'\]",
        ),
        ({"lock_rate_on": ["customer_id"]}, r"lock_rate_on of .*job needs a lock_rate"),
        ({"lock_rate": "1/s", "lock_on_rate_limit": "drop"}, r"lock_on_rate_limit of .*job must be one of"),
        ({"lock_limit": None}, r"lock_limit=None of .*job means no lock at all: it needs a lock_rate"),
        ({"lock_limit": None, "lock_rate": "1/s", "lock_scope": "queue"}, r"lock_limit=None of .*job \(no lock\)"),
        ({"lock_limit": None, "lock_rate": "1/s", "lock_cooldown": 5}, r"lock_limit=None of .*job \(no lock\)"),
        ({"lock_group": ""}, r"lock_group of .*job must be a non-empty name"),
        ({"lock_group": "a b"}, r"lock_group of .*job must be a non-empty name"),
        ({"lock_group": "{x}"}, r"lock_group of .*job must be a non-empty name"),
    ],
)
def test_bad_rate_options_are_refused_at_registration_in_one_line(options: dict[str, Any], message: str) -> None:
    app, _ = _register(**options)
    with pytest.raises(ConfigurationError, match=message) as info:
        _ = app.tasks
    assert "\n" not in str(info.value)


def test_good_rate_options_register() -> None:
    app, job = _register(lock_rate="100/m", lock_rate_on=["customer_id"], lock_on_rate_limit="skip")
    assert job.name in app.tasks
    app2, job2 = _register(lock_rate=(3, 0.5), lock_limit=None)
    assert job2.name in app2.tasks


def test_rate_key_follows_lock_rate_on_not_the_job_identity() -> None:
    app, job = _register(lock_rate="100/m", lock_rate_on=["customer_id"])
    app.conf.singleton_lock_urls = ["redis://127.0.0.1:6399/0"]
    a = job.lock_rate_key_for(7, {"x": 1})
    assert a == job.lock_rate_key_for(7, payload={"x": 2})  # two jobs, one customer's rate
    assert a != job.lock_rate_key_for(8, {"x": 1})
    assert a.startswith("singleton_lock:rate:")
    assert job.lock_key_for(7, {"x": 1}) != job.lock_key_for(7, {"x": 2})  # the jobs themselves differ


def _group_app(limit_b: Any = 1, rate_b: Any = "5/s") -> Celery:
    app = _app()

    @app.task(base=LockedTask, shared=False, name="g.a", lock_group="mail", lock_rate="5/s")
    def a(domain: str) -> None: ...

    @app.task(base=LockedTask, shared=False, name="g.b", lock_group="mail", lock_rate=rate_b, lock_limit=limit_b)
    def b(domain: str) -> None: ...

    return app


def test_a_group_shares_one_key_space() -> None:
    app = _group_app()
    a, b = app.tasks["g.a"], app.tasks["g.b"]
    assert a.lock_key_for("x.org") == b.lock_key_for("x.org")
    assert a.lock_key_for("x.org") != a.lock_key_for("y.org")
    assert a.lock_rate_key_for("x.org") == b.lock_rate_key_for("y.org")  # one rate for the group
    assert ":mail:" in a.lock_key_for("x.org")


@pytest.mark.parametrize(("limit_b", "rate_b"), [(2, "5/s"), (1, "6/s"), (1, None)])
def test_a_group_whose_tasks_disagree_is_refused_at_registration_and_by_the_start_checks(
    limit_b: Any, rate_b: Any
) -> None:
    app = _group_app(limit_b, rate_b)
    with pytest.raises(
        ConfigurationError, match=r"lock_group 'mail': g\.(a|b) has lock_limit=.* but g\.(a|b) has"
    ) as e:
        _ = app.tasks
    assert "\n" not in str(e.value)
    problems = start_problems(app)
    assert any("lock_group 'mail'" in p.message for p in problems), problems


def test_the_same_rate_written_two_ways_agrees() -> None:
    app = _group_app(1, (5, 1.0))
    assert "g.b" in app.tasks
    assert not [p for p in start_problems(app) if "lock_group" in p.message]


def _tiers(customer_id: int, payload: dict | None = None) -> int:
    return 10 if customer_id > 100 else 1


def test_a_limit_function_is_called_with_the_call_s_arguments() -> None:
    app, job = _register(lock_limit=_tiers, lock_unique_on=["customer_id"])
    assert job.name in app.tasks
    assert job.lock_limit_for(500) == 10
    assert job.lock_limit_for(customer_id=5, payload={}) == 1


@pytest.mark.parametrize("answer", [0, -1, 1.5, True, None, "2"])
def test_a_limit_function_s_odd_answer_is_refused_in_one_line(answer: Any) -> None:
    _, job = _register(lock_limit=lambda *a, **k: answer)
    with pytest.raises(ConfigurationError, match=r"^lock_limit of .*job must return a whole number >= 1, got") as e:
        job.lock_limit_for(1)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize(
    "options",
    [{"lock_scope": "queue"}, {"lock_enqueue_check": True}, {"lock_on_duplicate": "replace"}],
)
def test_a_limit_function_is_refused_where_a_limit_above_one_is(options: dict[str, Any]) -> None:
    app, _ = _register(lock_limit=_tiers, **options)
    with pytest.raises(ConfigurationError, match="lock_limit of"):
        _ = app.tasks


def test_lock_rate_on_naming_a_bound_task_s_self_is_refused_at_registration() -> None:
    """``bind=True``: ``self`` is no argument of a call (the key builder never sees it): refused when the task
    registers, naming lock_rate_on (it failed later, at every delivery, as an unknown name of lock_unique_on)."""
    app = _app()

    @app.task(base=LockedTask, bind=True, shared=False, lock_rate="1/s", lock_rate_on=["self"])
    def bound(self: Any, a: int) -> None: ...

    with pytest.raises(ConfigurationError, match=r"lock_rate_on of .*bound names unknown argument\(s\): \['self'\]"):
        _ = app.tasks
    app2 = _app()

    @app2.task(base=LockedTask, bind=True, shared=False, lock_rate="1/s", lock_rate_on=["a"])
    def bound_ok(self: Any, a: int) -> None: ...

    assert bound_ok.name in app2.tasks


def _tokens(customer_id: int, payload: dict | None = None) -> int:
    return 7 + len(payload or {})


@pytest.mark.parametrize(
    ("rate", "message"),
    [
        ([Rate("5/s"), Rate("50/s", cost=0)], r"Rate\(\.\.\., cost=\) must be a number of units above 0"),
        ([Rate("5/s"), Rate("50/s", cost="9")], r"Rate\(\.\.\., cost=\) must be a number of units above 0"),
        ([Rate("5/s"), Rate("50/s", cost=51)], r"Rate\('50 per 1 s', cost=\) is 51 units, more than the limit's 50"),
        (
            [Rate("5/s"), Rate("50/s", cost=lambda prompt, **_: 1)],
            r"Rate\('50 per 1 s', cost=\) needs argument\(s\) \['prompt'\] the task does not take",
        ),
    ],
)
def test_a_bad_cost_per_limit_is_refused_at_registration_in_one_line(rate: Any, message: str) -> None:
    app, _ = _register(lock_rate=rate)
    with pytest.raises(ConfigurationError, match=rf"^lock_rate of .*job: {message}") as info:
        _ = app.tasks
    assert "\n" not in str(info.value)


def test_a_cost_per_limit_takes_its_own_units_and_the_task_s_cost_elsewhere() -> None:
    """``Rate(cost=)`` is that limit's; a limit without one takes ``lock_rate_cost`` (1 without one); a function
    is called once per call; ``rate_spent`` without ``limit=`` corrects the limits whose cost is a function."""
    app, job = _register(lock_rate=[Rate("30/s"), Rate("900/m", cost=_tokens), Rate("60/m", cost=2)])
    assert job.name in app.tasks
    assert not [p for p in start_problems(app) if "lock_rate" in p.message]
    ctx = job.lock_context()
    assert RATE_FEATURE.units(ctx, (1,), {"payload": {"a": 1}}) == (1, 8, 2)
    conf = ctx.options.conf["rate"]
    assert conf.estimated() == [1]
    _, job2 = _register(lock_rate=[Rate("30/s", on=None), Rate("900/m", cost=1)], lock_rate_cost=_tokens)
    assert RATE_FEATURE.units(job2.lock_context(), (1,), {}) == (7, 1)
    assert job2.lock_context().options.conf["rate"].estimated() == [0]


def test_a_function_s_answer_above_its_limit_fails_the_call_in_one_line() -> None:
    _, job = _register(lock_rate=[Rate("30/s"), Rate("8/m", cost=_tokens)])
    with pytest.raises(ConfigurationError, match=r"^lock_rate of .*job: Rate\('8 per 60 s', cost=\) answered 9 units"):
        RATE_FEATURE.units(job.lock_context(), (1,), {"payload": {"a": 1, "b": 2}})


@pytest.mark.parametrize(
    ("name", "chosen"), [(1, [1]), ("900/m", [1]), ((900, 60), [1]), (3, []), ("1/h", []), ("x", [])]
)
def test_a_limit_is_named_as_slowdown_names_it(name: Any, chosen: list[int]) -> None:
    _, job = _register(lock_rate=[Rate("30/s"), Rate("900/m", cost=_tokens)])
    assert named_limits(job.lock_context().options.conf["rate"].limits, name) == chosen


def test_limits_of_one_period_with_costs_of_their_own_have_keys_of_their_own() -> None:
    """Requests and tokens a minute: two limits of one period and arguments, told apart by a cost of their own (the
    key carries its N); two without one (or with one and the same N) are still refused."""
    app, job = _register(lock_rate=[Rate("30/m"), Rate("900/m", cost=_tokens)])
    assert job.name in app.tasks
    keys = RATE_FEATURE.keys_for(job.lock_context(), (1,), {})
    assert len(set(keys)) == 2 and keys[1].split(":v2:")[0].endswith(":60s:900u"), keys
    assert not keys[0].split(":v2:")[0].endswith("u")
    for rate in (["30/m", "900/m"], [Rate("30/m", cost=2), Rate("30/m", cost=_tokens)]):
        bad, _ = _register(lock_rate=rate)
        with pytest.raises(ConfigurationError, match=r"two limits per 60 s on the same arguments"):
            _ = bad.tasks
