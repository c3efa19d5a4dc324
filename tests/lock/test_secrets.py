"""No secret, nor a fragment of one, in any log line, error, repr or CLI output.

Every secret-bearing part of a Redis URL goes through every surface that shows a URL: ``redact_url``,
``validate_url`` and ``NodeSet`` errors, ``LockSettings`` repr and ``describe()``, ``settings_for(app)`` errors and
its broker log line, the ``celery -A app locks`` CLI (``list`` and ``doctor``) and a real worker's start-up INFO line.

"No fragment" means: neither the secret nor any 4-character piece of it appears in the output, compared
case-insensitively, in the output as written and percent-decoded, for the secret as written in the URL and decoded.
Every secret below is chosen so that none of its 4-character pieces occurs in a legitimate part of the output
(a host, a scheme, an option name, the wording of an error).
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import traceback
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote, unquote, unquote_plus

import pytest
from celery import Celery
from hypothesis import assume, given
from hypothesis import strategies as st

from celery_singleton_lock.errors import ConfigurationError, LockUnavailableError
from celery_singleton_lock.lock._urls import redact_url, validate_url
from celery_singleton_lock.lock.config import settings_for, settings_from
from celery_singleton_lock.lock.redlock import NodeSet, Redlock
from celery_singleton_lock.testing import CeleryWorker, RedisServer, free_port

CELERY = str(Path(sys.executable).parent / "celery")
DEAD = free_port()  # nothing listens there; building settings and NodeSets never connects
HOST = f"127.0.0.1:{DEAD}"


def pieces(secret: str) -> set[str]:
    """The whole secret and its 4-character pieces, lowercased, as written and percent-decoded."""
    out: set[str] = set()
    for form in {secret, unquote(secret), unquote_plus(secret)}:
        low = form.lower()
        out.add(low)
        out.update(low[i : i + 4] for i in range(len(low) - 3))
    return out


def assert_no_secret(secrets: Iterable[str], *texts: str) -> None:
    """Fail when any text shows a secret or a 4-character piece of it (case-insensitive, also percent-decoded)."""
    for text in texts:
        forms = {text.lower(), unquote(text).lower(), unquote_plus(text).lower()}
        for secret in secrets:
            for piece in pieces(secret):
                for form in forms:
                    assert piece not in form, f"{piece!r} of the secret {secret!r} leaked in {text!r}"


@dataclass(frozen=True)
class Case:
    url: str
    secrets: tuple[str, ...]
    says: str = ""  # for a malformed URL: what its error must name


# Well-formed URLs that redis-py accepts, with a secret in every place a secret can hide.
GOOD = {
    "userinfo password, percent-encoded #": Case(f"redis://:s3cr%23t@{HOST}/0", ("s3cr%23t",)),
    "ACL user and password": Case(f"redis://acluser:Zx9Qw7Lm@{HOST}/0", ("Zx9Qw7Lm",)),
    "username only (may be a misplaced password)": Case(f"redis://Unam3Oqz@{HOST}/0", ("Unam3Oqz",)),
    "password with @ and :": Case(f"redis://:Pa@s:w0rdX@{HOST}/0", ("Pa@s:w0rdX",)),
    "encoded / and ? in the password": Case(f"redis://ac%40l:Pc%2Fnt%3F9@{HOST}/0", ("Pc%2Fnt%3F9",)),
    "comma in the password": Case(f"redis://:Pw,Comma9@{HOST}/0", ("Pw,Comma9",)),
    "ssl_password of a private key": Case(
        f"rediss://{HOST}/0?ssl_keyfile=/etc/tls/client.key&ssl_password=kEyPh7ase&ssl_certfile=/etc/tls/client.crt",
        ("kEyPh7ase",),
    ),
    "sentinel_password and password": Case(
        f"redis://{HOST}/0?sentinel_password=Snt1nelZq&password=Qp0Qvzy", ("Snt1nelZq", "Qp0Qvzy")
    ),
    "repeated password": Case(f"redis://{HOST}/0?password=Rep1Vq&db=0&password=Rep2Vq", ("Rep1Vq", "Rep2Vq")),
    "uppercase name": Case(f"redis://{HOST}/0?PASSWORD=UpCsW8v", ("UpCsW8v",)),
    "percent-encoded name": Case(f"redis://{HOST}/0?pass%77ord=EncNm55x", ("EncNm55x",)),
    "plus-encoded value": Case(f"redis://{HOST}/0?password=Pl+Xq9Zq", ("Pl+Xq9Zq",)),
    "; inside the password value": Case(f"redis://{HOST}/0?password=ab;Cdf9Tqz", ("ab;Cdf9Tqz",)),
    "unencoded & in the password value": Case(f"redis://{HOST}/0?password=amp&Rxt88q", ("amp&Rxt88q",)),
    "token, key and secret names": Case(
        f"redis://{HOST}/0?auth_token=Tok3nVq&api_key=K3yVq9&client_secret=Sekr1tVq&x_pwd=Pwd4Vq",
        ("Tok3nVq", "K3yVq9", "Sekr1tVq", "Pwd4Vq"),
    ),
    "unix socket with a password": Case("unix://:Xu9Pw4qz@/tmp/csl-none.sock?db=0", ("Xu9Pw4qz",)),
    "sentinel: master and Sentinel passwords": Case(
        f"redis+sentinel://acluser:Sq8PwMst@{HOST},127.0.0.2/mymaster/1?sentinel_password=Sx4PwSnt",
        ("Sq8PwMst", "Sx4PwSnt"),
    ),
    "sentinel over TLS, key passphrase": Case(
        f"rediss+sentinel://:Ts6PwQzv@{HOST}/mymaster?ssl_ca_certs=/etc/tls/ca.pem&ssl_password=kEy3Pz7q",
        ("Ts6PwQzv", "kEy3Pz7q"),
    ),
    "cluster: ACL user and password": Case(f"redis+cluster://acluser:Cl5PwQzx@{HOST},127.0.0.2:7001", ("Cl5PwQzx",)),
    "cluster over TLS": Case(f"rediss+cluster://:Tl5PwQzr@{HOST}?ssl_ca_certs=/etc/tls/ca.pem", ("Tl5PwQzr",)),
    "unix socket, password in the query": Case("unix:///tmp/csl-none.sock?db=0&password=Qx7Unz", ("Qx7Unz",)),
}

# Malformed URLs whose parser messages (urllib's, redis-py's) would quote a piece of the password.
BAD = {
    "# in the password": Case(f"redis://:hunter#2@{HOST}/0", ("hunter#2",), "'#'"),
    "/ and ? in the password": Case(f"redis://:p@ss/w?rd@{HOST}/0", ("p@ss/w?rd",), "'@'"),
    "password but no @host": Case("redis://:NoAt5eqXq", ("NoAt5eqXq",), "port"),
    "port out of range": Case("redis://:Rng9Pw@127.0.0.1:99999/0", ("Rng9Pw",), "port"),
    "unmatched ] in the password": Case(f"redis://:Brk]t9Pw@{HOST}/0", ("Brk]t9Pw",), "'['"),
    "not an address in brackets": Case("redis://:Zb6Pw9q@[notanaddr]:6379/0", ("Zb6Pw9q",), "bracket"),
    "full-width # in the password": Case(f"redis://:Nf\uff03kPw9@{HOST}/0", ("Nf\uff03kPw9",), "characters"),
    "; after db= swallows the password": Case(f"redis://{HOST}/0?db=0;password=Sxmi9Cq", ("Sxmi9Cq",), "'db'"),
    "bad socket_timeout": Case(f"redis://:Tm0Pwq@{HOST}/0?socket_timeout=soon", ("Tm0Pwq",), "'socket_timeout'"),
    "bad verify flag": Case(
        f"rediss://:Vf7Pwq@{HOST}/0?ssl_include_verify_flags=NOPE", ("Vf7Pwq",), "'ssl_include_verify_flags'"
    ),
    "negative max_connections": Case(f"redis://{HOST}/0?max_connections=-1&password=Mx9Pwq", ("Mx9Pwq",), "max_conn"),
    "@ in a query value": Case(f"redis://:Qs9Pw@{HOST}/0?client_name=a@b", ("Qs9Pw",), "'@'"),
    "uppercase scheme": Case(f"REDIS://:Upp3rPw@{HOST}/0", ("Upp3rPw",), "lowercase"),
    "not a Redis scheme": Case(f"http://:Htt9Pw@{HOST}/0", ("Htt9Pw",), "redis://"),
    "no scheme at all": Case("Bq5eXvZal", ("Bq5eXvZal",), "redis://"),
    "sentinel: password but no @host": Case("redis+sentinel://:NoAt6Snt", ("NoAt6Snt",), "host"),
    "sentinel: password read as hosts": Case("redis+sentinel://:Pq7,Hst9Rz/m", ("Pq7,Hst9Rz",), "host"),
    "sentinel: no service name": Case(f"redis+sentinel://:Sv3Pwqzx@{HOST}", ("Sv3Pwqzx",), "service"),
    "sentinel: # in the password": Case(f"redis+sentinel://:Hs#9Pwqz@{HOST}/m", ("Hs#9Pwqz",), "'#'"),
    "sentinel: misspelt option": Case(
        f"redis+sentinel://{HOST}/m?sentinel_pasword=Typo9Pwq", ("Typo9Pwq",), "sentinel_"
    ),
    "cluster: a host without its port": Case("redis+cluster://:Cp9Pwqzx@127.0.0.1", ("Cp9Pwqzx",), "port"),
    "cluster: a db other than 0": Case(f"redis+cluster://:Db4Pwqzx@{HOST}/3", ("Db4Pwqzx",), "db 0"),
}


def test_the_check_itself_catches_a_leak() -> None:
    """assert_no_secret fails on the whole secret, a 4-character piece, another case and a percent-encoded piece."""
    for text in ("x hunter#2 y", "x HUNT y", "x ter%232 y", "s3cr#t"):
        with pytest.raises(AssertionError):
            assert_no_secret(["hunter#2", "s3cr%23t"], text)
    assert_no_secret(["hunter#2"], "redis://:***@127.0.0.1:6379/0")


@pytest.mark.parametrize("case", list(GOOD.values()) + list(BAD.values()), ids=list(GOOD) + list(BAD))
def test_redact_url_hides_every_secret(case: Case) -> None:
    """redact_url shows no piece of any secret, for well-formed and malformed URLs alike, and never raises."""
    assert_no_secret(case.secrets, redact_url(case.url))


def test_redact_url_keeps_what_is_not_secret() -> None:
    """Hosts, ports, db, ACL usernames next to a password, key/cert file paths and plain options stay readable."""
    assert redact_url("redis://acluser:pw@[::1]:6379/2") == "redis://acluser:***@[::1]:6379/2"
    assert redact_url("redis://:hunter#2@h:6379/0") == "redis://:***@h:6379/0"
    assert redact_url("redis://Unam3Oqz@h:6379/0") == "redis://***@h:6379/0"
    assert (
        redact_url("rediss://h:6380/0?ssl_keyfile=/etc/tls/c.key&ssl_password=kEyPh7ase&ssl_cert_reqs=required")
        == "rediss://h:6380/0?ssl_keyfile=/etc/tls/c.key&ssl_password=***&ssl_cert_reqs=required"
    )
    assert (
        redact_url("redis://h/0?db=1;password=x&socket_timeout=0.5")
        == "redis://h/0?db=1;password=***&socket_timeout=0.5"
    )
    assert redact_url("redis://h/0?password=ab#Cd9") == "redis://h/0?password=***#***"
    assert redact_url("unix:///run/redis.sock?db=0") == "unix:///run/redis.sock?db=0"
    # A name that looks secret is shown with its value masked; an unknown one (maybe a password's tail) goes whole.
    assert redact_url("redis://h/0?auth_token=Tk&region=eu&tail") == "redis://h/0?auth_token=***&***&***"
    assert redact_url("redis://:NoAt5eqXq") == "redis://:***"
    assert redact_url("NoScheme") == "<not a URL>"


@given(st.text(alphabet=st.characters(codec="utf-8", exclude_categories=("Cs",)), min_size=1, max_size=30))
def test_redact_url_hides_any_encoded_password(secret: str) -> None:
    """Any password, percent-encoded as it should be, is hidden in the userinfo and in query values."""
    skeleton = "redis://acluser:@127.0.0.1:6379/0?db=0&password=&ssl_password=***"
    assume(not any(p in skeleton.lower() for p in pieces(secret)))
    url = f"redis://acluser:{quote(secret, safe='')}@127.0.0.1:6379/0?db=0&password={quote(secret)}"
    url += f"&ssl_password={quote(secret)}"
    assert_no_secret([secret, quote(secret, safe="")], redact_url(url))


@pytest.mark.parametrize("case", list(GOOD.values()), ids=list(GOOD))
def test_well_formed_urls_are_accepted(case: Case) -> None:
    """Every well-formed URL above passes validate_url and builds a NodeSet whose repr shows no secret."""
    assert validate_url(case.url) == case.url
    nodes = NodeSet(case.url)
    assert_no_secret(case.secrets, repr(nodes), *nodes.names)


def _error_texts(info: pytest.ExceptionInfo[ConfigurationError]) -> list[str]:
    return [str(info.value), repr(info.value), "".join(traceback.format_exception(info.value))]


@pytest.mark.parametrize("case", list(BAD.values()), ids=list(BAD))
def test_malformed_url_errors_name_the_problem_not_the_secret(case: Case) -> None:
    """validate_url and NodeSet refuse a malformed URL naming what to change, with no piece of the secret."""
    for build in (validate_url, NodeSet):
        with pytest.raises(ConfigurationError) as info:
            build(case.url)
        message = str(info.value)
        assert case.says.lower() in message.lower(), message
        assert "e.g." in message or "encode" in message or "must" in message, f"no remedy in {message!r}"
        assert_no_secret(case.secrets, *_error_texts(info))


@pytest.mark.parametrize("case", list(GOOD.values()), ids=list(GOOD))
def test_settings_repr_and_describe_hide_every_secret(case: Case) -> None:
    """LockSettings' repr, str and describe() (the worker's start-up line) show no piece of any secret."""
    settings = settings_from({"singleton_lock_urls": case.url})
    assert_no_secret(case.secrets, repr(settings), str(settings), settings.describe())
    assert HOST in settings.describe() or "unix://" in settings.describe()


def test_sentinel_and_cluster_urls_keep_what_is_not_secret() -> None:
    """Sentinel and Cluster URLs show every host and port, the service and db, the ACL username next to a password
    and the Sentinel username; the node's name (in errors and listings) has no userinfo or options at all."""
    url = "redis+sentinel://u:pw@h1:26379,[::1]:26380,h3/svc-1.a/2?sentinel_username=sent&sentinel_password=spw"
    assert redact_url(url) == (
        "redis+sentinel://u:***@h1:26379,[::1]:26380,h3/svc-1.a/2?sentinel_username=sent&sentinel_password=***"
    )
    assert NodeSet(url).names == ("redis+sentinel://h1:26379,[::1]:26380,h3:26379/svc-1.a/2",)
    cluster = "rediss+cluster://:pw@h1:7000,h2:7001?ssl_ca_certs=/etc/tls/ca.pem"
    assert redact_url(cluster) == "rediss+cluster://:***@h1:7000,h2:7001?ssl_ca_certs=/etc/tls/ca.pem"
    assert NodeSet(cluster).names == ("rediss+cluster://h1:7000,h2:7001",)
    # Without '@host', what looks like hosts may be a password: masked from the first part with no host on.
    assert redact_url("redis+sentinel://:Pq7,Hst9Rz/m") == "redis+sentinel://:***/***"


