"""The options matrix: for every pair of a LockedTask's options, one verdict, supported or refused in one line.

A task's options are read as *facets* (:data:`FACETS`): one per option value that changes what a call does
(``"scope:queue"``, ``"policy:replace"``, ``"limit:none"``, ...). Every unordered pair of facets that can occur
together has a verdict in :data:`VERDICTS`: :class:`Supported` (with a note saying what the pair promises) or
:class:`Refused` (with the one line a user sees, saying what to use instead). A few facets need another
(:data:`REQUIRES`: ``lock_limit=None`` needs a ``lock_rate``). Tasks that share state through a ``lock_group`` are
checked as a whole by :func:`check_group`.

This module is the one source: registration (``LockedTask.bind``), the worker's start checks and
``celery locks doctor`` read it through :func:`refusals` and :func:`check_group`, and docs/options.md is
:func:`render_markdown`'s text (``python -m celery_singleton_lock.policies.matrix > docs/options.md``; a test fails
when the two differ). The value checks of each option alone (types, ranges, names) stay with the option.

A pair that another option's promise makes hard is *supported* only when that promise holds for the pair (a test
of it exists); otherwise it is refused here, before any call can meet it.
"""

from __future__ import annotations

import contextlib
import itertools
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Final

from .port import parameters

__all__ = [
    "FACETS",
    "REQUIRES",
    "VERDICTS",
    "Refusal",
    "Refused",
    "Supported",
    "check_group",
    "facets",
    "pairs",
    "parameters",
    "refusals",
    "render_markdown",
]

#: Every facet, in the order of the rendered table. Facets of one family (``policy:*``, ``limit:*``, ``rate:*``,
#: ``unavailable:*``) exclude each other; a default value (run scope, ``lock_limit=1``, ``lock_on_lost="continue"``,
#: ``lock_on_unavailable="retry"``, no rate) has no facet: it is what every other facet is written against.
FACETS: Final[tuple[str, ...]] = (
    "scope:queue",  # lock_scope="queue"
    "policy:skip",  # lock_on_duplicate (the task's, else the settings' singleton_lock_on_duplicate)
    "policy:fail",
    "policy:reschedule",
    "policy:replace",
    "policy:cancel",
    "limit:many",  # lock_limit=N > 1
    "limit:callable",  # lock_limit=a function
    "limit:none",  # lock_limit=None: no lock
    "group",  # lock_group
    "rate:wait",  # lock_rate with lock_on_rate_limit="wait" (default)
    "rate:skip",
    "rate:fail",
    "rate_on",  # lock_rate_on
    "rate_stacked",  # lock_rate as a list of two or more limits
    "rate_cost",  # lock_rate_cost
    "debounce",  # lock_debounce (and lock_debounce_max)
    "max_waiting",  # lock_max_waiting
    "fair",  # lock_fair_on
    "cooldown",  # lock_cooldown > 0
    "enqueue_check",  # lock_enqueue_check=True
    "unique_on",  # lock_unique_on
    "key_fn",  # lock_key
    "lost:interrupt",  # lock_on_lost="interrupt"
    "unavailable:run",  # lock_on_unavailable (the task's, else the settings'), "run" or "fail"
    "unavailable:fail",
)

_FAMILIES: Final = ("policy:", "limit:", "rate:", "unavailable:")
_RATES: Final = ("rate:wait", "rate:skip", "rate:fail")
_POLICIES: Final = ("policy:skip", "policy:fail", "policy:reschedule", "policy:replace", "policy:cancel")
_PLACEHOLDER: Final = "{task}"


@dataclass(frozen=True)
class Supported:
    """A pair that works: ``note`` says what the pair promises (or that the two options are independent)."""

    note: str


@dataclass(frozen=True)
class Refused:
    """A pair refused at registration, at worker start and by the doctor: ``line`` (``{task}`` is the task's name)
    says what is refused and what to use instead."""

    line: str


Verdict = Supported | Refused


@dataclass(frozen=True)
class Refusal:
    """One refused combination of a task (or of a group's tasks): the facets, and the one line a user sees."""

    pair: tuple[str, ...]
    line: str

    def __str__(self) -> str:
        return self.line


def pairs() -> list[tuple[str, str]]:
    """Every unordered pair of facets that can occur together (two of one family cannot), in :data:`FACETS` order."""
    return [(a, b) for a, b in itertools.combinations(FACETS, 2) if not _same_family(a, b)]


def _same_family(a: str, b: str) -> bool:
    return any(a.startswith(f) and b.startswith(f) for f in _FAMILIES)


def _key(a: str, b: str) -> frozenset[str]:
    return frozenset((a, b))


# --- the verdicts -------------------------------------------------------------------------------------------------

_verdicts: dict[frozenset[str], Verdict] = {}


