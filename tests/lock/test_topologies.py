"""Lock nodes that are not a bare ``redis://host``: Sentinel, Redis Cluster, TLS and ACL users, on real servers.

Every server is a real ``redis-server`` started here (tests/topologies.py): a Sentinel set (a master, a replica,
a Sentinel) with a failover that keeps the lock and one that loses it, a 3-master Redis Cluster, TLS servers with a
CA and certificates made for the test, and an ACL user limited to the commands docs/nodes.md lists.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import needs
import pytest
import redis
from celery import Celery
from celery.bin.base import CLIContext
from celery.exceptions import TaskRevokedError
from click.testing import CliRunner
from kombu.utils import json as kombu_json
from redis.cluster import RedisCluster
from redis.sentinel import Sentinel
from test_secrets import assert_no_secret
from topologies import Cluster, SentinelSet, Server, TLSFiles, make_certs, tls_binary

from celery_singleton_lock import LockedTask, LockUnavailableError, Rate, RateLimitedError, Redlock
from celery_singleton_lock.lock.config import settings_for
from celery_singleton_lock.lock.nodes import NodeSet
from celery_singleton_lock.lock.record import _key_slot, done_key_for, sibling_key
from celery_singleton_lock.lock.renewal import Watchdog, watchdog
from celery_singleton_lock.ops.cli import list_locks, locks, read_stats, release_lock, show_lock
from celery_singleton_lock.policies.rate import RATE_FEATURE
from celery_singleton_lock.task._line import wake_next
from celery_singleton_lock.testing import CeleryWorker, RedisServer, free_port, redis_servers, wait_for

MASTER_PW = "Mst9rPwQz"
SENTINEL_PW = "Sn7lPwXq"


def _app(urls: list[str] | str, prefix: str) -> Celery:
    app = Celery(f"topo-{uuid.uuid4().hex[:8]}", broker="memory://", set_as_current=False)
    app.conf.singleton_lock_urls = urls
    app.conf.singleton_lock_prefix = prefix
    return app


def _listed(app: Celery, *args: str) -> dict[str, dict[str, Any]]:
    """`celery locks list --json` (in-process), by key."""
    result = CliRunner().invoke(locks, ["list", "--json", *args], obj=CLIContext(app=app, no_color=True, workdir=None))
    assert result.exit_code == 0, result.output
    return {e["key"]: e for e in json.loads(result.stdout)}


def _fenced_task(app: Celery) -> Any:
    @app.task(base=LockedTask, bind=True, name="topo.fenced", lock_ttl=10, shared=False)
    def fenced(self: Any, n: int) -> tuple[int, str]:
        assert self.lock_held()
        return self.fencing_token, self.lock_key_for(n)

    return fenced


# --- Sentinel --------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def sentinels() -> Iterator[SentinelSet]:
    """A master and a replica with passwords, and a Sentinel with a password of its own; never failed over."""
    with SentinelSet(service="locks", password=MASTER_PW, sentinel_password=SENTINEL_PW) as topology:
        yield topology


def test_sentinel_url_locks_on_the_master_the_sentinels_name(sentinels: SentinelSet) -> None:
    """A redis+sentinel:// URL (a Sentinel that is down listed first, passwords for the master and the Sentinels)
    takes the lock on the master; the holder record reaches the replica; no password shows in the node's name."""
    dead = f"127.0.0.1:{free_port()}"
    url = sentinels.url(extra_hosts=[dead])
    name = f"sentinel:{uuid.uuid4().hex}"
    lock = Redlock(url, name, ttl=10.0)
    assert lock.acquire(blocking=False)
    assert lock.extend()
    assert lock.owned()
    master = sentinels.master.client()
    assert master.hget(name, "owner") == lock.token.encode()  # type: ignore[union-attr]
    assert master.wait(1, 2000) == 1
    assert sentinels.replica.client().hget(name, "owner") == lock.token.encode()  # type: ignore[union-attr]
    assert lock.release()
    (shown,) = lock.nodes.names
    assert shown == f"redis+sentinel://{dead},127.0.0.1:{sentinels.sentinels[0].port}/locks/0"
    assert_no_secret([MASTER_PW, SENTINEL_PW], shown, repr(lock.nodes), repr(settings_for(_app(url, "p:"))))


def test_sentinel_master_client_passed_in(sentinels: SentinelSet) -> None:
    """A redis.sentinel master client is a node like any other; a LockedTask locks through it via the URL form."""
    sentinel = Sentinel([("127.0.0.1", s.port) for s in sentinels.sentinels], sentinel_kwargs={"password": SENTINEL_PW})
    master = sentinel.master_for("locks", password=MASTER_PW, socket_timeout=0.5)
    lock = Redlock([master], f"sentinel:{uuid.uuid4().hex}", ttl=5.0)
    assert lock.acquire(blocking=False)
    assert lock.nodes.names[0].startswith("redis+sentinel://127.0.0.1:")
    assert lock.release()

    app = _app(sentinels.url(), f"sent-{uuid.uuid4().hex[:8]}:")
    token, key = _fenced_task(app).apply(args=(1,), task_id="s-1").get()
    assert token >= 1
    assert sentinels.master.client().exists(done_key_for(key, "s-1")) == 1  # the done marker, on the master


