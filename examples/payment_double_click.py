"""A user double-clicks "pay", and clicks again 3 s later: the card is charged once, and every click gets that charge.

``charge`` uses ``lock_scope="queue"`` and ``lock_cooldown``, keyed on the order alone (``lock_unique_on``): the
first ``delay()`` reserves the job (the order) before its message is published; the second click, a few milliseconds
later, finds the reservation and publishes nothing: it gets *the first click's* ``AsyncResult`` (same task id). The
third click comes after the charge has finished: the cooldown still holds the job, so it too gets the first charge's
result instead of charging again. (With the default run scope the two simultaneous clicks would charge once, but the
click 3 s later would charge again: run scope means "never two at once", not "once".)

Run: ``python -m examples.payment_double_click`` from the repository root (starts its own Redis and workers).
"""

from __future__ import annotations

import sys
import threading
import time
import uuid
from types import ModuleType
from typing import Any

from celery_singleton_lock import LockedTask
from examples._harness import run_example, short
from examples.example_app import app, records


@app.task(
    base=LockedTask,
    bind=True,
    name="examples.payment.charge",
    lock_ttl=10,
    lock_scope="queue",
    lock_cooldown=600,
    lock_unique_on=["order_id"],  # the order is the job: a click sending another amount is no new charge
)
def charge(self: Any, order_id: int, amount_cents: int) -> str:
    """Charge the order's card (the provider call takes ~0.5 s), recording every charge made.

    A real provider call passes ``self.request.id`` as its idempotency key: a charge killed mid-run comes back
    (acks_late) under the same task id, and the provider does not charge twice for it.
    """
    time.sleep(0.5)  # the payment provider's API
    records().rpush(f"payment:{order_id}:charges", self.request.id)
    return f"charged order {order_id}: {amount_cents / 100:.2f} (fencing token {self.fencing_token})"


def main(app_module: ModuleType) -> dict[str, Any]:
    order = uuid.uuid4().int % 10**9
    print(f"\nA user double-clicks 'pay' on order {order}: two requests call charge.delay({order}, 4990) at once.")
    sent: list[Any] = [None, None]
    barrier = threading.Barrier(2)

    def click(i: int) -> None:  # two web requests, handled by two threads at the same moment
        barrier.wait()
        sent[i] = charge.delay(order, 4990)

    clicks = [threading.Thread(target=click, args=(i,)) for i in range(2)]
    for t in clicks:
        t.start()
    for t in clicks:
        t.join()
    first = sent[0].get(timeout=30) if sent[0] is not None else None
    print("  ... the charge finished; 3 s later the user clicks 'pay' again.")
    time.sleep(3.0)
    sent.append(charge.delay(order, 4990))
    charges = app_module.records().lrange(f"payment:{order}:charges", 0, -1)
    ids = {r.id for r in sent}
    answers = [r.get(timeout=30) for r in sent]
    for i, (r, answer) in enumerate(zip(sent, answers, strict=True), 1):
        print(f"  click {i} -> task [{short(r.id)}]: {answer}")
    print(f"  messages published: {len(ids)}; charges made for order {order}: {len(charges)}")
    return {
        "sent": len(sent),
        "published": len(ids),
        "charged": len(charges),
        "same_answer": all(a == first for a in answers),
        "ok": len(charges) == 1 and len(ids) == 1 and all(a == first for a in answers),
    }


if __name__ == "__main__":
    sys.exit(run_example(main))