def _declare(verdict: Verdict, first: str, others: Iterable[str]) -> None:
    for other in others:
        key = _key(first, other)
        if first not in FACETS or other not in FACETS or first == other or _same_family(first, other):
            raise AssertionError(f"no such pair: {first} x {other}")
        if key in _verdicts:
            raise AssertionError(f"two verdicts for {first} x {other}")
        _verdicts[key] = verdict


def _refuse(first: str, others: Iterable[str], line: str) -> None:
    _declare(Refused(line), first, others)


def _support(first: str, others: Iterable[str], note: str) -> None:
    _declare(Supported(note), first, others)


_INDEPENDENT = "independent"

# Refused, in the order they are reported (the first one found is the one a worker prints).
_refuse(
    "scope:queue",
    ["enqueue_check"],
    "lock_enqueue_check of {task} cannot be used with lock_scope='queue': the reservation already answers a call "
    "whose job is queued or running (skip, fail), and under reschedule or replace the call is sent to wait; "
    "remove lock_enqueue_check",
)
_refuse(
    "limit:none",
    ["scope:queue", "enqueue_check", "cooldown"],
    "lock_limit=None of {task} (no lock) cannot be used with lock_scope='queue', lock_enqueue_check or "
    "lock_cooldown: they need the lock; set lock_limit=1 (the default) to keep them",
)
_refuse(
    "limit:none",
    _POLICIES,
    "lock_limit=None of {task} means no lock: no call is ever a duplicate, so lock_on_duplicate does nothing "
    "(equal calls run side by side, only the lock_rate holds them back); remove lock_on_duplicate, or set "
    "lock_limit=1 for one run at a time",
)
_refuse(
    "limit:none",
    ["max_waiting", "debounce", "lost:interrupt", "unique_on", "key_fn"],
    "lock_limit=None of {task} means no lock (no duplicate, no waiting line, no burst, nothing to lose): "
    "lock_max_waiting, lock_debounce, lock_on_lost='interrupt', lock_unique_on and lock_key need one; remove "
    "them, or set lock_limit=1",
)
_refuse(
    "limit:callable",
    ["scope:queue", "enqueue_check"],
    "lock_limit of {task} (a function) works with lock_scope='run' only, without lock_enqueue_check",
)
_refuse("limit:many", ["scope:queue"], "lock_limit of {task} works with lock_scope='run' only: remove one of them")
_refuse(
    "limit:many",
    ["enqueue_check"],
    "lock_limit of {task} cannot be used with lock_enqueue_check (N runs of a key are allowed)",
)
_refuse(
    "policy:replace",
    ["limit:many", "limit:callable"],
    "lock_limit of {task} cannot be used with lock_on_duplicate='replace' (keep-latest means one run of a key): "
    "use 'reschedule', 'skip' or 'fail'",
)
_refuse(
    "max_waiting",
    ["policy:skip"],
    "lock_max_waiting of {task} caps a waiting line: it needs lock_on_duplicate='reschedule' or 'replace', got 'skip'",
)
_refuse(
    "max_waiting",
    ["policy:fail"],
    "lock_max_waiting of {task} caps a waiting line: it needs lock_on_duplicate='reschedule' or 'replace', got 'fail'",
)
_refuse(
    "debounce",
    ["scope:queue"],
    "lock_debounce of {task} cannot be used with lock_scope='queue' (a debounced job is held from its first call "
    "until it runs already)",
)
_refuse(
    "debounce",
    ["limit:many", "limit:callable", "enqueue_check"],
    "lock_debounce of {task} cannot be used with lock_limit or lock_enqueue_check (a burst is one job)",
)
_refuse(
    "policy:cancel",
    ["limit:many", "limit:callable"],
    "lock_limit of {task} cannot be used with lock_on_duplicate='cancel' (the newest call wins: one run of a key); "
    "use 'reschedule', 'skip' or 'fail'",
)
_refuse(
    "policy:cancel",
    ["scope:queue"],
    "lock_on_duplicate='cancel' of {task} stops a running job, and works with lock_scope='run' only (a queued "
    "reservation has no run to stop); use lock_scope='run', or 'replace'",
)
_refuse(
    "policy:cancel",
    ["enqueue_check"],
    "lock_enqueue_check of {task} answers a newer call with the running job, which lock_on_duplicate='cancel' "
    "stops for it: remove one of them",
)
_refuse(
    "policy:cancel",
    [*_RATES, "rate_on", "rate_stacked", "rate_cost"],
    "lock_rate of {task} cannot be used with lock_on_duplicate='cancel' yet (a stopped run's start stays counted, "
    "and its successor's wait for the window is untested): use 'replace' with a rate",
)
for _policy in ("skip", "fail", "replace", "cancel"):
    _refuse(
        "debounce",
        [f"policy:{_policy}"],
        "lock_debounce of {task} runs a new burst after the running one (lock_on_duplicate='reschedule'); "
        f"remove lock_on_duplicate={_policy!r}",
    )
