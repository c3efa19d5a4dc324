"""The package's rooms import one another one way: no import circle, and the lock core stands apart from Celery.

Read from the sources' ASTs (nothing is imported), so a circle is caught before it bites at import time.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterable
from pathlib import Path

import pytest
from sources import parse

from celery_singleton_lock.lock.metrics import OUTCOMES

PACKAGE = Path(__file__).resolve().parent.parent.parent / "celery_singleton_lock"
#: The wings (docs/DESIGN's table): each a subpackage; the root holds them and the public faces only.
WINGS = ("lock", "policies", "task", "ops", "testing")
#: Subpackages read as one unit each (their modules import one another freely): a feature and its port, the page.
WHOLE = ("policies", "ops.web")
#: What a wing may import (a wing's name: any of its modules; a dotted name: that module only), counting imports
#: under ``if TYPE_CHECKING:`` and inside functions. Every wing may import the root's ``errors``; ``testing`` anything.
MAY_IMPORT = {
    "lock": ("lock",),
    "policies": ("policies", "lock"),
    "task": ("task", "lock", "policies"),
    # ops is the top wing: the doctor runs the worker's own checks through task.checks (the task wing's face to ops),
    # so both say the same; nothing below imports ops.
    "ops": ("ops", "lock", "policies", "task.checks"),
    "testing": (*WINGS, "__init__"),
}
#: The root's own modules (not shims): the package's face, the errors (pickled by their module path: a rolling
#: deploy's two versions read each other's exceptions) and the pytest plugin (an entry point that imports nothing
#: until a fixture asks).
ROOT_MODULES = frozenset({"__init__", "errors", "pytest_plugin"})
#: Arrows against MAY_IMPORT that are there today, each with its reason; an arrow fixed must leave (tested below).
KNOWN_ARROWS: dict[tuple[str, str], str] = {}
CELERY_SIDE = ("celery", "kombu", "billiard", "click")


def _unit(relative: str) -> str:
    """The unit of a module named relative to the package (``lock.redlock``, ``policies``, ``__init__``)."""
    for whole in WHOLE:
        if relative == whole or relative.startswith(f"{whole}."):
            return whole
    return relative or "__init__"


def _files() -> dict[str, list[Path]]:
    out: dict[str, list[Path]] = {}
    for file in sorted(PACKAGE.rglob("*.py")):
        parts = file.relative_to(PACKAGE).with_suffix("").parts
        out.setdefault(_unit(".".join(parts[:-1] if parts[-1] == "__init__" else parts)), []).append(file)
    return out


#: Unit -> its files; a unit is a module of the package, or a subpackage of WHOLE.
FILES = _files()
MODULES = frozenset(FILES)
#: The lock core: the lock wing's modules.
CORE = frozenset(name for name in MODULES if name.startswith("lock."))


def _resolve(dotted: str) -> str:
    """The unit an absolute module name of the package falls in."""
    parts = dotted.split(".")[1:]
    while parts:
        name = _unit(".".join(parts))
        if name in MODULES:
            return name
        parts = parts[:-1]
    return "__init__"


def _imports(nodes: Iterable[ast.AST]) -> tuple[set[str], set[str]]:
    """The package's units and the top-level foreign packages that ``nodes`` import (their relative imports made
    absolute by ``_source``)."""
    ours: set[str] = set()
    foreign: set[str] = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == PACKAGE.name:
                    ours.add(_resolve(alias.name))
                else:
                    foreign.add(alias.name.split(".")[0])
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if module.split(".")[0] != PACKAGE.name:
                foreign.add(module.split(".")[0])
                continue
            for alias in node.names:
                name = f"{module}.{alias.name}"
                relative = _unit(name.split(".", 1)[1])
                ours.add(_resolve(name) if relative in MODULES else _resolve(module))
    return ours & MODULES, foreign


def _absolute(node: ast.ImportFrom, file: Path) -> str:
    """The absolute module a relative import of ``file`` names."""
    parts = [PACKAGE.name, *file.relative_to(PACKAGE).with_suffix("").parts][:-1]
    parts = parts[: len(parts) - (node.level - 1)]
    return ".".join([*parts, *([node.module] if node.module else [])])


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
    """The AST of unit ``name`` (a subpackage of WHOLE: its modules together, as one), relative imports absolute."""
    body: list[ast.stmt] = []
    for file in FILES[name]:
        tree = parse(file)
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level:
                node.module, node.level = _absolute(node, file), 0
        body.extend(tree.body)
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


def _graph(*, lazy: bool, typing: bool = False) -> dict[str, set[str]]:
    """Unit -> the package's units it imports (``lazy``: also the imports inside functions; ``typing``: also those
    under ``if TYPE_CHECKING:``, which are arrows of the design as much as the others)."""
    graph: dict[str, set[str]] = {}
    for name in MODULES:
        tree = _source(name)
        nodes = list(ast.walk(tree)) if typing else _walk(tree) if lazy else _module_level(tree)
        ours, _ = _imports(nodes)
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


def test_no_circle_counting_type_only_imports_and_imports_inside_functions() -> None:
    """No chain of imports, those under ``if TYPE_CHECKING:`` and inside functions included, leads from a module back
    to itself (the Celery side was one 12-file circle through its type-only imports of ``task``)."""
    assert _cycle(_graph(lazy=True, typing=True)) is None


#: The folders inside a WHOLE unit (read as one unit above, so a circle between their modules would go unseen).
INNER = sorted(p for p in (PACKAGE / "policies").iterdir() if (p / "__init__.py").exists())


def _inner_graph(folder: Path) -> dict[str, set[str]]:
    """Module of ``folder`` (``__init__`` too) -> the modules of ``folder`` it imports, every kind of import counted
    (inside functions, under ``if TYPE_CHECKING:``); ``from . import x`` counts as importing ``__init__``."""
    names = {file.stem for file in folder.glob("*.py")}
    dotted = ".".join((PACKAGE.name, *folder.relative_to(PACKAGE).parts))
    graph: dict[str, set[str]] = {}
    for name in names:
        targets: set[str] = set()
        for node in ast.walk(parse(folder / f"{name}.py")):
            if isinstance(node, ast.ImportFrom) and node.level == 1:
                targets.add(node.module.split(".")[0] if node.module else "__init__")
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith(f"{dotted}."):
                targets.add((node.module or "")[len(dotted) + 1 :].split(".")[0])
        graph[name] = (targets & names) - {name}
    return graph


@pytest.mark.parametrize("folder", INNER, ids=lambda p: p.name)
def test_the_rooms_of_a_folder_inside_policies_import_one_way(folder: Path) -> None:
    """policies/rate/'s modules import one another one way, every kind of import counted (policies/rate.py and
    rate_booking.py imported each other, one way through imports inside functions): its face imports them, none
    imports the face back."""
    graph = _inner_graph(folder)
    assert graph.get("__init__"), f"{folder.name}/__init__.py imports none of its rooms: the test reads nothing"
    assert _cycle(graph) is None


def _wing(name: str) -> str:
    """The wing of unit ``name``, or ``root``."""
    first = name.split(".", maxsplit=1)[0]
    return first if first in WINGS else "root"


def _allowed(source: str, target: str) -> bool:
    """Whether unit ``source`` may import unit ``target`` (MAY_IMPORT)."""
    if target == "errors" or _wing(target) == _wing(source):
        return True
    return any(target == rule or target.startswith(f"{rule}.") for rule in MAY_IMPORT[_wing(source)])


def _arrows_against_the_direction() -> set[tuple[str, str]]:
    """(unit, unit) arrows of the wings' modules that MAY_IMPORT does not allow, every kind of import counted."""
    graph = _graph(lazy=True, typing=True)
    return {
        (source, target)
        for source, targets in graph.items()
        if _wing(source) != "root"
        for target in targets
        if not _allowed(source, target)
    }


