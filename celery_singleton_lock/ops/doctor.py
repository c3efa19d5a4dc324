"""``celery -A app locks doctor``: check a deployment against what the library assumes, and say what to change.

Every check yields :class:`Finding` records (level, a stable ``code``, the subject, what was found, what to
change). The checks are pure functions of what was read (INFO fields, CONFIG values, clock readings, Celery
settings); the I/O is gathered apart (:func:`gather_node`), so each check is tested without a server and each
misconfiguration also against a real one.

* :func:`node_findings`: per lock node (reachable, role, version, eviction policy, persistence, clock) and over the
  nodes (how many, the same server listed twice, the prefix's hash tag on a Cluster).
* :func:`broker_findings`: the Celery side (each LockedTask's ``lock_ttl`` against the broker's visibility timeout,
  ``acks_late`` without ``task_reject_on_worker_lost``, quorum queues with a direct exchange). No I/O: it can run
  at worker start.
* :func:`run_doctor`: both, for an app, as the command runs them.

Levels: ``error`` (an assumption is broken: locks can vanish, cannot be taken, or a node cannot be checked),
``warning`` (a guarantee weakens, or something could not be read), ``ok`` (a check passed), ``info`` (context).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, cast

from redis.exceptions import ResponseError

from ..lock.config import LockSettings, settings_for
from ..task.checks import (
    Finding,
    Level,
    acks_late_finding,
    broker_findings,
    queue_findings,
    start_problems,
    visibility_finding,
)

__all__ = [
    "CODES",
    "DEFAULT_MAX_CLOCK_DRIFT",
    "DEFAULT_TIMEOUT",
    "LEVELS",
    "Finding",
    "NodeFacts",
    "acks_late_finding",
    "broker_findings",
    "clock_finding",
    "cluster_findings",
    "duplicate_findings",
    "durability_findings",
    "eviction_finding",
    "format_findings",
    "gather_node",
    "gather_nodes",
    "node_count_finding",
    "node_findings",
    "persistence_finding",
    "queue_findings",
    "run_doctor",
    "server_findings",
    "summary",
    "to_json",
    "visibility_finding",
]

LEVELS: Final[tuple[Level, ...]] = ("error", "warning", "ok", "info")

#: Every finding code, with what it checks. Codes are stable: scripts may match on them.
CODES: Final[dict[str, str]] = {
    "settings": "the app's singleton_lock_* settings are valid (as the worker checks them at start)",
    "task-options": "each LockedTask's lock_* options are valid, alone, together (the options matrix, "
    "docs/options.md) and with the settings, as the worker checks them at start",
    "task-import": "the app's task modules import (as the worker imports them)",
    "node-unreachable": "each lock node answers within the timeout, with the given credentials",
    "node-role": "each lock node is a writable master (not a replica, not a Sentinel daemon)",
    "server-version": "the server and its version (Redis >= 5.0, or Valkey)",
    "eviction-policy": "maxmemory-policy is noeviction (no lock key can be evicted)",
    "persistence": "appendonly is on (fencing counters survive a restart); an error when a task uses lock_cooldown or "
    "lock_scope='queue' (their records must survive one)",
    "clock-drift": "the node's clock (TIME) is within --max-clock-drift of this host's",
    "unreadable": "a setting the checks need could not be read (INFO or CONFIG refused)",
    "node-count": "an odd number of lock nodes",
    "node-duplicate": "no server is listed twice (same run_id under two URLs)",
    "cluster-url": "a node in cluster mode is listed as a whole cluster (redis+cluster://), not as one server",
    "cluster-hash-tag": "on a Redis Cluster, what the prefix's hash tag (if any) does to where the locks live",
    "cluster-full-coverage": "on a Redis Cluster, cluster-require-full-coverage is no (one failed master does not "
    "stop every lock)",
    "visibility-timeout": "each LockedTask's lock_ttl is within the broker's visibility timeout",
    "acks-late": "acks_late comes with task_reject_on_worker_lost (or retry_on_worker_lost)",
    "quorum-direct-exchange": "with quorum queues, no queue uses a direct exchange",
}

#: Default for ``--max-clock-drift``: seconds a node's clock may differ from this host's before a warning.
DEFAULT_MAX_CLOCK_DRIFT: Final = 0.5
#: Default for ``--timeout``: seconds all checks of one node may take, together (nodes are checked at once).
DEFAULT_TIMEOUT: Final = 3.0
#: Scripts call TIME before they write: Redis < 5.0 refuses that (it replicates scripts verbatim by default).
MIN_REDIS: Final = (5, 0)
#: JSON output format version: bumped when a field changes meaning or goes away (new fields may be added).
JSON_FORMAT: Final = 1


# --- the nodes: what is read ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class NodeFacts:
    """What one node told us: INFO fields (or their CONFIG GET fallback), a clock reading, what it refused."""

    node: str  # the redacted address
    error: str | None = None  # set when it did not answer at all (nothing else is then set)
    info: Mapping[str, Any] = field(default_factory=dict)
    unread: Mapping[str, str] = field(default_factory=dict)  # what could not be read -> why (INFO, a setting, TIME)
    clock: tuple[float, float, float] | None = None  # (this host's time before TIME, the node's TIME, after)


# INFO field -> CONFIG GET parameter, for the settings the checks need when INFO does not give them.
_CONFIG_FALLBACK: Final = {
    "maxmemory": "maxmemory",
    "maxmemory_policy": "maxmemory-policy",
    "aof_enabled": "appendonly",
}


def _why(exc: BaseException) -> str:
    # redis-py's messages carry no password (NodeSet.error relies on the same); keep one line.
    return f"{type(exc).__name__}: {exc}".splitlines()[0]


def gather_node(client: Any, node: str, *, clock: Callable[[], float] = time.time) -> NodeFacts:
    """Read INFO, the CONFIG fallbacks and TIME from one node. Never raises: a failure is in the facts.

    A node that refuses a command (ACL, a managed service that renames CONFIG) answered: what it refused goes in
    ``unread``. A connection error or timeout (also after INFO answered) means it did not answer: ``error``.
    """
    info: dict[str, Any] = {}
    unread: dict[str, str] = {}
    try:
        try:
            raw = client.info()
            info = dict(raw) if isinstance(raw, Mapping) else {}
        except ResponseError as exc:
            unread["INFO"] = _why(exc)
        for name, param in _CONFIG_FALLBACK.items():
            if name in info:
                continue
            try:
                values = cast(Mapping[str, Any], client.config_get(param))
            except ResponseError as exc:
                unread[param] = _why(exc)
                continue
            value = values.get(param)
            if value is None:
                unread[param] = "CONFIG GET returned nothing"
            else:
                text = value.decode() if isinstance(value, bytes) else str(value)
                info[name] = (1 if text == "yes" else 0) if name == "aof_enabled" else text
        if str(info.get("cluster_enabled", "0")) == "1":
            try:
                values = cast(Mapping[str, Any], client.config_get("cluster-require-full-coverage"))
                value = values.get("cluster-require-full-coverage")
                if value is not None:
                    info["cluster_require_full_coverage"] = value.decode() if isinstance(value, bytes) else str(value)
            except ResponseError as exc:
                unread["cluster-require-full-coverage"] = _why(exc)
        try:
            before = clock()
            seconds, micros = client.time()
            after = clock()
        except ResponseError as exc:
            unread["TIME"] = _why(exc)
            reading = None
        else:
            reading = (before, int(seconds) + int(micros) / 1e6, after)
    except Exception as exc:  # refused connection, timeout, TLS, a Sentinel or Cluster client's own errors
        return NodeFacts(node, error=_why(exc))
    return NodeFacts(node, info=info, unread=unread, clock=reading)


def gather_nodes(settings: LockSettings, *, timeout: float = DEFAULT_TIMEOUT) -> list[NodeFacts]:
    """:func:`gather_node` on every node at once, with the app's own clients; at most ``timeout`` s in all.

    The clients keep the app's ``singleton_lock_socket_timeout`` (what the workers use), so a node that answers
    more slowly than a lock needs fails here too. ``timeout`` bounds the whole of a node's checks whatever the
    client does (a connect that hangs, a client without a socket timeout): a node that has not finished by then
    is reported as not answering, and its thread is left behind (a daemon: it does not keep the process alive).
    """
    nodes = settings.nodes
    results: list[NodeFacts | None] = [None] * len(nodes)

    def work(i: int) -> None:
        results[i] = gather_node(nodes.clients[i], nodes.names[i])

    threads = [
        threading.Thread(target=work, args=(i,), name=f"locks-doctor-{i}", daemon=True) for i in range(len(nodes))
    ]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + timeout
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    return [
        r if r is not None else NodeFacts(nodes.names[i], error=f"timed out after {timeout:g} s (--timeout)")
        for i, r in enumerate(results)
    ]


# --- the nodes: the checks (pure) -----------------------------------------------------------------------------------


def _version(text: str) -> tuple[int, ...]:
    """``"7.0.15"`` -> ``(7, 0, 15)``; the leading number of each part (``"8.0-rc1"`` -> ``(8, 0)``).

    >>> _version("7.0.15"), _version("8.2.0-rc1"), _version("unknown")
    ((7, 0, 15), (8, 2, 0), ())
    """
    out: list[int] = []
    for part in text.split("."):
        digits = ""
        for char in part:
            if not char.isdigit():
                break
            digits += char
        if not digits:
            break
        out.append(int(digits))
    return tuple(out)


def _size(n: int) -> str:
    """Bytes as people write them.

    >>> _size(10 * 1024 * 1024), _size(1536), _size(100)
    ('10mb', '1.5kb', '100 bytes')
    """
    for unit, scale in (("gb", 1 << 30), ("mb", 1 << 20), ("kb", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.1f}".removesuffix(".0") + unit
    return f"{n} bytes"


def server_findings(node: str, info: Mapping[str, Any]) -> list[Finding]:
    """The server's kind and version (ok; error below Redis 5.0), and its role (error unless a writable master)."""
    out: list[Finding] = []
    if info.get("redis_mode") == "sentinel":
        return [
            Finding(
                "error",
                "node-role",
                node,
                "this address is a Sentinel daemon, not a Redis server: it cannot hold locks",
                "list the master a Sentinel set watches as redis+sentinel://HOST:26379[,HOST:PORT...]/SERVICE (see "
                "docs/nodes.md), or the Redis masters themselves; a master with replicas can lose a lock on "
                "failover: prefer independent masters",
            )
        ]
    valkey = info.get("valkey_version")
    name = "Valkey" if valkey is not None or str(info.get("server_name", "")).lower() == "valkey" else "Redis"
    version = str(valkey if valkey is not None else info.get("redis_version", "?"))
    role = str(info.get("role", "?"))
    mode = str(info.get("redis_mode", "standalone"))
    said = f"{name} {version} ({mode}, {role})"
    parsed = _version(version)
    if name == "Redis" and parsed and parsed < MIN_REDIS:
        out.append(
            Finding(
                "error",
                "server-version",
                node,
                f"{said}: older than 5.0; the lock scripts read TIME before they write, which Redis < 5.0 refuses "
                "(it replicates scripts verbatim by default), so taking over a handed-over lock and undoing a failed "
                "attempt fail",
                "upgrade the node to Redis 5.0 or later (7.x or Valkey recommended)",
            )
        )
    else:
        out.append(Finding("ok", "server-version", node, said))
    if role not in ("master", "?"):
        out.append(
            Finding(
                "error",
                "node-role",
                node,
                f"the node is a {role}: it refuses writes (READONLY), or loses them when its master resyncs it, so "
                "no lock can be taken on it",
                "list independent masters in singleton_lock_urls, never a replica",
            )
        )
    return out


