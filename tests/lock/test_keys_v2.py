"""Lock key format v2 (keys.py): the "same job" rule, default arguments, serializer round trips, stability.

Pure logic, in-process (one test starts a Python subprocess); no Redis. The rule is written once more here, as
``same_job_model``: two values are one job exactly when their models are equal under Python's ``==``. The
property tests check the encoder against that model, so a collision in the encoding (two jobs, one key) or a
split (one job, two keys) fails with the two values that show it.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import decimal
import enum
import hashlib
import inspect
import json
import math
import os
import pickle
import subprocess
import sys
import uuid
from collections import OrderedDict
from fractions import Fraction
from typing import Any

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st
from kombu.utils import json as kombu_json

from celery_singleton_lock.errors import ConfigurationError, UnserializableArgumentsError
from celery_singleton_lock.lock.keys import Binder, canonical, custom_key, lock_key

D = decimal.Decimal
UTC = dt.timezone.utc


def rebuild(account_id: int, month: str = "current") -> None: ...


def rebuild_v2(account_id: int, month: str = "current", *, force: bool = False, note: str | None = None) -> None: ...


SIG = inspect.signature(rebuild)
SIG_V2 = inspect.signature(rebuild_v2)


def key(*args: Any, **kwargs: Any) -> str:
    return lock_key("p:", "reports.rebuild", SIG, args, kwargs)


def vkey(value: Any) -> str:
    """The key of a one-argument call: the unit the "same job" rule is stated in."""
    return lock_key("p:", "t", None, (value,), {})


class Color(enum.Enum):
    RED = "red"
    CRIMSON = "red"  # an alias: the same member as RED
    ONE = 1


class Shade(enum.Enum):
    RED = "red"  # same name and value as Color.RED, another enum


class Level(enum.IntEnum):
    HIGH = 1


class Mode(str, enum.Enum):
    FAST = "fast"


@dataclasses.dataclass(frozen=True)
class Point:
    x: int
    y: int
    label: str = dataclasses.field(default="", compare=False)


# -- regressions: v1 gave two jobs one key, or one job two keys ------------------------------------------------------


def test_bytes_and_their_hex_text_are_different_jobs() -> None:
    """b"ab" and "6162" (its hex) are different jobs: v1 hex-encoded bytes into a string and gave both one key."""
    assert vkey(b"ab") != vkey("6162")
    assert vkey(b"") != vkey("")


def test_a_set_and_a_list_of_the_same_items_are_different_jobs() -> None:
    """{1, 2} and [1, 2] are different jobs: v1 encoded a set as its sorted list."""
    assert vkey({1, 2}) != vkey([1, 2])
    assert vkey(set()) != vkey([])


def test_equal_decimals_are_one_job() -> None:
    """Decimals equal in value are one job whatever their exponent or zero's sign (v1 keyed on str(Decimal))."""
    assert len({vkey(D("1.0")), vkey(D("1.00")), vkey(D("1")), vkey(D("1E0")), vkey(D("10E-1"))}) == 1
    assert vkey(D("100")) == vkey(D("1E+2"))
    assert vkey(D("-0")) == vkey(D("0.000")) == vkey(D("0E+5"))
    assert vkey(D("1.1")) != vkey(D("1.10000000000000000000000000000000001"))  # no rounding to a context


def test_one_instant_in_two_utc_offsets_is_one_job() -> None:
    """An aware datetime is its UTC instant: 12:00+02:00 and 10:00Z are one job (v1 keyed on the local text)."""
    paris = dt.datetime(2024, 6, 1, 12, 0, tzinfo=dt.timezone(dt.timedelta(hours=2)))
    assert vkey(paris) == vkey(dt.datetime(2024, 6, 1, 10, 0, tzinfo=UTC))
    assert vkey(paris) != vkey(dt.datetime(2024, 6, 1, 12, 0, tzinfo=UTC))


def test_aware_datetimes_at_the_ends_of_the_calendar_get_a_key() -> None:
    """Year 1 at +01:00 is an instant before datetime.min in UTC: it still has a key, the same as in any offset."""
    first = dt.datetime(1, 1, 1, 0, 30, tzinfo=dt.timezone(dt.timedelta(hours=1)))
    assert vkey(first) == vkey(first.replace(hour=1, minute=0, tzinfo=dt.timezone(dt.timedelta(hours=1, minutes=30))))
    last = dt.datetime.max.replace(tzinfo=dt.timezone(dt.timedelta(hours=-1)))
    assert vkey(last) != vkey(dt.datetime.max.replace(tzinfo=UTC))


