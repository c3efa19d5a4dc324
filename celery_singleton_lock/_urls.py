"""Redis node URLs: validation, and the redacted form that is safe to log, raise or print."""

from __future__ import annotations

import re
from urllib.parse import urlsplit, urlunsplit

from .errors import ConfigurationError

__all__ = ["redact_url", "validate_url"]

_SCHEMES = ("redis", "rediss", "unix")
_QUERY_PASSWORD = re.compile(r"((?:^|&)password=)[^&]*", re.IGNORECASE)


def redact_url(url: str) -> str:
    """Return ``url`` with any password replaced by ``***`` (safe for logs and errors); never raises.

    Both places redis-py reads a password from are masked: the userinfo and a ``password=`` query argument. The
    host and port are kept as written (not parsed: a bad port must not turn an error message into a crash).
    """
    scheme, sep, rest = url.partition("://")
    if sep and "@" in rest:
        # Everything up to the LAST "@" is userinfo to redis-py, even with an unencoded "/", "#" or "?" in the
        # password, which urlsplit would read as the start of the path, fragment or query.
        user, _, password = rest.rpartition("@")[0].partition(":")
        url = f"{scheme}://{user}:***@{rest.rpartition('@')[2]}" if password else url
    try:
        parts = urlsplit(url)
    except ValueError:
        return "<unparseable url>"
    if parts.password is not None:
        host = parts.netloc.rpartition("@")[2]
        parts = parts._replace(netloc=f"{parts.username or ''}:***@{host}")
    if "password=" in parts.query.lower():
        parts = parts._replace(query=_QUERY_PASSWORD.sub(r"\1***", parts.query))
    return urlunsplit(parts)


def validate_url(url: object) -> str:
    if not isinstance(url, str):
        raise ConfigurationError(f"a Redis node must be a URL string or a redis.Redis client, got {type(url).__name__}")
    try:
        scheme = urlsplit(url).scheme
    except ValueError as exc:
        raise ConfigurationError(f"invalid Redis URL {redact_url(url)!r}: {exc}") from None
    if scheme not in _SCHEMES:
        raise ConfigurationError(
            f"invalid Redis URL {redact_url(url)!r}: the scheme must be one of "
            f"redis://, rediss:// or unix://, e.g. 'redis://127.0.0.1:6379/0'"
        )
    return url
