"""Redis node URLs: validation, and the redacted form that is safe to log, raise or print.

No secret, nor a piece of one, may reach a log line, an error, a repr or the CLI's output. What :func:`redact_url`
treats as secret, and why:

* the userinfo's password (``redis://user:PASSWORD@host``), up to the LAST ``@``: redis-py takes everything before
  it as userinfo, and a password with an unencoded ``/``, ``?``, ``#`` or ``@`` must not leak its tail;
* a userinfo without ``:`` (``redis://NAME@host``): redis-py reads it as an ACL username, but it is where a password
  lands when the ``:`` before it is forgotten, so it is masked too (next to a password, a username is shown);
* every query value, unless its option is known to hold no secret (:data:`_PUBLIC_OPTIONS`: numbers, flags, names
  and the file *paths* ``ssl_keyfile``/``ssl_certfile``/``ssl_ca_certs``, which say where a key is, not what it is).
  A name that looks secret (``password``, ``ssl_password``, ``sentinel_password``, anything with pass, pwd,
  secret, token, key, auth or cred) keeps its name (``ssl_password=***``); any other name is masked whole, as it
  may be the tail of a password with an unencoded ``&``;
* anything after a ``#`` (redis-py ignores it: it is the tail of a password with an unencoded ``#``), a ``;``-tail
  of a path, a path that is not a db number, and a "port" that is not a number (``redis://:PASSWORD`` without
  ``@host`` reads the password as host:port).

:func:`validate_url` refuses what redis-py would misread or reject, and its errors name the problem and the fix,
never the parser's own message: urllib's and redis-py's messages quote the input (a port, a netloc) and so, for a
password with an unencoded ``#``, a piece of the password.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Final, cast
from urllib.parse import parse_qs, unquote, unquote_plus, urlsplit

import redis.connection

from .errors import ConfigurationError

__all__ = ["redact_url", "validate_url"]

_PREFIXES: Final = ("redis://", "rediss://", "unix://")
_SCHEME: Final = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*\Z")
_MASK: Final = "***"

# redis-py's URL options whose values are never secret: shown as written.
_PUBLIC_OPTIONS: Final = frozenset(
    {
        "db",
        "socket_timeout",
        "socket_connect_timeout",
        "socket_read_size",
        "socket_keepalive",
        "retry_on_timeout",
        "retry_on_error",
        "max_connections",
        "health_check_interval",
        "timeout",
        "protocol",
        "legacy_responses",
        "encoding",
        "encoding_errors",
        "decode_responses",
        "client_name",
        "lib_name",
        "lib_version",
        "username",
        "ssl_cert_reqs",
        "ssl_check_hostname",
        "ssl_include_verify_flags",
        "ssl_exclude_verify_flags",
        "ssl_min_version",
        "ssl_ciphers",
        "ssl_validate_ocsp",
        "ssl_validate_ocsp_stapled",
        # Paths to PEM files: where the key is, not the key (its passphrase is ssl_password, masked).
        "ssl_keyfile",
        "ssl_certfile",
        "ssl_ca_certs",
        "ssl_ca_path",
    }
)
# Options that hold (or by their name look like they hold) a secret: the name is shown, the value masked. Any other
# name is masked whole, name included: it may be the tail of a password with an unencoded '&' (``password=ab&cd=ef``).
_SECRET_NAME: Final = re.compile(r"pass|pwd|secret|token|key|auth|cred")

# redis-py converts these query options (int, float, bool, verify flags); what a value must look like, per converter.
_PARSERS = cast("Mapping[str, Callable[[str], object]]", getattr(redis.connection, "URL_QUERY_ARGUMENT_PARSERS", {}))
_EXPECTED: Final[Mapping[object, str]] = {int: "a whole number, e.g. 0", float: "a number, e.g. 0.5"}
_FLAGS: Final = "ssl.VerifyFlags names separated by commas, e.g. VERIFY_X509_STRICT"


def _option_name(name: str) -> str:
    return unquote_plus(name).strip().lower()


def _redact_userinfo(userinfo: str) -> str:
    user, colon, password = userinfo.partition(":")
    if not colon:
        return _MASK if user else ""
    if "@" in user:  # 'p@ss:word@host': the "username" is a piece of a password
        user = _MASK
    return f"{user}:{_MASK}" if password else f"{user}:"


def _redact_authority(authority: str) -> str:
    """Mask a "port" that is not a number: ``redis://:PASSWORD`` (no ``@host``) reads the password as the port."""
    if authority.startswith("["):
        host, close, port = authority.partition("]")
        host += close
        port = port.removeprefix(":")
    else:
        host, _, port = authority.partition(":")  # the first ':', as urllib splits host and port
    if port and not (port.isascii() and port.isdigit()):
        return f"{host}:{_MASK}"
    return authority


def _redact_path(scheme: str, path: str) -> str:
    """Mask a ``;``-tail, and for redis(s):// a path that is not a db number (both are ignored by redis-py)."""
    path, semicolon, _ = path.partition(";")
    db = unquote(path).replace("/", "")
    if scheme.lower() in ("redis", "rediss") and db and not (db.isascii() and db.isdigit()):
        path = _MASK
    return path + (f";{_MASK}" if semicolon else "")


def _redact_query(query: str) -> str:
    pieces = []
    for piece in query.split("&"):  # redis-py's separator: to it, a ';' is part of a value
        shown = []
        for item in piece.split(";"):
            name, eq, _ = item.partition("=")
            option = _option_name(name)
            if not item or (eq and option in _PUBLIC_OPTIONS):
                shown.append(item)
                continue
            # The rest of this '&'-piece may be one value to redis-py: it goes with this item.
            shown.append(f"{name}={_MASK}" if eq and _SECRET_NAME.search(option) else _MASK)
            break
        pieces.append(";".join(shown))
    return "&".join(pieces)


