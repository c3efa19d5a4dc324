"""Leader election: three instances of a service, one active at a time, failover within a lease, and the fencing
token handed to the store so a leader that was paused cannot write over its successor.

Each instance runs the same loop::

    while running:
        try:
            with Redlock(LOCK_URLS, "leader:billing-sync", ttl=TTL, interrupt_on_loss=True) as lock:
                while True:                       # the leader's work, until the lease is lost
                    write(store, lock.fencing_token, me)
                    time.sleep(STEP)
        except LockLostError:
            pass                                  # back to waiting: someone else leads now

``with`` waits until it is the leader, the process's watchdog renews the lease every ``ttl / 3`` while the block
runs, and a lost lease raises ``LockLostError`` inside the block (``interrupt_on_loss``, main thread). A follower
takes over within about one ``ttl`` of the leader's death. The store accepts a write only with a fencing token at
least the highest it has seen (one Lua script): a leader frozen past its lease (a GC pause, a stopped VM) that wakes
up and writes before its watchdog noticed the loss is refused there, the guard that holds even when the interrupt
comes too late.

``main`` starts four redis-servers (three lock nodes and the store), three instances as real processes, SIGKILLs
the first leader, then SIGSTOPs the second one for longer than a lease and resumes it, and reports who led, the
failover times and the writes the store refused.

Run: ``python -m examples.leader_election`` from the repository root.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from types import ModuleType
from typing import Any

import redis

from celery_singleton_lock import LockLostError, LockNotAcquiredError, Redlock
from celery_singleton_lock.testing import example_port, redis_servers, spawn

NAME = "leader:billing-sync"
TTL = 1.0  # the lease: a dead leader is replaced within about this long
STEP = 0.1  # the leader writes every STEP seconds
LIFETIME = 120.0  # an instance stops by itself after this long, whatever happens
INSTANCES = ("node-a", "node-b", "node-c")

# The store's fenced write: accepted only if the token is at least the highest seen (KEYS: high-water mark, log).
FENCED_WRITE = """
local high = tonumber(redis.call('GET', KEYS[1]) or '0')
if tonumber(ARGV[1]) < high then return 0 end
redis.call('SET', KEYS[1], ARGV[1])
redis.call('RPUSH', KEYS[2], ARGV[1] .. ' ' .. ARGV[2])
return 1
"""


def instance(me: str, lock_urls: list[str], store_url: str) -> None:
    """One instance of the service: wait to lead, lead until the lease is lost, wait again (until told to stop)."""
    store = redis.Redis.from_url(store_url, socket_timeout=5)
    write = store.register_script(FENCED_WRITE)
    stop_at = time.monotonic() + LIFETIME
    while time.monotonic() < stop_at and not store.exists("stop"):
        lock = Redlock(lock_urls, NAME, ttl=TTL, timeout=1.0, interrupt_on_loss=True)
        try:
            with lock:
                if store.exists("stop"):
                    break
                store.rpush("events", f"{me} leads with token {lock.fencing_token}")
                while time.monotonic() < stop_at and not store.exists("stop"):
                    if not write(keys=["high", "log"], args=[lock.fencing_token, me]):
                        store.incr(f"refused:{me}")  # a stale leader's write: the store kept its successor's
                    time.sleep(STEP)
        except LockLostError:
            store.rpush("events", f"{me} lost the lease (token {lock.fencing_token})")
        except LockNotAcquiredError:  # not the leader within timeout (or the nodes unreachable): wait again
            time.sleep(STEP)


def leader(store: redis.Redis) -> tuple[int, str] | None:
    """The last accepted write: (fencing token, instance)."""
    last = store.lindex("log", -1)
    if last is None:
        return None
    token, who = last.decode().split(" ")
    return int(token), who


def wait_for_leader(store: redis.Redis, not_this: str | None, timeout: float = 30.0) -> tuple[int, str] | None:
    """Poll the store until an instance other than ``not_this`` writes (bounded)."""
    for _ in range(int(timeout / 0.02)):
        now = leader(store)
        if now is not None and now[1] != not_this:
            return now
        time.sleep(0.02)
    return None


def main(_app_module: ModuleType | None = None) -> dict[str, Any]:
    with redis_servers(4, ports=example_port) as servers:
        lock_urls, store_url = [s.url for s in servers[:3]], servers[3].url
        store = redis.Redis.from_url(store_url, socket_timeout=5)
        procs: dict[str, subprocess.Popen[bytes]] = {}
        for me in INSTANCES:
            procs[me] = spawn(
                [sys.executable, "-m", "examples.leader_election", "--instance", me, store_url, *lock_urls],
                cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
            )
        try:
            first = wait_for_leader(store, None)
            assert first is not None, "no instance became the leader"
            print(f"\n{first[1]} leads (fencing token {first[0]}); SIGKILL it.")
            procs[first[1]].kill()
            killed_at = time.monotonic()
            second = wait_for_leader(store, first[1])
            assert second is not None, "nobody took over from the killed leader"
            after_kill = time.monotonic() - killed_at
            print(f"{second[1]} took over after {after_kill:.2f} s (ttl {TTL} s), token {second[0]}.")

            print(f"SIGSTOP {second[1]} for {1.5 * TTL:.1f} s (longer than its lease), then SIGCONT.")
            procs[second[1]].send_signal(signal.SIGSTOP)
            paused_at = time.monotonic()
            third = wait_for_leader(store, second[1])
            after_pause = time.monotonic() - paused_at
            time.sleep(max(0.0, 1.5 * TTL - after_pause))
            procs[second[1]].send_signal(signal.SIGCONT)
            assert third is not None, "nobody took over from the paused leader"
            print(f"{third[1]} took over after {after_pause:.2f} s, token {third[0]}.")
            time.sleep(TTL)  # the resumed instance finds its lease lost (interrupted), or writes and is refused
            store.set("stop", 1)
            for p in procs.values():
                p.wait(30)
        finally:
            for p in procs.values():
                if p.poll() is None:
                    p.send_signal(signal.SIGCONT)
                    p.kill()
                    p.wait(10)
        log = [(int(t), who) for t, who in (e.decode().split(" ") for e in store.lrange("log", 0, -1))]
        events = [e.decode() for e in store.lrange("events", 0, -1)]
        refused = {me: int(store.get(f"refused:{me}") or 0) for me in INSTANCES}
        store.close()
    tokens = [t for t, _ in log]
    owners: dict[int, set[str]] = {}
    for t, who in log:
        owners.setdefault(t, set()).add(who)
    took_over = next(i for i, (t, _) in enumerate(log) if t == third[0])
    resumed_after = [who for _, who in log[took_over:]]
    for e in events:
        print(f"  {e}")
    print(f"  accepted writes: {len(log)}; refused stale writes: {refused}")
    return {
        "leaders": [first[1], second[1], third[1]],
        "failover_after_kill_s": round(after_kill, 2),
        "failover_after_pause_s": round(after_pause, 2),
        "refused": refused,
        "lost_events": sum(1 for e in events if "lost the lease" in e),
        "tokens_grow": tokens == sorted(tokens),
        "one_leader_per_token": all(len(who) == 1 for who in owners.values()),
        "paused_leader_wrote_after_successor": second[1] in resumed_after,
        "ok": (
            len({first[1], second[1], third[1]}) == 3
            and tokens == sorted(tokens)
            and all(len(who) == 1 for who in owners.values())
            and second[1] not in resumed_after
        ),
    }


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--instance":
        instance(sys.argv[2], sys.argv[4:], sys.argv[3])
        sys.exit(0)
    figures = main()
    print(f"\nfigures: {figures}")
    sys.exit(0 if figures["ok"] else 1)