def test_each_wing_imports_only_what_its_row_allows() -> None:
    """lock imports only itself; decide only the record; policies lock and decide; task lock, decide and policies;
    ops lock and policies (the matrix), never the task side; testing anything. Type-only imports and imports inside
    functions count. An arrow against this is listed in KNOWN_ARROWS with its reason, or it fails here."""
    against = _arrows_against_the_direction() - set(KNOWN_ARROWS)
    assert not against, f"arrows against the wings' direction: {sorted(against)}"


def test_every_known_arrow_is_still_there() -> None:
    """KNOWN_ARROWS lists only arrows that exist (one fixed must leave the list)."""
    stale = set(KNOWN_ARROWS) - _arrows_against_the_direction()
    assert not stale, f"no longer there (take them out of KNOWN_ARROWS): {sorted(stale)}"


def test_the_direction_checker_sees_an_arrow() -> None:
    """The wing rule is not vacuous: lock importing task, or ops importing a task room, is refused."""
    assert not _allowed("lock.redlock", "task._run")
    assert not _allowed("ops.cli", "task._run")
    assert _allowed("task._run", "lock.redlock")
    assert _allowed("testing", "task._run")


def _is_shim(file: Path) -> bool:
    """A root module that only re-exports a wing's module: a docstring, imports from a wing, ``__all__``, and a
    module ``__getattr__`` forwarding to the wing's module (what it builds on first use, PEP 562)."""
    for node in parse(file).body:
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            continue
        if isinstance(node, ast.ImportFrom) and node.level == 1 and (node.module or "").split(".")[0] in WINGS:
            continue
        if isinstance(node, ast.ImportFrom) and node.module == "typing":
            continue
        if isinstance(node, ast.FunctionDef) and node.name == "__getattr__":
            body = [n for n in node.body if not (isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant))]
            imports_a_wing = isinstance(body[0], ast.ImportFrom) and body[0].level == 1 and body[0].module in WINGS
            if len(body) == 2 and imports_a_wing and ast.unparse(body[1]).startswith("return getattr("):
                continue
        if isinstance(node, ast.Assign) and [ast.unparse(t) for t in node.targets] == ["__all__"]:
            continue
        return False
    return True


