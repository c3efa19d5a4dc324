"""Read and validate ``app.conf.singleton_lock_*`` once per app into a frozen settings object.

Every setting is namespaced ``singleton_lock_*``. An unknown one (a typo) is an error, not silently ignored: a
lock that quietly used a default TTL because ``singleton_lock_tll`` was misspelt is the kind of bug this library
exists to prevent. The settings are cached on the app; :func:`settings_for` is cheap after the first call.
"""

from __future__ import annotations

import difflib
import importlib
import logging
import re
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any, Final, Literal, cast, get_args

import redis
from redis.cluster import RedisCluster
from redis.credentials import CredentialProvider

from ..errors import ConfigurationError
from ._urls import use_credentials
from .redlock import NodeSet, redact_url

__all__ = [
    "DEFAULT_TTL",
    "DuplicatePolicy",
    "LockSettings",
    "LostPolicy",
    "UnavailablePolicy",
    "settings_for",
]

logger = logging.getLogger("celery_singleton_lock.config")

DuplicatePolicy = Literal["skip", "fail", "reschedule", "replace", "cancel"]
UnavailablePolicy = Literal["retry", "fail", "run"]
#: What a LockedTask body does when its lock is lost (a task option only): go on (and ask ``check_lock()``), or be
#: interrupted with LockLostError where the pool allows it (see celery_singleton_lock.interrupt).
LostPolicy = Literal["continue", "interrupt"]

DEFAULT_TTL: Final = 60.0
_PREFIX: Final = "singleton_lock_"
_CACHE_ATTR: Final = "_singleton_lock_settings"
_cache_lock = threading.Lock()
_URL_START: Final = re.compile(r"\s*,\s*(?=[A-Za-z][A-Za-z0-9+.-]*://)")