def test_float_zero_and_negative_zero_are_one_job() -> None:
    """0.0 == -0.0, so they are one job (v1 kept JSON's "-0.0"); NaN is one job with itself."""
    assert vkey(0.0) == vkey(-0.0)
    assert vkey(math.nan) == vkey(float("nan"))


def test_adding_a_defaulted_parameter_changes_no_key() -> None:
    """A new parameter with a default leaves every existing key as it was: old and new workers share the lock."""
    for args, kwargs in [((1,), {}), ((1, "2024-01"), {}), ((), {"account_id": 7, "month": "current"})]:
        assert lock_key("p:", "t", SIG, args, kwargs) == lock_key("p:", "t", SIG_V2, args, kwargs)
    # Passing the new parameter at its default is still the old job; another value is another job.
    assert lock_key("p:", "t", SIG_V2, (1,), {"force": False}) == lock_key("p:", "t", SIG, (1,), {})
    assert lock_key("p:", "t", SIG_V2, (1,), {"force": True}) != lock_key("p:", "t", SIG, (1,), {})


def test_key_names_its_format_version() -> None:
    """A generated key is prefix + task name + ':v2:' + 32 hex digits, so a future format change is explicit."""
    k = key(1)
    head, digest = k.rsplit(":", 1)
    assert head == "p:reports.rebuild:v2"
    # The 32 digits: the start of the SHA-256, in lower-case hex, of the call's canonical text (docs/keys.md).
    assert digest == hashlib.sha256(b"{10:account_idi1;}").hexdigest()[:32]


def test_a_dataclass_and_the_dict_of_its_fields_are_different_jobs() -> None:
    """Point(1, 2) and {"x": 1, "y": 2} are different jobs: v1 encoded a dataclass as its asdict()."""
    assert vkey(Point(1, 2)) != vkey({"x": 1, "y": 2})


def test_an_enum_member_and_its_value_are_different_jobs() -> None:
    """A plain Enum member is not its value, nor a member of another enum with the same value (v1: all one)."""
    assert len({vkey(Color.RED), vkey("red"), vkey(Shade.RED)}) == 3
    assert vkey(Color.RED) == vkey(Color.CRIMSON)  # an alias is the same member


def test_timedeltas_differing_by_a_microsecond_are_different_jobs() -> None:
    """Timedeltas are keyed exactly (v1 used total_seconds(), a float that loses microseconds past ~285 years)."""
    assert vkey(dt.timedelta(days=999_999, microseconds=1)) != vkey(dt.timedelta(days=999_999))
    assert vkey(dt.timedelta(hours=24)) == vkey(dt.timedelta(days=1))


# -- the same-job rule, case by case -----------------------------------------------------------------------------------


def test_tuple_and_list_are_one_job() -> None:
    """(1, 2) and [1, 2] are one job: JSON sends every tuple as a list, so the worker cannot tell them apart."""
    assert vkey((1, 2)) == vkey([1, 2])
    assert vkey({"a": (1, (2,))}) == vkey({"a": [1, [2]]})


def test_int_float_and_bool_are_different_jobs() -> None:
    """1, 1.0 and True are three jobs: JSON, pickle, yaml and msgpack all keep them apart."""
    assert len({vkey(1), vkey(1.0), vkey(True), vkey(D(1)), vkey("1")}) == 5
    assert len({vkey(0), vkey(0.0), vkey(False), vkey(None), vkey(""), vkey([]), vkey({})}) == 7


def test_subclasses_of_json_types_are_their_base_type() -> None:
    """An IntEnum is its int and a str-mixin Enum its str: JSON sends them as such, and they compare equal."""
    assert vkey(Level.HIGH) == vkey(1)
    assert vkey(Mode.FAST) == vkey("fast")
    assert vkey(OrderedDict(b=2, a=1)) == vkey({"a": 1, "b": 2})


def test_naive_and_aware_datetimes_are_different_jobs() -> None:
    """A naive datetime is not the UTC instant with the same digits (Python never calls them equal either)."""
    assert vkey(dt.datetime(2024, 1, 1)) != vkey(dt.datetime(2024, 1, 1, tzinfo=UTC))
    assert vkey(dt.datetime(2024, 1, 1)) != vkey(dt.date(2024, 1, 1))


def test_aware_times_are_compared_like_python_does() -> None:
    """An aware time is its offset-adjusted time of day (Python's ==); a naive one is not an aware one."""
    plus_one = dt.timezone(dt.timedelta(hours=1))
    assert vkey(dt.time(12, 0, tzinfo=plus_one)) == vkey(dt.time(11, 0, tzinfo=UTC))
    assert vkey(dt.time(11, 0)) != vkey(dt.time(11, 0, tzinfo=UTC))


