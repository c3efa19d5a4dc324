"""An app whose LockedTask combines lock_limit=2 with lock_on_duplicate="replace": a worker must refuse to start.

CSL_BROKER names the broker (and lock node); CSL_REPLACE_AT is ``task`` (the task says "replace") or ``settings``
(``singleton_lock_on_duplicate`` says it).
"""

from __future__ import annotations

import os
from typing import Any

from celery import Celery

from celery_singleton_lock import LockedTask

app = Celery("limit_replace_app", broker=os.environ["CSL_BROKER"])
app.conf.singleton_lock_urls = [os.environ["CSL_BROKER"]]
options: dict[str, Any] = {"lock_limit": 2}
if os.environ.get("CSL_REPLACE_AT") == "settings":
    app.conf.singleton_lock_on_duplicate = "replace"
else:
    options["lock_on_duplicate"] = "replace"


@app.task(shared=False, base=LockedTask, name="limited_latest", **options)
def limited_latest() -> None:
    """Never runs: the worker must not start."""
