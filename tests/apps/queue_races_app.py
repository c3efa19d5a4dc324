"""Extra queue-scope tasks for tests/task/test_queue_scope_races.py, on locked_app's app (same env, same records).

Run with ``celery -A queue_races_app worker``: importing this module imports locked_app and adds these tasks to its app.
"""

from __future__ import annotations

from typing import Any

from locked_app import _run, app, q_flaky, q_work

from celery_singleton_lock import LockedTask

__all__ = ["app", "q_again", "q_flaky", "q_spawn", "q_spawn_same", "q_work"]


@app.task(shared=False, base=LockedTask, bind=True, lock_unique_on=["key"], lock_scope="queue")
def q_again(self: Any, key: str, rounds: int, pause: float = 0.3) -> str | None:
    """A self-rescheduling job (poll every ``pause`` s, ``rounds`` more times): at the end of its body it sends
    itself again with a countdown. Returns the id of the next call's AsyncResult (None on the last round)."""
    _run(self, key, 0.05)
    if rounds <= 0:
        return None
    return str(self.apply_async((key, rounds - 1, pause), countdown=pause).id)


@app.task(shared=False, base=LockedTask, bind=True, lock_unique_on=["key"], lock_scope="queue")
def q_spawn(self: Any, key: str, other: str) -> str:
    """From inside its run, send q_work(other) with a countdown (a different job of another queue-scope task)."""
    _run(self, key, 0.05)
    return str(q_work.apply_async((other, 0.0), countdown=1).id)


@app.task(shared=False, base=LockedTask, bind=True, lock_unique_on=["key"], lock_scope="queue")
def q_spawn_same(self: Any, key: str, other: str) -> str:
    """From inside its run, send another job of its own task (q_spawn_same(other)) with a countdown."""
    _run(self, key, 0.05)
    if other == "":
        return ""
    return str(self.apply_async((other, ""), countdown=1).id)
