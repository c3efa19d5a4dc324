"""OpenTelemetry: every lock decision on the trace (celery_singleton_lock.otel, issue 34).

Real redis-server processes (a broker, three lock nodes) and real ``celery worker`` processes (prefork) running
tests/apps/otel_app.py: ``opentelemetry-instrumentation-celery`` beside ``celery_singleton_lock.otel``, the SDK's
tracer provider exporting every span to a Redis list the test reads (the worker's spans are in its processes). The
test process is the caller: the same app module, its spans also kept by the SDK's ``InMemorySpanExporter``.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from worker_cluster import APPS, Cluster, cluster, polling

from celery_singleton_lock.lock.redlock import Redlock
from celery_singleton_lock.testing import CeleryWorker

otel_sdk = pytest.importorskip("opentelemetry.sdk.trace")
from opentelemetry import trace  # noqa: E402
from opentelemetry.instrumentation.celery import CeleryInstrumentor  # noqa: E402
from opentelemetry.sdk.trace.export import SimpleSpanProcessor  # noqa: E402
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter  # noqa: E402

from celery_singleton_lock.task.otel import key_digest, uninstrument  # noqa: E402

pytestmark = pytest.mark.slow

TTL = 5.0
NS = "celery_singleton_lock"


@pytest.fixture(scope="module")
def oc(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Cluster, Any, InMemorySpanExporter]]:
    """Redis broker and three lock nodes; the caller's side of otel_app in this process, its spans in memory."""
    with cluster(tmp_path_factory.mktemp("otel"), ttl=TTL) as c:
        c.app_module()
        saved = os.environ.get("CSL_OTEL_SERVICE")
        os.environ["CSL_OTEL_SERVICE"] = "caller"
        try:
            sys.modules.pop("otel_app", None)
            otel_app = importlib.import_module("otel_app")
            memory = InMemorySpanExporter()
            otel_app.provider.add_span_processor(SimpleSpanProcessor(memory))
            yield c, otel_app, memory
        finally:
            CeleryInstrumentor().uninstrument()
            uninstrument()
            sys.modules.pop("otel_app", None)
            if saved is None:
                os.environ.pop("CSL_OTEL_SERVICE", None)
            else:
                os.environ["CSL_OTEL_SERVICE"] = saved


@contextlib.contextmanager
def worker(c: Cluster, name: str, env: dict[str, str] | None = None) -> Iterator[CeleryWorker]:
    """A prefork worker (-c 2) on otel_app consuming q-<name>; killed on exit."""
    w = CeleryWorker(
        "otel_app",
        name,
        cwd=str(APPS),
        log_path=str(c.tmp / f"{name}.log"),
        env={**c.env, "CSL_OTEL_SERVICE": "worker", **(env or {})},
        extra=["-Q", f"q-{name}"],
    )
    c.workers.append(w)
    try:
        yield w.start(timeout=60)
    finally:
        w.kill()


def worker_spans(c: Cluster) -> list[dict[str, Any]]:
    """Every span exported so far: the workers' processes', and this process's too (the same app module)."""
    return [json.loads(s) for s in c.record.lrange("spans", 0, -1)]


def memory_spans(memory: InMemorySpanExporter) -> list[dict[str, Any]]:
    return [json.loads(s.to_json(indent=None)) for s in memory.get_finished_spans()]


def wait_span(c: Cluster, found: Callable[[dict[str, Any]], bool], timeout: float = 30.0) -> dict[str, Any]:
    for _ in polling(timeout, 0.1):
        for span in worker_spans(c):
            if found(span):
                return span
    raise AssertionError(f"no such span among {[s['name'] for s in worker_spans(c)]}")


def events(span: dict[str, Any], decision: str) -> list[dict[str, Any]]:
    return [e["attributes"] for e in span["events"] if e["name"] == f"{NS}.{decision}"]


def published(memory: InMemorySpanExporter, task_id: str) -> dict[str, Any]:
    """The caller's publish span of ``task_id`` (opentelemetry-instrumentation-celery's apply_async span)."""
    (span,) = [
        s
        for s in memory_spans(memory)
        if s["name"].startswith("apply_async/") and s["attributes"].get("messaging.message.id") == task_id
    ]
    return span


def secrets_absent(texts: list[str], *secrets: str) -> None:
    for secret in secrets:
        leaked = [t for t in texts if secret in t]
        assert not leaked, f"{secret!r} exported in {leaked[:1]}"


