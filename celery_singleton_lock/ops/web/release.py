"""``POST /release``: a held lock released from the page, behind the release secret.

A release needs the secret (in the form, typed by the operator: a forged cross-site form cannot know it, or in the
``X-Lock-Secret`` header), a same-origin request, and the digest of the owner the page showed (owner-checked as
``celery locks release`` is: a lock taken over since the page was drawn is left alone). Wrong secrets are counted per
client address: past :data:`SECRET_TRIES` in :data:`SECRET_WINDOW` s, the client gets 429 before any comparison.
"""

from __future__ import annotations

import hmac
import logging
import math
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qs

from ...lock.config import LockSettings
from ...lock.inventory import release_lock, show_lock

logger = logging.getLogger("celery_singleton_lock.web")

#: The shortest secret accepted for releases (a short one could be guessed).
MIN_SECRET = 16
#: The request body read at most (a release form is a few hundred bytes).
MAX_BODY = 16 * 1024
#: Wrong release secrets a client address may send per ``SECRET_WINDOW`` s; then 429 until the oldest ages out.
SECRET_TRIES, SECRET_WINDOW = 5, 60.0
#: Client addresses whose wrong secrets are remembered at most (the oldest are forgotten first).
MAX_CLIENTS = 10_000


def owner_digest(owner: str | None) -> str:
    """What the page shows of a holder's owner token: a digest (the token itself is the holder's to release with)."""
    return "" if owner is None else hmac.new(b"celery_singleton_lock.web", owner.encode(), "sha256").hexdigest()[:32]


class Tries:
    """Wrong secrets per client address: at most ``limit`` in any ``window`` s, then :meth:`wait` says how long
    until one more is allowed. Bounded: the addresses seen longest ago are forgotten past :data:`MAX_CLIENTS`."""

    def __init__(self, limit: int, window: float) -> None:
        self.limit, self.window = limit, window
        self._failed: dict[str, list[float]] = {}
        self._lock = threading.Lock()

    def _recent(self, client: str, now: float) -> list[float]:
        kept = [t for t in self._failed.get(client, ()) if now - t < self.window]
        if kept:
            self._failed[client] = kept
        else:
            self._failed.pop(client, None)
        return kept

    def wait(self, client: str) -> float:
        """Seconds until ``client`` may try a secret again (0: now)."""
        now = time.monotonic()
        with self._lock:
            recent = self._recent(client, now)
            return 0.0 if len(recent) < self.limit else recent[-self.limit] + self.window - now

    def failed(self, client: str) -> None:
        """Count one wrong secret from ``client``."""
        now = time.monotonic()
        with self._lock:
            recent = self._recent(client, now)
            self._failed.pop(client, None)  # re-inserted last: the dict's order is the order of last failure
            self._failed[client] = [*recent, now][-self.limit :]
            while len(self._failed) > MAX_CLIENTS:
                del self._failed[next(iter(self._failed))]


def same_origin(environ: Mapping[str, Any]) -> bool:
    """False for a request a browser marks as sent from another site (``Origin`` or ``Sec-Fetch-Site``)."""
    if environ.get("HTTP_SEC_FETCH_SITE", "same-origin") not in ("same-origin", "none"):
        return False
    origin = environ.get("HTTP_ORIGIN")
    if origin is None:
        return True
    host = environ.get("HTTP_HOST") or f"{environ.get('SERVER_NAME', '')}:{environ.get('SERVER_PORT', '')}"
    return origin in (f"http://{host}", f"https://{host}")


@dataclass(frozen=True)
class Refusal:
    """A release not done: the HTTP status and why (shown on the page; ``plain``: as a text answer instead, with
    ``retry_after`` s to wait)."""

    status: str
    why: str
    plain: bool = False
    retry_after: float = 0.0


def authorise(environ: Mapping[str, Any], secret: str | None, tries: Tries) -> Refusal | dict[str, list[str]]:
    """The release form of a request allowed to release (method, secret, origin, size and tries checked), or why
    not. A client out of tries is refused before the comparison: it learns nothing, even from the right secret."""
    if environ.get("REQUEST_METHOD") != "POST":
        return Refusal("405 Method Not Allowed", "POST only\n", plain=True)
    if secret is None:
        return Refusal("403 Forbidden", "releasing is off (no secret configured); the page is read-only")
    if not same_origin(environ):
        return Refusal("403 Forbidden", "the request came from another site")
    try:
        size = int(environ.get("CONTENT_LENGTH") or 0)
    except ValueError:
        size = 0
    if size > MAX_BODY:
        return Refusal("413 Payload Too Large", "request too large")
    form = parse_qs(environ["wsgi.input"].read(size).decode("utf-8", "replace")) if size > 0 else {}
    given = environ.get("HTTP_X_LOCK_SECRET") or form.get("secret", [""])[0]
    client = str(environ.get("REMOTE_ADDR", "?"))
    wait = tries.wait(client)
    if wait > 0:
        logger.warning("locks web: release refused (too many wrong secrets) from %s", client)
        why = f"too many wrong secrets from {client}: try again in {math.ceil(wait)} s\n"
        return Refusal("429 Too Many Requests", why, plain=True, retry_after=wait)
    if not hmac.compare_digest(given.encode("utf-8", "surrogateescape"), secret.encode("utf-8")):
        tries.failed(client)
        return Refusal("403 Forbidden", "wrong or missing secret")
    return form


def release_shown(settings: LockSettings, form: Mapping[str, list[str]], client: str) -> Refusal | str:
    """Release the key the form names if its owner is still the one the page showed (on the nodes holding that
    owner's record only); what the page says, or why not."""
    key, owner = form.get("key", [""])[0], form.get("owner", [""])[0]
    if not key or not owner:
        return Refusal("400 Bad Request", "name the key and the owner shown")
    if not key.startswith(settings.prefix):
        # The page shows only this prefix's keys: it releases nothing else (another app's lock on shared nodes).
        return Refusal("400 Bad Request", "not a key under this app's prefix")
    info, states = show_lock(settings, key).value
    if info is None or info.owner is None or not hmac.compare_digest(owner_digest(info.owner), owner):
        return Refusal("409 Conflict", f"{key} changed since the page was read (another holder, or free)")
    only = [s if s is not None and s.owner == info.owner else None for s in states]
    report = release_lock(settings, key, only)
    done = sum(r.outcome == "released" for r in report.value)
    logger.warning(
        "forced release of lock %s (%s %s[%s]) from the web page by %s: released on %d of %d node(s)",
        key,
        info.state,
        info.task_name or "?",
        info.task_id or "?",
        client,
        done,
        len(report.value),
    )
    return f"released {key} on {done} of {len(report.value)} node(s)"