def test_set_and_frozenset_are_one_job_whatever_the_order() -> None:
    """A set is one job with the equal frozenset and with itself built in any order; bytearray is bytes."""
    assert vkey({"b", "a", "c"}) == vkey(frozenset(["c", "a", "b"]))
    assert vkey(bytearray(b"\x00\xff")) == vkey(b"\x00\xff")


def test_dict_keys_are_the_strings_json_sends() -> None:
    """An int, float, bool or None dict key is the string JSON sends for it: {1: x} and {"1": x} are one job."""
    assert vkey({1: "x"}) == vkey({"1": "x"})
    assert vkey({True: 1, None: 2, 1.5: 3}) == vkey({"true": 1, "null": 2, "1.5": 3})
    assert vkey({2: "a", 10: "b"}) == vkey({"10": "b", "2": "a"})  # sorted as strings, as the worker sees them
    assert vkey({1: "a", "b": 2}) == vkey({"b": 2, "1": "a"})  # mixed key types need no ordering between them


def test_an_int_keyed_dict_has_the_key_the_json_worker_computes() -> None:
    """{2: a, 10: b} has the key a JSON worker computes from {"10": b, "2": a}, so the enqueue check agrees."""
    # v1 sorted the int keys numerically before JSON turned them into strings: the client and worker disagreed.
    value = {2: "a", 10: "b"}
    assert vkey(value) == vkey(kombu_json.loads(kombu_json.dumps(value)))


def test_dict_keys_json_would_merge_are_an_error() -> None:
    """{1: a, "1": b} has two keys that JSON would send as one (losing a value): a clear error, not a guess."""
    with pytest.raises(UnserializableArgumentsError, match=r"both sent as the dict key '1'.*lock_key="):
        vkey({1: "a", "1": "b"})


def test_defaults_given_explicitly_or_omitted_are_one_job() -> None:
    """f(1), f(1, 'current'), f(account_id=1) and every keyword order are one job; another value is another."""
    calls = [((1,), {}), ((1, "current"), {}), ((), {"account_id": 1}), ((), {"month": "current", "account_id": 1})]
    calls += [((1,), {"force": False, "note": None}), ((1, "current"), {"note": None})]
    assert len({lock_key("p:", "t", SIG_V2, a, k) for a, k in calls}) == 1
    others = [((2,), {}), ((1, "last"), {}), ((1,), {"force": True}), ((1,), {"note": ""}), ((1,), {"force": 0})]
    assert len({lock_key("p:", "t", SIG_V2, a, k) for a, k in [*calls[:1], *others]}) == 6


def test_a_default_is_compared_by_the_same_job_rule() -> None:
    """An argument is left out when it is the same job as its default (a tuple for a list default, say)."""

    def f(ids: Any = [1, 2], when: Any = D("1.0")) -> None: ...  # a list default on purpose

    sig = inspect.signature(f)
    plain = lock_key("p:", "t", sig, (), {})
    assert lock_key("p:", "t", sig, ((1, 2), D("1.00")), {}) == plain
    assert lock_key("p:", "t", sig, ([2, 1],), {}) != plain


def test_a_sentinel_default_with_no_canonical_form_still_works() -> None:
    """A default like object() needs no canonical form: passing it is the default, any other value is not."""
    missing = object()

    def f(a: int, b: Any = missing) -> None: ...

    sig = inspect.signature(f)
    assert lock_key("p:", "t", sig, (1,), {}) == lock_key("p:", "t", sig, (1, missing), {})
    assert lock_key("p:", "t", sig, (1,), {}) != lock_key("p:", "t", sig, (1, None), {})


def test_unique_on_keys_on_the_named_arguments_with_defaults_left_out() -> None:
    """lock_unique_on keeps working: named arguments only, a default is left out, an unknown name is an error."""
    only = ["account_id", "force"]
    a = lock_key("p:", "t", SIG_V2, (1, "x"), {}, unique_on=only)
    assert a == lock_key("p:", "t", SIG_V2, (1, "y"), {"force": False}, unique_on=only)
    assert a == lock_key("p:", "t", SIG, (1, "z"), {}, unique_on=["account_id"])  # `force` added later: same key
    assert a != lock_key("p:", "t", SIG_V2, (1, "x"), {"force": True}, unique_on=only)
    with pytest.raises(ConfigurationError, match=r"unknown argument\(s\): \['forse'\]"):
        lock_key("p:", "t", SIG_V2, (1,), {}, unique_on=["account_id", "forse"])