_refuse(
    "group",
    ["scope:queue"],
    "lock_group of {task} cannot be used with lock_scope='queue': a call would be answered with another task's "
    "queued job (its AsyncResult, its body); use lock_scope='run' in a group, or remove lock_group",
)
_refuse(
    "group",
    ["enqueue_check"],
    "lock_group of {task} cannot be used with lock_enqueue_check: a call would be answered with another task's "
    "running job (its AsyncResult); remove one of them",
)
_refuse(
    "group",
    ["debounce"],
    "lock_group of {task} cannot be used with lock_debounce: a call would join another task's burst (the burst "
    "runs one task with the last call's arguments); debounce each task on its own key (remove lock_group)",
)
_refuse(
    "unique_on",
    ["key_fn"],
    "lock_unique_on of {task} is ignored when lock_key is set (the function alone makes the key): remove one of them",
)

_refuse(
    "fair",
    ["policy:skip", "policy:fail", "policy:replace", "policy:cancel", "debounce"],
    "lock_fair_on of {task} takes turns in a key's waiting line: it needs lock_on_duplicate='reschedule' (skip and "
    "fail never wait; replace, cancel and debounce keep one call, so there are no turns to share)",
)
_refuse(
    "fair",
    ["scope:queue", "enqueue_check", "limit:none"],
    "lock_fair_on of {task} takes turns in a key's waiting line at the worker: it needs lock_scope='run', a lock "
    "(lock_limit) and no lock_enqueue_check (a call answered at delay() never waits its turn)",
)
_refuse(
    "fair",
    [*_RATES, "rate_on", "rate_stacked", "rate_cost"],
    "lock_fair_on of {task} cannot be used with lock_rate yet: a call waiting for its rate window is re-sent on its "
    "own, outside the line's turns (a booked slot of the rate's own line, issue 33, not the fair turns; the pair is "
    "untested); remove one of them",
)
_refuse(
    "fair",
    ["cooldown"],
    "lock_fair_on of {task} cannot be used with lock_cooldown yet (a turn woken into a cooldown is untested): "
    "remove one of them",
)

# Supported pairs whose promise another part of the package keeps on purpose (a test of the pair holds it).
_support(
    "scope:queue",
    ["rate:wait"],
    "the reservation stays while the reserved job waits for its rate window (a later call gets the reserved job)",
)
_support("scope:queue", ["rate:skip", "rate:fail"], "a reserved job refused by its rate ends its reservation")
_support(
    "scope:queue",
    ["policy:skip", "policy:fail"],
    "a call whose job is queued or running gets that job's AsyncResult (skip) or DuplicateTaskError (fail)",
)
_support(
    "scope:queue",
    ["policy:reschedule", "policy:replace"],
    "a call whose job is queued or running is sent, and waits at the worker for the key (replace: keep-latest)",
)
_support("scope:queue", ["max_waiting"], "caps the calls sent to wait at the worker behind the reserved job")
_support("scope:queue", ["cooldown"], "the reservation becomes the cooldown after a success")
_support("scope:queue", ["unique_on", "key_fn"], "they make the key the reservation holds")
_support("scope:queue", ["lost:interrupt", "rate_on"], _INDEPENDENT)
_support(
    "scope:queue",
    ["unavailable:run", "unavailable:fail"],
    "no quorum at delay(): run publishes without a reservation, fail raises LockUnavailableError",
)
for _p in _POLICIES:
    _support(_p, ["group"], "every task of the group has this policy (check_group), so a key's line is one policy")
    _support(_p, ["cooldown"], "a call during a success's cooldown is a duplicate of the finished run")
    if _p != "policy:cancel":
        _support(_p, ["enqueue_check"], "a call whose job runs gets that run; the worker's policy stays the guard")
        _support(_p, ["lost:interrupt"], _INDEPENDENT)
    _support(_p, ["unique_on", "key_fn", "unavailable:run", "unavailable:fail"], _INDEPENDENT)
    if _p != "policy:cancel":
        _support(_p, ["rate_on"], _INDEPENDENT)
