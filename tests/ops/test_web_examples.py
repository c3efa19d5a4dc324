"""The web examples (examples/fastapi_app.py) on real processes: two uvicorn instances, three lock nodes and a store,
driven over HTTP by httpx as users do. One set of servers for the module.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import needs
import pytest

needs.module("fastapi", "pip install -e '.[test]' (the test extra has fastapi, uvicorn and httpx)")
needs.module("uvicorn", "pip install -e '.[test]' (the test extra has fastapi, uvicorn and httpx)")
needs.module("httpx", "pip install -e '.[test]' (the test extra has fastapi, uvicorn and httpx)")

from examples import cache_stampede, fastapi_payment  # noqa: E402 - after the check that they can import
from examples._web import web_instances  # noqa: E402


@pytest.fixture(scope="module")
def web(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    with web_instances(log_dir=Path(tmp_path_factory.mktemp("web"))) as running:
        yield running


def test_a_double_click_on_pay_is_answered_409_and_the_charge_runs_once(web: Any) -> None:
    """Click 1 on instance A; click 2 on instance B while click 1's charge is in flight: 409; click 3 after it: 200
    with click 1's charge. The provider was called once."""
    figures = fastapi_payment.main(web)
    assert figures["statuses"] == [200, 409, 200]
    assert figures["charges"] == 1
    assert figures["same_charge"]
    assert figures["ok"]


def test_a_cache_stampede_of_500_requests_computes_once_and_serves_all(web: Any) -> None:
    """500 concurrent requests for a cold key over two instances: one computation, 500 answers, one value."""
    figures = cache_stampede.main(web)
    assert figures["served"] == figures["requests"] == 500
    assert figures["computations"] == 1 and figures["computed_here"] == 1
    assert figures["distinct_values"] == 1
    assert figures["ok"]
