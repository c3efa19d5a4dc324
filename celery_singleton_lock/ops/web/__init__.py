"""``celery -A app locks web``: one page showing locks, lines and the last hour; ``/metrics`` for Prometheus.

Both are plain WSGI apps (stdlib only: no framework, no new dependency), so the same page mounts in Django, Flask or
FastAPI (``WSGIMiddleware``) behind the host app's own auth, the way Sidekiq::Web and Oban Web are mounted::

    from celery_singleton_lock.web import make_app, metrics_app
    locks_page = make_app(celery_app)            # GET /  the page; POST /release; GET /metrics
    metrics = metrics_app(celery_app)            # GET    the Prometheus text alone

Everything is read from the lock nodes at each request (SCAN in batches, never KEYS; records read 200 keys per
script call), so the page shows what every worker and host did, and a node that is down or slow costs at most its
socket timeout and is reported by its redacted address. The page is read-only unless a *secret* is given: then each
held lock has a release form, and a release needs that secret in the form (typed by the operator: a forged cross-site
form cannot know it) or in the ``X-Lock-Secret`` header, a same-origin request (an ``Origin`` naming another host is
refused), and the owner the page showed (the release is owner-checked as ``celery locks release`` is: a lock taken
over since the page was drawn is left alone). Every value shown is escaped (task ids and keys are user data), a
Content-Security-Policy lets only the page's own script run, and no URL, password or holder token is shown.

The rooms: :mod:`.reading` (what a page shows, read from the nodes), :mod:`.render` (its HTML), :mod:`.prometheus`
(``/metrics``), :mod:`.release` (``POST /release`` behind the secret), :mod:`.listing` (``/locks.json`` by cursor),
:mod:`.calls` (a call typed on the page: its key and explanation) and :mod:`.app` (the routes and the server).
"""

from __future__ import annotations

from .app import make_app, metrics_app, serve
from .listing import list_page
from .prometheus import exposition
from .reading import PAGE_SIZE, Line, scan_lines
from .release import MIN_SECRET

__all__ = [
    "MIN_SECRET",
    "PAGE_SIZE",
    "Line",
    "exposition",
    "list_page",
    "make_app",
    "metrics_app",
    "scan_lines",
    "serve",
]
