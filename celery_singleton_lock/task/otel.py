"""OpenTelemetry: every lock decision on the trace, as a span event (``pip install celery-singleton-lock[otel]``).

Turned on by one call where the tracer provider is set up (in the app module, so that workers and callers both
run it), beside ``opentelemetry-instrumentation-celery``'s own::

    from opentelemetry.instrumentation.celery import CeleryInstrumentor
    import celery_singleton_lock.otel

    CeleryInstrumentor().instrument()
    celery_singleton_lock.otel.instrument()

Nothing here is imported by the package: until :func:`instrument` connects its receivers to
:mod:`celery_singleton_lock.signals`, a decision costs what a signal with no receivers costs (one ``if``).

Where the decision is recorded:

* inside a delivery's run (the ``run/<task>`` span the Celery instrumentation starts at ``task_prerun``): an event
  on that span (acquired, skipped or deferred in the pool, released, rate-limited, unavailable);
* everywhere else, a short span of its own (``<decision>/<task>``, kind INTERNAL) holding the same attributes and
  the same event: the skip before the pool in the worker's main process (its parent is the caller's context, read
  from the message's ``traceparent`` header, so the second click of "pay" shows in the caller's trace), a call at
  ``delay()`` that joined a job or a debounced burst (its parent: the caller's current span), a lock lost in the
  watchdog's thread, a waiting call superseded by a newer one (its parent: the newer run).

Every event is named ``celery_singleton_lock.<decision>``; attributes (absent when they do not apply):

=========================================== ============================================================
attribute                                   value
=========================================== ============================================================
``celery_singleton_lock.decision``          acquired, skipped, failed-duplicate, waiting, deferred, joined,
                                            debounced, superseded, rate-limited, unavailable, lost, released,
                                            done (a copy of a job that already ran: not run again)
``celery_singleton_lock.key.digest``        :func:`key_digest` of the lock key (never the key: it may hold arguments)
``celery_singleton_lock.task_id``           the task id of the call the decision is about
``celery_singleton_lock.holder.task_id``    the task id of the job holding the lock
``celery_singleton_lock.fencing_token``     the acquisition's fencing token (acquired)
``celery_singleton_lock.policy``            the policy that decided (skip, fail, reschedule, queue, rate's ...)
``celery_singleton_lock.reason``            why a call waits or a lock was lost (a fixed vocabulary)
``celery_singleton_lock.countdown``         seconds until a deferred call's copy runs
``celery_singleton_lock.rate``              the rate that held a call back (``"10/m"``)
``celery_singleton_lock.held``              released: the lock was still this run's
``celery_singleton_lock.node_errors``       unavailable: how many lock nodes failed (never their messages)
=========================================== ============================================================

The holder's owner token, the arguments and the raw key are never exported (``raw_keys=True`` adds
``celery_singleton_lock.key``, for keys you know hold nothing secret).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

from opentelemetry import trace
from opentelemetry.propagate import extract
from opentelemetry.trace import Span, SpanKind, Tracer, TracerProvider

from . import signals

__all__ = ["NS", "instrument", "instrumented", "key_digest", "uninstrument"]

#: The namespace of every attribute and event name.
NS = "celery_singleton_lock"

_tracer: Tracer | None = None
_raw_keys = False
_receivers = signals.Receivers()

# duplicate_skipped's policy -> the decision it records (a policy that waits records "waiting"; its re-send
# records "deferred" through lock_waiting).
_DUPLICATE = {
    "skip": "skipped",
    "max_waiting": "skipped",
    "fail": "failed-duplicate",
    "reschedule": "waiting",
    "replace": "waiting",
    "enqueue": "joined",
    "queue": "joined",
    "debounce": "debounced",
}


def key_digest(key: str) -> str:
    """What a trace shows of a lock key: the first 16 hex digits of its SHA-256 (``celery_singleton_lock.key.digest``;
    compute it for a key you know to find its decisions)."""
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()[:16]


def instrument(*, tracer_provider: TracerProvider | None = None, raw_keys: bool = False) -> None:
    """Record every lock decision of this process on its trace (see the module). Idempotent; ``tracer_provider``:
    the global one when None."""
    global _tracer, _raw_keys  # noqa: PLW0603 - one switch per process, as the instrumentations have
    _tracer = trace.get_tracer(NS, tracer_provider=tracer_provider)
    _raw_keys = raw_keys
    _receivers.connect(
        [
            (signals.lock_acquired, _acquired),
            (signals.duplicate_skipped, _duplicate),
            (signals.call_joined, _joined),
            (signals.lock_waiting, _waiting),
            (signals.delivery_skipped, _copy_dropped),
            (signals.rate_limited, _rate_limited),
            (signals.lock_unavailable, _unavailable),
            (signals.lock_lost, _lost),
            (signals.lock_released, _released),
        ]
    )


def uninstrument() -> None:
    """Disconnect :func:`instrument`'s receivers: decisions cost a signal with no receivers again."""
    _receivers.disconnect()


