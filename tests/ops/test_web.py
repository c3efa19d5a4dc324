"""Metrics in Redis, ``/metrics`` and the locks page, against real workers, real Redis and a real headless Chromium.

One module-wide set: a broker and three password-protected lock nodes, one prefork worker (tests/apps/locked_app.py),
the page served in this process on a free port (with a release secret), and one Chromium driven over the DevTools
protocol on a pipe (tests/cdp.py). Browser tests skip, saying why, where no Chromium is installed (under ``CI=true``
they fail: CI runs them).
"""

from __future__ import annotations

import contextlib
import html
import io
import ipaddress
import json
import os
import re
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import needs
import pytest
from cdp import Browser, find_chromium
from celery import Celery
from prometheus_client.parser import text_string_to_metric_families
from worker_cluster import APPS, Cluster, cluster, new_key, polling

from celery_singleton_lock.lock import metrics
from celery_singleton_lock.lock.config import settings_for
from celery_singleton_lock.lock.redlock import Redlock
from celery_singleton_lock.ops.web import PAGE_SIZE, exposition, make_app, metrics_app, serve
from celery_singleton_lock.testing import RedisServer, free_port
from celery_singleton_lock.testing.faults import FaultProxy

pytestmark = pytest.mark.slow

TTL = 5.0
PASSWORD = "n0de-pa55-Zq9"
SECRET = "web-release-secret-4711"
CHROMIUM = find_chromium()
#: Seconds a holder runs whose lock a test releases: it must outlive the steps up to the release plus one TTL (a
#: bound, not an expectation: steps slower than this fail the test, they never let it pass, because the test checks
#: that the lock was gone a whole TTL after the release while the holder's body still ran: the release did it, and
#: no renewal repaired it for longer than a moment).
OUTLIVES = 15.0
XSS_ID = '<img src=x onerror="window.__xss=1">\'"&<script>window.__xss=2</script>'


class Site:
    def __init__(self, c: Cluster, url: str) -> None:
        self.c, self.url = c, url

    def get(self, path: str) -> tuple[int, str]:
        try:
            with urllib.request.urlopen(self.url + path, timeout=30) as response:
                return response.status, response.read().decode()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read().decode()

    def post(self, path: str, form: dict[str, str], headers: dict[str, str] | None = None) -> tuple[int, str]:
        data = urllib.parse.urlencode(form).encode()
        request = urllib.request.Request(self.url + path, data=data, headers=headers or {}, method="POST")
        try:
            with urllib.request.urlopen(request, timeout=30) as response:
                return response.status, response.read().decode()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read().decode()


@contextlib.contextmanager
def served(wsgi: Any) -> Iterator[str]:
    server = serve(wsgi, "127.0.0.1", 0)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Site]:
    tmp = tmp_path_factory.mktemp("web")
    with cluster(tmp, ttl=TTL, password=PASSWORD) as c:
        c.worker("w1", concurrency=4)
        app = c.app_module().app
        with served(make_app(app, secret=SECRET, refresh=0, doctor_every=600)) as url:
            yield Site(c, url)


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    if CHROMIUM is None:  # under CI=true a failure: .ci/run installs chromium, so CI runs the browser tests
        needs.missing("no chromium on PATH: `apt-get install -y chromium` (Debian) runs them", "the browser tests")
    b = Browser(CHROMIUM)
    try:
        yield b
    finally:
        b.close()


def holder_of(c: Cluster, task: Any, key_arg: str) -> str | None:
    """The holder task id of the lock of ``task(key_arg)``, from the first lock node that answers."""
    key = task.lock_key_for(key_arg)
    for client in (c.lock_client(s) for s in c.locks):
        with contextlib.suppress(Exception):
            job = client.hget(key, "job")
            if job:
                return str(job.decode())
    return None


def gone_for_a_ttl(c: Cluster, task: Any, key_arg: str, job: str | None) -> None:
    """Wait (bounded) until ``job`` has not held the lock for a whole TTL after a release: a renewal in that time may
    repair the key for a moment (docs/cli.md, locks release), but must then count the lock as lost and let it go."""
    released = time.monotonic()
    for _ in polling(TTL + 15, 0.2):
        if time.monotonic() - released > TTL and holder_of(c, task, key_arg) != job:
            break


def metrics_families(text: str) -> dict[str, Any]:
    """/metrics' text, parsed by prometheus_client, by family name."""
    return {f.name: f for f in text_string_to_metric_families(text)}


def counted(c: Cluster, task: str, outcome: str, at_least: int, timeout: float = 30.0) -> int:
    settings = settings_for(c.app_module().app)
    n = 0
    for _ in polling(timeout, 0.25):
        n = metrics.read_metrics(settings.nodes, settings.prefix).tasks.get(task, {}).get(outcome, 0)
        if n >= at_least:
            break
    return n


# -- metrics in Redis, locks stats, /metrics --------------------------------------------------------------------------


def test_outcomes_are_counted_per_task_in_redis_and_exposed_for_prometheus(site: Site) -> None:
    """A run and two duplicates on a prefork worker are counted per task (acquired, skipped, released) in Redis by
    the pool children's watchdogs, read back per minute and since ever, and /metrics exposes them as
    celery_lock_events_total{task,outcome} that prometheus_client's parser reads, with task and outcome labels
    only; the running job is a held gauge."""
    c = site.c
    mod = c.app_module()
    name = mod.work.name
    k = new_key()
    first = mod.work.delay(k, 4.0)
    c.wait_started(k)
    # The held gauge reads the lock keys live: asked while the job runs (the counts below wait for a flush, which
    # can come after a short job ended).
    status, text = site.get("/metrics")
    assert status == 200
    held = {s.labels["task"]: s.value for s in metrics_families(text)["celery_lock_held"].samples}
    assert held.get(name, 0) >= 1
    dupes = [mod.work.delay(k, 0.0) for _ in range(2)]
    for d in dupes:
        d.get(timeout=30, propagate=False)
    # Each process flushes its own counts (the holder's pool child, the main process that skipped before the pool).
    assert counted(c, name, "skipped", 2) >= 2
    assert counted(c, name, "acquired", 1) >= 1
    status, text = site.get("/metrics")
    assert status == 200
    families = metrics_families(text)
    events = families["celery_lock_events"]
    assert events.type == "counter"
    samples = {(s.labels["task"], s.labels["outcome"]): s.value for s in events.samples if s.name.endswith("_total")}
    assert samples[(name, "acquired")] >= 1
    assert samples[(name, "skipped")] >= 2
    for family in families.values():
        for sample in family.samples:
            assert set(sample.labels) <= {"task", "outcome"}, sample
    assert PASSWORD not in text
    first.get(timeout=30)
    assert counted(c, name, "released", 1) >= 1
    settings = settings_for(mod.app)
    recent = metrics.read_metrics(settings.nodes, settings.prefix, since=600)
    assert recent.tasks[name]["acquired"] >= 1 and recent.to_json()["total"]["skipped"] >= 2


def test_a_line_counts_its_waits_and_the_wait_time(site: Site) -> None:
    """A rescheduled duplicate that waited in line and then ran is counted deferred/waited, with its wait time
    (the summary celery_lock_wait_seconds in /metrics)."""
    c = site.c
    mod = c.app_module()
    name = mod.work_later.name
    k = new_key()
    first = mod.work_later.delay(k, 1.0)
    c.wait_started(k)
    later = mod.work_later.delay(k, 0.0)
    first.get(timeout=30)
    later.get(timeout=60)
    assert counted(c, name, "waited", 1) >= 1
    _status, text = site.get("/metrics")
    families = {f.name: f for f in text_string_to_metric_families(text)}
    waits = {(s.name, s.labels["task"]): s.value for s in families["celery_lock_wait_seconds"].samples}
    assert waits[("celery_lock_wait_seconds_count", name)] >= 1
    assert waits[("celery_lock_wait_seconds_sum", name)] > 0


def waiting_gauge(site: Site, task: str) -> float:
    """``celery_lock_waiting{task}`` as /metrics says it now (0 when the task has no sample)."""
    _status, text = site.get("/metrics")
    samples = metrics_families(text)["celery_lock_waiting"].samples
    return next((s.value for s in samples if s.labels.get("task") == task), 0.0)


