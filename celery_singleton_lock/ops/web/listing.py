"""``/locks.json``: every lock by key, a page at a time, after a cursor naming the last key shown (no owner token)."""

from __future__ import annotations

import base64
import bisect
import hashlib
from collections.abc import Sequence
from typing import Any

from ...lock.config import LockSettings
from ...lock.inventory import LockInfo, Report, merge, read_burst, read_keys, scan_bursts, scan_keys
from ...lock.record import burst_key_for

#: ``/locks.json``: locks per page unless ``?limit=`` says, and the most a page may ask for.
JSON_LIMIT, JSON_MAX_LIMIT = 500, 5000
#: The longest ``?cursor=`` taken (a cursor is a key, base64: keys are bounded, see docs/keys.md).
MAX_CURSOR = 8192
#: Characters of a key a cursor carries; a longer key is named by them and a digest.
CURSOR_KEY = 1024


def cursor_key(cursor: str) -> tuple[str, str]:
    """What a ``/locks.json`` cursor names: the last key of the page before, or for a key longer than
    :data:`CURSOR_KEY` characters its first ones and a digest of it (``(head, digest)``; ``("", "")``: from the
    first key). Any key is a valid place to start (the next page is the keys after it), so a cursor made up by hand
    can only move where the listing starts, never past the prefix."""
    if not cursor:
        return "", ""
    if len(cursor) > MAX_CURSOR:
        raise ValueError(cursor)
    text, _, digest = cursor.partition(".")
    try:
        raw = text.encode("ascii") + b"=" * (-len(text) % 4)
        return base64.b64decode(raw, altchars=b"-_", validate=True).decode("utf-8"), digest
    except (ValueError, UnicodeError):  # binascii.Error is a ValueError
        raise ValueError(cursor) from None


def _digest(key: str) -> str:
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()[:24]


def cursor_of(key: str) -> str:
    """The cursor after ``key``: the key itself (base64), or past :data:`CURSOR_KEY` characters (a URL has a
    bounded length) its first ones and a digest of the whole."""
    head = key[:CURSOR_KEY]
    text = base64.urlsafe_b64encode(head.encode("utf-8", "surrogatepass")).decode("ascii").rstrip("=")
    return text if head == key else f"{text}.{_digest(key)}"


def _start(keys: Sequence[str], head: str, digest: str) -> int:
    """Where the page after the cursor ``(head, digest)`` starts in the sorted ``keys``."""
    if not digest:
        return bisect.bisect_right(keys, head)
    at = bisect.bisect_left(keys, head)
    for i in range(at, len(keys)):  # the long keys sharing those first characters, in order
        if not keys[i].startswith(head):
            break
        if _digest(keys[i]) == digest:
            return i + 1
    return at  # the key is gone: start at its first characters (a key may be listed twice, none is missed)


def limit_of(text: str) -> int:
    """``?limit=``: a whole number from 1 to :data:`JSON_MAX_LIMIT` (ValueError otherwise)."""
    limit = int(text.strip()[:8])
    if not 1 <= limit <= JSON_MAX_LIMIT:
        raise ValueError(text)
    return limit


def list_page(settings: LockSettings, after: tuple[str, str], limit: int) -> Report[tuple[list[LockInfo], str | None]]:
    """The ``limit`` keys after the cursor ``after`` (:func:`cursor_key`), by key (done markers and pending
    bursts included), read and merged, and the cursor of the next page (None: this was the last). Only the page's
    keys are read in full."""
    scanned = scan_keys(settings, done=True)
    down = [settings.nodes.names.index(x.node) for x in scanned.errors]
    bursts = scan_bursts(settings, skip=down)
    pending = {burst_key_for(k): k for k in bursts.value}
    keys = sorted({k for k in scanned.value if k not in pending and not k.endswith(":debounce")} | set(pending))
    at = _start(keys, *after) if after[0] else 0
    shown = keys[at : at + limit]
    read = read_keys(settings, [k for k in shown if k not in pending], skip=down)
    infos: list[LockInfo] = []
    for key in shown:
        if key in pending:
            info = read_burst(settings, pending[key])
        else:
            info = merge(key, read.value[key], settings.nodes.quorum, prefix=settings.prefix)
        if info is not None:
            infos.append(info)
    more = cursor_of(shown[-1]) if at + limit < len(keys) and shown else None
    errors = scanned.errors + bursts.errors + read.errors
    return Report((infos, more), errors, len(settings.nodes), settings.nodes.quorum)


def public(data: dict[str, Any]) -> dict[str, Any]:
    """A lock's JSON without its owner token (the holder's own secret for release and renewal)."""
    data = dict(data)
    data.pop("owner", None)
    data.pop("record", None)
    return data
