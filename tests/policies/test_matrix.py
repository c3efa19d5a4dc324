"""The options matrix (``celery_singleton_lock.policies.matrix``): every pair of options has a verdict, each refused
pair is refused at registration in one line (the worker's start and the doctor: tests/task/test_start_checks.py), a
``lock_group``'s tasks are checked as a whole, and docs/options.md is the matrix's rendered text. No Redis needed:
registration and the start checks read only the app's configuration."""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any, ClassVar

import pytest
from celery import Celery
from matrix_cases import FACET_OPTIONS, options_for, refusal_classes, resolved

import celery_singleton_lock
from celery_singleton_lock import ConfigurationError, LockedTask
from celery_singleton_lock.task import start_problems

DOC = Path(__file__).resolve().parent.parent.parent / "docs" / "options.md"


def _app(**conf: Any) -> Celery:
    app = Celery("matrix", broker="memory://", set_as_current=False)
    app.conf.update(singleton_lock_urls=["redis://127.0.0.1:1/0"], **conf)
    return app


def _register(app: Celery, name: str, options: dict[str, Any]) -> Any:
    @app.task(base=LockedTask, shared=False, name=name, **resolved(options))
    def noop(key: str) -> str:
        return key

    return noop


def _body(key: str) -> str:
    return key


def _task_class(options: dict[str, Any], name: str = "m.t") -> Any:
    """A LockedTask class with ``options``, never registered: what the matrix reads of a task."""
    return type("T", (LockedTask,), {"name": name, "run": staticmethod(_body), **resolved(options)})


def _refused_at_registration(options: dict[str, Any], name: str = "m.t") -> str:
    app = _app()
    _register(app, name, options)
    with pytest.raises(ConfigurationError) as info:
        _ = app.tasks
    return str(info.value)


# --- the table ----------------------------------------------------------------------------------------------------


def test_every_pair_of_facets_has_one_verdict() -> None:
    """Each unordered pair of facets that can occur together has a verdict, and no verdict names anything else."""
    from celery_singleton_lock.policies import matrix  # noqa: PLC0415

    wanted = {frozenset(p) for p in matrix.pairs()}
    missing = sorted(tuple(sorted(p)) for p in wanted - set(matrix.VERDICTS))
    extra = sorted(tuple(sorted(p)) for p in set(matrix.VERDICTS) - wanted)
    assert not missing, f"pairs without a verdict: {missing}"
    assert not extra, f"verdicts of no pair: {extra}"
    assert set(FACET_OPTIONS) == set(matrix.FACETS)
    for verdict in matrix.VERDICTS.values():
        text = verdict.line if isinstance(verdict, matrix.Refused) else verdict.note
        assert text and "\n" not in text


def test_facets_read_a_task_s_options_and_the_settings_defaults() -> None:
    """Each facet's options activate that facet; the settings' default policy counts, except where a task has no
    lock (lock_limit=None) or debounces (its duplicates always reschedule)."""
    from celery_singleton_lock.lock.config import settings_from  # noqa: PLC0415
    from celery_singleton_lock.policies import matrix  # noqa: PLC0415

    settings = settings_from({"singleton_lock_urls": "redis://127.0.0.1:1/0", "singleton_lock_on_duplicate": "fail"})
    for facet, options in FACET_OPTIONS.items():
        task = _task_class(options_for((facet,)))
        found = matrix.facets(task)
        assert facet in found, (facet, found)
        assert found <= {facet, "rate:wait", "policy:reschedule", *(["unique_on"] if facet == "fair" else [])}, (
            facet,
            found,
        )
    plain = _task_class({})
    assert matrix.facets(plain) == frozenset()
    assert matrix.facets(plain, settings) == {"policy:fail"}
    assert matrix.facets(_task_class({"lock_limit": None, "lock_rate": "1/s"}), settings) == {
        "limit:none",
        "rate:wait",
    }
    assert "policy:reschedule" in matrix.facets(_task_class({"lock_debounce": 1}), settings)


