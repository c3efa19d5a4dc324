"""The cost of one ``lock_rate`` decision against the ``limits`` library's Redis moving window and a plain sorted-set
pipeline floor, in ONE interleaved run (benchmarks/harness.py: round-robin slices, the first contender rotating).

One operation is one decision "may this start now?" for one rate key, through each contender's own client:

* ``floor zset 1n``     a redis-py pipeline (no MULTI): ``ZREMRANGEBYSCORE`` out of the window, ``ZCARD``, and for
                        an allowed start ``ZADD`` + ``PEXPIRE`` (a refusal only reads): the sliding log everyone writes
                        first (client clock, not atomic: two clients can both pass a full window; the least a
                        sorted-set log costs, not a correct limiter)
* ``limits 1n``         ``limits`` ``MovingWindowRateLimiter(RedisStorage).hit(item, key)``: its Lua moving window
                        (a list of timestamps, one node)
* ``limits lean 1n``    the same Lua (limits' ``acquire_moving_window.lua``, its client's clock) sent through our lean
                        path (``NodeSet.run``): the script's cost without redis-py's high-level ``Script`` path, so
                        client CPU compares like with like
* ``ours 1n`` / ``ours 3n``  ``policies.rate.take(nodes, key, rate)``: lua/rate.lua on one node / on three at once
                        (a quorum of the same slot; the nodes' TIME), the verdict parsed
* ``ours 3n stacked3``  ``policies.rate.take_many(nodes, keys, windows)``: three stacked limits (issue 33), one
                        lua/rate_stack.lua call per node with the three logs, on three nodes (goal: one round trip
                        per node, client CPU within 1.5x ``ours 3n``)
* ``ours 3n costed3``   the same three limits with a cost per limit (``Rate(cost=)``: 1, 5 and 1 units), as requests
                        and tokens at once: still one call per node (the costs go in its arguments)

The column ``EVALSHA per node`` is the script calls each node ran per decision (``INFO commandstats``): the round trips
of a decision. Two scenarios: ``open`` (200 keys in turn at 100 per 1 s: every decision is an allowed start, each log
holds a few entries) and ``full`` (one key whose window is full: every decision a refusal naming the wait). Figures: p50
over every decision pooled, decisions/s, this process's CPU per decision and the servers' time per decision (medians
over rounds), and the ratios (medians of per-round paired ratios). Server time is Redis's own accounting, ``INFO
commandstats`` ``usec`` summed over every command and every node (reset before each slice: a slice is one contender's),
so it is the time the commands and scripts ran, without the network and event loop around them.

    PYTHONPATH=$PWD python benchmarks/bench_rate.py                 # ~1 min: 12 rounds x 0.25 s x 10 contenders
    PYTHONPATH=$PWD python benchmarks/bench_rate.py --quick
"""

from __future__ import annotations

import itertools
import secrets
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import _common  # noqa: F401 - benchmarks/_common.py: run as `python benchmarks/<script>.py`
import harness
import limits
import redis
from limits import RateLimitItemPerSecond
from limits.storage import RedisStorage
from limits.strategies import MovingWindowRateLimiter

from celery_singleton_lock.lock.nodes import NodeSet
from celery_singleton_lock.lock.scripts import Script
from celery_singleton_lock.policies.rate import Window as Rate
from celery_singleton_lock.policies.rate import take, take_many
from celery_singleton_lock.testing import redis_servers

OPEN = Rate(100, 1.0)
FULL = Rate(10, 3600.0)
#: Three stacked limits per scenario: the first is OPEN / FULL, the others looser (a few entries per log).
STACKS = {"open": [OPEN, Rate(200, 2.0), Rate(300, 3.0)], "full": [FULL, Rate(20, 3600.0), Rate(30, 3600.0)]}


