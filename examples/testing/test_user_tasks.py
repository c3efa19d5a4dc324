"""Testing LockedTasks of your own with the celery_singleton_lock pytest plugin (see docs/testing.md).

A real worker runs in this process (``singleton_lock_worker``), so a test can keep a job inside its body while it
sends the duplicate. The payment provider is the one thing replaced: Redis, the broker and the worker are real.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest
import shop

from celery_singleton_lock.testing import assert_holds_lock, assert_no_locks_left, assert_skipped_duplicate

WAIT = 10.0


class HeldGateway:
    """Stands in for the payment provider: records each charge and keeps it in progress until released."""

    def __init__(self) -> None:
        self.charges: list[tuple[int, int]] = []
        self.in_progress = threading.Event()
        self.release = threading.Event()

    def charge(self, order_id: int, amount: int, *, idempotency_key: str) -> str:
        self.charges.append((order_id, amount))
        self.in_progress.set()
        self.release.wait(WAIT)
        return f"ch_{order_id}"


@pytest.fixture
def gateway(singleton_lock_worker: Any, monkeypatch: pytest.MonkeyPatch) -> Iterator[HeldGateway]:
    """The held gateway, in place while the worker runs (and released before the worker stops)."""
    held = HeldGateway()
    monkeypatch.setattr(shop, "gateway", held)
    yield held
    held.release.set()


def test_a_double_click_charges_the_card_once(gateway: HeldGateway) -> None:
    first = shop.charge.delay(7, 100)
    assert gateway.in_progress.wait(WAIT)
    assert_holds_lock(shop.charge, (7, 100), by=first.id)

    second = shop.charge.delay(7, 250)  # the same order: a duplicate, whatever the amount
    assert_skipped_duplicate(second, of=first.id)

    gateway.release.set()
    assert first.get(timeout=WAIT) == "ch_7"
    assert gateway.charges == [(7, 100)]
    assert_no_locks_left(shop.app)


def test_two_orders_are_charged_side_by_side(gateway: HeldGateway) -> None:
    seven, eight = shop.charge.delay(7, 100), shop.charge.delay(8, 100)
    assert_holds_lock(shop.charge, (7, 100), by=seven.id)
    assert_holds_lock(shop.charge, (8, 100), by=eight.id)
    gateway.release.set()
    assert [seven.get(timeout=WAIT), eight.get(timeout=WAIT)] == ["ch_7", "ch_8"]
    assert_no_locks_left(shop.app)


class TestOnThreeLockNodes:
    @pytest.fixture
    def singleton_lock_urls(self, singleton_lock_nodes: list[Any]) -> list[str]:
        return [node.url for node in singleton_lock_nodes]

    def test_the_lock_is_held_on_a_majority(self, gateway: HeldGateway) -> None:
        first = shop.charge.delay(9, 100)
        info = assert_holds_lock(shop.charge, (9, 100), by=first.id)
        assert len(info.nodes) >= 2
        assert info.fencing_token is not None
        assert_skipped_duplicate(shop.charge.delay(9, 100), of=first.id)
        gateway.release.set()
        assert first.get(timeout=WAIT) == "ch_9"


def test_eager_mode_runs_each_call_through_the_lock(singleton_lock_app: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(singleton_lock_app.conf, "task_always_eager", True)

    first = shop.send_receipt.delay(7)
    assert first.get() == "receipt for order 7"
    assert_skipped_duplicate(shop.send_receipt.delay(7), of=first.id)  # within the cooldown

    # Eager calls run one after another: the second starts after the first released, so it runs too. A double
    # click can only be shown with a worker (above).
    assert shop.charge.delay(5, 1).get() == shop.charge.delay(5, 1).get() == "ch_5_1"