def test_failover_after_replication_keeps_the_lock() -> None:
    """Master killed after the lock reached the replica: the Sentinel promotes it, the holder's renewal goes to the
    new master and succeeds, and a contender is refused there."""
    with SentinelSet(service="keep") as topology:
        name = f"failover:{uuid.uuid4().hex}"
        holder = Redlock(topology.url(), name, ttl=30.0)
        assert holder.acquire(blocking=False)
        assert topology.master.client().wait(1, 2000) == 1  # the replica has the record
        topology.failover()
        assert wait_for(holder.extend, timeout=5.0, interval=0.1)  # on the promoted replica
        contender = Redlock(topology.url(), name, ttl=30.0)
        assert not contender.acquire(blocking=False)
        assert contender.held_by == holder.token
        assert holder.release()


def test_failover_that_loses_the_write_grants_the_lock_twice() -> None:
    """The documented limit of a replicated node: the lock's write never reached the replica when the master died,
    so after the failover a second client gets the same lock, with the same fencing token (the counter's bump was
    lost too); the first holder learns of it at its next renewal (extend() is False, owned() too)."""
    with SentinelSet(service="lose", proxy=True) as topology:
        assert topology.proxy is not None
        name = f"failover:{uuid.uuid4().hex}"
        first = Redlock(topology.url(), name, ttl=30.0)
        topology.proxy.drop(direction="downstream")  # master -> replica: the replication stream stops here
        assert first.acquire(blocking=False)
        assert topology.master.client().wait(1, 300) == 0  # the replica did not get it
        topology.failover()
        second = Redlock(topology.url(), name, ttl=30.0)
        assert wait_for(lambda: second.acquire(blocking=False), timeout=5.0, interval=0.1)  # granted twice
        assert second.fencing_token == first.fencing_token == 1
        assert not first.extend()
        assert not first.owned()
        assert second.release()


@pytest.mark.timeout(40)
def test_a_wrong_sentinel_password_is_a_short_clear_error() -> None:
    """A wrong (or missing) sentinel_password is a short node error naming sentinel_password, without either
    password, not redis-py's whole Sentinel client repr (~600 characters, the reason buried at its end)."""
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


# --- Cluster ---------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    """Three masters, slots split in three ranges, no replicas; never faulted."""
    with Cluster(3) as topology:
        yield topology


def _names_on_every_master(cluster: Cluster, prefix: str, count: int) -> list[str]:
    names = [f"{prefix}{i}" for i in range(count)]
    assert {cluster.masters.index(cluster.master_of(_key_slot(n))) for n in names} == {0, 1, 2}
    return names


def test_cluster_url_and_client_lock_keys_of_every_master(cluster: Cluster) -> None:
    """Through a redis+cluster:// URL and through a RedisCluster client, locks whose keys live on each of the three
    masters are taken, renewed, checked and released; each record lives on its slot's master."""
    client = RedisCluster(host="127.0.0.1", port=cluster.masters[0].port)
    for nodes in (cluster.url(), [client]):
        names = _names_on_every_master(cluster, f"cl:{uuid.uuid4().hex[:6]}:", 12)
        held = [Redlock(nodes, n, ttl=10.0) for n in names]
        assert all(lock.acquire(blocking=False) for lock in held)
        assert all(lock.extend() and lock.owned() for lock in held)
        for lock in held:
            owner = cluster.master_of(_key_slot(lock.name)).client().hget(lock.name, "owner")
            assert owner == lock.token.encode()  # type: ignore[union-attr]
        assert [lock.fencing_token for lock in held] == [1] * 12  # a counter per name, in its slot
        assert not Redlock(nodes, names[0]).acquire(blocking=False)
        assert all(lock.release() for lock in held)
    assert len(held[0].nodes) == 1  # a cluster is ONE node of the Redlock


CLUSTER_CLIENT_APP = """
import os
from celery import Celery
from redis.cluster import RedisCluster
from celery_singleton_lock import LockedTask

app = Celery("cluster_client", broker=os.environ["TOPO_BROKER"] + "/5", backend=os.environ["TOPO_BROKER"] + "/6")
app.conf.singleton_lock_urls = [RedisCluster(host="127.0.0.1", port=int(os.environ["TOPO_CLUSTER_PORT"]))]
app.conf.singleton_lock_prefix = os.environ["TOPO_PREFIX"]

@app.task(base=LockedTask, bind=True, lock_ttl=5)
def held(self, n):
    return [self.lock_held(), self.fencing_token, self.lock_key_for(n)]
"""