@pytest.mark.timeout(30)
def test_unreachable_sentinels_and_cluster_errors_hide_every_secret() -> None:
    """A Sentinel set and a Cluster that nobody answers for fail the lock with errors naming the node, no secret."""
    secrets = ["Sq8PwMst", "Sx4PwSnt", "Cl5PwQzx"]
    for url in (
        f"redis+sentinel://acl:Sq8PwMst@{HOST},127.0.0.1:{free_port()}/mymaster?sentinel_password=Sx4PwSnt",
        f"redis+cluster://acl:Cl5PwQzx@{HOST}",
    ):
        lock = Redlock(url, "secret-test", ttl=5.0, timeout=0.0)
        with pytest.raises(LockUnavailableError) as info:
            with lock:
                pass
        texts = _error_texts(info)  # type: ignore[arg-type]
        assert lock.nodes.names[0] in texts[0]
        assert_no_secret(secrets, *texts, *(str(e) for e in lock.node_errors))


def test_ssl_file_paths_are_shown() -> None:
    """ssl_keyfile/ssl_certfile/ssl_ca_certs are paths, not secrets: describe() shows them, ssl_password it hides."""
    url = f"rediss://{HOST}/0?ssl_keyfile=/etc/tls/client.key&ssl_certfile=/etc/tls/client.crt"
    url += "&ssl_ca_certs=/etc/tls/ca.pem&ssl_password=kEyPh7ase"
    line = settings_from({"singleton_lock_urls": url}).describe()
    for path in ("ssl_keyfile=/etc/tls/client.key", "ssl_certfile=/etc/tls/client.crt", "ssl_ca_certs=/etc/tls/ca"):
        assert path in line
    assert "ssl_password=***" in line
    assert_no_secret(["kEyPh7ase"], line)


