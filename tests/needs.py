"""Skip a test whose dependency is missing here, but fail it under ``CI=true``: CI must run every test.

Not a test module itself; the RabbitMQ, TLS and optional-package tests share it.
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType

import pytest


def in_ci() -> bool:
    """True where ``CI`` says so (``true`` or ``1``, as GitHub Actions and most runners set it)."""
    return os.environ.get("CI", "").lower() in ("true", "1")


def missing(reason: str, what: str) -> None:
    """Skip the calling test for ``reason``; under CI=true fail it instead, naming ``what`` CI must run."""
    if in_ci():
        pytest.fail(f"CI must run {what}: {reason}", pytrace=False)
    pytest.skip(reason, allow_module_level=True)  # also from a module's top (test_compose.py's yaml)


def module(name: str, reason: str) -> ModuleType:
    """Import ``name``, or skip (under CI=true: fail) the calling test with ``reason``."""
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        error = str(exc)  # missing() is called outside the handler: a failure with no chained traceback
    missing(f"{name} cannot be imported ({error}): {reason}", f"the tests that need {name}")
    raise AssertionError("unreachable: missing() always raises")
