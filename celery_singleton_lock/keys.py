"""A task call -> a lock key, and the holder token stored under it.

The key binds the call's arguments to the function's signature with defaults applied, so ``f(1)``,
``f(1, "current")`` and ``f(account_id=1)`` are one job; a bound task's ``self`` is left out. The bound
arguments are encoded canonically (sorted keys, no whitespace; UUID, datetime, Decimal, set, bytes, Enum and
dataclasses have one fixed form each) and hashed, so a key has a bounded length whatever the arguments:

>>> def rebuild(account_id, month="current"): ...
>>> sig = inspect.signature(rebuild)
>>> a = lock_key("p:", "reports.rebuild", sig, (1,), {})
>>> a == lock_key("p:", "reports.rebuild", sig, (), {"account_id": 1, "month": "current"})
True
>>> a
'p:reports.rebuild:...'
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import decimal
import enum
import hashlib
import inspect
import json
import os
import secrets
import socket
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

from .errors import ConfigurationError, UnserializableArgumentsError

__all__ = ["Holder", "canonical", "holder_token", "lock_key", "parse_holder"]

_HOST = socket.gethostname()


class _NoCanonicalForm(TypeError):
    """A value of a type with no canonical form (its type name is the message)."""


def _encode(value: Any) -> Any:
    """JSON's ``default=``: one fixed, documented form per non-JSON type; anything else is an error."""
    if isinstance(value, uuid.UUID):
        return str(value)
    if isinstance(value, dt.datetime | dt.date | dt.time):
        return value.isoformat()
    if isinstance(value, dt.timedelta):
        return value.total_seconds()
    if isinstance(value, decimal.Decimal):
        return str(value)
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, set | frozenset):
        return sorted(value, key=canonical)
    if isinstance(value, bytes | bytearray):
        return value.hex()
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    raise _NoCanonicalForm(type(value).__name__)


def canonical(value: Any) -> str:
    """The canonical JSON text of ``value``: equal for equal arguments, whatever the dict order."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), default=_encode, ensure_ascii=False)


def lock_key(
    prefix: str,
    task_name: str,
    signature: inspect.Signature | None,
    args: Sequence[Any],
    kwargs: Mapping[str, Any],
    *,
    unique_on: Sequence[str] | None = None,
) -> str:
    """``prefix + task_name + ':' + hash`` of the call's bound arguments (only ``unique_on`` ones, if given)."""
    if signature is not None:
        try:
            bound = signature.bind(*args, **kwargs)
        except TypeError as exc:
            raise UnserializableArgumentsError(
                f"cannot build the lock key of {task_name}: arguments do not match its signature ({exc})"
            ) from None
        bound.apply_defaults()
        arguments: Any = dict(bound.arguments)
        if unique_on is not None:
            missing = [n for n in unique_on if n not in arguments]
            if missing:
                raise ConfigurationError(f"lock_unique_on of {task_name} names unknown argument(s): {missing}")
            arguments = {n: arguments[n] for n in unique_on}
    else:  # no usable signature (e.g. a C function): positional and keyword arguments as given
        arguments = {"args": list(args), "kwargs": dict(kwargs)}
    try:
        text = canonical(arguments)
    except (TypeError, ValueError) as exc:
        # json's own errors (dict keys of mixed or non-JSON types, a circular reference) are sentences, not types.
        if isinstance(exc, _NoCanonicalForm):
            what = f"an argument of type {exc} has no canonical form"
        else:
            what = f"the arguments have no canonical form ({exc})"
        raise UnserializableArgumentsError(
            f"cannot build the lock key of {task_name}: {what}; pass JSON-like values "
            f"(dicts with string keys), or set lock_key= (a function returning a string) on the task"
        ) from None
    # surrogatepass: a JSON message may carry a lone surrogate ("\ud800"), a str that strict UTF-8 cannot encode.
    digest = hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()[:32]
    return f"{prefix}{task_name}:{digest}"


def custom_key(prefix: str, task_name: str, fun: Callable[..., Any], args: Sequence[Any], kw: Mapping[str, Any]) -> str:
    """The key from a user's ``lock_key`` function, which receives the task's own arguments."""
    value = fun(*args, **kw)
    if not isinstance(value, str) or not value:
        raise ConfigurationError(f"lock_key of {task_name} must return a non-empty string, got {value!r}")
    return f"{prefix}{task_name}:{value}"


class Holder(NamedTuple):
    """What a LockedTask's owner token tells about the run that holds a lock."""

    task_id: str
    worker: str  # "pid@host"
    acquired_at: float  # wall clock, seconds since the epoch
    task_name: str


def holder_token(task_id: str, task_name: str, worker: str | None = None) -> str:
    """A unique owner token that also names the holder: ``nonce|task_id|pid@host|acquired_ms|task_name``.

    ``worker`` replaces ``pid@host`` for tokens that mark a state rather than a process (LockedTask's hand-overs).
    """
    worker = worker or f"{os.getpid()}@{_HOST}"
    return f"{secrets.token_hex(8)}|{task_id}|{worker}|{int(time.time() * 1000)}|{task_name}"


def parse_holder(token: str | None) -> Holder | None:
    """The holder named by a LockedTask token; None for a token of another shape (e.g. a plain Redlock)."""
    if not token:
        return None
    # Read from both ends: a task id may itself contain "|" (apply_async(task_id=...) takes any string); the
    # other fields never do (hex nonce, pid@host or a marker word, digits; task names are dotted identifiers).
    parts = token.split("|")
    if len(parts) < 5 or not parts[-2].isdigit():
        return None
    return Holder("|".join(parts[1:-3]), parts[-3], int(parts[-2]) / 1000.0, parts[-1])
