"""A FastAPI app with the two handlers where duplicates are born, guarded by AsyncRedlock (no sync I/O on the loop).

``POST /orders/{order_id}/pay``: the "pay" button. The charge runs under ``AsyncRedlock("pay:<order>")`` taken
without waiting (``timeout=0``): a second click while the first request is in flight is answered **409 Conflict**
("payment in progress", with ``Retry-After``) at once; a click after it finished is answered **200 with the first
request's charge** (the outcome is stored before the lock is released, and read first). The charge runs once.

``GET /reports/{key}``: a cache-stampede guard. A cold key asked by 500 requests at once is computed once: the
request that takes ``AsyncRedlock("rebuild:<key>")`` computes and fills the cache (checking the cache again first);
the others poll the cache (a cheap GET every 50 ms, bounded) instead of the lock; every request is served the one
computed value. Requests of one process coalesce before the lock (one attempt per key and process at a time).

Run as users do: ``EXAMPLES_LOCK_URLS=redis://...,... EXAMPLES_STORE_URL=redis://... uvicorn examples.fastapi_app:app``
(several instances may share the lock nodes and the store: the lock is distributed). ``examples/fastapi_payment.py``
and ``examples/cache_stampede.py`` start two instances and drive them with httpx.
"""

from __future__ import annotations

import asyncio
import os
import secrets
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import redis.asyncio as aioredis
from fastapi import FastAPI, HTTPException

from celery_singleton_lock import AsyncRedlock, LockNotAcquiredError, LockUnavailableError
from celery_singleton_lock.aio import aclose

LOCK_URLS = os.environ.get("EXAMPLES_LOCK_URLS", "redis://127.0.0.1:6379/0").split(",")
STORE_URL = os.environ.get("EXAMPLES_STORE_URL", "redis://127.0.0.1:6379/1")
CHARGE_SECONDS = float(os.environ.get("EXAMPLES_CHARGE_SECONDS", "1.0"))  # the payment provider's latency
COMPUTE_SECONDS = float(os.environ.get("EXAMPLES_COMPUTE_SECONDS", "0.5"))  # the report's cost
CACHE_WAIT = 30.0  # how long a request waits for another's computation before answering 503


@asynccontextmanager
async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
    # A blocking pool: 250 requests of a process at once would exceed a plain pool's 100 connections (redis-py 8
    # refuses the rest with MaxConnectionsError); these wait for a free connection instead.
    pool = aioredis.BlockingConnectionPool.from_url(STORE_URL, max_connections=50, timeout=20, decode_responses=True)
    _app.state.store = aioredis.Redis(connection_pool=pool)
    yield
    await _app.state.store.aclose()
    await aclose()  # the lock nodes' connections this loop opened


app = FastAPI(lifespan=lifespan)


def store() -> aioredis.Redis:
    return app.state.store  # type: ignore[no-any-return]


@app.get("/health")
async def health() -> dict[str, str]:
    return {"status": "ok", "instance": os.environ.get("EXAMPLES_INSTANCE", "")}


async def provider_charge(order_id: str, fencing_token: int) -> str:
    """The payment provider (simulated): slow, and it must be called once per order. The fencing token goes with
    the request, so a provider (or a ledger) can refuse a caller whose lock was taken over meanwhile."""
    await asyncio.sleep(CHARGE_SECONDS)
    charge_id = f"ch_{secrets.token_hex(6)}"
    await store().rpush(f"charges:{order_id}", f"{charge_id} fence={fencing_token}")
    return charge_id


@app.post("/orders/{order_id}/pay")
async def pay(order_id: str) -> dict[str, Any]:
    paid = await store().hget("paid", order_id)
    if paid:
        return {"status": "paid", "charge": paid}
    try:
        async with AsyncRedlock(LOCK_URLS, f"pay:{order_id}", ttl=10.0, timeout=0, cancel_on_loss=True) as lock:
            paid = await store().hget("paid", order_id)  # a first request may have finished since our read
            if paid:
                return {"status": "paid", "charge": paid}
            charge_id = await provider_charge(order_id, lock.fencing_token)
            await store().hset("paid", order_id, charge_id)  # the outcome, stored before the lock is released
            return {"status": "charged", "charge": charge_id}
    except LockUnavailableError as exc:  # too few lock nodes answered: the state is unknown, do not charge
        raise HTTPException(503, "payments unavailable, try again", headers={"Retry-After": "1"}) from exc
    except LockNotAcquiredError as exc:
        raise HTTPException(409, "payment in progress", headers={"Retry-After": "1"}) from exc


async def compute_report(key: str) -> str:
    """The expensive computation (simulated); counted so the example can show it ran once."""
    await store().incr(f"computations:{key}")
    await asyncio.sleep(COMPUTE_SECONDS)
    return f"report {key} #{secrets.token_hex(4)}"


# The keys this process is rebuilding right now: one request per key and process tries the lock, the others of the
# process wait for the cache (single-flight in the process first, then the lock across processes). Without it, 250
# requests of one process acquiring at once saturate its loop: node answers arrive after socket_timeout by the
# loop's clock and the attempts read as "unavailable".
_rebuilding: set[str] = set()


@app.get("/reports/{key}")
async def report(key: str) -> dict[str, Any]:
    cache_key = f"cache:{key}"
    for _ in range(int(CACHE_WAIT / 0.05)):
        value = await store().get(cache_key)
        if value is not None:
            return {"value": value, "computed_here": False}
        if key not in _rebuilding:
            _rebuilding.add(key)
            try:
                async with AsyncRedlock(LOCK_URLS, f"rebuild:{key}", ttl=10.0, timeout=0, cancel_on_loss=True):
                    value = await store().get(cache_key)  # filled while we took the lock?
                    computed = value is None
                    if value is None:
                        value = await compute_report(key)
                        await store().set(cache_key, value, ex=60)
                    return {"value": value, "computed_here": computed}
            except LockNotAcquiredError:  # another process computes it (or, unavailable, no node answered: retry)
                pass
            finally:
                _rebuilding.discard(key)
        await asyncio.sleep(0.05)  # someone else computes it: wait for the cache, not the lock
    raise HTTPException(503, "the report is still being computed, try again", headers={"Retry-After": "1"})