def test_a_cluster_client_in_singleton_lock_urls_serves_a_prefork_worker(
    tmp_path: Path, cluster: Cluster, redis_node: RedisServer
) -> None:
    """A RedisCluster client in singleton_lock_urls (alone, or in a list beside a URL) is a node, as Redlock takes
    it: a prefork worker configured so locks each job on the cluster (its done marker on the key's master), and
    the settings show the cluster by its address."""
    prefix = f"cc{uuid.uuid4().hex[:6]}:"
    client = RedisCluster(host="127.0.0.1", port=cluster.masters[0].port)
    alone = settings_for(_app(client, prefix))  # type: ignore[arg-type]
    assert alone.redacted_urls == (alone.nodes.names[0],)
    assert alone.redacted_urls[0].startswith("redis+cluster://127.0.0.1:")
    beside = settings_for(_app([client, redis_node.url], prefix))  # type: ignore[list-item]
    assert beside.describe().startswith(f"2 node(s) [{alone.redacted_urls[0]}, {redis_node.url}], quorum 2")
    (tmp_path / "cluster_client.py").write_text(CLUSTER_CLIENT_APP)
    broker = f"redis://127.0.0.1:{redis_node.port}"
    env = {"TOPO_BROKER": broker, "TOPO_CLUSTER_PORT": str(cluster.masters[0].port), "TOPO_PREFIX": prefix}
    worker = CeleryWorker(
        "cluster_client", "ccw", cwd=str(tmp_path), log_path=str(tmp_path / "worker.log"), concurrency=1, env=env
    )
    sender = Celery("cluster_sender", broker=f"{broker}/5", backend=f"{broker}/6", set_as_current=False)
    sender.conf.update(singleton_lock_urls=[client], singleton_lock_prefix=prefix)
    worker.start()
    try:
        assert f"celery_singleton_lock: 1 node(s) [{alone.redacted_urls[0]}]" in worker.log()
        for n in range(3):
            result = sender.send_task("cluster_client.held", args=(n,))
            was_held, token, key = result.get(timeout=20)
            assert was_held is True and token >= 1
            master = cluster.master_of(_key_slot(key)).client()
            assert master.exists(done_key_for(key, result.id)) == 1
        assert list_locks(settings_for(sender)).value == []
    finally:
        worker.stop()
        sender.close()


def test_a_limit_on_a_cluster_keeps_its_slots_in_the_names_hash_slot(cluster: Cluster) -> None:
    """Redlock(limit=3) on a 3-master cluster, for names on every master (tagged and not): 3 holders, a 4th refused,
    each slot renewed and released; one script call per acquire means every slot key lives in the name's slot."""
    by_master = {cluster.master_of(_key_slot(n)).port: n for n in _names_on_every_master(cluster, "lim:", 12)}
    names = [*by_master.values(), f"{{t{uuid.uuid4().hex[:4]}}}:lim"]
    for name in names:
        nodes = NodeSet(cluster.url())
        held = [Redlock(nodes, name, ttl=10.0, limit=3) for _ in range(3)]
        assert all(lock.acquire(blocking=False) for lock in held)
        assert sorted(lock.slot for lock in held) == [0, 1, 2]
        master = cluster.master_of(_key_slot(name)).client()
        assert all(master.hget(lock.key, "owner") == lock.token.encode() for lock in held)  # type: ignore[union-attr]
        fourth = Redlock(cluster.url(), name, ttl=10.0, limit=3)
        assert not fourth.acquire(blocking=False) and fourth.contended
        assert Redlock.nodes_extend(held) == [True, True, True]
        assert all(lock.release() for lock in held)
        assert fourth.acquire(blocking=False) and fourth.release()


@pytest.mark.parametrize("tagged", [False, True], ids=["untagged prefix", "hash-tagged prefix"])
def test_locked_task_on_a_cluster(cluster: Cluster, tagged: bool) -> None:
    """LockedTask on a cluster: with a prefix without a hash tag, each lock key lives in its own slot and its fencing
    counter is the prefix's per-slot one (<prefix>fence{n}:fence); with "{tag}:" every key shares one slot and the
    counter is the plain <prefix>fence. Tokens grow per job; the done marker sits in the lock's slot."""
    prefix = f"{{ct{uuid.uuid4().hex[:6]}}}:" if tagged else f"ct{uuid.uuid4().hex[:6]}:"
    app = _app(cluster.url(), prefix)
    fenced = _fenced_task(app)
    settings = settings_for(app)
    for n in range(6):
        first, key = fenced.apply(args=(n,), task_id=f"a-{n}").get()
        again, _ = fenced.apply(args=(n,), task_id=f"b-{n}").get()
        assert again > first
        fence = Redlock(settings.nodes, key, fence_key=settings.fence_key).fence_key
        master = cluster.master_of(_key_slot(key)).client()
        assert _key_slot(fence) == _key_slot(key)
        if tagged:
            assert fence == settings.fence_key
        else:
            assert fence != settings.fence_key
            assert fence.startswith(f"{prefix}fence{{") and fence.endswith("}:fence")
        assert int(master.get(fence)) >= again  # type: ignore[arg-type]
        assert master.exists(done_key_for(key, f"b-{n}")) == 1


