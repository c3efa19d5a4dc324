"""A Celery app whose ``singleton_lock_*`` settings come from the environment, for worker start-up tests.

CSL_BROKER is the broker URL; CSL_CONF is a JSON object merged into ``app.conf`` (e.g. a bad ttl, a misspelt
setting, ``singleton_lock_urls``); CSL_TASK is a JSON object of options for the task's decorator (e.g. a misspelt
``lock_*`` option).
"""

from __future__ import annotations

import json
import os
from typing import Any

from celery import Celery

from celery_singleton_lock import LockedTask

app = Celery("config_app", broker=os.environ["CSL_BROKER"])
app.conf.update(broker_connection_retry_on_startup=False, **json.loads(os.environ.get("CSL_CONF", "{}")))


@app.task(shared=False, base=LockedTask, bind=True, **json.loads(os.environ.get("CSL_TASK", "{}")))
def noop(self: Any, key: str) -> str:
    """Return ``key``."""
    return key