def redact_url(url: str) -> str:
    """Return ``url`` with every secret replaced by ``***`` (safe for logs, errors and output); never raises.

    See the module's docstring for what counts as secret. The host, port, db number, the ACL username next to a
    password and the options that hold no secret are kept as written, not parsed: a malformed URL must not turn an
    error message into a crash, nor into a message quoting the password.
    """
    if not isinstance(url, str):
        return f"<{type(url).__name__}, not a URL>"
    scheme, sep, rest = url.partition("://")
    if not sep or not _SCHEME.match(scheme):
        return "<not a URL>"  # no telling which part of it is a secret
    userinfo, at, rest = rest.rpartition("@")
    rest, hashmark, _ = rest.partition("#")
    rest, question, query = rest.partition("?")
    authority, slash, path = rest.partition("/")
    return (
        f"{scheme}://{_redact_userinfo(userinfo)}{at}{_redact_authority(authority)}{slash}"
        f"{_redact_path(scheme, path)}{question}{_redact_query(query)}{f'#{_MASK}' if hashmark else ''}"
    )


def _port_of(netloc: str) -> str:
    """The port as urllib splits it off the host (after the ']' of an IPv6 host, else after the first ':')."""
    hostport = netloc.rpartition("@")[2]
    if hostport.startswith("["):
        return hostport.partition("]")[2].partition(":")[2]
    return hostport.partition(":")[2]


def _problem(url: str) -> str | None:
    """What is wrong with ``url`` for redis-py, in words that quote no part of it; None when nothing is."""
    if not url.startswith(_PREFIXES):
        if url.lower().startswith(_PREFIXES):
            return "the scheme must be lowercase: redis://, rediss:// or unix://"
        return "it must start with redis://, rediss:// or unix://, e.g. 'redis://127.0.0.1:6379/0'"
    scheme, _, rest = url.partition("://")
    if "#" in rest:
        return (
            "it has a '#', and redis-py ignores everything after one: percent-encode a '#' in the password "
            "or in a query value as %23"
        )
    authority = re.split(r"[/?]", rest, maxsplit=1)[0]
    if "@" in rest[len(authority) :]:
        return (
            "it has an '@' after the host: percent-encode '/', '?' and '@' in the password (as %2F, %3F and %40) "
            "and '@' in a path or query value (as %40)"
        )
    try:
        parts = urlsplit(url)
    except ValueError:
        if ("[" in authority) != ("]" in authority):
            return (
                "it has an unmatched '[' or ']': only an IPv6 host goes in brackets, e.g. 'redis://[::1]:6379/0'; "
                "percent-encode them in the password (as %5B and %5D)"
            )
        if "[" in authority:
            return (
                "the host in brackets must be an IPv6 address, with nothing between ']' and ':port', e.g. "
                "'redis://[::1]:6379/0'; percent-encode '[' and ']' in the password (as %5B and %5D)"
            )
        if not authority.isascii():
            return (
                "the part before the path has non-ASCII characters that read as '/', '?', '#', '@' or ':' once "
                "normalised (NFKC): percent-encode them"
            )
        return "it cannot be split into scheme, host, port, path and query: write it as 'redis://127.0.0.1:6379/0'"
    try:
        parts.port  # noqa: B018 - urllib checks the port on access
    except ValueError:
        port = _port_of(parts.netloc)
        if port.isascii() and port.isdigit():
            return "Port out of range: it must be a number from 1 to 65535, e.g. 6379"
        return (
            "Port is not a number (what follows the host's ':'): write host:port, e.g. 'redis://127.0.0.1:6379/0', and "
            "a password before the host, after a ':' and followed by '@'"
        )
    if scheme != "unix":
        db = unquote(parts.path).replace("/", "")
        if "," in parts.netloc.rpartition("@")[2] or "," in db:
            return (
                "it has a ',' after the host: give several nodes as a list of URLs, or as one string of URLs "
                "separated by ',' and each starting with redis:// or rediss://"
            )
        if db and not (db.isascii() and db.isdigit()):
            return "the path after the host must be the db number, e.g. '/0', or nothing"
    for name, values in parse_qs(parts.query).items():
        parser = _PARSERS.get(name)
        if parser is None:
            continue
        try:
            value = parser(values[0])
        except (TypeError, ValueError):
            expected = _FLAGS if name.endswith("_verify_flags") else _EXPECTED.get(parser, "what redis-py accepts")
            return f"the query option {name!r} has an invalid value: it must be {expected}"
        if name == "max_connections" and isinstance(value, int) and value < 0:
            return "the query option 'max_connections' must be a positive whole number, e.g. 50"
    return None


def validate_url(url: object) -> str:
    """Return ``url`` if redis-py can use it as written, else raise a ConfigurationError that says what to change.

    The error shows the URL redacted, and says what is wrong in its own words: never a parser's message, which may
    quote a piece of the password.
    """
    if not isinstance(url, str):
        raise ConfigurationError(f"a Redis node must be a URL string or a redis.Redis client, got {type(url).__name__}")
    problem = _problem(url)
    if problem is not None:
        shown = redact_url(url)
        raise ConfigurationError(f"invalid Redis URL {shown if shown.startswith('<') else repr(shown)}: {problem}")
    return url
