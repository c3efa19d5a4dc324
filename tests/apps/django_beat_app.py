"""The Celery app of a Django project for tests/task/test_beat_django.py, shaped as ``proj/celery.py`` is: beat reads
its schedule from django-celery-beat's tables (PostgreSQL) under SingletonDatabaseScheduler.

Configured from the environment: CSL_BROKER, CSL_LOCK_URLS (comma-separated), CSL_PG_DB, optionally CSL_LIVENESS.
"""

import os

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "django_beat_settings")

import django
from celery import Celery

django.setup()

app = Celery("django_beat_app", broker=os.environ["CSL_BROKER"])
app.conf.update(
    singleton_lock_urls=os.environ["CSL_LOCK_URLS"].split(","),
    singleton_lock_liveness_file=os.environ.get("CSL_LIVENESS") or None,
    broker_connection_retry_on_startup=True,
    timezone="UTC",
)


@app.task
def tick() -> None:
    """Sent every second by beat; never run (the test counts the messages in the broker's queue)."""
