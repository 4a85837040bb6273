"""The package's shape, checked: sizes, the launch side's independence of the worker side,
strategies by composition, and every module opening with its job (static reads of src/, no
process)."""

from __future__ import annotations

import ast
import dataclasses
import re
from dataclasses import is_dataclass
from pathlib import Path
from typing import Optional

import pytest

from support import REPO

PACKAGE = REPO / "src" / "hydra_ddp"
# The package's modules; not template/, the files `hydra-ddp init` writes into a user's project.
MODULES = sorted(p for p in PACKAGE.rglob("*.py") if p.relative_to(PACKAGE).parts[0] != "template")
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


# Lines of at most 100 characters: the bounds first set at 120 (400 and 250 lines), scaled by 1.2.
@pytest.mark.parametrize("path", MODULES, ids=_name)
def test_no_module_over_480_lines_and_no_class_over_300(path: Path):
    text = path.read_text()
    assert text.count("\n") <= 480, f"{_name(path)} has {text.count(chr(10))} lines"
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.ClassDef):
            assert node.end_lineno - node.lineno + 1 <= 300, (
                f"{_name(path)}.{node.name} is over 300 lines"
            )


@pytest.mark.parametrize("path", MODULES, ids=_name)
def test_each_module_opens_with_a_statement_of_its_job(path: Path):
    docstring = ast.get_docstring(ast.parse(path.read_text()))
    assert docstring and docstring.split("\n")[0].strip(), f"{_name(path)} has no opening docstring"


@pytest.mark.parametrize(
    "path", [p for p in MODULES if p.relative_to(PACKAGE).parts[0] in LAUNCH_SIDE], ids=_name
)
def test_no_launch_side_module_imports_the_worker_side(path: Path):
    worker_side = sorted(
        m for m in _imports(ast.parse(path.read_text())) if m.startswith(WORKER_SIDE)
    )
    assert not worker_side, f"{_name(path)} imports {worker_side}"


STRATEGIES = PACKAGE / "parallel" / "strategies"


@pytest.mark.parametrize(
    "path",
    sorted(p for p in STRATEGIES.glob("*.py") if p.stem not in ("__init__", "base")),
    ids=_name,
)
def test_every_strategy_is_one_module_with_one_class_implementing_the_protocol(path: Path):
    tree = ast.parse(path.read_text())
    strategies = [
        node
        for node in tree.body
        if isinstance(node, ast.ClassDef)
        and any(isinstance(b, ast.Name) and b.id == "Strategy" for b in node.bases)
    ]
    assert len(strategies) == 1, (
        f"{_name(path)} defines {len(strategies)} Strategy classes, not one"
    )
    (strategy,) = strategies
    bases = [ast.unparse(base) for base in strategy.bases]
    assert bases == ["Strategy"], (
        f"{_name(path)}.{strategy.name} inherits {bases}: a strategy composes, not inherits"
    )
    name = next(
        (
            node.value.value
            for node in strategy.body
            if isinstance(node, (ast.Assign, ast.AnnAssign))
            and ast.unparse(node.targets[0] if isinstance(node, ast.Assign) else node.target)
            == "name"
        ),
        None,
    )
    assert name == path.stem, (
        f"{_name(path)}.{strategy.name}.name is {name!r}, not its module's name"
    )


def test_the_registry_holds_every_strategy_module_and_every_conf_strategy_option():
    from hydra_ddp.parallel import strategies
    from hydra_ddp.parallel.strategies.base import Strategy

    modules = {p.stem for p in STRATEGIES.glob("*.py")} - {"__init__", "base"}
    options = {p.stem for p in (REPO / "conf" / "strategy").glob("*.yaml")}
    assert set(strategies.REGISTRY) == modules == options
    for name, cls in strategies.REGISTRY.items():
        assert cls.wrap is not Strategy.wrap, f"strategy {name} does not say how it wraps a module"
        assert is_dataclass(cls.Settings), f"strategy {name}'s Settings is not a dataclass"


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


def _config_keys() -> dict[str, set[str]]:
    """Each section of the RunConfig with its fields (a strategy section: every strategy's)."""
    from hydra_ddp.config import run_config
    from hydra_ddp.parallel import strategies

    sections: dict[str, set[str]] = {}
    for f in dataclasses.fields(run_config.RunConfig):
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        sections[f.name] = (
            {g.name for g in dataclasses.fields(default)} if is_dataclass(default) else set()
        )
    sections["strategy"] = {
        g.name for s in strategies.REGISTRY.values() for g in dataclasses.fields(s.Settings)
    }
    return sections