def test_the_root_holds_only_public_modules_and_the_wings() -> None:
    """At the package root: its own public modules (ROOT_MODULES), public modules kept as shims of a wing's module,
    the wings, ``py.typed``; no private module, no other folder."""
    names = {p.name for p in PACKAGE.iterdir() if p.name != "__pycache__"}
    folders = {p.name for p in PACKAGE.iterdir() if p.is_dir() and p.name != "__pycache__"}
    assert folders == set(WINGS), sorted(folders ^ set(WINGS))
    modules = {p.stem: p for p in PACKAGE.glob("*.py")}
    assert not [m for m in modules if m.startswith("_") and m != "__init__"], sorted(modules)
    not_shims = sorted(m for m, p in modules.items() if m not in ROOT_MODULES and not _is_shim(p))
    assert not not_shims, f"root modules that are neither public faces nor shims: {not_shims}"
    assert names - {p.name for p in modules.values()} - folders <= {"py.typed"}, sorted(names)


#: The Celery side's rooms: the task wing's private modules and its signals (not ``LockedTask``'s own, the table of
#: contents, nor the integrations beside it: beat, otel, sentry).
ROOMS = frozenset(name for name in MODULES if name.startswith("task._") or name == "task.signals")


@pytest.mark.parametrize("name", sorted(ROOMS))
def test_no_room_imports_the_task_module(name: str) -> None:
    """A Celery-side room takes the context LockedTask builds (``_run.Context``) and never imports ``task``, not
    even for the type checker nor inside a function: LockedTask stays the table of contents above the rooms."""
    ours, _ = _imports(ast.walk(_source(name)))
    assert "task" not in ours, f"{name} imports the task module"


@pytest.mark.parametrize("name", sorted(ROOMS))
def test_no_room_calls_a_private_method_of_the_task(name: str) -> None:
    """The rooms reach LockedTask only through the context: no ``task._count``, ``task._options()``, ``task._key``
    ... (35 such calls before the seam)."""
    calls = [
        f"{node.value.id}.{node.attr}"  # type: ignore[attr-defined]
        for node in ast.walk(_source(name))
        if isinstance(node, ast.Attribute)
        and isinstance(node.value, ast.Name)
        and node.value.id in ("task", "sender")
        and node.attr.startswith("_")
        and not node.attr.startswith("__")
    ]
    assert not calls, f"{name} calls {sorted(set(calls))}"


@pytest.mark.parametrize("name", sorted(n for n in MODULES if _wing(n) in ("lock", "policies")))
def test_the_core_decide_and_policies_import_nothing_of_celery(name: str) -> None:
    """The lock core, the decision and the features import (anywhere, also inside functions) nothing of Celery,
    kombu, billiard or click: ``Redlock`` is usable without Celery, and what a feature needs of Celery it gets
    through the context a room hands it."""
    _, foreign = _imports(ast.walk(_source(name)))
    assert not foreign.intersection(CELERY_SIDE), f"{name} imports {sorted(foreign.intersection(CELERY_SIDE))}"