@dataclass(frozen=True, repr=False)
class LockSettings:
    """The validated ``singleton_lock_*`` settings of one Celery app.

    ===================================== ============================ ==============================================
    setting                               default                      meaning
    ===================================== ============================ ==============================================
    ``singleton_lock_urls``               the broker URL (if Redis)    one URL or client, or a list: N masters
    ``singleton_lock_ttl``                60.0                         lease in seconds (renewed while running)
    ``singleton_lock_prefix``             ``"singleton_lock:"``        key prefix (may carry a ``{hash tag}``)
    ``singleton_lock_socket_timeout``     0.5                          per-node socket timeout in seconds
    ``singleton_lock_on_duplicate``       ``"skip"``                   skip / fail / reschedule
    ``singleton_lock_on_unavailable``     ``"retry"``                  retry / fail / run (fail open)
    ``singleton_lock_retry_delay``        1.0                          first back-off when Redis is unavailable
    ``singleton_lock_retry_max_delay``    60.0                         cap of that back-off
    ``singleton_lock_max_retries``        None (forever)               retries before giving up when unavailable
    ``singleton_lock_renew_fraction``     1/3                          renew every ``ttl * fraction`` seconds
    ``singleton_lock_skip_before_pool``   True                         skip a clear duplicate in the worker's main
                                                                       process, before the pool (docs/how-it-works.md)
    ``singleton_lock_credential_provider`` None                        a redis-py ``CredentialProvider`` (or its
                                                                       dotted path) for every node connection
    ``singleton_lock_liveness_file``      None                         a heartbeat file the worker's watchdog and
                                                                       beat rewrite (``locks health --liveness``)
    ``singleton_lock_hand_on``            True                         "cancel": hand a stopped run's lock to the
                                                                       newest waiting call; False frees it instead
                                                                       (a rolling upgrade from before hand-on)
    ===================================== ============================ ==============================================
    """

    urls: tuple[str | redis.Redis | RedisCluster, ...]
    ttl: float = DEFAULT_TTL
    prefix: str = "singleton_lock:"
    socket_timeout: float = 0.5
    on_duplicate: DuplicatePolicy = "skip"
    on_unavailable: UnavailablePolicy = "retry"
    retry_delay: float = 1.0
    retry_max_delay: float = 60.0
    max_retries: int | None = None
    renew_fraction: float = 1 / 3
    skip_before_pool: bool = True
    liveness_file: str | None = None
    hand_on: bool = True
    credential_provider: Any = field(default=None, repr=False)  # repr: its class only (it may hold a secret)
    nodes: NodeSet = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        check_ttl(self.ttl, "singleton_lock_ttl")
        check_prefix(self.prefix)
        _positive(self.socket_timeout, "singleton_lock_socket_timeout")
        check_policy(self.on_duplicate, DuplicatePolicy, "singleton_lock_on_duplicate")
        check_policy(self.on_unavailable, UnavailablePolicy, "singleton_lock_on_unavailable")
        _positive(self.retry_delay, "singleton_lock_retry_delay")
        _positive(self.retry_max_delay, "singleton_lock_retry_max_delay")
        if self.max_retries is not None and (not isinstance(self.max_retries, int) or self.max_retries < 0):
            raise ConfigurationError(
                f"singleton_lock_max_retries must be None or an int >= 0, got {self.max_retries!r}"
            )
        if not (isinstance(self.renew_fraction, int | float) and 0 < self.renew_fraction < 1):
            raise ConfigurationError(
                f"singleton_lock_renew_fraction must be between 0 and 1 (e.g. 0.33), got {self.renew_fraction!r}"
            )
        if not isinstance(self.skip_before_pool, bool):
            raise ConfigurationError(
                f"singleton_lock_skip_before_pool must be True or False, got {self.skip_before_pool!r}"
            )
        if not isinstance(self.hand_on, bool):
            raise ConfigurationError(f"singleton_lock_hand_on must be True or False, got {self.hand_on!r}")
        if self.liveness_file is not None and (not isinstance(self.liveness_file, str) or not self.liveness_file):
            raise ConfigurationError(
                f"singleton_lock_liveness_file must be a file path (e.g. '/tmp/celery-liveness.json') or None, "
                f"got {self.liveness_file!r}"
            )
        if self.credential_provider is not None:
            provider = _credential_provider(self.credential_provider)
            object.__setattr__(self, "credential_provider", provider)
            _no_userinfo(self.urls)
            use_credentials(self.urls, provider)
        object.__setattr__(self, "nodes", NodeSet(list(self.urls), socket_timeout=self.socket_timeout))

    def __repr__(self) -> str:
        # Not the generated repr: it would print the URLs' passwords, and settings end up in logs and tracebacks.
        shown = [f"{f.name}={getattr(self, f.name)!r}" for f in fields(self) if f.repr and f.name != "urls"]
        if self.credential_provider is not None:
            shown.append(f"credential_provider=<{type(self.credential_provider).__qualname__}>")
        return f"LockSettings(urls={self.redacted_urls!r}, {', '.join(shown)})"

    @property
    def redacted_urls(self) -> tuple[str, ...]:
        """The nodes as they may be shown: each URL redacted, each client by its address (never a password)."""
        return tuple(
            redact_url(u) if isinstance(u, str) else name for u, name in zip(self.urls, self.nodes.names, strict=True)
        )

    @property
    def fence_key(self) -> str:
        """The fencing counter every LockedTask lock under this prefix shares: one key, not one per job ever run."""
        return f"{self.prefix}fence"

    def describe(self) -> str:
        """A one-line summary for logs, passwords redacted."""
        nodes = ", ".join(self.redacted_urls)
        return f"{len(self.urls)} node(s) [{nodes}], quorum {self.nodes.quorum}, ttl {self.ttl}s"


_FIELDS: Final = {
    "urls",
    "ttl",
    "prefix",
    "socket_timeout",
    "on_duplicate",
    "on_unavailable",
    "retry_delay",
    "retry_max_delay",
    "max_retries",
    "renew_fraction",
    "skip_before_pool",
    "liveness_file",
    "hand_on",
    "credential_provider",
}


# Settings of celery-singleton that fall into our namespace: an app migrating from it gets told what to use.
_PEER_SETTINGS: Final = {"singleton_lock_expiry": "singleton_lock_ttl (or lock_ttl on the task)"}


