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

Besides redis-py's own schemes, a node may be a Sentinel-managed master or a Redis Cluster (see docs/nodes.md)::

    redis+sentinel://[user:password@]host[:port][,host[:port]...]/SERVICE_NAME[/DB][?options]   (port 26379)
    redis+cluster://[user:password@]host:port[,host:port...][?options]

``rediss+`` instead of ``redis+`` is TLS. :func:`parse_node_url` splits them into hosts and the equivalent one-host
``redis(s)://`` URL, whose userinfo, db and options redis-py's own parser then reads, as for any other node.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Final, Literal, cast
from urllib.parse import parse_qs, unquote, unquote_plus, urlsplit

import redis.connection

from ..errors import ConfigurationError

__all__ = [
    "NodeURL",
    "credentials_for",
    "credentials_version",
    "parse_node_url",
    "redact_url",
    "use_credentials",
    "validate_url",
]

# Schemes naming several hosts: a Sentinel set (its master is the node) or a Redis Cluster (one logical node).
_MULTI: Final = ("redis+sentinel://", "rediss+sentinel://", "redis+cluster://", "rediss+cluster://")
_PREFIXES: Final = ("redis://", "rediss://", "unix://", *_MULTI)
_SCHEMES_HINT: Final = "redis://, rediss://, unix://, redis+sentinel://, redis+cluster:// (or rediss+ for TLS)"
SENTINEL_PORT: Final = 26379
# Query options for the Sentinel daemons themselves (the userinfo authenticates to the master).
_SENTINEL_OPTIONS: Final = frozenset({"sentinel_username", "sentinel_password"})
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
        "sentinel_username",
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


def _redact_hosts(authority: str) -> str:
    """A ``host[:port],host[:port]`` list: the hosts and ports shown; from a part with no host, or a "port" that is
    not a number, on, everything is masked (``redis+sentinel://:PASSWORD`` without ``@host`` reads the password as
    hosts and ports)."""
    shown = []
    for part in authority.split(","):
        redacted = _redact_authority(part)
        if not part or part.startswith(":") or redacted != part:
            shown.append(redacted if part and not part.startswith(":") else f":{_MASK}")
            break
        shown.append(part)
    return ",".join(shown)


_DB_PATH: Final = frozenset({"redis", "rediss", "redis+cluster", "rediss+cluster"})
_SERVICE_PATH: Final = re.compile(r"[A-Za-z0-9._-]+(/[0-9]*)?/?\Z")