def test_every_wing_exists() -> None:
    """The wings' lists name folders that exist and hold modules (a rename must update them)."""
    assert {_wing(name) for name in MODULES} == {*WINGS, "root"}


def _counter(node: ast.expr) -> bool:
    """``node`` is what counts a task's outcomes: a context (``ctx``, ``self.ctx``, ``Context(...)``), or ``self``
    inside the context's own methods."""
    text = ast.unparse(node)
    return text in ("ctx", "self.ctx", "self", "self.task") or text.startswith("Context(")


def test_every_outcome_counted_is_one_of_the_metrics_vocabulary() -> None:
    """``Context.count("...")`` names an outcome of ``metrics.OUTCOMES`` everywhere: an unknown name would be
    counted under a field no stats table, page or /metrics family shows (the rate room once counted "rate_limited")."""
    counted: set[str] = set()
    for file in PACKAGE.rglob("*.py"):
        for node in ast.walk(parse(file)):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr in ("count", "_count")
                and _counter(node.func.value)
                and node.args
                and isinstance(node.args[0], ast.Constant)
            ):
                counted.add(str(node.args[0].value))
    assert counted, "no count call found: the test looks in the wrong place"
    assert counted <= set(OUTCOMES), f"counted but not in OUTCOMES: {sorted(counted - set(OUTCOMES))}"


# -- the feature port (issue 31): a feature is named by its own module, reached through the port elsewhere ----------

#: Each feature behind the port: its module (or its subpackage, a folder) under policies/ and the task options it owns.
FEATURE_OPTIONS = {
    "debounce": ("policies/debounce.py", ("lock_debounce", "lock_debounce_max")),
    "rate": ("policies/rate", ("lock_rate", "lock_rate_on", "lock_on_rate_limit", "lock_rate_cost")),
    "max_waiting": ("policies/waiting.py", ("lock_max_waiting",)),
    "fair": ("policies/fair.py", ("lock_fair_on",)),
    "cooldown": ("policies/cooldown.py", ("lock_cooldown",)),
    "limit": ("policies/limit.py", ("lock_limit",)),
}
#: Where a feature's option is still named outside its module, the port's matrix and task.py's declarations (issue
#: 31): the operators' words only, on purpose (explain, doctor, inventory and metrics say the option the operator set,
#: in an operator's terms). Exact counts: a new mention fails the test below. No room names a feature's option: the
#: rooms call the active features' hooks (policies/port.py).
NOT_YET_MOVED = {
    # operators' words (doctor, explain, inventory, metrics): they name the option the operator set, on purpose.
    ("cooldown", "ops/doctor.py"): 2,
    ("cooldown", "ops/explain.py"): 2,
    ("cooldown", "lock/inventory.py"): 1,
    ("debounce", "ops/explain.py"): 8,
    ("debounce", "lock/inventory.py"): 1,
    ("debounce", "lock/metrics.py"): 1,
    ("limit", "ops/explain.py"): 2,
    ("max_waiting", "ops/explain.py"): 3,
    ("rate", "ops/explain.py"): 7,
    ("rate", "lock/inventory.py"): 1,
}


def _docstrings(tree: ast.AST) -> set[int]:
    """The ids of ``tree``'s docstring constants (a module's, class's, function's, or an attribute's)."""
    out: set[int] = set()
    for node in ast.walk(tree):
        for name in ("body", "orelse"):
            body = getattr(node, name, None)
            if not isinstance(body, list):
                continue
            for statement in body:
                if isinstance(statement, ast.Expr) and isinstance(statement.value, ast.Constant):
                    out.add(id(statement.value))
    return out


def _declarations(tree: ast.Module) -> set[int]:
    """The ids of the nodes of LockedTask's option declarations (``lock_x: ClassVar[...] = ...`` in its body)."""
    out: set[int] = set()
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == "LockedTask":
            for statement in node.body:
                if isinstance(statement, ast.AnnAssign):
                    out.update(id(n) for n in ast.walk(statement))
    return out


