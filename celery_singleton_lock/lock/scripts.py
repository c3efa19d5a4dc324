"""The lock's Lua scripts: each one a file under ``lua/`` (its KEYS/ARGV/returns header at the top), read once at
import and run by SHA (``EVALSHA``; the body goes to a node only when it answers ``NOSCRIPT``).

docs/protocol.md says which keys, record fields and state transitions each script reads and writes; every script's
header names its rows there (``-- protocol: ...``).
"""

from __future__ import annotations

import hashlib
from importlib import resources

__all__ = [
    "ACQUIRE",
    "ACQUIRED",
    "ACQUIRE_SCRIPT",
    "BRIEF",
    "BRIEF_SCRIPT",
    "CANCEL",
    "CANCEL_JOB",
    "CANCEL_JOB_SCRIPT",
    "CANCEL_SCRIPT",
    "COUNT",
    "COUNT_SCRIPT",
    "DEBOUNCE_CLAIM",
    "DEBOUNCE_CLAIM_SCRIPT",
    "DEBOUNCE_JOIN",
    "DEBOUNCE_JOIN_SCRIPT",
    "DONE",
    "EXTEND",
    "EXTENDED",
    "EXTEND_SCRIPT",
    "FAIR_TURN",
    "FAIR_TURN_CODE",
    "FAIR_TURN_SCRIPT",
    "FENCE",
    "FENCE_SCRIPT",
    "FINISH",
    "FINISH_SCRIPT",
    "FORCE_RELEASE",
    "FORCE_RELEASE_SCRIPT",
    "HAND_ON",
    "HAND_ON_SCRIPT",
    "HELD",
    "LOST",
    "PARK_CAPPED",
    "PARK_CAPPED_CODE",
    "PARK_CAPPED_SCRIPT",
    "PARK_FAIR",
    "PARK_FAIR_CODE",
    "PARK_FAIR_SCRIPT",
    "PARK_REPLACING",
    "PARK_REPLACING_CODE",
    "PARK_REPLACING_SCRIPT",
    "POP_WAITER",
    "POP_WAITER_CODE",
    "POP_WAITER_SCRIPT",
    "RATE",
    "RATE_ADJUST",
    "RATE_ADJUST_SCRIPT",
    "RATE_BOOK",
    "RATE_BOOK_SCRIPT",
    "RATE_CLAIM",
    "RATE_CLAIM_SCRIPT",
    "RATE_PAUSE",
    "RATE_PAUSE_SCRIPT",
    "RATE_RESTAMP",
    "RATE_RESTAMP_SCRIPT",
    "RATE_SCRIPT",
    "RATE_STACK",
    "RATE_STACK_RESTAMP",
    "RATE_STACK_RESTAMP_SCRIPT",
    "RATE_STACK_SCRIPT",
    "RATE_UNDO",
    "RATE_UNDO_SCRIPT",
    "READ",
    "READ_SCRIPT",
    "REFILL",
    "REFILL_SCRIPT",
    "RELEASE",
    "RELEASE_SCRIPT",
    "REPAIRED",
    "SCRIPTS",
    "STATUS",
    "STATUS_SCRIPT",
    "TRANSFER",
    "TRANSFER_SCRIPT",
    "UNDO",
    "UNDO_SCRIPT",
    "UNPARK_FAIR",
    "UNPARK_FAIR_CODE",
    "UNPARK_FAIR_SCRIPT",
    "Script",
]


def _load(name: str) -> str:
    """The text of ``lua/<name>.lua``, shipped in the package (pyproject's package-data)."""
    return resources.files(__package__).joinpath("lua").joinpath(f"{name}.lua").read_text(encoding="utf-8")