def test_the_waiting_gauge_follows_the_line_and_replaced_and_lost_are_counted(site: Site) -> None:
    """/metrics on real workers: ``celery_lock_waiting`` counts the jobs waiting in a line (2 behind a holder, 0
    once they ran); a waiting call superseded by a newer one (``replace``) is counted ``replaced``; a lock deleted
    under its running job is counted ``lost``."""
    c = site.c
    mod = c.app_module()
    k = new_key()
    holder = mod.work_later.delay(k, 3.0)
    c.wait_started(k)
    waiting = [mod.work_later.delay(k, 0.0) for _ in range(2)]
    seen = 0.0
    for _ in polling(20, 0.2):
        seen = waiting_gauge(site, mod.work_later.name)
        if seen >= 2:
            break
    assert seen >= 2
    for r in [holder, *waiting]:
        assert r.get(timeout=60) == k
    for _ in polling(20, 0.2):
        seen = waiting_gauge(site, mod.work_later.name)
        if seen == 0:
            break
    assert seen == 0
    # replace: while "a" runs, "b" waits, then "c" takes its place.
    k2 = new_key()
    first = mod.latest.delay(k2, "a", 2.0)
    c.wait_started(k2)
    second = mod.latest.delay(k2, "b")
    for _ in polling(15, 0.1):
        if line_of(c, mod.latest.lock_key_for(k2, "b")):
            break
    third = mod.latest.delay(k2, "c")
    assert first.get(timeout=30) == "a" and third.get(timeout=30) == "c"
    second.get(timeout=30, propagate=False)
    assert second.state == "REVOKED"
    assert counted(c, mod.latest.name, "replaced", 1) >= 1
    # lost: the running job's key deleted on every node; its next renewal finds it gone.
    k3 = new_key()
    running = mod.work.delay(k3, OUTLIVES)
    c.wait_started(k3)
    for server in c.locks:
        with contextlib.closing(c.lock_client(server)) as client:
            client.delete(mod.work.lock_key_for(k3))
    assert counted(c, mod.work.name, "lost", 1) >= 1
    running.revoke()


def line_of(c: Cluster, lock_key: str) -> list[str]:
    """The task ids waiting in ``lock_key``'s line, from the first lock node."""
    from celery_singleton_lock.lock.record import sibling_key  # noqa: PLC0415

    with contextlib.closing(c.lock_client(c.locks[0])) as client:
        return [m.decode() for m in client.zrange(sibling_key(lock_key, ":waiters"), 0, -1)]


# -- the page in a real browser -------------------------------------------------------------------------------------


def test_the_page_shows_the_holder_and_the_line_and_a_release_needs_the_secret(site: Site, browser: Browser) -> None:
    """In Chromium: a running job's holder task id is shown in the held table, its waiting duplicates in line in
    their order; a release with a wrong secret is refused (403, the lock stays), with the right one the lock goes."""
    c = site.c
    mod = c.app_module()
    k = new_key()
    holder = mod.work_later.delay(k, OUTLIVES)
    c.wait_started(k)
    waiting = []
    for _ in range(3):
        waiting.append(mod.work_later.delay(k, 0.0).id)
    lock_key = mod.work_later.lock_key_for(k)
    for _ in polling(20, 0.2):
        _status, body = site.get("/")
        if all(w in body for w in waiting):
            break
    browser.open(site.url + "/")
    rows = "[...document.querySelectorAll('table.{} tr')].map(r => r.innerText)"
    row = browser.wait_for(rows.format("held") + f".find(t => t.includes({json.dumps(holder.id)})) || ''")
    assert mod.work_later.name in row and "running" in row
    order = browser.evaluate(rows.format("lines") + f".find(t => t.includes({json.dumps(lock_key)})) || ''")
    # The line's order is its arrival order at the workers (a sorted set by first arrival), not the send order.
    from celery_singleton_lock.lock.record import sibling_key  # noqa: PLC0415

    line = [m.decode() for m in c.lock_client(c.locks[0]).zrange(sibling_key(lock_key, ":waiters"), 0, -1)]
    assert sorted(line) == sorted(waiting)
    positions = [order.find(w) for w in line]
    assert -1 not in positions and positions == sorted(positions), order
    if os.environ.get("CSL_WEB_SCREENSHOT"):  # docs/img/locks-web.png is made this way
        browser.screenshot(os.environ["CSL_WEB_SCREENSHOT"])

    def submit(secret: str) -> str:
        browser.open(site.url + "/")
        clicked = browser.evaluate(
            "(() => { const f = [...document.querySelectorAll('form.release')].find("
            f"f => f.key.value === {json.dumps(lock_key)}); if (!f) return false;"
            f" f.secret.value = {json.dumps(secret)}; f.querySelector('button').click(); return true; }})()"
        )
        assert clicked
        return str(
            browser.wait_for(
                "location.pathname.endsWith('/release') && document.readyState === 'complete'"
                " && document.getElementById('message') && document.getElementById('message').innerText"
            )
        )

    said = submit("not-the-secret-at-all")
    assert "wrong or missing secret" in said
    assert holder_of(c, mod.work_later, k) == holder.id
    said = submit(SECRET)
    assert f"released {lock_key} on 3 of 3 node(s)" in said
    # The running holder's next renewal may find its key gone and repair it for a moment before it counts the lock
    # as lost and takes its record back off (see docs/cli.md, locks release): poll, bounded.
    gone_for_a_ttl(c, mod.work_later, k, holder.id)
    assert holder_of(c, mod.work_later, k) != holder.id
    assert holder.id not in [r[1] for r in c.runs(k)], "the lock went only when its job ended, not at the release"


def test_task_ids_are_escaped_on_the_page(site: Site, browser: Browser) -> None:
    """A task id full of HTML (an img with onerror, a script) shows as text: no element is injected and no script
    runs (each value is escaped; the CSP allows only the page's own script)."""
    c = site.c
    mod = c.app_module()
    k = new_key()
    result = mod.work.apply_async((k, 4.0), task_id=XSS_ID)
    c.wait_started(k)
    browser.open(site.url + "/")
    shown = browser.wait_for(f"document.body.innerText.includes({json.dumps(XSS_ID)})")
    assert shown, "the task id is shown as text"
    assert browser.evaluate("window.__xss === undefined")
    assert browser.evaluate("document.querySelectorAll('img').length") == 0
    assert browser.evaluate("document.querySelectorAll('script').length") == 0  # refresh=0: the page has none
    result.revoke()


# -- release attacks over HTTP -----------------------------------------------------------------------------------------


def _running(site: Site, duration: float = 4.0) -> tuple[Any, str, str]:
    c = site.c
    mod = c.app_module()
    k = new_key()
    result = mod.work.delay(k, duration)
    c.wait_started(k)
    key = mod.work.lock_key_for(k)
    _status, body = site.get("/")
    start = body.index(f'name="key" value="{key}"')
    owner = body[start:].split('name="owner" value="', 1)[1].split('"', 1)[0]
    return result, k, owner


def test_release_without_the_secret_a_wrong_one_or_from_another_site_is_refused(site: Site) -> None:
    """POST /release with no secret, a wrong one, a right one sent from another origin (a CSRF form), or an owner
    the page did not show: each is refused and the lock stays; the right secret in the header releases it."""
    c = site.c
    mod = c.app_module()
    _result, k, owner = _running(site, OUTLIVES)
    key = mod.work.lock_key_for(k)
    holder = holder_of(c, mod.work, k)
    for form, headers, code in (
        ({"key": key, "owner": owner}, {}, 403),
        ({"key": key, "owner": owner, "secret": SECRET[:-1]}, {}, 403),
        ({"key": key, "owner": owner, "secret": SECRET}, {"Origin": "http://evil.example"}, 403),
        ({"key": key, "owner": owner, "secret": SECRET}, {"Sec-Fetch-Site": "cross-site"}, 403),
        ({"key": key, "owner": "0" * 32, "secret": SECRET}, {}, 409),
    ):
        status, _ = site.post("/release", form, headers)
        assert status == code, (form, headers)
        assert holder_of(c, mod.work, k) == holder
    status, body = site.get("/release")
    assert status == 405
    status, body = site.post("/release", {"key": key, "owner": owner}, {"X-Lock-Secret": SECRET})
    assert status == 200 and "released" in body
    gone_for_a_ttl(c, mod.work, k, holder)
    assert holder_of(c, mod.work, k) != holder
    assert holder not in [r[1] for r in c.runs(k)], "the lock went only when its job ended, not at the release"