def _redact_path(scheme: str, path: str) -> str:
    """Mask a ``;``-tail, and for redis(s):// a path that is not a db number (both are ignored by redis-py); for a
    Sentinel URL a path that is not ``SERVICE_NAME[/DB]``, for a Cluster URL one that is not db 0."""
    path, semicolon, _ = path.partition(";")
    db = unquote(path).replace("/", "")
    scheme = scheme.lower()
    if scheme.endswith("+sentinel"):
        if path and not _SERVICE_PATH.match(path):
            path = _MASK
    elif (
        scheme in ("redis", "rediss", "redis+cluster", "rediss+cluster") and db and not (db.isascii() and db.isdigit())
    ):
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
    if f"{scheme.lower()}://" in _MULTI:
        hosts = _redact_hosts(authority)
        if hosts != authority:  # a password read as hosts: what follows may be more of it
            path = _MASK if path else path
        shown = hosts
    else:
        shown = _redact_authority(authority)
    return (
        f"{scheme}://{_redact_userinfo(userinfo)}{at}{shown}{slash}"
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
            return f"the scheme must be lowercase: {_SCHEMES_HINT}"
        return f"it must start with {_SCHEMES_HINT}, e.g. 'redis://127.0.0.1:6379/0'"
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
    if f"{scheme}://" in _MULTI:
        return _multi_problem(scheme, rest)
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
    return _query_problem(parts.query)


def _query_problem(query: str) -> str | None:
    for name, values in parse_qs(query).items():
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


def _split_host(part: str, default_port: int | None) -> tuple[str, int] | str:
    """``(host, port)`` of one ``host[:port]`` of a multi-host URL, or what is wrong with it (quoting none of it)."""
    if part.startswith("["):
        host, close, port = part.partition("]")
        host = host[1:]
        if not close or (port and not port.startswith(":")):
            return "an IPv6 host goes in brackets, followed by ':port', e.g. '[::1]:26379'"
        port = port[1:]
    else:
        host, _, port = part.partition(":")
    if not host:
        return (
            "every host in the list needs a name, e.g. '127.0.0.1:26379,127.0.0.2:26379', and a password goes "
            "before the hosts, after a ':' and followed by '@'"
        )
    if not port:
        if default_port is None:
            return "every host of a Cluster URL needs its port, e.g. 'redis+cluster://127.0.0.1:7000,127.0.0.1:7001'"
        return host, default_port
    if not (port.isascii() and port.isdigit()):
        return "Port is not a number (what follows a host's ':'): write host:port, e.g. '127.0.0.1:26379'"
    if not 0 < int(port) < 65536:
        return "Port out of range: it must be a number from 1 to 65535, e.g. 26379"
    return host, int(port)


def _multi_problem(scheme: str, rest: str) -> str | None:
    """What is wrong with a ``redis+sentinel://`` or ``redis+cluster://`` URL (after its ``scheme://``)."""
    sentinel = scheme.endswith("+sentinel")
    authority = re.split(r"[/?]", rest, maxsplit=1)[0]
    hosts = authority.rpartition("@")[2]
    if not hosts:
        return "it names no host: e.g. 'redis+sentinel://127.0.0.1:26379/mymaster' or 'redis+cluster://127.0.0.1:7000'"
    for part in hosts.split(","):
        split = _split_host(part, SENTINEL_PORT if sentinel else None)
        if isinstance(split, str):
            return split
    path, _, query = rest[len(authority) :].partition("?")
    segments = [unquote(s) for s in path.split("/")[1:]]
    if segments and segments[-1] == "":
        segments.pop()  # a trailing '/'
    if sentinel:
        if not segments or not segments[0]:
            return "a Sentinel URL names the master's service after the hosts, e.g. 'redis+sentinel://h:26379/mymaster'"
        if len(segments) > 2 or (len(segments) == 2 and not (segments[1].isascii() and segments[1].isdigit())):
            return "the path of a Sentinel URL must be /SERVICE_NAME or /SERVICE_NAME/DB, e.g. '/mymaster/0'"
    elif segments and segments != ["0"]:
        return "a Redis Cluster has db 0 only: write no path (or '/0'), e.g. 'redis+cluster://127.0.0.1:7000'"
    for name in parse_qs(query):
        if name.startswith("sentinel_") and name not in _SENTINEL_OPTIONS:
            return "a Sentinel option must be sentinel_username or sentinel_password (the Sentinels' own AUTH)"
        if name == "db" and not sentinel:
            return "a Redis Cluster has db 0 only: leave out the 'db' option"
    return _query_problem(query)


@dataclass(frozen=True)
class NodeURL:
    """A ``redis+sentinel://`` or ``redis+cluster://`` URL, split (see :func:`parse_node_url`). Holds secrets: never
    log it; its ``name`` is the redacted form."""

    kind: Literal["sentinel", "cluster"]
    tls: bool
    hosts: tuple[tuple[str, int], ...]
    #: The equivalent one-host ``redis(s)://`` URL (userinfo, db and the options for the data nodes), for
    #: redis-py's ``parse_url``; its host is the first of ``hosts``.
    plain: str
    #: Sentinel only: the master's service name, and the options for the Sentinels' own connections.
    service: str = ""
    sentinel_options: tuple[tuple[str, str], ...] = ()

    def __repr__(self) -> str:
        return f"NodeURL({self.name!r})"

    @property
    def name(self) -> str:
        """The node's name in errors and listings: scheme, hosts and (Sentinel) service and db; nothing secret."""
        hosts = ",".join(f"[{h}]:{p}" if ":" in h else f"{h}:{p}" for h, p in self.hosts)
        scheme = f"{'rediss' if self.tls else 'redis'}+{self.kind}"
        if self.kind == "cluster":
            return f"{scheme}://{hosts}"
        db = urlsplit(self.plain).path.strip("/") or "0"
        return f"{scheme}://{hosts}/{self.service}/{db}"


def parse_node_url(url: str) -> NodeURL | None:
    """Split a valid ``redis+sentinel://`` / ``redis+cluster://`` URL (see :func:`validate_url`); None for any
    other scheme."""
    scheme, sep, rest = url.partition("://")
    if not sep or f"{scheme}://" not in _MULTI:
        return None
    sentinel = scheme.endswith("+sentinel")
    authority = re.split(r"[/?]", rest, maxsplit=1)[0]
    userinfo, at, hosts = authority.rpartition("@")
    parsed = tuple(_split_host(part, SENTINEL_PORT if sentinel else None) for part in hosts.split(","))
    pairs = tuple(p for p in parsed if not isinstance(p, str))
    if len(pairs) != len(parsed):
        raise ConfigurationError(f"invalid Redis URL {redact_url(url)!r}: check it with validate_url first")
    path, _, query = rest[len(authority) :].partition("?")
    segments = [s for s in path.split("/")[1:] if s]
    options = [
        item for item in query.split("&") if item and not _option_name(item.partition("=")[0]).startswith("sentinel_")
    ]
    sentinel_options = tuple((name, values[0]) for name, values in parse_qs(query).items() if name in _SENTINEL_OPTIONS)
    host, port = pairs[0]
    shown_host = f"[{host}]" if ":" in host else host
    db = segments[1] if sentinel and len(segments) > 1 else "0"
    tls = scheme.startswith("rediss")
    plain = f"{'rediss' if tls else 'redis'}://{userinfo}{at}{shown_host}:{port}/{db}"
    if options:
        plain += "?" + "&".join(options)
    return NodeURL(
        kind="sentinel" if sentinel else "cluster",
        tls=tls,
        hosts=pairs,
        plain=plain,
        service=unquote(segments[0]) if sentinel else "",
        sentinel_options=sentinel_options,
    )


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


# -- credential providers (singleton_lock_credential_provider) ------------------------------------------------------

#: URL -> the redis-py ``CredentialProvider`` its connections authenticate with. Read where the clients are built
#: (nodes.py and aio.py), so every NodeSet and AsyncNodes built from that URL (settings, pre-skip, async producers)
#: uses it; redis-py asks the provider on every new connection, so a rotated secret needs no restart.
_providers: dict[str, object] = {}
#: Bumped whenever a URL's provider changes: NodeSets cached per URL list (nodes.py) are keyed by it, so a provider
#: set after a NodeSet was built from that URL is used by the next one.
_providers_version = 0


def use_credentials(urls: Sequence[object], provider: object) -> None:
    """Authenticate every new connection to the nodes ``urls`` (the URL strings among them) with ``provider``."""
    global _providers_version  # noqa: PLW0603 - one counter per process, read on NodeSet's hot path
    for url in urls:
        if isinstance(url, str) and _providers.get(url) is not provider:
            _providers[url] = provider
            _providers_version += 1


def credentials_version() -> int:
    """A number that changes whenever a URL's credential provider does (see ``nodes.NodeSet``'s cache)."""
    return _providers_version


def credentials_for(url: str) -> object | None:
    """The credential provider of ``url``'s connections, or None (the URL's own user and password, if any)."""
    return _providers.get(url)
