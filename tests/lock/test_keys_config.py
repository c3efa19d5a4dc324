"""Lock keys from task calls (keys.py) and the ``singleton_lock_*`` settings (config.py): pure logic, in-process.

No Redis is needed: building a NodeSet from URLs does not connect.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import decimal
import enum
import inspect
import logging
import uuid
from typing import Any

import pytest
from celery import Celery
from hypothesis import given, settings
from hypothesis import strategies as st

from celery_singleton_lock import LockedTask
from celery_singleton_lock.errors import ConfigurationError, LockError, UnserializableArgumentsError
from celery_singleton_lock.lock.config import DEFAULT_TTL, LockSettings, settings_for, settings_from
from celery_singleton_lock.lock.keys import canonical, lock_key

DEAD_URL = "redis://127.0.0.1:1/0"  # never contacted: settings and keys do no I/O


def rebuild(account_id: int, month: str = "current") -> None: ...


SIG = inspect.signature(rebuild)


def key(*args: Any, **kwargs: Any) -> str:
    return lock_key("p:", "reports.rebuild", SIG, args, kwargs)


# -- keys: binding -------------------------------------------------------------------------------------------------


def test_positional_keyword_and_default_calls_share_one_key() -> None:
    """f(1), f(1, 'current'), f(account_id=1) and f(month='current', account_id=1) are one job."""
    assert key(1) == key(1, "current") == key(account_id=1) == key(month="current", account_id=1)
    assert key(1).startswith("p:reports.rebuild:v2:")


def test_different_arguments_give_different_keys() -> None:
    """Another account, another month or another task name is another job."""
    keys = {
        key(1),
        key(2),
        key(1, "last"),
        lock_key("p:", "reports.other", SIG, (1,), {}),
        lock_key("q:", "reports.rebuild", SIG, (1,), {}),
    }
    assert len(keys) == 5


def test_dict_order_does_not_matter() -> None:
    """Dicts in the arguments, and the keyword arguments themselves, give one key whatever their order."""
    a = {"x": 1, "y": {"p": [1, 2], "q": None}}
    b = {"y": {"q": None, "p": [1, 2]}, "x": 1}
    assert key(a) == key(b)
    assert key(account_id=a, month="m") == key(month="m", account_id=b)
    assert key({"x": [1, 2]}) != key({"x": [2, 1]})  # list order does matter


def test_signature_mismatch_is_a_clear_error() -> None:
    """Arguments that do not fit the signature raise UnserializableArgumentsError naming the task."""
    with pytest.raises(UnserializableArgumentsError, match=r"reports\.rebuild.*do not match its signature"):
        key(1, "m", "extra")


def test_no_signature_keys_on_args_and_kwargs_as_given() -> None:
    """Without a usable signature the key is built from the positional and keyword arguments as given."""
    k = lock_key("p:", "t", None, (1,), {"b": 2, "a": 1})
    assert k == lock_key("p:", "t", None, (1,), {"a": 1, "b": 2})
    assert k != lock_key("p:", "t", None, (), {"x": 1, "a": 1, "b": 2})


def test_unique_on_keys_on_the_named_arguments_only() -> None:
    """lock_unique_on picks the arguments that make two calls one job; an unknown name is a ConfigurationError."""
    assert lock_key("p:", "t", SIG, (1, "a"), {}, unique_on=["account_id"]) == lock_key(
        "p:", "t", SIG, (1, "b"), {}, unique_on=["account_id"]
    )
    with pytest.raises(ConfigurationError, match="acount_id"):
        lock_key("p:", "t", SIG, (1,), {}, unique_on=["acount_id"])


# -- keys: bound tasks ---------------------------------------------------------------------------------------------


@pytest.fixture
def app() -> Celery:
    app = Celery("keys_test", broker="memory://", set_as_current=False)
    app.conf.singleton_lock_urls = DEAD_URL
    return app


def test_bound_task_key_leaves_self_out(app: Celery) -> None:
    """A bind=True task's key ignores `self`: LockedTask passes keys.lock_key the signature of the bound run()."""

    @app.task(bind=True, base=LockedTask, name="reports.rebuild", shared=False)
    def bound(self: Any, account_id: int, month: str = "current") -> None: ...

    # How: keys.lock_key binds to whatever signature it is given; LockedTask gives it inspect.signature(self.run),
    # the signature of a bound method, which has no `self`.
    assert list(inspect.signature(bound.run).parameters) == ["account_id", "month"]
    assert bound.lock_key_for(1) == bound.lock_key_for(account_id=1) == bound.lock_key_for(1, "current")
    # Same name and parameters as the plain function: the same key, so `self` contributed nothing.
    assert bound.lock_key_for(1) == lock_key("singleton_lock:", "reports.rebuild", SIG, (1,), {})
    # The unbound function's signature would still have `self`: the caller must pass the bound one.
    unbound = inspect.signature(bound.run.__func__)
    assert next(iter(unbound.parameters)) == "self"
    with pytest.raises(UnserializableArgumentsError):
        lock_key("p:", "reports.rebuild", unbound, (), {"account_id": 1})


