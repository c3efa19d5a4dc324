"""A duplicate skipped in the worker's main process, before the pool (issue 26).

In a duplicate storm every copy is handed to a pool child, traced, and answered there: a skip costs more than a
plain no-op task. Celery asks the worker's request ``revoked()`` before it hands a message to the pool (the
generated ``execute_using_pool`` in celery/worker/request.py raises TaskRevokedError when it answers True, and the
worker then only frees the pool slot: Celery's own ``revoked()`` acks, stores REVOKED and sends ``task-revoked``
itself, in ``_announce_revoked``). :meth:`LockedRequest.revoked` asks Celery's first, then :func:`skipped`.

Only the clear case is decided here; everything else goes to the child exactly as before:

* run scope, ``lock_limit`` 1, ``lock_on_duplicate="skip"``; not a chord member, not redelivered, not a retry, none
  of our own re-send headers, and handed to the pool now (an ETA/countdown message once it is due, never at
  receipt: Celery also calls ``revoked()`` at receipt for a message with ``expires``);
* a call this process saw within :data:`SEEN_FOR` s (task name and argument reprs, from the message's headers: the
  first message of a call is usually its holder, and pays one dict look-up, not even the key);
* one read-only round trip (the holder read of ``Redlock.holder()`` and ``celery locks``) with its own
  :data:`TIMEOUT`, on URL-built plain Redis nodes (not under gevent/eventlet: not measured there); skipped only
  when a quorum names a holder record of ANOTHER job in state running, and no node marks this task id done. A
  node that errs or times out opens the breaker: no pre-check for :data:`BREAKER_FOR` s.

What the caller and monitors see is the child's skip (``_delivery._Duplicate.revoke``): REVOKED naming the holder
(unless results are ignored), ``task-revoked`` with ``reason``/``holder``/``lock_skip``, ``duplicate_skipped``, and
the same "skipped duplicate" log line. ``task_prerun``/``task_postrun`` and ``task-started`` do not happen, and a
``lock_key`` function and ``duplicate_skipped`` handlers run in the main process.
"""

from __future__ import annotations

import logging
import socket
import time
from collections import OrderedDict
from typing import TYPE_CHECKING, Any, cast

from celery.worker import state as worker_state

from ..lock.nodes import NodeSet
from ..lock.record import RUNNING, _merged, done_key_for, record_of
from ..lock.scripts import STATUS as _STATUS
from ..policies.limit import LIMIT
from . import signals
from ._run import OWN_HEADERS, Context, Options, is_locked_task

if TYPE_CHECKING:
    from ..lock.config import LockSettings

__all__ = ["BREAKER_FOR", "SEEN_FOR", "TIMEOUT", "skipped"]

#: The pre-check's own deadline (s): the main process runs the event loop, a slow node must not stall it.
TIMEOUT = 0.03
#: Seconds the pre-check stays off after a node erred or timed out (the child's check decides meanwhile).
BREAKER_FOR = 30.0
#: A call seen this recently (s) by this process is checked; older or unseen calls go to the child unchecked.
SEEN_FOR = 60.0
_SEEN_MAX = 4096

# Celery's tracer logs a task's end through this logger (its "succeeded" line, which _SkipLogFilter rewrites).
trace_logger = logging.getLogger("celery.app.trace")
logger = logging.getLogger("celery_singleton_lock.task")

_seen: OrderedDict[int, float] = OrderedDict()
_nodes: dict[int, tuple[LockSettings, NodeSet | None]] = {}
_open_until = 0.0
# Whether Celery asks revoked() only once a pool slot is free to take the message (set at worker start by
# pool_started; unknown outside a worker: as before). The threads pool asks at receipt and queues the message behind
# busy threads, where it may wait past its holder's end: decided there, a copy the child would run was skipped.
_at_start = True


