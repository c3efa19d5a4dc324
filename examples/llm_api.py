"""An LLM-style API with a request and a token quota at once: two tenants share them, a 429 pauses every start.

The fake API (:class:`FakeLLMAPI`, a real HTTP server on a free 127.0.0.1 port, in this process) allows ``REQUESTS``
requests and ``QUOTA`` tokens in any ``API_WINDOW`` s for the whole account, like an API's "requests per minute" and
"tokens per minute" scaled down to seconds. It admits a request only if it is within the requests and its estimate
(prompt tokens + ``max_tokens``) fits in what is left of the window's tokens, charges what the answer really used,
and answers anything else with a 429 and a ``Retry-After`` header (a refused request still counts as a request).

``complete(tenant, prompt)`` stacks three limits, each with its own cost (``Rate(cost=)``):

* ``Rate((QUOTA, RATE_WINDOW), cost=estimate)``: the account's tokens, a call's estimate of them, over a window one
  second longer than the API's (the API counts a request when it arrives, a few ms after the lock nodes counted its
  start: the longer window covers that gap);
* ``Rate((TENANT_SHARE, RATE_WINDOW), on=["tenant"], cost=estimate)``: one tenant never takes more than 60 % of
  them, so a big tenant's burst does not hold a small one back for long;
* ``Rate((REQUESTS, RATE_WINDOW))``: the account's requests, 1 unit a call (no cost of its own, no
  ``lock_rate_cost``: 1). All three are taken together, all or none, in one script call per lock node.

The estimate is high (the prompt's tokens + ``max_tokens``); after the answer, ``self.rate_spent(usage)`` gives the
unused tokens back at once, of the two token limits only (those whose cost is an estimate; the request stays one
request): a refund, promise 2 of docs/rate.md, the corrected tokens of any window never exceed the limit. On a 429
the body raises ``SlowDown.from_retry_after(response.headers["Retry-After"], limit=0)``: every start of the
account's token limit, whichever tenant, waits that long on every worker, and the refused call is re-sent to run
once after the pause. Here the 429 comes from outside: another application on the same API key spends the
whole quota just before the tenants' 4th request (the account's tokens are not all ours to count).

Run: ``python -m examples.llm_api`` from the repository root (the API listens on 127.0.0.1: the workers must run on
this host, as the throwaway ones do).
"""

from __future__ import annotations

import hashlib
import json
import math
import sys
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import ModuleType
from typing import Any
from urllib import error, request

from celery_singleton_lock import LockedTask, Rate, SlowDown
from examples._harness import outcomes, run_example, short
from examples.example_app import app, records

#: Not in docker-compose's demo: the fake API listens on the demo container's own 127.0.0.1, which the worker
#: containers cannot reach (tests/project/test_compose.py reads this line).
NOT_IN_COMPOSE_DEMO = True
QUOTA = 1000  # the API's tokens per API_WINDOW for the account (and our account limit)
REQUESTS = 5  # the API's requests per API_WINDOW for the account (and ours)
API_WINDOW = 2.0
RATE_WINDOW = 3.0  # ours: longer than the API's by more than the time from a counted start to the request
TENANT_SHARE = 600  # one tenant's tokens per RATE_WINDOW
MAX_TOKENS = 120  # the longest answer a call asks for
URL_KEY = "llm-api:url"  # where the workers find the API (in a real app: your settings)


def prompt_tokens(prompt: str) -> int:
    """The API's count of a prompt's tokens (about 4 characters each)."""
    return math.ceil(len(prompt) / 4)


def estimate(tenant: str, prompt: str) -> int:
    """The token limits' cost (``Rate(cost=)``), called like the task: the most a call can use, its prompt's tokens
    and the longest answer."""
    return prompt_tokens(prompt) + MAX_TOKENS


@app.task(
    base=LockedTask,
    bind=True,
    name="examples.llm.complete",
    lock_limit=None,  # no lock: calls run side by side, the rate alone decides when they start
    lock_rate=[
        Rate((QUOTA, RATE_WINDOW), cost=estimate),
        Rate((TENANT_SHARE, RATE_WINDOW), on=["tenant"], cost=estimate),
        Rate((REQUESTS, RATE_WINDOW)),
    ],
)
def complete(self: Any, tenant: str, prompt: str) -> str:
    """One completion for the tenant; its tokens are corrected after the answer, a 429 pauses the account's rate."""
    body = json.dumps({"tenant": tenant, "prompt": prompt, "max_tokens": MAX_TOKENS, "call": self.request.id})
    req = request.Request(
        str(records().get(URL_KEY)), data=body.encode(), headers={"Content-Type": "application/json"}, method="POST"
    )
    try:
        with request.urlopen(req, timeout=10) as response:
            answer = json.loads(response.read())
    except error.HTTPError as exc:
        if exc.code != 429:
            raise
        self.rate_spent(0)  # refused: it used no tokens (given back at once; the request limit keeps its unit)
        # limit=0: the account's limit (its index in lock_rate), shared by every tenant, is what the API said is full.
        raise SlowDown.from_retry_after(exc.headers.get("Retry-After"), default=1.0, limit=0) from None
    used = answer["usage"]
    refund = self.rate_spent(used)  # the estimate was the most it could use: give the rest back
    records().rpush(
        f"llm:{tenant}", json.dumps([self.request.id, estimate(tenant, prompt), used, refund, self.rate_started_at])
    )
    return str(answer["text"])


