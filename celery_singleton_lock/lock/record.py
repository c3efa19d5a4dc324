"""The holder record: the one vocabulary of the lock's data in Redis.

A lock key holds a hash, the *holder record*: who holds it (``owner``, a random token fresh for every attempt), its
fencing token, and what LockedTask (or beat, or your own code through ``Redlock(record=...)``) wrote about the
holder. The scripts (``lua/``), ``decide``, the CLI and the doctor all read these names from here. The keys beside
a lock key (fencing counter, done markers, waiting line, ...) are named by the functions below, each in the lock
key's Redis Cluster slot. docs/protocol.md is the written form of all of it (tests/project/test_protocol_doc.py holds
the
two together).
"""

from __future__ import annotations

import functools
from binascii import crc_hqx
from collections.abc import Iterable, Sequence
from typing import Any, Final

from redis.crc import key_slot

__all__ = [
    "COOLDOWN",
    "ENDING",
    "FIELDS",
    "F_ARGS",
    "F_AT",
    "F_CANCEL",
    "F_DUE",
    "F_FENCE",
    "F_FIRST",
    "F_JOB",
    "F_NAME",
    "F_OPEN",
    "F_OWNER",
    "F_PREV",
    "F_SENT",
    "F_SEQ",
    "F_SINCE",
    "F_STATE",
    "F_TRY",
    "F_TURN_AHEAD",
    "F_TURN_COUNT",
    "F_TURN_JOINED",
    "F_TURN_LAST",
    "F_TURN_NOW",
    "F_TURN_PARKS",
    "F_TURN_SCORE",
    "F_TURN_STARTS",
    "F_TURN_VALUE",
    "F_WAITING",
    "F_WORKER",
    "HANDED",
    "HANDOVER",
    "QUEUED",
    "RUNNING",
    "SENDING",
    "STATES",
    "burst_key_for",
    "cancels_key_for",
    "claimed_key_for",
    "done_key_for",
    "fence_key_for",
    "fence_key_in_slot",
    "limits_key_for",
    "newest_run_key_for",
    "record_of",
    "sibling_key",
    "slot_keys",
]

# -- states (the ``state`` field) --------------------------------------------------------------------------------
#: A delivery holds the lock and runs the body (LockedTask's acquire).
RUNNING = "run"
#: Handed over by ``self.retry()`` to the retry's delivery of the same task id, which takes it over.
HANDOVER = "retry"
#: A run that is being ended (hard time limit) or a reservation being freed: held ~1 s by nobody's renewals.
ENDING = "ending"
#: A finished run's record kept for ``lock_cooldown`` seconds: the next run of the key waits for it to expire.
COOLDOWN = "cooldown"
#: Queue scope: a reservation whose message was sent; the delivery of that task id takes it over.
QUEUED = "queued"
#: Queue scope: a reservation whose message is being published (it becomes QUEUED once it was sent).
SENDING = "sending"
#: ``lock_on_duplicate="cancel"``: handed by a run a newer call stopped to the newest call waiting in the key's line,
#: whose woken copy (that task id) takes it over.
HANDED = "handed"
#: Every state a holder record's ``state`` field may hold (a record without one: beat's claims, your own locks).
STATES = (RUNNING, HANDOVER, ENDING, COOLDOWN, QUEUED, SENDING, HANDED)

