#!/usr/bin/env python3
"""Move the package's flat modules into its wings (issue 31), and tests/ into folders that mirror them.

Run from a clean checkout, once: ``python tools/move_wings.py`` (``--dry-run`` prints the plan and changes nothing).
It refuses to run on a dirty tree, on a tree where the moves are done already, and where a module or a test file is
in none of the tables below (add its row, then run it again). Steps, all derived from the tables:

1. ``git mv`` each module of MODULES (and the ``web`` and ``lua`` folders) to its wing, each test file of TESTS to
   its folder;
2. rewrite every import of the package (relative and absolute, module level, in functions, under TYPE_CHECKING) in
   the package, tests/, benchmarks/, examples/, tools/ and the root conftest.py, and the dotted names, file paths
   and test paths in every text file (docs, README, pyproject.toml, Makefile, .ci, ...). Inside the package and in
   tests/benchmarks/tools, imports name the real module; docs, README and examples keep the public paths (their shims);
3. write the root's compatibility shims: each public (underscore-free) module that moved keeps its old path as a
   module re-exporting its public names from the wing; private modules move without one. Logger names are literal
   strings in the code and stay as they are;
4. patch the few files that read the tree by path (test_layout, test_protocol_doc, test_packaging, pyproject's
   package data) and write test_layout's wing rules;
5. run ``ruff check --fix`` and ``ruff format``.
"""

from __future__ import annotations

import argparse
import ast
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PKG = "celery_singleton_lock"
WINGS = ("lock", "decide", "policies", "task", "ops", "testing")

#: Root module -> its new dotted path under the package. ``task`` and ``testing`` become their wings' ``__init__``:
#: they are the wings' public faces and keep their module identity (``celery_singleton_lock.task.LockedTask``).
MODULES = {
    # lock/: the core, Celery-free
    "scripts": "lock.scripts",
    "record": "lock.record",
    "nodes": "lock.nodes",
    "lease": "lock.lease",
    "redlock": "lock.redlock",
    "aio": "lock.aio",
    "renewal": "lock.renewal",
    "interrupt": "lock.interrupt",
    "metrics": "lock.metrics",
    "keys": "lock.keys",
    "config": "lock.config",
    "_resp": "lock._resp",
    "_urls": "lock._urls",
    "_heartbeat": "lock._heartbeat",
    # decide/: the pure decision
    "facts": "decide.facts",
    "decision": "decide.decision",
    # task/: the Celery side
    "task": "task",
    "_run": "task._run",
    "_enqueue": "task._enqueue",
    "_delivery": "task._delivery",
    "_line": "task._line",
    "_resend": "task._resend",
    "_handover": "task._handover",
    "_monitoring": "task._monitoring",
    "_preskip": "task._preskip",
    "_startup": "task._startup",
    "_brokers": "task._brokers",
    "_reach": "task._reach",
    "signals": "task.signals",
    "beat": "task.beat",
    "otel": "task.otel",
    "sentry": "task.sentry",
    # ops/: what operators run
    "cli": "ops.cli",
    "doctor": "ops.doctor",
    "inventory": "ops.inventory",
    "health": "ops.health",
    "explain": "ops.explain",
    "_gauges": "ops._gauges",
    "web": "ops.web",  # a package
    # testing/: the test kit
    "testing": "testing",
    "faults": "testing.faults",
    "history": "testing.history",
}
#: Folders that move (package data and subpackages).
FOLDERS = {"lua": "lock/lua", "web": "ops/web"}
#: What stays at the root: the package's face, the errors (pickled by module path: a rolling deploy's workers on
#: both versions must read each other's exceptions), the pytest plugin (an entry point that must import nothing
#: until a fixture asks: tests/testing/test_pytest_plugin.py), and the wing that was a package already.
STAY = {"__init__", "errors", "pytest_plugin", "policies"}
#: The wings' new ``__init__`` files (the others come with a moved module or exist).
NEW_INITS = {
    "lock": "The lock core: the lease, its nodes and fan-out, the record, the scripts, renewal. Nothing of Celery.",
    "decide": "The pure decision: what a delivery meets (facts) and what it does about it (decide).",
    "ops": "What operators run: the ``celery locks`` commands, the doctor, the inventory, the page, the probes.",
}

