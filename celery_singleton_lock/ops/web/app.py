"""The WSGI apps: the page's routes (``/``, ``/release``, ``/locks.json``, ``/explain``, ``/metrics``, the health
probes), the answers' security headers, the Host check and the stdlib server ``locks web`` runs."""

from __future__ import annotations

import json
import logging
import math
import secrets
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any, cast
from urllib.parse import parse_qs, urlencode

from ...errors import ConfigurationError
from ...lock.config import LockSettings, settings_for
from ...lock.metrics import read_minutes
from ..doctor import Finding, run_doctor
from ..health import route as health_route
from .calls import explained, explanation_json, key_of_call
from .listing import JSON_LIMIT, JSON_MAX_LIMIT, cursor_key, limit_of, list_page, public
from .prometheus import exposition
from .reading import down_nodes, snapshot
from .release import MIN_SECRET, SECRET_TRIES, SECRET_WINDOW, Refusal, Tries, authorise, release_shown
from .render import render, render_explain_page, render_explanation

logger = logging.getLogger("celery_singleton_lock.web")

StartResponse = Callable[[str, list[tuple[str, str]]], Any]
WSGIApp = Callable[[dict[str, Any], StartResponse], Iterable[bytes]]
TEXT = "text/plain; charset=utf-8"

SECURITY_HEADERS = [
    ("X-Content-Type-Options", "nosniff"),
    # Not "no-referrer": with it a browser sends "Origin: null" on the page's own form posts (refused as cross-site).
    ("Referrer-Policy", "same-origin"),
    ("X-Frame-Options", "DENY"),
    ("Cache-Control", "no-store"),
]


def _csp(nonce: str) -> str:
    return (
        "default-src 'none'; style-src 'unsafe-inline'; img-src data:; "
        f"script-src 'nonce-{nonce}'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'"
    )


def _respond(
    start: StartResponse,
    status: str,
    body: str,
    kind: str = "text/html; charset=utf-8",
    nonce: str = "",
    retry_after: float = 0.0,
) -> list[bytes]:
    data = body.encode("utf-8", "surrogateescape")
    headers = [("Content-Type", kind), ("Content-Length", str(len(data))), *SECURITY_HEADERS]
    if retry_after > 0:
        headers.append(("Retry-After", str(math.ceil(retry_after))))
    headers.append(("Content-Security-Policy", _csp(nonce or secrets.token_urlsafe(8))))
    start(status, headers)
    return [data]


def _settings_of(source: Any) -> Callable[[], LockSettings]:
    if isinstance(source, LockSettings):
        return lambda: source
    return lambda: settings_for(source)


def metrics_app(app: Any) -> WSGIApp:
    """A WSGI app answering every GET with the Prometheus text (:func:`exposition`) of ``app`` (a Celery app)."""
    settings = _settings_of(app)

    def metrics(environ: dict[str, Any], start: StartResponse) -> Iterable[bytes]:
        if environ.get("REQUEST_METHOD", "GET") not in ("GET", "HEAD"):
            return _respond(start, "405 Method Not Allowed", "GET only\n", "text/plain; charset=utf-8")
        return _respond(start, "200 OK", exposition(settings()), "text/plain; version=0.0.4; charset=utf-8")

    return metrics


def make_app(
    app: Any,
    *,
    secret: str | None = None,
    refresh: float = 5.0,
    doctor: bool = True,
    doctor_every: float = 60.0,
    allowed_hosts: Sequence[str] | None = None,
) -> WSGIApp:
    """The page as a WSGI app: ``GET /`` the page (``?page=N``), ``GET /metrics`` the Prometheus text, ``POST
    /release`` (only with ``secret``, at least :data:`MIN_SECRET` characters), ``GET /explain`` and
    ``/explain.json`` (``?key=``, or a call ``?task=&args=&kwargs=``: ``celery locks explain``'s answer). ``app``
    is the Celery app;
    ``doctor``: show ``celery locks doctor``'s findings, run at most every ``doctor_every`` s. ``allowed_hosts``:
    the host names (without port) a request's ``Host`` may name, others get 403 (``locks web`` on a loopback
    address passes the loopback names: a site re-resolving its name to 127.0.0.1, DNS rebinding, cannot read the
    page); None (mounted in a host app): any, the host app checks."""
    if secret is not None and len(secret) < MIN_SECRET:
        raise ConfigurationError(f"locks web: the release secret must be at least {MIN_SECRET} characters long")
    hosts = None if allowed_hosts is None else frozenset(h.lower() for h in allowed_hosts)
    return _Site(app, secret, refresh, doctor_every if doctor else None, hosts).wsgi


