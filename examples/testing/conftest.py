"""Which app the celery_singleton_lock plugin points at its throwaway lock nodes: ours, with its broker and its
results on a throwaway server too (databases 1 and 2 of the plugin's node)."""

from __future__ import annotations

from typing import Any

import pytest
import shop


@pytest.fixture(scope="session")
def singleton_lock_celery_app(singleton_lock_node: Any) -> Any:
    base = f"redis://127.0.0.1:{singleton_lock_node.port}"
    shop.app.conf.update(broker_url=f"{base}/1", result_backend=f"{base}/2")
    return shop.app
