"""Options that activate each facet of the options matrix (``celery_singleton_lock.policies.matrix``), as a task's
decorator options, and one case per refusal class: what the matrix tests register in-process and what
``tests/apps/config_app.py`` registers in a real ``celery worker`` / ``celery locks doctor``.

A value ``"@fn"`` is a function of the task's arguments (config_app and :func:`resolved` turn it into one).
"""

from __future__ import annotations

from typing import Any

from celery_singleton_lock.policies import matrix

#: Decorator options that make a task (``noop(key)``) show one facet, and nothing else it does not need.
FACET_OPTIONS: dict[str, dict[str, Any]] = {
    "scope:queue": {"lock_scope": "queue"},
    "policy:skip": {"lock_on_duplicate": "skip"},
    "policy:fail": {"lock_on_duplicate": "fail"},
    "policy:reschedule": {"lock_on_duplicate": "reschedule"},
    "policy:replace": {"lock_on_duplicate": "replace"},
    "policy:cancel": {"lock_on_duplicate": "cancel"},
    "limit:many": {"lock_limit": 2},
    "limit:callable": {"lock_limit": "@fn"},
    "limit:none": {"lock_limit": None},
    "group": {"lock_group": "g"},
    "rate:wait": {"lock_rate": "5/s", "lock_on_rate_limit": "wait"},
    "rate:skip": {"lock_rate": "5/s", "lock_on_rate_limit": "skip"},
    "rate:fail": {"lock_rate": "5/s", "lock_on_rate_limit": "fail"},
    "rate_on": {"lock_rate_on": ["key"]},
    "rate_stacked": {"lock_rate": ["5/s", "100/m"]},
    "rate_cost": {"lock_rate_cost": 2},
    "debounce": {"lock_debounce": 1},
    "max_waiting": {"lock_max_waiting": 2},
    "fair": {"lock_fair_on": ["key"]},
    "cooldown": {"lock_cooldown": 5},
    "enqueue_check": {"lock_enqueue_check": True},
    "unique_on": {"lock_unique_on": ["key"]},
    "key_fn": {"lock_key": "@fn"},
    "lost:interrupt": {"lock_on_lost": "interrupt"},
    "unavailable:run": {"lock_on_unavailable": "run"},
    "unavailable:fail": {"lock_on_unavailable": "fail"},
}


def options_for(facets: tuple[str, ...] | frozenset[str]) -> dict[str, Any]:
    """Decorator options showing ``facets``, plus what one of them needs (a rate for ``lock_limit=None``)."""
    out: dict[str, Any] = {}
    for facet in facets:
        out.update(FACET_OPTIONS[facet])
    if "rate_stacked" in facets:  # a rate:* facet's plain lock_rate must not replace the list
        out.update(FACET_OPTIONS["rate_stacked"])
    needs = set(facets) & set(matrix.REQUIRES)
    if "fair" in facets and "lock_unique_on" in out:
        out["lock_unique_on"] = []  # the key the fair values share: without the fair argument
    if "fair" in needs and "limit:none" not in facets and "lock_unique_on" not in out and "lock_key" not in out:
        out["lock_unique_on"] = []  # a key its values share
    needs.discard("fair")
    if needs and "lock_rate" not in out:
        out["lock_rate"] = "5/s"
    return out


def fn(key: str, *args: Any, **kwargs: Any) -> Any:
    """A ``lock_limit`` / ``lock_key`` function (only registered here, never called)."""
    return key


def resolved(options: dict[str, Any]) -> dict[str, Any]:
    """``options`` with ``"@fn"`` made a function."""
    return {name: fn if value == "@fn" else value for name, value in options.items()}


def refusal_classes() -> dict[str, dict[str, Any]]:
    """One case per refusal class of the matrix (each distinct refused line, each requirement): its id -> the
    options of a task that meets it (the first pair declared with that line)."""
    cases: dict[str, dict[str, Any]] = {}
    seen: set[str] = set()
    for key, verdict in matrix.VERDICTS.items():
        if isinstance(verdict, matrix.Refused) and verdict.line not in seen:
            seen.add(verdict.line)
            pair = tuple(sorted(key, key=matrix.FACETS.index))
            cases[" x ".join(pair)] = options_for(pair)
    for facet in matrix.REQUIRES:
        cases[f"{facet} alone"] = dict(FACET_OPTIONS[facet])
    return cases


#: Groups whose two tasks (config_app's ``noop(key)`` and ``other(key, email)``) disagree: their options.
GROUP_CASES: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "group with mixed policies": (
        {"lock_group": "g", "lock_on_duplicate": "reschedule"},
        {"lock_group": "g", "lock_on_duplicate": "replace"},
    ),
    "group whose tasks identify the job by different arguments": ({"lock_group": "g"}, {"lock_group": "g"}),
    "group with different cooldowns": (
        {"lock_group": "g", "lock_unique_on": ["key"], "lock_cooldown": 5},
        {"lock_group": "g", "lock_unique_on": ["key"]},
    ),
}