def _option_mentions(path: Path, names: frozenset[str]) -> int:
    """How often ``path``'s code names one of ``names``: an identifier, attribute, keyword, parameter, or a word of a
    string that is not a docstring (comments and docstrings are prose, not a reach into the feature)."""
    tree = parse(path)
    skip = _docstrings(tree) | (
        _declarations(tree) if path.relative_to(PACKAGE).as_posix() == "task/__init__.py" else set()
    )
    count = 0
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        words: list[str] = []
        if isinstance(node, ast.Name):
            words = [node.id]
        elif isinstance(node, ast.Attribute):
            words = [node.attr]
        elif isinstance(node, ast.keyword) and node.arg:
            words = [node.arg]
        elif isinstance(node, ast.arg):
            words = [node.arg]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            words = re.findall(r"\w+", node.value)
        count += sum(1 for w in words if w in names)
    return count


def _feature_spread() -> dict[tuple[str, str], int]:
    """(feature, file) -> mentions of the feature's options outside its module, the matrix and task's declarations."""
    spread: dict[tuple[str, str], int] = {}
    for feature, (home, names) in FEATURE_OPTIONS.items():
        for path in sorted(PACKAGE.rglob("*.py")):
            relative = path.relative_to(PACKAGE).as_posix()
            if relative in (home, "policies/matrix.py") or relative.startswith(f"{home}/"):
                continue
            n = _option_mentions(path, frozenset(names))
            if n:
                spread[feature, relative] = n
    return spread


def test_the_option_counter_sees_a_mention() -> None:
    """The counter is not vacuous: the matrix names every feature's option, and task.py declares each one."""
    for home, names in FEATURE_OPTIONS.values():
        assert _option_mentions(PACKAGE / "policies" / "matrix.py", frozenset(names)), names
        assert (PACKAGE / home).exists(), home


def test_a_feature_is_named_only_by_its_module_the_matrix_and_the_option_declarations() -> None:
    """Outside its module under policies/, the matrix and LockedTask's option declarations, the package reaches
    debounce, rate, lock_max_waiting, cooldown and lock_limit only through the port: where one of their options is
    still named elsewhere is exactly the list of moves left (NOT_YET_MOVED), never more."""
    expected = {k: v for k, v in NOT_YET_MOVED.items() if v}
    assert _feature_spread() == expected


def test_no_circle_in_the_lock_core_even_through_type_only_imports() -> None:
    """Within the lock core, no chain of imports leads from a module back to itself, counting the imports inside
    functions and those under ``if TYPE_CHECKING:`` (the renewal depends on a protocol, not on ``Redlock``)."""
    graph = {name: _imports(ast.walk(_source(name)))[0] & CORE - {name} for name in CORE}
    assert _cycle(graph) is None


#: The faces of the lease: they drive ``lease.py``'s step machines and send no script of their own.
FACES = ("lock.redlock", "lock.aio")


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
        if isinstance(node, ast.ImportFrom) and node.module == f"{PACKAGE.name}.lock.scripts"
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
    tree = _source("lock.lease")
    _, foreign = _imports(ast.walk(tree))
    assert not foreign & {"asyncio", "socket", "selectors", "threading"}, sorted(foreign)
    named = {node.module or "" for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.level == 0}
    plain = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    assert {m for m in named | plain if m.split(".")[0] == "redis"} <= {"redis.exceptions"}
    assert not _calls(tree, "run")
    assert not _calls(tree, "drive")


# -- sizes (issue 31): a room that outgrows its size is two rooms ------------------------------------------------------