# -- keys: unserialisable and huge arguments ------------------------------------------------------------------------


class Color(enum.Enum):
    RED = "red"


@dataclasses.dataclass
class Point:
    x: int
    y: int


@pytest.mark.parametrize(
    ("value", "says"),
    [
        (object(), "an argument of type object has no canonical form"),
        (lambda: 1, "an argument of type function has no canonical form"),
        ({(1, 2): "tuple key"}, "a dict key of type tuple has no canonical form"),
        ({1: "a", "1": 2}, "both sent as the dict key '1' by JSON"),
    ],
    ids=["object", "function", "tuple-key", "keys-json-would-merge"],
)
def test_unserialisable_arguments_raise_a_clear_error(value: object, says: str) -> None:
    """An argument with no canonical form raises UnserializableArgumentsError saying what and how to fix it."""
    with pytest.raises(UnserializableArgumentsError) as info:
        key(value)
    message = str(info.value)
    assert says in message
    assert "reports.rebuild" in message
    assert "lock_key=" in message
    assert "of type keys" not in message
    assert "of type '<'" not in message
    assert isinstance(info.value, TypeError)
    assert isinstance(info.value, LockError)


def test_circular_argument_is_a_clear_error() -> None:
    """A self-containing list raises UnserializableArgumentsError, not a RecursionError or ValueError."""
    loop: list[Any] = []
    loop.append(loop)
    with pytest.raises(UnserializableArgumentsError, match="contain themselves"):
        key(loop)


def test_non_json_types_have_one_fixed_form() -> None:
    """UUID, datetime, Decimal, set, bytes, Enum and dataclass arguments give stable keys of their own type."""
    # Sets ignore order and equal Decimals are one job; the full rule: docs/keys.md and tests/lock/test_keys_v2.py.
    u = uuid.UUID("12345678-1234-5678-1234-567812345678")
    when = dt.datetime(2024, 1, 2, 3, 4, 5, tzinfo=dt.timezone.utc)
    values = [u, when, decimal.Decimal("1.10"), {1, 9}, b"\x00\xff", Color.RED, Point(1, 2), dt.timedelta(1)]
    # The same values built again, each a new object made another way: {9, 1} iterates in another order than
    # {1, 9} (they share a hash slot), the datetime is the same instant in another zone.
    again = [
        uuid.UUID(str(u)),
        dt.datetime(2024, 1, 2, 5, 4, 5, tzinfo=dt.timezone(dt.timedelta(hours=2))),
        decimal.Decimal("1.1") + decimal.Decimal("0.00"),
        {9, 1},
        bytes(bytearray([0, 255])),
        Color("red"),
        Point(*[1, 2]),
        dt.timedelta(hours=24),
    ]
    assert list(values[3]) != list(again[3])  # the set case above tests what it says
    assert [key(v) for v in values] == [key(v) for v in again]
    assert len({key(v) for v in values}) == len(values)
    assert canonical({"b", "a", "c"}) == canonical({"c", "a", "b"}) == "<s1:as1:bs1:c>"
    assert canonical(Point(1, 2)) == f"@dataclass:{len(__name__) + 6}:{__name__}.Point{{1:xi1;1:yi2;}}"
    assert key(decimal.Decimal("1.10")) == key(decimal.Decimal("1.1"))


def test_lone_surrogate_argument_gets_a_key() -> None:
    """A str with a lone surrogate (possible after JSON decoding) still gets a key, distinct from its neighbour."""
    assert key("\ud800") != key("\ud801")


def test_key_length_is_bounded_for_huge_arguments() -> None:
    """Megabytes of arguments still give a key of prefix + name + ':v2:' + 32 hex digits."""
    huge = key("x" * 1_000_000, "y" * 100_000)
    many = key(list(range(100_000)))
    for k in (huge, many, key(1)):
        assert len(k) == len("p:reports.rebuild:v2:") + 32
    assert huge != key("x" * 999_999, "y" * 100_000)


# -- keys: properties ----------------------------------------------------------------------------------------------

json_scalars = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8)
json_values = st.recursive(
    json_scalars,
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=6), children, max_size=4),
    max_leaves=12,
)