def test_a_page_without_a_secret_is_read_only(site: Site) -> None:
    """Mounted without a secret, the page has no release form and refuses every release with 403."""
    c = site.c
    mod = c.app_module()
    with served(make_app(c.app_module().app, refresh=0, doctor=False)) as url:
        other = Site(c, url)
        _result, k, _ = _running(site)
        holder = holder_of(c, mod.work, k)
        status, body = other.get("/")
        assert status == 200 and "form" not in body.split("<h2>Held</h2>", 1)[1].split("<h2>", 1)[0]
        status, _ = other.post("/release", {"key": "x", "owner": "y", "secret": SECRET})
        assert status == 403
        assert holder_of(c, mod.work, k) == holder


def test_no_password_or_owner_token_is_shown(site: Site) -> None:
    """The nodes' password (in their URLs) appears nowhere: not on the page, not in /metrics, not in locks.json;
    nor do the holders' owner tokens (they are what a release or renewal compares)."""
    c = site.c
    _, k, _ = _running(site, OUTLIVES)
    key = c.app_module().work.lock_key_for(k)
    owner = c.lock_client(c.locks[0]).hget(key, "owner")
    assert owner is not None, "the holder ended before the pages were read: nothing was compared"
    for path in ("/", "/metrics", "/locks.json"):
        status, body = site.get(path)
        assert status == 200
        assert PASSWORD not in body, path
        assert owner.decode() not in body, path


def test_a_slow_node_and_a_dead_node_leave_the_page_up(site: Site) -> None:
    """One lock node behind a proxy that holds every command (a stalled node), another stopped: the page still
    loads, within the socket timeouts, and names both nodes as not answering, by their redacted address."""
    c = site.c
    base = c.app_module().app
    with FaultProxy(c.locks[2].port) as proxy:
        urls = [*c.lock_urls[:2], f"redis://:{PASSWORD}@127.0.0.1:{proxy.port}/0"]
        app = Celery("web-slow", broker="memory://", set_as_current=False)
        app.conf.update(
            singleton_lock_urls=urls, singleton_lock_prefix=base.conf.singleton_lock_prefix, singleton_lock_ttl=TTL
        )
        proxy.hold()
        with served(make_app(app, refresh=0, doctor=False)) as url:
            status, body = Site(c, url).get("/")
            assert status == 200
            assert f"127.0.0.1:{proxy.port}" in body and "did not answer" in body
            assert PASSWORD not in body
            c.stop_locks(1)
            try:
                status, body = Site(c, url).get("/")
                assert status == 200
                assert body.count("did not answer") >= 2 and "1 of 3 lock node(s) answered" in body
                status, text = Site(c, url).get("/metrics")
                assert status == 200 and "celery_lock_nodes_up 1" in text
            finally:
                c.start_locks()
        proxy.clear()


def test_the_cli_serves_the_page_and_names_the_missing_secret_length(site: Site, tmp_path: Path) -> None:
    """`celery -A app locks web --port N` serves / and /metrics on 127.0.0.1; a secret too short is refused with one
    line naming the variable."""
    c = site.c
    env = {**os.environ, **c.env, "PYTHONPATH": f"{APPS}:{Path(__file__).parent.parent.parent}"}
    short = subprocess.run(
        [sys.executable, "-m", "celery", "-A", "locked_app", "locks", "web", "--port", "0"],
        env={**env, "SINGLETON_LOCK_WEB_SECRET": "short"},
        cwd=str(APPS),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert (
        short.returncode != 0
        and "SINGLETON_LOCK_WEB_SECRET" in short.stderr
        and "short" not in short.stderr.replace("too short", "")
    )
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "celery", "-A", "locked_app", "locks", "web", "--port", str(port)],
        env=env,
        cwd=str(APPS),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        site2 = Site(c, f"http://127.0.0.1:{port}")
        status = 0
        for _ in polling(60, 0.25):
            with contextlib.suppress(OSError):
                status, body = site2.get("/metrics")
                if status == 200:
                    break
        assert status == 200 and "celery_lock_events_total" in body
        status, body = site2.get("/")
        assert status == 200 and "Read-only" in body
        # With no --host it binds loopback only: the kernel's table of listening sockets says so.
        if Path("/proc/net/tcp").exists():
            assert listening_on(port) == {"127.0.0.1"}
    finally:
        proc.terminate()
        proc.wait(timeout=20)


def listening_on(port: int) -> set[str]:
    """The local addresses of the TCP sockets listening on ``port`` (Linux: /proc/net/tcp and tcp6)."""
    found: set[str] = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(FileNotFoundError), open(table, encoding="ascii") as f:
            for line in f.readlines()[1:]:
                local, state = line.split()[1], line.split()[3]
                address, hex_port = local.split(":")
                if state == "0A" and int(hex_port, 16) == port:
                    raw = bytes.fromhex(address)
                    words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))  # little-endian words
                    found.add(str(ipaddress.ip_address(words)))
    return found


def test_metrics_app_serves_prometheus_text_of_the_app(site: Site) -> None:
    """``metrics_app(app)`` (the metrics alone, to mount anywhere): GET answers the Prometheus text of the app's
    counts, parsed by prometheus_client, with a job's outcome counted; a POST is refused with 405."""
    c = site.c
    mod = c.app_module()
    k = new_key()
    assert mod.work.delay(k, 0.0).get(timeout=30) == k
    assert counted(c, mod.work.name, "acquired", 1) >= 1
    with served(metrics_app(mod.app)) as url:
        status, text = Site(c, url).get("/metrics")
        assert status == 200
        families = metrics_families(text)
        samples = [s for s in families["celery_lock_events"].samples if s.labels.get("task") == mod.work.name]
        assert any(s.labels.get("outcome") == "acquired" and s.value >= 1 for s in samples), samples
        status, _ = Site(c, url).post("/metrics", {})
        assert status == 405


# -- attack pass: regressions ---------------------------------------------------------------------------------------


def test_attack_dns_rebinding_a_foreign_host_name_is_refused_by_the_local_server(site: Site) -> None:
    """FOUND in the attack pass: bound to 127.0.0.1, the page answered any Host header, so a web site whose name
    re-resolves to 127.0.0.1 (DNS rebinding) could read it from the operator's browser, and its release form would
    pass the same-origin check (Origin and Host both name that site). `locks web` on a loopback address answers only
    loopback host names (403 otherwise); a mounted app leaves Host to its host framework."""
    c = site.c
    app = c.app_module().app
    with served(make_app(app, refresh=0, doctor=False, allowed_hosts=("127.0.0.1", "localhost", "[::1]"))) as url:
        local = Site(c, url)
        status, _ = local.get("/")
        assert status == 200
        port = url.rsplit(":", 1)[1]
        for host in (f"rebind.example:{port}", "rebind.example", f"127.0.0.1.rebind.example:{port}"):
            request = urllib.request.Request(url + "/", headers={"Host": host})
            with pytest.raises(urllib.error.HTTPError) as refused:
                urllib.request.urlopen(request, timeout=30)
            assert refused.value.code == 403, host
        for host in (f"localhost:{port}", f"127.0.0.1:{port}"):
            request = urllib.request.Request(url + "/metrics", headers={"Host": host})
            with urllib.request.urlopen(request, timeout=30) as response:
                assert response.status == 200


def test_attack_release_is_limited_to_keys_under_the_prefix(site: Site) -> None:
    """FOUND in the attack pass: with the secret, the release form released any holder record on the lock nodes,
    e.g. another app's lock under another prefix (the page shows only this prefix's keys). Refused now (400), and
    the other lock stays."""
    c = site.c
    from celery_singleton_lock import Redlock  # noqa: PLC0415

    other = Redlock(c.lock_urls, "another-app:job-1", ttl=30.0)
    assert other.acquire()
    try:
        seen = [c.lock_client(s).hget("another-app:job-1", "owner") for s in c.locks]
        owner = seen[0].decode() if seen[0] else ""
        from celery_singleton_lock.ops.web.release import owner_digest  # noqa: PLC0415

        status, _ = site.post("/release", {"key": "another-app:job-1", "owner": owner_digest(owner), "secret": SECRET})
        assert status == 400
        assert other.owned()
    finally:
        other.release()