# -- fields ------------------------------------------------------------------------------------------------------
F_OWNER = "owner"  #: the holder's random token: only a script given it extends, hands over or releases the record
F_FENCE = "fence"  #: the fencing token of the lease (0 for a lock without fencing tokens)
F_JOB = "job"  #: the task id (job) holding the lock; a copy of the same job is never skipped as its duplicate
F_STATE = "state"  #: one of STATES
F_TRY = "try"  #: the holder's ``request.retries`` (which try of the job holds it)
F_WORKER = "worker"  #: ``<pid>@<host>`` of the process that wrote the record
F_NAME = "name"  #: the task's name
F_AT = "at"  #: when the record was written, Unix ms
F_OPEN = "open"  #: '1': handed over for this job's next delivery, whose refused acquire must not mark it waiting
F_WAITING = "waiting"  #: '1': a copy of the holder's job waits for it (the done marker then lives longer)
F_CANCEL = "cancel"  #: lock_on_duplicate="cancel": the task id of the newer call that asks this running job to stop
F_SINCE = "since"  #: lock_on_duplicate="cancel": when the holder's call first reached a worker (ms): who is newer
F_PREV = "_prev"  #: a record taken over, JSON [fields, absolute expiry ms], so an undo can put it back
# A pending debounced burst (``burst_key_for``: lock_debounce) has ``job``, ``name``, ``at`` and these:
F_FIRST = "first"  #: a burst: when its first call joined (the node's Unix ms)
F_DUE = "due"  #: a burst: when its job runs (the node's Unix ms), unless another call joins first
F_SEQ = "seq"  #: a burst: how many calls joined it (its last call's number)
F_ARGS = "args"  #: a burst: its last call's arguments, JSON ``[args, kwargs]``
F_SENT = "sent"  #: a burst: '0' until its job's message was published, then when it was (last) published (node ms)
F_EXP = "exp"  #: a burst: its last call's expiry (Unix ms; 0: none): a re-send carrying its arguments expires then
F_HIST = "hist"  #: a burst: its last 16 versions (calls), JSON ``[[n, call id, args, due, expires], ...]``
# A fair line's turns (lock_fair_on: lua/park_fair.lua); a prefix field is followed by a value or a task id.
F_TURN_NOW = "now"  #: the turn served last
F_TURN_PARKS = "parks"  #: how many jobs parked (their order within a turn)
F_TURN_LAST = "last:"  #: + value: the value's last turn
F_TURN_COUNT = "n:"  #: + value: its jobs parked and not yet run
F_TURN_SCORE = "s:"  #: + task id: the job's score in the line, until it runs
F_TURN_VALUE = "v:"  #: + task id: the job's value, until it runs
F_TURN_STARTS = "starts"  #: how many starts the line counted (a call's turns waited)
F_TURN_JOINED = "p:"  #: + task id: the starts counted when the job first parked, until it runs
F_TURN_AHEAD = "k:"  #: + task id: its value's jobs waiting when it first parked, until it runs

#: Every field a holder record (or a pending burst, or a fair line's turns) may have.
FIELDS = (
    F_OWNER,
    F_FENCE,
    F_JOB,
    F_STATE,
    F_TRY,
    F_WORKER,
    F_NAME,
    F_AT,
    F_OPEN,
    F_WAITING,
    F_CANCEL,
    F_SINCE,
    F_PREV,
    F_FIRST,
    F_DUE,
    F_SEQ,
    F_TURN_NOW,
    F_TURN_PARKS,
    F_TURN_LAST,
    F_TURN_COUNT,
    F_TURN_SCORE,
    F_TURN_VALUE,
    F_TURN_STARTS,
    F_TURN_JOINED,
    F_TURN_AHEAD,
    F_ARGS,
    F_SENT,
    F_EXP,
    F_HIST,
)

# -- keys --------------------------------------------------------------------------------------------------------


def slot_keys(name: str, limit: int) -> tuple[str, ...]:
    """The keys of a lock with ``limit`` slots: ``name`` itself, then ``name:slot:<i>`` in ``name``'s Cluster slot.

    The slot keys start with ``name`` (so a SCAN of the prefix finds them). A name with a hash tag keeps it; one
    without gets a tag of the same Cluster slot at the end (``name:slot:1{<n>}``, see :func:`fence_key_in_slot`).
    """
    if limit <= 1:
        return (name,)
    start = name.find("{")
    end = name.find("}", start + 1) if start != -1 else -1
    if end > start + 1:
        return (name, *(f"{name}:slot:{i}" for i in range(1, limit)))
    if "{" in name:  # a brace that is no tag: the sibling form, tag in front
        return (name, *(sibling_key(name, f":slot:{i}") for i in range(1, limit)))
    tag = f"{{{_slot_twin(_key_slot(name))}}}"
    return (name, *(f"{name}:slot:{i}{tag}" for i in range(1, limit)))


def fence_key_for(key: str) -> str:
    """The fencing counter's key: in the same Redis Cluster slot as ``key``."""
    return sibling_key(key, ":fence")


