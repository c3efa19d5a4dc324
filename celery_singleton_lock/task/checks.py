"""The worker's own checks, as the operations wing runs them (``celery-singleton-lock doctor``): the task wing's one
face to ``ops``, so the doctor and a starting worker say the same and ``ops`` reaches no task room directly."""

from ._brokers import Finding, Level, acks_late_finding, broker_findings, queue_findings, visibility_finding
from ._run import is_locked_task
from ._startup import start_problems

__all__ = [
    "Finding",
    "Level",
    "acks_late_finding",
    "broker_findings",
    "is_locked_task",
    "queue_findings",
    "start_problems",
    "visibility_finding",
]