def test_stacked_rate_limits_on_a_cluster_share_the_task_s_hash_slot(cluster: Cluster) -> None:
    """lock_rate as a list on a Cluster lock node: each limit's log carries the task's hash tag, so one call's logs
    (one script call, lua/rate_stack.lua) hash to one slot whatever the arguments; 2 per minute per tenant stacked
    with 3 per minute for the task: two starts of tenant a, a third refused by its own limit, one of tenant b, then
    tenant c refused by the task's limit (eager: RateLimitedError)."""
    app = _app(cluster.url(), f"sr{uuid.uuid4().hex[:6]}:")

    @app.task(
        base=LockedTask, name="topo.stacked", shared=False, lock_limit=None, lock_rate=[Rate("3/m"), "2/m"],
        lock_rate_on=["tenant"],
    )  # fmt: skip
    def stacked(tenant: str) -> str:
        return tenant

    keys = [RATE_FEATURE.keys_for(stacked.lock_context(), (t,), {}) for t in "abc"]
    assert len({_key_slot(k) for ks in keys for k in ks}) == 1
    assert len({k for ks in keys for k in ks}) == 4  # the task's log, and one per tenant
    assert [stacked.apply(args=("a",)).get() for _ in range(2)] == ["a", "a"]
    with pytest.raises(RateLimitedError):
        stacked.apply(args=("a",)).get()
    assert stacked.apply(args=("b",)).get() == "b"
    with pytest.raises(RateLimitedError):
        stacked.apply(args=("c",)).get()


def test_renewal_is_one_round_trip_per_master(cluster: Cluster) -> None:
    """The watchdog's batched renewal of 60 locks spread over the three masters sends each master one call per slot
    it holds, all in ONE write: each master sees exactly one read event for it (INFO's total_reads_processed: two
    INFO calls alone differ by 1, with the renewal in between by 2)."""
    nodes = NodeSet(cluster.url())
    held = [Redlock(nodes, name, ttl=10.0) for name in _names_on_every_master(cluster, f"rn:{uuid.uuid4().hex}:", 60)]
    assert all(lock.acquire(blocking=False) for lock in held)
    watchdog = Watchdog()
    leases = [watchdog.register(lock, interval=60.0) for lock in held]
    watchdog.renew(leases)  # warm: every master's connection open
    probes = [m.client() for m in cluster.masters]

    def reads() -> list[int]:
        return [int(p.info("stats")["total_reads_processed"]) for p in probes]

    # Other traffic can only add reads (in a shared test process another module's watchdog may flush or renew
    # meanwhile): a renewal that cost more than one round trip a master would never show [2, 2, 2]. Up to 5 looks.
    for _ in range(5):
        before = reads()
        idle = [b - a for a, b in zip(before, reads(), strict=True)]
        cluster.reset_stats()
        start = reads()
        watchdog.renew(leases)
        renewed = [b - a for a, b in zip(start, reads(), strict=True)]
        if idle == [1, 1, 1] and renewed == [2, 2, 2]:
            break
    assert idle == [1, 1, 1]
    assert renewed == [2, 2, 2]
    slots = [
        len({_key_slot(lock.name) for lock in held if cluster.master_of(_key_slot(lock.name)) is m})
        for m in cluster.masters
    ]
    assert cluster.command_calls("evalsha") == slots
    assert not any(lease.lost for lease in leases)
    assert all(lock.validity > 9 for lock in held)
    for lease in leases:
        watchdog.unregister(lease)
    assert all(lock.release() for lock in held)


def test_locks_list_show_and_release_across_the_cluster(cluster: Cluster) -> None:
    """`celery locks list` finds the locks on every master (SCAN on each), with their done markers on request;
    show and release work on any of them; stats add up the counters."""
    prefix = f"ls{uuid.uuid4().hex[:6]}:"
    app = _app(cluster.url(), prefix)
    names = _names_on_every_master(cluster, f"{prefix}job:", 9)
    held = [Redlock(cluster.url(), n, ttl=30.0, job=f"t-{i}", record={"state": "run"}) for i, n in enumerate(names)]
    assert all(lock.acquire(blocking=False) for lock in held)
    finished = Redlock(cluster.url(), f"{prefix}done-job", ttl=30.0, job="t-done")
    assert finished.acquire(blocking=False)
    assert finished.finish(done_for=60, waited_for=60)
    listed = _listed(app)
    assert sorted(listed) == sorted(names)
    assert {e["state"] for e in listed.values()} == {"running"}
    with_done = _listed(app, "--done")
    assert done_key_for(finished.name, "t-done") in with_done
    settings = settings_for(app)
    info, states = show_lock(settings, names[4]).value
    assert info is not None and info.owner == held[4].token
    released = release_lock(settings, names[4], states).value
    assert [r.outcome for r in released] == ["released"]
    assert names[4] not in {i.key for i in list_locks(settings).value}
    assert read_stats(settings).errors == ()
    for lock in held:
        lock.release()