def test_var_positional_and_var_keyword_arguments_are_keyed() -> None:
    """*args and **kwargs take part in the key; passing none of them is the same as omitting them."""

    def f(a: int, *rest: Any, **extra: Any) -> None: ...

    sig = inspect.signature(f)
    k = lock_key("p:", "t", sig, (1,), {})
    assert k == lock_key("p:", "t", sig, (1, *()), {**{}})
    assert k != lock_key("p:", "t", sig, (1, 2), {})
    assert lock_key("p:", "t", sig, (1,), {"x": 1, "y": 2}) == lock_key("p:", "t", sig, (1,), {"y": 2, "x": 1})


def test_custom_key_format_is_unchanged_and_unversioned() -> None:
    """A lock_key= function's string is used as prefix + task name + ':' + string, as in v1 (no ':v2:')."""

    def by_account(account_id: int, **_: Any) -> str:
        return f"acct-{account_id}"

    assert custom_key("p:", "reports.rebuild", by_account, (7,), {"month": "x"}) == "p:reports.rebuild:acct-7"
    with pytest.raises(ConfigurationError, match="must return a non-empty string"):
        custom_key("p:", "t", lambda: "", (), {})


def test_an_object_with_kombu_json_hook_is_keyed_as_what_kombu_sends() -> None:
    """kombu's JSON sends an object with __json__() as that method's result, so the key uses it too."""

    class Money:
        def __init__(self, cents: int) -> None:
            self.cents = cents

        def __json__(self) -> dict[str, Any]:
            return {"cents": self.cents}

    sent = kombu_json.loads(kombu_json.dumps(Money(5)))
    assert sent == {"cents": 5}
    assert vkey(Money(5)) == vkey(sent) != vkey(Money(6))


@pytest.mark.parametrize(
    ("value", "says"),
    [
        (object(), "an argument of type object has no canonical form"),
        (1 + 2j, "an argument of type complex has no canonical form"),
        (Fraction(1, 3), "an argument of type Fraction has no canonical form"),
        ({(1, 2): "x"}, "a dict key of type tuple has no canonical form"),
        ([{"ok": [object()]}], "an argument of type object has no canonical form"),
    ],
    ids=["object", "complex", "fraction", "tuple-key", "nested"],
)
def test_values_with_no_canonical_form_name_their_type_and_the_fix(value: object, says: str) -> None:
    """An argument with no canonical form is an UnserializableArgumentsError naming its type and lock_key=."""
    with pytest.raises(UnserializableArgumentsError) as info:
        key(value)
    message = str(info.value)
    assert says in message
    assert "reports.rebuild" in message
    assert "lock_key=" in message


def test_self_containing_and_absurdly_deep_arguments_are_clear_errors() -> None:
    """A list that contains itself, or nesting deeper than the recursion limit, is an error, not a crash."""
    loop: list[Any] = []
    loop.append(loop)
    deep: list[Any] = []
    for _ in range(sys.getrecursionlimit() + 10):
        deep = [deep]
    for value in (loop, deep):
        with pytest.raises(UnserializableArgumentsError, match="contain themselves or are nested too deeply"):
            key(value)


def test_huge_ints_get_a_key() -> None:
    """An int past Python's 4300-digit str() limit still has a canonical form (pickle can send it)."""
    assert vkey(10**5000) != vkey(10**5000 + 1)


# -- the rule as a model, and properties ------------------------------------------------------------------------------


def json_key(k: Any) -> str:
    """The string JSON sends for a dict key (json.dumps's own rules)."""
    (sent,) = json.loads(json.dumps({k: 0}))
    return sent


