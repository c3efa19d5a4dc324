"""What monitors see of a delivery that did not run: the Skipped marker, the worker's log line, Celery's events.

Deciding in ``before_start`` and returning early from ``__call__`` costs about as much as a no-op task; raising
``Ignore`` or ``Reject`` from ``before_start`` costs ~35-47x that (the tracer builds and formats a traceback), and
a duplicate storm is all skips. A delivery that does not run therefore returns a :class:`Skipped` marker from
``__call__`` with ``request.ignore_result`` set, so the tracer stores nothing over the outcome we stored (or over
the twin's), and its callbacks, chain and chord are cleared (the re-sent copy carries them). The worker's main
process sees only the marker's repr: :class:`LockedRequest` turns it into the right event, and a log filter into
the right line.
"""

from __future__ import annotations

import logging
from typing import Any, ClassVar

from billiard.einfo import ExceptionWithTraceback
from billiard.exceptions import WorkerLostError
from celery.signals import worker_process_shutdown, worker_shutdown
from celery.worker.request import Request

from ..lock.renewal import flush_stats
from . import _handover as handover
from . import _preskip as preskip
from ._run import HOST, SKIP_MARK, Skipped, is_locked_task

__all__ = ["KIND_EVENT", "SKIP_MARK", "LockedRequest", "Skipped", "parse_skipped"]

logger = logging.getLogger("celery_singleton_lock.task")

#: The Celery event a worker sends for each kind of Skipped, instead of task-succeeded (None: no event at all).
KIND_EVENT: dict[str, str | None] = {
    "duplicate": "task-revoked",  # another job holds the lock: REVOKED
    "settled": "task-revoked",  # a copy of a job whose run succeeded but was killed before storing its result
    "cancelled": "task-revoked",  # a running job stopped for a newer call (lock_on_duplicate="cancel")
    "deferred": "task-retried",  # a first delivery re-sent to run later (reschedule, replace, outage back-off, ...)
    # A copy of a job that succeeded, or one waiting for its twin: the task id's state is its twin's, so nothing is
    # said (a task-retried after the twin's task-succeeded would turn SUCCESS into RETRY in Celery's event state).
    "done": None,
    "waiting": None,
}


def parse_skipped(text: str) -> tuple[str, str | None, str] | None:
    """``(kind, holder task id, reason)`` from a :class:`Skipped` repr (what the worker's main process sees).

    A repr cut short keeps its kind; the holder is None when its id was cut, and the reason is what is left.
    """
    if not text.startswith(SKIP_MARK):
        return None
    kind, colon, rest = text[len(SKIP_MARK) :].partition(":")
    if kind not in KIND_EVENT or not colon:
        return None
    size, colon, rest = rest.partition(":")
    if not colon or not size.isdigit() or len(rest) < int(size):
        return kind, None, ""
    holder, reason = rest[: int(size)], rest[int(size) + 1 :]
    return kind, holder or None, reason.removesuffix(">")


class _SkipLogFilter(logging.Filter):
    """Rewrite Celery's "Task x[id] succeeded in ...: <Skipped ...>" line to say what happened instead."""

    _SAYS: ClassVar[dict[str, str]] = {
        "duplicate": "skipped duplicate",
        "done": "skipped: already done",
        "settled": "skipped: already done, result lost",
        "cancelled": "cancelled",
        "deferred": "deferred",
        "waiting": "deferred",
    }

    def filter(self, record: logging.LogRecord) -> bool:
        data = record.args
        if isinstance(data, dict):
            value = data.get("return_value")
            if isinstance(value, str) and value.startswith(SKIP_MARK):
                parsed = parse_skipped(value)
                if parsed is not None:
                    kind, _, reason = parsed
                    record.msg = "Task %(name)s[%(id)s] " + self._SAYS[kind] + " in %(runtime)ss: %(reason)s"
                    record.args = {**data, "reason": reason}
        return True


# Celery's tracer logs a task's success through this logger (celery/app/trace.py, LOG_SUCCESS).
logging.getLogger("celery.app.trace").addFilter(_SkipLogFilter())


@worker_process_shutdown.connect(weak=False)  # type: ignore[untyped-decorator]
@worker_shutdown.connect(weak=False)  # type: ignore[untyped-decorator]
def _flush_stats_at_exit(**_: Any) -> None:
    """A pool child exits (worker_max_tasks_per_child, shutdown), or the worker's main process does (its skips
    before the pool; every count of a threads or solo worker), with up to 5 s of unflushed counters: flush them."""
    try:
        flush_stats()
    except Exception:  # never block a child's exit; the counters are only statistics
        logger.debug("flushing lock counters at exit failed", exc_info=True)