def test_a_moved_slot_is_followed(cluster: Cluster) -> None:
    """A slot moved to another master after the client read the slot map (MOVED) is followed: the lock call is
    sent again to the new master and succeeds; the slot map is re-read."""
    nodes = NodeSet(cluster.url())
    name = f"moved:{uuid.uuid4().hex}"
    lock = Redlock(nodes, name, ttl=10.0, fencing=False)  # no counter key: the slot can move without its keys
    assert lock.acquire(blocking=False)
    assert lock.release()
    slot = _key_slot(name)
    source = cluster.master_of(slot)
    target = next(m for m in cluster.masters if m is not source)
    target_id = target.client().execute_command("CLUSTER", "MYID")
    for master in cluster.masters:
        master.client().execute_command("CLUSTER", "SETSLOT", slot, "NODE", target_id)
    try:
        assert lock.acquire(blocking=False)
        assert target.client().hget(name, "owner") == lock.token.encode()  # type: ignore[union-attr]
        assert lock.release()
    finally:
        source_id = source.client().execute_command("CLUSTER", "MYID")
        for master in cluster.masters:
            master.client().execute_command("CLUSTER", "SETSLOT", slot, "NODE", source_id)


def test_an_ask_redirection_is_followed(cluster: Cluster) -> None:
    """During a slot's migration: a one-key call (release) for a key already moved to the target is answered ASK by
    the slot's master and sent once more to the target, after ASKING; a call with several keys (acquire: the lock
    and its counter) gets TRYAGAIN from Redis 7.0 (a node that does not answer: retried), or, from servers that
    answer ASK for it, follows it the same way."""
    nodes = NodeSet(cluster.url())
    name = f"ask:{uuid.uuid4().hex}"
    slot = _key_slot(name)
    source = cluster.master_of(slot)
    target = next(m for m in cluster.masters if m is not source)
    source_id = source.client().execute_command("CLUSTER", "MYID")
    target_id = target.client().execute_command("CLUSTER", "MYID")
    lock = Redlock(nodes, name, ttl=10.0, fencing=False)
    assert lock.acquire(blocking=False)
    target.client().execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", source_id)
    source.client().execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", target_id)
    try:
        source.client().migrate("127.0.0.1", target.port, name, 0, 5000)  # the source now answers ASK for it
        assert lock.release()  # ASK -> ASKING + the release script on the target
        asking = target.client().pipeline(transaction=False)
        asking.execute_command("ASKING")
        asking.exists(name)
        assert asking.execute()[1] == 0
        fresh = Redlock(nodes, f"{{{name}}}", ttl=10.0, fencing=False)  # same slot, nowhere yet
        if fresh.acquire(blocking=False):
            assert fresh.release()
        else:
            assert "TryAgainError" in str(fresh.node_errors[0])
    finally:
        for master in (source, target):
            master.client().execute_command("CLUSTER", "SETSLOT", slot, "STABLE")


def test_acl_user_on_a_cluster(cluster: Cluster) -> None:
    """On a cluster, the same ACL user plus CLUSTER SLOTS and COMMAND (redis-py's cluster client reads the slot map
    and the command table when it starts) runs LockedTask jobs on every master, the stats flush and `locks list`."""
    prefix = f"ca{uuid.uuid4().hex[:6]}:"
    for master in cluster.masters:
        master.client().execute_command(
            "ACL", "SETUSER", "clocker", "reset", "on", ">ClPw9Zqx", f"~{prefix}*", f"~{{{prefix}*",
            "resetchannels", "-@all", *ACL_COMMANDS.split(), "+cluster|slots", "+command",
        )  # fmt: skip
    url = "redis+cluster://clocker:ClPw9Zqx@" + ",".join(f"127.0.0.1:{m.port}" for m in cluster.masters)
    app = _app(url, prefix)
    fenced = _fenced_task(app)
    keys = {fenced.apply(args=(n,), task_id=f"c-{n}").get()[1] for n in range(12)}
    assert {cluster.masters.index(cluster.master_of(_key_slot(k))) for k in keys} == {0, 1, 2}
    watchdog().flush_stats()
    stats = read_stats(settings_for(app))
    assert stats.errors == ()
    assert stats.value["acquired"] == 12
    markers = [e for e in _listed(app, "--done").values() if e["kind"] == "done"]
    assert sorted(e["task_id"] for e in markers) == sorted(f"c-{n}" for n in range(12))


