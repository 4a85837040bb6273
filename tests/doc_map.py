"""Every documented command and the test that runs it for real: kit code, a module and a script.

A test under tests/e2e that calls `support.documented(PAGE, FRAGMENT)` or
`support.documented_command(PAGE, FRAGMENT)` (with constants) runs that command of the docs (its
words, with its own overrides after them): it is the command's runner, and the doc test
(tests/e2e/test_docs.py) runs it no more. Every other command the doc test runs itself. The same
command on several pages has the same runner. The map is generated from the tests' calls, and
docs/testing.md shows it between its two markers: tests/unit/test_docs.py keeps them equal, so a new
command, a new runner or a command gone changes the page too.

    python tests/doc_map.py           # the map, as docs/testing.md shows it
    python tests/doc_map.py --write   # written into docs/testing.md
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent
sys.path.insert(0, str(TESTS))

from support import BLOCKS, SHELLS, documented_command, without_comment  # noqa: E402

PAGE = REPO / "docs" / "testing.md"
START, END = "<!-- doc-map: start -->", "<!-- doc-map: end -->"
HERE = "the doc test"
CALLS = ("documented", "documented_command")


def normal(command: str) -> str:
    """A command as the map compares it: without its comment and the venv's path."""
    return without_comment(command).replace(".venv/bin/", "")


def claims() -> dict[str, set[str]]:
    """{command (normalized): the tests that run it}, from the e2e tests' calls."""
    found: dict[str, set[str]] = {}
    for path in sorted((TESTS / "e2e").glob("test_*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        for top in tree.body:
            if not isinstance(top, (ast.FunctionDef, ast.ClassDef)):
                continue
            for node in ast.walk(top):
                name = getattr(getattr(node, "func", None), "id", None) or getattr(
                    getattr(node, "func", None), "attr", None
                )
                if not (isinstance(node, ast.Call) and name in CALLS and len(node.args) >= 2):
                    continue
                page, fragment = (getattr(a, "value", None) for a in node.args[:2])
                if not (isinstance(page, str) and isinstance(fragment, str)):
                    continue  # not a constant: not a claim this map can read
                command = normal(documented_command(page, fragment))
                found.setdefault(command, set()).add(f"{path.relative_to(REPO)}::{top.name}")
    return found


def runnable() -> list[tuple[str, str]]:
    """(where, command) of every command the doc test would run: unmarked shell blocks' commands,
    but their variable assignments."""
    return [
        (block.where, command)
        for block in BLOCKS
        if block.lang in SHELLS and block.mark is None
        for command in block.commands
        if not re.match(r"^(export\s+)?\w+=", without_comment(command))
    ]


def runners() -> dict[tuple[str, str], list[str]]:
    """Each runnable command's runners: its tests, or the doc test."""
    claimed = claims()
    return {
        (where, command): sorted(claimed.get(normal(command), {HERE}))
        for where, command in runnable()
    }


def table() -> str:
    rows = [
        "| page | command | run for real by |",
        "| --- | --- | --- |",
    ]
    for (where, command), tests in runners().items():
        shown = normal(command).replace("|", "\\|")
        shown = shown if len(shown) <= 70 else shown[:67] + "..."
        by = "<br>".join(t.replace("tests/e2e/", "") for t in tests)
        rows.append(f"| {where.split(':')[0]} | `{shown}` | {by} |")
    return "\n".join(rows)


def counts() -> tuple[int, int]:
    """(commands, of them run by another test)."""
    found = runners()
    return len(found), sum(HERE not in tests for tests in found.values())


def written() -> str:
    text = PAGE.read_text()
    start, end = text.index(START) + len(START), text.index(END)
    return text[start:end].strip("\n")


def write() -> None:
    text = PAGE.read_text()
    start, end = text.index(START) + len(START), text.index(END)
    PAGE.write_text(text[:start] + "\n" + table() + "\n" + text[end:])


if __name__ == "__main__":
    if sys.argv[1:] == ["--write"]:
        write()
    else:
        print(table())