@pytest.mark.parametrize(("case", "options"), list(refusal_classes().items()))
def test_each_refused_combination_is_refused_at_registration_in_one_line(case: str, options: dict[str, Any]) -> None:
    """Registering a task whose options the matrix refuses raises the public ConfigurationError (also a
    ConfigurationRefusedError) with one line naming the task: the matrix's first refusal of its facets."""
    from celery_singleton_lock.policies import matrix  # noqa: PLC0415

    app = _app()
    _register(app, "m.t", options)
    expected = matrix.refusals(matrix.facets(_task_class(options)), "m.t")
    assert expected, case
    with pytest.raises(celery_singleton_lock.ConfigurationRefusedError) as info:
        _ = app.tasks
    assert isinstance(info.value, ConfigurationError)
    assert str(info.value) == expected[0].line
    assert "\n" not in str(info.value) and "m.t" in str(info.value)


def test_every_refused_pair_is_refused_at_registration() -> None:
    """Not only one pair per refusal line: every refused pair of the table stops registration."""
    from celery_singleton_lock.policies import matrix  # noqa: PLC0415

    for key, verdict in matrix.VERDICTS.items():
        if isinstance(verdict, matrix.Refused):
            message = _refused_at_registration(options_for(tuple(key)))
            assert message in {r.line for r in matrix.refusals(key | {"rate:wait"}, "m.t")} | {
                r.line for r in matrix.refusals(key, "m.t")
            }, (key, message)


def test_a_supported_pair_registers_and_passes_the_start_checks() -> None:
    """Every supported pair registers, and the worker's start checks find nothing in it."""
    from celery_singleton_lock.policies import matrix  # noqa: PLC0415

    for a, b in matrix.pairs():
        if isinstance(matrix.verdict(a, b), matrix.Supported):
            options = options_for((a, b))
            if "policy:" not in a + b and any(f in ("max_waiting", "fair") for f in (a, b)):
                options["lock_on_duplicate"] = "reschedule"  # the settings' default 'skip' waits in no line
            app = _app()
            _register(app, "m.s", options)
            assert start_problems(app) == [], (a, b, options)


def test_docs_options_md_is_the_rendered_matrix() -> None:
    """docs/options.md is exactly what the code renders (regenerate: the command in the file's head)."""
    from celery_singleton_lock.policies import matrix  # noqa: PLC0415

    assert DOC.read_text() == matrix.render_markdown(), (
        "docs/options.md differs from the matrix: run python -m celery_singleton_lock.policies.matrix > docs/options.md"
    )


# --- findings of issue 29 that registration accepted ------------------------------------------------------------------


def _invoice_receipt(invoice: dict[str, Any], receipt: dict[str, Any]) -> Celery:
    app = _app()

    @app.task(base=LockedTask, shared=False, name="shop.invoice", lock_group="order", **invoice)
    def invoice_(order_id: int) -> None: ...

    @app.task(base=LockedTask, shared=False, name="shop.receipt", lock_group="order", **receipt)
    def receipt_(order_id: int, email: str) -> None: ...

    return app


def _one_line_refusal(app: Celery, says: str) -> None:
    with pytest.raises(ConfigurationError) as info:
        _ = app.tasks
    assert says in str(info.value) and "\n" not in str(info.value), str(info.value)
    assert any(says in p.message for p in start_problems(app)), start_problems(app)


def test_finding_1_a_group_of_debounced_tasks_is_refused() -> None:
    """lock_group x lock_debounce (invoice(order_id), receipt(order_id, email)): refused at registration, since a
    receipt call would join invoice's burst and the burst would run invoice with receipt's arguments."""
    unique = {"lock_unique_on": ["order_id"], "lock_debounce": 1}
    _one_line_refusal(_invoice_receipt(unique, unique), "cannot be used with lock_debounce")


def test_finding_2_a_group_in_queue_scope_is_refused() -> None:
    """lock_group x lock_scope='queue': refused at registration, since a receipt call would be answered with
    invoice's queued job (its AsyncResult) and receipt's body would never run."""
    unique = {"lock_unique_on": ["order_id"], "lock_scope": "queue"}
    _one_line_refusal(_invoice_receipt(unique, unique), "cannot be used with lock_scope='queue'")


@pytest.mark.parametrize("policy", ["skip", "reschedule", "replace"])
def test_queue_scope_with_lock_enqueue_check_is_refused(policy: str) -> None:
    """lock_scope='queue' x lock_enqueue_check: refused (found by the model suite's soak, seeds 145336 and 690765:
    under reschedule or replace a call while the job ran was published as a job of its own, the enqueue check never
    asked; under skip or fail it only repeated what the reservation does)."""
    app = _app()

    @app.task(base=LockedTask, shared=False, name="q.enq", lock_scope="queue", lock_enqueue_check=True,
              lock_on_duplicate=policy)  # fmt: skip
    def enq(n: int) -> None: ...

    _one_line_refusal(app, "remove lock_enqueue_check")