def test_a_master_down_leaves_the_other_masters_locks_renewed() -> None:
    """One of three masters killed: the batched renewal still extends the locks whose slots live on the other two,
    and leaves those of the dead master undecided (not lost at once: the watchdog retries them for an interval);
    an acquire there fails naming the cluster."""
    with Cluster(3) as cluster:
        nodes = NodeSet(cluster.url())
        names = _names_on_every_master(cluster, "down:", 24)
        held = [Redlock(nodes, n, ttl=10.0) for n in names]
        assert all(lock.acquire(blocking=False) for lock in held)
        dead = cluster.masters[2]
        dead.kill()
        answers = Redlock.nodes_extend(held)
        on_dead = [cluster.master_of(_key_slot(n)) is dead for n in names]
        assert answers == [None if d else True for d in on_dead]
        victim = next(n for n, d in zip(names, on_dead, strict=True) if d)
        fresh = Redlock(nodes, f"{{{victim}}}:other", ttl=5.0)
        assert not fresh.acquire(blocking=False)
        assert fresh.node_errors[0].node == nodes.names[0]


WORKER_APP = """
import os, time
import redis
from celery import Celery
from celery_singleton_lock import LockedTask

app = Celery("topo_worker", broker=os.environ["TOPO_BROKER"] + "/5", backend=os.environ["TOPO_BROKER"] + "/6")
app.conf.singleton_lock_urls = os.environ["TOPO_NODES"].split(" ")
app.conf.singleton_lock_prefix = os.environ["TOPO_PREFIX"]
app.conf.worker_prefetch_multiplier = 1
record = redis.Redis.from_url(os.environ["TOPO_BROKER"] + "/7")

@app.task(base=LockedTask, bind=True, lock_ttl=5)
def slow(self, n, seconds):
    record.rpush("started", self.request.id)
    time.sleep(seconds)
    return [self.fencing_token, self.lock_key_for(n, seconds), os.getpid()]
"""


def test_prefork_worker_on_a_cluster_a_sentinel_master_and_a_plain_master(
    tmp_path: Path, cluster: Cluster, sentinels: SentinelSet, redis_node: RedisServer
) -> None:
    """A real prefork worker whose three lock nodes are a Redis Cluster, a Sentinel-managed master and a plain
    master (an untagged prefix): its pool children (forked after the settings were read) run distinct jobs, and
    a duplicate sent while its job runs is skipped; afterwards no lock is left on any node."""
    prefix = f"pw{uuid.uuid4().hex[:6]}:"
    nodes = [cluster.url(), sentinels.url(), redis_node.url]
    (tmp_path / "topo_worker.py").write_text(WORKER_APP)
    broker = f"redis://127.0.0.1:{redis_node.port}"
    record = redis.Redis(host="127.0.0.1", port=redis_node.port, db=7)
    record.delete("started")
    env = {"TOPO_BROKER": broker, "TOPO_NODES": " ".join(nodes), "TOPO_PREFIX": prefix}
    worker = CeleryWorker(
        "topo_worker", "topo", cwd=str(tmp_path), log_path=str(tmp_path / "worker.log"), concurrency=2, env=env
    )
    client = Celery("topo_client", broker=f"{broker}/5", backend=f"{broker}/6", set_as_current=False)
    client.conf.update(singleton_lock_urls=nodes, singleton_lock_prefix=prefix)
    worker.start()
    try:
        first = client.send_task("topo_worker.slow", args=(1, 1.5))
        assert wait_for(lambda: record.llen("started") == 1, timeout=10.0, interval=0.05)
        duplicate = client.send_task("topo_worker.slow", args=(1, 1.5))
        with pytest.raises(TaskRevokedError):
            duplicate.get(timeout=10)
        others = [client.send_task("topo_worker.slow", args=(n, 0.1)) for n in range(2, 6)]
        results = [first.get(timeout=10)] + [r.get(timeout=10) for r in others]
        assert all(token >= 1 for token, _, _ in results)
        settings = settings_for(client)
        assert len(settings.nodes) == 3
        assert wait_for(lambda: list_locks(settings).value == [], timeout=5.0)
        assert list_locks(settings).errors == ()
    finally:
        worker.stop()
        client.close()


@pytest.mark.timeout(40)
def test_survivors_locks_still_renew_after_the_cluster_marks_a_master_failed() -> None:
    """With ``cluster-require-full-coverage no`` (docs/nodes.md, "Moved slots and failed masters", tells users to set
    it), the locks on the surviving masters renew after the others mark a dead master FAIL. (With Redis' default,
    yes, the survivors answer CLUSTERDOWN for every slot: a documented limit.)"""
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


def test_removing_the_cluster_node_restarts_tokens_as_documented(cluster: Cluster) -> None:
    """With a Cluster node in the list, the prefix's fencing counter is kept per slot on every node, plain ones
    included; taking the Cluster node out switches every node back to the plain ``<prefix>fence``, which those runs
    never raised: the next token may go back although no node lost anything, as docs/nodes.md says (a documented
    limit)."""
    prefix = f"rm10{uuid.uuid4().hex[:6]}:"
    with redis_servers(2) as plain:
        mixed = _fenced_task(_app([cluster.url(), plain[0].url, plain[1].url], prefix))
        tokens = [mixed.apply(args=(7,), task_id=f"m-{i}").get()[0] for i in range(3)]
        assert tokens == sorted(set(tokens))
        # The cluster is retired: the two plain nodes (which lost nothing) and a new one.
        with redis_servers(1) as extra:
            after = _fenced_task(_app([plain[0].url, plain[1].url, extra[0].url], prefix))
            token = after.apply(args=(7,), task_id="p-1").get()[0]
        # Documented (docs/nodes.md, Sentinel section): the counters' names change, tokens start again.
        assert token <= tokens[-1], (tokens, token)


