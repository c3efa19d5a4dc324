"""Two (or more) ``celery beat`` instances side by side: each due run is sent once, and either may die.

Start a Redis on 127.0.0.1:6379 (or point ``EXAMPLES_BROKER`` and ``EXAMPLES_LOCK_URLS`` elsewhere, as for every
example: see examples/example_app.py), then, from the repository root, in three terminals::

    celery -A examples.beat_app worker -l INFO
    celery -A examples.beat_app beat -l INFO -S singleton --schedule /tmp/beat-a
    celery -A examples.beat_app beat -l INFO -S singleton --schedule /tmp/beat-b

``-S singleton`` is ``celery_singleton_lock.beat.SingletonScheduler``, found through the ``celery.beat_schedulers``
entry point this package registers. Give every instance its own ``--schedule`` file: celery's shelve file is not
safe to share between processes. (``docker compose up`` runs the same pair as ``beat1`` and ``beat2``.)

What to watch:

* Every 5 seconds, and at every minute, exactly one of the two beats logs ``Scheduler: Sending due task ...``; the
  other logs ``beat: ... run ... was claimed by another beat instance (beat@host:pid:...); not sending it``.
* The worker prints each run once, with its slot, the same whichever beat sent it.
* ``redis-cli --scan --pattern 'singleton_lock:beat:*'`` lists the claims: one key per entry per run, each
  expiring on its own (nothing to clean up).
* Stop either beat (Ctrl-C, or ``kill -9``): the other goes on sending every run. Start it again: it joins in, and
  a run the other already sent is not sent a second time.
"""

from __future__ import annotations

from typing import Any

from celery.schedules import crontab

from celery_singleton_lock.beat import SLOT_HEADER
from examples.example_app import app

# add_defaults with a function: read when the configuration is first needed, like the rest of the examples' settings.
app.add_defaults(
    lambda: {
        "beat_schedule": {
            "heartbeat-every-5s": {"task": "examples.beat_app.heartbeat", "schedule": 5.0},
            "report-every-minute": {"task": "examples.beat_app.report", "schedule": crontab(minute="*")},
        }
    }
)


@app.task(bind=True, name="examples.beat_app.heartbeat")
def heartbeat(self: Any) -> str:
    """Print the run's slot: the start of its 5 s window, in Unix seconds."""
    slot = self.request.get(SLOT_HEADER)
    print(f"heartbeat for slot {slot}, task {self.request.id}")
    return str(slot)


@app.task(bind=True, name="examples.beat_app.report")
def report(self: Any) -> str:
    """Print the run's slot: its scheduled minute, in Unix seconds (a natural idempotency key for the job)."""
    slot = self.request.get(SLOT_HEADER)
    print(f"report for the minute starting at {slot}, task {self.request.id}")
    return str(slot)
