"""The package's rooms import one another one way: no import circle, and the lock core stands apart from Celery.

Read from the sources' ASTs (nothing is imported), so a circle is caught before it bites at import time.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable
from pathlib import Path

import pytest
from sources import parse

from celery_singleton_lock.metrics import OUTCOMES

PACKAGE = Path(__file__).resolve().parent.parent / "celery_singleton_lock"
#: The package's modules, and its subpackages (``policies``) as one module each.
MODULES = frozenset(p.stem for p in PACKAGE.glob("*.py")) | frozenset(
    p.parent.name for p in PACKAGE.glob("*/__init__.py")
)
#: The lock core: scripts, the holder record, nodes and fan-out, the lease (its algorithms, and its sync and async
#: faces), its renewal and interrupt on loss (``with Redlock``), and what they stand on.
CORE = frozenset(
    {
        "scripts",
        "record",
        "nodes",
        "lease",
        "redlock",
        "aio",
        "renewal",
        "interrupt",
        "metrics",
        "_resp",
        "_urls",
        "errors",
        "_heartbeat",  # the watchdog's liveness file (stdlib only)
    }
)
CELERY_SIDE = ("celery", "kombu", "billiard", "click")


def _imports(nodes: Iterable[ast.AST]) -> tuple[set[str], set[str]]:
    """The package's modules and the top-level foreign packages that ``nodes`` import."""
    ours: set[str] = set()
    foreign: set[str] = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[0] == PACKAGE.name:
                    ours.update(parts[1:2])
                else:
                    foreign.add(parts[0])
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level == 0 and not module.startswith(PACKAGE.name):
                foreign.add(module.split(".")[0])
                continue
            parts = module.split(".")[1:] if node.level == 0 else module.split(".") if module else []
            if parts and parts[0]:
                ours.add(parts[0])
            else:  # ``from . import signals``
                ours.update(alias.name for alias in node.names)
    return ours & MODULES, foreign


def _type_checking(node: ast.AST) -> bool:
    """An ``if TYPE_CHECKING:`` block: imports for the type checker only, never run."""
    return isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"


def _walk(tree: ast.AST) -> list[ast.AST]:
    """Every node of ``tree`` but those inside ``if TYPE_CHECKING:`` blocks."""
    out: list[ast.AST] = []
    todo: list[ast.AST] = [tree]
    while todo:
        node = todo.pop()
        if _type_checking(node):
            continue
        out.append(node)
        todo.extend(ast.iter_child_nodes(node))
    return out


def _source(name: str) -> ast.Module:
    """The AST of module ``name``; a subpackage's modules together, as one."""
    path = PACKAGE / f"{name}.py"
    files = [path] if path.exists() else sorted((PACKAGE / name).glob("*.py"))
    body: list[ast.stmt] = []
    for file in files:
        body.extend(parse(file).body)
    return ast.Module(body=body, type_ignores=[])


def _module_level(tree: ast.Module) -> list[ast.AST]:
    """The statements that run when the module is imported (under ``if``/``try``/``with`` too, not in functions)."""
    out: list[ast.AST] = []
    todo: list[ast.AST] = list(tree.body)
    while todo:
        node = todo.pop()
        if _type_checking(node):
            continue
        out.append(node)
        if isinstance(node, (ast.If, ast.Try, ast.With)):
            todo.extend(ast.iter_child_nodes(node))
    return out


def _graph(*, lazy: bool) -> dict[str, set[str]]:
    """Module -> the package's modules it imports (``lazy``: also the imports inside functions)."""
    graph: dict[str, set[str]] = {}
    for name in MODULES:
        tree = _source(name)
        ours, _ = _imports(_walk(tree) if lazy else _module_level(tree))
        graph[name] = ours - {name}
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle of ``graph`` (its modules in order, the first repeated at the end), or None."""
    done: set[str] = set()

    def walk(name: str, path: list[str]) -> list[str] | None:
        if name in path:
            return [*path[path.index(name) :], name]
        if name in done:
            return None
        for target in sorted(graph[name]):
            found = walk(target, [*path, name])
            if found:
                return found
        done.add(name)
        return None

    for name in sorted(graph):
        found = walk(name, [])
        if found:
            return found
    return None


def test_the_cycle_finder_finds_a_circle() -> None:
    """The circle check is not vacuous: a graph with a circle is reported with the circle's modules."""
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_no_module_imports_itself_back_at_import_time() -> None:
    """No chain of module-level imports leads from a module of the package back to itself."""
    assert _cycle(_graph(lazy=False)) is None


def test_no_circle_even_through_imports_inside_functions() -> None:
    """No chain of imports, those inside functions included, leads from a module back to itself."""
    assert _cycle(_graph(lazy=True)) is None


