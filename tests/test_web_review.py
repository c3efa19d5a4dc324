"""Adversarial review of issue 23 (metrics in Redis, /metrics, the locks page): each test failed before its fix.

One real redis-server for the module; the watchdog and the page run in this process against it.
"""

from __future__ import annotations

import contextlib
import html
import io
import json
import re
import threading
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery

from celery_singleton_lock import metrics
from celery_singleton_lock.config import settings_for
from celery_singleton_lock.faults import FaultProxy
from celery_singleton_lock.redlock import Redlock
from celery_singleton_lock.renewal import Watchdog
from celery_singleton_lock.testing import RedisServer, wait_for
from celery_singleton_lock.web import PAGE_SIZE, exposition, make_app, serve


@pytest.fixture(scope="module")
def server() -> Iterator[RedisServer]:
    with RedisServer() as r:
        yield r


def app_on(server: RedisServer, name: str) -> Any:
    app = Celery(name, broker="memory://", set_as_current=False)
    app.conf.singleton_lock_urls = [server.url]
    app.conf.singleton_lock_prefix = f"{name}:"
    return app


def test_a_flush_that_timed_out_on_a_paused_node_is_not_counted_twice(server: RedisServer) -> None:
    """A node paused (SIGSTOP) during a flush still runs what it was sent once it resumes: the watchdog must not
    both send the batch and keep it to write again (10 outcomes read 15 before the fix). Now the PING before the
    batch times out, nothing of the batch is sent, and it is written once, when the node answers (the watchdog's
    own tick, or the flush below)."""
    settings = settings_for(app_on(server, "flushtwice"))
    nodes, prefix = settings.nodes, settings.prefix
    watchdog = Watchdog()

    def acquired() -> int:
        return metrics.read_metrics(nodes, prefix).tasks.get("t", {}).get("acquired", 0)

    watchdog.count(nodes, prefix, "acquired", "t", 5)
    watchdog.flush_stats()  # (or the watchdog's own thread, started by count(), already is flushing)
    assert wait_for(lambda: acquired() >= 5, timeout=15, interval=0.05)
    watchdog.count(nodes, prefix, "acquired", "t", 5)
    server.pause()
    try:
        watchdog.flush_stats()  # the PING times out after socket_timeout: the batch is kept
    finally:
        server.resume()
    watchdog.flush_stats()
    assert wait_for(lambda: acquired() >= 10, timeout=15, interval=0.05)
    watchdog.flush_stats()
    assert acquired() == 10


def test_counts_flushed_while_the_first_node_is_stalled_land_on_the_next_node(server: RedisServer) -> None:
    """A first node that accepts connections but answers nothing (stalled, or blackholed) must not swallow every
    flush: a batch not yet sent goes to the next node that answers; only a batch sent and then timed out counts
    as written (the node may still run it)."""
    behind = RedisServer().start()
    try:
        with FaultProxy(behind.port) as proxy:
            app = Celery("stalledfirst", broker="memory://", set_as_current=False)
            app.conf.singleton_lock_urls = [proxy.url, server.url]
            app.conf.singleton_lock_prefix = "stalledfirst:"
            settings = settings_for(app)
            proxy.hold()
            watchdog = Watchdog()
            watchdog.count(settings.nodes, settings.prefix, "acquired", "t", 5)
            watchdog.flush_stats()  # (or the watchdog's own thread, started by count(), already is flushing)
            client, total = server.client(), metrics.total_key(settings.prefix)
            assert wait_for(lambda: client.hgetall(total) != {}, timeout=15, interval=0.05)
            assert client.hgetall(total) == {f"t{metrics.SEP}acquired".encode(): b"5"}
    finally:
        behind.close()


# -- the page in a real browser -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    from cdp import Browser, find_chromium  # noqa: PLC0415

    binary = find_chromium()
    if binary is None:  # under CI=true a failure: .ci/run installs chromium, so CI runs the browser tests
        import needs  # noqa: PLC0415

        needs.missing("no chromium on PATH: `apt-get install -y chromium` (Debian) runs them", "the browser tests")
    b = Browser(binary)
    try:
        yield b
    finally:
        b.close()


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


def hold(app: Any, name: str) -> str:
    """A lock held now by a real acquire (as a worker's run takes it), for a minute; its key."""
    settings = settings_for(app)
    lock = Redlock(settings.nodes, f"{settings.prefix}{name}:v2:{uuid.uuid4().hex}", ttl=60.0)
    assert lock.acquire(blocking=False)
    return lock.name