def eviction_finding(node: str, maxmemory: int | str | None, policy: str | None) -> Finding | None:
    """Error when the node can evict a lock key; warning when it would as soon as a memory limit is set.

    A lock's holder record, a done marker and a cooldown are keys with a TTL; the fencing counters have none.
    ``volatile-*`` policies evict keys with a TTL when memory is full, ``allkeys-*`` any key (the counters too):
    a held lock can vanish and a second run start beside the first, a fencing token go back. ``maxmemory 0`` means
    no limit (Redis never evicts, on 64-bit builds), so the policy is dormant: a warning, not an error, as a limit
    set later (``CONFIG SET``, a provider's default) makes it live without a restart. None: the policy is unknown.

    >>> eviction_finding("n", 0, "noeviction").level
    'ok'
    >>> eviction_finding("n", 10485760, "volatile-lru").level, eviction_finding("n", 0, "allkeys-lru").level
    ('error', 'warning')
    """
    if policy is None:
        return None
    limit = int(maxmemory) if maxmemory is not None and str(maxmemory).isdigit() else None
    if policy == "noeviction":
        return Finding("ok", "eviction-policy", node, "maxmemory-policy noeviction: no lock key is ever evicted")
    if policy.startswith("volatile-"):
        what = "keys with a TTL, and every lock, done marker and cooldown is one"
    else:
        what = "any key: locks, done markers, and the fencing counters too (tokens can go back)"
    fix = (
        "set maxmemory-policy noeviction on this node (CONFIG SET maxmemory-policy noeviction, and in redis.conf or "
        "the provider's parameter group, which often defaults to volatile-lru); keep locks on a node of their own if "
        "the data there needs eviction. With noeviction a full node refuses writes: the lock is then unavailable "
        "(retried by default), never silently gone"
    )
    if limit == 0:
        return Finding(
            "warning",
            "eviction-policy",
            node,
            f"maxmemory-policy {policy} with maxmemory 0 (no limit): nothing is evicted today, but a memory limit "
            f"set later evicts {what}",
            fix,
        )
    shown = "unknown" if limit is None else _size(limit)
    return Finding(
        "error",
        "eviction-policy",
        node,
        f"maxmemory-policy {policy} with maxmemory {shown}: when memory is full the node evicts {what}; an evicted "
        "lock lets a second run start beside the first",
        fix,
    )


