"""What LockedTask's pieces cost inside the task flow, not in a tight loop.

``profile_task.py --pieces`` times each piece in a loop of its own, with hot caches. In a worker each piece runs
right after a blocking socket read (the previous round trip), with cold caches, and costs 2-3x more. Here the
executed (or skip) path runs through the hooks (``push_request``, ``before_start``, ``__call__``) as in
profile_task.py, with the thread CPU time (``time.thread_time_ns``) of each piece summed around its calls; the
wrappers cost ~0.5 µs per call, so the figures are upper bounds. One throwaway redis-server on 127.0.0.1, placed by
``--pin`` (see bench_hotpath.py).

    python benchmarks/inflow_task.py                 # executed path, 20,000 tasks
    python benchmarks/inflow_task.py --skip          # a skipped duplicate's path
"""

from __future__ import annotations

import collections
import importlib
import os
import sys
import time
from collections.abc import Callable
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import _common  # noqa: E402
import harness  # noqa: E402
import profile_task  # noqa: E402

from celery_singleton_lock.lock import redlock  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = harness.Cli(__doc__, quick={"tasks": 200}, pin="split")
    parser.add_argument("--tasks", type=int, default=20_000, help="tasks timed (default 20000)")
    parser.add_argument("--skip", action="store_true", help="the skipped duplicate's path instead")
    args = parser.parse(argv)
    env = harness.start("inflow_task", "celery")
    spent: collections.Counter[str] = collections.Counter()
    clock = time.thread_time_ns

    def timed(owner: Any, name: str, label: str) -> None:
        original = getattr(owner, name)

        def wrapper(*a: Any, **kw: Any) -> Any:
            start = clock()
            try:
                return original(*a, **kw)
            finally:
                spent[label] += clock() - start

        setattr(owner, name, wrapper)

    with _common.pinned_servers(1, args.pin) as servers:
        bench = profile_task.Bench([s.url for s in servers])
        task_class = type(bench.locked._get_current_object())
        # LockedTask's pieces, by their names before the redesign (labels stay comparable across checkouts); since
        # it, the delivery's pieces are functions of the _delivery room, timed there.
        moved = {"_hold": "hold", "_release": "release", "_facts": "gather", "_carry_out": "carry_out"}
        for name in ("before_start", "__call__", "_key", "_new_lock", "_hold", "_release", "_facts", "_carry_out"):
            if hasattr(task_class, name):
                timed(task_class, name, f"LockedTask.{name}")
            elif name in ("_key", "_new_lock"):  # since the seam (issue 31): the context's key builder and lock factory
                timed(
                    importlib.import_module("celery_singleton_lock.task._run").Context, name[1:], f"LockedTask.{name}"
                )
            else:
                timed(
                    importlib.import_module("celery_singleton_lock.task._delivery"), moved[name], f"LockedTask.{name}"
                )
        for name in ("__init__", "acquire", "_attempt", "finish"):
            timed(redlock.Redlock, name, f"Redlock.{name}")
        timed(redlock.NodeSet, "run", "NodeSet.run")
        path: Callable[[int], None] = bench.hooks_skip if args.skip else bench.hooks_executed
        harness.counted(path, 1000)  # warm up
        spent.clear()
        per_task = harness.counted(path, args.tasks)["cpu_us"]
    print(f"## {'skipped duplicate' if args.skip else 'executed'} path, {args.tasks} tasks through the hooks\n")
    print(f"process CPU per task: {per_task:.1f} µs (wrappers included)\n")
    print("| piece (nested pieces are inside their callers) | thread CPU µs per task |\n|---|---:|")
    for label, ns in spent.most_common():
        print(f"| `{label}` | {ns / args.tasks / 1000:.1f} |")
    harness.save(args, env, cpu_us_per_task=per_task, pieces_us={k: v / args.tasks / 1000 for k, v in spent.items()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
