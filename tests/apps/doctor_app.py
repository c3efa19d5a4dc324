"""A Celery app for ``celery -A doctor_app locks doctor`` tests, configured from the environment.

CSL_BROKER is the broker URL (never contacted by the doctor); CSL_CONF is a JSON object merged into ``app.conf``
(``singleton_lock_urls``, ``task_acks_late``, ``broker_transport_options``, ...). One LockedTask, ``doctor_app.job``.
"""

from __future__ import annotations

import json
import os

from celery import Celery

from celery_singleton_lock import LockedTask

app = Celery("doctor_app", broker=os.environ["CSL_BROKER"])
app.conf.update(json.loads(os.environ.get("CSL_CONF", "{}")))


@app.task(shared=False, base=LockedTask)
def job(account_id: int) -> int:
    """Return ``account_id``."""
    return account_id