class LockedRequest(Request):  # type: ignore[misc]
    """The worker's request for a LockedTask: when its pool child is killed, end the dead run's lease within ~1 s.

    Celery handles a hard time limit in the worker's main process (``Request.on_timeout``), and a pool child that
    died mid-task (SIGKILL, the OOM killer: ``on_failure`` with ``WorkerLostError``) there too, where this request
    knows the pool child that ran the task (``worker_pid``); ``after_return`` there is given no request, so it
    could not tell the killed run from another delivery of the same task id. A task that names its own ``Request``
    class must subclass this one.
    """

    def send_event(self, type_: str, **fields: Any) -> None:
        """Report a delivery that returned a :class:`Skipped` marker as what it was, not as a success.

        The pool child's tracer hands the main process only the repr of the return value, and the main process
        sends ``task-succeeded`` from there (``Request.on_success``): a skip becomes ``task-revoked`` (REVOKED in
        Flower and ``celery events``) and a re-send ``task-retried`` (RETRY, until the re-sent copy's own events),
        each with ``reason``, ``holder`` (the holder's task id, when there is one) and ``lock_skip`` (the kind).
        """
        if type_ == "task-succeeded":
            result = fields.get("result")
            if isinstance(result, str) and result.startswith(SKIP_MARK):
                parsed = parse_skipped(result)
                if parsed is not None:
                    kind, holder, reason = parsed
                    event = KIND_EVENT[kind]
                    if event is None:
                        return
                    extra = {"reason": reason, "holder": holder, "lock_skip": kind}
                    if event == "task-retried":
                        fields = {"exception": reason, "traceback": "", **extra}
                    else:
                        # Flower shows only Celery's own task fields: the reason goes in "exception" too.
                        fields = {"terminated": False, "signum": None, "expired": False, "exception": reason, **extra}
                    type_ = event
        super().send_event(type_, **fields)

    def revoked(self) -> bool:
        """Celery's answer first (revoked by id or stamp, expired); then a duplicate of a running job is skipped
        here, in the worker's main process, before the pool (see :mod:`celery_singleton_lock.task._preskip`)."""
        if super().revoked():
            return True
        try:
            return preskip.skipped(self)
        except Exception:  # never lose a message to the pre-check: the child decides, as without it
            logger.exception("the pre-check of %s[%s] failed; the pool child decides", self.name, self.id)
            return False

    def on_timeout(self, soft: bool, timeout: float) -> None:  # noqa: FBT001 - Celery's signature
        super().on_timeout(soft, timeout)
        if not soft:
            self._end_killed_run()

    def on_failure(self, exc_info: Any, send_failed_event: bool = True, return_ok: bool = False) -> None:  # noqa: FBT001, FBT002 - Celery's signature
        """A pool child that died running this request (``WorkerLostError``): end its run's lease now, before Celery
        requeues the message (``reject_on_worker_lost``), so the redelivery waits ~1 s, not the dead run's lease.

        Safe because the child is known dead here: billiard reports ``WorkerLostError`` only for a child whose exit
        it has reaped (``_join_exited_workers``, then ``worker_lost_wait`` s for a result it may have sent), and a
        dead child renews nothing. A paused child (SIGSTOP, a debugger, swapped out) has not exited: no
        ``WorkerLostError``, and its lease stands (it ends within ttl if the pause outlasts it). A job that raised
        ``SystemExit`` itself reaches Celery as such (turned into ``WorkerLostError`` inside Celery's handler, not
        before): its body has ended and released already, and is not touched here.
        """
        exc = getattr(exc_info, "exception", None)
        if isinstance(exc, ExceptionWithTraceback):
            exc = exc.exc
        if isinstance(exc, WorkerLostError):
            self._end_killed_run()
        super().on_failure(exc_info, send_failed_event=send_failed_event, return_ok=return_ok)

    def _end_killed_run(self) -> None:
        """End the lease of this request's run in the pool child just killed (owner-checked by that child's pid and
        the task id: see ``_handover.end_lease_of``), and count it."""
        task = self.task
        if not is_locked_task(task) or not self.worker_pid:
            return  # never accepted by a child: no body ran, nothing was held
        try:
            ctx = task.lock_context()
            ctx.count("killed")
            args, kwargs = self.args or (), self.kwargs or {}
            limit = ctx.limit_for(args, kwargs)
            if limit is None:  # lock_limit=None: a rate only, no lock held
                return
            key = ctx.key(args, kwargs)
            handover.end_lease_of(ctx, self.id, key, f"{self.worker_pid}@{HOST}", limit)
        except Exception:
            logger.exception("could not end the lease of %s[%s]", task.name, self.id)