def pay_twice(c: Cluster, app: Any, queue: str) -> tuple[Any, Any, str, str, str, str]:
    """The user clicked pay twice: the same call twice, the second arriving while the first runs (3 s)."""
    order, card = f"o-{uuid.uuid4().hex[:10]}", f"card-{uuid.uuid4().hex}"
    first = app.charge.apply_async((order, card, 3.0), queue=queue)
    for _ in polling(20):
        if c.record.llen(f"charged:{order}"):
            break
    key = app.charge.lock_key_for(order, card, 3.0)
    holder = Redlock(app.app.conf.singleton_lock_urls, key).holder()
    assert holder is not None
    assert holder.get("job") == first.id
    second = app.charge.apply_async((order, card, 3.0), queue=queue)
    assert first.get(timeout=30) == order
    for _ in polling(20):
        if second.state == "REVOKED":
            break
    assert second.state == "REVOKED"
    return first, second, order, card, key, holder["owner"]


def test_pay_twice_shows_both_calls_and_the_skip_before_the_pool(oc: tuple[Cluster, Any, Any]) -> None:
    """The first call's run span says acquired (digest, fencing token) and released; the second call, skipped in the
    worker's main process, makes a short span of its own in the second caller's trace, naming the holder."""
    c, app, memory = oc
    with worker(c, "w1"):
        first, second, order, card, key, owner = pay_twice(c, app, "q-w1")
        run = wait_span(c, lambda s: s["name"] == "run/otel_app.charge" and events(s, "released"))
        skip = wait_span(c, lambda s: s["name"] == "skipped/otel_app.charge")
    sent1, sent2 = published(memory, first.id), published(memory, second.id)
    # The run: in the first call's trace, a child of its publish span.
    assert run["context"]["trace_id"] == sent1["context"]["trace_id"]
    assert run["parent_id"] == sent1["context"]["span_id"]
    (acquired,) = events(run, "acquired")
    assert acquired[f"{NS}.decision"] == "acquired"
    assert acquired[f"{NS}.key.digest"] == key_digest(key)
    assert acquired[f"{NS}.task_id"] == first.id
    assert isinstance(acquired[f"{NS}.fencing_token"], int)
    (released,) = events(run, "released")
    assert released[f"{NS}.held"] is True
    # The duplicate: never traced in a pool child, its own short span in the second call's trace.
    assert not [
        s
        for s in worker_spans(c)
        if s["name"].startswith("run/") and s["attributes"].get("messaging.message.id") == second.id
    ]
    assert skip["context"]["trace_id"] == sent2["context"]["trace_id"]
    assert skip["parent_id"] == sent2["context"]["span_id"]
    attrs = skip["attributes"]
    assert attrs[f"{NS}.decision"] == "skipped"
    assert attrs[f"{NS}.holder.task_id"] == first.id
    assert attrs[f"{NS}.task_id"] == second.id
    assert attrs[f"{NS}.policy"] == "skip"
    assert attrs[f"{NS}.key.digest"] == key_digest(key)
    (event,) = events(skip, "skipped")
    assert event[f"{NS}.holder.task_id"] == first.id
    # Nothing secret: no argument, raw key or owner token in anything exported, on either side.
    texts = [json.dumps(s) for s in worker_spans(c) + memory_spans(memory)]
    secrets_absent(texts, card, order, key, owner)


def test_a_duplicate_skipped_in_the_pool_is_an_event_on_its_run_span(oc: tuple[Cluster, Any, Any]) -> None:
    """With the skip before the pool off, the duplicate's own run span carries the skipped event naming the holder."""
    c, app, memory = oc
    with worker(c, "w2", env={"CSL_SKIP_BEFORE_POOL": "0"}):
        first, second, order, card, key, owner = pay_twice(c, app, "q-w2")
        dup = wait_span(
            c, lambda s: s["name"] == "run/otel_app.charge" and s["attributes"].get("messaging.message.id") == second.id
        )
    assert dup["context"]["trace_id"] == published(memory, second.id)["context"]["trace_id"]
    (skipped,) = events(dup, "skipped")
    assert skipped[f"{NS}.holder.task_id"] == first.id
    assert skipped[f"{NS}.task_id"] == second.id
    assert not events(dup, "acquired")
    texts = [json.dumps(s) for s in worker_spans(c) + memory_spans(memory)]
    secrets_absent(texts, card, order, key, owner)


