"""A coupon with 5 left and 12 users redeeming it at once: never oversold, with the lock; oversold without it.

``redeem(coupon, user)`` checks the stock, does the slow part of a redemption (creating the order), then takes
one off. Twelve different users make twelve different calls, but they must not interleave on one coupon, so the
lock is keyed on the coupon only (``lock_unique_on=["coupon"]``) and a call that finds the coupon locked is not
dropped but re-sent to run after the holder's lease (``lock_on_duplicate="reschedule"``): every user gets an
answer, exactly 5 get the coupon, and the stock never goes below zero.

The same body as a plain task (no lock) runs four at a time on the two workers: several read "1 left" at the
same moment and all take one, so more than 5 users get the coupon and the stock ends below zero.

Run: ``python -m examples.stock_decrement`` from the repository root.
"""

from __future__ import annotations

import json
import sys
import time
import uuid
from types import ModuleType
from typing import Any

from celery_singleton_lock import LockedTask, signals
from examples._harness import outcomes, run_example
from examples.example_app import app, records

STOCK = 5
USERS = 12


def _redeem(coupon: str, user: str) -> str:
    """Check, work, take one off: a check-then-act that is only correct if nothing interleaves."""
    db = records()
    stock = int(db.get(f"coupon:{coupon}:stock") or 0)
    time.sleep(0.1)  # create the order, reserve the discount: the window in which others can interleave
    if stock <= 0:
        result: dict[str, Any] = {"user": user, "result": "sold out", "t": time.time()}
    else:
        result = {"user": user, "result": "redeemed", "left": db.decr(f"coupon:{coupon}:stock"), "t": time.time()}
    db.rpush(f"coupon:{coupon}:log", json.dumps(result))
    return str(result["result"])


# A short ttl keeps the example quick: a re-sent redemption comes back after the holder's remaining lease (< 1 s,
# renewed while the holder runs) rather than after a long default lease.
REDEEM = "examples.stock.redeem"


@app.task(
    base=LockedTask,
    name=REDEEM,
    lock_unique_on=["coupon"],
    lock_on_duplicate="reschedule",
    lock_ttl=1,
)
def redeem(coupon: str, user: str) -> str:
    """Redeem the coupon for the user, one redemption of a coupon at a time."""
    return _redeem(coupon, user)


@app.task(name="examples.stock.redeem_unlocked")
def redeem_unlocked(coupon: str, user: str) -> str:
    """The same redemption as a plain task: nothing stops two from interleaving."""
    return _redeem(coupon, user)


# Signals are process-wide: this receiver also hears other apps' tasks. It compares names, not ``redeem.name``:
# reading an attribute of ``redeem`` (a proxy until the app is finalized) would finalize and configure this app
# then, from whatever environment the process has at that moment (a test of another app's skip did exactly that).
@signals.duplicate_skipped.connect
def _count_resends(sender: Any, key: str, policy: str, **_: Any) -> None:
    if sender is not None and sender.name == REDEEM and policy == "reschedule":
        records().hincrby("stock:resends", key, 1)


def _run(task: Any, app_module: ModuleType, label: str) -> dict[str, Any]:
    db = app_module.records()
    coupon = f"SPRING-{uuid.uuid4().hex[:6]}"
    db.set(f"coupon:{coupon}:stock", STOCK)
    print(f"\n{label}: coupon {coupon} has {STOCK} left; {USERS} users redeem it at the same moment.")
    results = [task.delay(coupon, f"user-{i:02d}") for i in range(1, USERS + 1)]
    seen = outcomes(results, timeout=90)
    log = sorted((json.loads(x) for x in db.lrange(f"coupon:{coupon}:log", 0, -1)), key=lambda r: r["t"])
    t0 = log[0]["t"] if log else 0.0
    for r in log:
        left = f"({r['left']} left)" if "left" in r else ""
        print(f"  +{r['t'] - t0:5.2f}s  {r['user']}  {r['result']:<9} {left}")
    redeemed = sum(r["result"] == "redeemed" for r in log)
    lowest = min([r["left"] for r in log if "left" in r], default=STOCK)
    final = int(db.get(f"coupon:{coupon}:stock") or 0)
    resends = int(db.hget("stock:resends", redeem.lock_key_for(coupon, "anyone")) or 0)
    answered = sum(o.ran for o in seen)
    print(f"  redeemed: {redeemed} of {STOCK}; stock now {final} (lowest seen {lowest}); {answered} users answered")
    if task is redeem:
        print(f"  redemptions re-sent because the coupon was locked: {resends} (each ran later, once)")
    elif redeemed > STOCK:
        print(f"  OVERSOLD by {redeemed - STOCK}: reads of the stock interleaved with other redemptions' writes")
    return {"redeemed": redeemed, "final_stock": final, "lowest_stock": lowest, "answered": answered, "log": len(log)}


def main(app_module: ModuleType) -> dict[str, Any]:
    locked = _run(redeem, app_module, "With the lock (lock_unique_on=['coupon'], lock_on_duplicate='reschedule')")
    unlocked = _run(redeem_unlocked, app_module, "Without a lock (a plain task)")
    ok = (
        locked["redeemed"] == STOCK
        and locked["lowest_stock"] >= 0
        and locked["final_stock"] == 0
        and locked["answered"] == locked["log"] == USERS
    )
    return {"locked": locked, "unlocked": unlocked, "oversold_without_lock": unlocked["redeemed"] > STOCK, "ok": ok}


if __name__ == "__main__":
    sys.exit(run_example(main))