def same_job_model(v: Any) -> Any:
    """The documented same-job rule as a value whose == says "one job": a type tag and a normalised value."""
    if v is None or isinstance(v, bool):
        return ("const", v)
    if isinstance(v, int):
        return ("int", int(v))
    if isinstance(v, float):
        return ("float", "nan" if math.isnan(v) else float(v) + 0.0)  # -0.0 + 0.0 is 0.0
    if isinstance(v, str):
        return ("str", str(v))
    if isinstance(v, bytes | bytearray):
        return ("bytes", bytes(v))
    if isinstance(v, list | tuple):
        return ("list", tuple(same_job_model(x) for x in v))
    if isinstance(v, dict):
        return ("dict", frozenset((json_key(k), same_job_model(x)) for k, x in v.items()))
    if isinstance(v, set | frozenset):
        return ("set", frozenset(same_job_model(x) for x in v))
    if isinstance(v, D):
        return ("decimal", str(v) if v.is_nan() else v)
    if isinstance(v, dt.datetime):
        # Aware minus aware is exact and cannot leave datetime's range (astimezone can, near year 1 or 9999).
        return ("instant", v - dt.datetime(1970, 1, 1, tzinfo=UTC)) if v.utcoffset() is not None else ("naive", v)
    if isinstance(v, dt.date):
        return ("date", v)
    if isinstance(v, dt.time):
        offset = v.utcoffset()
        if offset is None:
            return ("time", v)
        since_midnight = dt.timedelta(hours=v.hour, minutes=v.minute, seconds=v.second, microseconds=v.microsecond)
        return ("aware-time", since_midnight - offset)  # Python compares aware times this way, without wrapping
    if isinstance(v, dt.timedelta | uuid.UUID):
        return (type(v).__name__, v)
    if isinstance(v, enum.Enum):
        return ("enum", type(v), same_job_model(v.value))
    if isinstance(v, Point):
        return ("point", v.x, v.y)
    raise AssertionError(f"no model for {v!r}")


# Whole seconds: CPython 3.11's fromisoformat drops an offset's microseconds, so kombu's JSON cannot carry them
# (no real zone has one; LMT offsets with seconds do survive).
fixed_offsets = st.integers(-86399, 86399).map(lambda s: dt.timezone(dt.timedelta(seconds=s)))
keyable_floats = st.floats(allow_nan=True, allow_infinity=True)
# Strings close to each other and to the text of other values (hex digits, tags, lengths) are where a sloppy
# encoding collides; a small alphabet makes hypothesis try them.
tricky_text = st.text(alphabet="06a1b:;[]{}<>@sindE-.", max_size=6) | st.text(max_size=4)
scalars = (
    st.none()
    | st.booleans()
    | st.integers()
    | keyable_floats
    | tricky_text
    | st.binary(max_size=4)
    | st.decimals(allow_nan=True, places=None)
    | st.datetimes(timezones=st.none() | fixed_offsets)
    | st.dates()
    | st.times(timezones=st.none() | fixed_offsets)
    | st.uuids()
    | st.timedeltas()
    | st.sampled_from([*Color, Color.CRIMSON, *Shade, Level.HIGH, Mode.FAST])
    | st.builds(Point, st.integers(-2, 2), st.integers(-2, 2), st.text(max_size=2))
)
hashable_scalars = st.none() | st.booleans() | st.integers() | tricky_text | st.binary(max_size=3) | st.dates()
dict_keys = st.text(max_size=4) | st.integers(-20, 20) | st.booleans() | st.none() | st.floats(allow_nan=False)


def _unambiguous_keys(d: dict[Any, Any]) -> bool:
    """JSON would not merge two of its keys, and it is not kombu's {"__type__", "__value__"} marker."""
    return len({json_key(k) for k in d}) == len(d) and set(d) != {"__type__", "__value__"}