def _credential_provider(value: object) -> CredentialProvider:
    """A ``CredentialProvider``: given, or named by a dotted path (``"proj.redis:provider"``) to an instance or to a
    class (or function) that makes one with no arguments."""
    found = value
    if isinstance(value, str):
        module, _, attr = value.partition(":") if ":" in value else value.rpartition(".")
        try:
            found = getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError, ValueError) as exc:
            raise ConfigurationError(
                f"singleton_lock_credential_provider {value!r} cannot be imported ({type(exc).__name__}): give a "
                "dotted path such as 'proj.redis:credentials' or a redis.credentials.CredentialProvider instance"
            ) from None
    if callable(found) and not isinstance(found, CredentialProvider):
        found = found()
    if not isinstance(found, CredentialProvider):
        raise ConfigurationError(
            "singleton_lock_credential_provider must be a redis.credentials.CredentialProvider instance (or a "
            f"dotted path to one), got {type(found).__module__}.{type(found).__qualname__}"
        )
    return found


def _no_userinfo(urls: Sequence[object]) -> None:
    """Refuse a URL carrying a user or password beside a credential provider (redis-py takes one or the other)."""
    for i, url in enumerate(urls):
        if isinstance(url, str) and "@" in url.split("://", 1)[-1].split("/", 1)[0]:
            raise ConfigurationError(
                f"singleton_lock_urls[{i}] {redact_url(url)} carries a user or password and "
                "singleton_lock_credential_provider is set: remove them from the URL (the provider gives them)"
            )


#: A prefix: an optional leading hash tag, then a name, then one ``:`` that ends it (see :func:`check_prefix`).
PREFIX_SHAPE = re.compile(r"(\{[^{}:]+\})?[^{}:]*:")


def check_prefix(value: object) -> str:
    """``value`` if it is a valid ``singleton_lock_prefix``: one ``:``, at its end, and braces only as a leading
    hash tag (``"app:"``, ``"{locks}app:"``, ``"{locks}:"``).

    Why: two apps whose prefixes nest (``"a:"`` and ``"a:b:"``) would see each other's keys on shared nodes (a key
    ``a:b:t:v2:...`` is under both), so one app's ``locks list``, page and release would act on the other's locks.
    With one ``:`` that ends every prefix, no prefix starts another one (only itself): a key is under at most one
    app's prefix, whatever task names and ``lock_key`` functions the apps use.
    """
    if not isinstance(value, str):
        raise ConfigurationError(f"singleton_lock_prefix must be a string, got {value!r}")
    if PREFIX_SHAPE.fullmatch(value) is None:
        name = re.sub(r"[{}:]+", "-", value).strip("-") or "app"
        raise ConfigurationError(
            f"singleton_lock_prefix {value!r} must hold one ':', at its end (braces only as a leading hash tag): "
            f"prefixes that nest ('a:' and 'a:b:') see each other's locks; use e.g. {name + ':'!r}"
        )
    return value