def done_key_for(key: str, job: str) -> str:
    """The key that marks ``job`` finished under lock ``key`` (see ``Redlock.finish``): in the same slot as ``key``."""
    return sibling_key(key, f":done:{job}")


def burst_key_for(key: str) -> str:
    """The pending debounced burst of lock ``key`` (``lock_debounce``): in the same slot as ``key``."""
    return sibling_key(key, ":debounce")


def claimed_key_for(key: str, job: str) -> str:
    """The arguments a debounced ``job`` claimed from its burst (its later copies read them): same slot as ``key``."""
    return sibling_key(key, f":debounced:{job}")


def newest_run_key_for(key: str) -> str:
    """The newest version of ``key``'s debounced calls that ran (its stamp, job, arguments): same slot as ``key``."""
    return sibling_key(key, ":debounced-ran")


def cancels_key_for(prefix: str) -> str:
    """The pending durable cancels (``LockedTask.cancel``, ``locks cancel``): a sorted set of JSON
    ``[lock key, task id, by]`` scored by the cancel's expiry (Unix ms): what ``locks list`` shows (a listing only:
    the done marker of the job is the cancel itself)."""
    return f"{prefix}cancels"


#: A done marker holding a durable cancel starts with this (``cancel:<who> at <when>``); a finished job's holds "1".
#: A marker's value, not a state or a field of the holder record (docs/protocol.md, the done marker).
DURABLE: Final = "cancel:"


def durable_marker(clients: Sequence[Any], key: str, task_id: str) -> str | None:
    """The durable cancel (``cancel:...``) the done marker of ``task_id`` holds on one of ``clients``, else None
    (the job finished, or nothing answers). A client that errs says nothing: the others answer."""
    marker = done_key_for(key, task_id)
    for client in clients:
        try:
            value = client.get(marker)
        except Exception:  # noqa: S112 - the others answer
            continue
        text = value.decode() if isinstance(value, bytes) else value
        if isinstance(text, str) and text.startswith(DURABLE):
            return text
    return None


def pending_cancels(clients: Sequence[Any], prefix: str) -> list[tuple[str, str, str, float]]:
    """The durable cancels still pending, read from ``clients`` (the nodes to ask: the page leaves out the ones that
    did not answer its scan): ``(lock key, task id, by, expires at Unix s)``, whose job's done marker still holds the
    cancel on some node (one that ended since, or expired, is dropped from the listing)."""
    import json  # noqa: PLC0415 - a listing's only
    import time  # noqa: PLC0415

    now = int(time.time() * 1000)
    found: dict[tuple[str, str], tuple[str, float]] = {}
    for client in clients:
        try:
            client.zremrangebyscore(cancels_key_for(prefix), "-inf", now)
            rows = client.zrange(cancels_key_for(prefix), 0, -1, withscores=True)
        except Exception:  # noqa: S112 - the others answer
            continue
        for raw, score in rows:
            try:
                key, task_id, mark = json.loads(raw)
            except (ValueError, TypeError):
                continue
            if (key, task_id) not in found or found[(key, task_id)][1] < score:
                found[(key, task_id)] = (mark, score / 1000.0)
    out = []
    for (key, task_id), (mark, expires) in sorted(found.items()):
        if durable_marker(clients, key, task_id) is not None:
            out.append((key, task_id, mark[len(DURABLE) :], expires))
    return out


def limits_key_for(prefix: str, space: str) -> str:
    """The limits a task (or ``lock_group``) with a callable ``lock_limit`` has used: a sorted set, each limit scored by
    itself, so a copy of a job looks at every slot it may hold, however the limit changed since (one key per task)."""
    return f"{prefix}limits:{space}"


def sibling_key(key: str, suffix: str) -> str:
    """``key`` + ``suffix``, hashed to the same Redis Cluster slot as ``key`` whatever ``suffix`` holds.

    A key carrying a hash tag (``{...}`` with a non-empty body) keeps it; a key without one becomes the tag, so
    both keys hash to the same slot either way. Cluster reads only the *first* ``{`` and the first ``}`` after it
    (an empty ``{}`` there means no tag at all), so a tagless key that contains ``}`` cannot be a tag: its sibling
    is tagged with a short string of the same slot instead.
    """
    start = key.find("{")
    end = key.find("}", start + 1) if start != -1 else -1
    if end > start + 1:
        return f"{key}{suffix}"
    # No tag (an empty "{}" first counts as none: Cluster then hashes the whole key, it looks for no later tag).
    if "}" not in key:
        return f"{{{key}}}{suffix}"
    return f"{{{_slot_twin(key_slot(key.encode()))}}}{key}{suffix}"