_support("policy:skip", ["limit:many", "limit:callable"], "a call that finds all N slots held is skipped")
_support("policy:fail", ["limit:many", "limit:callable"], "a call that finds all N slots held fails")
_support("policy:reschedule", ["limit:many", "limit:callable"], "a call that finds all N slots held waits in line")
_support(
    "policy:reschedule",
    ["rate:wait"],
    "a waiting call re-sent for its rate window keeps its place in the key's line (every re-send is its own)",
)
_support("policy:reschedule", ["rate:skip", "rate:fail"], "a run refused by its rate wakes the key's line")
_support(
    "policy:replace",
    ["rate:wait"],
    "the newest waiting call runs, and older ones waiting for the rate window are superseded, never run after it "
    "(not booked: a superseded call's booking would waste its slot)",
)
_support("policy:replace", ["rate:skip", "rate:fail"], "a run refused by its rate wakes the key's line")
_support("policy:skip", _RATES, "the rate is asked after the lock: a skipped call uses no share")
_support("policy:fail", _RATES, "the rate is asked after the lock: a failed duplicate uses no share")
_support("policy:reschedule", ["max_waiting"], "at most N calls wait in a key's line; a new one finds it full: REVOKED")
_support("policy:replace", ["max_waiting"], "at most N calls wait in a key's line (keep-latest replaces within it)")
_support("policy:cancel", ["max_waiting"], "the newest call waits (keep-latest, as replace); the cap counts it")
_support(
    "policy:cancel",
    ["lost:interrupt"],
    "the body is interrupted either way: LockLostError for a lost lock, JobCancelledError for a newer call",
)
_support("policy:reschedule", ["debounce"], "a debounced job waits for the previous burst's run (never beside it)")
for _limit in ("limit:many", "limit:callable"):
    _support(_limit, ["group"], "the group's tasks share the N slots of a key (every task has the same lock_limit)")
    _support(_limit, _RATES, "N runs at once of a key, and no more starts than the rate (two separate keys)")
    _support(_limit, ["rate_on", "lost:interrupt", "unavailable:run", "unavailable:fail"], _INDEPENDENT)
    _support(_limit, ["max_waiting"], "at most N calls wait for a free slot")
    _support(_limit, ["cooldown"], "a success keeps its slot for the cooldown")
    _support(_limit, ["unique_on", "key_fn"], "they make the key whose N slots are shared (e.g. per tenant)")
_support("limit:none", ["group"], "no lock: the group shares its rate only")
_support("limit:none", _RATES, "no lock: equal calls run side by side, never more starts than the rate")
_support("limit:none", ["rate_on"], "the rate is per lock_rate_on arguments")
_support(
    "limit:none",
    ["unavailable:run", "unavailable:fail"],
    "no quorum for the rate: run starts uncounted, fail fails (LockUnavailableError)",
)
_support("group", _RATES, "the group's tasks share one rate (every task has the same lock_rate and lock_on_rate_limit)")
_support("group", ["rate_on"], "every task of the group names the same lock_rate_on arguments (check_group)")
_support("group", ["max_waiting"], "the group's tasks share a key's line and its cap (every task has the same cap)")
_support("group", ["cooldown"], "a success of one task cools the key down for the group (same lock_cooldown)")
_support("group", ["unique_on"], "every task of the group names the same lock_unique_on arguments (check_group)")
_support("group", ["key_fn"], "each task's lock_key makes its part of the group's key: equal strings are one job")
_support("group", ["lost:interrupt", "unavailable:run", "unavailable:fail"], _INDEPENDENT)
for _rate in _RATES:
    _support(_rate, ["rate_on"], "one rate per lock_rate_on arguments, separate from the job's identity")
    _support(_rate, ["max_waiting"], "a call waiting for its rate window keeps its place in the key's line")
    _support(_rate, ["cooldown"], "the cooldown follows a run's success; the rate counts its start")
    _support(_rate, ["enqueue_check", "unique_on", "key_fn", "lost:interrupt"], _INDEPENDENT)
    _support(_rate, ["unavailable:run", "unavailable:fail"], "no quorum for the rate follows lock_on_unavailable")
_support("rate:wait", ["debounce"], "a due burst waiting for its rate window runs once, with its last arguments")
_support(
    "rate:skip",
    ["debounce"],
    "a burst skipped for its rate ends on the nodes: a later call starts a new burst",
)
_support("rate:fail", ["debounce"], "a burst failed for its rate ends on the nodes: a later call starts a new burst")
for _other in ("debounce", "max_waiting", "cooldown", "enqueue_check", "unique_on", "key_fn", "lost:interrupt"):
    _support("rate_on", [_other], _INDEPENDENT)