def floor(client: redis.Redis, keys: Callable[[], str], rate: Rate, *, add: bool) -> Callable[[], Any]:
    window_ms = int(rate.period * 1000)

    def op() -> Any:
        key = keys()
        now = time.time() * 1000
        pipe = client.pipeline(transaction=False)
        pipe.zremrangebyscore(key, "-inf", now - window_ms)
        pipe.zcard(key)
        if add:  # an allowed start is logged; a refusal (the full window) only reads
            pipe.zadd(key, {secrets.token_hex(8): now})
            pipe.pexpire(key, window_ms + 1000)
        return pipe.execute()[1] < rate.limit

    return op


def ours(nodes: NodeSet, keys: Callable[[], str], rate: Rate) -> Callable[[], Any]:
    return lambda: take(nodes, keys(), rate)


def ours_stacked(
    nodes: NodeSet, keys: Callable[[], str], windows: list[Rate], costs: tuple[int, ...] = (1, 1, 1)
) -> Callable[[], Any]:
    def op() -> Any:
        key = keys()
        return take_many(nodes, [f"{key}:a", f"{key}:b", f"{key}:c"], windows, costs)

    return op


def peer(limiter: MovingWindowRateLimiter, keys: Callable[[], str], rate: Rate) -> Callable[[], Any]:
    item = RateLimitItemPerSecond(rate.limit, int(rate.period))
    return lambda: limiter.hit(item, keys())


def limits_lean(nodes: NodeSet, keys: Callable[[], str], rate: Rate) -> Callable[[], Any]:
    """limits' own moving-window Lua (its client clock, seconds) through our lean path: one EVALSHA, a bool back."""
    path = Path(limits.__file__).parent / "resources" / "redis" / "lua_scripts" / "acquire_moving_window.lua"
    script = Script(path.read_text(encoding="utf-8"))
    expiry = int(rate.period)
    return lambda: nodes.run(script, [f"LIMITS:{keys()}"], [repr(time.time()), rate.limit, expiry, 1])[0] == 1


def reset_stats(clients: list[redis.Redis]) -> None:
    for c in clients:
        c.config_resetstat()


def server_usec(clients: list[redis.Redis]) -> float:
    """Microseconds the servers spent running commands since the last reset (``INFO commandstats``), the
    benchmark's own CONFIG and INFO calls left out."""
    total = 0.0
    for c in clients:
        for name, stats in c.info("commandstats").items():
            if name not in ("cmdstat_config", "cmdstat_info"):
                total += float(stats["usec"])
    return total


def evals_per_node(clients: list[redis.Redis]) -> float:
    """EVALSHA calls the nodes ran since the last reset, per node."""
    calls = sum(int(c.info("commandstats").get("cmdstat_evalsha", {}).get("calls", 0)) for c in clients)
    return calls / len(clients)


def rotating(prefix: str, count: int) -> Callable[[], str]:
    cycle = itertools.cycle([f"{prefix}:{i}" for i in range(count)])
    return lambda: next(cycle)


