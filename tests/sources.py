"""Reading the package's source in tests (not a test module itself)."""

from __future__ import annotations

import ast
from pathlib import Path


def parse(path: Path) -> ast.Module:
    """``ast.parse`` of a file, asked again if CPython 3.11's AST converter trips over another thread's parse.

    Its recursion counter is shared by threads (CPython gh-106905, fixed in later releases): in a process where
    earlier tests left threads that compile code, a parse can raise "AST constructor recursion depth mismatch".
    """
    source = path.read_text(encoding="utf-8")
    for _ in range(4):
        try:
            return ast.parse(source, str(path))
        except SystemError:
            continue
    return ast.parse(source, str(path))