CONFIG_NAMES = {
    "cfg",
    "config",
    "run_config",
    "resolved",
    "plain",
    "data_cfg",
    "settings",
    "as_run",
}


def _string_key(node: ast.AST) -> tuple[Optional[str], Optional[ast.AST]]:
    """(key, the object it is read from) for `obj["key"]` and `obj.get/pop/setdefault("key")`."""
    if (
        isinstance(node, ast.Subscript)
        and isinstance(node.slice, ast.Constant)
        and isinstance(node.slice.value, str)
    ):
        return node.slice.value, node.value
    if (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr in ("get", "pop", "setdefault")
        and node.args
        and isinstance(node.args[0], ast.Constant)
        and isinstance(node.args[0].value, str)
    ):
        return node.args[0].value, node.func.value
    return None, None


def _root(node: ast.AST) -> str:
    """The name an expression is read from: `self.cfg.data` → `self.cfg`, `plain["x"]` → `plain`."""
    while isinstance(node, (ast.Subscript, ast.Call, ast.Attribute)):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id == "self"
        ):
            return f"self.{node.attr}"
        node = node.value if not isinstance(node, ast.Call) else node.func
    return node.id if isinstance(node, ast.Name) else ""


def _config_reads(text: str) -> list[str]:
    """Where `text` reads a RunConfig key by string. Caught: a section's field read
    by string (`x["trainer"]["accumulate"]`, whatever `x` is called), any string key read from a
    config-named object (`cfg["data"]`, `self.cfg.get("seed")`), and a dotted key of a section as a
    constant (`lookup(cfg, "data.batch_size")`). Not caught, by design: the keys of the nodes a user
    fills with his own class's arguments (model, optim: `cfg.optim.get("lr")`), Hydra's own `hydra`
    node and `_target_`, and a dotted key a user names (an override, a monitor): data, not a
    read."""
    sections = _config_keys()
    names = set(sections) | set().union(*sections.values())
    found = []
    tree = ast.parse(text)
    for node in ast.walk(tree):
        key, obj = _string_key(node)
        if key is not None and key != "_target_":
            outer, _ = _string_key(obj)
            root = _root(obj).removeprefix("self.")
            if (outer in sections and key in sections[outer]) or (
                root in CONFIG_NAMES and key in names
            ):
                found.append(f"line {node.lineno}: {ast.unparse(node)}")
        if (
            isinstance(node, ast.Call)
            and getattr(node.func, "attr", getattr(node.func, "id", ""))
            in ("lookup", "select", "update")
            and len(node.args) > 1
            and isinstance(node.args[1], ast.Constant)
            and str(node.args[1].value).split(".")[0] in sections
        ):
            found.append(f"line {node.lineno}: {ast.unparse(node)}")
    return found


def test_the_config_read_check_catches_each_form_it_names():
    caught = [
        'x = state["config"]["trainer"]["accumulate"]',
        'x = saved["data"].get("global_batch_size")',
        'x = cfg["data"]',
        'x = self.cfg.get("trainer")',
        'x = plain.pop("sweep")',
        'x = run_config.lookup(cfg, "data.batch_size")',
        'x = OmegaConf.select(cfg, "strategy.comm_hook")',
    ]
    for line in caught:
        assert _config_reads(line), line
    passed = [
        'x = cfg.optim.get("lr")',
        'x = state["model"]',
        'x = cfg.model["_target_"]',
        "x = lookup(cfg, key)",
    ]
    for line in passed:
        assert not _config_reads(line), line


@pytest.mark.parametrize(
    "path", [p for p in MODULES if p.relative_to(PACKAGE).parts[0] != "config"], ids=_name
)
def test_no_module_outside_config_reads_a_config_key_by_string(path: Path):
    """The RunConfig is typed: outside config/ its keys are attributes (the forms:
    _config_reads)."""
    found = _config_reads(path.read_text())
    assert not found, (
        f"{_name(path)} reads config keys by string (use the RunConfig's attributes): {found}"
    )