def persistence_finding(node: str, aof_enabled: int | str | None) -> Finding | None:
    """Warning when the append-only file is off: a restart forgets the fencing counters (and every lock).

    >>> persistence_finding("n", 1).level, persistence_finding("n", 0).level
    ('ok', 'warning')
    """
    if aof_enabled is None:
        return None
    if str(aof_enabled) == "1":
        return Finding("ok", "persistence", node, "appendonly yes: fencing counters survive a restart")
    return Finding(
        "warning",
        "persistence",
        node,
        "appendonly no: a restart empties this node (or brings back an older RDB snapshot); its fencing counters go "
        "back, so a later holder can get a token an earlier one already had, and it forgets the locks it held, "
        "which weakens the quorum of every lock held at that moment",
        "set appendonly yes (CONFIG SET appendonly yes, and in redis.conf); and keep a restarted node out for longer "
        "than the longest lock_ttl before it rejoins (delayed restart)",
    )


def clock_finding(node: str, *, before: float, server: float, after: float, max_drift: float) -> Finding:
    """Compare the node's clock with this host's: warning when they differ by more than ``max_drift`` seconds.

    ``before`` and ``after`` are this host's wall clock just before and after TIME was sent and answered; the
    node's reading lies between them, so the offset is measured against their midpoint, give or take half the
    round trip, and only an offset beyond that uncertainty counts.

    >>> clock_finding("n", before=100.0, server=100.01, after=100.02, max_drift=0.5).level
    'ok'
    >>> clock_finding("n", before=100.0, server=101.5, after=100.02, max_drift=0.5).level
    'warning'
    """
    offset = server - (before + after) / 2
    offset = 0.0 if abs(offset) < 0.0005 else offset  # not "-0.000 s"
    slack = max(0.0, after - before) / 2
    measured = f"{offset:+.3f} s (measured to +/-{slack:.3f} s)"
    if abs(offset) - slack <= max_drift:
        return Finding("ok", "clock-drift", node, f"clock within {max_drift:g} s of this host's: {measured}")
    return Finding(
        "warning",
        "clock-drift",
        node,
        f"the node's clock is {measured} off this host's (more than {max_drift:g} s): one of the two clocks is not "
        "kept in sync. Redis and Valkey store a key's expiry as a wall-clock time, so when that clock is stepped "
        "(NTP correcting it, a VM resumed, by hand) every lease on the node ends early or late: a step forward "
        "frees held locks. The lock compares no times across machines, so an offset alone is harmless; it is the "
        "sign of a clock that can jump",
        "run NTP (chrony, systemd-timesyncd) on this host and on the node, slewing rather than stepping large "
        "corrections; compare again from a worker host",
    )