def test_attack_html_in_keys_and_record_fields_is_escaped(site: Site) -> None:
    """Keys made from user data (a lock_key() returning an argument verbatim) and record fields (worker, task name)
    holding HTML are shown as text on the page: nothing of them is parsed as markup."""
    c = site.c
    prefix = c.app_module().app.conf.singleton_lock_prefix
    key = f'{prefix}<script>alert(1)</script>"><img src=x onerror=alert(2)>'
    for server in c.locks:
        client = c.lock_client(server)
        client.hset(
            key,
            mapping={"owner": "o-1", "fence": 1, "state": "running", "name": "<b>t</b>", "job": "j", "worker": "<i>w"},
        )
        client.pexpire(key, 20_000)
    try:
        status, body = site.get("/")
        assert status == 200
        assert "<script>alert" not in body and "<img src=x" not in body and "<b>t</b>" not in body
        assert "&lt;script&gt;alert(1)&lt;/script&gt;&quot;&gt;&lt;img src=x onerror=alert(2)&gt;" in body
        assert "&lt;i&gt;w" in body
    finally:
        for server in c.locks:
            c.lock_client(server).delete(key)


def test_attack_the_page_cannot_be_framed_and_runs_no_foreign_script(site: Site) -> None:
    """Clickjacking and injected scripts: the page is sent with X-Frame-Options DENY and a CSP allowing no frame
    ancestors and only the page's own (nonce) script."""
    with urllib.request.urlopen(site.url + "/", timeout=30) as response:
        headers = response.headers
    assert headers["X-Frame-Options"] == "DENY"
    csp = headers["Content-Security-Policy"]
    assert "frame-ancestors 'none'" in csp and "script-src 'nonce-" in csp and "default-src 'none'" in csp


def test_attack_a_task_name_with_quotes_and_newlines_stays_one_label(site: Site) -> None:
    """A task name holding a quote, a backslash and a newline (user-chosen names) is escaped in the exposition:
    prometheus_client's parser reads it back as the same label, and no extra sample appears."""
    c = site.c
    settings = settings_for(c.app_module().app)
    name = 'odd"task\\name\nfake_metric{x="1"} 9'
    pipe = settings.nodes.clients[0].pipeline(transaction=False)
    metrics.write(pipe, settings.prefix, {(name, "acquired"): 2})
    pipe.execute()
    _, text = site.get("/metrics")
    families = {f.name: f for f in text_string_to_metric_families(text)}
    assert "fake_metric" not in families
    samples = [s for s in families["celery_lock_events"].samples if s.labels["task"] == name]
    assert [(s.labels["outcome"], s.value) for s in samples if s.name.endswith("_total")] == [("acquired", 2.0)]


def test_attack_secrets_in_the_broker_backend_and_node_urls_never_show(tmp_path: Path) -> None:
    """Passwords in the broker, result backend and lock node URLs (user info and a ?password= query), with every
    node down so their errors and the doctor's findings are on the page: none of them appears on the page or in
    /metrics."""
    import io  # noqa: PLC0415

    port = free_port()  # nothing listens there
    app = Celery(
        "web-secrets",
        broker=f"redis://:brokersecret@127.0.0.1:{port}/0",
        backend=f"redis://:backendsecret@127.0.0.1:{port}/1",
        set_as_current=False,
    )
    app.conf.singleton_lock_urls = [f"redis://user:locksecret@127.0.0.1:{port}/0?password=querysecret"]
    wsgi = make_app(app, refresh=0)
    for path in ("/", "/metrics", "/locks.json"):
        statuses: list[str] = []
        environ = {"PATH_INFO": path, "REQUEST_METHOD": "GET", "wsgi.input": io.BytesIO(), "QUERY_STRING": ""}
        body = b"".join(wsgi(environ, lambda status, _headers, out=statuses: out.append(status))).decode()
        assert statuses == ["200 OK"], path
        for secret in ("brokersecret", "backendsecret", "locksecret", "querysecret"):
            assert secret not in body, (path, secret)
    assert "did not answer" in b"".join(wsgi({**environ, "PATH_INFO": "/"}, lambda *_: None)).decode()


def test_the_page_refreshes_itself(site: Site, browser: Browser) -> None:
    """With refresh=1 the page reloads itself (its own nonce script, allowed by the CSP): a new document within a
    few seconds, without any action in the browser."""
    with served(make_app(site.c.app_module().app, refresh=1, doctor=False)) as url:
        browser.open(url + "/")
        browser.evaluate("window.__first = true")
        reloaded = browser.wait_for("document.readyState === 'complete' && window.__first === undefined", 15)
        assert reloaded


# -- what an operator reads: folded claims, partial records, the producer, the search, no tokens -------------------


def _records(site: Site) -> dict[str, Any]:
    """A beat claim, a done marker, a queued reservation by a producer, a cooldown on every node and one left on a
    single node (partial), each written as the library writes it, under the page's prefix."""
    from celery_singleton_lock import Redlock  # noqa: PLC0415
    from celery_singleton_lock.lock.record import done_key_for  # noqa: PLC0415

    c, tag = site.c, uuid.uuid4().hex[:8]
    prefix = c.app_module().app.conf.singleton_lock_prefix
    at = str(int(time.time() * 1000))
    made: dict[str, Any] = {}

    def take(key: str, urls: list[str], **record: str) -> Redlock:
        lock = Redlock(urls, f"{prefix}{key}", ttl=60.0, job=f"job-{key}", record=record or None, fencing=False)
        assert lock.acquire(blocking=False), key
        return lock

    made["beat"] = take(f"beat:tick-{tag}:2026-01-01T00:00", c.lock_urls)
    made["queued"] = take(f"ops.charge-{tag}", c.lock_urls, state="queued", name="ops.charge", worker="4242@shop-web")
    made["cool"] = take(f"ops.cool-{tag}", c.lock_urls, state="cooldown", name="ops.cool", worker="77@w1", at=at)
    made["partial"] = take(f"ops.gone-{tag}", c.lock_urls[:1], state="cooldown", name="ops.gone", at=at)
    done = done_key_for(f"{prefix}ops.cool-{tag}", f"done-{tag}")
    for client in (c.lock_client(s) for s in c.locks):
        client.set(done, "1", ex=60)
    made["tag"] = tag
    return made


def test_the_page_folds_beat_claims_and_done_markers_and_names_the_producer(site: Site) -> None:
    """Beat claims and done markers sit in folded sections (a count and a toggle), not in the Held table; a queued
    reservation's writer reads "producer pid@host"; a cooldown has a release form, and its release (owner-checked,
    by the digest the page shows) ends it."""
    made = _records(site)
    try:
        tag = made["tag"]
        status, body = site.get("/")
        assert status == 200
        held = body.split("<h2>Held</h2>", 1)[1].split("<h2>", 1)[0]
        assert f"tick-{tag}" not in held
        beat = body.split('<details id="beat">', 1)[1].split("</details>", 1)[0]
        assert f"tick-{tag}" in beat and "beat claim(s)" in beat.split("</summary>")[0]
        done = body.split('<details id="done">', 1)[1].split("</details>", 1)[0]
        assert f"done-{tag}" in done
        reserved = body.split("<h2>Queue-scope reservations</h2>", 1)[1].split("<h2>", 1)[0]
        assert "producer 4242@shop-web" in reserved
        cooling = body.split("<h2>Cooldowns</h2>", 1)[1].split("<h2>", 1)[0]
        row = next(r for r in cooling.split("<tr") if f"ops.cool-{tag}" in r)
        assert 'action="/release"' in row
        digest = row.split('name="owner" value="', 1)[1].split('"', 1)[0]
        status, answer = site.post("/release", {"key": made["cool"].name, "owner": digest, "secret": SECRET})
        assert status == 200 and "released" in answer
        assert not made["cool"].owned()
    finally:
        for lock in (made[k] for k in ("beat", "queued", "cool", "partial")):
            lock.release()