def main(argv: list[str] | None = None) -> int:
    parser = harness.Cli(__doc__, quick={"seconds": 0.1, "rounds": 1})
    parser.add_argument("--seconds", type=float, default=0.25, help="time per contender per round (default 0.25)")
    parser.add_argument("--rounds", type=int, default=12, help="interleaved rounds (default 12)")
    parser.add_argument("--max-ops", type=int, default=50_000, help="cap on decisions per slice")
    args = parser.parse(argv)
    env = harness.start("lock_rate decision benchmark")
    with redis_servers(3) as servers:
        urls = [s.url for s in servers]
        sfx = secrets.token_hex(4)
        one, three = NodeSet(urls[0]), NodeSet(urls)
        client = redis.Redis.from_url(urls[0])
        limiter = MovingWindowRateLimiter(RedisStorage(urls[0]))
        admins = [redis.Redis.from_url(u) for u in urls]
        ops: dict[str, Callable[[], Any]] = {}
        for scenario, rate in (("open", OPEN), ("full", FULL)):

            def keys(name: str, scenario: str = scenario) -> Callable[[], str]:
                return rotating(f"bench:rate:{sfx}:{scenario}:{name}", 200 if scenario == "open" else 1)

            ops[f"floor zset 1n {scenario}"] = floor(client, keys("floor"), rate, add=scenario == "open")
            ops[f"limits 1n {scenario}"] = peer(limiter, keys("limits"), rate)
            ops[f"limits lean 1n {scenario}"] = limits_lean(one, keys("limits-lean"), rate)
            ops[f"ours 1n {scenario}"] = ours(one, keys("ours1"), rate)
            ops[f"ours 3n {scenario}"] = ours(three, keys("ours3"), rate)
            ops[f"ours 3n stacked3 {scenario}"] = ours_stacked(three, keys("stack3"), STACKS[scenario])
            ops[f"ours 3n costed3 {scenario}"] = ours_stacked(three, keys("cost3"), STACKS[scenario], (1, 5, 1))
        # Fill the full scenario's windows first (each contender's own key).
        for name, op in ops.items():
            if name.endswith("full"):
                for _ in range(FULL.limit + 2):
                    op()
        contenders = [harness.Contender(n, op) for n, op in ops.items()]

        def measure(c: harness.Contender, _rnd: int) -> harness.Sample:
            reset_stats(admins)
            sample = harness.timed(c.op, args.seconds, args.max_ops, collect=True)
            sample.values["server_us"] = server_usec(admins) / max(sample.ops, 1)
            ours3 = c.name.startswith("ours 3n")  # the three-node contenders: their script calls per node
            sample.values["evals"] = evals_per_node(admins) / max(sample.ops, 1) if ours3 else float("nan")
            return sample

        results = harness.interleave(contenders, args.rounds, measure, warmup=lambda c: harness.timed(c.op, 0.1, 500))
        rows = [
            [c.name, f"{results.median(c.name, 'ops_per_s'):,.0f}", f"{results.median(c.name, 'p50_us'):.1f}",
             f"{results.median(c.name, 'p99_us'):.1f}", f"{results.median(c.name, 'cpu_us'):.1f}",
             f"{results.median(c.name, 'server_us'):.1f}", f"{results.median(c.name, 'evals'):.2f}"]
            for c in contenders
        ]  # fmt: skip
        print(
            harness.markdown(
                [
                    "contender",
                    "decisions/s",
                    "p50 µs",
                    "p99 µs",
                    "client CPU µs",
                    "server µs (commandstats)",
                    "EVALSHA per node",
                ],
                rows,
            )
        )
        ratios = []
        for scenario in ("open", "full"):
            pairs = [
                (f"{name} {scenario}", f"floor zset 1n {scenario}") for name in ("limits 1n", "ours 1n", "ours 3n")
            ]
            pairs += [
                (f"ours 1n {scenario}", f"limits 1n {scenario}"),
                (f"ours 1n {scenario}", f"limits lean 1n {scenario}"),
                (f"ours 3n stacked3 {scenario}", f"ours 3n {scenario}"),
                (f"ours 3n costed3 {scenario}", f"ours 3n {scenario}"),
                (f"ours 3n costed3 {scenario}", f"ours 3n stacked3 {scenario}"),
            ]
            ratios += [
                (f"{name} / {ref}", *(results.paired(name, ref, m) for m in ("cpu_us", "server_us", "p50_us")))
                for name, ref in pairs
            ]
        print()
        print(
            harness.markdown(
                ["pair", "client CPU ratio", "server time ratio", "p50 ratio"],
                [[n, f"{a:.2f}x", f"{b:.2f}x", f"{c:.2f}x"] for n, a, b, c in ratios],
            )
        )
        client.close()
        for c in admins:
            c.close()
    harness.save(args, env, results=results.record(), ratios=[list(r) for r in ratios])
    print("\nmedians over interleaved rounds; ratios are medians of per-round paired ratios", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
