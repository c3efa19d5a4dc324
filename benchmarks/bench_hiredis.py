"""Our hand-written RESP2 reader (``_resp.py``) against hiredis (redis-py's C parser, ``redis[hiredis]``), in ONE
interleaved run: does the lock need its own reader?

hiredis must be importable (``pip install hiredis``, or ``PYTHONPATH=<dir with hiredis>``); the package does not
depend on it. Contenders, one node, uncontended acquire + release cycles (a reused ``Redlock``: the parser's share
is largest there):

* ``floor str, redis-py parser``  SET NX PX + EVALSHA compare-and-delete on a redis-py ``Connection`` (pure-Python
                                  ``_RESP2Parser``)
* ``floor str, hiredis``          the same on a ``Connection`` with ``_HiredisParser``
* ``ours, own reader``            ``Redlock(nodes, name)`` on a NodeSet built from the URL: the lean checkout and
                                  ``_resp.read_reply`` (the default, with or without hiredis installed)
* ``ours, hiredis``               the same lock on a NodeSet whose pool makes hiredis connections: the lean checkout
                                  and redis-py's ``read_response`` through hiredis (``_resp.usable`` says no)
* ``ours, redis-py parser``       the same lock, its connections' own reader turned off: the lean checkout and
                                  redis-py's ``read_response`` through its pure-Python ``_RESP2Parser`` (what the
                                  lock would cost without ``_resp.py`` and without hiredis)

p50 over every cycle pooled; client CPU (``time.process_time``) per cycle, medians over rounds; ratios medians of
per-round paired ratios. ``--pin split`` (default) as bench_hotpath.py.

    PYTHONPATH=$PWD:/tmp/hiredis python benchmarks/bench_hiredis.py          # ~40 s
"""

from __future__ import annotations

import secrets
import sys
from collections.abc import Callable
from typing import Any

import _common  # benchmarks/_common.py: run as `python benchmarks/<script>.py`
import _floors
import harness
from redis.connection import Connection, _HiredisParser, _RESP2Parser
from redis.utils import HIREDIS_AVAILABLE

from celery_singleton_lock.lock.redlock import NodeSet, Redlock

FLOOR_PY, FLOOR_HI = "floor str, redis-py parser", "floor str, hiredis"
OURS, OURS_HI, OURS_PY = "ours, own reader", "ours, hiredis", "ours, redis-py parser"


class NoOwnReader(Connection):
    """A connection our lean path reads through redis-py's ``read_response`` (``nodes._fast`` reads this flag)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._csl_fast = False


def connect(port: int, parser: type) -> Connection:
    conn = Connection(host="127.0.0.1", port=port, protocol=2, socket_timeout=5, parser_class=parser)
    conn.connect()
    return conn


def cycle(lock: Redlock) -> Callable[[], None]:
    def op() -> None:
        if not lock.acquire(blocking=False) or not lock.release():
            raise RuntimeError(f"a cycle failed on {lock.name}")

    return op


def main(argv: list[str] | None = None) -> int:
    parser = harness.Cli(__doc__, quick={"slice": 0.05, "rounds": 2}, pin="split")
    parser.add_argument("--slice", type=float, default=0.1, help="seconds per contender per round (default 0.1)")
    parser.add_argument("--rounds", type=int, default=40, help="interleaved rounds (default 40)")
    args = parser.parse(argv)
    if not HIREDIS_AVAILABLE:
        parser.error("hiredis is not importable: pip install hiredis (or put it on PYTHONPATH)")
    env = harness.start("own RESP2 reader against hiredis", "hiredis")
    with _common.pinned_servers(1, args.pin) as servers:
        url, port = servers[0].url, servers[0].port
        k = f"hiredis:{secrets.token_hex(4)}"
        own = NodeSet(url)
        hired = NodeSet(url, socket_timeout=0.5000001)  # another pool (the clients are per URL and timeouts)
        plain = NodeSet(url, socket_timeout=0.5000002)
        for nodes, parser_class in ((own, _RESP2Parser), (hired, _HiredisParser), (plain, _RESP2Parser)):
            for client in nodes.clients:
                client.connection_pool.connection_kwargs["parser_class"] = parser_class
        for client in plain.clients:
            client.connection_pool.connection_class = NoOwnReader
        ops = {
            FLOOR_PY: _floors.str_cycle([connect(port, _RESP2Parser)], f"{k}:fp", 10_000),
            FLOOR_HI: _floors.str_cycle([connect(port, _HiredisParser)], f"{k}:fh", 10_000),
            OURS: cycle(Redlock(own, f"{k}:o", ttl=10)),
            OURS_HI: cycle(Redlock(hired, f"{k}:h", ttl=10)),
            OURS_PY: cycle(Redlock(plain, f"{k}:p", ttl=10)),
        }
        contenders = [harness.Contender(name, op) for name, op in ops.items()]
        results = harness.interleave(
            contenders,
            args.rounds,
            lambda c, _rnd: harness.timed(c.op, args.slice, 100_000, collect=True),
            warmup=lambda c: harness.timed(c.op, 0.2, 2_000),
            collect=True,
        )
    print(
        harness.markdown(
            ["contender", "p50 µs", "client CPU µs", "p50 vs redis-py floor", "CPU vs redis-py floor"],
            [[c.name, f"{results.pooled(c.name, 0.5):.1f}", f"{results.median(c.name, 'cpu_us'):.1f}",
              f"{results.paired(c.name, FLOOR_PY, 'p50_us'):.3f}x",
              f"{results.paired(c.name, FLOOR_PY, 'cpu_us'):.3f}x"]
             for c in contenders],
        )
    )  # fmt: skip
    pairs = ((OURS_HI, OURS), (OURS_PY, OURS), (FLOOR_HI, FLOOR_PY))
    print()
    for name, ref in pairs:
        print(
            f"- {name} / {ref}: p50 {results.paired(name, ref, 'p50_us'):.3f}x, "
            f"client CPU {results.paired(name, ref, 'cpu_us'):.3f}x "
            f"({results.paired(name, ref, 'cpu_us', delta=True):+.1f} µs)"
        )
    harness.save(args, env, samples=results.record())
    return 0


if __name__ == "__main__":
    sys.exit(main())