# --- TLS -------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> TLSFiles:
    return make_certs(str(tmp_path_factory.mktemp("certs")))


@pytest.fixture(scope="module")
def tls_redis() -> str:
    binary = tls_binary()
    if binary is None:
        reason = "needs a redis-server built with TLS (Debian's: apt-get install redis-server)"
        needs.missing(reason, "the TLS tests")
    return binary


@pytest.fixture(scope="module")
def tls_server(certs: TLSFiles, tls_redis: str) -> Iterator[Server]:
    """A TLS-only server that requires a client certificate (mutual TLS) and a password."""
    server = Server(["tls-auth-clients yes"], binary=tls_redis, tls=certs, password=MASTER_PW)
    try:
        yield server.start()
    finally:
        server.close()


def _tls_url(server: Server, query: str) -> str:
    return f"rediss://:{MASTER_PW}@127.0.0.1:{server.port}/0?{query}"


def test_tls_with_a_ca_and_a_client_certificate(tls_server: Server, certs: TLSFiles) -> None:
    """rediss:// with ssl_ca_certs, ssl_certfile/ssl_keyfile and ssl_cert_reqs=required locks on a mutual-TLS
    server; LockedTask works through it; the node's name is rediss://, without the password."""
    url = _tls_url(tls_server, certs.query())
    lock = Redlock(url, f"tls:{uuid.uuid4().hex}", ttl=5.0)
    assert lock.acquire(blocking=False)
    assert lock.owned() and lock.extend() and lock.release()
    assert lock.nodes.names == (f"rediss://127.0.0.1:{tls_server.port}/0",)
    token, _ = _fenced_task(_app(url, f"tls-{uuid.uuid4().hex[:6]}:")).apply(args=(1,), task_id="tls-1").get()
    assert token >= 1


@pytest.mark.timeout(20)
@pytest.mark.parametrize("case", ["wrong CA", "no client certificate"])
def test_tls_refused_fails_at_once_naming_the_node(tls_server: Server, certs: TLSFiles, case: str) -> None:
    """A server certificate from another CA, or no client certificate where the server wants one: the lock fails
    with an error naming the node (redacted) and the TLS problem, at once, not after a timeout (the socket timeout
    here is 30 s and the test's own limit 20 s)."""
    query = certs.query(ca=certs.other_ca) if case == "wrong CA" else certs.query(client_cert=False)
    url = _tls_url(tls_server, query)
    lock = Redlock(url, f"tls:{uuid.uuid4().hex}", ttl=5.0, timeout=0.0, socket_timeout=30.0)
    with pytest.raises(LockUnavailableError) as info:
        with lock:
            pass
    message = str(info.value)
    assert f"rediss://127.0.0.1:{tls_server.port}/0" in message
    if case == "wrong CA":
        assert "certificate verify failed" in message
    assert_no_secret([MASTER_PW], message, repr(info.value))


def test_tls_cluster_and_tls_sentinel(certs: TLSFiles, tls_redis: str) -> None:
    """rediss+cluster:// and rediss+sentinel:// (Sentinels, master and replica all on TLS) take and release locks;
    `locks list` reads the TLS cluster."""
    with Cluster(3, tls=certs, binary=tls_redis) as cluster:
        prefix = f"tc{uuid.uuid4().hex[:6]}:"
        names = _names_on_every_master(cluster, prefix, 9)
        held = [Redlock(cluster.url(), n, ttl=10.0) for n in names]
        assert all(lock.acquire(blocking=False) for lock in held)
        assert held[0].nodes.names[0].startswith("rediss+cluster://127.0.0.1:")
        assert sorted(_listed(_app(cluster.url(), prefix))) == sorted(names)
        assert all(lock.release() for lock in held)
    with SentinelSet(service="tls", tls=certs, binary=tls_redis) as topology:
        lock = Redlock(topology.url(), f"tls:{uuid.uuid4().hex}", ttl=5.0)
        assert lock.acquire(blocking=False)
        assert lock.nodes.names[0].startswith("rediss+sentinel://")
        assert lock.release()


# --- ACL -------------------------------------------------------------------------------------------------------------

#: docs/nodes.md's minimum command set, as an ACL rule (kept in step with the docs by test_acl_rule_is_documented).
ACL_COMMANDS = (
    "+evalsha +eval +exists +type +get +set +incr +del +pexpire +pttl +time "
    "+hget +hmget +hset +hdel +hgetall +hexists +hlen +hincrby +scan "
    "+zadd +zrem +zrange +zrangebyscore +zpopmin"
)


