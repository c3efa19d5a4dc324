"""``celery -A app locks list|show|cancel|release|stats|doctor|web|health|explain``: see, cancel, force-release; probes.

The logic lives in plain functions taking a :class:`~celery_singleton_lock.config.LockSettings` (scan, merge,
release, stats, formatting), so it is testable without click; the click commands at the bottom only parse options,
print and pick the exit code. ``locks doctor``'s checks live in :mod:`celery_singleton_lock.doctor`.

A lock key holds a *holder record* (a Redis hash: ``owner``, ``fence`` and the fields its holder wrote, see
:class:`~celery_singleton_lock.redlock.Redlock`). A key's records are merged across the nodes by their ``owner``:
the lock is *held* when a quorum of nodes holds a record of the same owner, and *partial* when some nodes hold one
but no owner reaches a quorum (a lock being acquired or released right now, a failed attempt's leftovers, or a
node that lost its data). A held LockedTask lock shows the state its record names instead (running, retry-wait,
ending, cooldown). A key under the prefix that is not a holder record is *foreign*: listed, never released. Done
markers (``done_key_for(lock key, task id)``) are not locks: listed only on request. A node that does not answer
is reported by its redacted address; the others are still shown, and the exit code is 1 when fewer than a quorum
answered.
"""

from __future__ import annotations

import datetime as dt
import getpass
import json
import logging
import os
import socket
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal, TypeVar, cast

import click
from celery.bin.base import CeleryCommand, handle_preload_options
from celery.states import READY_STATES

from ..errors import ConfigurationError
from ..lock.config import LockSettings, settings_for
from ..lock.inventory import (
    _TASK_STATES,  # noqa: F401 - tests read it here
    KINDS,
    STATES,
    LockInfo,
    NodeRelease,
    NodeState,
    Report,
    burst_line,
    done_marker_of,
    format_duration,
    holder_label,
    line_of,
    list_locks,
    merge,
    read_burst,
    read_keys,
    read_stats,
    release_lock,
    scan_keys,
    show_lock,
)
from ..lock.metrics import MetricsReport, parse_since, read_metrics
from ..policies import cancel as cancel_policy
from ..policies.limit import LIMIT
from ..policies.waiting import WAITING
from .doctor import DEFAULT_MAX_CLOCK_DRIFT, DEFAULT_TIMEOUT, format_findings, run_doctor, to_json
from .health import DEFAULT_GRACE, Liveness, Readiness, liveness, readiness

__all__ = [
    "KINDS",
    "STATES",
    "LockInfo",
    "NodeRelease",
    "NodeState",
    "Report",
    "done_marker_of",
    "format_duration",
    "format_metrics",
    "format_show",
    "format_stats",
    "format_table",
    "key_of_call",
    "list_locks",
    "locks",
    "merge",
    "read_keys",
    "read_stats",
    "release_lock",
    "scan_keys",
    "show_lock",
]

logger = logging.getLogger("celery_singleton_lock.cli")

#: The environment variable holding the web page's release secret.
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "[::1]", "::1")
SECRET_ENV = "SINGLETON_LOCK_WEB_SECRET"  # noqa: S105 - a variable name, not a secret

# --- formatting ----------------------------------------------------------------------------------------------------


