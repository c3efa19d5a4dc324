"""Regression tests from the adversarial review of the lock nodes (Sentinel, Redis Cluster, TLS, ACL users).

Each test guards one finding on real redis-server processes (tests/topologies.py); the comment above it names the
finding: 1 and 3 are documented limits (docs/nodes.md) checked as documented, 2 and 4 were fixed.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery
from kombu.utils import json as kombu_json
from topologies import Cluster, SentinelSet

from celery_singleton_lock import LockedTask, Redlock
from celery_singleton_lock._line import wake_next
from celery_singleton_lock.nodes import NodeSet
from celery_singleton_lock.record import _key_slot, sibling_key
from celery_singleton_lock.testing import RedisServer, redis_servers, wait_for

#: docs/nodes.md "ACL users": "The commands the library sends, all of them".
DOCUMENTED_ACL = (
    "+evalsha +eval +exists +type +get +set +incr +del +pexpire +pttl +time "
    "+hget +hmget +hset +hdel +hgetall +hexists +hlen +hincrby +scan "
    "+zadd +zrem +zrange +zrangebyscore +zpopmin"
)


def _app(urls: list[str] | str, prefix: str) -> Celery:
    app = Celery(f"atk10-{uuid.uuid4().hex[:8]}", broker="memory://", set_as_current=False)
    app.conf.singleton_lock_urls = urls
    app.conf.singleton_lock_prefix = prefix
    return app


def _fenced(app: Celery) -> Any:
    @app.task(base=LockedTask, bind=True, name="atk10.fenced", lock_ttl=10, shared=False)
    def fenced(self: Any, n: int) -> int:
        assert self.lock_held()
        return int(self.fencing_token)

    return fenced


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    with Cluster(3) as topology:
        yield topology


# FINDING 1 (a documented limit). Once the surviving masters mark a dead master FAIL, Redis' default
# `cluster-require-full-coverage yes` makes them answer CLUSTERDOWN for every slot, so the locks on the healthy
# masters are not renewed either. docs/nodes.md ("Moved slots and failed masters") now says so and tells users to
# set `cluster-require-full-coverage no`; with that setting, the survivors' locks renew after the FAIL mark.
@pytest.mark.timeout(40)
def test_survivors_locks_still_renew_after_the_cluster_marks_a_master_failed() -> None:
    with Cluster(3) as topology:
        for master in topology.masters:  # what docs/nodes.md tells users to set for a cluster used for locks
            master.client().config_set("cluster-require-full-coverage", "no")
        nodes = NodeSet(topology.url())
        names = [f"down10:{i}" for i in range(24)]
        held = [Redlock(nodes, n, ttl=30.0) for n in names]
        assert all(lock.acquire(blocking=False) for lock in held)
        dead = topology.masters[2]
        dead.kill()
        survivor = topology.masters[0].client(socket_timeout=1.0, decode_responses=True)

        def marked_failed() -> bool:  # the survivors flagged the dead master FAIL (not just PFAIL)
            lines = str(survivor.execute_command("CLUSTER", "NODES")).splitlines()
            line = next(x for x in lines if f":{dead.port}@" in x)
            return "fail" in line.split()[2].split(",")

        assert wait_for(marked_failed, 15.0, 0.1)
        answers = Redlock.nodes_extend(held)
        on_survivors = [a for n, a in zip(names, answers, strict=True) if topology.master_of(_key_slot(n)) is not dead]
        assert on_survivors, "no lock on a surviving master"
        # With Redis' default (yes) every survivor's answer would be None (CLUSTERDOWN), not True.
        assert on_survivors == [True] * len(on_survivors)


# FINDING 2 (fixed; docs/nodes.md "ACL users": "The commands the library sends, all of them"). The reschedule/replace
# waiting line (task.py _park/_unpark/_wake_next) sends ZADD, ZREM, ZRANGE(BYSCORE) and ZPOPMIN, which the
# documented set used to lack: with the documented user every park and wake was refused (NOPERM) and swallowed, so
# waiters were never woken by the release. The documented set (DOCUMENTED_ACL above) now has them.
def test_the_documented_acl_set_can_wake_a_waiting_duplicate(fresh_node: RedisServer) -> None:
    prefix = "acl10:"
    admin = fresh_node.client()
    admin.execute_command(
        "ACL", "SETUSER", "locker10", "reset", "on", ">Acl10PwZ", f"~{prefix}*", f"~{{{prefix}*",
        "resetchannels", "-@all", *DOCUMENTED_ACL.split(),
    )  # fmt: skip
    app = _app(f"redis://locker10:Acl10PwZ@127.0.0.1:{fresh_node.port}/0", prefix)

    @app.task(base=LockedTask, bind=True, name="atk10.waits", lock_ttl=10, lock_on_duplicate="reschedule")
    def waits(self: Any, n: int) -> int:
        return n

    key = waits.lock_key_for(1)
    line, messages = sibling_key(key, ":waiters"), sibling_key(key, ":parked")
    admin.zadd(line, {"w-1": 1})
    admin.hset(messages, "w-1", kombu_json.dumps(dict(waits.signature((1,), task_id="w-1"))))
    wake_next(waits.lock_context(), key, waits.lock_options())  # what the holder's release does
    # The documented user may ZPOPMIN: the waiter left the line (it was sent), rather than staying on a NOPERM.
    assert admin.zcard(line) == 0


# FINDING 3 (a documented limit; fencing). With a Cluster node in the list the prefix's shared counter is kept per
# slot on every node, plain ones included (nodes.py NodeSet.same_slot / fence_key_in_slot). Taking the Cluster
# node out again switches every node back to the plain `<prefix>fence`, which those runs never raised: the next
# token goes back although no node lost anything. docs/nodes.md now says so for removing the last Cluster node too.
def test_removing_the_cluster_node_restarts_tokens_as_documented(cluster: Cluster) -> None:
    prefix = f"rm10{uuid.uuid4().hex[:6]}:"
    with redis_servers(2) as plain:
        mixed = _fenced(_app([cluster.url(), plain[0].url, plain[1].url], prefix))
        tokens = [mixed.apply(args=(7,), task_id=f"m-{i}").get() for i in range(3)]
        assert tokens == sorted(set(tokens))
        # The cluster is retired: the two plain nodes (which lost nothing) and a new one.
        with redis_servers(1) as extra:
            after = _fenced(_app([plain[0].url, plain[1].url, extra[0].url], prefix))
            token = after.apply(args=(7,), task_id="p-1").get()
        # Documented (docs/nodes.md, Sentinel section): the counters' names change, tokens start again.
        assert token <= tokens[-1], (tokens, token)


# FINDING 4 (fixed; rule 2: "Bad input gets a clear one-line error saying what to change"). A wrong (or missing)
# sentinel_password used to make the node error embed redis-py's whole Sentinel client repr (~600 characters, the
# reason buried at its end, not saying which password to fix). The node error is now short and names
# sentinel_password (nodes.py NodeSet._failed).
@pytest.mark.timeout(40)
def test_a_wrong_sentinel_password_is_a_short_clear_error() -> None:
    with SentinelSet(service="locks", sentinel_password="Sn10PwQx") as sentinels:
        url = sentinels.url().replace("sentinel_password=Sn10PwQx", "sentinel_password=wrong10")
        lock = Redlock(url, f"sp10:{uuid.uuid4().hex}", ttl=5.0)
        assert not lock.acquire(blocking=False)  # refused by the Sentinels (bounded by the test's 40 s timeout)
        (error,) = lock.node_errors
        message = str(error)
        assert "Sn10PwQx" not in message and "wrong10" not in message
        assert "AuthenticationError" in message
        # Not a repr of redis-py's client (pool, connection, every option): a short line.
        assert "<redis.client.Redis(" not in message, message
        assert len(message) < 300, len(message)
        assert "sentinel_password" in message, message  # it says which password to fix