def test_finding_3_a_group_with_mixed_policies_is_refused() -> None:
    """lock_group whose tasks have different lock_on_duplicate (reschedule, replace): refused at registration,
    since a waiting reschedule call ("every call runs") would be superseded by the replace task's newer call."""
    app = _invoice_receipt(
        {"lock_unique_on": ["order_id"], "lock_on_duplicate": "reschedule"},
        {"lock_unique_on": ["order_id"], "lock_on_duplicate": "replace"},
    )
    _one_line_refusal(app, "lock_on_duplicate='reschedule'")


def test_a_group_whose_tasks_name_different_job_arguments_is_refused() -> None:
    """A group's tasks must make their keys from the same argument names (all of invoice's order_id vs all of
    receipt's order_id and email would never be one job): refused, naming both lists."""
    _one_line_refusal(_invoice_receipt({}, {}), "unique-on arguments ['order_id']")


def test_a_group_agreeing_on_everything_registers() -> None:
    """Tasks of one group with one policy and the same job arguments register and pass the start checks."""
    same = {"lock_unique_on": ["order_id"], "lock_on_duplicate": "reschedule", "lock_cooldown": 2}
    app = _invoice_receipt(same, same)
    assert "shop.receipt" in app.tasks
    assert start_problems(app) == []


def test_a_group_s_policy_from_the_settings_is_compared_at_start() -> None:
    """A group task without lock_on_duplicate registers beside one with 'reschedule' (the settings are not read at
    registration), and the start checks compare the policy the settings give it."""
    app = _invoice_receipt(
        {"lock_unique_on": ["order_id"], "lock_on_duplicate": "reschedule"}, {"lock_unique_on": ["order_id"]}
    )
    assert "shop.receipt" in app.tasks
    problems = start_problems(app)
    assert len(problems) == 1 and "lock_on_duplicate='skip'" in problems[0].message, problems
    app.conf.singleton_lock_on_duplicate = "reschedule"
    app.__dict__.pop("_singleton_lock_settings", None)
    assert start_problems(app) == []


@pytest.mark.parametrize("policy", ["reschedule", "replace", "skip", "fail"])
def test_finding_9_lock_limit_none_with_a_policy_is_refused(policy: str) -> None:
    """lock_limit=None x lock_on_duplicate: refused at registration with a line saying None means no lock (three
    calls of one job ran at once under 'reschedule')."""
    message = _refused_at_registration({"lock_limit": None, "lock_rate": "1/s", "lock_on_duplicate": policy})
    assert "lock_limit=None of m.t means no lock" in message and "remove lock_on_duplicate" in message


@pytest.mark.parametrize(
    "options",
    [{"lock_max_waiting": 2}, {"lock_debounce": 1}, {"lock_on_lost": "interrupt"}, {"lock_unique_on": ["key"]}],
)
def test_finding_9_lock_limit_none_with_what_needs_a_lock_is_refused(options: dict[str, Any]) -> None:
    """lock_limit=None x lock_max_waiting / lock_debounce / lock_on_lost='interrupt' / lock_unique_on: refused,
    saying None means no lock."""
    message = _refused_at_registration({"lock_limit": None, "lock_rate": "1/s", **options})
    assert "lock_limit=None of m.t means no lock" in message


def test_lock_limit_none_ignores_the_settings_default_policy() -> None:
    """A rate-only task (lock_limit=None) still starts under singleton_lock_on_duplicate='reschedule': the default
    policy is no option of a task that has no lock."""
    app = _app(singleton_lock_on_duplicate="reschedule")
    _register(app, "m.r", {"lock_limit": None, "lock_rate": "1/s"})
    assert start_problems(app) == []


# --- issue 30: misconfiguration said at once ----------------------------------------------------------------------


def _signed(options: dict[str, Any], *, bind: bool = False) -> Celery:
    app = _app()
    if bind:

        @app.task(base=LockedTask, shared=False, name="shop.charge", bind=True, **options)
        def charge_bound(self: Any, order_id: int, amount: int = 0) -> None: ...

    else:

        @app.task(base=LockedTask, shared=False, name="shop.charge", **options)
        def charge(order_id: int, amount: int = 0) -> None: ...

    return app