def _acl_user(server: RedisServer, name: str, password: str, keys: str) -> str:
    server.client().execute_command(
        "ACL", "SETUSER", name, "reset", "on", f">{password}", *keys.split(), "resetchannels", "-@all",
        *ACL_COMMANDS.split(),
    )  # fmt: skip
    return f"redis://{name}:{password}@127.0.0.1:{server.port}/0"


def test_acl_user_with_the_minimum_command_set(fresh_node: RedisServer) -> None:
    """A user allowed exactly the documented commands, on keys under the prefix only (~prefix* ~{prefix*), runs a
    LockedTask, every Redlock operation (acquire, undo, owned, extend with repair and refill, transfer, take-over,
    finish, release) and `locks list/show/release/stats`. With ~prefix* alone, the done marker ({key}:done:id) and
    a lock's own counter ({key}:fence) are refused."""
    prefix = "aclp:"
    url = _acl_user(fresh_node, "locker", "AclPw7Zq", f"~{prefix}* ~{{{prefix}*")
    app = _app(url, prefix)
    fenced = _fenced_task(app)
    token, key = fenced.apply(args=(1,), task_id="acl-1").get()
    assert token == 1
    assert fresh_node.client().exists(done_key_for(key, "acl-1")) == 1

    name = f"{prefix}plain"
    ticks = iter(range(0, 10_000, 100))
    late = Redlock(url, name, ttl=5.0, clock=lambda: float(next(ticks)))  # every clock read 100 s later
    assert not late.acquire(blocking=False)  # set, but past its validity: undone
    assert fresh_node.client().exists(name) == 0
    lock = Redlock(url, name, ttl=5.0, job="j-1", record={"state": "run"})
    assert lock.acquire(blocking=False)
    assert lock.owned()
    fresh_node.client().delete(name)  # a node that lost the key: the next renewal repairs it
    assert not lock.extend()  # repaired, but one node that lost it cannot vouch for the lease
    assert lock.acquire(blocking=False)
    assert lock.transfer(5.0, {"state": "retry"})
    taker = Redlock(url, name, ttl=5.0, job="j-1")
    taker.replaces = fresh_node.client().hget(name, "owner").decode()  # type: ignore[union-attr]
    assert taker.acquire(blocking=False)  # took the handed-over lock over
    assert taker.finish(done_for=10, waited_for=10)
    listed = _listed(app, "--done")
    assert done_key_for(name, "j-1") in listed
    other = Redlock(url, f"{prefix}other", ttl=5.0)
    assert other.acquire(blocking=False)
    settings = settings_for(app)
    _, states = show_lock(settings, other.name).value
    assert [r.outcome for r in release_lock(settings, other.name, states).value] == ["released"]
    assert read_stats(settings).errors == ()

    narrow = _acl_user(fresh_node, "narrow", "NarPw8Xq", f"~{prefix}*")
    refused = Redlock(narrow, f"{prefix}job", ttl=5.0, job="j-2")
    assert not refused.acquire(blocking=False)
    assert "NoPermissionError" in str(refused.node_errors[0])  # the done marker {key}:done:id is not under ~prefix*
    # A lock whose every key is under the prefix (no job, the prefix's counter, as LockedTask's) is allowed.
    assert Redlock(narrow, f"{prefix}job", ttl=5.0, fence_key=f"{prefix}fence").acquire(blocking=False)


def test_the_documented_acl_set_can_wake_a_waiting_duplicate(fresh_node: RedisServer) -> None:
    """The documented user may run the waiting line (reschedule/replace): ZADD, ZREM, ZRANGE(BYSCORE) and ZPOPMIN
    are in the set, so a holder's release wakes its waiter (without them every park and wake was refused, NOPERM,
    and swallowed: waiters were never woken by the release)."""
    prefix = "acl10:"
    admin = fresh_node.client()
    app = _app(_acl_user(fresh_node, "locker10", "Acl10PwZ", f"~{prefix}* ~{{{prefix}*"), prefix)

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


def test_acl_rule_is_documented() -> None:
    """docs/nodes.md lists the same commands the ACL test allows (the doc is what users copy)."""
    doc = (Path(__file__).parent.parent.parent / "docs" / "nodes.md").read_text()
    for command in ACL_COMMANDS.split():
        assert command in doc, command


def test_a_full_noeviction_node_refuses_new_locks_and_keeps_held_ones(fresh_node: RedisServer) -> None:
    """maxmemory reached under noeviction: a new acquire fails naming OutOfMemoryError (a node that does not
    answer), while a held lock still renews and releases (docs/nodes.md, Memory)."""
    held = Redlock(fresh_node.url, "oom:held", ttl=5.0)
    assert held.acquire(blocking=False)
    fresh_node.client().config_set("maxmemory-policy", "noeviction")
    fresh_node.client().config_set("maxmemory", 1)
    new = Redlock(fresh_node.url, "oom:new", ttl=5.0)
    assert not new.acquire(blocking=False)
    assert "OutOfMemoryError" in str(new.node_errors[0])
    assert held.extend()
    assert held.release()
