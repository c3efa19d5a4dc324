"""A user double-clicks "pay": the charge endpoint is hit twice at once, and the card is charged once.

Both requests enqueue ``charge(order_id, amount_cents)``; the two messages reach two different worker processes
within milliseconds. The first takes the lock and talks to the payment provider; the second finds the lock held by
a *different* job and is skipped: its caller's ``result.get()`` raises ``TaskRevokedError`` at once, with a reason
naming the lock and the task that holds it (so the endpoint can answer "already being charged").

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
from examples._harness import outcomes, run_example, short
from examples.example_app import app, records


@app.task(base=LockedTask, bind=True, name="examples.payment.charge", lock_ttl=10)
def charge(self: Any, order_id: int, amount_cents: int) -> str:
    """Charge the order's card (the provider call takes ~0.5 s), recording every charge made."""
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
    seen = outcomes(sent, timeout=30)
    charges = app_module.records().lrange(f"payment:{order}:charges", 0, -1)
    ran = [o for o in seen if o.ran]
    skipped = [o for o in seen if o.state == "REVOKED"]
    for i, o in enumerate(seen, 1):
        if o.ran:
            print(f"  click {i} [{short(o.task_id)}]: RAN      {o.value}")
        else:
            print(f"  click {i} [{short(o.task_id)}]: {o.state:<8} {o.reason}")
            print(f"           -> the lock is held by task {short(o.holder)}, the click that is charging the card")
    holder_named = bool(ran) and all(o.holder == ran[0].task_id for o in skipped)
    print(f"  charges made for order {order}: {len(charges)}")
    return {
        "sent": len(seen),
        "charged": len(charges),
        "ran": len(ran),
        "revoked": len(skipped),
        "holder_named": holder_named,
        "ok": len(charges) == 1 and len(ran) == 1 and len(skipped) == 1 and holder_named,
    }


if __name__ == "__main__":
    sys.exit(run_example(main))
