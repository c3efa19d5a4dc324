"""Sentry Crons under the singleton scheduler: one check-in per run, and a skipped duplicate is no failure.

``sentry_sdk``'s ``CeleryIntegration(monitor_beat_tasks=True)`` opens a check-in (``in_progress``) in beat, in its
wrapper of ``Scheduler.apply_entry``, and puts the monitor's slug and the check-in id in the task's headers; the
worker closes it from Celery's ``task_success`` (``ok``), ``task_failure`` and ``task_retry`` (``error``) signals. What
this library does about it:

* **Beat.** :class:`~celery_singleton_lock.beat.SingletonSchedulerMixin` claims a due run in its own
  ``apply_entry`` *before* calling the scheduler's (Sentry's wrapper included): an instance that did not claim the
  run never reaches Sentry's wrapper, so only the instance that sends a run checks in for it, and every run sent
  has its check-in. Nothing to turn on.
* **A duplicate skipped in the pool** ends as a success in Celery's tracer: ``task_success`` closes the check-in
  ``ok``. The skipped duplicate is not a failure and not a missed run: the monitor's job is being done, by the
  holder, which closes its own check-in when it ends.
* **A duplicate skipped before the pool** (in the worker's main process) has no ``task_success``: without
  :func:`instrument`, its check-in stays ``in_progress`` until Sentry calls it a timeout (a failure). Instrumented,
  it is closed ``ok`` there, as the same skip in the pool is.
* **A call re-sent to run later** (a duplicate that waits, no quorum, a rate), **or a copy of a job that already
  ran** (the fallback copy of a call woken from its line, a redelivery): the re-sent copy carries the check-in and
  closes it when it really runs; the job's run closed it already. Instrumented, such a delivery sends nothing (its
  ``task_success`` would close the check-in ``ok`` before the run, or again after it: over an ``error`` too).

Turn on in the module that calls ``sentry_sdk.init`` (workers and beat)::

    sentry_sdk.init(dsn=..., integrations=[CeleryIntegration(monitor_beat_tasks=True)])
    celery_singleton_lock.sentry.instrument()

Nothing here is imported by the package: until :func:`instrument` connects its receivers, a decision costs what a
signal with no receivers costs.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, MutableMapping
from typing import Any

from sentry_sdk.crons import MonitorStatus, capture_checkin

from . import signals

__all__ = ["MONITOR_HEADERS", "instrument", "uninstrument"]

#: The headers sentry_sdk's Celery integration sends a beat run's check-in in.
SLUG, CHECK_IN, CONFIG, STARTED = (
    "sentry-monitor-slug",
    "sentry-monitor-check-in-id",
    "sentry-monitor-config",
    "sentry-monitor-start-timestamp-s",
)
MONITOR_HEADERS = (SLUG, CHECK_IN, CONFIG, STARTED)

_receivers = signals.Receivers()


def instrument() -> None:
    """Close a duplicate's check-in when it is skipped before the pool; leave a re-sent call's check-in to the copy
    that runs (see the module). Idempotent."""
    _receivers.connect([(signals.duplicate_skipped, _skipped), (signals.delivery_skipped, _not_the_run)])


def uninstrument() -> None:
    """Disconnect :func:`instrument`'s receivers."""
    _receivers.disconnect()


def _monitor(found: Mapping[str, Any]) -> dict[str, Any]:
    """The check-in headers of a message, wherever Celery left them (top level, or in the nested ``headers`` that
    sentry_sdk also fills: celery#4875)."""
    nested = found.get("headers")
    merged = {**(nested if isinstance(nested, Mapping) else {}), **found}
    return {k: merged[k] for k in MONITOR_HEADERS if merged.get(k) is not None}


def _skipped(sender: Any, request: Any = None, **_: Any) -> None:
    """Skipped before the pool: close the beat run's check-in ``ok`` (in the pool, Celery's task_success does)."""
    if request is None:
        return
    found = getattr(request, "request_dict", None)
    monitor = _monitor(found if isinstance(found, Mapping) else {})
    if SLUG not in monitor or CHECK_IN not in monitor:
        return
    started = monitor.get(STARTED)
    capture_checkin(
        monitor_slug=monitor[SLUG],
        check_in_id=monitor[CHECK_IN],
        monitor_config=monitor.get(CONFIG) or None,
        duration=time.time() - float(started) if started else None,
        status=MonitorStatus.OK,
    )


def _not_the_run(sender: Any, kind: str, **_: Any) -> None:
    """This delivery is not the job's run, nor a duplicate's skip: re-sent (the copy took the headers along, and
    closes the check-in when it runs), or a copy of a job that already ran (whose run closed it): Celery's
    task_success must not close the check-in for it."""
    request = getattr(sender, "request", None)
    if kind == "duplicate" or request is None:
        return
    for name in ("headers", "properties"):
        found = getattr(request, name, None)
        if isinstance(found, MutableMapping):
            _strip(found)


def _strip(headers: MutableMapping[str, Any]) -> None:
    for key in MONITOR_HEADERS:
        headers.pop(key, None)
    nested = headers.get("headers")
    if isinstance(nested, MutableMapping):
        _strip(nested)
