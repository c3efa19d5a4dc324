"""The README's Python examples run, in order, against a throwaway redis-server (no worker: eager apply)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from celery_singleton_lock.testing import RedisServer

README = Path(__file__).resolve().parent.parent / "README.md"


def python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.DOTALL)


def test_readme_examples_run(fresh_node: RedisServer) -> None:
    """Every ```python block of the README runs, and its tasks work when applied (eagerly, through the tracer)."""
    blocks = python_blocks()
    assert len(blocks) >= 4
    namespace: dict[str, Any] = {"__name__": "readme"}
    for block in blocks:
        code = block.replace("redis://localhost:6379", f"redis://127.0.0.1:{fresh_node.port}")
        exec(compile(code, str(README), "exec"), namespace)  # our own README
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