#: Test file -> its folder under tests/ (the wing it tests; ``project`` for the repository's own checks).
TESTS = {
    "lock": [
        "test_aio", "test_redlock", "test_redlock_with", "test_resp", "test_keys_config", "test_keys_v2",
        "test_topologies", "test_secrets", "test_credentials", "test_server_ownership", "test_hardening",
        "test_metrics",
    ],
    "decide": ["test_decision"],
    "policies": [
        "test_cancel", "test_debounce", "test_fair", "test_limit", "test_limit_workers", "test_rate",
        "test_rate_options", "test_rate_rabbitmq", "test_rate_workers", "test_reschedule", "test_matrix",
    ],
    "task": [
        "test_locked_task", "test_locked_task_faults", "test_locked_task_workers", "test_enqueue_async",
        "test_preskip", "test_monitoring", "test_rabbitmq", "test_queue_scope", "test_queue_scope_races",
        "test_copies", "test_start_checks", "test_task_eager", "test_fast_tier", "test_lock_on_lost", "test_beat",
        "test_beat_django", "test_beat_dst", "test_beat_overlap", "test_valkey", "test_otel", "test_sentry",
    ],
    "ops": ["test_cli", "test_doctor", "test_explain", "test_health", "test_web", "test_web_examples", "test_flower"],
    "testing": ["test_fault_proxy", "test_history", "test_pytest_plugin", "test_model", "test_worker_cluster",
                "test_promises_e2e"],
    "project": [
        "test_layout", "test_protocol_doc", "test_readme", "test_docs_site", "test_packaging", "test_examples",
        "test_demo", "test_compose", "test_docker_compose", "test_docker_smoke",
    ],
}  # fmt: skip
TEST_WING = {name: wing for wing, names in TESTS.items() for name in names}
#: Where the Python files whose imports are rewritten live; the others (below) are text.
INTERNAL = ("celery_singleton_lock", "tests", "benchmarks", "tools", "conftest.py")
PUBLIC = ("examples",)
TEXT_SUFFIXES = {".md", ".toml", ".yml", ".yaml", ".cfg", ".ini", ".txt", ".sh", ".json", ""}
SKIP = ("tools/move_wings.py", "tools/wings_layout.py.txt", "CHANGELOG.md")


def run(*args: str) -> str:
    return subprocess.run(args, cwd=ROOT, check=True, capture_output=True, text=True).stdout  # noqa: S603


def die(message: str) -> None:
    sys.exit(f"move_wings: {message}")


# -- names ------------------------------------------------------------------------------------------------------------