def test_partial_records_are_highlighted_and_counted_in_metrics(site: Site) -> None:
    """A cooldown left on one node of three (two restarted empty) shows as a highlighted partial row with a warning
    above the tables, and /metrics counts it in celery_lock_partial{task}; a record on all three is not counted."""
    made = _records(site)
    try:
        tag = made["tag"]
        _status, body = site.get("/")
        assert 'id="partial"' in body
        row = next(r for r in body.split("<tr") if f"ops.gone-{tag}" in r)
        assert row.startswith(' class="partial"')
        _status, text = site.get("/metrics")
        families = metrics_families(text)
        partial = {s.labels["task"]: s.value for s in families["celery_lock_partial"].samples}
        assert partial.get("ops.gone") == 1 and "ops.cool" not in partial
        assert "celery_lock_incomplete" in families
    finally:
        for lock in (made[k] for k in ("beat", "queued", "cool", "partial")):
            lock.release()


def test_the_page_finds_a_key_by_substring_or_by_a_call(site: Site) -> None:
    """The search box keeps only keys containing the text; a call (task, args and kwargs as JSON) shows its key and
    only that key's rows."""
    c = site.c
    mod = c.app_module()
    made = _records(site)
    result, k, _ = _running(site, 3.0)
    try:
        tag = made["tag"]
        status, body = site.get(f"/?q=charge-{tag}")
        assert status == 200 and f"ops.charge-{tag}" in body and f"ops.cool-{tag}" not in body
        query = urllib.parse.urlencode({"task": mod.work.name, "args": json.dumps([k, 3.0]), "kwargs": "{}"})
        status, body = site.get(f"/?{query}")
        key = mod.work.lock_key_for(k)
        assert status == 200 and f"locks {key}" in body
        held = body.split("<h2>Held</h2>", 1)[1].split("<h2>", 1)[0]
        assert key in held and f"ops.cool-{tag}" not in body
    finally:
        result.revoke()
        for lock in (made[kind] for kind in ("beat", "queued", "cool", "partial")):
            lock.release()


def test_no_owner_token_nor_a_piece_of_one_is_in_any_output(site: Site) -> None:
    """With a secret set, the page, a search, /metrics and /locks.json hold no owner token of any holder, nor any 8
    characters of its random part: the release forms carry a digest of it."""
    c = site.c
    made = _records(site)
    result, _, _ = _running(site, 3.0)
    try:
        tokens = set()
        for client in (c.lock_client(s) for s in c.locks):
            for key in client.scan_iter(match=f"{c.app_module().app.conf.singleton_lock_prefix}*", count=1000):
                with contextlib.suppress(Exception):
                    owner = client.hget(key, "owner")
                    if owner:
                        tokens.add(owner.decode())
        assert len(tokens) >= 4
        outputs = [site.get(path)[1] for path in ("/", "/metrics", "/locks.json", f"/?q={made['tag']}")]
        for token in tokens:
            random_part = token[-32:]  # the label before it (beat@host:pid:...) is no secret
            pieces = {random_part[i : i + 8] for i in range(len(random_part) - 7)}
            for out in outputs:
                assert token not in out
                assert not [p for p in pieces if p in out], token
    finally:
        result.revoke()
        for lock in (made[kind] for kind in ("beat", "queued", "cool", "partial")):
            lock.release()


def _two_apps(c: Cluster) -> tuple[Celery, Celery]:
    """Two apps on the same lock nodes, 'pa<hex>:' and 'xpa<hex>:' (one prefix ends the other: "{xpa..." keys
    match the glob '\\{*pa<hex>:*')."""
    tag = uuid.uuid4().hex[:8]
    apps = []
    for prefix in (f"pa{tag}:", f"xpa{tag}:"):
        app = Celery(prefix[:-1], broker="memory://", set_as_current=False)
        app.conf.update(singleton_lock_urls=c.lock_urls, singleton_lock_prefix=prefix, singleton_lock_ttl=TTL)
        apps.append(app)
    return apps[0], apps[1]


def test_attack_two_apps_on_one_node_neither_lists_nor_releases_the_others_locks(site: Site) -> None:
    """FOUND: app 'pa:' listed app 'xpa:'s done markers and lines (their '{xpa...}:done:'/':waiters' names match
    the scan for '{...pa:...'), and `locks release` released a lock of any prefix. Now the CLI list, the page and
    /locks.json show only the app's own keys, and neither the CLI nor the page releases the other app's lock."""
    from celery.bin.base import CLIContext  # noqa: PLC0415
    from click.testing import CliRunner  # noqa: PLC0415

    from celery_singleton_lock import Redlock  # noqa: PLC0415
    from celery_singleton_lock.lock.record import burst_key_for, sibling_key  # noqa: PLC0415
    from celery_singleton_lock.ops.cli import locks  # noqa: PLC0415
    from celery_singleton_lock.ops.web.release import owner_digest  # noqa: PLC0415

    c = site.c
    mine, theirs = _two_apps(c)
    held: list[Redlock] = []
    owned: dict[str, str] = {}
    for n, app in enumerate((mine, theirs)):
        settings = settings_for(app)
        lock = Redlock(c.lock_urls, f"{settings.prefix}t{n}.job:v2:{'a' * 32}", ttl=60.0)
        assert lock.acquire(blocking=False)
        held.append(lock)
        owned[settings.prefix] = lock.name
        done = Redlock(c.lock_urls, f"{settings.prefix}t{n}.done:v2:{'b' * 32}", ttl=60.0, job=f"job-{n}")
        assert done.acquire(blocking=False)
        assert done.finish(done_for=60, waited_for=60)
        first = c.lock_client(c.locks[0])
        first.zadd(sibling_key(lock.name, ":waiters"), {f"waiter-of-{settings.prefix}": time.time() * 1000})
        first.expire(sibling_key(lock.name, ":waiters"), 60)
        for server in c.locks:
            client = c.lock_client(server)
            burst = burst_key_for(f"{settings.prefix}t{n}.deb:v2:{'c' * 32}")
            client.hset(burst, mapping={"job": f"j{n}", "name": f"t{n}.deb"})
            client.expire(burst, 60)

    def cli(app: Celery, *args: str) -> Any:
        return CliRunner().invoke(locks, list(args), obj=CLIContext(app=app, no_color=True, workdir=None))

    try:
        for n, app, other in ((0, mine, theirs), (1, theirs, mine)):
            own, foreign = app.conf.singleton_lock_prefix, other.conf.singleton_lock_prefix
            theirs_named = f"{foreign}t{1 - n}."
            listing = cli(app, "list", "--done", "--json")
            assert listing.exit_code == 0, listing.output
            keys = {e["lock_key"] or e["key"] for e in json.loads(listing.stdout)}
            assert keys and all(k.startswith(own) for k in keys), keys
            with served(make_app(app, secret=SECRET, refresh=0, doctor=False)) as url:
                page = Site(c, url)
                status, body = page.get("/")
                assert status == 200
                assert theirs_named not in body and f"waiter-of-{foreign}" not in body, "the other app's keys shown"
                assert f"waiter-of-{own}" in body and f"{own}t{n}.job" in body and f"{own}t{n}.deb" in body
                status, text = page.get("/locks.json")
                assert status == 200
                assert all((e["lock_key"] or e["key"]).startswith(own) for e in json.loads(text)["locks"])
                victim = owned[foreign]
                owner = c.lock_client(c.locks[0]).hget(victim, "owner").decode()
                status, _ = page.post("/release", {"key": victim, "owner": owner_digest(owner), "secret": SECRET})
                assert status == 400
            refused = cli(app, "release", owned[foreign], "--yes")
            assert refused.exit_code == 1 and "not under this app's prefix" in refused.stderr
        assert all(lock.owned() for lock in held)
    finally:
        for lock in held:
            lock.release()


def _own_app(c: Cluster, name: str) -> Celery:
    """An app of this test's own on the module's lock nodes (memory broker: nothing consumes what it sends)."""
    app = Celery(name, broker="memory://", set_as_current=False)
    prefix = f"{name}{uuid.uuid4().hex[:8]}:"
    app.conf.update(singleton_lock_urls=c.lock_urls, singleton_lock_prefix=prefix, singleton_lock_ttl=TTL)
    return app


