"""The lock scripts' server cost in instructions (valgrind's callgrind): a steady figure on a shared, noisy machine.

``INFO commandstats`` µs per call moves by ±30% with the load of a shared 2-vCPU VM, more than a change to a script
saves. So each contender runs against a redis-server of its own under ``valgrind --tool=callgrind`` (no timing:
instructions, counted), ``--calls`` times, each call followed by a companion command (a ``PING``, or the ``DEL`` /
``SET`` / ``HSET`` that resets the key for the next call); a run of PINGs alone is the baseline, and a run of the
companion alone is subtracted, so each figure is the instructions of one call of the contender on the server (its
parsing, lookup, Lua, the commands inside, the reply). Figures move by a few thousand between runs (the event
loop's iterations depend on timing): compare differences larger than that. The companion is measured alone on
an empty key, so a figure also holds what resetting the key costs beyond that (the ``DEL`` of a real record).

Contenders (KEYS: the lock key and its fencing counter; a plain lock's arguments, ``ttl`` 10 s, fencing on):

* ``SET NX PX`` and the compare-and-delete Lua (``GET`` == tok -> ``DEL``): the str floor's two commands
* ``return 1``: an ``EVALSHA`` doing nothing, with the acquire's keys and arguments (the cost of calling a script)
* ``hash floor acquire``: ``EXISTS``, ``HSET owner``, ``PEXPIRE`` in Lua (the least a holder-record lock writes)
* ``acquire.lua`` free (no record fields, and LockedTask's 6), refused (the key held by another job), and
  ``release.lua``; with ``--old PATH`` (a checkout's ``celery_singleton_lock/lock/lua``) the same for its scripts

    python benchmarks/bench_server_cg.py                       # ~2 min
    python benchmarks/bench_server_cg.py --old /tmp/old/celery_singleton_lock/lock/lua --calls 1000
"""

from __future__ import annotations

import argparse
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import redis

LUA = Path(__file__).resolve().parent.parent / "celery_singleton_lock" / "lock" / "lua"
STR_RELEASE = "if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end return 0"
HASH_ACQUIRE = (
    "if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end "
    "redis.call('HSET', KEYS[1], 'owner', ARGV[1], unpack(ARGV, 7)) redis.call('PEXPIRE', KEYS[1], ARGV[2]) return 1"
)
RECORD = ("job", "j2", "state", "run", "name", "t", "worker", "2@h", "at", "1", "try", "0")
HELD = {"owner": "x", "job": "j1", "state": "run", "try": "0", "worker": "1@h", "fence": "1"}
Op = Callable[[redis.Redis, Any], Any]


def acquire_args(record: tuple[str, ...] = (), job: str = "") -> tuple[Any, ...]:
    return (2, "k", "k:fence", "tok", 10_000, "1", "", job, "1", *record)


def contenders(lua: Path, tag: str) -> dict[str, tuple[Callable[[redis.Redis], Any], Op, str]]:
    """name -> (set-up, one call, the companion subtracted)."""
    acquire, release = (lua / "acquire.lua").read_text(), (lua / "release.lua").read_text()

    def held(r: redis.Redis) -> Any:
        r.hset("held", mapping=HELD)
        return r.script_load(acquire)

    return {
        f"acquire.lua free, no fields{tag}": (
            lambda r: r.script_load(acquire),
            lambda r, sha: r.evalsha(sha, *acquire_args()),
            "del",
        ),
        f"acquire.lua free, LockedTask's 6 fields{tag}": (
            lambda r: r.script_load(acquire),
            lambda r, sha: r.evalsha(sha, *acquire_args(RECORD)),
            "del",
        ),
        f"acquire.lua refused{tag}": (
            held,
            lambda r, sha: r.evalsha(sha, 2, "held", "k:fence", "tok", 10_000, "1", "", "j2", "1", *RECORD),
            "ping",
        ),
        f"release.lua{tag}": (lambda r: r.script_load(release), lambda r, sha: r.evalsha(sha, 1, "k", "tok"), "hset"),
    }


def floors() -> dict[str, tuple[Callable[[redis.Redis], Any], Op, str]]:
    return {
        "SET NX PX (str floor)": (lambda r: None, lambda r, _: r.set("k", "tok", nx=True, px=10_000), "del"),
        "compare-and-delete Lua (str floor)": (
            lambda r: r.script_load(STR_RELEASE),
            lambda r, sha: r.evalsha(sha, 1, "k", "tok"),
            "set",
        ),
        "EVALSHA 'return 1'": (
            lambda r: r.script_load("return 1"),
            lambda r, sha: r.evalsha(sha, *acquire_args()),
            "ping",
        ),
        "hash floor acquire (EXISTS, HSET, PEXPIRE)": (
            lambda r: r.script_load(HASH_ACQUIRE),
            lambda r, sha: r.evalsha(sha, *acquire_args()),
            "del",
        ),
    }


COMPANIONS: dict[str, Op] = {
    "ping": lambda r, _: r.ping(),
    "del": lambda r, _: r.delete("k"),
    "set": lambda r, _: r.set("k", "tok"),
    "hset": lambda r, _: r.hset("k", "owner", "tok"),
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def instructions(server: str, calls: int, setup: Callable[[redis.Redis], Any], ops: list[Op], out: Path) -> int:
    """Total instructions of a redis-server that served ``calls`` rounds of ``ops`` under callgrind."""
    port = free_port()
    cmd = ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}", server, "--port", str(port), "--save", ""]
    proc = subprocess.Popen([*cmd, "--appendonly", "no"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    client = redis.Redis(port=port, socket_timeout=60)
    try:
        for _ in range(300):  # valgrind starts slowly: at most ~30 s
            try:
                client.ping()
                break
            except redis.ConnectionError:
                time.sleep(0.1)
        ctx = setup(client)
        for _ in range(calls):
            for op in ops:
                op(client, ctx)
        client.shutdown(nosave=True)
    except redis.ConnectionError:
        pass  # the shutdown closes the connection
    finally:
        proc.wait(timeout=120)
    found = re.search(r"^(?:summary|totals): (\d+)", out.read_text(), re.MULTILINE)
    if found is None:
        raise RuntimeError(f"no totals in {out}")
    return int(found.group(1))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=1000, help="calls per contender (default 1000)")
    parser.add_argument("--old", type=Path, help="another checkout's lua/ directory, measured beside this one")
    args = parser.parse_args()
    server = shutil.which("redis-server")
    if server is None or shutil.which("valgrind") is None:
        print("needs redis-server and valgrind on PATH", file=sys.stderr)
        return 2
    table = {**floors(), **contenders(LUA, "")}
    if args.old:
        table.update(contenders(args.old, " (old)"))
    with tempfile.TemporaryDirectory() as tmp:
        ping = COMPANIONS["ping"]
        base = instructions(server, args.calls, lambda r: None, [ping], Path(tmp) / "base.out")
        alone = {
            name: instructions(server, args.calls, lambda r: None, [op, ping], Path(tmp) / f"{name}.out") - base
            for name, op in COMPANIONS.items()
            if name != "ping"
        }
        alone["ping"] = 0
        print("| contender | server instructions per call |\n|---|---:|")
        for i, (name, (setup, op, companion)) in enumerate(table.items()):
            ops = [op, COMPANIONS[companion], ping] if companion != "ping" else [op, ping]
            total = instructions(server, args.calls, setup, ops, Path(tmp) / f"{i}.out")
            extra = total - base - alone[companion]  # what the call alone costs the server
            print(f"| {name} | {extra / args.calls:,.0f} |", flush=True)
    print(f"\n{args.calls} calls each, one redis-server per contender under callgrind ({server})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