_support("rate_on", ["unavailable:run", "unavailable:fail"], _INDEPENDENT)
_support("debounce", ["max_waiting"], "caps the bursts' jobs waiting behind a running one")
_support("debounce", ["cooldown"], "a burst's successful run cools the key down; the next burst waits for it")
_support("debounce", ["unique_on", "key_fn"], "they make the burst's key")
_support("debounce", ["lost:interrupt"], _INDEPENDENT)
_support(
    "debounce",
    ["unavailable:run", "unavailable:fail"],
    "a call that finds no quorum for its burst is sent on its own and leaves nothing in a burst",
)
_support("fair", ["policy:reschedule"], "waiting calls are woken round-robin across the lock_fair_on values")
_support("fair", ["limit:many", "limit:callable"], "a freed slot goes to the next value's turn, not the oldest call")
_support("fair", ["group"], "the group's tasks take turns in one line (every task names the same lock_fair_on)")
_support("fair", ["max_waiting"], "the cap counts the whole line, every value; a call with a free slot never waits")
_support("fair", ["unique_on", "key_fn"], "they make the shared key, without the fair arguments")
_support("fair", ["lost:interrupt", "unavailable:fail"], _INDEPENDENT)
_support("fair", ["unavailable:run"], "a call run unguarded (no quorum) takes no turn")
_support("max_waiting", ["cooldown"], "calls waiting out a cooldown count in the line")
_support("max_waiting", ["enqueue_check", "unique_on", "key_fn", "lost:interrupt"], _INDEPENDENT)
_support("max_waiting", ["unavailable:run", "unavailable:fail"], _INDEPENDENT)
_support("cooldown", ["enqueue_check"], "a call during the cooldown gets the finished run's AsyncResult")
_support("cooldown", ["unique_on", "key_fn", "lost:interrupt", "unavailable:run", "unavailable:fail"], _INDEPENDENT)
_support("enqueue_check", ["unique_on", "key_fn", "lost:interrupt"], _INDEPENDENT)
_support("enqueue_check", ["unavailable:run", "unavailable:fail"], "no quorum at delay(): the call is sent")
_support("unique_on", ["lost:interrupt", "unavailable:run", "unavailable:fail"], _INDEPENDENT)
_support("key_fn", ["lost:interrupt", "unavailable:run", "unavailable:fail"], _INDEPENDENT)
_support("lost:interrupt", ["unavailable:run"], "a run started unguarded holds no lock to lose")
_support("lost:interrupt", ["unavailable:fail"], _INDEPENDENT)

# Stacked limits and a cost per start (issue 33): each limit is a rate of its own arguments, counted in the same one
# round trip; a cost takes that many slots of each limit. What the rate does with another option, they do too.
_support("rate_stacked", ["rate_cost"], "a start takes its cost of every limit, all or none")
_support("rate_stacked", ["rate_on"], "lock_rate_on is the arguments of the list's plain items; Rate(on=) its own")
_support("rate_cost", ["rate_on"], "a start takes its cost of the rate of its lock_rate_on arguments")
_support("rate_stacked", _RATES, "a start needs a share of every limit; refused, the wait is the latest limit's")
_support("rate_cost", _RATES, "a start takes its cost in units of the rate; rate_spent corrects it after the run")
_support("rate_stacked", ["limit:none"], "no lock: only the limits decide")
_support("rate_cost", ["limit:none"], "no lock: only the rate's units decide")
_support("rate_stacked", ["group"], "the group's tasks share every limit (the same lock_rate list, check_group)")
_support("rate_cost", ["group"], "the group's tasks share the rate's units (the same lock_rate_cost, check_group)")
_support(
    "rate_cost",
    ["unavailable:run"],
    "no quorum for the rate: the body starts uncounted and rate_spent corrects nothing",
)
for _facet in ("rate_stacked", "rate_cost"):
    for _other in FACETS:
        if _other == "policy:cancel" or _other.startswith("rate") or _key(_facet, _other) in _verdicts:
            continue
        if _other not in ("limit:none", "group"):
            _support(_facet, [_other], _INDEPENDENT)

#: The verdict of every pair of :func:`pairs` (a test fails on a missing one).
VERDICTS: Final[dict[frozenset[str], Verdict]] = dict(_verdicts)

#: Facets that need one of other facets, with the line a task without them sees.
REQUIRES: Final[dict[str, tuple[tuple[str, ...], str]]] = {
    "limit:none": (_RATES, "lock_limit=None of {task} means no lock at all: it needs a lock_rate"),
    "rate_on": (_RATES, "lock_rate_on of {task} needs a lock_rate"),
    "fair": (
        ("unique_on", "key_fn"),
        "lock_fair_on of {task} needs a key its values share: set lock_unique_on to the other arguments (or []), or "
        "a lock_key",
    ),
    "rate_cost": (_RATES, "lock_rate_cost of {task} needs a lock_rate"),
}


def verdict(a: str, b: str) -> Verdict:
    """The verdict of the pair ``a`` x ``b`` (KeyError: not a pair of :func:`pairs`)."""
    return VERDICTS[_key(a, b)]


# --- reading a task ------------------------------------------------------------------------------------------------


def _cls(task: Any) -> Any:
    return task if isinstance(task, type) else type(task)