def test_the_page_shown_after_a_release_refreshes_to_the_page_not_to_the_form(
    server: RedisServer, browser: Any
) -> None:
    """After a release (a POST), the page's refresh loads the page again: it must not re-send the form (a reload of
    a POST's answer does), which repeated the release every few seconds, each a forced release or a refusal logged."""
    app = app_on(server, "reposted")
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


# -- /metrics -------------------------------------------------------------------------------------------------------


def test_a_counter_never_goes_down_while_a_node_holding_some_of_its_counts_is_down(server: RedisServer) -> None:
    """Counts are written to the first node that answers and read summed over the nodes: with a node down, the
    sum is short. A counter must not then be exposed lower than before (Prometheus reads a decrease as a reset and
    counts the whole total again when the node is back): each count stays at least what a scrape showed."""
    from prometheus_client.parser import text_string_to_metric_families  # noqa: PLC0415

    other = RedisServer().start()
    try:
        app = Celery("countdown", broker="memory://", set_as_current=False)
        app.conf.singleton_lock_urls = [server.url, other.url]
        app.conf.singleton_lock_prefix = "countdown:"
        settings = settings_for(app)
        for client, n in ((server.client(), 3), (other.client(), 4)):  # flushes that went to either node
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
        pipe = server.client().pipeline(transaction=False)
        metrics.write(pipe, settings.prefix, {("app.t", "acquired"): 5})  # more runs meanwhile, on the node up
        pipe.execute()
        assert scraped() == [8.0]  # 3 + 5 read, never less than what was shown
        other.start()  # a fresh, empty server on the same port: the 4 it held are lost (no persistence here)
        assert scraped() == [8.0]
        server.client().delete(metrics.total_key(settings.prefix))  # every node answers: a real reset shows
        assert scraped() == []
    finally:
        other.close()


def test_a_stalled_node_costs_one_socket_timeout_per_request_not_one_per_read(server: RedisServer) -> None:
    """A node that holds every command (a stalled node, in front: it holds the lines) is found out once per page
    and per scrape: the reads that follow skip it instead of each waiting its socket timeout again (the page read
    it 3 times, /metrics 3 times: 1.5 s each with the default 0.5 s, 15 s with a 5 s timeout). Counted as the
    connections the stalled node was sent (each timeout drops its connection), not timed."""
    with FaultProxy(server.port) as proxy:
        app = Celery("stalled", broker="memory://", set_as_current=False)
        app.conf.singleton_lock_urls = [proxy.url, server.url]
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


def test_the_page_links_of_a_release_answer_lead_to_the_page_not_to_the_release_url(server: RedisServer) -> None:
    """The answer to a release (a POST to /release) is the page, paged: its 'next' link was the relative
    ``?page=2``, which from /release is ``GET /release?page=2`` (405, POST only). Links name the page's own path."""
    from urllib.parse import urljoin, urlsplit  # noqa: PLC0415

    app = app_on(server, "navlinks")
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


# -- counts against a real worker -------------------------------------------------------------------------------------


def test_a_worker_stopped_right_after_a_storm_has_flushed_the_skips_its_main_process_counted(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """Duplicates skipped before the pool are counted in the worker's main process, whose watchdog flushes every
    5 s; only pool children flushed at exit. A worker stopped (warm) right after a storm lost those skips (2 of 20
    counted): the main process flushes at worker shutdown too. Counts equal the real outcomes."""
    from worker_cluster import cluster, new_key  # noqa: PLC0415

    with cluster(tmp_path_factory.mktemp("storm"), ttl=5.0) as c:
        worker = c.worker("storm", concurrency=2)
        mod = c.app_module()
        k = new_key()
        first = mod.work.delay(k, 3.0)
        c.wait_started(k)
        dupes = [mod.work.delay(k, 0.0) for _ in range(20)]
        for d in [first, *dupes]:
            d.get(timeout=60, propagate=False)
        runs = len(c.runs(k))
        worker.stop()
        settings = settings_for(mod.app)
        counted = metrics.read_metrics(settings.nodes, settings.prefix).tasks.get(mod.work.name, {})
        assert (counted.get("acquired"), counted.get("skipped", 0), counted.get("released")) == (runs, 21 - runs, runs)
