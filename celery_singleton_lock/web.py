"""Kept for the code that imports this path: the module is ``celery_singleton_lock.ops.web``."""

from .ops.web import (
    MIN_SECRET,
    PAGE_SIZE,
    Line,
    exposition,
    list_page,
    make_app,
    metrics_app,
    scan_lines,
    serve,
)

__all__ = [
    "MIN_SECRET",
    "PAGE_SIZE",
    "Line",
    "exposition",
    "list_page",
    "make_app",
    "metrics_app",
    "scan_lines",
    "serve",
]