def _containers(children: st.SearchStrategy[Any], keys: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return (
        st.lists(children, max_size=3)
        | st.lists(children, max_size=3).map(tuple)
        | st.dictionaries(keys, children, max_size=3).filter(_unambiguous_keys)
    )


values = st.recursive(
    scalars | st.frozensets(hashable_scalars, max_size=3) | st.sets(hashable_scalars, max_size=3),
    lambda children: _containers(children, dict_keys),
    max_leaves=8,
)


@settings(max_examples=300, deadline=None)
@given(st.lists(values, max_size=12))
def test_distinct_values_get_distinct_keys_and_equal_values_equal_ones(batch: list[Any]) -> None:
    """Over a batch of values, two have one key exactly when the same-job model calls them equal."""
    by_model: dict[Any, str] = {}
    by_key: dict[str, Any] = {}
    for v in batch:
        m, k = same_job_model(v), vkey(v)
        assert by_model.setdefault(m, k) == k, f"one job, two keys: {v!r}"
        assert by_key.setdefault(k, m) == m, f"two jobs, one key: {v!r}"


def _twin(v: Any, draw: Any) -> Any:
    """Another value of the same job: other container type, dict order, offset, exponent, zero sign, label."""
    if isinstance(v, bool) or v is None:
        return v
    if isinstance(v, float):
        return -v if v == 0 else v
    if isinstance(v, D) and v.is_finite():
        return D(v.as_tuple()._replace(digits=(*v.as_tuple().digits, 0), exponent=v.as_tuple().exponent - 1))
    if isinstance(v, dt.datetime) and v.utcoffset() is not None:
        try:
            return v.astimezone(draw(fixed_offsets))
        except OverflowError:  # the instant is not writable in that offset (near year 1 or 9999)
            return v
    if isinstance(v, bytes):
        return bytearray(v)
    if isinstance(v, Point):
        return dataclasses.replace(v, label=v.label + "x")  # a compare=False field: not part of the job
    if isinstance(v, list | tuple):
        items = [_twin(x, draw) for x in v]
        return items if isinstance(v, tuple) else tuple(items)
    if isinstance(v, dict):
        items = [(k, _twin(x, draw)) for k, x in v.items()]
        return dict(draw(st.permutations(items)))
    if isinstance(v, set | frozenset):
        return set(v) if isinstance(v, frozenset) else frozenset(v)
    return v


@settings(max_examples=200, deadline=None)
@given(values, st.data())
def test_a_twin_of_the_same_job_gets_the_same_key(value: Any, data: st.DataObject) -> None:
    """Rewriting a value into an equal one of the same job (tuple/list, offset, exponent...) keeps its key."""
    twin = _twin(value, data.draw)
    assert same_job_model(twin) == same_job_model(value)
    assert vkey(twin) == vkey(value)


# Values that survive kombu's JSON as themselves or as their same-job twin (a tuple as a list, an int dict key as a
# string, an IntEnum as an int): no set, bytearray, timedelta, plain Enum or dataclass, which JSON cannot send.
json_scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(10**30), 10**30)
    | keyable_floats
    | st.text(max_size=6)
    | st.binary(max_size=6)
    | st.decimals(allow_nan=True, places=None)
    | st.datetimes(timezones=st.none() | fixed_offsets)
    | st.dates()
    | st.times(timezones=st.none() | fixed_offsets)
    | st.uuids()
    | st.sampled_from([Level.HIGH, Mode.FAST])
)
json_values = st.recursive(json_scalars, lambda children: _containers(children, dict_keys), max_leaves=10)


def _kombu_json(v: Any) -> Any:
    return kombu_json.loads(kombu_json.dumps(v))


@settings(max_examples=300, deadline=None)
@given(st.lists(json_values, max_size=3), st.dictionaries(st.text(max_size=5), json_values, max_size=3))
def test_the_key_survives_the_kombu_json_round_trip(args: list[Any], kwargs: dict[str, Any]) -> None:
    """The worker's key (arguments after kombu's JSON) equals the client's (the original Python arguments)."""
    client = lock_key("p:", "t", None, args, kwargs)
    assert lock_key("p:", "t", None, _kombu_json(args), _kombu_json(kwargs)) == client


@settings(max_examples=150, deadline=None)
@given(values)
def test_the_key_survives_the_pickle_round_trip(value: Any) -> None:
    """Under the pickle serializer every keyable value arrives as itself, and keeps its key."""
    assert vkey(pickle.loads(pickle.dumps(value))) == vkey(value)


minute_offsets = st.integers(-23 * 60, 23 * 60).map(lambda m: dt.timezone(dt.timedelta(minutes=m)))
yaml_scalars = (
    st.none()
    | st.booleans()
    | st.integers()
    | keyable_floats
    | st.text(alphabet=st.characters(codec="utf-8", exclude_categories=["Cs", "Cc"]), max_size=6)
    | st.binary(max_size=6)
    # yaml writes an offset as +HH:MM: a zone with seconds in its offset cannot be sent at all.
    | st.datetimes(timezones=st.none() | minute_offsets)
    | st.dates()
)
yaml_values = st.recursive(
    yaml_scalars | st.sets(st.integers() | st.text(alphabet="abc", max_size=3), max_size=3),
    lambda children: _containers(children, st.text(alphabet="abc", max_size=3) | st.integers(-9, 9)),
    max_leaves=8,
)


@settings(max_examples=150, deadline=None)
@given(yaml_values)
def test_the_key_survives_the_yaml_round_trip(value: Any) -> None:
    """Under kombu's yaml serializer (safe_dump/safe_load) a value keeps its key."""
    assert vkey(yaml.safe_load(yaml.safe_dump(value))) == vkey(value)


# -- stability: across processes, hash seeds and releases -------------------------------------------------------------