def facets(task: Any, settings: Any = None) -> frozenset[str]:
    """The facets a LockedTask (class or instance) activates.

    ``settings`` (a :class:`~celery_singleton_lock.config.LockSettings`) gives the defaults a task does not set
    (``lock_on_duplicate``, ``lock_on_unavailable``); without them only the task's own options count. A debounced
    task's duplicates reschedule whatever the settings say; a task without a lock (``lock_limit=None``) has no
    duplicates, so the settings' default policy is no facet of it. Values are read as given: an invalid one is the
    option's own check's to refuse.
    """
    cls = _cls(task)
    out: set[str] = set()
    if cls.lock_scope == "queue":
        out.add("scope:queue")
    limit = cls.lock_limit
    if limit is None:
        out.add("limit:none")
    elif callable(limit):
        out.add("limit:callable")
    elif isinstance(limit, int) and not isinstance(limit, bool) and limit > 1:
        out.add("limit:many")
    policy = cls.lock_on_duplicate
    if policy is None and limit is not None:
        policy = "reschedule" if cls.lock_debounce else getattr(settings, "on_duplicate", None)
    if policy is not None:
        out.add(f"policy:{policy}")
    if cls.lock_group is not None:
        out.add("group")
    if cls.lock_rate is not None:
        out.add(f"rate:{cls.lock_on_rate_limit}")
    if cls.lock_rate_on is not None:
        out.add("rate_on")
    if _stacked(cls.lock_rate):
        out.add("rate_stacked")
    if getattr(cls, "lock_rate_cost", None) is not None:
        out.add("rate_cost")
    if cls.lock_debounce is not None:
        out.add("debounce")
    if cls.lock_max_waiting is not None:
        out.add("max_waiting")
    if getattr(cls, "lock_fair_on", None) is not None:
        out.add("fair")
    if cls.lock_cooldown:
        out.add("cooldown")
    if cls.lock_enqueue_check:
        out.add("enqueue_check")
    if cls.lock_unique_on is not None:
        out.add("unique_on")
    if cls.lock_key is not None:
        out.add("key_fn")
    if cls.lock_on_lost == "interrupt":
        out.add("lost:interrupt")
    unavailable = cls.lock_on_unavailable or getattr(settings, "on_unavailable", None)
    if unavailable in ("run", "fail"):
        out.add(f"unavailable:{unavailable}")
    return frozenset(f for f in out if f in FACETS)


def _stacked(rate: Any) -> bool:
    """``lock_rate`` is a list of two or more limits (``(N, seconds)`` is one: its items are numbers)."""
    return (
        isinstance(rate, list | tuple)
        and len(rate) >= 2
        and not any(isinstance(item, int | float) and not isinstance(item, bool) for item in rate)
    )


def refusals(facet_set: Iterable[str], name: str = _PLACEHOLDER) -> list[Refusal]:
    """Every refused pair (and unmet requirement) of ``facet_set``, in the order of :data:`VERDICTS`; empty: the
    combination is supported. ``name`` is put in each line (the task's name)."""
    present = set(facet_set)
    out: list[Refusal] = []
    for facet, (needs, line) in REQUIRES.items():
        if facet in present and not present.intersection(needs):
            out.append(Refusal((facet,), line.replace(_PLACEHOLDER, name)))
    for key, found in VERDICTS.items():
        if isinstance(found, Refused) and key <= present:
            pair = tuple(sorted(key, key=FACETS.index))
            out.append(Refusal(pair, found.line.replace(_PLACEHOLDER, name)))
    return out


# --- a group, as a whole -------------------------------------------------------------------------------------------


def unique_names(task: Any) -> tuple[str, ...] | None:
    """The names of the arguments that make ``task``'s job: ``lock_unique_on``, else every named parameter; None
    when ``lock_key`` makes the key or the signature cannot be read."""
    cls = _cls(task)
    if cls.lock_key is not None:
        return None
    if cls.lock_unique_on is not None:
        return tuple(sorted(cls.lock_unique_on))
    params = parameters(cls)
    if params is None:
        return None
    return tuple(sorted(p.name for p in params))


def _terms(task: Any, settings: Any) -> dict[str, Any]:
    """What the tasks of one group must agree on: whatever shares a key (the lock's, the line's, the rate's)."""
    cls = _cls(task)
    rate: Any = cls.lock_rate
    if rate is not None:
        from .rate import parse_limits  # noqa: PLC0415 - rate imports the nodes; the matrix stays light to import

        with contextlib.suppress(ValueError):  # invalid: the option's own check says so
            limits = parse_limits(rate, cls.lock_rate_on or (), "")
            rate = limits[0].window if len(limits) == 1 else tuple((lim.window, sorted(lim.on)) for lim in limits)
    found = facets(cls, settings)
    return {
        "lock_on_duplicate": next((f.split(":", 1)[1] for f in found if f.startswith("policy:")), None),
        "lock_scope": cls.lock_scope,
        "lock_limit": cls.lock_limit,
        "lock_rate": rate,
        "lock_on_rate_limit": cls.lock_on_rate_limit if cls.lock_rate is not None else None,
        "lock_rate_on": tuple(sorted(cls.lock_rate_on)) if cls.lock_rate_on is not None else None,
        "lock_rate_cost": getattr(cls, "lock_rate_cost", None),
        "lock_debounce": (cls.lock_debounce, cls.lock_debounce_max) if cls.lock_debounce is not None else None,
        "lock_cooldown": float(cls.lock_cooldown) if isinstance(cls.lock_cooldown, int | float) else cls.lock_cooldown,
        "lock_max_waiting": cls.lock_max_waiting,
        "lock_fair_on": tuple(sorted(cls.lock_fair_on)) if getattr(cls, "lock_fair_on", None) is not None else None,
        "unique-on arguments": unique_names(cls) if cls.lock_limit is not None else None,
    }


