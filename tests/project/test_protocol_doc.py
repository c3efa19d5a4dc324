"""docs/protocol.md is held to the code: a state, field, key function or script added without its row fails here.

Read from the sources (record.py's AST, the .lua files' text, the test files' ASTs): nothing needs a Redis.
"""

from __future__ import annotations

import ast
import re
from functools import cache
from pathlib import Path

import pytest
from sources import parse

from celery_singleton_lock.lock import record, scripts

ROOT = Path(__file__).resolve().parent.parent.parent
DOC = ROOT / "docs" / "protocol.md"
LUA = ROOT / "celery_singleton_lock" / "lock" / "lua"
RECORD = ROOT / "celery_singleton_lock" / "lock" / "record.py"
#: Hash commands whose arguments after the key are all field names; HSET's are field, value pairs.
FIELD_COMMANDS = {"HGET", "HMGET", "HDEL", "HEXISTS"}


@cache
def sections() -> dict[str, str]:
    """The document's ``## `` sections by title."""
    parts = re.split(r"^## (.+)$", DOC.read_text(encoding="utf-8"), flags=re.MULTILINE)
    return {title.strip(): body for title, body in zip(parts[1::2], parts[2::2], strict=True)}


def table(section: str, first: str) -> list[list[str]]:
    """The rows (cells) of the table in ``section`` whose header's first cell is ``first``."""
    rows: list[list[str]] = []
    inside = False
    for line in sections()[section].splitlines():
        if not line.startswith("|"):
            if inside:
                break
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if not inside:
            inside = cells[0] == first
            continue
        if set(cells[0]) <= {"-"}:
            continue
        rows.append(cells)
    assert rows, f"no table headed {first!r} in section {section!r}"
    return rows


def quoted(cell: str) -> set[str]:
    """The ``code`` spans of a table cell."""
    return set(re.findall(r"`([^`]+)`", cell))


def constants() -> dict[str, str]:
    """record.py's module-level ``NAME = "text"`` constants (its states and fields)."""
    out: dict[str, str] = {}
    for node in parse(RECORD).body:
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            for target in node.targets:
                if isinstance(target, ast.Name) and target.id.isupper():
                    out[target.id] = node.value.value
    return out


def state_constants() -> dict[str, str]:
    return {k: v for k, v in constants().items() if not k.startswith("F_")}


def field_constants() -> dict[str, str]:
    return {k: v for k, v in constants().items() if k.startswith("F_")}


def calls(text: str) -> list[list[str]]:
    """Every ``redis.call(...)`` of a Lua text, as its top-level arguments (source text, stripped)."""
    out = []
    for match in re.finditer(r"redis\.call\(", text):
        depth, args, current, quote = 1, [], "", None
        for ch in text[match.end() :]:
            if quote:
                current += ch
                quote = None if ch == quote else quote
                continue
            if ch in "'\"":
                quote = ch
            elif ch in "({":
                depth += 1
            elif ch in ")}":
                depth -= 1
                if depth == 0:
                    args.append(current.strip())
                    break
            elif ch == "," and depth == 1:
                args.append(current.strip())
                current = ""
                continue
            current += ch
        out.append(args)
    return out


def literal(arg: str) -> str | None:
    found = re.fullmatch(r"'([^']*)'|\"([^\"]*)\"", arg)
    return None if found is None else found.group(1) or found.group(2) or ""


def script_fields(text: str) -> tuple[set[str], set[str]]:
    """The hash field names a script reads or writes as literals, and the ``state`` values it writes."""
    fields: set[str] = set()
    states: set[str] = set()
    for args in calls(text):
        command = (literal(args[0]) or "").upper()
        rest = args[2:]  # after the command and the key
        if command in FIELD_COMMANDS:
            fields.update(name for name in map(literal, rest) if name)
        elif command == "HSET":
            for name_arg, value_arg in zip(rest[::2], rest[1::2], strict=False):
                name = literal(name_arg)
                if name:
                    fields.add(name)
                    if name == record.F_STATE and literal(value_arg):
                        states.add(literal(value_arg) or "")
    return fields, states


def lua_files() -> list[Path]:
    return sorted(LUA.glob("*.lua"))