def _columns(rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(row[c]) for row in rows) for c in range(len(rows[0]))]
    return "\n".join("  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)).rstrip() for row in rows)


def format_table(infos: Sequence[LockInfo], now: float) -> str:
    """An aligned table, one key a row."""
    rows = [("KEY", "STATE", "KIND", "TASK", "TASK ID", "WORKER", "AGE", "TTL", "FENCE", "NODES")]
    rows += [
        (
            i.key,
            i.state,
            i.kind,
            i.task_name or "-",
            i.task_id or "-",
            holder_label(i),
            format_duration(i.age(now)),
            format_duration(i.ttl, none="never"),
            "-" if i.fencing_token is None else str(i.fencing_token),
            f"{len(i.nodes)}/{i.total}",
        )
        for i in infos
    ]
    return _columns(rows)


def _state_line(info: LockInfo, quorum: int) -> str:
    where = f"on {len(info.nodes)}/{info.total} nodes (quorum {quorum})"
    if info.state == "partial":
        what = f"{info.record['state']} record" if info.kind == "task" else f"{info.kind} record"
        return f"partial: a {what} {where}, no owner has a quorum"
    if info.kind in ("done", "rate", "foreign"):
        return f"{info.state}: {STATES[info.state]}, present on {len(info.nodes)}/{info.total} nodes"
    meaning = STATES.get(info.state, f"record state {info.state!r}")
    return f"{info.state}: {meaning}; {where}"


def format_show(key: str, info: LockInfo | None, states: Sequence[NodeState | None], quorum: int, now: float) -> str:
    """The merged state of one key, then its state on each node."""
    lines: list[str] = []
    if info is None:
        lines.append(f"{key}: not held on any node that answered")
    else:
        when = "-"
        if info.acquired_at is not None:
            stamp = dt.datetime.fromtimestamp(info.acquired_at, tz=dt.timezone.utc).isoformat(timespec="seconds")
            when = f"{stamp} ({format_duration(info.age(now))} ago)"
        fields: list[tuple[str, str]] = [("key", key), ("kind", info.kind), ("state", _state_line(info, quorum))]
        if info.kind in ("foreign", "rate"):
            fields.append(("type", f"a Redis {info.redis_type}: never released by this command"))
        elif info.kind == "done":
            fields += [("lock", info.lock_key or "-"), ("task id", info.task_id or "-")]
            fields.append(("ttl", format_duration(info.ttl, none="never")))
        else:
            fields += [
                ("task", info.task_name or "-"),
                ("task id", info.task_id or "-"),
                ("producer" if info.state in ("queued", "sending") else "worker", info.worker or "-"),
                ("acquired", when),
                ("ttl", format_duration(info.ttl, none="never")),
                ("fencing token", "-" if info.fencing_token is None else str(info.fencing_token)),
                ("owner", info.owner or "-"),
            ]
            if info.waiting:
                fields.append(("waiting", "yes: a redelivered copy of this task id waits for this run"))
        width = max(len(name) for name, _ in fields)
        lines += [f"{name.ljust(width)}  {value}" for name, value in fields]
    lines.append("")
    rows = [("NODE", "OWNER", "STATE", "FENCE", "TTL")]
    for state in states:
        if state is None:
            continue  # reported as an error line
        ttl = format_duration(None if state.ttl_ms == -1 else state.ttl_ms / 1000.0, none="never")
        if state.owner is not None:
            shown = state.record.get("state", "-")
            rows.append((state.node, state.owner, shown, str(state.fence) if state.fence else "-", ttl))
        elif state.present:
            rows.append((state.node, f"(a Redis {state.redis_type}, no holder record)", "-", "-", ttl))
        else:
            rows.append((state.node, "(not held)", "-", "-", "-"))
    if len(rows) > 1:
        lines.append(_columns(rows))
    return "\n".join(lines)


def format_stats(totals: Mapping[str, int]) -> str:
    """One counter a line, aligned."""
    width = max(len(name) for name in totals)
    return "\n".join(f"{name.ljust(width)}  {n}" for name, n in totals.items())


def format_metrics(found: MetricsReport, since: str | None = None) -> str:
    """One task a row, one outcome a column (only outcomes that happened), then the total; the mean wait."""
    period = f"in the last {since}" if since else "since the counts began"
    if not found.tasks:
        return f"no lock outcomes counted {period}"
    total = found.total
    columns = list(total)
    rows = [("TASK", *(c.upper() for c in columns), "MEAN WAIT")]
    for task, counts in found.tasks.items():
        ms, n = found.waits.get(task, (0, 0))
        rows.append(
            (task or "-", *(str(counts.get(c, 0)) for c in columns), format_duration(ms / 1000 / n) if n else "-")
        )
    rows.append(("(total)", *(str(total[c]) for c in columns), ""))
    return f"lock outcomes {period}\n" + _columns(rows)


# --- the click layer -----------------------------------------------------------------------------------------------

F = TypeVar("F", bound=Callable[..., Any])
_preload = cast(Callable[[F], F], handle_preload_options)


def _seconds_option(name: str, default: float, help_text: str, minimum: float = 0.0) -> Callable[[F], F]:
    """A ``--NAME SECONDS`` option (a float >= ``minimum``, its default shown in ``--help``)."""
    return click.option(name, type=click.FloatRange(min=minimum), default=default, show_default=True, help=help_text)


def _settings(ctx: click.Context) -> LockSettings:
    try:
        return settings_for(ctx.obj.app)
    except ConfigurationError as exc:
        raise click.ClickException(str(exc)) from None


def _who() -> str:
    try:
        user = getpass.getuser()
    except (OSError, KeyError, ImportError):  # no login name (a container with an unknown uid)
        user = f"uid {os.getuid()}" if hasattr(os, "getuid") else "unknown"
    return f"{user}@{socket.gethostname()} (pid {os.getpid()})"


def _report_errors(ctx: click.Context, report: Report[Any]) -> None:
    """Print one line per node that did not answer; exit 1 after the output when fewer than a quorum answered."""
    for error in report.errors:
        ctx.obj.error(f"error: node {error.node} did not answer: {error.error}")
    if not report.ok:
        ctx.obj.error(
            f"error: only {report.answered} of {report.total} node(s) answered (quorum {report.quorum}): "
            "the result is incomplete"
        )


def _finish(ctx: click.Context, report: Report[Any]) -> None:
    """Report the nodes that did not answer; exit 1 when any did not (what they hold is missing from the output,
    even when a quorum answered: a script must not read an incomplete listing as complete)."""
    _report_errors(ctx, report)
    if report.errors:
        ctx.exit(1)


@click.group(name="locks")
@click.pass_context
@_preload
def locks(ctx: click.Context, /, **kwargs: Any) -> None:
    """Inspect and force-release celery_singleton_lock locks (singleton_lock_* settings of the app)."""


@locks.command(name="list", cls=CeleryCommand)
@click.option("--json", "as_json", is_flag=True, help="Print a JSON list (for scripts).")
@click.option("--match", default="*", show_default=True, help="Glob on the key after the prefix, e.g. 'reports.*'.")
@click.option("--done", is_flag=True, help="Also list the done markers of finished task ids (not locks).")
@click.pass_context
def list_command(ctx: click.Context, *, as_json: bool, match: str, done: bool) -> None:
    """Every lock under the app's prefix, merged across the nodes."""
    settings = _settings(ctx)
    report = list_locks(settings, match=match, done=done)
    now = time.time()
    if as_json:
        ctx.obj.echo(json.dumps([i.to_json(now) for i in report.value], indent=2))
    elif report.value:
        ctx.obj.echo(format_table(report.value, now))
    else:
        matching = "" if match == "*" else f" matching {match!r}"
        ctx.obj.echo(f"no {'locks or done markers' if done else 'locks'} under {settings.prefix!r}{matching}")
    if not as_json:
        for key, task_id, by, expires in cancel_policy.pending(settings.nodes, settings.prefix):
            left = format_duration(expires - now)
            ctx.obj.echo(f"pending cancel  task {task_id} (lock {key}) by {by}: for {left} more")
    _finish(ctx, report)


def _json_arg(value: str, option: str, kind: type) -> Any:
    """``value`` parsed as a JSON array (``kind`` list) or object (dict); a one-line usage error naming ``option``."""
    example = "'[1, \"x\"]'" if kind is list else "'{\"a\": 1}'"
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError as exc:
        raise click.BadParameter(f"not JSON ({exc.msg}): e.g. {example}", param_hint=option) from None
    if not isinstance(parsed, kind):
        raise click.BadParameter(
            f"must be a JSON {'array' if kind is list else 'object'}, e.g. {example}", param_hint=option
        )
    return parsed


def call_options(*, task: Literal["option", "argument"]) -> Callable[[F], F]:
    """A call named as ``celery call`` takes it, for every command that names one (show, cancel, explain): the
    task's name (``--task NAME``, or the ``TASK`` argument), ``-a/--args`` a JSON array and ``-k/--kwargs`` a JSON
    object, parsed here (the command gets ``task_name``, ``call_args`` a list, ``call_kwargs`` a dict; arguments
    that are not JSON are a one-line usage error naming the option)."""

    def decorate(command: F) -> F:
        command = click.option(
            "-k",
            "--kwargs",
            "call_kwargs",
            default="{}",
            show_default=True,
            callback=lambda _ctx, _param, value: _json_arg(value, "--kwargs", dict),
            help="The call's keyword arguments, a JSON object: '{\"a\": 1}'.",
        )(command)
        command = click.option(
            "-a",
            "--args",
            "call_args",
            default="[]",
            show_default=True,
            callback=lambda _ctx, _param, value: _json_arg(value, "--args", list),
            help="The call's positional arguments, a JSON array: '[1, \"x\"]'.",
        )(command)
        if task == "argument":
            return click.argument("task_name", metavar="TASK")(command)
        help_text = "Instead of KEY: the task of a call, e.g. shop.charge."
        return click.option("--task", "task_name", default=None, help=help_text)(command)

    return decorate


def key_of_call(app: Any, task_name: str, args: Sequence[Any], kwargs: Mapping[str, Any]) -> str:
    """The lock key a call ``task_name(*args, **kwargs)`` takes (the arguments as :func:`call_options` parsed
    them); a one-line :class:`click.ClickException` for an unknown task, a task that is no LockedTask, or arguments
    that do not fit the task's key."""
    import difflib  # noqa: PLC0415

    tasks = app.tasks
    task = tasks.get(task_name)
    if task is None:
        close = difflib.get_close_matches(task_name, [n for n in tasks if not n.startswith("celery.")], n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise click.ClickException(f"--task: no task named {task_name!r} in this app{hint}")
    if not callable(getattr(task, "lock_key_for", None)):
        raise click.ClickException(f"--task: {task_name} is not a LockedTask: it takes no lock")
    try:
        return str(task.lock_key_for(*args, **kwargs))
    except (TypeError, ValueError, ConfigurationError) as exc:
        raise click.ClickException(f"--task {task_name}: these arguments give no lock key: {exc}") from None


@locks.command(name="show", cls=CeleryCommand)
@click.argument("key", required=False)
@call_options(task="option")
@click.option("--json", "as_json", is_flag=True, help="Print JSON (for scripts).")
@click.pass_context
def show_command(
    ctx: click.Context,
    key: str | None,
    *,
    task_name: str | None,
    call_args: list[Any],
    call_kwargs: dict[str, Any],
    as_json: bool,
) -> None:
    """One KEY's holder and its state on each node; or the key a call takes (--task NAME --args '[7]').

    Exit status 1 when nothing is under the key (no lock, burst or line) or a node did not answer.
    """
    if (key is None) == (task_name is None):
        raise click.UsageError("give a KEY or --task NAME (with --args/--kwargs), not both")
    settings = _settings(ctx)
    if task_name is not None:
        key = key_of_call(ctx.obj.app, task_name, call_args, call_kwargs)
        if not as_json:
            ctx.obj.echo(f"{task_name}(*{json.dumps(call_args)}, **{json.dumps(call_kwargs)}) locks {key}")
    assert key is not None
    report = show_lock(settings, key)
    info, states = report.value
    now = time.time()
    # lock_debounce's pending burst, and the waiting line against its cap (lock_max_waiting of the key's task).
    burst = read_burst(settings, key)
    waiting = line_of(settings, key)
    name = (info.task_name if info is not None else None) or (burst.task_name if burst is not None else None)
    task = ctx.obj.app.tasks.get(name) if name else None
    cap = WAITING.cap(task)
    if as_json:
        lock = None if info is None else info.to_json(now)
        ctx.obj.echo(
            json.dumps(
                {
                    "lock": lock,
                    "nodes": [s.to_json() for s in states if s is not None],
                    "burst": None if burst is None else burst.to_json(now),
                    "line": {"waiting": waiting, "cap": cap},
                },
                indent=2,
            )
        )
    else:
        ctx.obj.echo(format_show(key, info, states, settings.nodes.quorum, now))
        if burst is not None:
            ctx.obj.echo(f"pending burst  {burst.state}: {burst_line(burst)}")
        if waiting:
            ctx.obj.echo(f"waiting line   {waiting} waiting" + WAITING.shown(cap))
    _finish(ctx, report)
    if info is None and burst is None and not waiting:
        ctx.exit(1)  # nothing under this key: a script asking "is it held?" gets no


@locks.command(name="cancel", cls=CeleryCommand)
@click.argument("key", required=False)
@call_options(task="option")
@click.option("--id", "task_id", default=None, help="The job's task id (alone: looked up among the locks held).")
@click.option(
    "--ttl",
    type=click.FloatRange(min=1.0),
    default=cancel_policy.DEFAULT_TTL,
    show_default=True,
    help="Seconds the cancel lasts: a queued copy arriving later runs.",
)
@click.pass_context
def cancel_command(
    ctx: click.Context,
    key: str | None,
    *,
    task_name: str | None,
    call_args: list[Any],
    call_kwargs: dict[str, Any],
    task_id: str | None,
    ttl: float,
) -> None:
    """Cancel one job durably: the job holding KEY, or a call's (--task NAME --args '[7]'), or --id TASK_ID.

    Written on the lock nodes for --ttl seconds: a running body is stopped within one renewal interval (REVOKED
    "cancelled (by locks cancel ...)"), its queued copies are dropped when they reach any worker, a queue-scope
    reservation is freed. Exit status 1 when no job was found or fewer than a quorum of nodes hold the cancel.
    """
    if key is not None and task_name is not None:
        raise click.UsageError("give a KEY or --task NAME (with --args/--kwargs), not both")
    if key is None and task_name is None and task_id is None:
        raise click.UsageError("give a KEY, --task NAME (with --args/--kwargs) or --id TASK_ID")
    settings = _settings(ctx)
    app = ctx.obj.app
    if task_name is not None:
        key = key_of_call(app, task_name, call_args, call_kwargs)
    if key is None:  # --id alone: the lock that names it
        held = [i for i in list_locks(settings).value if i.task_id == task_id and i.kind == "task"]
        if not held:
            ctx.obj.error(
                f"error: no lock names task {task_id}: give --task NAME --args/--kwargs of its call to cancel a "
                "queued message"
            )
            ctx.exit(1)
        key, task_name = held[0].lock_key or held[0].key, held[0].task_name
    assert key is not None
    info, _ = show_lock(settings, key).value
    if task_id is None:
        task_id = info.task_id if info is not None else None
        if task_id is None:
            ctx.obj.error(f"error: no job holds {key}: nothing to cancel (a queued message: give its --id)")
            ctx.exit(1)
    assert task_id is not None
    name = task_name or (info.task_name if info is not None else None)
    task = app.tasks.get(name) if name else None
    limit = 1
    if task is not None and callable(getattr(task, "lock_context", None)):  # a LockedTask: the slots to look at
        limit = LIMIT.static(task)
        if task_name is not None:
            limit = task.lock_context().limit_for(tuple(call_args), call_kwargs) or 1
    try:
        ended = app.backend.get_state(task_id) in READY_STATES
    except Exception:  # no usable result backend: the done marker alone tells
        ended = False
    if ended:
        report = cancel_policy.CancelReport(key, task_id, "ended", 0, len(settings.nodes), settings.nodes.quorum)
    else:
        by = f"locks cancel by {_who()}"
        report = cancel_policy.cancel_job(settings.nodes, settings.prefix, key, task_id, by=by, ttl=ttl, limit=limit)
        logger.warning("cancel of task %s (lock %s) %s", task_id, key, report)
    ctx.obj.echo(str(report))
    for error in report.errors:
        ctx.obj.error(f"error: a node did not answer: {error}")
    if not report.durable:
        ctx.exit(1)


@locks.command(name="release", cls=CeleryCommand)
@click.argument("key")
@click.option("--yes", "-y", "yes", is_flag=True, help="Do not ask for confirmation.")
@click.pass_context
def release_command(ctx: click.Context, key: str, *, yes: bool) -> None:
    """Force-release KEY on every node (only the holder read now is deleted, never a newer one)."""
    settings = _settings(ctx)
    seen = show_lock(settings, key)
    info, states = seen.value
    if not any(s is not None and s.owner is not None for s in states):
        if info is None:
            ctx.obj.echo(f"{key}: not held on any node that answered, nothing to release")
            _finish(ctx, seen)
            return
        ctx.obj.echo(format_show(key, info, states, settings.nodes.quorum, time.time()))
        why = "a done marker" if info.kind == "done" else "not a holder record of celery_singleton_lock"
        ctx.obj.error(f"error: {key} is {why}: not released (this command only deletes locks)")
        _report_errors(ctx, seen)
        ctx.exit(1)
    if not key.startswith(settings.prefix):
        # Prefixes never nest (config.check_prefix): a key not under this app's prefix is another app's lock.
        ctx.obj.error(f"error: {key} is not under this app's prefix {settings.prefix!r}: not released (use its -A)")
        ctx.exit(1)
    ctx.obj.echo(format_show(key, info, states, settings.nodes.quorum, time.time()))
    _report_errors(ctx, seen)
    if not yes and not click.confirm(f"\nForce-release {key} on every node?", default=False):
        ctx.obj.echo("aborted: nothing released")
        ctx.exit(1)
    report = release_lock(settings, key, states)
    outcomes = Counter(r.outcome for r in report.value)
    summary = ", ".join(f"{n} {outcome}" for outcome, n in outcomes.items())
    holder = f"{info.state} {info.kind}" if info is not None else "unknown"
    if info is not None and info.task_id:
        holder += f" {info.task_name or '?'}[{info.task_id}]"
    logger.warning("forced release of lock %s (%s) by %s: %s", key, holder, _who(), summary)
    for result in report.value:
        ctx.obj.echo(str(result))
    ctx.obj.echo(f"released on {outcomes['released']} of {len(report.value)} node(s)")
    if not report.ok:
        ctx.obj.error(f"error: fewer than a quorum ({report.quorum}) of the nodes answered: the lock may still be held")
        ctx.exit(1)


@locks.command(name="stats", cls=CeleryCommand)
@click.option("--json", "as_json", is_flag=True, help="Print a JSON object (for scripts).")
@click.option("--since", "since", default=None, help="Only the last period: 30s, 10m, 2h, 1d (at most 24h).")
@click.pass_context
def stats_command(ctx: click.Context, *, as_json: bool, since: str | None) -> None:
    """The workers' lock outcomes per task, summed over the nodes (flushed every few seconds).

    Without --since: since the counts began; with it: the last period, in whole minutes.
    """
    settings = _settings(ctx)
    try:
        period = None if since is None else parse_since(since)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--since") from None
    found = read_metrics(settings.nodes, settings.prefix, period)
    report = Report(found, found.errors, len(settings.nodes), settings.nodes.quorum)
    if as_json:
        ctx.obj.echo(json.dumps(found.to_json(), indent=2))
    else:
        ctx.obj.echo(format_metrics(found, since))
    _finish(ctx, report)


@locks.command(name="web", cls=CeleryCommand)
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on (keep it local).")
@click.option("--port", type=click.IntRange(0, 65535), default=8089, show_default=True, help="Port (0: any free).")
@click.option("--refresh", type=click.FloatRange(min=0.0), default=5.0, show_default=True, help="Page refresh (s).")
@click.option(
    "--allowed-host",
    "allowed_host",
    multiple=True,
    help="A host name requests may name in their Host header (repeatable); the bound address and the loopback "
    "names always are.",
)
@click.pass_context
def web_command(ctx: click.Context, *, host: str, port: int, refresh: float, allowed_host: tuple[str, ...]) -> None:
    """Serve the locks page at / and Prometheus metrics at /metrics (stdlib WSGI server).

    Read-only unless the environment variable SINGLETON_LOCK_WEB_SECRET holds a secret (16+ characters): then a
    held lock can be released from the page by whoever types that secret.
    """
    from .web import make_app, serve  # noqa: PLC0415 - only this command needs the page

    settings = _settings(ctx)
    secret = os.environ.get(SECRET_ENV) or None
    try:
        # Only the names the server is meant to be reached by: no DNS rebinding of a web site onto the page (its
        # name re-resolved to this address), no Host header a proxy or cache could be fooled by.
        allowed = _allowed_hosts(host, allowed_host)
        app = make_app(ctx.obj.app, secret=secret, refresh=refresh, allowed_hosts=allowed)
    except ConfigurationError as exc:
        raise click.ClickException(f"{exc} (set in {SECRET_ENV})") from None
    try:
        server = serve(app, host, port)
    except OSError as exc:  # the port is in use, the address is not this host's, a port below 1024 unprivileged
        why = exc.strerror or str(exc)
        raise click.ClickException(
            f"locks web cannot listen on {host}:{port}: {why} (pick another --port, or --port 0 for any free one)"
        ) from None
    bound_host, bound_port = server.server_address[:2]
    mode = "releases need the secret" if secret else f"read-only (set {SECRET_ENV} to allow releases)"
    ctx.obj.echo(f"locks web for {settings.prefix!r} on http://{bound_host}:{bound_port}/ ({mode}); Ctrl-C stops")
    ctx.obj.echo(f"answering Host names: {', '.join(allowed)} (add one with --allowed-host)")
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()


def _allowed_hosts(host: str, extra: Sequence[str]) -> tuple[str, ...]:
    """The Host names ``locks web`` answers: the loopback names, the bound address (a wildcard address: this
    machine's names), and ``extra`` (``--allowed-host``); an IPv6 address as a Host names it in brackets."""
    names = [*LOOPBACK_HOSTS, host]
    if host in ("", "0.0.0.0", "::"):  # noqa: S104 - compared, not bound
        names += [socket.gethostname(), socket.getfqdn()]
    names += [h.strip() for h in extra if h.strip()]
    names += [f"[{n}]" for n in names if ":" in n and not n.startswith("[")]
    return tuple(dict.fromkeys(n.lower() for n in names if n))


# --- locks health (the probes live in celery_singleton_lock.health) ------------------------------------------------


@locks.command(name="health", cls=CeleryCommand)
@click.option("--readiness", "probe", flag_value="readiness", default=True, help="A quorum of lock nodes answers.")
@click.option("--liveness", "probe", flag_value="liveness", help="The worker's watchdog (or beat) writes its file.")
@click.option("--file", "path", default=None, help="The liveness file (default: singleton_lock_liveness_file).")
@_seconds_option("--grace", DEFAULT_GRACE, "Seconds a heartbeat may be later than it said before the probe fails.")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON object (for scripts).")
@click.pass_context
def health_command(ctx: click.Context, *, probe: str, path: str | None, grace: float, as_json: bool) -> None:
    """A probe for Kubernetes: exit 0 when healthy, 1 with one line saying why not.

    --readiness (the default): at least a quorum of the lock nodes answers (each asked once, at the same time,
    within singleton_lock_socket_timeout). --liveness: the heartbeat file a worker's lock watchdog or a beat
    under the singleton scheduler rewrites is not overdue (see docs/ops.md).
    """
    settings = _settings(ctx)
    found: Readiness | Liveness
    if probe == "liveness":
        path = path or settings.liveness_file
        if not path:
            raise click.UsageError("--liveness needs a file: set singleton_lock_liveness_file or pass --file PATH")
        found = liveness(path, grace=grace)
        ok = found.ok
    else:
        found = readiness(settings)
        ok = found.ready
    if as_json:
        ctx.obj.echo(json.dumps(found.to_json()))
    elif ok:
        ctx.obj.echo(found.line())
    else:
        ctx.obj.error(found.line())
    if not ok:
        ctx.exit(1)


# --- locks explain (the reading lives in celery_singleton_lock.explain) ---------------------------------------------


@locks.command(name="explain", cls=CeleryCommand)
@call_options(task="argument")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON object (for scripts).")
@click.pass_context
def explain_command(
    ctx: click.Context, task_name: str, *, call_args: list[Any], call_kwargs: dict[str, Any], as_json: bool
) -> None:
    """What would happen to TASK called with these arguments now, and why (Celery's `call` convention).

    Its key; who holds it (task id, worker, since when, fencing token); the waiting line and its cap; the rate
    windows and when a share frees; a cooldown, a pending debounced burst, done markers; each node's answer when
    the nodes disagree. Reads only. Exit 1 when fewer than a quorum of the nodes answered.
    """
    from .explain import explain, format_explanation  # noqa: PLC0415 - only this command needs it

    try:
        found = explain(ctx.obj.app, task_name, call_args, call_kwargs)
    except ConfigurationError as exc:
        raise click.ClickException(str(exc)) from None
    except TypeError as exc:  # the arguments do not fit the task's signature
        raise click.BadParameter(f"{task_name}: {exc}", param_hint="--args/--kwargs") from None
    now = time.time()
    if as_json:
        ctx.obj.echo(json.dumps(found.to_json(now), indent=2))
    else:
        ctx.obj.echo(format_explanation(found, now))
    if found.verdict == "unavailable":
        ctx.exit(1)


# --- locks doctor (the checks live in celery_singleton_lock.doctor) --------------------------------------------------


@locks.command(name="doctor", cls=CeleryCommand)
@click.option("--json", "as_json", is_flag=True, help="Print a JSON document (for scripts; see docs/cli.md).")
@_seconds_option(
    "--max-clock-drift", DEFAULT_MAX_CLOCK_DRIFT, "Seconds a node's clock may differ from this host's before a warning."
)
@_seconds_option(
    "--timeout", DEFAULT_TIMEOUT, "Seconds all checks of one node may take (the nodes are checked at once).", 0.1
)
@click.pass_context
def doctor_command(ctx: click.Context, *, as_json: bool, max_clock_drift: float, timeout: float) -> None:
    """Check the lock nodes and the app's Celery settings against the library's assumptions.

    Exit status 1 when any check finds an error, 0 otherwise (warnings included).
    """
    findings = run_doctor(ctx.obj.app, max_clock_drift=max_clock_drift, timeout=timeout)
    if as_json:
        ctx.obj.echo(json.dumps(to_json(findings), indent=2))
    else:
        ctx.obj.echo(format_findings(findings))
    if any(f.level == "error" for f in findings):
        ctx.exit(1)