@pytest.mark.parametrize("bind", [False, True], ids=["plain", "bind"])
@pytest.mark.parametrize("option", ["lock_unique_on", "lock_rate_on"])
def test_a_misspelt_argument_name_is_refused_at_registration_with_did_you_mean(option: str, *, bind: bool) -> None:
    """lock_unique_on=["orderid"] (or lock_rate_on) is refused when the task registers, suggesting "order_id" and
    listing the task's arguments (a bound task's self is none of them), not at every call in the worker."""
    extra = {"lock_rate": "1/s"} if option == "lock_rate_on" else {}
    app = _signed({option: ["orderid"], **extra}, bind=bind)
    with pytest.raises(ConfigurationError) as info:
        _ = app.tasks
    assert str(info.value) == (
        f"{option} of shop.charge names unknown argument(s): ['orderid'] (did you mean 'order_id'?); the task's "
        "arguments are order_id, amount"
    )
    good = _signed({option: ["order_id"], **extra}, bind=bind)
    assert "shop.charge" in good.tasks
    assert start_problems(good) == []


class _Unreadable:
    """A callable whose signature inspect cannot read."""

    __signature__ = "not a signature"

    def __call__(self, *args: Any) -> None: ...


def test_argument_names_are_not_checked_where_a_signature_cannot_be_read() -> None:
    """A task whose run has no readable signature registers with any lock_unique_on names: its key is built from
    the arguments as given."""

    class Opaque(LockedTask):  # type: ignore[misc]
        name = "m.opaque"
        run = staticmethod(_Unreadable())
        lock_unique_on: ClassVar[list[str]] = ["anything"]

    with pytest.raises(TypeError):
        inspect.signature(Opaque.run)
    app = _app()
    app.register_task(Opaque())
    assert start_problems(app) == []


def test_a_refused_option_at_the_producer_raises_the_public_error() -> None:
    """A bad option met at a producer's first delay() (the app finalized there) raises ConfigurationRefusedError,
    exported by the package and caught by ``except celery_singleton_lock.ConfigurationError``."""
    app = _app()
    task = _register(app, "m.bad", {"lock_on_duplicate": "resechedule"})
    try:
        task.delay("k")
    except celery_singleton_lock.ConfigurationError as exc:
        assert type(exc) is celery_singleton_lock.ConfigurationRefusedError
        assert type(exc).__module__ == "celery_singleton_lock"
        assert "ConfigurationRefusedError" in celery_singleton_lock.__all__
        assert str(exc) == (
            "lock_on_duplicate of m.bad must be one of 'skip', 'fail', 'reschedule', 'replace', 'cancel', got "
            "'resechedule' (did you mean 'reschedule'?)"
        )
    else:
        pytest.fail("delay() with a misspelt lock_on_duplicate was accepted")


@pytest.mark.parametrize(
    ("option", "value", "hint"),
    [
        ("lock_on_duplicate", "resechedule", "'reschedule'"),
        ("lock_scope", "queu", "'queue'"),
        ("lock_on_lost", "interupt", "'interrupt'"),
        ("lock_on_unavailable", "rety", "'retry'"),
        ("lock_on_rate_limit", "wiat", "'wait'"),
    ],
)
def test_a_misspelt_option_value_names_the_closest(option: str, value: str, hint: str) -> None:
    """A misspelt value of a choice option is refused with "did you mean" the closest choice."""
    extra = {"lock_rate": "1/s"} if option == "lock_on_rate_limit" else {}
    message = _refused_at_registration({option: value, **extra})
    assert f"got {value!r} (did you mean {hint}?)" in message, message


def test_a_misspelt_setting_names_the_closest() -> None:
    """singleton_lock_ttll in app.conf is refused, naming singleton_lock_ttl; a misspelt setting value too."""
    app = _app(singleton_lock_ttll=5)
    (problem,) = start_problems(app)
    assert "singleton_lock_ttll (did you mean singleton_lock_ttl?)" in problem.message
    app = _app(singleton_lock_on_duplicate="resechedule")
    (problem,) = start_problems(app)
    assert "got 'resechedule' (did you mean 'reschedule'?)" in problem.message
