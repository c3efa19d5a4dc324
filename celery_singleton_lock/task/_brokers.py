"""Broker facts: what the broker does to a LockedTask's guarantees (its visibility timeout, native delayed delivery,
acks_late), read from the app's settings without connecting. The task side reads them at run time, the worker's
start step and ``celery locks doctor`` report them: one room both use, so the doctor never imports the task side's
internals.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal

from ..errors import ConfigurationError
from ..lock.config import settings_for
from ._run import is_locked_task

__all__ = [
    "Finding",
    "Level",
    "acks_late_finding",
    "broker_findings",
    "native_delayed_delivery",
    "queue_findings",
    "visibility_finding",
    "visibility_timeout",
]

logger = logging.getLogger("celery_singleton_lock.task")

Level = Literal["error", "warning", "ok", "info"]


@dataclass(frozen=True)
class Finding:
    """One result of one check."""

    level: Level
    code: str  # a key of CODES
    subject: str  # a node's redacted address, a task name, a setting or queue
    message: str  # what was found, and why it matters
    fix: str | None = None  # what to change (None for ok and info)

    def to_json(self) -> dict[str, str | None]:
        """A JSON-ready dict (the keys of ``--json``'s findings)."""
        return {
            "level": self.level,
            "code": self.code,
            "subject": self.subject,
            "message": self.message,
            "fix": self.fix,
        }


def visibility_timeout(app: Any) -> float | None:
    """The broker's effective visibility timeout in seconds (Redis, SQS), or None for brokers without one.

    An explicit ``broker_transport_options["visibility_timeout"]`` wins; otherwise the transport's own default
    (kombu: 3600 s for Redis, 1800 s for SQS), read from its channel class without connecting.
    """
    explicit = (app.conf.broker_transport_options or {}).get("visibility_timeout")
    if isinstance(explicit, int | float) and not isinstance(explicit, bool) and explicit > 0:
        return float(explicit)
    try:
        channel = getattr(app.connection_for_write().transport, "Channel", None)
    except Exception:  # an unknown or unimportable transport: no visibility timeout we could know of
        logger.debug("cannot read the broker transport's visibility timeout", exc_info=True)
        return None
    for attr in ("visibility_timeout", "default_visibility_timeout"):
        value = getattr(channel, attr, None)
        if isinstance(value, int | float) and not isinstance(value, bool) and value > 0:
            return float(value)
    return None


def native_delayed_delivery(app: Any) -> bool:
    """True when Celery sends countdowns through RabbitMQ's native delayed delivery (quorum queues, Celery 5.5+).

    Celery then rounds a countdown down to whole seconds, and kombu raises ValueError for one below 1 s.
    """
    try:
        from celery.utils.quorum_queues import detect_quorum_queues  # noqa: PLC0415 - Celery >= 5.5 only

        driver = app.connection_for_write().transport.driver_type
        return bool(detect_quorum_queues(app, driver)[0])
    except Exception:  # older Celery, or a transport we cannot inspect: no native delayed delivery
        logger.debug("cannot tell whether quorum queues are used", exc_info=True)
        return False


def visibility_finding(task: str, ttl: float, visibility_timeout: float | None) -> Finding:
    """Warning when a task's ``lock_ttl`` outlasts the broker's visibility timeout (Redis, SQS).

    The broker gives an unacknowledged message to another worker once it has been out for the visibility timeout:
    an ``acks_late`` run that outlasts it, the messages of a worker that died, and a message a worker holds for
    its countdown (our own re-sends too). Such a copy never runs beside its twin and is never dropped: it sees the
    lock held under its own task id and re-sends itself with a countdown of the remaining lease, capped at half the
    visibility timeout (so the waiting copy is not itself restored). With ``lock_ttl`` longer than the timeout, the
    copy of a run whose worker died can come back while the dead run's lease is still live, and waits for it: the
    job runs again up to ``lock_ttl`` after the crash, and the copy re-sends itself once per half timeout meanwhile.

    >>> visibility_finding("t", 60, 3600).level, visibility_finding("t", 7200, 3600).level
    ('ok', 'warning')
    >>> visibility_finding("t", 60, None).level
    'info'
    """
    if visibility_timeout is None:
        return Finding(
            "info",
            "visibility-timeout",
            f"task {task}",
            f"lock_ttl {ttl:g} s; the broker has no visibility timeout (not Redis or SQS): nothing to compare",
        )
    said = f"lock_ttl {ttl:g} s, broker visibility timeout {visibility_timeout:g} s"
    if ttl <= visibility_timeout:
        return Finding("ok", "visibility-timeout", f"task {task}", said)
    return Finding(
        "warning",
        "visibility-timeout",
        f"task {task}",
        f"{said}: a message the broker redelivers after the timeout (an acks_late run that outlasts it, the tasks of "
        "a worker that died) can find the lock still held under its own task id; it is not run and not dropped: it "
        f"re-sends itself, waiting at most {visibility_timeout / 2:g} s each time, until that lease ends, so a "
        f"crashed run's job can run again only up to {ttl:g} s after the crash",
        "raise broker_transport_options['visibility_timeout'] above lock_ttl and above your longest run (Celery's "
        "own advice for Redis and SQS), or lower lock_ttl: it is renewed while the task runs, so it need not cover "
        "the run's length, only how long a dead worker's lock may block the job",
    )


def _transport_import_finding(app: Any) -> Finding | None:
    """An error when kombu's transport for the broker does not import (a missing extra): the worker cannot start on
    it either, and no visibility timeout can be read from it. None when it imports."""
    try:
        app.connection_for_write().transport  # noqa: B018 - importing the transport is the check
    except ImportError as exc:
        url = app.conf.broker_write_url or app.conf.broker_url or ""
        first = url[0] if isinstance(url, list | tuple) and url else url
        scheme = str(first).split(";", 1)[0].split(":", 1)[0].split("+", 1)[0].lower()  # the scheme only: no secret
        kind = {"rediss": "redis", "sentinel": "redis"}.get(scheme, scheme or "amqp")  # kombu's extras' names
        return Finding(
            "error",
            "visibility-timeout",
            f"broker transport {kind}",
            f"kombu's {kind} transport failed to import ({exc}): the worker cannot start on this broker, and its "
            "visibility timeout cannot be read",
            f"install the transport's dependencies: pip install 'kombu[{kind}]' (what celery[{kind}] installs)",
        )
    return None


def acks_late_finding(
    task: str, *, acks_late: bool, reject_on_worker_lost: bool, retry_on_worker_lost: bool
) -> Finding:
    """Warning for ``acks_late`` without ``task_reject_on_worker_lost`` (nor Celery 5.7's ``retry_on_worker_lost``).

    >>> acks_late_finding("t", acks_late=True, reject_on_worker_lost=False, retry_on_worker_lost=False).level
    'warning'
    >>> acks_late_finding("t", acks_late=True, reject_on_worker_lost=True, retry_on_worker_lost=False).level
    'ok'
    """
    if not acks_late:
        return Finding(
            "ok", "acks-late", f"task {task}", "acks_late off: the message is acknowledged when the run starts"
        )
    if reject_on_worker_lost or retry_on_worker_lost:
        how = "task_reject_on_worker_lost" if reject_on_worker_lost else "retry_on_worker_lost"
        return Finding("ok", "acks-late", f"task {task}", f"acks_late with {how}: a run whose process dies comes back")
    return Finding(
        "warning",
        "acks-late",
        f"task {task}",
        "acks_late without task_reject_on_worker_lost: when the pool process running it dies while the worker lives "
        "on (SIGKILL, the OOM killer, a segfault), Celery does not requeue the message and stores FAILURE "
        "(WorkerLostError): the job is not run again, though its lock frees within lock_ttl",
        "set task_reject_on_worker_lost = True (or reject_on_worker_lost=True on the task): the message comes "
        "back, its copy sees the dead run's lock under the same task id, waits for that lease to end (at most "
        "lock_ttl) and runs once. Celery warns that a task which always kills its process then loops; Celery 5.7's "
        "task_retry_on_worker_lost bounds that by max_retries",
    )


def queue_findings(driver_type: str | None, queues: Iterable[tuple[str, str | None, str]]) -> list[Finding]:
    """Warning for each queue with a direct exchange when any queue is a quorum queue (RabbitMQ only).

    ``queues`` holds ``(name, x-queue-type or None, exchange type)``; the detection is Celery's own
    (``celery.utils.quorum_queues.detect_quorum_queues``: an ``amqp`` transport and a queue argument
    ``x-queue-type: quorum``).

    >>> [f.level for f in queue_findings("amqp", [("celery", "quorum", "direct")])]
    ['warning']
    >>> [f.level for f in queue_findings("amqp", [("celery", "quorum", "topic")])], queue_findings("redis", [])
    (['ok'], [])
    """
    listed = list(queues)
    if driver_type != "amqp":
        return []
    quorum = [name for name, kind, _ in listed if kind == "quorum"]
    if not quorum:
        return [Finding("ok", "quorum-direct-exchange", "broker", "no quorum queues")]
    direct = [name for name, _, exchange in listed if exchange == "direct"]
    if not direct:
        return [
            Finding("ok", "quorum-direct-exchange", "broker", f"quorum queues {', '.join(quorum)}: no direct exchange")
        ]
    return [
        Finding(
            "warning",
            "quorum-direct-exchange",
            f"queue {name}",
            f"quorum queues are in use ({', '.join(quorum)}) and queue {name} has a direct exchange: Celery's native "
            "delayed delivery cannot route a countdown through it, so every countdown sent to it (a redelivered copy "
            "waiting for its twin, a rescheduled duplicate, an outage back-off, self.retry(countdown=...)) is held "
            "by a worker until due; with quorum queues the prefetch count is static, so each waiting copy holds one "
            "of the worker's prefetch slots, and enough of them stop it taking new work",
            f"give queue {name} a topic exchange (Queue({name!r}, Exchange({name!r}, type='topic'), ...)), or set "
            "task_default_exchange_type = 'topic' for the default queue",
        )
        for name in direct
    ]


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def _flag(task: Any, attr: str, conf: Any, setting: str) -> bool:
    value = getattr(task, attr, None)
    if value is None:
        value = conf.get(setting)
    return bool(value)


def _queues(app: Any) -> tuple[str | None, list[tuple[str, str | None, str]]]:
    try:
        driver = str(app.connection_for_write().transport.driver_type)
    except Exception:  # an unknown or unimportable transport (SQS without boto3): no quorum queues to check
        return None, []
    queues = []
    for name, queue in app.amqp.queues.items():
        kind = (queue.queue_arguments or {}).get("x-queue-type")
        exchange = queue.exchange.type if queue.exchange is not None else "direct"
        queues.append((str(name), None if kind is None else str(kind), str(exchange)))
    return driver, queues


def broker_findings(app: Any) -> list[Finding]:
    """The Celery-side checks for every registered LockedTask, and the queues; no I/O (no broker connection).

    Per LockedTask (by name): ``visibility-timeout`` and ``acks-late``; then ``quorum-direct-exchange`` (RabbitMQ
    only). Returns ok findings too: keep ``f.level in ("error", "warning")`` to log only problems. Reads the tasks
    registered so far: call it once the task modules are imported (at worker start they are; the doctor imports
    them first, as the worker does).
    """
    conf = app.conf
    try:
        default_ttl: float | None = settings_for(app).ttl
    except ConfigurationError:  # reported by the doctor's "settings" finding; a task's own lock_ttl still counts
        default_ttl = None
    visibility = visibility_timeout(app)
    out: list[Finding] = []
    broken = _transport_import_finding(app) if visibility is None else None
    if broken is not None:  # "no visibility timeout" would be wrong: the transport that has one did not import
        out.append(broken)
    for name in sorted(app.tasks):
        task = app.tasks[name]
        if not is_locked_task(task):
            continue
        # As LockedTask._options resolves it: the task's lock_ttl, else singleton_lock_ttl.
        ttl = _number(task.lock_ttl) if task.lock_ttl is not None else default_ttl  # invalid: task-options
        if ttl is not None and broken is None:
            out.append(visibility_finding(name, ttl, visibility))
        out.append(
            acks_late_finding(
                name,
                acks_late=_flag(task, "acks_late", conf, "task_acks_late"),
                reject_on_worker_lost=_flag(task, "reject_on_worker_lost", conf, "task_reject_on_worker_lost"),
                retry_on_worker_lost=_flag(task, "retry_on_worker_lost", conf, "task_retry_on_worker_lost"),
            )
        )
    out.extend(queue_findings(*_queues(app)))
    return out


# --- the whole run, and its output ----------------------------------------------------------------------------------