def node_count_finding(count: int) -> Finding:
    """Warning for an even number of nodes: the quorum ``N // 2 + 1`` then tolerates no more failures than N-1.

    >>> [node_count_finding(n).level for n in (1, 2, 3, 4)]
    ['info', 'warning', 'ok', 'warning']
    """
    quorum = count // 2 + 1
    tolerated = count - quorum
    if count == 1:
        return Finding(
            "info",
            "node-count",
            "singleton_lock_urls",
            "1 node: no fault tolerance; while it is down no lock can be taken (tasks wait, by default)",
        )
    if count % 2:
        return Finding(
            "ok", "node-count", "singleton_lock_urls", f"{count} nodes, quorum {quorum}: {tolerated} may be down"
        )
    return Finding(
        "warning",
        "node-count",
        "singleton_lock_urls",
        f"{count} nodes, quorum {quorum}: still only {tolerated} may be down, as with {count - 1}, and an even "
        f"number can split {count // 2}/{count // 2} with no majority",
        f"use {count - 1} or {count + 1} independent nodes",
    )


def duplicate_findings(run_ids: Mapping[str, str | None]) -> list[Finding]:
    """Error for each server listed more than once (the same ``run_id`` under two URLs, e.g. two db numbers).

    The quorum counts it once per URL: one server down takes several votes with it, and one server's yes is
    counted as several.

    >>> [f.subject for f in duplicate_findings({"redis://a:1/0": "x", "redis://a:1/1": "x", "redis://b:1/0": "y"})]
    ['singleton_lock_urls']
    """
    by_id: dict[str, list[str]] = {}
    for node, run_id in run_ids.items():
        if run_id:
            by_id.setdefault(run_id, []).append(node)
    return [
        Finding(
            "error",
            "node-duplicate",
            "singleton_lock_urls",
            f"{', '.join(nodes)} are one server (run_id {run_id[:12]}...): its vote counts {len(nodes)} times toward "
            f"the quorum, so fewer independent servers than listed can make it, and its failure costs {len(nodes)} "
            "votes",
            "list each server once: Redlock needs independent nodes (another db number on the same server is "
            "the same node)",
        )
        for run_id, nodes in by_id.items()
        if len(nodes) > 1
    ]


