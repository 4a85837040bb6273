"""The package's shape, checked: sizes, the launch side's independence of the worker side, strategies
by composition, and every module opening with its job (static reads of src/, no process)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from support import REPO

PACKAGE = REPO / "src" / "hydra_ddp"
MODULES = sorted(PACKAGE.rglob("*.py"))
LAUNCH_SIDE = ("launch", "config")  # the command's process: it starts workers, and never is one
WORKER_SIDE = "hydra_ddp.training"


def _name(path: Path) -> str:
    return ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)


def _imports(tree: ast.AST) -> set[str]:
    """Every module an import statement names, at any depth (function-level imports included)."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            found |= {f"{node.module}.{alias.name}" for alias in node.names}
    return found


def test_the_package_has_modules_to_check():
    assert len(MODULES) > 30 and (PACKAGE / "training" / "trainer.py") in MODULES


@pytest.mark.parametrize("path", MODULES, ids=_name)
def test_no_module_over_400_lines_and_no_class_over_250(path: Path):
    text = path.read_text()
    assert text.count("\n") <= 400, f"{_name(path)} has {text.count(chr(10))} lines"
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.ClassDef):
            assert node.end_lineno - node.lineno + 1 <= 250, f"{_name(path)}.{node.name} is over 250 lines"


@pytest.mark.parametrize("path", MODULES, ids=_name)
def test_each_module_opens_with_a_statement_of_its_job(path: Path):
    docstring = ast.get_docstring(ast.parse(path.read_text()))
    assert docstring and docstring.split("\n")[0].strip(), f"{_name(path)} has no opening docstring"


@pytest.mark.parametrize("path", [p for p in MODULES if p.relative_to(PACKAGE).parts[0] in LAUNCH_SIDE], ids=_name)
def test_no_launch_side_module_imports_the_worker_side(path: Path):
    worker_side = sorted(m for m in _imports(ast.parse(path.read_text())) if m.startswith(WORKER_SIDE))
    assert not worker_side, f"{_name(path)} imports {worker_side}"


def test_no_strategy_borrows_another_strategys_code():
    tree = ast.parse((PACKAGE / "parallel" / "strategy.py").read_text())
    classes = {node.name: node for node in tree.body if isinstance(node, ast.ClassDef)}
    for name, node in classes.items():
        assert not [base for base in node.bases if isinstance(base, ast.Name) and base.id in classes], (
            f"{name} inherits from another class of strategy.py"
        )
    assert "Strategy" in classes


def test_docs_architecture_md_lists_every_module_and_no_module_that_is_gone():
    text = (REPO / "docs" / "architecture.md").read_text()
    listed = set(re.findall(r"^\s+((?:[\w]+/)*[\w]+\.py)\s", text, re.MULTILINE))
    here = {str(p.relative_to(PACKAGE)) for p in MODULES if p.name != "__init__.py"}
    plugins = {
        str(p.relative_to(REPO / "src" / "hydra_plugins"))
        for p in (REPO / "src" / "hydra_plugins").rglob("*.py")
        if p.name != "__init__.py"
    }
    assert here | plugins == listed, (
        f"missing from docs/architecture.md: {sorted((here | plugins) - listed)}; "
        f"listed but gone: {sorted(listed - here - plugins)}"
    )