def test_the_page_shows_pending_debounced_runs(site: Site) -> None:
    """A burst pending under lock_debounce (what `locks list` shows as kind debounce) is on the page too: its key,
    task, job's task id, when it runs and the last call's arguments, escaped; /locks.json lists it."""
    from celery_singleton_lock import LockedTask  # noqa: PLC0415

    app = _own_app(site.c, "deb")

    @app.task(base=LockedTask, shared=False, lock_debounce=60, lock_unique_on=["key"], name="deb.rebuild")
    def rebuild(key: str, note: str = "") -> None: ...

    rebuild.delay("acct-1", note="<script>alert(1)</script>")
    key = rebuild.lock_key_for("acct-1")
    with served(make_app(app, refresh=0, doctor=False)) as url:
        status, body = Site(site.c, url).get("/")
        assert status == 200
        section = body.split("<h2>Pending debounced runs</h2>", 1)[1].split("<h2>", 1)[0]
        assert key in section and "deb.rebuild" in section and "pending" in section
        assert "&lt;script&gt;alert(1)&lt;/script&gt;" in section and "<script>alert" not in body
        assert "1 debounced run(s) pending" in body
        status, text = Site(site.c, url).get("/locks.json")
        (entry,) = [e for e in json.loads(text)["locks"] if e["kind"] == "debounce"]
        assert entry["lock_key"] == key


def test_the_page_lists_pending_cancels_escaped(site: Site) -> None:
    """A durable cancel of a job not yet delivered (what `locks list` shows as a pending cancel) is on the page: its
    key, task id and who cancelled it, escaped."""
    from celery_singleton_lock import LockedTask  # noqa: PLC0415

    app = _own_app(site.c, "cxl")

    @app.task(base=LockedTask, shared=False, lock_unique_on=["key"], name="cxl.rebuild")
    def rebuild(key: str) -> None: ...

    report = rebuild.cancel_task_id("job-<b>1</b>", ["acct-<i>"], by="ops <script>x</script>")
    assert report.outcome == "pending" and report.durable, report
    key = rebuild.lock_key_for("acct-<i>")
    with served(make_app(app, refresh=0, doctor=False)) as url:
        status, body = Site(site.c, url).get("/")
    assert status == 200
    section = body.split("<h2>Pending cancels</h2>", 1)[1].split("<h2>", 1)[0]
    assert html.escape(key) in section and "job-&lt;b&gt;1&lt;/b&gt;" in section
    assert "ops &lt;script&gt;x&lt;/script&gt;" in section and "<script>x" not in body


def test_locks_json_is_paged_and_its_cursor_and_limit_are_checked(site: Site) -> None:
    """/locks.json gives `limit` locks (default 500) and a `next` cursor: walking the pages lists every key once;
    a limit of 0, negative, huge or not a number, and a cursor that is not one are 400; a cursor forged from any
    key only moves the start, never past the prefix (a key after every key of the app gives an empty page)."""
    from celery_singleton_lock import Redlock  # noqa: PLC0415
    from celery_singleton_lock.ops.web.listing import cursor_of  # noqa: PLC0415

    c = site.c
    app = _own_app(c, "paged")
    prefix = app.conf.singleton_lock_prefix
    held = [Redlock(c.lock_urls, f"{prefix}t.job:{n:03d}", ttl=60.0) for n in range(23)]
    assert all(lock.acquire(blocking=False) for lock in held)
    try:
        with served(make_app(app, refresh=0, doctor=False)) as url:
            page = Site(c, url)
            seen: list[str] = []
            cursor, pages = "", 0
            for _ in range(10):
                status, text = page.get(f"/locks.json?limit=10&cursor={cursor}")
                assert status == 200, text
                doc = json.loads(text)
                assert len(doc["locks"]) <= 10 and doc["limit"] == 10
                seen += [e["key"] for e in doc["locks"]]
                pages += 1
                if doc["next"] is None:
                    break
                cursor = doc["next"]
            assert pages == 3 and seen == sorted(lock.name for lock in held)
            status, text = page.get("/locks.json")
            assert status == 200 and len(json.loads(text)["locks"]) == 23 and json.loads(text)["next"] is None
            for query in ("limit=0", "limit=-1", "limit=99999999999", "limit=abc", "limit=", "cursor=%%%", "cursor=_w"):
                status, text = page.get(f"/locks.json?{query}")
                assert status == 400 and "limit" in json.loads(text)["error"], query
            status, text = page.get(f"/locks.json?cursor={cursor_of(prefix + '~')}")
            assert status == 200 and json.loads(text)["locks"] == []
            status, text = page.get(f"/locks.json?limit=5&cursor={cursor_of('a')}")
            assert [e["key"] for e in json.loads(text)["locks"]] == sorted(lock.name for lock in held)[:5]
    finally:
        for lock in held:
            lock.release()


def test_wrong_secrets_are_rate_limited_per_client(site: Site) -> None:
    """Five wrong release secrets from one address in a minute, then 429 with Retry-After, even for the right
    secret (a guesser learns nothing more); another page's counts are its own."""
    c = site.c
    app = _own_app(c, "tries")
    with served(make_app(app, secret=SECRET, refresh=0, doctor=False)) as url:
        page = Site(c, url)
        for n in range(5):
            status, _ = page.post("/release", {"key": "k", "owner": "o", "secret": f"wrong-secret-{n:04d}-xxxx"})
            assert status == 403, n
        status, body = page.post("/release", {"key": "k", "owner": "o", "secret": SECRET})
        assert status == 429 and "too many wrong secrets" in body
        request = urllib.request.Request(url + "/release", data=b"key=k&owner=o", method="POST")
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(request, timeout=30)
        assert refused.value.code == 429 and 0 < int(refused.value.headers["Retry-After"]) <= 60
    with served(make_app(app, secret=SECRET, refresh=0, doctor=False)) as url:
        status, _ = Site(c, url).post("/release", {"key": "k", "owner": "o", "secret": SECRET})
        assert status == 400  # the right secret, a key not under the prefix: no longer limited


def test_locks_web_on_a_non_loopback_address_answers_only_its_allowed_hosts(site: Site) -> None:
    """FOUND: `locks web --host 0.0.0.0` answered any Host header (DNS rebinding onto the page from a browser on
    the network). Now it answers the bound address's names, the loopback names and --allowed-host, 403 otherwise."""
    c = site.c
    env = {**os.environ, **c.env, "PYTHONPATH": f"{APPS}:{Path(__file__).parent.parent.parent}"}
    port = free_port()
    command = [sys.executable, "-m", "celery", "-A", "locked_app", "locks", "web", "--host", "0.0.0.0"]
    proc = subprocess.Popen(
        [*command, "--port", str(port), "--allowed-host", "locks.example.org"],
        env=env,
        cwd=str(APPS),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )

    def status_for(host: str) -> int:
        request = urllib.request.Request(f"http://127.0.0.1:{port}/livez", headers={"Host": host})
        try:
            with urllib.request.urlopen(request, timeout=30) as response:
                return int(response.status)
        except urllib.error.HTTPError as exc:
            return exc.code

    try:
        for _ in polling(60, 0.25):
            with contextlib.suppress(OSError):
                if status_for(f"127.0.0.1:{port}") == 200:
                    break
        for host in ("locks.example.org", f"LOCKS.example.org:{port}", f"localhost:{port}", "[::1]"):
            assert status_for(host) == 200, host
        for host in ("evil.example", f"evil.example:{port}", "locks.example.org.evil.example", "", "a@b"):
            assert status_for(host) == 403, host
    finally:
        proc.terminate()
        proc.wait(timeout=20)