def _hash_tag(prefix: str) -> str | None:
    """The Cluster hash tag the prefix gives every key under it, or None (Cluster hashes the first ``{...}``).

    >>> _hash_tag("{locks}:"), _hash_tag("singleton_lock:"), _hash_tag("{}:{x}"), _hash_tag("app:{locks")
    ('locks', None, None, None)
    """
    start = prefix.find("{")
    end = prefix.find("}", start + 1) if start != -1 else -1
    return prefix[start + 1 : end] if end > start + 1 else None


def _cluster_url(node: str) -> bool:
    """True for a node listed as a whole Redis Cluster (``redis+cluster://``, ``rediss+cluster://``)."""
    return node.partition("://")[0].endswith("+cluster")


def cluster_findings(prefix: str, cluster_nodes: Sequence[str]) -> list[Finding]:
    """For each node that runs in cluster mode: error when it is listed as a plain server, advice on the prefix.

    A Cluster node listed as ``redis://`` serves only its own slots and answers MOVED for the rest: most locks
    cannot be taken on it. Listed as ``redis+cluster://`` (one logical node, see docs/nodes.md), each lock goes to
    the master of its slot: a prefix without a hash tag spreads the locks over the slots (ok), one with a tag puts
    every lock in one slot, so on one shard (info). INFO, CONFIG GET and TIME reach one master of the cluster
    (the one redis-py routes them to): the other masters' settings are not read.

    >>> [f.level for f in cluster_findings("singleton_lock:", ["redis://c:7000/0"])]
    ['error']
    >>> [f.level for f in cluster_findings("app:", ["redis+cluster://c:7000"])]
    ['ok']
    >>> [f.level for f in cluster_findings("{locks}:", ["redis+cluster://c:7000"])], cluster_findings("p:", [])
    (['info'], [])
    """
    out: list[Finding] = []
    plain = [n for n in cluster_nodes if not _cluster_url(n)]
    out.extend(
        Finding(
            "error",
            "cluster-url",
            node,
            "the node runs in cluster mode but is listed as a single server: it answers MOVED for every key of a "
            "slot it does not serve, so most locks cannot be taken on it",
            f"list the whole cluster as one node: redis+cluster://{node.partition('://')[2].rsplit('/', 1)[0]} "
            "(rediss+cluster:// for TLS; see docs/nodes.md)",
        )
        for node in plain
    )
    if len(plain) == len(cluster_nodes):
        return out
    tag = _hash_tag(prefix)
    one_master = (
        "; INFO, CONFIG GET and TIME were read from one master of the cluster: check the other masters' "
        "maxmemory-policy and appendonly by hand"
    )
    if tag is None:
        out.append(
            Finding(
                "ok",
                "cluster-hash-tag",
                "singleton_lock_prefix",
                f"the prefix {prefix!r} has no hash tag: the locks spread over the cluster's slots{one_master}",
            )
        )
    else:
        out.append(
            Finding(
                "info",
                "cluster-hash-tag",
                "singleton_lock_prefix",
                f"the prefix's hash tag {{{tag}}} puts every lock in one slot, so on one shard: that shard carries all "
                f"lock traffic (a prefix without a tag spreads it){one_master}",
            )
        )
    return out