class FakeLLMAPI:
    """An LLM API on a free 127.0.0.1 port: ``quota`` tokens in any ``window`` s, a 429 with Retry-After beyond.

    ``log`` holds every request: ``(arrival, call id, tenant, status, tokens charged, Retry-After)``."""

    def __init__(
        self, quota: int = QUOTA, window: float = API_WINDOW, outside_before: int = 0, requests: int = REQUESTS
    ) -> None:
        self.quota, self.window, self.requests = quota, window, requests
        # Another application on the same API key spends the whole quota just before our request number
        # ``outside_before`` (0: never): the account's tokens are not all ours to count.
        self.outside_before, self.outside_at = outside_before, 0.0
        self.log: list[tuple[float, str, str, int, int, int]] = []
        self._charged: list[tuple[float, int]] = []  # (arrival, tokens) of the admitted requests, and outside spends
        self._mutex = threading.Lock()
        api = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                call = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                status, payload, retry_after = api.answer(call)
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                if retry_after:
                    self.send_header("Retry-After", str(retry_after))
                data = json.dumps(payload).encode()
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: Any) -> None:  # quiet
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}/v1/complete"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def __enter__(self) -> FakeLLMAPI:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()

    def _used(self, now: float) -> int:
        return sum(tokens for at, tokens in self._charged if at > now - self.window)

    def answer(self, call: dict[str, Any]) -> tuple[int, dict[str, Any], int]:
        """Admit the call if its estimate fits in the window's quota, and charge what it used; else a 429."""
        need = prompt_tokens(call["prompt"]) + call["max_tokens"]
        with self._mutex:
            now = time.time()
            if len(self.log) + 1 == self.outside_before:
                self._charged.append((now, self.quota))
                self.outside_at = now
            calls = sum(1 for at, *_ in self.log if at > now - self.window)
            if calls >= self.requests or self._used(now) + need > self.quota:
                retry_after = self._free_in(now, need)
                if calls >= self.requests:
                    first = min(at for at, *_ in self.log if at > now - self.window)
                    retry_after = max(retry_after, math.ceil(first + self.window - now))
                self.log.append((now, call["call"], call["tenant"], 429, 0, retry_after))
                return 429, {"error": "rate_limit_exceeded"}, retry_after
            # A deterministic answer of 20 to MAX_TOKENS tokens.
            words = 20 + int(hashlib.sha256(call["prompt"].encode()).hexdigest(), 16) % (MAX_TOKENS - 19)
            usage = prompt_tokens(call["prompt"]) + words
            self._charged.append((now, usage))
            self.log.append((now, call["call"], call["tenant"], 200, usage, 0))
        return 200, {"text": f"{words} words for {call['tenant']}", "usage": usage}, 0

    def _free_in(self, now: float, need: int) -> int:
        """Whole seconds until ``need`` tokens fit (the header's form), at least 1."""
        live = sorted((at, tokens) for at, tokens in self._charged if at > now - self.window)
        used = sum(tokens for _, tokens in live)
        for at, tokens in live:
            used -= tokens
            if used + need <= self.quota:
                return max(1, math.ceil(at + self.window - now))
        return max(1, math.ceil(self.window))

    def busiest_requests(self) -> int:
        """The most requests the API saw (ours, refused ones too) in any ``window`` s (by arrival)."""
        ats = sorted(at for at, *_ in self.log)
        return max((sum(1 for a in ats if at <= a < at + self.window) for at in ats), default=0)

    def busiest_window(self) -> int:
        """The most tokens the API charged our calls in any ``window`` s (by arrival)."""
        ours = sorted((at, tokens) for at, _, _, status, tokens, _ in self.log if status == 200)
        return max((sum(t for a, t in ours if at <= a < at + self.window) for at, _ in ours), default=0)