def _shown(term: str, value: Any) -> str:
    if term == "lock_rate" and value is not None and hasattr(value, "limit"):
        return f"lock_rate={value}"
    if term == "lock_limit" and callable(value):
        return f"lock_limit={getattr(value, '__qualname__', value)!r}"
    if term == "unique-on arguments" and value is not None:
        return f"unique-on arguments {list(value)}"
    return f"{term}={value!r}"


_UNKNOWN_AS_NONE: Final = ("lock_on_duplicate", "unique-on arguments")


def check_group(tasks: Sequence[Any], settings: Any = None) -> list[Refusal]:
    """The refusals of a ``lock_group``'s tasks taken together (empty: they agree): every task of a group shares the
    group's keys (lock, line, rate), so each must agree with the first on every term of a key (policy, scope,
    limit, rate, cooldown, line cap, debounce, the names of the arguments that make the job)."""
    out: list[Refusal] = []
    if len(tasks) < 2:
        return out
    first = _cls(tasks[0])
    mine = _terms(first, settings)
    for task in tasks[1:]:
        cls = _cls(task)
        theirs = _terms(cls, settings)
        # None where a term is unknown (a policy left to the settings at registration, a key made by lock_key).
        differ = [
            t for t in mine if mine[t] != theirs[t] and not (t in _UNKNOWN_AS_NONE and None in (mine[t], theirs[t]))
        ]
        if not differ:
            continue
        if differ[0] in ("lock_limit", "lock_rate"):
            # Worded as before this module, which tests and users' searches know.
            line = (
                f"lock_group {first.lock_group!r}: {first.name} has lock_limit={first.lock_limit!r}, "
                f"lock_rate={first.lock_rate!r} but {cls.name} has lock_limit={cls.lock_limit!r}, "
                f"lock_rate={cls.lock_rate!r}: every task of a group must agree on them"
            )
        else:
            line = (
                f"lock_group {first.lock_group!r}: {first.name} has "
                f"{', '.join(_shown(t, mine[t]) for t in differ)} but {cls.name} has "
                f"{', '.join(_shown(t, theirs[t]) for t in differ)}: the tasks of a group share its keys, so they "
                "must agree on them (or use two groups)"
            )
        out.append(Refusal(("group", *differ), line))
    return out


# --- docs/options.md -----------------------------------------------------------------------------------------------

_SHORT: Final = {
    "scope:queue": "queue",
    "policy:skip": "skip",
    "policy:fail": "fail",
    "policy:reschedule": "resch",
    "policy:replace": "repl",
    "policy:cancel": "canc",
    "limit:many": "lim N",
    "limit:callable": "lim f",
    "limit:none": "lim 0",
    "group": "group",
    "rate:wait": "r wait",
    "rate:skip": "r skip",
    "rate:fail": "r fail",
    "rate_on": "rate on",
    "rate_stacked": "r stack",
    "rate_cost": "r cost",
    "debounce": "deb",
    "max_waiting": "max w",
    "fair": "fair",
    "cooldown": "cool",
    "enqueue_check": "enq",
    "unique_on": "uniq",
    "key_fn": "key",
    "lost:interrupt": "intr",
    "unavailable:run": "u run",
    "unavailable:fail": "u fail",
}

