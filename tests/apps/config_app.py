"""A Celery app whose ``singleton_lock_*`` settings come from the environment, for worker start-up tests.

CSL_BROKER is the broker URL; CSL_CONF is a JSON object merged into ``app.conf`` (e.g. a bad ttl, a misspelt
setting, ``singleton_lock_urls``); CSL_TASK is a JSON object of options for the task's decorator (e.g. a misspelt
``lock_*`` option); CSL_TASK2, when set, registers a second task, ``config_app.other(key, email)``, with those
options (a ``lock_group`` whose tasks disagree). An option value ``"@fn"`` is a function of the task's arguments
(``lock_limit=`` a function, ``lock_key``), which JSON cannot carry.
"""

from __future__ import annotations

import json
import os
from typing import Any

from celery import Celery

from celery_singleton_lock import LockedTask

app = Celery("config_app", broker=os.environ["CSL_BROKER"])
app.conf.update(broker_connection_retry_on_startup=False, **json.loads(os.environ.get("CSL_CONF", "{}")))


def fn(key: str, *args: Any, **kwargs: Any) -> Any:
    """A ``lock_limit`` or ``lock_key`` function: 2 for a limit, the key for a key (both are only registered)."""
    return key


def _options(variable: str) -> dict[str, Any]:
    options = json.loads(os.environ.get(variable, "{}"))
    return {name: fn if value == "@fn" else value for name, value in options.items()}


@app.task(shared=False, base=LockedTask, bind=True, **_options("CSL_TASK"))
def noop(self: Any, key: str) -> str:
    """Return ``key``."""
    return key


if os.environ.get("CSL_TASK2"):

    @app.task(shared=False, base=LockedTask, bind=True, **_options("CSL_TASK2"))
    def other(self: Any, key: str, email: str = "") -> str:
        """Return ``key``."""
        return key