# The lease (Redlock).
ACQUIRE_SCRIPT = _load("acquire")
UNDO_SCRIPT = _load("undo")
REFILL_SCRIPT = _load("refill")
FENCE_SCRIPT = _load("fence")
TRANSFER_SCRIPT = _load("transfer")
HAND_ON_SCRIPT = _load("hand_on")  # lock_on_duplicate="cancel": a stopped run's lock handed to the newest waiter
RELEASE_SCRIPT = _load("release")
FINISH_SCRIPT = _load("finish")
EXTEND_SCRIPT = _load("extend")
STATUS_SCRIPT = _load("status")
# The waiting line (LockedTask's reschedule and replace).
POP_WAITER_SCRIPT = _load("pop_waiter")
PARK_REPLACING_SCRIPT = _load("park_replacing")
PARK_CAPPED_SCRIPT = _load("park_capped")
# The fair line's (lock_fair_on: policies/fair.py).
PARK_FAIR_SCRIPT = _load("park_fair")
UNPARK_FAIR_SCRIPT = _load("unpark_fair")
FAIR_TURN_SCRIPT = _load("fair_turn")
# The rate's sliding log (lock_rate).
RATE_SCRIPT = _load("rate")
RATE_UNDO_SCRIPT = _load("rate_undo")
RATE_RESTAMP_SCRIPT = _load("rate_restamp")
RATE_STACK_SCRIPT = _load("rate_stack")  # several limits, or a cost (lock_rate as a list, lock_rate_cost)
RATE_STACK_RESTAMP_SCRIPT = _load("rate_stack_restamp")
RATE_ADJUST_SCRIPT = _load("rate_adjust")  # a run's reported cost (LockedTask.rate_spent)
RATE_PAUSE_SCRIPT = _load("rate_pause")  # a body's SlowDown
RATE_BOOK_SCRIPT = _load("rate_book")  # a waiting call's booked slot (policies/rate/booking.py)
RATE_CLAIM_SCRIPT = _load("rate_claim")


def _code(text: str) -> str:
    """``text`` without its header (the leading comment lines): for a script sent by EVAL, text and all, on every
    call (the waiting line's, from LockedTask), so the header stays in the file and off the wire."""
    lines = text.splitlines(keepends=True)
    start = next((i for i, line in enumerate(lines) if not line.startswith("--")), len(lines))
    return "".join(lines[start:])


#: The waiting line's scripts as LockedTask sends them by EVAL: the code only (what it sent before they were files).
POP_WAITER_CODE = _code(POP_WAITER_SCRIPT)
PARK_REPLACING_CODE = _code(PARK_REPLACING_SCRIPT)
PARK_CAPPED_CODE = _code(PARK_CAPPED_SCRIPT)
PARK_FAIR_CODE = _code(PARK_FAIR_SCRIPT)
UNPARK_FAIR_CODE = _code(UNPARK_FAIR_SCRIPT)
FAIR_TURN_CODE = _code(FAIR_TURN_SCRIPT)
# Debounce (LockedTask's lock_debounce): a key's pending burst.
DEBOUNCE_JOIN_SCRIPT = _load("debounce_join")
DEBOUNCE_CLAIM_SCRIPT = _load("debounce_claim")
# The CLI (list, release).
READ_SCRIPT = _load("read")
BRIEF_SCRIPT = _load("brief")  # the locks page (celery_singleton_lock.web)
FORCE_RELEASE_SCRIPT = _load("force_release")
COUNT_SCRIPT = _load("count")  # the metrics flush (celery_singleton_lock.metrics.Outbox)
CANCEL_SCRIPT = _load("cancel")  # lock_on_duplicate="cancel": ask a running job to stop (policies.cancel)
CANCEL_JOB_SCRIPT = _load("cancel_job")  # the durable cancel of one job (LockedTask.cancel, locks cancel)

#: EXTEND_SCRIPT's answer per lease (or a string: EXTENDED, and the job is asked to stop by that task id).
EXTENDED, REPAIRED, LOST = 1, 2, 0
#: ACQUIRE_SCRIPT's first element.
ACQUIRED, HELD, DONE = 1, 0, 2


class Script:
    """A Lua script sent by SHA; its body is sent only to a node that answers NOSCRIPT.

    ``batch=(k, a)`` marks a script that handles many items in one call (``k`` KEYS and ``a`` ARGV per item, any
    further ARGV shared by all; ``a == 0``: every ARGV is shared) and answers an array, one entry per item. On a
    Redis Cluster node such a call is split by slot, one call per slot (Cluster refuses a script whose keys span
    slots), and the calls for one master are written together: one round trip per master. With ``partial``, an
    item whose slot's master did not answer gets that error as its entry; without, the whole node's answer is it.
    """

    def __init__(self, body: str, *, batch: tuple[int, int] | None = None, partial: bool = False) -> None:
        self.body = body
        self.sha = hashlib.sha1(body.encode()).hexdigest()  # noqa: S324 - Redis names scripts by SHA1
        self.batch = batch
        self.partial = partial


