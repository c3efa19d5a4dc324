"""locked_app plus OpenTelemetry (not a test module): what tests/task/test_otel.py runs in real workers and its client.

The process's tracer provider exports every ended span, as JSON, to the Redis list ``spans`` (CSL_RECORD): a worker's
spans (its main process's and its pool children's) are in another process than the test, so the test reads them
there. ``opentelemetry-instrumentation-celery`` makes the run and publish spans; ``celery_singleton_lock.otel`` adds
the lock's decisions. ``CSL_OTEL_SERVICE`` names the process (``service.name``).
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from typing import Any

from locked_app import app, record
from opentelemetry import trace
from opentelemetry.instrumentation.celery import CeleryInstrumentor
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExporter, SpanExportResult

import celery_singleton_lock.otel
from celery_singleton_lock import LockedTask

if "CSL_SKIP_BEFORE_POOL" in os.environ:
    app.conf.singleton_lock_skip_before_pool = os.environ["CSL_SKIP_BEFORE_POOL"] == "1"


class RedisListExporter(SpanExporter):
    """Every span, as ``ReadableSpan.to_json()``, pushed to the Redis list ``spans``."""

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        if spans:
            record.rpush("spans", *(s.to_json(indent=None) for s in spans))
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        return None


provider = TracerProvider(resource=Resource.create({"service.name": os.environ.get("CSL_OTEL_SERVICE", "worker")}))
provider.add_span_processor(SimpleSpanProcessor(RedisListExporter()))
trace.set_tracer_provider(provider)
CeleryInstrumentor().instrument(tracer_provider=provider)
celery_singleton_lock.otel.instrument(tracer_provider=provider)


def _order_key(order_id: str, card: str, duration: float = 0.0) -> str:
    return f"order:{order_id}"


@app.task(shared=False, base=LockedTask, bind=True, lock_key=_order_key)
def charge(self: Any, order_id: str, card: str, duration: float = 0.0) -> str:
    """The user clicked pay: charge ``card`` for ``order_id`` (holds the lock ``duration`` s)."""
    record.rpush(f"charged:{order_id}", self.request.id)
    time.sleep(duration)
    return order_id


@app.task(shared=False, base=LockedTask, bind=True, lock_key=_order_key, lock_scope="queue")
def charge_queued(self: Any, order_id: str, card: str, duration: float = 0.0) -> str:
    """``charge`` under queue scope: a second click while the first is queued or running sends nothing."""
    record.rpush(f"charged:{order_id}", self.request.id)
    time.sleep(duration)
    return order_id


@app.task(shared=False, base=LockedTask, bind=True, lock_key=_order_key, lock_on_duplicate="reschedule")
def charge_later(self: Any, order_id: str, card: str, duration: float = 0.0) -> str:
    """``charge`` whose duplicate waits for the holder and runs after it."""
    record.rpush(f"charged:{order_id}", self.request.id)
    time.sleep(duration)
    return order_id
