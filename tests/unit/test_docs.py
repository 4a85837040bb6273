"""The docs cannot drift, checked in this process: every fence names its language, every
`<!-- doc-test: MARK -->` is one of MARKS (docs/testing.md lists them), no command line is wider
than the site shows, and the config reference is the schema's. The blocks are read by the kit
(support.blocks: a shell block's commands, its language and its mark); tests/e2e/test_docs.py runs
every shell command they give."""

from __future__ import annotations

import re
from pathlib import Path

from support import BLOCKS, MARKS, PAGES, REPO, SHELLS


def test_every_fence_names_its_language_and_every_mark_is_known():
    bare = [block.where for block in BLOCKS if not block.lang]
    assert not bare, f"fences without a language (a command block is bash, output text): {bare}"
    for page in PAGES:
        for found in re.findall(r"^<!-- doc-test: ([\w-]+) -->$", page.read_text(), re.MULTILINE):
            assert found in MARKS, (
                f"{page.name}: unknown doc-test mark {found!r} (one of {', '.join(MARKS)})"
            )
    # README.md and docs/: the test reads them
    assert sum(len(b.commands) for b in BLOCKS if b.lang in SHELLS) > 60
    # The site shows about 90 characters of a code line: longer ones scroll, hiding their comments.
    long = [
        f"{page.relative_to(REPO)}: {line}"
        for page in PAGES
        for block in _fenced_lines(page)
        for line in block
        if len(line) > 90
    ]
    assert not long, (
        "command lines over 90 characters (put the comment above, or continue with \\):\n"
        + "\n".join(long)
    )


def _fenced_lines(page: Path) -> list[list[str]]:
    """The lines of each bash block of a page."""
    out, lines, inside = [], page.read_text().split("\n"), False
    for line in lines:
        if line.strip().startswith("```"):
            inside = line.strip() == "```bash"
            out.append([])
        elif inside:
            out[-1].append(line)
    return out


def test_the_marks_are_the_ones_docs_testing_md_lists():
    listed = (REPO / "docs" / "testing.md").read_text()
    assert all(f"`{mark}`" in listed for mark in MARKS), [
        m for m in MARKS if f"`{m}`" not in listed
    ]


def test_the_config_reference_is_the_schemas_and_every_field_has_a_doc():
    from hydra_ddp.tools import config_reference as reference

    text, missing = reference.render()
    assert not missing, f"schema fields with no doc comment (add one above the field): {missing}"
    assert reference.OUT.read_text() == text, (
        "docs/reference/config.md is out of date: python -m hydra_ddp.tools.config_reference"
    )


def test_the_reference_lists_every_key_of_the_default_config():
    """Every leaf of the default run's composed config (outside the `_target_` groups) has a row."""
    from hydra_ddp.tools import config_reference as reference

    config, text = reference._default_config(), reference.OUT.read_text()

    def leaves(node, prefix=""):
        for key, value in node.items():
            dotted = f"{prefix}{key}"
            if dotted in ("task", "model", "optim", "scheduler", "logger", "data.dataset"):
                # `_target_` objects: their keys are the user's class's (the groups table lists
                # them)
                continue
            if isinstance(value, dict) and value:
                yield from leaves(value, f"{dotted}.")
            else:
                yield dotted

    absent = [key for key in leaves(config) if f"| `{key}` |" not in text]
    assert not absent, absent


def test_every_test_the_hydra_ddp_page_names_exists():
    """docs/hydra-ddp.md answers each known problem with a test: the test is there, under that
    name."""
    import re

    page = (REPO / "docs" / "hydra-ddp.md").read_text()
    named = re.findall(r"`(tests/[\w/]+\.py)((?:::\w+)?)`", page)
    assert len(named) >= 9, named
    for path, test in named:
        assert (REPO / path).is_file(), path
        if test:
            assert f"def {test[2:]}(" in (REPO / path).read_text(), f"{path}{test}"
    for short in re.findall(r"`::(\w+)`", page):  # a test of the module named just before it
        assert any(f"def {short}(" in (REPO / path).read_text() for path, _ in named), short