ACQUIRE = Script(ACQUIRE_SCRIPT)
COUNT = Script(COUNT_SCRIPT)
FENCE = Script(FENCE_SCRIPT)
RELEASE = Script(RELEASE_SCRIPT)
TRANSFER = Script(TRANSFER_SCRIPT)
HAND_ON = Script(HAND_ON_SCRIPT)
EXTEND = Script(EXTEND_SCRIPT, batch=(2, 3), partial=True)
STATUS = Script(STATUS_SCRIPT)
FINISH = Script(FINISH_SCRIPT)
UNDO = Script(UNDO_SCRIPT)
REFILL = Script(REFILL_SCRIPT)
POP_WAITER = Script(POP_WAITER_SCRIPT)
PARK_REPLACING = Script(PARK_REPLACING_SCRIPT)
PARK_CAPPED = Script(PARK_CAPPED_SCRIPT)
PARK_FAIR = Script(PARK_FAIR_SCRIPT)
UNPARK_FAIR = Script(UNPARK_FAIR_SCRIPT)
FAIR_TURN = Script(FAIR_TURN_SCRIPT)
DEBOUNCE_JOIN = Script(DEBOUNCE_JOIN_SCRIPT)
DEBOUNCE_CLAIM = Script(DEBOUNCE_CLAIM_SCRIPT)
RATE = Script(RATE_SCRIPT)
RATE_UNDO = Script(RATE_UNDO_SCRIPT)
RATE_RESTAMP = Script(RATE_RESTAMP_SCRIPT)
RATE_STACK = Script(RATE_STACK_SCRIPT)
RATE_STACK_RESTAMP = Script(RATE_STACK_RESTAMP_SCRIPT)
RATE_ADJUST = Script(RATE_ADJUST_SCRIPT)
RATE_PAUSE = Script(RATE_PAUSE_SCRIPT)
RATE_BOOK = Script(RATE_BOOK_SCRIPT)
RATE_CLAIM = Script(RATE_CLAIM_SCRIPT)
READ = Script(READ_SCRIPT, batch=(1, 0))  # split by slot on a Redis Cluster node
BRIEF = Script(BRIEF_SCRIPT, batch=(1, 0))
FORCE_RELEASE = Script(FORCE_RELEASE_SCRIPT)
CANCEL = Script(CANCEL_SCRIPT)
CANCEL_JOB = Script(CANCEL_JOB_SCRIPT)

#: Every script by its file's name (``lua/<name>.lua``).
SCRIPTS: dict[str, Script] = {
    "acquire": ACQUIRE,
    "undo": UNDO,
    "refill": REFILL,
    "fence": FENCE,
    "transfer": TRANSFER,
    "hand_on": HAND_ON,
    "release": RELEASE,
    "finish": FINISH,
    "extend": EXTEND,
    "status": STATUS,
    "pop_waiter": POP_WAITER,
    "park_replacing": PARK_REPLACING,
    "park_capped": PARK_CAPPED,
    "park_fair": PARK_FAIR,
    "unpark_fair": UNPARK_FAIR,
    "fair_turn": FAIR_TURN,
    "debounce_join": DEBOUNCE_JOIN,
    "debounce_claim": DEBOUNCE_CLAIM,
    "rate": RATE,
    "rate_undo": RATE_UNDO,
    "rate_restamp": RATE_RESTAMP,
    "rate_stack": RATE_STACK,
    "rate_stack_restamp": RATE_STACK_RESTAMP,
    "rate_adjust": RATE_ADJUST,
    "rate_pause": RATE_PAUSE,
    "rate_book": RATE_BOOK,
    "rate_claim": RATE_CLAIM,
    "read": READ,
    "brief": BRIEF,
    "force_release": FORCE_RELEASE,
    "count": COUNT,
    "cancel": CANCEL,
    "cancel_job": CANCEL_JOB,
}