@settings(max_examples=200, deadline=None)
@given(st.dictionaries(st.text(max_size=8), json_values, max_size=8).flatmap(
    lambda d: st.tuples(st.just(d), st.permutations(list(d.items())))
))  # fmt: skip
def test_canonical_ignores_dict_insertion_order(case: tuple[dict[str, Any], list[tuple[str, Any]]]) -> None:
    """canonical() of a dict equals canonical() of the same dict built in any other insertion order."""
    original, shuffled = case
    assert canonical(original) == canonical(dict(shuffled))


@settings(max_examples=100, deadline=None)
@given(st.dictionaries(st.text(max_size=8), json_values, max_size=6), st.randoms(use_true_random=False))
def test_lock_key_ignores_nested_dict_order(value: dict[str, Any], rnd: Any) -> None:
    """A nested dict argument rebuilt in shuffled order at every level gives the same lock key."""

    def shuffle(v: Any) -> Any:
        if isinstance(v, dict):
            items = list(v.items())
            rnd.shuffle(items)
            return {k: shuffle(x) for k, x in items}
        if isinstance(v, list):
            return [shuffle(x) for x in v]
        return v

    assert key(value) == key(shuffle(value))


# -- config ----------------------------------------------------------------------------------------------------------

SECRET = "s3cret"


def test_defaults_from_a_redis_broker_are_logged_redacted(caplog: pytest.LogCaptureFixture) -> None:
    """Without singleton_lock_urls a Redis broker is used; the log line and repr hide its password."""
    broker = f"redis://:{SECRET}@127.0.0.1:1/0"
    with caplog.at_level(logging.INFO, logger="celery_singleton_lock.config"):
        s = settings_from({"broker_url": broker})
    assert s.urls == (broker,)
    assert s.ttl == DEFAULT_TTL
    assert "singleton_lock_urls is not set" in caplog.text
    assert SECRET not in caplog.text
    assert SECRET not in repr(s)
    assert SECRET not in s.describe()
    assert "redis://:***@127.0.0.1:1/0" in repr(s)


def test_a_broker_given_by_celery_broker_url_holds_the_locks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Celery takes the broker from ``CELERY_BROKER_URL`` when the app sets none (``app.conf.broker_url`` reads it):
    the locks fall back to that broker too. (Found running pytest-celery's worker containers, whose broker comes
    from that variable: the worker refused to start, "the broker None is not Redis".)"""
    broker = "redis://127.0.0.1:1/3"
    monkeypatch.setenv("CELERY_BROKER_URL", broker)
    app = Celery("env_broker", set_as_current=False)
    app.config_from_object({"worker_prefetch_multiplier": 1})
    assert settings_for(app).urls == (broker,)


def test_urls_as_a_comma_separated_string() -> None:
    """A comma-separated string of URLs is a list of nodes, with a majority quorum."""
    s = settings_from({"singleton_lock_urls": "redis://127.0.0.1:1/0, redis://127.0.0.1:2/0,redis://127.0.0.1:3/0"})
    assert s.urls == ("redis://127.0.0.1:1/0", "redis://127.0.0.1:2/0", "redis://127.0.0.1:3/0")
    assert s.nodes.quorum == 2


def test_unknown_setting_lists_the_known_ones() -> None:
    """A misspelt singleton_lock_* setting is an error naming it and listing every known setting."""
    with pytest.raises(ConfigurationError) as info:
        settings_from({"singleton_lock_urls": DEAD_URL, "singleton_lock_tll": 30})
    message = str(info.value)
    assert "singleton_lock_tll" in message
    for known in ("singleton_lock_ttl", "singleton_lock_urls", "singleton_lock_on_duplicate"):
        assert known in message


@pytest.mark.parametrize("prefix", ["singleton_lock:", "app:", "{locks}app:", "{locks}:", "a.b-c_d:"])
def test_a_prefix_with_one_colon_at_its_end_is_accepted(prefix: str) -> None:
    """Prefixes that cannot nest in another app's (one ':', ending them; a leading hash tag) are accepted as given."""
    assert settings_from({"singleton_lock_urls": DEAD_URL, "singleton_lock_prefix": prefix}).prefix == prefix


def test_celery_singleton_setting_says_what_to_use_instead() -> None:
    """An app migrating from celery-singleton with singleton_lock_expiry set is told to use singleton_lock_ttl."""
    with pytest.raises(ConfigurationError, match=r"celery-singleton's setting: use singleton_lock_ttl"):
        settings_from({"singleton_lock_urls": DEAD_URL, "singleton_lock_expiry": 60})