def old_modules() -> set[str]:
    """Every dotted module of the package as it stands (``celery_singleton_lock.web.app``, ...)."""
    out = set()
    for path in (ROOT / PKG).rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        out.add(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return out


def new_module(name: str) -> str:
    """The new dotted path of old module ``name`` (unchanged where it does not move)."""
    parts = name.split(".")
    if parts[0] != PKG or len(parts) < 2 or parts[1] not in MODULES:
        return name
    return ".".join([PKG, *MODULES[parts[1]].split("."), *parts[2:]])


def shimmed(name: str) -> bool:
    """Old module ``name`` keeps its path as a root shim (public, moved, not a wing's face itself)."""
    parts = name.split(".")
    return len(parts) == 2 and parts[0] == PKG and parts[1] in MODULES and public(parts[1])


def public(root_module: str) -> bool:
    return not root_module.startswith("_") and MODULES[root_module] != root_module


def new_path(rel: str) -> str:
    """The new repository path of file ``rel``."""
    parts = rel.split("/")
    if parts[0] == PKG and len(parts) >= 2:
        if parts[1] in FOLDERS and len(parts) > 2:
            return "/".join([PKG, FOLDERS[parts[1]], *parts[2:]])
        stem = parts[1].removesuffix(".py")
        if len(parts) == 2 and parts[1].endswith(".py") and stem in MODULES:
            target = MODULES[stem].split(".")
            if target[-1] in WINGS and len(target) == 1:
                return "/".join([PKG, *target, "__init__.py"])
            return "/".join([PKG, *target]) + ".py"
    if parts[0] == "tests" and len(parts) == 2 and parts[1].endswith(".py") and parts[1][:-3] in TEST_WING:
        return f"tests/{TEST_WING[parts[1][:-3]]}/{parts[1]}"
    return rel


def module_of(rel: str) -> str:
    """The dotted module of package file ``rel`` (a package's ``__init__`` is the package)."""
    parts = Path(rel).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


# -- imports ----------------------------------------------------------------------------------------------------------


def absolute(node: ast.ImportFrom, rel: str) -> str:
    if not node.level:
        return node.module or ""
    base = module_of(rel).split(".")
    if not rel.endswith("__init__.py"):
        base = base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join([*base, *([node.module] if node.module else [])])


def relative(target: str, new_rel: str) -> str:
    """``target`` (dotted) as seen from package file ``new_rel``: ``..lock.record``."""
    here = module_of(new_rel).split(".")
    if not new_rel.endswith("__init__.py"):
        here = here[:-1]
    there = target.split(".")
    common = 0
    while common < min(len(here), len(there)) and here[common] == there[common]:
        common += 1
    return "." * (len(here) - common + 1) + ".".join(there[common:])


def alias_text(alias: ast.alias) -> str:
    return alias.name + (f" as {alias.asname}" if alias.asname else "")


def rewrite_imports(source: str, rel: str, new_rel: str, modules: set[str], *, internal: bool) -> str:
    """``source`` with each import of the package naming the new module (``internal``), or only the moved modules
    that keep no shim (public code: docs' and examples' readers import the public paths)."""
    tree = ast.parse(source)
    in_package = rel.startswith(f"{PKG}/")
    edits: list[tuple[int, int, int, int, str]] = []

    def target(name: str) -> str:
        parts = name.split(".")
        moved = len(parts) >= 2 and parts[1] in MODULES
        if internal or (moved and (parts[1].startswith("_") or len(parts) > 2)):
            return new_module(name)
        return name

    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            old = absolute(node, rel)
            if old != PKG and not old.startswith(f"{PKG}."):
                continue
            groups: dict[str, list[str]] = {}
            for alias in node.names:
                full = f"{old}.{alias.name}"
                if full in modules and new_module(full) != full and (internal or not shimmed(full)):
                    parent, _, name = new_module(full).rpartition(".")
                    groups.setdefault(parent, []).append(alias_text(ast.alias(name, alias.asname)))
                else:
                    groups.setdefault(target(old), []).append(alias_text(alias))
            as_relative = in_package and node.level > 0
            lines = []
            for parent, names in groups.items():
                where = relative(parent, new_rel) if as_relative else parent
                lines.append(f"from {where} import {', '.join(names)}")
            original = "." * node.level + (node.module or "")
            same_names = len(groups) == 1 and next(iter(groups.values())) == [alias_text(a) for a in node.names]
            if same_names and lines[0].split()[1] == original:
                continue
            if same_names:
                # only the module changes: rewrite the head, keep the names and their comments as they are
                head = f"from {lines[0].split()[1]} import"
                edits.append((node.lineno, node.col_offset, node.lineno, node.col_offset, f"@HEAD@{original}@{head}"))
                continue
            statement = ast.get_source_segment(source, node) or ""
            if "#" in statement:
                print(f"move_wings: {new_rel}:{node.lineno}: comments inside a split import are lost", file=sys.stderr)
            end = (node.end_lineno or node.lineno, node.end_col_offset or 0)
            edits.append((node.lineno, node.col_offset, *end, "\n".join(lines)))
        elif isinstance(node, ast.Import):
            names = []
            for alias in node.names:
                name = alias.name
                if (name == PKG or name.startswith(f"{PKG}.")) and (alias.asname or not shimmed(name)):
                    name = new_module(name)
                names.append(alias_text(ast.alias(name, alias.asname)))
            if names != [alias_text(a) for a in node.names]:
                text = f"import {', '.join(names)}"
                edits.append(
                    (node.lineno, node.col_offset, node.end_lineno or node.lineno, node.end_col_offset or 0, text)
                )
    lines = source.splitlines(keepends=True)
    for start, col, end, end_col, statement in sorted(edits, reverse=True):
        if statement.startswith("@HEAD@"):
            original, head = statement.removeprefix("@HEAD@").split("@", 1)
            line = lines[start - 1]
            found = re.compile(rf"from\s+{re.escape(original)}\s+import").search(line, col)
            if not found:
                die(f"{rel}:{start}: cannot find the import's head 'from {original} import'")
            lines[start - 1] = line[: found.start()] + head + line[found.end() :]
            continue
        head, tail = lines[start - 1][:col], lines[end - 1][end_col:]
        lines[start - 1 : end] = [head + statement.replace("\n", "\n" + " " * col) + tail]
    return "".join(lines)


# -- text -------------------------------------------------------------------------------------------------------------


def text_rules() -> list[tuple[re.Pattern[str], Callable[[re.Match[str]], str]]]:
    private = "|".join(sorted((m for m in MODULES if m.startswith("_")), key=len, reverse=True))
    files = "|".join(sorted((re.escape(m) for m in MODULES if m not in FOLDERS), key=len, reverse=True))
    web = "|".join(p.stem for p in (ROOT / PKG / "web").glob("*.py") if p.stem != "__init__")
    tests = "|".join(sorted(TEST_WING, key=len, reverse=True))
    return [
        # dotted names of private modules (no shim keeps them) and of web's rooms
        (re.compile(rf"\b{PKG}\.({private})\b"), lambda m: f"{PKG}.{MODULES[m[1]]}"),
        (re.compile(rf"\b{PKG}\.web\.({web})\b"), lambda m: f"{PKG}.ops.web.{m[1]}"),
        # file paths
        (re.compile(rf"\b{PKG}/({files})\.py\b"), lambda m: new_path(f"{PKG}/{m[1]}.py")),
        (re.compile(rf"\b{PKG}/(web|lua)\b"), lambda m: f"{PKG}/{FOLDERS[m[1]]}"),
        (re.compile(rf"\b{PKG}/_\{{"), lambda m: f"{PKG}/task/_{{"),
        # test paths
        (re.compile(rf"\btests/({tests})\.py\b"), lambda m: f"tests/{TEST_WING[m[1]]}/{m[1]}.py"),
    ]


def rewrite_text(text: str) -> str:
    for pattern, replace in text_rules():
        text = pattern.sub(replace, text)
    return text


def deeper(text: str) -> str:
    """A test file moved one folder down: ``Path(__file__).parent`` and friends name one more parent."""
    return re.sub(r"(Path\(__file__\)(?:\.resolve\(\))?)\.parent\b", r"\1.parent.parent", text)


# -- patches ----------------------------------------------------------------------------------------------------------

#: (file, old, new): exact replacements in files that read the tree by path; each must be found.
PATCHES = [
    ("pyproject.toml", 'celery_singleton_lock = ["py.typed", "lua/*.lua"]',
     'celery_singleton_lock = ["py.typed"]\n"celery_singleton_lock.lock" = ["lua/*.lua"]'),
    ("tests/project/test_protocol_doc.py", 'ROOT / "celery_singleton_lock" / "lua"',
     'ROOT / "celery_singleton_lock" / "lock" / "lua"'),
    ("tests/project/test_protocol_doc.py", 'ROOT / "celery_singleton_lock" / "record.py"',
     'ROOT / "celery_singleton_lock" / "lock" / "record.py"'),
    ("tests/project/test_protocol_doc.py", '(ROOT / "tests").glob("test_*.py")', '(ROOT / "tests").rglob("test_*.py")'),
    ("tests/project/test_protocol_doc.py", 'f"tests/{path.name}::{node.name}"',
     'f"{path.relative_to(ROOT).as_posix()}::{node.name}"'),
    ("tests/project/test_packaging.py", 'f"{PACKAGE}/lua/{p.name}"', 'f"{PACKAGE}/lock/lua/{p.name}"'),
    ("tests/project/test_packaging.py", '(ROOT / PACKAGE / "lua")', '(ROOT / PACKAGE / "lock" / "lua")'),
    ("tests/project/test_packaging.py", 'f"{PACKAGE}/task.py"', 'f"{PACKAGE}/task/__init__.py"'),
    ("tests/project/test_layout.py", 'path.name == "task.py"', 'path.relative_to(PACKAGE).as_posix() == "task.py"'),
    ("tests/project/test_layout.py", 'FACES = ("redlock", "aio")', 'FACES = ("lock.redlock", "lock.aio")'),
    ("tests/project/test_layout.py", '_source("lease")', '_source("lock.lease")'),
    ("tests/project/test_layout.py", 'node.module == "scripts" and node.level == 1',
     'node.module == f"{PACKAGE.name}.lock.scripts"'),
]  # fmt: skip


def patch(rel: str, old: str, new: str) -> None:
    path = ROOT / rel
    text = path.read_text(encoding="utf-8")
    if old not in text:
        die(f"{rel}: expected text not found (update PATCHES): {old!r}")
    path.write_text(text.replace(old, new), encoding="utf-8")


def layout_keys(text: str) -> str:
    """test_layout's OVERSIZE / NOT_YET_MOVED / FEATURE_OPTIONS keys are paths relative to the package."""
    names = "|".join(sorted((re.escape(m) for m in MODULES if m not in FOLDERS), key=len, reverse=True))

    def key(m: re.Match[str]) -> str:
        return m[1] + new_path(f"{PKG}/{m[2]}.py").removeprefix(f"{PKG}/") + m[3]

    text = re.sub(rf'(")({names})\.py([:"])', key, text)
    return re.sub(r'"web/', '"ops/web/', text)


def write_layout_rules() -> None:
    """Replace test_layout's flat-module layering (from ``PACKAGE =`` up to ``def _counter``) with the wings'."""
    path = ROOT / "tests/project/test_layout.py"
    text = path.read_text(encoding="utf-8")
    start, end = text.find("\nPACKAGE = "), text.find("\ndef _counter(")
    if start < 0 or end < 0:
        die("tests/project/test_layout.py: the block from 'PACKAGE =' to 'def _counter(' is not there")
    template = (ROOT / "tools" / "wings_layout.py.txt").read_text(encoding="utf-8")
    path.write_text(text[:start] + "\n" + template + "\n" + text[end:], encoding="utf-8")


LIMIT = 120


def wrap(path: Path, numbers: list[int]) -> None:
    """Lines ``numbers`` of ``path`` (over LIMIT after the rewrite) split at a space: a comment goes on as a
    comment, a dict entry's string as two literals, a docstring's line as the next line at its indentation."""
    before = path.read_text(encoding="utf-8")
    lines = before.split("\n")
    for number in sorted(numbers, reverse=True):
        line = lines[number - 1]
        indent = line[: len(line) - len(line.lstrip())]
        stripped = line.strip()
        if stripped.startswith("#") and re.search(r" -{4,}$", line):  # a banner: fewer dashes
            lines[number - 1] = line[:LIMIT]
            continue
        entry = re.fullmatch(r'(\s*"[^"]*": )"(.*)",', line)
        cut = line.rfind(" ", len(indent) + 8, LIMIT - 1)
        if entry:
            text = entry[2]
            half = text.rfind(" ", 0, len(text) // 2 + 20)
            lines[number - 1 : number] = [
                f"{entry[1]}(",
                f'{indent}    "{text[: half + 1]}"',
                f'{indent}    "{text[half + 1 :]}"',
                f"{indent}),",
            ]
        elif cut > 0 and stripped.startswith("#"):
            lines[number - 1 : number] = [line[:cut], f"{indent}# {line[cut + 1 :]}"]
        elif cut > 0:
            lines[number - 1 : number] = [line[:cut], f"{indent}{line[cut + 1 :]}"]
    try:
        ast.parse("\n".join(lines))
    except SyntaxError:
        print(f"move_wings: could not wrap {path.relative_to(ROOT)}:{numbers}: shorten it by hand", file=sys.stderr)
        return
    path.write_text("\n".join(lines), encoding="utf-8")


# -- shims ------------------------------------------------------------------------------------------------------------


def exported(tree: ast.Module) -> list[str]:
    """The names a module exports: its ``__all__``, else its public top-level definitions."""
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
            return [ast.literal_eval(e) for e in node.value.elts]  # type: ignore[attr-defined]
    names = []
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.append(node.name)
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.extend(t.id for t in targets if isinstance(t, ast.Name))
    return [n for n in names if not n.startswith("_")]


def write_shim(name: str) -> str:
    """The root module ``name``: a re-export of its wing's module, for the code and docs that import the old path."""
    target = MODULES[name]
    real = ROOT / new_path(f"{PKG}/{name}.py")
    if name in FOLDERS:
        real = ROOT / PKG / FOLDERS[name] / "__init__.py"
    names = exported(ast.parse(real.read_text(encoding="utf-8")))
    body = ",\n    ".join(sorted(names))
    listed = ",\n    ".join(f'"{n}"' for n in sorted(names))
    text = (
        f'"""Kept for the code that imports this path: the module is ``{PKG}.{target}``."""\n\n'
        f"from .{target} import (\n    {body},\n)\n\n__all__ = [\n    {listed},\n]\n"
    )
    path = ROOT / PKG / f"{name}.py"
    path.write_text(text, encoding="utf-8")
    return path.relative_to(ROOT).as_posix()


# -- the run ----------------------------------------------------------------------------------------------------------


def check_tree() -> None:
    if run("git", "status", "--porcelain", "--untracked-files=no").strip():
        die("the work tree has changes: commit or reset them first")
    if (ROOT / PKG / "lock").exists() or not (ROOT / PKG / "redlock.py").exists():
        die(f"{PKG}/lock/ exists already: the moves are done (reset the commit that ran this script to run it again)")
    here = {p.stem for p in (ROOT / PKG).glob("*.py")} | {p.name for p in (ROOT / PKG).iterdir() if p.is_dir()}
    here -= {"__pycache__"}
    unknown = sorted(here - set(MODULES) - set(FOLDERS) - STAY)
    if unknown:
        die(f"root modules in no wing: {unknown}; add them to MODULES in tools/move_wings.py")
    missing = sorted(set(MODULES) - here)
    if missing:
        die(f"MODULES names modules that are not there: {missing}; take them out of tools/move_wings.py")
    tests = {p.stem for p in (ROOT / "tests").glob("test_*.py")}
    if tests - set(TEST_WING):
        die(f"test files in no folder: {sorted(tests - set(TEST_WING))}; add them to TESTS in tools/move_wings.py")
    if set(TEST_WING) - tests:
        die(f"TESTS names test files that are not there: {sorted(set(TEST_WING) - tests)}")
    # A test file importing another by name needs it in its own folder (pytest puts each test file's folder on
    # sys.path, and tests/, through its conftest.py).
    for name in sorted(tests):
        for node in ast.walk(ast.parse((ROOT / "tests" / f"{name}.py").read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("test_"):
                other = node.module or ""
                if TEST_WING.get(other) != TEST_WING[name]:
                    die(f"tests/{name}.py imports {other}: put both in one folder of TESTS")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--dry-run", action="store_true", help="print the moves, change nothing")
    args = parser.parse_args()
    check_tree()
    modules = old_modules()
    tracked = [f for f in run("git", "ls-files").splitlines() if f not in SKIP and (ROOT / f).is_file()]
    moves = {f: new_path(f) for f in tracked if new_path(f) != f}
    if args.dry_run:
        for old, new in sorted(moves.items()):
            print(f"{old} -> {new}")
        return

    # 1. new contents, computed from the old locations
    contents: dict[str, str] = {}
    for rel in tracked:
        path = ROOT / rel
        new_rel = moves.get(rel, rel)
        if path.suffix == ".py":
            internal = rel.startswith(INTERNAL)
            if not internal and not rel.startswith(PUBLIC) and rel != "conftest.py":
                internal = False
            source = path.read_text(encoding="utf-8")
            text = rewrite_imports(source, rel, new_rel, modules, internal=internal)
            text = rewrite_text(text)
            if rel.startswith("tests/") and new_rel != rel:
                text = deeper(text)
        elif path.suffix in TEXT_SUFFIXES or path.name in ("Makefile", "Dockerfile"):
            try:
                source = path.read_text(encoding="utf-8")
            except UnicodeDecodeError:
                continue
            text = rewrite_text(source)
        else:
            continue
        if text != source or new_rel != rel:
            contents[new_rel] = text

    # 2. the moves
    for wing in WINGS:
        (ROOT / PKG / wing).mkdir(exist_ok=True)
    for wing in sorted(set(TEST_WING.values())):
        (ROOT / "tests" / wing).mkdir(exist_ok=True)
    for folder, target in FOLDERS.items():
        run("git", "mv", f"{PKG}/{folder}", f"{PKG}/{target}")
    for rel, new_rel in sorted(moves.items()):
        if rel.split("/")[1] in FOLDERS and rel.startswith(f"{PKG}/"):
            continue  # moved with its folder
        run("git", "mv", rel, new_rel)
    for rel, text in contents.items():
        (ROOT / rel).write_text(text, encoding="utf-8")
    for wing, doc in NEW_INITS.items():
        init = ROOT / PKG / wing / "__init__.py"
        if not init.exists():
            init.write_text(f'"""{doc}"""\n', encoding="utf-8")
            run("git", "add", init.relative_to(ROOT).as_posix())

    # 3. the shims
    for name in sorted(MODULES):
        if public(name):
            run("git", "add", write_shim(name))

    # 4. the files that read the tree by path, and the wings' rules
    for rel, old, new in PATCHES:
        patch(rel, old, new)
    layout = ROOT / "tests/project/test_layout.py"
    layout.write_text(layout_keys(layout.read_text(encoding="utf-8")), encoding="utf-8")
    write_layout_rules()

    # 5. imports sorted, the code formatted
    ruff = str(Path(sys.executable).parent / "ruff")
    subprocess.run([ruff, "check", "--fix", "--quiet", "."], cwd=ROOT, check=False)  # noqa: S603
    subprocess.run([ruff, "format", "--quiet", "."], cwd=ROOT, check=True)  # noqa: S603
    # the longer paths push some comments and docstrings over the line length: wrap them
    for _ in range(4):
        report = subprocess.run(  # noqa: S603
            [ruff, "check", "--select", "E501", "--output-format", "concise", "--quiet", "."],
            cwd=ROOT,
            check=False,
            capture_output=True,
            text=True,
        ).stdout
        found = [m.groups() for m in re.finditer(r"^(\S+\.py):(\d+):\d+: E501", report, re.MULTILINE)]
        if not found:
            break
        for rel in {f for f, _ in found}:
            wrap(ROOT / rel, sorted({int(n) for f, n in found if f == rel}))
    subprocess.run([ruff, "format", "--quiet", "."], cwd=ROOT, check=True)  # noqa: S603
    run("git", "add", "-A", PKG, "tests")
    print(f"moved {len(moves)} files; now run the gates (ruff, mypy, tests/project/test_layout.py)")


if __name__ == "__main__":
    main()