def test_comma_separated_urls_keep_a_comma_in_a_password() -> None:
    """A comma-separated string of URLs splits only before a scheme, so a ',' in a password is not cut in two."""
    other = f"redis://127.0.0.1:{free_port()}/0"
    settings = settings_from({"singleton_lock_urls": f"redis://:Pw,Comma9@{HOST}/0, {other}"})
    assert settings.urls == (f"redis://:Pw,Comma9@{HOST}/0", other)
    assert_no_secret(["Pw,Comma9"], repr(settings), settings.describe())


@pytest.mark.parametrize(
    ("url", "says"),
    [
        ("redis://127.0.0.1:1/0,127.0.0.1:2/0", "','"),
        ("redis://127.0.0.1,127.0.0.2/0", "','"),
        ("redis://127.0.0.1:1/db0", "db number"),
    ],
)
def test_urls_redis_py_would_misread_are_refused(url: str, says: str) -> None:
    """A ',' after the host or a path that is not a db number is refused, not silently read as one node or db 0."""
    with pytest.raises(ConfigurationError, match=says):
        validate_url(url)
    with pytest.raises(ConfigurationError, match=says):
        settings_from({"singleton_lock_urls": url})


def _app(**conf: object) -> Celery:
    app = Celery("secrets_test", broker=conf.pop("broker_url", "memory://"), set_as_current=False)
    app.conf.update(conf)
    return app


