"""A call typed on the page (a task's name, its args and kwargs as JSON, as ``celery call`` takes them): its lock key,
and ``locks explain``'s answer for it or for a key."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from ...errors import ConfigurationError, LockError
from ..explain import Explanation, explain, explain_key
from .listing import public


def parse_call(app: Any, task_name: str, args: str, kwargs: str) -> tuple[Any, list[Any], dict[str, Any]]:
    """The LockedTask and arguments of a call typed on the page (``args``/``kwargs`` as JSON, as ``celery call``
    takes them); ConfigurationError saying what to change."""
    task = getattr(app, "tasks", {}).get(task_name)
    if task is None or not callable(getattr(task, "lock_key_for", None)):
        raise ConfigurationError(f"no LockedTask named {task_name!r} in this app")
    try:
        call_args, call_kwargs = json.loads(args or "[]"), json.loads(kwargs or "{}")
    except ValueError as exc:
        raise ConfigurationError(f"args and kwargs must be JSON, e.g. [7] and {{}} ({str(exc)[:200]})") from None
    if not isinstance(call_args, list) or not isinstance(call_kwargs, dict):
        raise ConfigurationError("args must be a JSON list and kwargs a JSON object, e.g. [7] and {}")
    return task, call_args, call_kwargs


def key_of_call(app: Any, task_name: str, args: str, kwargs: str) -> tuple[str, str]:
    """The lock key of a call (``args``/``kwargs`` as JSON, as ``celery call`` takes them) and what the page says:
    ``(key, "")``, or ``("\x00", why)`` when there is none (a search nothing matches)."""
    try:
        task, call_args, call_kwargs = parse_call(app, task_name, args, kwargs)
    except ConfigurationError as exc:
        return "\x00", str(exc)
    try:
        key = str(task.lock_key_for(*call_args, **call_kwargs))
    except (TypeError, ValueError, ConfigurationError) as exc:
        return "\x00", f"{task_name}: these arguments give no lock key ({type(exc).__name__}: {str(exc)[:200]})"
    return key, f"{task_name}(*{args}, **{kwargs}) locks {key}"


def explained(app: Any, query: Mapping[str, list[str]]) -> tuple[Explanation | None, str]:
    """``locks explain`` of ``?key=`` or of the call ``?task=&args=&kwargs=``, or None and what to change."""
    task_name = query.get("task", [""])[0].strip()[:200]
    key = query.get("key", [""])[0]
    try:
        if task_name:
            task, args, kwargs = parse_call(
                app, task_name, query.get("args", ["[]"])[0], query.get("kwargs", ["{}"])[0]
            )
            return explain(app, task.name, args, kwargs), ""
        if key:
            return explain_key(app, key), ""
    except (TypeError, ValueError, LockError) as exc:  # ConfigurationError, UnserializableArgumentsError: both
        return None, str(exc)[:400]
    return None, "name a key (?key=) or a call (?task=&args=&kwargs=, the arguments as JSON)"


def explanation_json(found: Explanation, now: float) -> dict[str, Any]:
    """An explanation's JSON without owner tokens or stored records (:func:`~.listing.public`)."""
    data = found.to_json(now)
    data["slots"] = [None if s is None else public(s) for s in data["slots"]]
    data["burst"] = None if data["burst"] is None else public(data["burst"])
    data["done"] = [public(d) for d in data["done"]]
    return data
