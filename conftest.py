"""Docstring examples in the package run as tests, against a throwaway redis-server."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from celery_singleton_lock.testing import redis_servers


@pytest.fixture(scope="session")
def _doctest_server_url() -> Iterator[str]:
    with redis_servers(1) as servers:
        yield servers[0].url


@pytest.fixture(autouse=True)
def _doctest_redis(request: pytest.FixtureRequest, doctest_namespace: dict[str, Any]) -> None:
    """Docstring examples get ``redis_url`` pointing at a throwaway server."""
    if isinstance(request.node, pytest.DoctestItem):
        doctest_namespace["redis_url"] = request.getfixturevalue("_doctest_server_url")