@functools.lru_cache(maxsize=1024)
def _slot_twin(slot: int) -> str:
    """The smallest decimal number whose text hashes to ``slot`` (every slot has one below 110,000)."""
    for n in range(1 << 17):
        if crc_hqx(str(n).encode(), 0) % 16384 == slot:  # Cluster's slot of a key without braces
            return str(n)
    raise AssertionError(f"no decimal hash tag for Cluster slot {slot}")  # pragma: no cover - checked exhaustively


def _key_slot(key: str) -> int:
    """The Redis Cluster slot of ``key`` (its hash tag's, if it has one)."""
    return key_slot(key.encode("utf-8", "surrogatepass"))


def fence_key_in_slot(key: str, name: str) -> str:
    """``key``, or when it hashes to another Redis Cluster slot than ``name``, a key of its own in ``name``'s slot.

    The fencing counter a prefix shares (``<prefix>fence``) is one key: on a Cluster, a lock name without a hash
    tag lives in another slot, and a script may only touch keys of one slot. There the counter becomes one per
    slot, ``fence_key_for(key + "{<n>}")`` (``n`` the smallest number hashing to ``name``'s slot): at most 16,384
    counters, each shared by the names of its slot, so tokens still grow strictly per name. A key with a ``{``
    gets the tag in front instead (``{<n>}<key>:fence``), as a tag must be the key's first ``{...}``.
    """
    slot = _key_slot(name)
    if _key_slot(key) == slot:
        return key
    tag = f"{{{_slot_twin(slot)}}}"
    return fence_key_for(f"{tag}{key}" if "{" in key else f"{key}{tag}")


# -- reading records ---------------------------------------------------------------------------------------------


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def record_of(flat: Sequence[Any]) -> dict[str, str]:
    """A holder record from a script's flat field/value array (``HGETALL``'s reply in RESP2)."""
    return {_text(flat[i]): _text(flat[i + 1]) for i in range(0, len(flat) - 1, 2)}


#: The fields of a refused acquire's answer, in the order acquire.lua sends them.
_BRIEF_FIELDS = (F_OWNER, F_JOB, F_STATE, F_TRY, F_WORKER)


def _prefixed(blob: bytes | str) -> list[str]:
    """The values of ``<length>:<value>...`` (lengths in bytes, so values may hold any character)."""
    data = blob.encode("utf-8", "surrogatepass") if isinstance(blob, str) else blob
    out: list[str] = []
    i = 0
    if data.isascii():  # one byte a character (ids, names, numbers: the usual record): slice the text
        text = data.decode("ascii")
        while i < len(text):
            colon = text.index(":", i)
            end = colon + 1 + int(text[i:colon])
            out.append(text[colon + 1 : end])
            i = end
        return out
    while i < len(data):
        colon = data.index(b":", i)
        end = colon + 1 + int(data[i:colon])
        out.append(data[colon + 1 : end].decode("utf-8", "surrogatepass"))
        i = end
    return out


def _brief(blob: bytes | str) -> dict[str, str]:
    """The fields of a refused acquire's answer: ``<length>:<value>`` each, in ``_BRIEF_FIELDS`` order (empty
    values, i.e. missing fields, are left out). Lengths are in bytes, so values may hold any character."""
    return {name: value for name, value in zip(_BRIEF_FIELDS, _prefixed(blob), strict=False) if value}


def _merged(records: Iterable[dict[str, str]]) -> dict[str, str]:
    """One owner's record as several nodes hold it: a node that lost the key and was repaired by a renewal holds
    only ``owner`` and ``fence`` until it is refilled, so the fuller records' fields win, never the stripped one's."""
    if isinstance(records, tuple) and len(records) == 1:  # one node's record: nothing to merge
        out = dict(records[0])
    else:
        out = {}
        for record in sorted(records, key=len):
            out.update(record)
    out.pop(F_PREV, None)
    return out