def instrumented() -> bool:
    """Whether :func:`instrument` is in effect in this process."""
    return bool(_receivers)


def _record(
    sender: Any,
    decision: str,
    key: str,
    task_id: str | None,
    parent: Any = None,
    *,
    holder: str | None = None,
    **attrs: Any,
) -> None:
    """Add the decision's event to the current run's span, or to a short span of its own (see the module)."""
    tracer = _tracer
    if tracer is None:
        return
    attributes: dict[str, Any] = {f"{NS}.decision": decision, f"{NS}.key.digest": key_digest(key)}
    if _raw_keys:
        attributes[f"{NS}.key"] = key
    if task_id is not None:
        attributes[f"{NS}.task_id"] = task_id
    if holder is not None:
        attributes[f"{NS}.holder.task_id"] = holder
    for name, value in attrs.items():
        if value is not None:
            attributes[f"{NS}.{name}"] = value
    event = f"{NS}.{decision}"
    current = trace.get_current_span()
    request = getattr(sender, "request", None)
    if parent is None and task_id is not None and current.is_recording() and getattr(request, "id", None) == task_id:
        current.add_event(event, attributes)  # the run's own span (this delivery is being traced)
        return
    name = getattr(sender, "name", None) or "task"
    span: Span = tracer.start_span(
        f"{decision}/{name}", context=parent, kind=SpanKind.INTERNAL, attributes={"celery.task_name": name}
    )
    try:
        if task_id is not None:
            span.set_attribute("messaging.message.id", task_id)
        span.set_attributes(attributes)
        span.add_event(event, attributes)
    finally:
        span.end()


def _acquired(sender: Any, key: str, task_id: str, fencing_token: int | None = None, **_: Any) -> None:
    _record(sender, "acquired", key, task_id, fencing_token=fencing_token)


def _duplicate(
    sender: Any, key: str, task_id: str | None, holder_task_id: str | None, policy: str, **kwargs: Any
) -> None:
    decision = _DUPLICATE.get(policy, "skipped")
    parent = None
    request = kwargs.get("request")
    if request is not None:  # skipped before the pool: no run span; the caller's context rides the message
        parent = extract(_headers(request))
    elif policy == "replace" and holder_task_id is not None and holder_task_id == getattr(sender.request, "id", ""):
        decision = "superseded"  # the newer run took this waiting call's place: sent by the newer one
    elif policy == "queue":
        try:
            raises = sender._options().policy.raises  # noqa: SLF001 - the task's resolved options
        except Exception:  # a trace must never break a call
            raises = False
        decision = "failed-duplicate" if raises else "joined"
    _record(sender, decision, key, task_id, parent, holder=holder_task_id, policy=policy)


def _headers(request: Any) -> Mapping[str, Any]:
    """The message's headers as the worker received them (``traceparent`` is one, put there by the producer)."""
    found = getattr(request, "request_dict", None)
    return found if isinstance(found, Mapping) else {}


def _joined(sender: Any, key: str, task_id: str, holder_task_id: str | None = None, **_: Any) -> None:
    _record(sender, "joined", key, task_id, holder=holder_task_id, policy="queue")


def _waiting(sender: Any, key: str, task_id: str, countdown: float, reason: str, **_: Any) -> None:
    _record(sender, "deferred", key, task_id, countdown=float(countdown), reason=reason)


def _copy_dropped(sender: Any, key: str, task_id: str, kind: str, **_: Any) -> None:
    # The other kinds were recorded by their decision's own signal (duplicate_skipped, lock_waiting).
    if kind in ("done", "settled"):
        _record(sender, "done", key, task_id, reason=kind)


def _rate_limited(sender: Any, key: str, task_id: str, rate: str, policy: str, **_: Any) -> None:
    _record(sender, "rate-limited", key, task_id, rate=rate, policy=policy)


def _unavailable(sender: Any, key: str, task_id: str, policy: str, errors: Any = (), **_: Any) -> None:
    _record(sender, "unavailable", key, task_id, policy=policy, node_errors=len(errors or ()))


def _lost(sender: Any, key: str, task_id: str, reason: str, **_: Any) -> None:
    _record(sender, "lost", key, task_id, reason=reason)


def _released(sender: Any, key: str, task_id: str, held: bool, **_: Any) -> None:  # noqa: FBT001 - a signal's field
    _record(sender, "released", key, task_id, held=bool(held))