def pool_started(worker: Any) -> None:
    """Note whether this worker's pool hands a message to the pool only once a slot is free: prefork with putlocks
    (its semaphore) or solo (one message at a time, in the main process); elsewhere the pool child decides."""
    global _at_start  # noqa: PLW0603 - one per process
    pool_cls = getattr(worker, "pool_cls", None)
    held = bool(getattr(pool_cls, "uses_semaphore", False) and getattr(worker, "pool_putlocks", False))
    # Not on AMQP brokers (RabbitMQ): acks sent from the main process mid-storm stalled the worker's consumer for
    # ~4 s in review (Celery's own discard of expired messages at receipt stalls the same way; not diagnosed), so
    # the pool child decides there, as before.
    try:
        amqp = worker.app.connection_for_write().transport.driver_type == "amqp"
    except Exception:  # a transport we cannot inspect: as before, the child decides
        amqp = True
    solo = getattr(pool_cls, "__module__", None) == "celery.concurrency.solo"
    _at_start = (held or solo) and not amqp
    if not _wanted(worker):
        return
    if _at_start:
        why = "on (prefork with putlocks)" if held else "on (solo pool)"
    elif amqp:
        why = "off: an AMQP broker (RabbitMQ), the pool decides"
    else:
        why = f"off: the {getattr(pool_cls, '__module__', '?').rsplit('.', 1)[-1]} pool asks before a slot is free"
    logger.info("celery_singleton_lock: duplicates skipped before the pool: %s", why)


def _wanted(worker: Any) -> bool:
    """Whether the app leaves ``singleton_lock_skip_before_pool`` on (a worker's start line names it only then)."""
    try:
        return bool(worker.app.conf.get("singleton_lock_skip_before_pool", True))
    except Exception:
        return True


def _green() -> bool:
    """Whether sockets are patched (gevent/eventlet): the pre-check's blocking read would then switch greenlets."""
    return socket.socket.__module__ != "socket"


def reset() -> None:
    """Forget the keys seen and close the breaker (tests)."""
    global _open_until  # noqa: PLW0603 - one per process
    _seen.clear()
    _open_until = 0.0


def _fast_nodes(settings: LockSettings) -> NodeSet | None:
    """The lock nodes with the pre-check's short timeout (connect and read); None when they cannot have it."""
    found = _nodes.get(id(settings))
    if found is not None and found[0] is settings:
        return found[1]
    nodes: NodeSet | None = None
    # Only nodes we build from URLs, plain Redis: a client passed in keeps its own connect timeout, a Sentinel asks
    # its Sentinels first, a Cluster may move slots; none of those is a single short round trip.
    # Nor under gevent/eventlet (sockets patched): not measured there, so their pool decides, as before.
    plain = all(isinstance(u, str) for u in settings.urls) and all(settings.nodes._own) and not settings.nodes.cluster  # noqa: SLF001
    if plain and not _green():
        nodes = NodeSet(list(settings.urls), socket_timeout=min(TIMEOUT, settings.socket_timeout))
        # A URL's own socket_connect_timeout wins over ours (redis-py), and a connect is not under the read deadline:
        # a node down behind a dropped SYN would hold the event loop that long. The pool decides for such nodes.
        waits = (cast(Any, c).connection_pool.connection_kwargs.get("socket_connect_timeout") for c in nodes.clients)
        if any(w is None or w > TIMEOUT for w in waits):
            nodes = None
    _nodes[id(settings)] = (settings, nodes)
    return nodes


def _clear_case(request: Any, task: Any) -> bool:
    if task.lock_scope != "run" or not LIMIT.plain(task):
        return False
    data = request.request_dict
    if data.get("retries") or data.get("redelivered") or (request.delivery_info or {}).get("redelivered"):
        return False
    if not OWN_HEADERS.isdisjoint(data):
        return False
    # Handed to the pool now (not Celery's look at receipt, for a message with expires): the worker reserved it.
    return request in worker_state.reserved_requests