@pytest.mark.parametrize("name", sorted(CORE))
def test_the_lock_core_imports_nothing_of_celery_nor_the_celery_side(name: str) -> None:
    """A lock core module imports (anywhere, also inside functions) only the core's other modules, never Celery,
    kombu, billiard or click: ``Redlock`` is usable without Celery, and the Celery side sits on top of it."""
    tree = parse(PACKAGE / f"{name}.py")
    ours, foreign = _imports(ast.walk(tree))
    assert ours <= CORE, f"{name} imports {sorted(ours - CORE)} from outside the lock core"
    assert not foreign.intersection(CELERY_SIDE), f"{name} imports {sorted(foreign.intersection(CELERY_SIDE))}"


def test_every_core_module_exists() -> None:
    """The lock core's list names modules that exist (a rename must update it, or the check above checks nothing)."""
    assert CORE <= MODULES, sorted(CORE - MODULES)


#: What operators run (the page, its metrics reader, the node inventory): never the task side's internals.
OPS = ("web", "metrics", "inventory")
TASK_SIDE = frozenset(
    {"task", "_delivery", "_enqueue", "_line", "_handover", "_resend", "_run", "_monitoring", "_preskip", "policies"}
    | {"renewal", "signals", "interrupt"}
)


@pytest.mark.parametrize("name", OPS)
def test_ops_modules_import_nothing_of_the_task_side(name: str) -> None:
    """The page, /metrics and the metrics reader read the nodes through the core, config and record (and the
    doctor), never through LockedTask's rooms: they run in a web process with no worker in it."""
    ours, _ = _imports(_walk(_source(name)))
    assert not ours & TASK_SIDE, f"{name} imports {sorted(ours & TASK_SIDE)}"


def test_every_outcome_counted_is_one_of_the_metrics_vocabulary() -> None:
    """``LockedTask._count("...")`` names an outcome of ``metrics.OUTCOMES`` everywhere: an unknown name would be
    counted under a field no stats table, page or /metrics family shows (the rate room once counted "rate_limited")."""
    counted: set[str] = set()
    for file in PACKAGE.rglob("*.py"):
        for node in ast.walk(parse(file)):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == "_count"
                and node.args
                and isinstance(node.args[0], ast.Constant)
            ):
                counted.add(str(node.args[0].value))
    assert counted, "no _count call found: the test looks in the wrong place"
    assert counted <= set(OUTCOMES), f"counted but not in OUTCOMES: {sorted(counted - set(OUTCOMES))}"


def test_no_circle_in_the_lock_core_even_through_type_only_imports() -> None:
    """Within the lock core, no chain of imports leads from a module back to itself, counting the imports inside
    functions and those under ``if TYPE_CHECKING:`` (the renewal depends on a protocol, not on ``Redlock``)."""
    graph = {name: _imports(ast.walk(_source(name)))[0] & CORE - {name} for name in CORE}
    assert _cycle(graph) is None


#: The faces of the lease: they drive ``lease.py``'s step machines and send no script of their own.
FACES = ("redlock", "aio")


def _calls(tree: ast.AST, attr: str) -> list[ast.Call]:
    """The calls ``<anything>.<attr>(...)`` in ``tree``."""
    return [
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == attr
    ]


@pytest.mark.parametrize("name", FACES)
def test_the_lease_faces_do_not_re_implement_the_algorithm(name: str) -> None:
    """``Redlock`` and ``AsyncRedlock`` send no script themselves: they import no script of ``scripts.py`` and call
    the fan-out (``run``) only inside a driver (``drive``), so acquire, extend, release and hand-over are written
    once, as ``lease.py``'s step machines."""
    tree = _source(name)
    scripts = [
        alias.name
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and node.module == "scripts" and node.level == 1
        for alias in node.names
        if alias.name != "Script"
    ]
    assert not scripts, f"{name} imports scripts {scripts}: the step machines in lease.py send them"
    drivers = [node for node in ast.walk(tree) if isinstance(node, ast.AsyncFunctionDef | ast.FunctionDef)]
    inside = {id(call) for fn in drivers if fn.name == "drive" for call in _calls(fn, "run")}
    outside = [call.lineno for call in _calls(tree, "run") if id(call) not in inside]
    assert not outside, f"{name}.py calls run() outside a driver at lines {outside}"


def test_the_lease_algorithms_do_no_io() -> None:
    """``lease.py`` (the step machines) yields requests and never sends one: no client, socket, thread or event loop
    imported (of redis, only its exception types), no ``run`` or ``drive`` called."""
    tree = _source("lease")
    _, foreign = _imports(ast.walk(tree))
    assert not foreign & {"asyncio", "socket", "selectors", "threading"}, sorted(foreign)
    named = {node.module or "" for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.level == 0}
    plain = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    assert {m for m in named | plain if m.split(".")[0] == "redis"} <= {"redis.exceptions"}
    assert not _calls(tree, "run")
    assert not _calls(tree, "drive")