# Run in this process and in a subprocess with another hash seed: set iteration order and str hashes change with
# PYTHONHASHSEED, keys must not. Classes are defined in the snippet so their module name is the same in both.
FIXED_CASES = """
import dataclasses, datetime as dt, decimal, enum, inspect, uuid
from celery_singleton_lock.keys import lock_key

class Color(enum.Enum):
    RED = "red"

@dataclasses.dataclass
class Point:
    x: int
    y: int

def rebuild(account_id, month="current", *, force=False): ...

SIG = inspect.signature(rebuild)
VALUES = {
    "int": 1, "str": "héllo", "float": 2.5, "none": None, "bool": True, "big": 10**40, "list": [1, "a", None],
    "dict": {"b": [1, 2], "a": {"z": 1, "y": 2}}, "int-keys": {3: "c", 1: "a", 20: "b"},
    "set": {"pear", "apple", "fig", "kiwi", "plum"}, "frozenset": frozenset(range(40)),
    "bytes": b"\\x00\\xffab", "decimal": decimal.Decimal("12.50"),
    "aware": dt.datetime(2024, 3, 31, 1, 30, tzinfo=dt.timezone(dt.timedelta(hours=-5))),
    "naive": dt.datetime(2024, 3, 31, 1, 30, 0, 5), "date": dt.date(2024, 2, 29), "time": dt.time(23, 59, 59),
    "timedelta": dt.timedelta(days=1, microseconds=3), "uuid": uuid.UUID("12345678-1234-5678-1234-567812345678"),
    "enum": Color.RED, "dataclass": Point(1, 2),
}
KEYS = {name: lock_key("p:", "t", None, (v,), {}) for name, v in VALUES.items()}
KEYS["call"] = lock_key("singleton_lock:", "reports.rebuild", SIG, (42,), {})
KEYS["call-kw"] = lock_key("singleton_lock:", "reports.rebuild", SIG, (42, "2024-01"), {"force": True})
"""


# A real module (dataclasses look their module up in sys.modules) with one name in both processes.
RUN_FIXED_CASES = """
import sys, types
fixture = sys.modules["keys_fixture"] = types.ModuleType("keys_fixture")
exec(CASES, fixture.__dict__)
"""


def fixed_keys() -> dict[str, str]:
    namespace: dict[str, Any] = {"CASES": FIXED_CASES}
    try:
        exec(RUN_FIXED_CASES, namespace)
        return sys.modules["keys_fixture"].KEYS
    finally:
        sys.modules.pop("keys_fixture", None)


def test_keys_are_the_same_in_another_process_with_another_hash_seed() -> None:
    """A subprocess with another PYTHONHASHSEED computes exactly the keys this process does."""
    script = f"import json\nCASES = {FIXED_CASES!r}\n{RUN_FIXED_CASES}\nprint(json.dumps(fixture.KEYS))"
    here = fixed_keys()
    for seed in ("1", "4242"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True)
        assert json.loads(out.stdout) == here


# Pinned by hand: if one of these changes, the key format changed. Running and new workers would then not see each
# other's locks, so a change here needs a new format version (v3) and a migration note, never a silent edit.
PINNED = {
    "int": "p:t:v2:698eb765eeca7f03a5ba264e370fe148",
    "set": "p:t:v2:e92420734e8f89a9bfb3d78fbd038e40",
    "aware": "p:t:v2:5d3782e6446198817f281a18a9c6cc83",
    "decimal": "p:t:v2:d69f31693d107d7944bd2d0ab73b6ceb",
    "enum": "p:t:v2:1fd38cde01883872218cff6859572442",
    "call": "singleton_lock:reports.rebuild:v2:a7069fdaa005c27ff104c9c8abb72950",
    "call-kw": "singleton_lock:reports.rebuild:v2:5763c1b87cf692866b63448fd0f10ce3",
}


def test_pinned_keys_do_not_change() -> None:
    """A few keys are pinned literally, so an accidental change of the v2 format fails loudly."""
    keys = fixed_keys()
    assert {name: keys[name] for name in PINNED} == PINNED
    # The documented format, by hand: a call with no signature hashes {"args": [1], "kwargs": {}}; rebuild(42)
    # hashes {"account_id": 42} (month and force omitted: they are at their defaults).
    assert PINNED["int"] == "p:t:v2:" + hashlib.sha256(b"{4:args[i1;]6:kwargs{}}").hexdigest()[:32]
    assert PINNED["call"].endswith(":v2:" + hashlib.sha256(b"{10:account_idi2a;}").hexdigest()[:32])


