"""Every example in examples/ runs against real workers and does what its report says.

One harness for the module (a broker, three lock nodes, two prefork workers serving examples.example_app); each
test calls an example's ``main`` and checks the figures it returns.
"""

from __future__ import annotations

import contextlib
import random
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from celery.signals import after_task_publish

from celery_singleton_lock import testing
from examples import (
    bounded_line,
    cache_rebuild_storm,
    leader_election,
    llm_api,
    long_report,
    nightly_job,
    partner_api_rate,
    payment_double_click,
    prometheus_metrics,
    rebuild_newest_wins,
    reindex_debounced,
    reindex_latest,
    stock_decrement,
    tenant_exports,
)
from examples._harness import example_workers


def _free_block(count: int) -> int:
    """A first port of ``count`` consecutive ports on 127.0.0.1 that are all free right now (bounded search)."""
    rng = random.Random()
    for _ in range(50):
        first = rng.randrange(20000, 30000)
        try:
            with contextlib.ExitStack() as stack:
                for port in range(first, first + count):
                    sock = stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
                    sock.bind(("127.0.0.1", port))
        except OSError:
            continue
        return first
    raise AssertionError(f"no {count} consecutive free ports found")


def test_examples_ports_chooses_the_examples_ports(monkeypatch: pytest.MonkeyPatch) -> None:
    """``EXAMPLES_PORTS=A-B``: an example's servers listen on A, A+1, ... in order (real redis-servers); a range used
    up, or a value that is no range, is refused in one line naming the variable."""
    first = _free_block(4)
    monkeypatch.setenv("EXAMPLES_PORTS", f"{first}-{first + 3}")
    monkeypatch.setattr(testing, "_ports_taken", 0)
    with testing.redis_servers(4, ports=testing.example_port) as servers:
        assert [s.port for s in servers] == list(range(first, first + 4))
        assert servers[3].client().ping()
    with pytest.raises(ValueError, match=r"EXAMPLES_PORTS=.* has no port left .* wider range"):
        testing.example_port()
    monkeypatch.setenv("EXAMPLES_PORTS", "17000:17010")
    with pytest.raises(ValueError, match="EXAMPLES_PORTS='17000:17010': set a port range such as 17000-17019"):
        testing.example_port()
    monkeypatch.delenv("EXAMPLES_PORTS")
    assert testing.example_port() > 0  # unset: a free ephemeral port


@pytest.fixture(scope="module")
def app_module(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ModuleType]:
    with example_workers(log_dir=tmp_path_factory.mktemp("examples")) as module:
        yield module


def test_payment_double_click_charges_once(app_module: ModuleType) -> None:
    """Two simultaneous clicks and one 3 s later: one message, one charge, and every click gets that charge."""
    published: list[str] = []

    def count(sender: str | None = None, headers: dict[str, Any] | None = None, **_: Any) -> None:
        if sender == "examples.payment.charge":  # what the broker was really sent, not the ids the callers got
            published.append((headers or {}).get("id", ""))

    after_task_publish.connect(count, weak=False)
    try:
        figures = payment_double_click.main(app_module)
    finally:
        after_task_publish.disconnect(count)
    assert figures["sent"] == 3
    assert len(published) == 1, published
    assert figures["published"] == 1
    assert figures["charged"] == 1
    assert figures["same_answer"]
    assert figures["ok"]


def test_partner_api_rate_runs_5_per_second_per_customer(app_module: ModuleType) -> None:
    """15 calls for one customer at lock_rate=(5, 1.0): every call runs, never more than 5 in any 1 s window."""
    figures = partner_api_rate.main(app_module)
    assert figures["ran"] == figures["sent"] == 18
    assert figures["acme"] == {"calls": 15, "busiest_window": 5}
    assert figures["ok"]


def test_llm_api_keeps_the_token_quota_and_runs_a_429d_call_once_after_the_pause(app_module: ModuleType) -> None:
    """Two tenants' 11 completions against a local HTTP API with a request and a token quota; stacked limits with a
    cost each (the account's tokens and one tenant's share: estimated high and refunded with rate_spent; the
    account's requests: 1 a call); another app spends the whole quota
    mid-way: every call answered exactly once, no 429 but those the outside spend caused, each 429'd call ran once
    after its pause, and the corrected tokens of any window stayed within the quota (promise 2, refunds only)."""
    figures = llm_api.main(app_module)
    assert figures["ran"] == figures["sent"] == 11
    assert figures["answered_once"]
    assert figures["runs"] == {"acme": 8, "tiny": 3}
    assert figures["429s"] >= 1
    assert figures["ran_once_after_the_pause"]
    assert figures["429s_not_from_the_outside_spend"] == 0
    assert figures["api_busiest_window"] <= llm_api.QUOTA
    assert figures["api_busiest_requests"] <= llm_api.REQUESTS
    assert figures["corrected_busiest_window"] <= llm_api.QUOTA
    assert figures["refunded"] > 0
    assert figures["ok"]


def test_nightly_job_runs_once_across_three_hosts(app_module: ModuleType) -> None:
    """Three hosts send the nightly cleanup at the same moment: it runs once, the two others are skipped."""
    figures = nightly_job.main(app_module)
    assert figures["runs"] == 1
    assert figures["skipped"] == 2
    assert figures["holder_named"]


def test_stock_never_oversold_with_the_lock(app_module: ModuleType) -> None:
    """12 redemptions of a coupon with 5 left: exactly 5 succeed, stock never below 0, every user answered;
    the same without a lock oversells."""
    figures = stock_decrement.main(app_module)
    locked = figures["locked"]
    assert locked["redeemed"] == 5
    assert locked["lowest_stock"] >= 0
    assert locked["final_stock"] == 0
    assert locked["answered"] == locked["log"] == 12
    assert figures["unlocked"]["redeemed"] > 5
    assert figures["oversold_without_lock"]


