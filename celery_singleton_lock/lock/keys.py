"""A task call -> a lock key, and the holder token stored under it.

Key format v2: ``prefix + task_name + ":v2:" + 32 hex digits``, the digits a SHA-256 of the canonical text of
the call's arguments (see docs/keys.md). Two calls are **the same job** when their arguments are equal values of
one type, after the few merges a message serializer forces (a tuple is a list, a dict key is the string JSON sends).
Arguments are bound to the function's signature by name, and an argument equal to its declared default is left
out, so ``f(1)``, ``f(1, "current")`` and ``f(account_id=1)`` are one job, and adding a parameter with a default
changes no existing key; a bound task's ``self`` is left out:

>>> def rebuild(account_id, month="current"): ...
>>> sig = inspect.signature(rebuild)
>>> a = lock_key("p:", "reports.rebuild", sig, (1,), {})
>>> a == lock_key("p:", "reports.rebuild", sig, (), {"account_id": 1, "month": "current"})
True
>>> a
'p:reports.rebuild:v2:...'
>>> canonical({"when": dt.date(2024, 1, 31), "ids": (1, 2)})
'{3:ids[i1;i2;]4:when@date:2024-01-31;}'
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import decimal
import enum
import hashlib
import inspect
import socket
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from ..errors import ConfigurationError, UnserializableArgumentsError

__all__ = ["canonical", "lock_key"]

_HOST = socket.gethostname()

# The generated keys' format. Any change to what counts as one job, to the canonical text or to the hash needs a
# new version here (and a migration note in docs/keys.md): keys of two versions never see each other's locks.
KEY_FORMAT = "v2"

_EMPTY = inspect.Parameter.empty
_ONE_MICROSECOND = dt.timedelta(microseconds=1)
_EPOCH = dt.datetime(1970, 1, 1)
# Exact types whose own == is already the same-job rule (no subclass, no float: 0.0 == -0.0 but NaN != NaN).
_PLAIN = frozenset({str, int, bool, bytes, type(None)})


class _NoCanonicalForm(TypeError):
    """A value with no canonical form; the message says which (an argument's type, a dict key's type...)."""


# The canonical text is a prefix-free code: every value is one tag character (or an ``@name:`` tag) followed by a
# payload that is either self-delimiting (a length, a closing bracket) or ends at a ";" it cannot contain. So the
# text can be read back one way only, and two values have one text only when the rule calls them one job.
#
#   n t f                None True False             i<hex>;           int (and int subclasses: IntEnum...)
#   d<repr>;             float, 0.0 for -0.0, nan    s<len>:<text>     str (and str subclasses: StrEnum...)
#   b<len>:<latin-1>     bytes, bytearray            [<item>...]       list, tuple (JSON sends a tuple as a list)
#   {<len>:<key><value>...}   dict, keys sorted as the strings JSON sends for them
#   <<item>...>          set, frozenset: items' texts sorted, each once
#   @decimal:<digits>E<exp>;  @datetime-utc:<us>;  @datetime:<iso>;  @date:<iso>;  @time-utc:<us>;  @time:<iso>;
#   @timedelta:<d>,<s>,<us>;  @uuid:<hex>;  @enum:<len>:<module.qualname><value>  @dataclass:<len>:<name>{...}
def _encode(value: Any, out: list[str]) -> None:
    """Append the canonical text of ``value`` to ``out``; raise _NoCanonicalForm for a value with none."""
    # Exact types first, by identity: the hot path is a handful of ints and strs.
    t = type(value)
    if t is str:
        out.append(f"s{len(value)}:{value}")
    elif t is int:
        out.append(f"i{value:x};")  # hex: not subject to the 4300-digit limit of str(int)
    elif t is bool:
        out.append("t" if value else "f")
    elif value is None:
        out.append("n")
    elif t is list or t is tuple:
        out.append("[")
        _encode_items(value, out)
        out.append("]")
    elif t is dict:
        _encode_dict(value, out)
    elif t is float:
        out.append(_float(value))
    else:
        _encode_other(value, out)


def _encode_items(items: Iterable[Any], out: list[str]) -> None:
    """_encode() of each item, with ints and strs inline (a long list of them spends its time in calls)."""
    append = out.append
    for item in items:
        t = type(item)
        if t is int:
            append(f"i{item:x};")
        elif t is str:
            append(f"s{len(item)}:{item}")
        else:
            _encode(item, out)


def _float(value: float) -> str:
    if value != value:  # noqa: PLR0124 - NaN: never equal to itself, yet one job with itself
        return "dnan;"
    if value == 0:  # 0.0 == -0.0
        return "d0.0;"
    return f"d{float.__repr__(value)};"  # shortest round-trip repr: one text per float, on every platform


def _json_key(key: Any) -> str:
    """The string JSON sends for a dict key: a worker behind the JSON serializer only ever sees that string."""
    if isinstance(key, str):
        return str.__str__(key)
    if key is None:
        return "null"
    if key is True:
        return "true"
    if key is False:
        return "false"
    if isinstance(key, int):
        return int.__repr__(key)
    if isinstance(key, float):
        if key != key:  # noqa: PLR0124 - NaN
            return "NaN"
        if key in (float("inf"), float("-inf")):
            return "Infinity" if key > 0 else "-Infinity"
        return float.__repr__(key)
    raise _NoCanonicalForm(
        f"a dict key of type {type(key).__name__} has no canonical form (JSON sends only str, int, float, bool and "
        f"None keys, as strings)"
    )


def _encode_dict(value: Mapping[Any, Any], out: list[str]) -> None:
    items = list(value.items())
    if not all(type(k) is str for k, _ in items):
        keys = [_json_key(k) for k, _ in items]
        if len(set(keys)) < len(keys):
            seen: dict[str, Any] = {}
            for (original, _), sent in zip(items, keys, strict=True):
                if sent in seen:
                    raise _NoCanonicalForm(
                        f"a dict has the keys {seen[sent]!r} and {original!r}, both sent as the dict key {sent!r} "
                        f"by JSON (one value would be lost)"
                    )
                seen[sent] = original
        items = [(k, v) for k, (_, v) in zip(keys, items, strict=True)]
    # Keys are unique strs here, so the sort never compares two values.
    items.sort(key=_first)
    append = out.append
    append("{")
    for k, v in items:
        append(f"{len(k)}:{k}")
        t = type(v)  # ints and strs inline, as in _encode_items
        if t is str:
            append(f"s{len(v)}:{v}")
        elif t is int:
            append(f"i{v:x};")
        else:
            _encode(v, out)
    append("}")


def _first(item: tuple[str, Any]) -> str:
    return item[0]


def _encode_other(value: Any, out: list[str]) -> None:
    """Subclasses of the JSON types, then the types kombu's JSON, pickle or yaml carry, then an error."""
    # Subclasses of JSON's types travel as their base type under JSON (an IntEnum as its int, a str-mixin Enum as
    # its str, a namedtuple as a list) and compare equal to it: key them as the base type.
    if isinstance(value, str):
        out.append(f"s{len(value)}:{str.__str__(value)}")
    elif isinstance(value, int):
        out.append(f"i{int.__index__(value):x};")
    elif isinstance(value, float):
        out.append(_float(float.__float__(value)))
    elif isinstance(value, dict):
        _encode_dict(value, out)
    elif isinstance(value, list | tuple):
        _encode(list(value), out)
    # kombu's JSON sends an object with __json__() as that method's result (checked before its own types).
    elif callable(reducer := getattr(value, "__json__", None)):
        _encode(reducer(), out)
    elif isinstance(value, dt.datetime):  # before date: a datetime is a date
        offset = value.utcoffset()
        if offset is None:  # naive: its wall-clock digits, never equal to an aware instant
            out.append(f"@datetime:{dt.datetime.isoformat(value)};")
        else:  # aware: the UTC instant (microseconds since 1970-01-01 UTC), whatever the zone or offset
            # Timedelta arithmetic, not a UTC datetime: that could leave datetime's range (year 1 at +01:00).
            since = dt.datetime.replace(value, tzinfo=None) - _EPOCH - offset
            out.append(f"@datetime-utc:{since // _ONE_MICROSECOND};")
    elif isinstance(value, dt.date):
        out.append(f"@date:{dt.date.isoformat(value)};")
    elif isinstance(value, dt.time):
        offset = value.utcoffset()
        if offset is None:
            out.append(f"@time:{dt.time.isoformat(value)};")
        else:  # Python's == for aware times: time of day minus offset, in microseconds (may leave 0..24h)
            of_day = ((value.hour * 60 + value.minute) * 60 + value.second) * 1_000_000 + value.microsecond
            out.append(f"@time-utc:{of_day - offset // _ONE_MICROSECOND};")
    elif isinstance(value, dt.timedelta):
        out.append(f"@timedelta:{value.days},{value.seconds},{value.microseconds};")
    elif isinstance(value, decimal.Decimal):
        out.append(f"@decimal:{_decimal(value)};")
    elif isinstance(value, uuid.UUID):
        out.append(f"@uuid:{value.hex};")
    elif isinstance(value, bytes | bytearray):
        out.append(f"b{len(value)}:{value.decode('latin-1')}")  # latin-1: one char per byte, any byte
    elif isinstance(value, set | frozenset):
        texts = set()
        for item in value:
            part: list[str] = []
            _encode(item, part)
            texts.add("".join(part))
        out.append("<")
        out.extend(sorted(texts))  # sorted texts, not items: set iteration order changes with the hash seed
        out.append(">")
    elif isinstance(value, enum.Enum):  # a plain Enum (int and str mixins were keyed above as their value)
        name = f"{type(value).__module__}.{type(value).__qualname__}"
        out.append(f"@enum:{len(name)}:{name}")
        _encode(value.value, out)
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        name = f"{type(value).__module__}.{type(value).__qualname__}"
        # The fields its == compares (compare=True), so equal instances are one job.
        fields = {f.name: getattr(value, f.name) for f in dataclasses.fields(value) if f.compare}
        out.append(f"@dataclass:{len(name)}:{name}")
        _encode_dict(fields, out)
    else:
        raise _NoCanonicalForm(f"an argument of type {type(value).__name__} has no canonical form")