def test_canonical_text_examples() -> None:
    """canonical() is the text that is hashed: a readable, self-delimiting, type-tagged form."""
    assert canonical({"when": dt.date(2024, 1, 31), "ids": (1, 2)}) == "{3:ids[i1;i2;]4:when@date:2024-01-31;}"
    assert canonical({"b", "a"}) == canonical(frozenset({"a", "b"})) == "<s1:as1:b>"
    assert canonical(b"ab") == "b2:ab"
    assert canonical("6162") == "s4:6162"
    assert canonical(D("1.50")) == canonical(D("15E-1")) == "@decimal:15E-1;"


_KINDS = [
    inspect.Parameter.POSITIONAL_ONLY,
    inspect.Parameter.POSITIONAL_OR_KEYWORD,
    inspect.Parameter.VAR_POSITIONAL,
    inspect.Parameter.KEYWORD_ONLY,
    inspect.Parameter.VAR_KEYWORD,
]


@st.composite
def signatures(draw: st.DrawFn) -> inspect.Signature:
    """Valid signatures: kinds in order, at most one of each var kind, no required parameter after a defaulted
    positional one; mostly plain positional-or-keyword parameters (the Binder's fast path)."""
    plain_only = draw(st.booleans())
    kinds = sorted(draw(st.lists(st.sampled_from(_KINDS[1:2] if plain_only else _KINDS), max_size=5)), key=_KINDS.index)
    params: list[inspect.Parameter] = []
    defaulted = False
    seen: set[Any] = set()
    for i, kind in enumerate(kinds):
        if kind in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD):
            if kind in seen:
                continue
            seen.add(kind)
            params.append(inspect.Parameter(f"p{i}", kind))
            continue
        positional = kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
        default = inspect.Parameter.empty
        if draw(st.booleans()) or (positional and defaulted):
            default = draw(st.sampled_from([None, 0, "d"]))
            defaulted = defaulted or positional
        params.append(inspect.Parameter(f"p{i}", kind, default=default))
    return inspect.Signature(params)


@settings(max_examples=400)
@given(signatures(), st.data())
def test_the_binder_binds_every_call_as_signature_bind_does(sig: inspect.Signature, data: st.DataObject) -> None:
    """keys.Binder's fast path (plain parameters) gives ``Signature.bind``'s arguments, or its TypeError."""
    names = [*sig.parameters, "other"]
    count = data.draw(st.integers(0, len(sig.parameters) + 1))
    args = tuple(range(count))
    kwargs = dict.fromkeys(data.draw(st.sets(st.sampled_from(names), max_size=len(names))), -1)
    try:
        expected: dict[str, Any] | type[TypeError] = dict(sig.bind(*args, **kwargs).arguments)
    except TypeError:
        expected = TypeError
    try:
        got: dict[str, Any] | type[TypeError] = Binder(sig).given(args, kwargs)
    except TypeError:
        got = TypeError
    assert got == expected
    if expected is not TypeError:
        assert lock_key("p:", "t", Binder(sig), args, kwargs) == lock_key("p:", "t", sig, args, kwargs)


def test_binder_edge_cases_key_and_fail_as_signature_bind_does() -> None:
    """Review of c6caff2: the fast binding must agree with ``Signature.bind`` (and the key with the old code's)
    where a plain-parameter signature meets an odd call."""

    def f(a: Any, b: Any = 1) -> None: ...

    sig = inspect.signature(f)
    # An argument that IS the Parameter.empty sentinel (pickle, apply()), given for a required parameter: left out,
    # as by the code before the Binder (the keys below are that code's).
    empty = inspect.Parameter.empty
    assert lock_key("p:", "t", sig, (empty,), {}) == "p:t:v2:44136fa355b3678a1146ad16f7e8649e"
    assert lock_key("p:", "t", sig, (empty, 2), {}) == "p:t:v2:90808c318ca9fcf7edf71df993d88bf3"
    # args that are not a tuple or list: bound (or refused) by Signature.bind, with its wording.
    assert lock_key("p:", "t", sig, (x for x in (5,)), {}) == lock_key("p:", "t", sig, (5,), {})
    with pytest.raises(UnserializableArgumentsError, match="must be an iterable, not NoneType"):
        lock_key("p:", "t", sig, None, {})  # type: ignore[arg-type]
    # A hand-built signature with a required parameter after a defaulted one: still "missing a required argument".
    odd = inspect.Signature(
        [
            inspect.Parameter("a", inspect.Parameter.POSITIONAL_OR_KEYWORD, default=1),
            inspect.Parameter("b", inspect.Parameter.POSITIONAL_OR_KEYWORD),
        ],
        __validate_parameters__=False,
    )
    with pytest.raises(UnserializableArgumentsError, match="missing a required argument: 'b'"):
        lock_key("p:", "t", odd, (5,), {})
