"""RabbitMQ queues for tests/task/test_copies.py's dead-letter retry (no tasks here: importable by the client)."""

from __future__ import annotations

from kombu import Exchange, Queue


def dlx_queues(main: str) -> list[Queue]:
    """RabbitMQ's dead-letter retry (Celery's docs on Reject): a message rejected without requeue from the main queue
    waits 1 s in a retry queue, then is dead-lettered back to the main queue, the same message again."""
    retry = main + ".retry"
    return [
        Queue(main, Exchange(main), routing_key=main, queue_arguments={
            "x-dead-letter-exchange": retry, "x-dead-letter-routing-key": retry}),
        Queue(retry, Exchange(retry), routing_key=retry, queue_arguments={
            "x-message-ttl": 1000, "x-dead-letter-exchange": main, "x-dead-letter-routing-key": main}),
    ]  # fmt: skip
