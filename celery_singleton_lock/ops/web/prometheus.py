"""``/metrics``: the Prometheus text exposition of the lock metrics, read from the nodes at each scrape."""

from __future__ import annotations

import threading

from ...lock.config import LockSettings
from ...lock.metrics import OUTCOMES, WAIT_MS, WAITS, MetricsReport, read_metrics
from .._gauges import read_gauges


def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def exposition(settings: LockSettings) -> str:
    """The Prometheus text exposition (format 0.0.4) of the app's lock metrics, read from the nodes now.

    Families: ``celery_lock_events_total{task,outcome}`` (counter: every outcome since the counts began, summed over
    every worker and host), ``celery_lock_wait_seconds{task}`` (summary: sum and count of the time runs waited
    before taking their lock), ``celery_lock_held{task}`` and ``celery_lock_waiting{task}`` (gauges: locks held and
    jobs waiting in a line now), ``celery_lock_partial{task}`` (gauge: lock records, cooldowns and reservations
    included, on fewer than a quorum of nodes: no owner holds them, so they guard nothing, e.g. a cooldown left on
    one node after two restarted empty), ``celery_lock_incomplete{task}`` (gauge: records on a quorum but not on
    every node: one more node lost and they are partial), ``celery_lock_nodes_up`` (gauge: lock nodes that
    answered). Labels are ``task`` and
    ``outcome`` only, never a key or a task id. A counter never goes down from one scrape to the next while a node
    holding some of its counts does not answer (:func:`_never_lower`).
    """
    gauges = read_gauges(settings)
    found = read_metrics(settings.nodes, settings.prefix, skip=gauges.down)
    found = _never_lower(settings, found, complete=not (found.errors or gauges.errors))
    out = [
        "# HELP celery_lock_events_total Lock outcomes per task (see celery_singleton_lock.metrics.OUTCOMES).",
        "# TYPE celery_lock_events_total counter",
    ]
    for task, counts in found.tasks.items():
        for outcome, n in counts.items():
            out.append(f'celery_lock_events_total{{task="{_label(task)}",outcome="{_label(outcome)}"}} {n}')
    out += [
        "# HELP celery_lock_wait_seconds Time runs waited (re-sent or in a line) before taking their lock.",
        "# TYPE celery_lock_wait_seconds summary",
    ]
    for task, (ms, n) in found.waits.items():
        out.append(f'celery_lock_wait_seconds_sum{{task="{_label(task)}"}} {ms / 1000.0}')
        out.append(f'celery_lock_wait_seconds_count{{task="{_label(task)}"}} {n}')
    held, waiting, partial, incomplete = gauges.held, gauges.waiting, gauges.partial, gauges.incomplete
    for name, help_, values in (
        ("celery_lock_held", "Locks held now per task (running, retry-wait, ending, cooldown, queued).", held),
        ("celery_lock_waiting", "Jobs waiting in a line now per task.", waiting),
        ("celery_lock_partial", "Lock records (cooldowns, reservations too) on fewer than a quorum of nodes.", partial),
        ("celery_lock_incomplete", "Lock records on a quorum but not on every lock node now.", incomplete),
    ):
        out += [f"# HELP {name} {help_}", f"# TYPE {name} gauge"]
        out += [f'{name}{{task="{_label(t)}"}} {n}' for t, n in sorted(values.items())]
    out += [
        "# HELP celery_lock_nodes_up Lock nodes that answered this scrape.",
        "# TYPE celery_lock_nodes_up gauge",
        f"celery_lock_nodes_up {len(settings.nodes) - len({x.node for x in found.errors + gauges.errors})}",
        "# HELP celery_lock_gauges_age_seconds Age of the walk over the keys the gauges above come from (a walk "
        "longer than one scrape ends over several).",
        "# TYPE celery_lock_gauges_age_seconds gauge",
        f"celery_lock_gauges_age_seconds {gauges.age:.3f}",
        "# HELP celery_lock_gauges_complete 1 once a walk over every key has ended (the gauges are 0 until then).",
        "# TYPE celery_lock_gauges_complete gauge",
        f"celery_lock_gauges_complete {int(gauges.complete)}",
    ]
    return "\n".join(out) + "\n"


#: The highest count this process exposed per series, per (nodes, prefix): see :func:`_never_lower`.
_EXPOSED: dict[tuple[tuple[str, ...], str], dict[tuple[str, str], int]] = {}
_EXPOSED_LOCK = threading.Lock()


def _never_lower(settings: LockSettings, found: MetricsReport, *, complete: bool) -> MetricsReport:
    """``found`` with each count raised to the highest this process exposed before, unless it is ``complete``
    (every node answered).

    Counts live on whichever node answered each flush, and are read summed over the nodes that answer: with a node
    down the sum is short. A counter that goes down reads as a reset in Prometheus (its whole total counted again
    when the node is back), so such a scrape never shows less than an earlier one did (bounded: one entry a
    series). When every node answers, the sums are shown as read: a real reset (a node that lost its data) shows.
    """
    with _EXPOSED_LOCK:
        seen = _EXPOSED.setdefault((settings.nodes.names, settings.prefix), {})
        if complete:
            seen.clear()
        for task, counts in found.tasks.items():
            for outcome, n in counts.items():
                seen[(task, outcome)] = max(seen.get((task, outcome), 0), n)
        for task, (ms, n) in found.waits.items():
            for field, value in ((WAIT_MS, ms), (WAITS, n)):
                seen[(task, field)] = max(seen.get((task, field), 0), value)
        tasks: dict[str, dict[str, int]] = {}
        waits: dict[str, tuple[int, int]] = {}
        for (task, outcome), n in sorted(seen.items()):
            if outcome in (WAIT_MS, WAITS):
                waits[task] = (seen.get((task, WAIT_MS), 0), seen.get((task, WAITS), 0))
            else:
                tasks.setdefault(task, {})[outcome] = n
    order = {o: i for i, o in enumerate(OUTCOMES)}
    ordered = {
        t: dict(sorted(c.items(), key=lambda kv: (order.get(kv[0], len(order)), kv[0]))) for t, c in tasks.items()
    }
    return MetricsReport(ordered, waits, found.errors)