def test_the_line_length_the_docs_state_is_the_linters():
    import tomllib

    length = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["ruff"]["line-length"]
    assert f"Lines are at most {length} characters" in (REPO / "docs" / "testing.md").read_text()


def test_the_doc_map_is_the_tests_claims_and_the_testing_page_shows_it():
    """Each claim (support.documented with constants, in an e2e test) names one documented command,
    and docs/testing.md shows the map they make: a command without a test of its own is the doc
    test's."""
    import doc_map

    commands, elsewhere = doc_map.counts()
    assert commands > 80 and elsewhere <= commands
    assert doc_map.written() == doc_map.table(), (
        "docs/testing.md's map of documented commands is not the tests' claims: "
        "python tests/doc_map.py --write"
    )


def test_the_usage_pages_group_table_shows_every_group_and_option_in_conf():
    """docs/usage.md's options column is conf/'s: each group's options, its default named
    (tests/group_table.py makes it)."""
    import group_table

    assert group_table.cell("scheduler").startswith("`step` (default), `cosine`, `none`")
    assert group_table.cell("logger").startswith("`tensorboard` and `csv` (default, together)")
    assert group_table.cell("debug").startswith("none by default; `anomaly`")
    assert group_table.written() == group_table.cells(), (
        "docs/usage.md's table of config groups is not conf/'s: python tests/group_table.py --write"
    )


def test_the_suite_times_the_testing_page_states_are_rows_of_ci_runs():
    """docs/testing.md's suite time is a measurement: each "N min M s ... at `COMMIT`" (or "N
    minutes at `COMMIT`") of its paragraph is in a row of bench/results/CI_RUNS.md for that
    commit."""
    page = (REPO / "docs" / "testing.md").read_text()
    paragraph = page[page.index("**The suite's time.**") :].split("\n\n")[0]
    stated = re.findall(r"(\d+ min \d+ s|\d+ minutes)[^`]*?at `([0-9a-f]{7,})`", paragraph)
    assert len(stated) >= 2, f"no figure at a commit in the suite's time: {paragraph}"
    rows = [
        line
        for line in (REPO / "bench/results/CI_RUNS.md").read_text().splitlines()
        if line.startswith("| 20")
    ]
    for figure, commit in stated:
        wanted = figure.replace(" minutes", " min ")
        assert any(f"| {commit} |" in row and wanted in row for row in rows), (
            f"docs/testing.md says {figure} at {commit}: no row of bench/results/CI_RUNS.md does"
        )


def test_every_known_bug_names_a_test_that_exists_and_a_control():
    """docs/correctness.md: at least ten of the field's known training bugs, each row naming where
    it was reported, a test under tests/ that exists under that name (a `::name` alone is a test of
    the module named before it in the row), and its control, run in that test."""
    import ast

    rows = [
        line
        for line in (REPO / "docs" / "correctness.md").read_text().splitlines()
        if line.startswith("| ") and not line.startswith(("| the bug", "| ---"))
    ]
    assert len(rows) >= 10, len(rows)
    defined: dict[str, set[str]] = {}
    for row in rows:
        cells = [cell.strip() for cell in row.strip("|").split(" | ")]
        assert len(cells) == 5, row
        bug, reported, _, tests, control = cells
        assert re.search(
            r"\[#\d+\]\(https://github\.com/[\w.-]+/[\w.-]+/(issues|pull)/\d+\)", reported
        ), bug
        assert control.startswith(("in the test", "in both tests", "in the first test")), bug
        named = re.findall(r"`(tests/[\w/]+\.py)?::(\w+)`", tests)
        assert named, f"{bug}: no test named"
        module = None
        for path, test in named:
            module = path or module
            assert module, f"{bug}: ::{test} before any module"
            if module not in defined:
                tree = ast.parse((REPO / module).read_text())
                defined[module] = {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}
            assert test.startswith("test_") and test in defined[module], f"{module}::{test}"