def full_coverage_finding(node: str, value: str | None) -> Finding | None:
    """Warning when a cluster node stops serving every slot once one master fails (Redis's default).

    >>> [f.level if f else f for f in (full_coverage_finding("c", v) for v in ("yes", "no", None))]
    ['warning', 'ok', None]
    """
    if value is None:
        return None
    if value == "no":
        return Finding("ok", "cluster-full-coverage", node, "cluster-require-full-coverage no")
    return Finding(
        "warning",
        "cluster-full-coverage",
        node,
        "cluster-require-full-coverage yes: once the cluster marks one failed master FAIL, every master answers "
        "CLUSTERDOWN, so every lock on the cluster goes undecided and is lost within a renewal interval, not only "
        "the failed master's",
        "CONFIG SET cluster-require-full-coverage no on every master (and in redis.conf)",
    )


def _int_or_none(value: Any) -> int | str | None:
    return value if value is None or isinstance(value, int) else str(value)


def node_findings(
    facts: Sequence[NodeFacts], *, prefix: str, max_clock_drift: float = DEFAULT_MAX_CLOCK_DRIFT
) -> list[Finding]:
    """Every node check on what :func:`gather_nodes` read, then the checks over all nodes."""
    out: list[Finding] = []
    cluster_nodes: list[str] = []
    run_ids: dict[str, str | None] = {}
    for f in facts:
        if f.error is not None:
            out.append(
                Finding(
                    "error",
                    "node-unreachable",
                    f.node,
                    f"did not answer: {f.error}",
                    "check the address, port, password or ACL user, TLS options and firewall; while fewer than a "
                    "quorum of nodes answer, no lock can be taken",
                )
            )
            continue
        info = f.info
        if "INFO" in f.unread:
            out.append(
                Finding(
                    "warning",
                    "unreadable",
                    f.node,
                    f"could not read INFO ({f.unread['INFO']}): server version, role and cluster mode not checked",
                    "allow this user INFO (ACL: +info), or check by hand that the node is a master of Redis >= 5.0",
                )
            )
        else:
            out.extend(server_findings(f.node, info))
        for name, param, expected in (
            ("maxmemory_policy", "maxmemory-policy", "noeviction"),
            ("aof_enabled", "appendonly", "yes"),
        ):
            if name not in info:
                said = {"INFO": "INFO", param: "CONFIG GET"}
                why = "; ".join(f"{said[k]}: {v}" for k, v in f.unread.items() if k in said) or "not reported"
                out.append(
                    Finding(
                        "warning",
                        "unreadable",
                        f.node,
                        f"could not read {param} ({why}): not checked",
                        f"allow this user INFO or CONFIG GET, or check by hand that {param} is {expected}",
                    )
                )
        evict = eviction_finding(
            f.node, _int_or_none(info.get("maxmemory")), _str_or_none(info.get("maxmemory_policy"))
        )
        if evict is not None:
            out.append(evict)
        persist = persistence_finding(f.node, _int_or_none(info.get("aof_enabled")))
        if persist is not None:
            out.append(persist)
        coverage = full_coverage_finding(f.node, _str_or_none(info.get("cluster_require_full_coverage")))
        if coverage is not None:
            out.append(coverage)
        if f.clock is not None:
            before, server, after = f.clock
            out.append(clock_finding(f.node, before=before, server=server, after=after, max_drift=max_clock_drift))
        elif "TIME" in f.unread:
            out.append(
                Finding(
                    "warning",
                    "unreadable",
                    f.node,
                    f"could not read TIME ({f.unread['TIME']}): clock not checked",
                    "allow this user TIME (ACL: +time)",
                )
            )
        if str(info.get("cluster_enabled", "0")) == "1":
            cluster_nodes.append(f.node)
        run_ids[f.node] = _str_or_none(info.get("run_id"))
    out.append(node_count_finding(len(facts)))
    out.extend(duplicate_findings(run_ids))
    out.extend(cluster_findings(prefix, cluster_nodes))
    return out


