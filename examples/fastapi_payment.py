"""The double-clicked "pay" button on a FastAPI endpoint (``examples/fastapi_app.py``), two app instances.

Click 1 goes to instance A; while its charge (1 s at the simulated provider) is in flight, click 2 goes to
instance B: it is answered 409 "payment in progress" at once. Click 3, after click 1 was answered, gets 200 with
click 1's charge. The provider was called once.

Run: ``python -m examples.fastapi_payment`` from the repository root (starts four redis-servers and two uvicorn
processes).
"""

from __future__ import annotations

import asyncio
import sys
import uuid
from typing import Any

import httpx
import redis

from examples._web import Web, web_instances


async def clicks(web: Web, order_id: str) -> list[httpx.Response]:
    a, b = web.instances[0], web.instances[-1]
    async with httpx.AsyncClient(timeout=30.0) as client:
        first = asyncio.ensure_future(client.post(f"{a}/orders/{order_id}/pay"))
        await asyncio.sleep(0.3)  # the double click, while the first charge is in flight
        second = await client.post(f"{b}/orders/{order_id}/pay")
        first_answer = await first
        third = await client.post(f"{b}/orders/{order_id}/pay")  # once the first was answered
    return [first_answer, second, third]


def main(web: Web) -> dict[str, Any]:
    order_id = f"order-{uuid.uuid4().hex[:8]}"
    print(f"\nthree clicks on 'pay' for {order_id}: the 2nd while the 1st is in flight, the 3rd after it")
    answers = asyncio.run(clicks(web, order_id))
    for n, r in enumerate(answers, 1):
        print(f"  click {n}: {r.status_code} {r.json()}")
    store = redis.Redis.from_url(web.store_url, decode_responses=True)
    try:
        charges = store.lrange(f"charges:{order_id}", 0, -1)
    finally:
        store.close()
    print(f"  provider charges for {order_id}: {charges}")
    first, _, third = answers
    return {
        "statuses": [r.status_code for r in answers],
        "charges": len(charges),
        "same_charge": first.status_code == 200 and third.json().get("charge") == first.json().get("charge"),
        "ok": (
            [r.status_code for r in answers] == [200, 409, 200]
            and len(charges) == 1
            and third.json().get("charge") == first.json().get("charge")
        ),
    }


if __name__ == "__main__":
    with web_instances() as running:
        figures = main(running)
    print(f"\nfigures: {figures}")
    sys.exit(0 if figures["ok"] else 1)