def skipped(request: Any) -> bool:
    """Decide in the main process whether ``request`` (a LockedRequest about to go to the pool) is a duplicate of a
    running job; if so, do everything the child's skip does and return True (the message is acked)."""
    global _open_until  # noqa: PLW0603 - one per process
    task = request.task
    if not is_locked_task(task):
        return False
    options = task.lock_options()
    settings = options.settings
    if (
        not (_at_start and settings.skip_before_pool)
        or options.on_duplicate != "skip"
        or not _clear_case(request, task)
    ):
        return False
    now = time.monotonic()
    if now < _open_until:
        return False
    started = time.perf_counter()
    # The gate, before the key (hashing the bound arguments costs ~30 µs, a non-duplicate's whole bill otherwise):
    # the message's argument reprs, which Celery puts in its headers. Copies of one call share them; calls that
    # differ only in arguments outside the key do not, and go to the child (where the key decides, as before).
    # A hash: reprs run up to Celery's argsrepr_maxsize; a collision only makes a message pay the key and the read.
    seen_as = hash((task.name, request.argsrepr, request.kwargsrepr))
    seen = _seen.pop(seen_as, None)
    _seen[seen_as] = now
    if len(_seen) > _SEEN_MAX:
        _seen.popitem(last=False)
    if seen is None or now - seen > SEEN_FOR:
        return False
    if request.chord:  # after the gate: reading it decodes the message's embed (~4 µs a non-duplicate would pay)
        return False
    try:
        key = Context(task, options).key(request.args or (), request.kwargs or {})
    except Exception:  # an argument the key cannot be made of: the child says so, as before
        return False
    nodes = _fast_nodes(settings)
    if nodes is None:
        return False
    # The holder read's second key is a counter it returns as a number: here this task id's done marker ('1' when
    # set), so that a copy of a job that already ran (the child stops it quietly) is never made REVOKED over it.
    answers = nodes.run(_STATUS, (key, done_key_for(key, request.id)), ())
    if any(isinstance(a, BaseException) for a in answers):
        _open_until = time.monotonic() + BREAKER_FOR
        logger.warning(
            "Duplicates of %s are checked in the pool again for %.0fs: a lock node failed or took over %.0f ms",
            task.name,
            BREAKER_FOR,
            TIMEOUT * 1000,
        )
        return False
    if any(a[2] for a in answers):
        return False
    records = [record_of(a[0]) for a in answers if a[0]]
    owners: dict[str, int] = {}
    for r in records:
        token = r.get("owner", "")
        owners[token] = owners.get(token, 0) + 1
    owner = max(owners, key=owners.__getitem__, default=None)
    if owner is None or owners[owner] < nodes.quorum:
        _seen.pop(seen_as, None)  # free: the next message of the call is likely its holder again
        return False
    record = _merged(r for r in records if r.get("owner", "") == owner)
    holder = record.get("job")
    if record.get("state") != RUNNING or not holder or holder == request.id:
        return False
    _skip(request, task, options, key, holder, time.perf_counter() - started)
    return True


def _skip(request: Any, task: Any, options: Options, key: str, holder: str, runtime: float) -> None:
    """What the child's skip does (``_delivery.duplicate`` and ``_Duplicate.revoke``), from the main process."""
    task_id = request.id
    reason = f"duplicate of {task.name} skipped: lock {key} held by task {holder}"
    # Storing REVOKED first: if the backend fails, nothing is acked yet and the child decides, as without us.
    if not (task.ignore_result or request.request_dict.get("ignore_result")):
        task.backend.mark_as_revoked(task_id, reason, request=None)
    worker_state.task_ready(request)
    request.acknowledge()
    request._already_revoked = True  # noqa: SLF001 - Celery's own mark: a second revoked() answers True at once
    try:
        Context(task, options).count("skipped")
        signals.duplicate_skipped.send(
            sender=task, key=key, task_id=task_id, holder_task_id=holder, policy="skip", request=request
        )
        # The fields LockedRequest.send_event gives the child's skip (Flower shows "exception"; ours are the rest).
        request.send_event(
            "task-revoked",
            terminated=False,
            signum=None,
            expired=False,
            exception=reason,
            reason=reason,
            holder=holder,
            lock_skip="duplicate",
        )
        if trace_logger.isEnabledFor(logging.INFO):
            trace_logger.info(
                "Task %(name)s[%(id)s] skipped duplicate in %(runtime)ss: %(reason)s",
                {"name": task.name, "id": task_id, "runtime": runtime, "reason": reason},
            )
    except Exception:  # acked: the skip stands, whatever a monitor missed
        logger.exception("telling monitors of the skip of %s[%s] failed", task.name, task_id)