def _str_or_none(value: Any) -> str | None:
    return None if value is None else str(value)


# --- the Celery side (pure reads of the app's configuration: no I/O) ----------------------------------------------


def run_doctor(
    app: Any, *, max_clock_drift: float = DEFAULT_MAX_CLOCK_DRIFT, timeout: float = DEFAULT_TIMEOUT
) -> list[Finding]:
    """Every check, as ``celery -A app locks doctor`` runs them: task modules, settings, nodes, then Celery's side."""
    out: list[Finding] = []
    try:
        app.loader.import_default_modules()  # what the worker imports: imports, include, autodiscovered modules
    except Exception as exc:
        out.append(
            Finding(
                "error",
                "task-import",
                "app",
                f"importing the app's task modules failed ({_why(exc)}): the tasks checks below cover only the tasks "
                "registered so far, and a worker would not start either",
                "fix the import error (run the worker once to see its traceback)",
            )
        )
    # The worker's own start checks, the same function: what stops a worker is an error here.
    problems = start_problems(app)
    for problem in problems:
        what = "setting" if problem.code == "settings" else "task option"
        out.append(Finding("error", problem.code, problem.subject, problem.message, f"fix the {what} named above"))
    settings: LockSettings | None = None
    if not any(p.code == "settings" for p in problems):
        settings = settings_for(app)
    if settings is not None:
        facts = gather_nodes(settings, timeout=timeout)
        out.extend(node_findings(facts, prefix=settings.prefix, max_clock_drift=max_clock_drift))
    out.extend(broker_findings(app))
    return durability_findings(app, out)