_OPTIONS: Final = {
    "scope:queue": '`lock_scope="queue"`',
    "policy:skip": '`lock_on_duplicate="skip"` (the task\'s, else `singleton_lock_on_duplicate`)',
    "policy:fail": '`lock_on_duplicate="fail"`',
    "policy:reschedule": '`lock_on_duplicate="reschedule"` (also every debounced task)',
    "policy:replace": '`lock_on_duplicate="replace"`',
    "policy:cancel": '`lock_on_duplicate="cancel"` (stop the running job; the newest call runs after it)',
    "limit:many": "`lock_limit=N`, N > 1",
    "limit:callable": "`lock_limit=` a function",
    "limit:none": "`lock_limit=None` (no lock)",
    "group": "`lock_group`",
    "rate:wait": '`lock_rate` with `lock_on_rate_limit="wait"` (default)',
    "rate:skip": '`lock_rate` with `lock_on_rate_limit="skip"`',
    "rate:fail": '`lock_rate` with `lock_on_rate_limit="fail"`',
    "rate_on": "`lock_rate_on`",
    "rate_stacked": "`lock_rate` as a list of limits (stacked: a start needs a share of every one)",
    "rate_cost": "`lock_rate_cost` (the units a start takes; `rate_spent` corrects them)",
    "debounce": "`lock_debounce` (and `lock_debounce_max`)",
    "max_waiting": "`lock_max_waiting`",
    "fair": "`lock_fair_on`",
    "cooldown": "`lock_cooldown` > 0",
    "enqueue_check": "`lock_enqueue_check=True`",
    "unique_on": "`lock_unique_on`",
    "key_fn": "`lock_key`",
    "lost:interrupt": '`lock_on_lost="interrupt"`',
    "unavailable:run": '`lock_on_unavailable="run"` (the task\'s, else `singleton_lock_on_unavailable`)',
    "unavailable:fail": '`lock_on_unavailable="fail"`',
}


def render_markdown() -> str:
    """docs/options.md: the matrix as a table, the refusal lines, and the notes of the supported pairs."""
    refused: dict[str, int] = {}
    for found in VERDICTS.values():
        if isinstance(found, Refused) and found.line not in refused:
            refused[found.line] = len(refused) + 1
    lines = [
        "# Options matrix",
        "",
        "<!-- Generated from celery_singleton_lock/policies/matrix.py: do not edit by hand. Regenerate with",
        "     python -m celery_singleton_lock.policies.matrix > docs/options.md",
        "     (tests/policies/test_matrix.py fails when this file and the code differ). -->",
        "",
        "Every pair of a LockedTask's options has one verdict: supported, or refused at registration, at worker",
        "start and by `celery locks doctor`, in one line saying what to use instead. The verdicts live in",
        "`celery_singleton_lock/policies/matrix.py`, which all three read; this page is generated from it.",
        "",
        "Tasks that share a `lock_group` share its keys (the lock, a key's waiting line, the rate), so they are",
        "checked as a whole: they must agree on `lock_on_duplicate`, `lock_scope`, `lock_limit`, `lock_rate`,",
        "`lock_on_rate_limit`, `lock_rate_on`, `lock_rate_cost`, `lock_debounce`, `lock_cooldown`, `lock_max_waiting`,",
        "`lock_fair_on` and the names of the arguments that make the job (`lock_unique_on`, or every parameter), or",
        "they are refused.",
        "",
        "## Facets",
        "",
        "| facet | column | option |",
        "|---|---|---|",
    ]
    lines += [f"| `{f}` | {_SHORT[f]} | {_OPTIONS[f]} |" for f in FACETS]
    lines += [
        "",
        "## The matrix",
        "",
        "`ok`: supported (see the notes below); `xN`: refused, line N below; `-`: one option, two values (cannot",
        "occur together).",
        "",
        "| | " + " | ".join(_SHORT[f] for f in FACETS) + " |",
        "|---|" + "---|" * len(FACETS),
    ]
    for a in FACETS:
        cells = []
        for b in FACETS:
            if a == b or _same_family(a, b):
                cells.append("-")
                continue
            found = VERDICTS[_key(a, b)]
            cells.append(f"x{refused[found.line]}" if isinstance(found, Refused) else "ok")
        lines.append(f"| **{_SHORT[a]}** | " + " | ".join(cells) + " |")
    lines += ["", "## Refused", ""]
    for line, number in refused.items():
        which = sorted(
            (
                " x ".join(f"`{f}`" for f in sorted(k, key=FACETS.index))
                for k, v in VERDICTS.items()
                if v == Refused(line)
            ),
        )
        lines.append(f"{number}. {', '.join(which)}: {line.replace(_PLACEHOLDER, '<task>')}")
    lines += ["", "Needs another option:", ""]
    for facet, (_needs, line) in REQUIRES.items():
        lines.append(f"- `{facet}`: {line.replace(_PLACEHOLDER, '<task>')}")
    lines += ["", "## Supported pairs and what they promise", ""]
    lines += [
        f"- `{a}` x `{b}`: {found.note}"
        for a, b in pairs()
        if isinstance(found := VERDICTS[_key(a, b)], Supported) and found.note != _INDEPENDENT
    ]
    lines += [
        "",
        f"Every other supported pair is independent: the two options act on different things. {len(pairs())} pairs "
        f"in all, {sum(isinstance(v, Refused) for v in VERDICTS.values())} refused.",
    ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":  # pragma: no cover - python -m celery_singleton_lock.policies.matrix > docs/options.md
    sys.stdout.write(render_markdown())