@pytest.mark.parametrize(
    ("setting", "value", "says"),
    [
        ("singleton_lock_ttl", 0, "singleton_lock_ttl must be a number of seconds > 0.1"),
        ("singleton_lock_ttl", -5, "singleton_lock_ttl must be"),
        ("singleton_lock_ttl", "60", "singleton_lock_ttl must be"),
        ("singleton_lock_ttl", True, "singleton_lock_ttl must be"),
        ("singleton_lock_on_duplicate", "ignore", "'skip', 'fail', 'reschedule'"),
        ("singleton_lock_on_unavailable", "panic", "'retry', 'fail', 'run'"),
        ("singleton_lock_socket_timeout", 0, "singleton_lock_socket_timeout must be"),
        ("singleton_lock_renew_fraction", 1, "between 0 and 1"),
        ("singleton_lock_max_retries", -1, "singleton_lock_max_retries must be"),
        ("singleton_lock_prefix", 3, "singleton_lock_prefix must be a string"),
        ("singleton_lock_prefix", "a:b:", "must hold one ':', at its end"),
        ("singleton_lock_prefix", "locks", "must hold one ':', at its end"),
        ("singleton_lock_prefix", "{a:b}c:", "use e.g. 'a-b-c:'"),
        ("singleton_lock_prefix", "{a:", "braces only as a leading hash tag"),
        ("singleton_lock_skip_before_pool", "yes", "singleton_lock_skip_before_pool must be True or False"),
        ("singleton_lock_hand_on", "no", "singleton_lock_hand_on must be True or False"),
    ],
)
def test_invalid_values_say_what_to_change(setting: str, value: object, says: str) -> None:
    """A bad value raises ConfigurationError naming the setting and what it must be, never the password."""
    with pytest.raises(ConfigurationError) as info:
        settings_from({"singleton_lock_urls": f"redis://:{SECRET}@127.0.0.1:1/0", setting: value})
    assert says in str(info.value)
    assert SECRET not in str(info.value)


@pytest.mark.parametrize(
    "broker",
    [f"amqp://guest:{SECRET}@rabbit:5672//", f"amqp://guest:{SECRET}@rabbit:notaport//", None],
    ids=["amqp", "amqp-bad-port", "none"],
)
def test_non_redis_broker_without_urls_says_to_set_them(broker: str | None) -> None:
    """A non-Redis broker and no singleton_lock_urls: the error says to set them, password redacted."""
    with pytest.raises(ConfigurationError) as info:
        settings_from({"broker_url": broker})
    assert "set app.conf.singleton_lock_urls" in str(info.value)
    assert SECRET not in str(info.value)


@pytest.mark.parametrize(
    "urls",
    [
        f"http://user:{SECRET}@127.0.0.1:6379/0",
        [f"redis://:{SECRET}@127.0.0.1:1/0", f"redis://:{SECRET}@127.0.0.1:1/0"],
        f"redis://:{SECRET}@127.0.0.1:notaport/0",
        [],
        [f"redis://:{SECRET}@127.0.0.1:1/0", 5],
    ],
    ids=["http", "duplicate", "bad-port", "empty", "not-a-string"],
)
def test_bad_urls_are_configuration_errors_without_the_password(urls: object) -> None:
    """Bad singleton_lock_urls raise ConfigurationError saying what is wrong; no message carries the password."""
    with pytest.raises(ConfigurationError) as info:
        settings_from({"singleton_lock_urls": urls})
    assert SECRET not in str(info.value)
    assert SECRET not in repr(info.value)


def test_a_node_that_is_neither_a_url_nor_a_client_is_named_with_the_url_form_to_use() -> None:
    """An item of singleton_lock_urls that is no URL and no client Redlock takes (an asyncio client) is refused by
    its index, naming the URL forms (the redis+cluster:// one too) and the clients that are taken."""
    from redis.asyncio import Redis as AsyncRedis  # noqa: PLC0415 - only this test needs it

    with pytest.raises(ConfigurationError) as info:
        settings_from({"singleton_lock_urls": [DEAD_URL, AsyncRedis(port=1)]})
    said = str(info.value)
    assert said.startswith("singleton_lock_urls[1] must be a Redis URL (e.g. 'redis://127.0.0.1:6379/0', ")
    assert "'redis+cluster://127.0.0.1:7000' for a Redis Cluster" in said
    assert said.endswith("or a redis.Redis or redis.cluster.RedisCluster client, got redis.asyncio.client.Redis")
    with pytest.raises(ConfigurationError, match="got dict"):
        settings_from({"singleton_lock_urls": {"url": DEAD_URL}})


def test_settings_are_read_once_and_cached_on_the_app(app: Celery) -> None:
    """settings_for validates on first use and returns the same object afterwards."""
    first = settings_for(app)
    assert isinstance(first, LockSettings)
    assert settings_for(app) is first
    assert first.urls == (DEAD_URL,)