def _positive(value: object, setting: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise ConfigurationError(f"{setting} must be a number of seconds > 0, got {value!r}")


def check_ttl(value: object, setting: str) -> float:
    """Validate a lock TTL (seconds, > 0.1); returns it as a float."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0.1:
        raise ConfigurationError(f"{setting} must be a number of seconds > 0.1, e.g. 60, got {value!r}")
    return float(value)


def did_you_mean(value: object, choices: Sequence[str]) -> str:
    """`` (did you mean 'x'?)`` when ``value`` is a string close to one of ``choices`` (difflib); else empty."""
    if not isinstance(value, str):
        return ""
    close = difflib.get_close_matches(value, list(choices), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def check_policy(value: object, policy: Any, setting: str) -> None:
    """Validate that ``value`` is one of the ``Literal`` type ``policy``'s options."""
    options = get_args(policy)
    if value not in options:
        raise ConfigurationError(
            f"{setting} must be one of {', '.join(map(repr, options))}, got {value!r}{did_you_mean(value, options)}"
        )


def _urls(conf: Mapping[str, Any]) -> tuple[str | redis.Redis | RedisCluster, ...]:
    raw = conf.get("singleton_lock_urls")
    if raw is None:
        # app.conf's broker_url property also reads CELERY_BROKER_URL (the broker Celery uses when the app sets
        # none); a plain mapping has only its key.
        broker = cast(Any, conf).broker_url if hasattr(type(conf), "broker_url") else conf.get("broker_url")
        if isinstance(broker, str) and broker.split("://", 1)[0] in ("redis", "rediss"):
            logger.info("singleton_lock_urls is not set: locking on the broker, %s", redact_url(broker))
            return (broker,)
        shown = redact_url(broker) if isinstance(broker, str) else repr(broker)
        raise ConfigurationError(
            f"set app.conf.singleton_lock_urls to one Redis URL or a list of independent Redis masters "
            f"(e.g. ['redis://127.0.0.1:6379/0']): the broker {shown} is not Redis, so it cannot hold the locks"
        )
    if isinstance(raw, str):
        # Split only where a URL starts: a ',' inside one (a password may have it) stays, and validate_url refuses
        # a ',' left in a host or db path ("redis://a:1/0,b:2/0"), so a missing scheme is an error, not one node.
        raw = [u.strip() for u in _URL_START.split(raw)]
    elif isinstance(raw, redis.Redis | RedisCluster):
        raw = [raw]
    if not isinstance(raw, Sequence) or not raw:
        raise ConfigurationError(
            f"singleton_lock_urls must be a Redis URL, a redis.Redis or RedisCluster client, or a non-empty list of "
            f"them, got {'an empty list' if isinstance(raw, Sequence) else type(raw).__name__}"
        )
    for i, item in enumerate(raw):
        if not isinstance(item, str | redis.Redis | RedisCluster):
            # Where Redlock takes a client (a redis.Redis, a Sentinel's master_for(), a RedisCluster), so do we.
            raise ConfigurationError(
                f"singleton_lock_urls[{i}] must be a Redis URL (e.g. 'redis://127.0.0.1:6379/0', "
                f"'redis+cluster://127.0.0.1:7000' for a Redis Cluster, see docs/nodes.md) or a redis.Redis or "
                f"redis.cluster.RedisCluster client, got {type(item).__module__}.{type(item).__qualname__}"
            )
    return tuple(raw)


def settings_from(conf: Mapping[str, Any]) -> LockSettings:
    """Build settings from a mapping of ``singleton_lock_*`` keys (e.g. ``app.conf``); raises on bad values."""
    keys = [k for k in conf if isinstance(k, str) and k.lower().startswith(_PREFIX)]
    unknown = sorted(k for k in keys if k.lower()[len(_PREFIX) :] not in _FIELDS)
    if unknown:
        known = ", ".join(_PREFIX + f for f in sorted(_FIELDS))
        hints = "".join(
            f"; {k} is celery-singleton's setting: use {_PEER_SETTINGS[k.lower()]}"
            for k in unknown
            if k.lower() in _PEER_SETTINGS
        )
        shown = []
        for k in unknown:
            # Compared without the shared prefix, which alone would make every name look close.
            close = difflib.get_close_matches(k.lower()[len(_PREFIX) :], sorted(_FIELDS), n=1)
            shown.append(f"{k} (did you mean {_PREFIX}{close[0]}?)" if close and k.lower() not in _PEER_SETTINGS else k)
        raise ConfigurationError(f"unknown setting(s) {', '.join(shown)}{hints}; known settings: {known}")
    values: dict[str, Any] = {"urls": _urls(conf)}
    for key in keys:
        name = key.lower()[len(_PREFIX) :]
        if name != "urls":
            values[name] = conf[key]
    return LockSettings(**values)


def settings_for(app: Any) -> LockSettings:
    """The app's settings, validated on first use and cached on the app."""
    cached = app.__dict__.get(_CACHE_ATTR)
    if cached is not None:
        return cast(LockSettings, cached)
    with _cache_lock:
        cached = app.__dict__.get(_CACHE_ATTR)
        if cached is None:
            cached = settings_from(app.conf)
            app.__dict__[_CACHE_ATTR] = cached
            logger.debug("celery_singleton_lock settings: %s", cached.describe())
        return cast(LockSettings, cached)