@pytest.mark.parametrize("case", list(BAD.values()), ids=list(BAD))
def test_settings_for_an_app_with_a_malformed_url(case: Case) -> None:
    """settings_for(app) with a malformed singleton_lock_urls raises an error with no piece of the secret."""
    with pytest.raises(ConfigurationError) as info:
        settings_for(_app(singleton_lock_urls=[case.url]))
    assert_no_secret(case.secrets, *_error_texts(info))


def test_settings_for_an_app_with_a_secret_broker(caplog: pytest.LogCaptureFixture) -> None:
    """A non-Redis broker's error and a Redis broker's "locking on the broker" log line show no broker secret."""
    amqp = "amqp://guest:AmxPw9xq@127.0.0.1:5672//?token=Tk9Bq"
    with pytest.raises(ConfigurationError) as info:
        settings_for(_app(broker_url=amqp))  # (the traceback quotes this line: keep the URL out of it)
    assert_no_secret(["AmxPw9xq", "Tk9Bq"], *_error_texts(info))
    broker = f"redis://:BrkPw7q@{HOST}/0?ssl_password=Brk8Key"
    with caplog.at_level(logging.DEBUG, logger="celery_singleton_lock"):
        settings = settings_for(_app(broker_url=broker))
    assert "locking on the broker" in caplog.text
    assert_no_secret(["BrkPw7q", "Brk8Key"], caplog.text, repr(settings), settings.describe())