def _lasting_tasks(app: Any) -> list[str]:
    """The LockedTasks whose promise rests on records kept across time: ``lock_cooldown`` (no second run within it)
    and ``lock_scope='queue'`` (no second message while one waits)."""
    from ..policies.cooldown import COOLDOWN_FEATURE  # noqa: PLC0415
    from ..task.checks import is_locked_task  # noqa: PLC0415

    try:
        tasks = dict(app.tasks)
    except Exception:  # a refused registration: reported by the start checks
        return []
    return sorted(
        name
        for name, task in tasks.items()
        if is_locked_task(task) and (COOLDOWN_FEATURE.keeps_records(task) or task.lock_scope == "queue")
    )


def durability_findings(app: Any, findings: Sequence[Finding]) -> list[Finding]:
    """``findings`` with each ``persistence`` warning made an error when the app has a task using ``lock_cooldown``
    or ``lock_scope='queue'``: a node restarted without an append-only file comes back empty (or with an older RDB
    snapshot), so with a majority restarted such a record is on fewer than a quorum and a second call runs again
    inside the cooldown (or publishes a second message), silently."""
    lasting = _lasting_tasks(app)
    if not lasting:
        return list(findings)
    named = ", ".join(lasting[:5]) + (f" and {len(lasting) - 5} more" if len(lasting) > 5 else "")
    out: list[Finding] = []
    for found in findings:
        f = found
        if f.code == "persistence" and f.level == "warning":
            f = Finding(
                "error",
                f.code,
                f.subject,
                f"appendonly no, and {named} rely on lock records kept across time (lock_cooldown or "
                "lock_scope='queue'): a restart empties this node (or brings back an older RDB snapshot), and with "
                "a majority of nodes restarted a cooldown or reservation is left on fewer than a quorum: a second "
                "call inside the cooldown runs (a second charge), with no error anywhere",
                f.fix,
            )
        out.append(f)
    return out


def summary(findings: Iterable[Finding]) -> dict[str, int]:
    """How many findings of each level, in LEVELS order."""
    counts: dict[str, int] = dict.fromkeys(LEVELS, 0)
    for f in findings:
        counts[f.level] += 1
    return counts


def to_json(findings: Sequence[Finding]) -> dict[str, Any]:
    """The ``--json`` document (see docs/cli.md): ``format``, ``ok`` (no error), ``summary``, ``findings``."""
    counts = summary(findings)
    return {
        "format": JSON_FORMAT,
        "ok": counts["error"] == 0,
        "summary": counts,
        "findings": [f.to_json() for f in findings],
    }


def format_findings(findings: Sequence[Finding]) -> str:
    """One block per subject (in order of first appearance), one line per finding with its fix, then a summary."""
    subjects: dict[str, list[Finding]] = {}
    for f in findings:
        subjects.setdefault(f.subject, []).append(f)
    width = max((len(f.code) for f in findings), default=0)
    lines: list[str] = []
    for subject, items in subjects.items():
        lines.append(subject)
        for f in items:
            lines.append(f"  {f.level.ljust(7)}  {f.code.ljust(width)}  {f.message}")
            if f.fix:
                lines.append(f"  {'':7}  {'':{width}}  fix: {f.fix}")
    counts = summary(findings)
    parts = [f"{counts['error']} error(s)", f"{counts['warning']} warning(s)", f"{counts['ok']} ok"]
    if counts["info"]:
        parts.append(f"{counts['info']} info")
    verdict = "FAILED" if counts["error"] else "passed with warnings" if counts["warning"] else "passed"
    lines.append(f"doctor {verdict}: {', '.join(parts)}")
    return "\n".join(lines)