def corrected_busiest(runs: list[list[Any]], period: float) -> int:
    """The most corrected tokens (what the runs used) of starts counted in any ``period`` s, by the nodes' clock (10 ms
    of slack between nodes)."""
    starts = sorted((r[4], r[2]) for r in runs)
    return max((sum(u for a, u in starts if at <= a < at + period - 0.01) for at, _ in starts), default=0)


def prompts(tenant: str, count: int) -> list[str]:
    return [f"{tenant}: summarise ticket {i}. " + "Context. " * (10 + 7 * i) for i in range(count)]


def main(app_module: ModuleType) -> dict[str, Any]:
    db = app_module.records()
    run = uuid.uuid4().hex[:6]
    big, small = f"acme-{run}", f"tiny-{run}"
    with FakeLLMAPI(outside_before=4) as api:
        db.set(URL_KEY, api.url)
        print(
            f"\nThe API allows {QUOTA} tokens per {API_WINDOW:g} s; {big} sends 8 completions and {small} 3, at once."
        )
        print(
            f"lock_rate: {QUOTA} tokens and {REQUESTS} requests per {RATE_WINDOW:g} s for the account, "
            f"{TENANT_SHARE} tokens per tenant."
        )
        results = [complete.delay(big, p) for p in prompts(big, 8)]
        results += [complete.delay(small, p) for p in prompts(small, 3)]
        print("  (another application on the same API key spends the whole quota just before our 4th request)")
        seen = outcomes(results, timeout=120)
        log = list(api.log)
    runs = {t: [json.loads(x) for x in db.lrange(f"llm:{t}", 0, -1)] for t in (big, small)}
    t0 = min([e[0] for e in log] + [r[4] for rows in runs.values() for r in rows], default=0.0)
    spent_at = api.outside_at
    for tenant, rows in runs.items():
        est, used = sum(r[1] for r in rows), sum(r[2] for r in rows)
        print(f"  {tenant}: {len(rows)} runs, estimated {est} tokens, corrected to {used} (refunds {est - used})")
        print("    started at +" + ", +".join(f"{r[4] - t0:.2f}" for r in sorted(rows, key=lambda r: r[4])) + " s")
    refused = [e for e in log if e[3] == 429]
    after = []
    for at, call, tenant, _, _, retry_after in refused:
        ok = [e for e in log if e[1] == call and e[3] == 200]
        start = next((r[4] for r in runs[tenant] if r[0] == call), None)
        print(
            f"  429 for {short(call)} ({tenant}) at +{at - t0:.2f} s (the outside spend: +{spent_at - t0:.2f} s), "
            f"Retry-After {retry_after}: the account's starts paused; it ran {len(ok)} time(s), "
            f"at +{(start or 0) - t0:.2f} s"
        )
        after.append(len(ok) == 1 and start is not None and start >= at + retry_after - 0.05)
    own_429s = [e for e in refused if not spent_at - 0.05 <= e[0] < spent_at + API_WINDOW]
    calls = [e[1] for e in log if e[3] == 200]
    figures: dict[str, Any] = {
        "sent": len(results),
        "ran": sum(o.ran for o in seen),
        "answered_once": len(calls) == len(set(calls)) == len(results),
        "429s": len(refused),
        "429s_not_from_the_outside_spend": len(own_429s),
        "ran_once_after_the_pause": all(after) and bool(after),
        "api_busiest_window": api.busiest_window(),
        "api_busiest_requests": api.busiest_requests(),
        "corrected_busiest_window": corrected_busiest(runs[big] + runs[small], RATE_WINDOW),
        "runs": {t.split("-")[0]: len(rows) for t, rows in runs.items()},
        "refunded": sum(r[1] - r[2] for rows in runs.values() for r in rows),
    }
    print(
        f"  busiest {API_WINDOW:g} s at the API: {figures['api_busiest_window']} tokens of our calls (quota {QUOTA}); "
        f"busiest {RATE_WINDOW:g} s of corrected tokens: {figures['corrected_busiest_window']}; "
        f"busiest {API_WINDOW:g} s of requests: {figures['api_busiest_requests']} (quota {REQUESTS})"
    )
    figures["ok"] = (
        figures["ran"] == figures["sent"] == 11
        and figures["answered_once"]
        and figures["ran_once_after_the_pause"]
        and not own_429s
        and figures["api_busiest_window"] <= QUOTA
        and figures["api_busiest_requests"] <= REQUESTS
        and figures["corrected_busiest_window"] <= QUOTA
        and figures["runs"] == {"acme": 8, "tiny": 3}
    )
    return figures


if __name__ == "__main__":
    sys.exit(run_example(main))