class _Site:
    """One mounted page: the Celery app, the release secret, the doctor's cached findings and the wrong secrets
    counted, answering each route."""

    def __init__(
        self, app: Any, secret: str | None, refresh: float, doctor_every: float | None, hosts: frozenset[str] | None
    ) -> None:
        self.app, self.secret, self.refresh, self.doctor_every, self.hosts = app, secret, refresh, doctor_every, hosts
        self.settings = _settings_of(app)
        self.metrics = metrics_app(app)
        self.tries = Tries(SECRET_TRIES, SECRET_WINDOW)
        self._guard = threading.Lock()
        self._doctor_at = 0.0
        self._findings: list[Finding] | None = None

    def wsgi(self, environ: dict[str, Any], start: StartResponse) -> Iterable[bytes]:
        """Route a request (after the Host check)."""
        path = environ.get("PATH_INFO", "/") or "/"
        if self.hosts is not None and _host_name(environ.get("HTTP_HOST", "")) not in self.hosts:
            logger.warning("locks web: refused a request for host %r", environ.get("HTTP_HOST", "")[:100])
            return _respond(start, "403 Forbidden", "unknown host\n", TEXT)
        probe = health_route(path, self.settings)
        if probe is not None:
            return probe(environ, start)
        if path in ("/", ""):
            return self.page(environ, start)
        if path == "/metrics":
            return self.metrics(environ, start)
        if path == "/release":
            return self.release(environ, start)
        if path == "/locks.json":
            return self.locks_json(environ, start)
        if path in ("/explain", "/explain.json"):
            return self.explain(environ, start, as_json=path.endswith(".json"))
        return _respond(start, "404 Not Found", "not found\n", TEXT)

    def findings(self) -> list[Finding] | None:
        """The doctor's findings, run again once they are ``doctor_every`` s old (None: the doctor is off)."""
        if self.doctor_every is None:
            return None
        with self._guard:
            if self._findings is None or time.monotonic() - self._doctor_at > self.doctor_every:
                try:
                    self._findings = run_doctor(self.app, timeout=2.0)
                except Exception as exc:  # the page still shows the locks
                    logger.debug("locks web: the doctor failed", exc_info=True)
                    self._findings = [Finding("error", "doctor", "app", f"the doctor failed: {type(exc).__name__}")]
                self._doctor_at = time.monotonic()
            return self._findings

    def page(
        self, environ: dict[str, Any], start: StartResponse, message: str = "", status: str = "200 OK"
    ) -> list[bytes]:
        """The page (``?page=``, ``?q=`` a search, or ``?task=&args=&kwargs=`` a call: its key and explanation)."""
        query = parse_qs(environ.get("QUERY_STRING", ""))
        try:
            number = int(query.get("page", ["1"])[0])
        except ValueError:
            number = 1
        current = self.settings()
        base = environ.get("SCRIPT_NAME", "").rstrip("/")
        search = query.get("q", [""])[0].strip()[:200]
        call = (query.get("task", [""])[0].strip()[:200], query.get("args", ["[]"])[0], query.get("kwargs", ["{}"])[0])
        explanation = ""
        if call[0]:
            search, why = key_of_call(self.app, *call)
            message = message or why
            found = explained(self.app, query)[0] if search != "\x00" else None
            if found is not None:
                asked = urlencode({"task": call[0], "args": call[1], "kwargs": call[2]})
                explanation = render_explanation(found, time.time(), base, asked)
        snap = snapshot(current, number, search)
        span, per_task, _ = read_minutes(current.nodes, current.prefix, 60, skip=down_nodes(current, snap))
        nonce = secrets.token_urlsafe(16)
        body = render(
            snap,
            page=number,
            series=(span, per_task),
            findings=self.findings(),
            base=base,
            release=self.secret is not None,
            refresh=self.refresh,
            nonce=nonce,
            prefix=current.prefix,
            message=message,
            reload_to=f"{base}/" if environ.get("REQUEST_METHOD") == "POST" else None,
            search=search,
            call=call,
            explanation=explanation,
        )
        return _respond(start, status, body, nonce=nonce)

    def release(self, environ: dict[str, Any], start: StartResponse) -> list[bytes]:
        """``POST /release`` (:mod:`.release`): the page again, saying what was released or why not."""
        client = str(environ.get("REMOTE_ADDR", "?"))
        form = authorise(environ, self.secret, self.tries)
        done = form if isinstance(form, Refusal) else release_shown(self.settings(), form, client)
        if isinstance(done, str):
            return self.page(environ, start, done)
        if done.plain:
            return _respond(start, done.status, done.why, TEXT, retry_after=done.retry_after)
        logger.warning("locks web: release refused (%s) from %s", done.why, client)
        return self.page(environ, start, f"not released: {done.why}", done.status)

    def locks_json(self, environ: dict[str, Any], start: StartResponse) -> list[bytes]:
        """``GET /locks.json`` (:mod:`.listing`): a page of locks by key, and the cursor of the next."""
        query = parse_qs(environ.get("QUERY_STRING", ""), keep_blank_values=True)
        try:
            after = cursor_key(query.get("cursor", [""])[0])
            limit = limit_of(query.get("limit", [str(JSON_LIMIT)])[0])
        except ValueError:
            why = f"cursor must be a 'next' this endpoint returned, limit a number from 1 to {JSON_MAX_LIMIT}"
            return _respond(start, "400 Bad Request", json.dumps({"error": why}), "application/json")
        found = list_page(self.settings(), after, limit)
        data = {
            "locks": [public(i.to_json(time.time())) for i in found.value[0]],
            "next": found.value[1],
            "limit": limit,
            "errors": [f"{x.node}: {x.error}" for x in found.errors],
        }
        return _respond(start, "200 OK", json.dumps(data), "application/json")

    def explain(self, environ: dict[str, Any], start: StartResponse, *, as_json: bool) -> list[bytes]:
        """``GET /explain`` and ``/explain.json`` (:mod:`.calls`): ``locks explain`` of a key or a call."""
        query = parse_qs(environ.get("QUERY_STRING", ""))
        found, why = explained(self.app, query)
        status = "200 OK" if found is not None else "400 Bad Request"
        if as_json:
            data = {"error": why} if found is None else explanation_json(found, time.time())
            return _respond(start, status, json.dumps(data), "application/json")
        base = environ.get("SCRIPT_NAME", "").rstrip("/")
        return _respond(start, status, render_explain_page(found, why, base, query))


def _host_name(host: str) -> str:
    """The name in a ``Host`` header, without its port (``[::1]:8089`` -> ``[::1]``)."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[: host.find("]") + 1] if "]" in host else host
    return host.rsplit(":", 1)[0] if ":" in host else host


def serve(wsgi: WSGIApp, host: str = "127.0.0.1", port: int = 8089) -> Any:
    """A threaded stdlib WSGI server for ``wsgi`` (``serve_forever()`` it; ``server_address`` has the port)."""
    from socketserver import ThreadingMixIn  # noqa: PLC0415
    from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server  # noqa: PLC0415

    class Server(ThreadingMixIn, WSGIServer):
        daemon_threads = True

    class Quiet(WSGIRequestHandler):
        def log_message(self, format: str, *args: Any) -> None:
            logger.info("%s %s", self.address_string(), format % args)

    return make_server(host, port, cast(Any, wsgi), server_class=Server, handler_class=Quiet)
