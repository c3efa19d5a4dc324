"""A cache stampede on a FastAPI endpoint (``examples/fastapi_app.py``): 500 concurrent requests for a cold key,
spread over two app instances. One request computes the report (0.5 s), every request is served that value.

Run: ``python -m examples.cache_stampede`` from the repository root (starts four redis-servers and two uvicorn
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

REQUESTS = 500


async def stampede(web: Web, key: str) -> list[httpx.Response | BaseException]:
    limits = httpx.Limits(max_connections=REQUESTS, max_keepalive_connections=REQUESTS)
    async with httpx.AsyncClient(timeout=60.0, limits=limits) as client:
        return await asyncio.gather(
            *(client.get(f"{web.instances[i % len(web.instances)]}/reports/{key}") for i in range(REQUESTS)),
            return_exceptions=True,
        )


def main(web: Web) -> dict[str, Any]:
    key = f"sales-{uuid.uuid4().hex[:8]}"
    print(f"\n{REQUESTS} concurrent requests for the cold report {key!r} on {len(web.instances)} instances")
    answers = asyncio.run(stampede(web, key))
    served = [r for r in answers if isinstance(r, httpx.Response) and r.status_code == 200]
    errors = [r if isinstance(r, BaseException) else f"{r.status_code} {r.text}" for r in answers if r not in served]
    values = {r.json()["value"] for r in served}
    computed_here = sum(1 for r in served if r.json()["computed_here"])
    store = redis.Redis.from_url(web.store_url, decode_responses=True)
    try:
        computations = int(store.get(f"computations:{key}") or 0)
    finally:
        store.close()
    print(f"  served: {len(served)}/{REQUESTS}, distinct values: {len(values)}, computations: {computations}")
    if errors:
        print(f"  not served: {len(errors)}, e.g. {errors[0]!r}")
    return {
        "requests": REQUESTS,
        "served": len(served),
        "distinct_values": len(values),
        "computations": computations,
        "computed_here": computed_here,
        "ok": len(served) == REQUESTS and len(values) == 1 and computations == 1 and computed_here == 1,
    }


if __name__ == "__main__":
    with web_instances() as running:
        figures = main(running)
    print(f"\nfigures: {figures}")
    sys.exit(0 if figures["ok"] else 1)