@cache
def suite_tests() -> set[str]:
    """``tests/<file>.py::<test>`` of every test function (module level or in a class) of the test suite."""
    out: set[str] = set()
    for path in (ROOT / "tests").rglob("test_*.py"):
        for node in ast.walk(parse(path)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name.startswith("test_"):
                out.add(f"{path.relative_to(ROOT).as_posix()}::{node.name}")
    return out


def transitions() -> dict[str, list[str]]:
    """The Transitions table by transition name: its cells."""
    rows = table("Transitions", "transition")
    return {row[0]: row for row in rows}


def test_every_state_has_a_row_and_a_transition() -> None:
    """Each state record.py defines is in the States table (its value and constant), STATES lists every one, and
    each is the source or target of at least one transition."""
    states = state_constants()
    rows = {row[0].strip("`"): row for row in table("States", "state")}
    assert set(record.STATES) == set(states.values())
    for name, value in states.items():
        assert value in rows, f"state {name} = {value!r} has no row in docs/protocol.md's States table"
        assert rows[value][1] == f"`{name}`"
    moved = " ".join(cell for row in transitions().values() for cell in row[1:3])
    for value in states.values():
        assert f"`{value}`" in moved, f"state {value!r} is in no transition of docs/protocol.md"


def test_every_field_has_a_row() -> None:
    """Each field constant of record.py, and each field a Lua script reads or writes by name, is in the field
    table; FIELDS lists every constant; every ``state`` a script writes is a documented state."""
    rows = {row[0].strip("`"): row for row in table("Holder record fields", "field")}
    fields = field_constants()
    assert set(record.FIELDS) == set(fields.values())
    for name, value in fields.items():
        assert value in rows, f"field {name} = {value!r} has no row in docs/protocol.md's field table"
        assert rows[value][1] == f"`{name}`"
    documented_states = {row[0].strip("`") for row in table("States", "state")}
    for path in lua_files():
        used, states = script_fields(path.read_text(encoding="utf-8"))
        for name in used:
            assert name in rows, f"{path.name} uses field {name!r}, which has no row in docs/protocol.md"
            assert name in fields.values(), f"{path.name} uses field {name!r}, which record.py does not define"
        assert states <= documented_states, f"{path.name} writes undocumented states {sorted(states)}"


def test_the_field_parser_reads_the_scripts() -> None:
    """The Lua field scan is not vacuous: it finds acquire.lua's reads and writes and finish.lua's state."""
    used, _ = script_fields((LUA / "acquire.lua").read_text(encoding="utf-8"))
    assert {"owner", "fence", "job", "state", "try", "worker", "open", "waiting", "_prev"} <= used
    assert script_fields((LUA / "finish.lua").read_text(encoding="utf-8"))[1] == {"cooldown"}


def test_every_key_function_is_documented() -> None:
    """Each function of record.py that names or places a key is in the Keys section's function table."""
    names = [node.name for node in parse(RECORD).body if isinstance(node, ast.FunctionDef) and "key" in node.name]
    assert "sibling_key" in names
    documented = {row[0].strip("`") for row in table("Keys", "function")}
    assert set(names) <= documented, f"undocumented key functions: {sorted(set(names) - documented)}"


def test_every_script_is_documented_and_every_documented_script_exists() -> None:
    """Each .lua file has a row in the Scripts table, and each row names a file that exists."""
    documented = {row[0].strip("`") for row in table("Scripts", "script")}
    files = {p.name for p in lua_files()}
    assert files == documented, (sorted(files - documented), sorted(documented - files))


@pytest.mark.parametrize("path", lua_files(), ids=lambda p: p.name)
def test_every_script_names_its_rows(path: Path) -> None:
    """A script's header has a KEYS and a returns line and a ``-- protocol:`` line naming Transitions rows, each
    of which names that script."""
    text = path.read_text(encoding="utf-8")
    header = [line for line in text.splitlines() if line.startswith("--")]
    assert any(line.startswith("-- KEYS") for line in header), f"{path.name}: no KEYS line in its header"
    assert any(line.startswith("-- returns") for line in header), f"{path.name}: no returns line in its header"
    (line,) = [line for line in header if line.startswith("-- protocol:")]
    names = [n.strip() for n in re.sub(r"\(.*\)", "", line.removeprefix("-- protocol:")).split(",")]
    rows = transitions()
    for name in names:
        assert name in rows, f"{path.name} names {name!r}, which is no row of docs/protocol.md's Transitions"
        assert path.name in quoted(rows[name][3]), f"the row {name!r} does not name {path.name}"


def test_every_transition_names_a_test_that_exists() -> None:
    """Each Transitions row names at least one test, each an existing ``tests/<file>.py::<test>``, and each script
    it names exists."""
    known = suite_tests()
    files = {p.name for p in lua_files()}
    for name, row in transitions().items():
        tests = quoted(row[5])
        assert tests, f"transition {name!r} names no test"
        assert tests <= known, f"transition {name!r} names tests that do not exist: {sorted(tests - known)}"
        assert {s for s in quoted(row[3]) if s.endswith(".lua")} <= files, f"transition {name!r}: unknown script"


def test_the_line_s_eval_code_is_its_file_without_the_header() -> None:
    """What LockedTask sends by EVAL on every park and wake is the script file's code, header left out."""
    for name, code in (("pop_waiter", scripts.POP_WAITER_CODE), ("park_replacing", scripts.PARK_REPLACING_CODE)):
        text = (LUA / f"{name}.lua").read_text(encoding="utf-8")
        assert text.endswith(code)
        assert code.startswith("local ")
        assert all(line.startswith("--") for line in text.removesuffix(code).splitlines())


def test_every_message_header_is_documented() -> None:
    """Every header our copies and reserved messages carry (``_run``'s ``*_HEADER``) has a row in the headers table."""
    from celery_singleton_lock.task import _run  # noqa: PLC0415

    doc = (Path(__file__).resolve().parent.parent.parent / "docs" / "protocol.md").read_text(encoding="utf-8")
    table = doc[doc.index("## Message headers") :]
    headers = {value for name, value in vars(_run).items() if name.endswith("_HEADER")}
    assert headers, "no header constants found: the check would check nothing"
    missing = sorted(h for h in headers if f"`{h}`" not in table)
    assert not missing, f"headers missing from docs/protocol.md's 'Message headers': {missing}"