def _decimal(value: decimal.Decimal) -> str:
    """Equal Decimals -> one text: 1.0, 1.00, 1E0 -> '1E0'; 0 and -0 -> '0'. Exact: no context, no rounding."""
    if not value.is_finite():
        return str(value)  # Infinity, -Infinity, NaN, sNaN (with sign and payload: NaN is one job with itself)
    if not value:
        return "0"
    sign, digits, exponent = value.as_tuple()
    text = "".join(map(str, digits))
    stripped = text.rstrip("0")
    return f"{'-' if sign else ''}{stripped}E{int(exponent) + len(text) - len(stripped)}"


def canonical(value: Any) -> str:
    """The canonical text of ``value`` (format v2): equal for two values of one job, different otherwise.

    Raises TypeError (or ValueError, RecursionError) for a value with no canonical form.
    """
    out: list[str] = []
    _encode(value, out)
    return "".join(out)


def _is_default(value: Any, default: Any) -> bool:
    """Whether an argument is the same job as its parameter's declared default (then it is left out of the key)."""
    if value is default:
        return True
    if default is _EMPTY:
        return False
    kind = type(value)
    if kind is type(default) and kind in _PLAIN:
        return bool(value == default)
    try:
        return canonical(value) == canonical(default)
    except (TypeError, ValueError, OverflowError, RecursionError):
        # A default with no canonical form (a sentinel object()) is the same job only as itself; a value with none
        # is reported when the arguments are encoded.
        return False