def test_cache_rebuild_storm_rebuilds_once(app_module: ModuleType) -> None:
    """200 rebuild requests while a rebuild runs: one rebuild, 200 skipped duplicates naming it."""
    figures = cache_rebuild_storm.main(app_module)
    assert figures["rebuilds"] == 1
    assert figures["skipped"] == 200
    assert figures["holder_named"]


def test_long_report_holds_its_lock_throughout(app_module: ModuleType) -> None:
    """A 5 s report on a 1 s lease is renewed and held at every step, writes with one fencing token, and a
    duplicate sent 2 s in is skipped."""
    figures = long_report.main(app_module)
    assert figures["held_throughout"]
    assert figures["steps"] == figures["writes_accepted"] == 10
    assert len(figures["tokens"]) == 1
    assert figures["seconds"] > 3
    assert figures["duplicate_skipped"]


def test_prometheus_counters_come_from_the_pool_processes(app_module: ModuleType) -> None:
    """One endpoint reading Redis shows the pool children's counts of both workers: started, skipped, released..."""
    figures = prometheus_metrics.main(app_module)
    assert figures["this_run"] == {"started": 1, "acquired": 1, "skipped": 3, "released": 1}
    assert figures["ok"]


def test_tenant_exports_never_more_than_the_limit_per_tenant(app_module: ModuleType) -> None:
    """6 exports of one tenant and 2 of another at once, lock_limit=2: all run, never more than 2 of a tenant."""
    figures = tenant_exports.main(app_module)
    assert figures["ran"] == figures["sent"] == 8
    assert figures["acme"] == {"exports": 6, "most_at_once": 2}
    assert figures["tiny"]["exports"] == 2
    assert figures["ok"]


def test_reindex_latest_runs_the_newest_edit_only(app_module: ModuleType) -> None:
    """5 edits while a reindex runs: the running one and then only the newest version; the others superseded."""
    figures = reindex_latest.main(app_module)
    assert figures["reindexed"] == [1, 6]
    assert figures["superseded"] == 4
    assert figures["ok"]


def test_rebuild_newest_wins_stops_the_stale_rebuild_and_fences_a_stubborn_one(app_module: ModuleType) -> None:
    """A newer rebuild stops the running one (REVOKED naming it) and publishes; a stubborn one's late publish is
    refused by its older fencing token."""
    figures = rebuild_newest_wins.main(app_module)
    assert figures["cancelled"], figures
    assert figures["ok"], figures


def test_reindex_debounced_runs_once_with_the_last_edit(app_module: ModuleType) -> None:
    """40 edits 20 ms apart, lock_debounce=1: one task id for all, one reindex, of the last version."""
    figures = reindex_debounced.main(app_module)
    assert figures["jobs"] == 1
    assert figures["reindexed"] == [40]
    assert figures["ok"]


def test_bounded_line_refuses_a_storm_beyond_the_cap_at_once(app_module: ModuleType) -> None:
    """10 requests while a sync runs, lock_max_waiting=3: the running one and 3 waiting run; 7 refused at once."""
    figures = bounded_line.main(app_module)
    assert figures["ran"] == 4
    assert figures["refused"] == 7
    assert figures["ok"]


ISOLATION = """
import celery
from celery_singleton_lock import LockedTask, signals
import examples.example_app as ea
from examples import (bounded_line, cache_rebuild_storm, long_report, nightly_job, payment_double_click,
                      prometheus_metrics, reindex_debounced, reindex_latest, stock_decrement, tenant_exports)
other = celery.Celery("other", broker="memory://")
@other.task(base=LockedTask, name="other.work")
def work(): ...
for sig in (signals.duplicate_skipped, signals.lock_acquired, signals.lock_released, signals.lock_unavailable):
    sig.send(sender=work, key="k", task_id="t", holder_task_id="h", policy="reschedule", held=True, errors=[])
print("configured" if ea.app.configured else "untouched")
"""


def test_the_examples_receivers_leave_their_app_unconfigured_when_another_app_signals() -> None:
    """The examples' signal receivers hear every app's tasks (signals are process-wide). Hearing another app's skip
    must not configure the examples' app: configured then, before a harness sets its environment, it kept the
    default broker, and every later example in the process sent to a broker no worker read (test_examples timed
    out after test_queue_scope, and after the async producers' tests)."""
    root = Path(__file__).resolve().parent.parent.parent
    out = subprocess.run(
        [sys.executable, "-c", ISOLATION], cwd=root, capture_output=True, text=True, timeout=60, check=False
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "untouched", out.stdout


def test_leader_election_fails_over_and_fences_the_paused_leader() -> None:
    """Three instances (real processes) on ``with Redlock(..., interrupt_on_loss=True)``: one leads; a SIGKILLed
    leader and a leader SIGSTOPped past its lease are each replaced by another instance; the resumed one loses its
    lease (interrupted) and never writes after its successor; the store's accepted tokens only grow, one instance
    per token. No Celery worker: the lock alone."""
    figures = leader_election.main()
    assert len(set(figures["leaders"])) == 3
    assert figures["tokens_grow"] and figures["one_leader_per_token"]
    assert not figures["paused_leader_wrote_after_successor"]
    assert figures["lost_events"] + sum(figures["refused"].values()) >= 1  # the resumed leader learnt of its loss
    assert figures["ok"]