#: The most lines a module, a class and a function (or method) may have, docstrings and comments included.
MODULE_LINES, CLASS_LINES, FUNCTION_LINES = 600, 300, 60
#: What is over its size today, each with its reason (issue 31 splits those marked "to split"). A new entry needs a
#: reason a reviewer accepts; an entry no longer over its size must go (the test below says so).
OVERSIZE = {
    "testing/__init__.py": "the public test kit (servers, workers, assertions) users import from one place; to split",
    "lock/nodes.py": "the node set and its fan-out, one protocol per URL kind (plain, Sentinel, Cluster); to split",
    "ops/doctor.py": "one check per finding, each small; the module is their list",
    "testing/faults.py": "the fault proxy (issue 31: listener, state and pump); to split",
    "ops/cli.py": "one click command per operator verb, each small; the module is the command group",
    "policies/matrix.py": "the options matrix: one verdict per pair of options, data more than code",
    "lock/inventory.py": "the readers behind list/show/stats and the page, one per kind of key; to split",
    "task/_delivery.py": "a delivery's life, being moved behind the feature port (issue 31); to split",
    "lock/lease.py": "the lease's step machines, written once for both faces (issue 31)",
    "testing/faults.py:FaultProxy": "listener, fault schedule and RESP pump in one class (issue 31); to split",
    "task/__init__.py:LockedTask": (
        "the table of contents: Celery's hooks and the options' declarations, each a line or two"
    ),
    "lock/lease.py:_LeaseSpec": "the step machines of acquire, extend, release and transfer, one spec for both faces",
    "policies/debounce.py:send": "a burst's claim at send, being moved behind the port; to split",
    "task/_delivery.py:start": "a delivery's start, calling each feature's hook in order; to split",
    "testing/history.py:run_lock_client": "one client of the history checker's schedule: each step a few lines",
    "lock/nodes.py:NodeSet.run": "the fan-out: one round trip to every node at once, its answers and errors; to split",
    "ops/doctor.py:node_findings": "one finding per node check, each a few lines",
    "policies/rate/count.py:take": "the rate windows' take; being reworked (composite limits)",
    "task/beat.py:SingletonSchedulerMixin._claim": (
        "beat's claim of a schedule slot, its fallback and its log; to split"
    ),
    "lock/inventory.py:merge": "one lock's merged view over the nodes' records, by quorum",
    "lock/lease.py:_LeaseSpec._extend_steps": "the extend step machine (the batched renewal's repair and refill)",
    "policies/matrix.py:render_markdown": "docs/options.md, table by table",
    "policies/decision.py:decide": "the pure decision, one branch per fact (docs/protocol.md's table)",
    "task/_preskip.py:skipped": "the pre-check before the pool: its clear case and every way out of it",
    "ops/explain.py:_decide": "explain's verdict, one branch per feature's answer",
    "policies/debounce.py:claim": "a burst's claim at the worker, being moved behind the port",
    "task/_enqueue.py:_verdict": "the queue-scope verdict at send, one branch per reservation state",
    "lock/keys.py:_encode_other": "the canonical encoding's type dispatch, one return per type",
    "ops/cli.py:cancel_command": "locks cancel: its three ways to name a job and their errors",
    "lock/lease.py:_LeaseSpec._attempt_steps": "the acquire step machine (token, quorum, undo on a split vote)",
    "policies/debounce.py": "a burst at send and at the worker (join, check, claim, confirm); to split in two",
    "policies/rate/stack.py:take_many": "several limits' take: all or none per node, a quorum per limit, split retries",
    "lock/redlock.py:Redlock": "the public lock: a fifth of it is its docstring (the user's manual, doctested)",
}


def _sizes() -> dict[str, tuple[int, int]]:
    """Each module (``path``), class and function (``path:Qual.name``) of the package -> (lines, its limit)."""
    sizes: dict[str, tuple[int, int]] = {}
    for file in sorted(PACKAGE.rglob("*.py")):
        relative = file.relative_to(PACKAGE).as_posix()
        sizes[relative] = (file.read_text(encoding="utf-8").count("\n"), MODULE_LINES)
        todo: list[tuple[ast.AST, str]] = [(parse(file), "")]
        while todo:
            node, outer = todo.pop()
            for child in ast.iter_child_nodes(node):
                if isinstance(child, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                    name = f"{outer}{child.name}"
                    limit = CLASS_LINES if isinstance(child, ast.ClassDef) else FUNCTION_LINES
                    sizes[f"{relative}:{name}"] = ((child.end_lineno or child.lineno) - child.lineno + 1, limit)
                    todo.append((child, f"{name}."))
                else:
                    todo.append((child, outer))
    return sizes


def test_no_module_class_or_function_is_over_its_size_unless_listed_with_a_reason() -> None:
    """No module over 600 lines, class over 300 or function over 60 (``render`` was 213 lines, ``make_app`` 181,
    ``web.py`` 1,282): a room that outgrows its size is split where it has a seam, or listed in OVERSIZE with why."""
    over = {name: lines for name, (lines, limit) in _sizes().items() if lines > limit and name not in OVERSIZE}
    assert not over, f"over their size, not in OVERSIZE: {over}"


def test_every_size_exception_is_still_over_its_size() -> None:
    """OVERSIZE names only what exists and is still over its size (a split must take its entry out)."""
    sizes = _sizes()
    stale = sorted(name for name in OVERSIZE if name not in sizes or sizes[name][0] <= sizes[name][1])
    assert not stale, f"no longer over their size (take them out of OVERSIZE): {stale}"
