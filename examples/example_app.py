"""The one Celery app behind every example: ``celery -A examples.example_app worker`` serves them all.

Configured from the environment, read when the configuration is first needed (not at import), so an example can
be imported before its servers exist (``python -m examples.payment_double_click`` starts them, then sends):

==================== ===========================================================================================
``EXAMPLES_BROKER``     the broker, a Redis URL (default ``redis://127.0.0.1:6379/0``); results go to its db 1
``EXAMPLES_LOCK_URLS``  comma-separated independent Redis masters for the locks (default: the broker)
``EXAMPLES_RECORDS``    where the examples record what happened (default: the broker's db 2)
==================== ===========================================================================================

Every example module lives in ``include`` below, so one pair of workers serves all of them; each task has an
explicit name, so a module run as ``__main__`` sends the same task names the workers registered.
"""

from __future__ import annotations

import functools
import importlib.util
import os
from typing import Any

import redis
from celery import Celery

EXAMPLES = [
    "examples.payment_double_click",
    "examples.nightly_job",
    "examples.stock_decrement",
    "examples.cache_rebuild_storm",
    "examples.long_report",
    "examples.tenant_exports",
    "examples.partner_api_rate",
    "examples.llm_api",
    "examples.reindex_latest",
    "examples.rebuild_newest_wins",
    "examples.reindex_debounced",
    "examples.bounded_line",
    "examples.beat_app",
]
if importlib.util.find_spec("prometheus_client"):  # the one example with a dependency of its own
    EXAMPLES.append("examples.prometheus_metrics")


def broker_url() -> str:
    return os.environ.get("EXAMPLES_BROKER", "redis://127.0.0.1:6379/0")


def _db(url: str, db: int) -> str:
    return f"{url.rsplit('/', 1)[0]}/{db}"


def _settings_from_env() -> dict[str, Any]:
    broker = broker_url()
    locks = os.environ.get("EXAMPLES_LOCK_URLS")
    return {
        "broker_url": broker,
        "result_backend": _db(broker, 1),
        "singleton_lock_urls": locks.split(",") if locks else [broker],
        "singleton_lock_ttl": 10,
        "task_acks_late": True,
        "task_reject_on_worker_lost": True,
        "worker_prefetch_multiplier": 1,
        "broker_connection_retry_on_startup": True,
        "result_expires": 3600,
    }


app = Celery("examples", include=EXAMPLES)
app.add_defaults(_settings_from_env)  # a promise: evaluated when the configuration is first read


@functools.cache
def records() -> redis.Redis:
    """The Redis database where tasks record their runs and the examples read them back."""
    return redis.Redis.from_url(os.environ.get("EXAMPLES_RECORDS") or _db(broker_url(), 2), decode_responses=True)