class Binder:
    """A signature, with what binding a call to it needs, worked out once (a task builds one per process).

    :meth:`given` is ``signature.bind(*args, **kwargs).arguments`` as a dict. For a signature of plain parameters
    only (positional-or-keyword: the usual task), a call whose arguments fit is bound here in a few dict operations;
    anything else (``*args``, keyword-only or positional-only parameters, a call that does not fit) goes through
    ``Signature.bind``, which also words the error. ``Signature.bind`` is most of a key's cost on a worker.
    """

    __slots__ = ("_index", "_names", "_required", "defaults", "signature")

    def __init__(self, signature: inspect.Signature) -> None:
        self.signature = signature
        parameters = signature.parameters
        self.defaults: dict[str, Any] = {name: p.default for name, p in parameters.items()}
        plain = all(p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD for p in parameters.values())
        self._required = tuple(name for name, p in parameters.items() if p.default is _EMPTY)
        # The fast path counts on the required parameters coming first, as Python makes them (a signature built by
        # hand may skip that check).
        plain = plain and tuple(parameters)[: len(self._required)] == self._required
        self._names: tuple[str, ...] | None = tuple(parameters) if plain else None
        self._index = {name: i for i, name in enumerate(parameters)}

    def given(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> dict[str, Any]:
        """The arguments given, by parameter name; raises TypeError (``Signature.bind``'s) when they do not fit."""
        names = self._names
        if names is not None and type(args) in (tuple, list) and len(args) <= len(names):
            out = dict(zip(names, args, strict=False))
            fits = True
            if kwargs:
                index, count = self._index, len(args)
                for name, value in kwargs.items():
                    if index.get(name, -1) < count:  # unknown, or given positionally too
                        fits = False
                        break
                    out[name] = value
            if fits and (len(args) >= len(self._required) or all(n in out for n in self._required)):
                return out
        return dict(self.signature.bind(*args, **kwargs).arguments)


def lock_key(
    prefix: str,
    task_name: str,
    signature: inspect.Signature | Binder | None,
    args: Sequence[Any],
    kwargs: Mapping[str, Any],
    *,
    unique_on: Sequence[str] | None = None,
) -> str:
    """``prefix + task_name + ':v2:' + hash`` of the call's bound arguments (only ``unique_on`` ones, if given).

    An argument equal to its parameter's default (by the same-job rule) is left out, as an omitted one is.
    """
    if signature is not None:
        binder = signature if isinstance(signature, Binder) else Binder(signature)
        try:
            given = binder.given(args, kwargs)
        except TypeError as exc:
            raise UnserializableArgumentsError(
                f"cannot build the lock key of {task_name}: arguments do not match its signature ({exc})"
            ) from None
        # No apply_defaults(): bound.arguments holds the arguments actually given, and a given one equal to its
        # default is dropped too. So a parameter added later with a default changes no existing key, and old and
        # new workers of a rolling deploy agree on every job.
        defaults = binder.defaults
        if unique_on is not None:
            missing = [n for n in unique_on if n not in defaults]
            if missing:
                raise ConfigurationError(f"lock_unique_on of {task_name} names unknown argument(s): {missing}")
            given = {n: given[n] for n in unique_on if n in given}
        arguments: dict[str, Any] = {
            name: value for name, value in given.items() if not _is_default(value, defaults[name])
        }
    else:  # no usable signature (e.g. a C function): positional and keyword arguments as given
        arguments = {"args": list(args), "kwargs": dict(kwargs)}
    out: list[str] = []
    try:
        _encode_dict(arguments, out)
    except (TypeError, ValueError, OverflowError, RecursionError) as exc:
        if isinstance(exc, _NoCanonicalForm):
            what = str(exc)
        elif isinstance(exc, RecursionError):
            what = "the arguments contain themselves or are nested too deeply to have a canonical form"
        else:
            what = f"the arguments have no canonical form ({exc})"
        raise UnserializableArgumentsError(
            f"cannot build the lock key of {task_name}: {what}; pass JSON-like values (see docs/keys.md for the "
            f"types with a canonical form), or set lock_key= (a function returning a string) on the task"
        ) from None
    # surrogatepass: a JSON message may carry a lone surrogate ("\ud800"), a str that strict UTF-8 cannot encode.
    digest = hashlib.sha256("".join(out).encode("utf-8", "surrogatepass")).hexdigest()[:32]
    return f"{prefix}{task_name}:{KEY_FORMAT}:{digest}"


def custom_key(prefix: str, task_name: str, fun: Callable[..., Any], args: Sequence[Any], kw: Mapping[str, Any]) -> str:
    """The key from a user's ``lock_key`` function, which receives the task's own arguments.

    ``prefix + task_name + ':' + value``, unversioned on purpose: the function, not the library, decides what is
    one job, so a new key format leaves these keys as they are. Version the returned string yourself if you change
    the function (docs/keys.md).
    """
    value = fun(*args, **kw)
    if not isinstance(value, str) or not value:
        raise ConfigurationError(f"lock_key of {task_name} must return a non-empty string, got {value!r}")
    return f"{prefix}{task_name}:{value}"
