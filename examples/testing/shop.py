"""The application under test: a Celery app with two LockedTasks, as your project has one.

Production settings live here; the tests' conftest.py points the broker and the locks at throwaway servers.
"""

from __future__ import annotations

from typing import Any

from celery import Celery

from celery_singleton_lock import LockedTask

app = Celery("shop")
app.conf.update(
    broker_url="redis://localhost:6379/0",
    result_backend="redis://localhost:6379/1",
    singleton_lock_urls=["redis://localhost:6379/2"],
)


class PaymentGateway:
    """The payment provider's client (a real one makes an HTTP call)."""

    def charge(self, order_id: int, amount: int, *, idempotency_key: str) -> str:
        return f"ch_{order_id}_{amount}"


gateway = PaymentGateway()


@app.task(base=LockedTask, bind=True, lock_ttl=30, lock_unique_on=["order_id"])
def charge(self: Any, order_id: int, amount: int) -> str:
    """Charge an order: never twice at once, whatever the amount a second click sends (keyed on the order alone).

    A charge killed mid-run is run again under the same task id (with acks_late, as the README advises): that id is
    the provider's idempotency key, so the provider does not charge twice for it.
    """
    return gateway.charge(order_id, amount, idempotency_key=self.request.id)


@app.task(base=LockedTask, lock_cooldown=60)
def send_receipt(order_id: int) -> str:
    """At most one receipt per order per minute."""
    return f"receipt for order {order_id}"