def test_attack_hostile_keys_huge_unicode_and_invalid_utf8_leave_every_endpoint_whole(site: Site) -> None:
    """Keys of 20 KB, with emoji, right-to-left marks and bytes that are not UTF-8, and records naming a task in
    HTML with a quote and a newline: the page, /metrics (parsed by prometheus_client), /locks.json (paged over them
    with its cursor) and /healthz all answer 200, escaped, and every UTF-8 key is counted and listed once."""
    c = site.c
    app = _own_app(c, "hostile")
    prefix = app.conf.singleton_lock_prefix
    keys = [
        f"{prefix}t.huge:" + "x" * 20_000,
        f"{prefix}t.uni:\U0001f512\u202eevil\u202c",
        (prefix + "t.bin:").encode() + b"\xff\xfe<script>",
    ]
    name = '<img src=x onerror=alert(1)>"\nnext'
    for server in c.locks:
        client = c.lock_client(server)
        for key in keys:
            client.hset(key, mapping={"owner": "o", "fence": 1, "state": "run", "name": name, "job": "<j>"})
            client.expire(key, 60)
    with served(make_app(app, refresh=0, doctor=False)) as url:
        page = Site(c, url)
        status, body = page.get("/")
        assert status == 200 and "<img src=x" not in body and "\U0001f512" in body
        status, text = page.get("/metrics")
        assert status == 200
        held = metrics_families(text)["celery_lock_held"].samples
        # Not 3: a key that is not UTF-8 is read back by its decoded name, another key (left open, see CHANGELOG).
        assert [s.value for s in held if s.labels["task"] == name] == [2.0]
        listed, cursor = [], ""
        for _ in range(5):
            status, text = page.get(f"/locks.json?limit=1&cursor={cursor}")
            assert status == 200, (cursor[:80], len(cursor), text)
            doc = json.loads(text)
            listed += [e["key"] for e in doc["locks"]]
            if doc["next"] is None:
                break
            cursor = doc["next"]
        assert len(listed) == len(set(listed)) and {keys[0], keys[1]} <= set(listed)
        assert page.get("/healthz")[0] == 200


# -- why is this call blocked? /explain and /explain.json (issue 34) ------------------------------------------------


def _href_to_explain(body: str, key: str) -> str:
    """The link the page's row of ``key`` has to its explanation (asserting there is one)."""
    href = f'href="/explain?key={urllib.parse.quote(key, safe="")}"'
    assert href in body, key
    return href[len('href="') : -1]


def _owners(c: Cluster, key: str) -> set[str]:
    """The owner tokens ``key``'s holder records hold on the lock nodes (the holder's secret)."""
    seen = (c.lock_client(s).hget(key, "owner") for s in c.locks)
    return {o.decode() for o in seen if o}


def test_explain_names_the_holder_and_the_line_from_the_page_and_the_call_search(site: Site) -> None:
    """While a real worker holds a key with a duplicate waiting in its line, the held row links to /explain?key=,
    which says the next call waits at place 2 behind the holder's task id (in HTML and in /explain.json, without
    the owner token); the page's search for the call shows the same explanation; an unknown Host gets 403."""
    c = site.c
    mod = c.app_module()
    k = new_key("why")
    running = mod.work_later.delay(k, OUTLIVES)
    c.wait_started(k)
    key = mod.work_later.lock_key_for(k)
    waiting = mod.work_later.delay(k)
    for _ in polling(30, 0.1):
        if line_of(c, key) == [waiting.id]:
            break
    assert line_of(c, key) == [waiting.id]
    owners = _owners(c, key)
    assert owners, "the holder ended before the page was read"
    try:
        _status, page = site.get("/")
        held = page.split("<h2>Held</h2>", 1)[1].split("<h2>", 1)[0]
        status, body = site.get(_href_to_explain(held, key))
        assert status == 200
        assert '<span class="warn" id="verdict">waits</span>' in body
        assert running.id in body and "1 waiting" in body and "place 2" in body
        status, text = site.get(f"/explain.json?key={urllib.parse.quote(key, safe='')}")
        found = json.loads(text)
        assert status == 200 and found["verdict"] == "waits" and found["key"] == key
        assert found["slots"][0]["task_id"] == running.id and "owner" not in found["slots"][0]
        assert found["line"] == {"waiting": 1, "cap": None}
        query = urllib.parse.urlencode({"task": mod.work_later.name, "args": json.dumps([k]), "kwargs": "{}"})
        _status, searched = site.get(f"/?{query}")
        assert 'id="explain"' in searched and "place 2" in searched and running.id in searched
        status, text = site.get(f"/explain.json?{query}")
        assert status == 200 and json.loads(text)["verdict"] == "waits"
        for out in (page, body, text, searched):
            assert not [o for o in owners if o in out or o[-32:] in out]
        with served(make_app(mod.app, refresh=0, doctor=False, allowed_hosts=("127.0.0.1",))) as url:
            request = urllib.request.Request(f"{url}/explain?key=x", headers={"Host": "rebind.example"})
            with pytest.raises(urllib.error.HTTPError) as refused:
                urllib.request.urlopen(request, timeout=30)
            assert refused.value.code == 403
    finally:
        running.revoke()
        waiting.revoke()


def test_explain_shows_a_cooldown_and_says_when_a_key_has_nothing(site: Site) -> None:
    """After a real run of a task with lock_cooldown=60, its Cooldowns row links to an explanation naming the run's
    task id and when the cooldown ends (the call is skipped); a key nothing is under says so (the call runs), a key
    outside the prefix, a call of no LockedTask and a request naming nothing are 400s saying what to change."""
    c = site.c
    mod = c.app_module()
    k = new_key("cool")
    ran = mod.cooled.delay(k)
    assert ran.get(timeout=60) == k
    key = mod.cooled.lock_key_for(k)
    _status, page = site.get("/")
    cooling = page.split("<h2>Cooldowns</h2>", 1)[1].split("<h2>", 1)[0]
    status, body = site.get(_href_to_explain(cooling, key))
    assert status == 200 and 'id="verdict">skipped<' in body
    assert f"in its cooldown by task {ran.id}" in body and "(lock_cooldown=60s)" in body
    empty = mod.cooled.lock_key_for(new_key("none"))
    status, body = site.get(f"/explain?key={urllib.parse.quote(empty, safe='')}")
    assert status == 200 and 'id="verdict">runs<' in body
    assert f"nothing is under {empty} now" in body
    found = json.loads(site.get(f"/explain.json?key={urllib.parse.quote(empty, safe='')}")[1])
    assert found["slots"] == [None] and found["done"] == [] and found["burst"] is None
    for path, says in (
        ("/explain?key=another-app%3Ax", "is not a key under this app&#x27;s prefix"),
        ("/explain?task=nope.task&args=%5B%5D", "no LockedTask named &#x27;nope.task&#x27;"),
        ("/explain?task=locked_app.cooled&args=%5B1%2C", "must be JSON"),
        ("/explain", "name a key (?key=) or a call"),
    ):
        status, body = site.get(path)
        assert status == 400 and says in body, path
    status, text = site.get("/explain.json?key=another-app%3Ax")
    assert status == 400 and "not a key under this app" in json.loads(text)["error"]


def test_attack_explain_escapes_hostile_keys_task_names_and_holder_fields(site: Site) -> None:
    """A key, task name, worker and task id holding HTML and quotes, linked from the page and explained: every
    value is text (no markup of theirs in /explain), the link's URL is percent-encoded, /explain.json parses, and
    the record's owner token is in no output; a hostile task name typed in the call search is escaped too."""
    c = site.c
    prefix = c.app_module().app.conf.singleton_lock_prefix
    key = f'{prefix}<script>alert(1)</script>"><img src=x onerror=alert(2)>'
    owner = f"owner-{uuid.uuid4().hex}"
    record = {"owner": owner, "fence": 1, "state": "running", "name": "<b>t</b>", "job": '<j">', "worker": "<i>w"}
    for server in c.locks:
        client = c.lock_client(server)
        client.hset(key, mapping=record)
        client.pexpire(key, 30_000)
    try:
        _status, page = site.get("/")
        href = _href_to_explain(page, key)
        status, body = site.get(href)
        assert status == 200 and 'id="verdict">held<' in body
        for raw in ("<script>alert", "<img src=x", "<b>t</b>", "<i>w", '<j">'):
            assert raw not in body, raw
        assert "&lt;script&gt;alert(1)&lt;/script&gt;&quot;&gt;&lt;img src=x onerror=alert(2)&gt;" in body
        assert "task &lt;j&quot;&gt; on &lt;i&gt;w" in body
        status, text = site.get(href.replace("/explain?", "/explain.json?"))
        found = json.loads(text)
        assert status == 200 and found["key"] == key and found["slots"][0]["task_id"] == '<j">'
        hostile = urllib.parse.urlencode({"task": '<img src=x onerror=alert(3)>"', "args": "[]"})
        for path in (f"/explain?{hostile}", f"/?{hostile}"):
            _status, out = site.get(path)
            assert "<img src=x onerror=alert(3)>" not in out and "&lt;img src=x onerror=alert(3)&gt;" in out
        for out in (page, body, text):
            assert owner not in out
    finally:
        for server in c.locks:
            c.lock_client(server).delete(key)


