"""The Python examples of the README, and of the docs pages moved out of it, run in order against a throwaway
redis-server (no worker: eager apply)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from celery_singleton_lock.testing import RedisServer

ROOT = Path(__file__).resolve().parent.parent.parent
README = ROOT / "README.md"
# Run in this order, in one namespace: the README's quick start defines `app` and `LockedTask`, the pages build on it.
# Every ```python block of these pages runs (a block added to one of them runs too).
RUN = [
    "README.md",
    "docs/configuration.md",
    "docs/policies.md",
    "docs/rate.md",
    "docs/long-tasks.md",
    "docs/redlock.md",
    "docs/asyncio.md",
    "docs/monitoring.md",
    "docs/metrics.md",
    "docs/signals.md",
    "docs/how-it-works.md",
    "docs/guarantees.md",
    "docs/faq.md",
    "docs/migration.md",
    "docs/development.md",
    "docs/index.md",
]
# Pages whose ```python blocks are fragments of a larger program (a scheduler subclass of a package we do not
# install, a repro split over two files, the pytest files that tests/testing/test_pytest_plugin.py compares verbatim,
# ...).
FRAGMENTS = {
    "docs/beat.md",
    "docs/brokers.md",
    "docs/cli.md",
    "docs/faults.md",
    "docs/reliability.md",
    "docs/testing.md",
    "docs/benchmarks.md",
    "docs/keys.md",
    "docs/nodes.md",
    "docs/ops.md",
    "docs/observability.md",
    "docs/options.md",
    "docs/protocol.md",
}


def python_blocks(page: Path = README) -> list[str]:
    return re.findall(r"```python\n(.*?)```", page.read_text(), flags=re.DOTALL)


def test_every_docs_page_is_run_or_named_a_fragment() -> None:
    """Each docs page is either run here or listed as holding fragments, so a new page's examples cannot go unrun."""
    pages = {f"docs/{p.name}" for p in (ROOT / "docs").glob("*.md")}
    assert pages == (set(RUN) - {"README.md"}) | FRAGMENTS


def test_readme_examples_run(fresh_node: RedisServer) -> None:
    """Every ```python block of the README and of its docs pages runs, and its tasks work when applied (eagerly,
    through the tracer)."""
    assert len(python_blocks(README)) >= 2
    namespace: dict[str, Any] = {"__name__": "readme"}
    ran = 0
    for name in RUN:
        page = ROOT / name
        for block in python_blocks(page):
            code = block.replace("redis://localhost:6379", f"redis://127.0.0.1:{fresh_node.port}")
            exec(compile(code, str(page), "exec"), namespace)  # our own docs
            ran += 1
    assert ran >= 7
    assert namespace["rebuild_report"].apply(args=(42,)).get() == "rebuilt 42/current"
    charged = namespace["charge"].apply(args=(7, 4990))
    assert charged.get() == f"charged order 7: 4990 cents (idempotency key {charged.id})"
    assert namespace["charge"].lock_key_for(7, 4990) == namespace["charge"].lock_key_for(7, 5990)  # keyed on the order
    namespace["migrate"].apply(args=("orders",)).get()
    rated = namespace["call_partner_api"]
    rated.apply(args=(1, {"a": 1})).get()  # counted on the node: one start of customer 1's rate
    assert rated.lock_rate_key_for(1, {"a": 1}) == rated.lock_rate_key_for(1, {"b": 2})
    client = fresh_node.client()
    # Released: no lock left (done markers are keys of their own), but charge's cooldown, which holds for 600 s.
    (held,) = client.keys("singleton_lock:readme.*")
    assert client.zcard(rated.lock_rate_key_for(1, {})) == 1  # the rate's log: one start
    assert held.startswith(b"singleton_lock:readme.charge:")
    assert client.hget(held, "state") == b"cooldown"