def _app_module(tmp_path: Path, name: str, urls: list[str]) -> dict[str, str]:
    """Write a tiny Celery app module (memory broker, one LockedTask) to tmp_path; return the env to import it."""
    (tmp_path / f"{name}.py").write_text(
        "from celery import Celery\n"
        "from celery_singleton_lock import LockedTask\n"
        f"app = Celery({name!r}, broker='memory://')\n"
        f"app.conf.singleton_lock_urls = {urls!r}\n"
        "@app.task(shared=False, base=LockedTask)\n"
        "def noop():\n"
        "    return None\n"
    )
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))}


def _locks_list(tmp_path: Path, name: str, urls: list[str]) -> subprocess.CompletedProcess[str]:
    env = _app_module(tmp_path, name, urls)
    return subprocess.run(
        [CELERY, "-A", name, "locks", "list"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_cli_with_a_malformed_url(tmp_path: Path) -> None:
    """`celery -A app locks list` with a malformed URL exits 1 naming the problem, with no piece of the password."""
    bad = BAD["# in the password"]
    proc = _locks_list(tmp_path, "cli_bad_url", [bad.url])
    assert proc.returncode != 0
    assert "'#'" in proc.stderr, proc.stderr
    assert_no_secret(bad.secrets, proc.stdout, proc.stderr)


def test_cli_with_unreachable_and_refusing_nodes(tmp_path: Path, redis_node: RedisServer) -> None:
    """`locks list` against a dead node and a live node refusing the password reports both, no secret shown."""
    urls = [
        f"rediss://:Unr3achPw@127.0.0.1:{free_port()}/0?ssl_password=Cl1KeyPh",
        f"redis://acluser:Wr0ngPwq@127.0.0.1:{redis_node.port}/0",
        f"redis://127.0.0.1:{free_port()}/0?password=Qry9Pwz",
    ]
    proc = _locks_list(tmp_path, "cli_dead_nodes", urls)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "did not answer" in proc.stderr
    assert_no_secret(["Unr3achPw", "Cl1KeyPh", "Wr0ngPwq", "Qry9Pwz"], proc.stdout, proc.stderr)


def test_doctor_with_unreachable_and_refusing_nodes(tmp_path: Path, redis_node: RedisServer) -> None:
    """`locks doctor` (and --json) against a dead node and a live node refusing the password: no secret shown."""
    urls = [
        f"rediss://:Unr3achPw@127.0.0.1:{free_port()}/0?ssl_password=Cl1KeyPh",
        f"redis://acluser:Wr0ngPwq@127.0.0.1:{redis_node.port}/0",
        f"redis://127.0.0.1:{free_port()}/0?password=Qry9Pwz",
    ]
    env = _app_module(tmp_path, "doctor_dead_nodes", urls)
    for extra in ([], ["--json"]):
        proc = subprocess.run(
            [CELERY, "-A", "doctor_dead_nodes", "locks", "doctor", *extra],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert proc.returncode == 1, proc.stdout + proc.stderr
        assert proc.stdout.count("node-unreachable") == 3, proc.stdout
        assert_no_secret(["Unr3achPw", "Cl1KeyPh", "Wr0ngPwq", "Qry9Pwz"], proc.stdout, proc.stderr)


def test_worker_start_line_hides_every_secret(tmp_path: Path) -> None:
    """A real worker's INFO line at start lists the nodes with no piece of any secret, and ssl paths as written."""
    cases = [GOOD[k] for k in ("ACL user and password", "ssl_password of a private key", "repeated password")]
    ports: set[int] = set()
    while len(ports) < len(cases):
        ports.add(free_port())
    urls = [c.url.replace(HOST, f"127.0.0.1:{port}") for c, port in zip(cases, sorted(ports), strict=True)]
    env = _app_module(tmp_path, "worker_secrets", urls)
    worker = CeleryWorker(
        "worker_secrets", "secrets", cwd=str(tmp_path), log_path=str(tmp_path / "w.log"), pool="solo", env=env
    )
    try:
        worker.start(timeout=30)
    finally:
        worker.kill()
    log = worker.log()
    assert "celery_singleton_lock: 3 node(s)" in log
    assert "ssl_keyfile=/etc/tls/client.key" in log
    assert_no_secret([s for c in cases for s in c.secrets], log)


def test_worker_refusing_a_malformed_url_hides_the_secret(tmp_path: Path) -> None:
    """A worker whose singleton_lock_urls is malformed stops at start, its log naming the problem, not the secret."""
    bad = BAD["/ and ? in the password"]
    env = _app_module(tmp_path, "worker_bad_url", [bad.url])
    worker = CeleryWorker(
        "worker_bad_url", "bad", cwd=str(tmp_path), log_path=str(tmp_path / "w.log"), pool="solo", env=env
    )
    try:
        with pytest.raises(RuntimeError, match="exited with"):
            worker.start(timeout=30)
    finally:
        worker.kill()
    log = worker.log()
    assert "invalid Redis URL" in log  # the one-line start error (no traceback since the worker-start change)
    assert_no_secret(bad.secrets, log)