def test_explain_of_a_slot_key_reads_every_slot_of_its_lock(site: Site) -> None:
    """With lock_limit=3 and three real runs holding a key, the row of a slot key (``name:slot:<i>``) links to the
    explanation of its lock: all three holders' task ids, and the next call waits in line."""
    c = site.c
    mod = c.app_module()
    k = new_key("slots")
    runs = [mod.limited.delay(k, OUTLIVES) for _ in range(3)]
    c.wait_started(k, count=3)
    key = mod.limited.lock_key_for(k)
    try:
        query = urllib.parse.urlencode({"task": mod.limited.name, "args": json.dumps([k])})
        _status, page = site.get(f"/?{query}")
        held = page.split("<h2>Held</h2>", 1)[1].split("<h2>", 1)[0]
        slot = next(s for s in held.split("<code>")[1:] if ":slot:" in s).split("</code>", 1)[0]
        status, text = site.get(_href_to_explain(held, html.unescape(slot)).replace("/explain?", "/explain.json?"))
        found = json.loads(text)
        assert status == 200 and found["key"] == key and found["verdict"] == "waits"
        assert {s["task_id"] for s in found["slots"]} == {r.id for r in runs}
    finally:
        for r in runs:
            r.revoke()


# -- the page and /metrics on a node of the test's own (in this process: no worker) ---------------------------------


def app_on(node: RedisServer, name: str) -> Any:
    """A Celery app of this test's own (memory broker) locking on ``node`` alone under the prefix ``name:``."""
    app = Celery(name, broker="memory://", set_as_current=False)
    app.conf.singleton_lock_urls = [node.url]
    app.conf.singleton_lock_prefix = f"{name}:"
    return app


def hold(app: Any, name: str) -> str:
    """A lock held now by a real acquire (as a worker's run takes it), for a minute; its key."""
    settings = settings_for(app)
    lock = Redlock(settings.nodes, f"{settings.prefix}{name}:v2:{uuid.uuid4().hex}", ttl=60.0)
    assert lock.acquire(blocking=False)
    return lock.name


def test_the_page_shown_after_a_release_refreshes_to_the_page_not_to_the_form(
    fresh_node: RedisServer, browser: Browser
) -> None:
    """After a release (a POST), the page's refresh loads the page again: it must not re-send the form (a reload of
    a POST's answer does), which repeated the release every few seconds, each a forced release or a refusal logged."""
    app = app_on(fresh_node, "reposted")
    key = hold(app, "app.task")
    posts: list[str] = []
    page = make_app(app, secret="s" * 20, refresh=1, doctor=False)

    def counting(environ: dict[str, Any], start: Any) -> Any:
        if environ.get("REQUEST_METHOD") == "POST":
            posts.append(environ.get("PATH_INFO", ""))
        return page(environ, start)

    with served(counting) as url:
        browser.open(url + "/")
        clicked = browser.evaluate(
            "(() => { const f = [...document.querySelectorAll('form.release')].find("
            f"f => f.key.value === {json.dumps(key)}); if (!f) return false;"
            f" f.secret.value = {json.dumps('s' * 20)}; f.querySelector('button').click(); return true; }})()"
        )
        assert clicked
        said = browser.wait_for("document.getElementById('message') && document.getElementById('message').innerText")
        assert "released" in str(said)
        browser.evaluate("document.activeElement && document.activeElement.blur()")
        back = browser.wait_for("location.pathname === '/' && document.readyState === 'complete'", 15)
    assert back
    assert posts == ["/release"]


def test_a_counter_never_goes_down_while_a_node_holding_some_of_its_counts_is_down(fresh_node: RedisServer) -> None:
    """Counts are written to the first node that answers and read summed over the nodes: with a node down, the
    sum is short. A counter must not then be exposed lower than before (Prometheus reads a decrease as a reset and
    counts the whole total again when the node is back): each count stays at least what a scrape showed."""
    other = RedisServer().start()
    try:
        app = Celery("countdown", broker="memory://", set_as_current=False)
        app.conf.singleton_lock_urls = [fresh_node.url, other.url]
        app.conf.singleton_lock_prefix = "countdown:"
        settings = settings_for(app)
        for client, n in ((fresh_node.client(), 3), (other.client(), 4)):  # flushes that went to either node
            pipe = client.pipeline(transaction=False)
            metrics.write(pipe, settings.prefix, {("app.t", "acquired"): n})
            pipe.execute()

        def scraped() -> list[float]:
            text = exposition(settings)
            families = {f.name: f for f in text_string_to_metric_families(text)}
            return [s.value for s in families["celery_lock_events"].samples if s.labels.get("task") == "app.t"]

        assert scraped() == [7.0]
        other.stop()
        assert scraped() == [7.0]
        pipe = fresh_node.client().pipeline(transaction=False)
        metrics.write(pipe, settings.prefix, {("app.t", "acquired"): 5})  # more runs meanwhile, on the node up
        pipe.execute()
        assert scraped() == [8.0]  # 3 + 5 read, never less than what was shown
        other.start()  # a fresh, empty server on the same port: the 4 it held are lost (no persistence here)
        assert scraped() == [8.0]
        fresh_node.client().delete(metrics.total_key(settings.prefix))  # every node answers: a real reset shows
        assert scraped() == []
    finally:
        other.close()


def test_a_stalled_node_costs_one_socket_timeout_per_request_not_one_per_read(fresh_node: RedisServer) -> None:
    """A node that holds every command (a stalled node, in front: it holds the lines) is found out once per page
    and per scrape: the reads that follow skip it instead of each waiting its socket timeout again (the page read
    it 3 times, /metrics 3 times: 1.5 s each with the default 0.5 s, 15 s with a 5 s timeout). Counted as the
    connections the stalled node was sent (each timeout drops its connection), not timed."""
    with FaultProxy(fresh_node.port) as proxy:
        app = Celery("stalled", broker="memory://", set_as_current=False)
        app.conf.singleton_lock_urls = [proxy.url, fresh_node.url]
        app.conf.singleton_lock_prefix = "stalled:"
        hold(app, "app.task")  # before the stall: a lock for the page to show
        page = make_app(app, refresh=0, doctor=False)
        proxy.hold()
        for path in ("/", "/metrics"):
            before = proxy.accepted
            statuses: list[str] = []
            environ = {"PATH_INFO": path, "REQUEST_METHOD": "GET", "wsgi.input": io.BytesIO(), "QUERY_STRING": ""}
            body = b"".join(page(environ, lambda status, _h, out=statuses: out.append(status))).decode()
            assert statuses == ["200 OK"], path
            assert ("did not answer" in body) if path == "/" else ("celery_lock_nodes_up 1" in body)
            assert proxy.accepted - before <= 1, path
        proxy.clear()


def test_the_page_links_of_a_release_answer_lead_to_the_page_not_to_the_release_url(fresh_node: RedisServer) -> None:
    """The answer to a release (a POST to /release) is the page, paged: its 'next' link was the relative
    ``?page=2``, which from /release is ``GET /release?page=2`` (405, POST only). Links name the page's own path."""
    from urllib.parse import urljoin, urlsplit  # noqa: PLC0415

    app = app_on(fresh_node, "navlinks")
    for _ in range(PAGE_SIZE + 1):
        hold(app, "app.task")
    page = make_app(app, secret="s" * 20, refresh=0, doctor=False)
    body_bytes = b"key=x&owner=y&secret=wrong"
    environ = {
        "PATH_INFO": "/release",
        "SCRIPT_NAME": "/locks",
        "REQUEST_METHOD": "POST",
        "wsgi.input": io.BytesIO(body_bytes),
        "CONTENT_LENGTH": str(len(body_bytes)),
        "QUERY_STRING": "",
    }
    statuses: list[str] = []
    body = b"".join(page(environ, lambda status, _h, out=statuses: out.append(status))).decode()
    assert statuses == ["403 Forbidden"]
    links = re.findall(r'<a href="([^"]*page=[^"]*)"', body)
    assert links
    for link in links:
        target = urlsplit(urljoin("http://127.0.0.1/locks/release", html.unescape(link)))
        assert (target.path, target.query) == ("/locks/", "page=2"), link