def test_a_rescheduled_duplicate_says_it_waits_and_a_later_delivery_runs_it(
    oc: tuple[Cluster, Any, Any],
) -> None:
    """A duplicate under "reschedule": its run span, in its caller's trace, says waiting (naming the holder) and
    deferred (with the countdown); a later delivery of the same task id runs it and says acquired."""
    c, app, memory = oc
    order, card = f"o-{uuid.uuid4().hex[:10]}", f"card-{uuid.uuid4().hex}"
    with worker(c, "w3"):
        first = app.charge_later.apply_async((order, card, 2.0), queue="q-w3")
        for _ in polling(20):
            if c.record.llen(f"charged:{order}"):
                break
        second = app.charge_later.apply_async((order, card, 2.0), queue="q-w3")
        assert first.get(timeout=30) == order
        assert second.get(timeout=60) == order
        trace_id = published(memory, second.id)["context"]["trace_id"]

        def runs_of_second() -> list[dict[str, Any]]:
            return [
                s
                for s in worker_spans(c)
                if s["name"] == "run/otel_app.charge_later" and s["attributes"].get("messaging.message.id") == second.id
            ]

        for _ in polling(30, 0.1):
            if any(events(s, "released") for s in runs_of_second()):
                break
    spans = runs_of_second()
    (waited,) = [s for s in spans if events(s, "waiting")]
    assert waited["context"]["trace_id"] == trace_id
    (waiting,) = events(waited, "waiting")
    assert waiting[f"{NS}.holder.task_id"] == first.id
    assert waiting[f"{NS}.policy"] == "reschedule"
    (deferred,) = events(waited, "deferred")
    assert deferred[f"{NS}.reason"] == "duplicate"
    assert deferred[f"{NS}.countdown"] > 0
    # The copy that runs is the one the holder's release woke: the Celery instrumentation parents a message to the
    # span that publishes it, so that run is in the holder's trace (docs/observability.md).
    assert [s for s in spans if events(s, "acquired") and events(s, "released")], [
        [e["name"] for e in s["events"]] for s in spans
    ]
    texts = [json.dumps(s) for s in worker_spans(c) + memory_spans(memory)]
    secrets_absent(texts, card, order)


def test_a_queue_scope_duplicate_at_delay_is_a_short_span_in_the_callers_trace(oc: tuple[Cluster, Any, Any]) -> None:
    """Under queue scope the second click sends nothing: a 'joined' span under the caller's own span names the job."""
    _, app, memory = oc
    order, card = f"o-{uuid.uuid4().hex[:10]}", f"card-{uuid.uuid4().hex}"
    tracer = trace.get_tracer("test")
    with tracer.start_as_current_span("POST /pay") as request:
        one = app.charge_queued.apply_async((order, card), queue="q-nobody")
        two = app.charge_queued.apply_async((order, card), queue="q-nobody")
        again = app.charge_queued.apply_async((order, card), queue="q-nobody", task_id=one.id)
    assert two.id == one.id
    assert again.id == one.id
    joined = [s for s in memory_spans(memory) if s["name"] == "joined/otel_app.charge_queued"]
    assert len(joined) == 2
    parent = format(request.get_span_context().span_id, "#018x")
    for span in joined:
        assert span["parent_id"] == parent
        assert span["attributes"][f"{NS}.holder.task_id"] == one.id
        assert span["attributes"][f"{NS}.policy"] == "queue"
    key = app.charge_queued.lock_key_for(order, card)
    secrets_absent([json.dumps(s) for s in memory_spans(memory)], card, order, key)


def test_without_instrument_nothing_of_opentelemetry_is_imported() -> None:
    """The package, its task class and beat import no OpenTelemetry (nor Sentry) module beyond what redis and celery
    import themselves (redis-py's observability imports the API when it is installed): off costs nothing."""
    code = (
        "import sys, redis, redis.asyncio, celery, celery.beat, celery.worker.request;"
        "before = set(sys.modules);"
        "import celery_singleton_lock, celery_singleton_lock.task, celery_singleton_lock.beat, "
        "celery_singleton_lock.task._preskip, celery_singleton_lock.task._enqueue;"
        "new = set(sys.modules) - before;"
        "print(sorted(m for m in new if m.startswith(('opentelemetry', 'sentry_sdk', 'celery_singleton_lock.otel', "
        "'celery_singleton_lock.sentry'))))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        cwd=Path(__file__).parent.parent.parent,
    )
    assert out.stdout.strip() == "[]"
