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

import hydra_ddp
from hydra_ddp.config import schema

from support import REPO

PACKAGE = REPO / "src" / "hydra_ddp"
# The package's modules; not template/, the files `hydra-ddp init` writes into a user's project.
MODULES = sorted(p for p in PACKAGE.rglob("*.py") if p.relative_to(PACKAGE).parts[0] != "template")
# The package's layers, lowest first (docs/architecture.md, "Layers"): a unit (a subpackage, or a
# module at the package's top) imports only from units in layers below its own: never up, never
# sideways within its layer, lazy imports inside functions included. So no two units import each
# other, the config knows nothing above it, and the launching side (launch/) and the worker side
# (training/) know nothing of each other (workers are started by their entry's name).
LAYERS = (
    ("errors",),
    ("rundir", "project", "monitor", "models", "hf", "hooks"),
    ("runtime",),
    ("config",),
    ("recipe", "data", "performance"),
    ("parallel", "tasks"),
    ("checkpoint", "reporting", "blueprint"),
    ("training", "launch"),
    ("export", "generate", "init", "tools", "search", "warm", "sweeps", "trackers", "clusters"),
    ("cli",),
    ("__main__",),
)
LAYER_OF = {unit: index for index, layer in enumerate(LAYERS) for unit in layer}


def _name(path: Path) -> str:
    return ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)


def test_the_package_has_modules_to_check():
    assert len(MODULES) > 30 and (PACKAGE / "training" / "trainer.py") in MODULES


@pytest.mark.parametrize("path", MODULES, ids=_name)
def test_no_module_over_400_lines_and_no_class_over_250(path: Path):
    text = path.read_text()
    assert text.count("\n") <= 400, f"{_name(path)} has {text.count(chr(10))} lines"
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.ClassDef):
            assert node.end_lineno - node.lineno + 1 <= 250, (
                f"{_name(path)}.{node.name} is over 250 lines"
            )


@pytest.mark.parametrize("path", MODULES, ids=_name)
def test_each_module_opens_with_a_statement_of_its_job(path: Path):
    docstring = ast.get_docstring(ast.parse(path.read_text()))
    assert docstring and docstring.split("\n")[0].strip(), f"{_name(path)} has no opening docstring"


def _unit(path: Path) -> str:
    """The layer unit a module belongs to: its subpackage, or its own name at the package's top."""
    parts = path.relative_to(PACKAGE).with_suffix("").parts
    return parts[0]


def _units_imported(tree: ast.AST) -> set[str]:
    """The package's units an import statement names, at any depth (function-level imports too)."""
    found = set()
    for node in ast.walk(tree):
        assert not (isinstance(node, ast.ImportFrom) and node.level), (
            "a relative import: name the module"
        )
        names = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module == "hydra_ddp":
            names = [f"hydra_ddp.{alias.name}" for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module]
        found |= {name.split(".")[1] for name in names if name.startswith("hydra_ddp.")}
    return found


def test_every_unit_of_the_package_has_one_layer():
    units = {_unit(p) for p in MODULES} - {"__init__"}
    assert units == set(LAYER_OF), (
        f"unplaced: {sorted(units - set(LAYER_OF))}; gone: {sorted(set(LAYER_OF) - units)}"
    )
    assert sum(len(layer) for layer in LAYERS) == len(LAYER_OF), "a unit in two layers"


@pytest.mark.parametrize("path", MODULES, ids=_name)
def test_no_import_runs_up_or_sideways_between_layers(path: Path):
    unit = _unit(path)
    if unit == "__init__":  # the package's own __init__: imports nothing of it
        assert not _units_imported(ast.parse(path.read_text()))
        return
    wrong = sorted(
        f"{other} (layer {LAYER_OF.get(other)})"
        for other in _units_imported(ast.parse(path.read_text())) - {unit}
        if LAYER_OF.get(other, len(LAYERS)) >= LAYER_OF[unit]
    )
    assert not wrong, (
        f"{_name(path)} (unit {unit}, layer {LAYER_OF[unit]}) "
        f"imports {wrong}: only layers below its own"
    )


def test_the_layer_check_sees_each_form_of_import():
    forms = {
        "from hydra_ddp import tasks": {"tasks"},
        "from hydra_ddp.training.worker import main": {"training"},
        "import hydra_ddp.launch.command": {"launch"},
        "def f():\n    from hydra_ddp.parallel import strategies": {"parallel"},
        "import torch": set(),
    }
    for source, units in forms.items():
        assert _units_imported(ast.parse(source)) == units, source


def test_docs_architecture_md_states_the_layers_the_test_holds():
    text = (REPO / "docs" / "architecture.md").read_text()
    stated = re.findall(r"^layer (\d+)\s+(.+)$", text, re.MULTILINE)
    assert [(int(n), tuple(units.split())) for n, units in stated] == list(enumerate(LAYERS)), (
        "docs/architecture.md's layer lines differ from tests/unit/test_architecture.py's LAYERS"
    )


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
    from hydra_ddp.config import strategy_settings

    assert {
        name: cls.Settings for name, cls in strategies.REGISTRY.items()
    } == strategy_settings.SETTINGS


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


# A parameter that takes a config section, by its name: the whole config's names, `settings` and
# `section`, any `*_cfg`, `*_config` or `*_settings`, and the schema's sections' own (`data`,
# `trainer`, `launcher`, ...; `model` and `strategy` too, so their objects say their types).
CONFIG_PARAMETERS = ("cfg", "config", "run_config", "resolved", "settings", "section")
CONFIG_SUFFIXES = ("_cfg", "_config", "_settings")
SECTIONS = frozenset(f.name for f in dataclasses.fields(schema.Config))
# What says nothing of a parameter's type.
UNTYPED = ("Any", "Optional[Any]")
# Across the package: a lower layer (monitor.py) cannot import the config's types, and so stays Any.
MOST_UNTYPED = 10


def _takes_config(name: str) -> bool:
    return name in CONFIG_PARAMETERS or name in SECTIONS or name.endswith(CONFIG_SUFFIXES)


def _untyped_config_parameters(source: str) -> list[str]:
    """Parameters named as a config or a section whose annotation says nothing (none, or Any). One
    whose annotation names another type (a `model: nn.Module`, a `trainer: TrainerConf`) passes."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for arg in node.args.posonlyargs + node.args.args + node.args.kwonlyargs:
                if _takes_config(arg.arg) and (
                    arg.annotation is None or ast.unparse(arg.annotation) in UNTYPED
                ):
                    found.append(f"{node.name}({arg.arg}) at line {node.lineno}")
    return found


def test_the_typed_parameter_check_catches_any_and_a_missing_annotation():
    assert _untyped_config_parameters("def f(cfg: Any): pass\ndef g(x, config): pass") == [
        "f(cfg) at line 1",
        "g(config) at line 2",
    ]
    assert not _untyped_config_parameters("def f(cfg: RunConfig, other: Any): pass")
    assert _untyped_config_parameters("def f(data_cfg: Any, trainer: Optional[Any]): pass") == [
        "f(data_cfg) at line 1",
        "f(trainer) at line 1",
    ]
    assert not _untyped_config_parameters("def f(trainer: TrainerConf, model: nn.Module): pass")


def test_config_parameters_say_their_types():
    """The run's config is a RunConfig from launch to loop (a composed one a DictConfig), and each
    section a schema class (a `_target_` group a Mapping): a parameter that takes one names which,
    instead of Any; at most MOST_UNTYPED across the package do not."""
    found = [
        f"{_name(path)}: {where}"
        for path in MODULES
        for where in _untyped_config_parameters(path.read_text())
    ]
    assert len(found) <= MOST_UNTYPED, (
        f"{len(found)} config parameters typed Any or not at all (at most {MOST_UNTYPED}): "
        + "; ".join(found)
    )


# Nothing assigns into a config after composition: what settling or the launch learns makes a new
# one (run_config.amended), and the Requested and RunConfig raise on an assignment (test_config.py).
# Here, the source: no assignment (or setattr) into an attribute or item of a name that holds the
# config or a section. Names a built object shares with its section (model, strategy, task, optim,
# scheduler, logger) are not read as config here. Hydra's own node (`.hydra.`, which Hydra's
# launchers set before a job runs, as tools/preflight.py and the Slurm plugin do) is Hydra's.
BUILT_OBJECTS = frozenset({"model", "strategy", "task", "optim", "scheduler", "logger"})


def _assignments_into_config(source: str) -> list[str]:
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source)):
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        elif isinstance(node, ast.Call) and getattr(node.func, "id", "") == "setattr":
            targets = [ast.Attribute(value=node.args[0], attr="?")] if node.args else []
        for target in targets:
            for part in target.elts if isinstance(target, ast.Tuple) else [target]:
                root = part
                while isinstance(root, (ast.Attribute, ast.Subscript)):
                    root = root.value
                named = isinstance(root, ast.Name) and root.id not in BUILT_OBJECTS
                if part is not root and named and _takes_config(root.id):
                    where = ast.unparse(part)
                    if ".hydra." not in where:
                        found.append((node.lineno, f"{where} at line {node.lineno}"))
    return [where for _, where in sorted(found)]


def test_the_assignment_check_catches_attributes_items_tuples_and_setattr():
    source = (
        "cfg.trainer.nproc = 2\ntrainer.x, y = 1, 2\ndata_cfg['k'] = 3\nsetattr(settings, 'a', 1)\n"
        "launcher.n += 1\nmodel.conv1 = m\nself.cfg = cfg\ncfg = amended(cfg, {})\n"
        "cfg.hydra.runtime.output_dir = d\n"
    )
    assert _assignments_into_config(source) == [
        "cfg.trainer.nproc at line 1",
        "trainer.x at line 2",
        "data_cfg['k'] at line 3",
        "settings.? at line 4",
        "launcher.n at line 5",
    ]


def test_nothing_assigns_into_a_config_after_composition():
    plugins = (REPO / "src" / "hydra_plugins").rglob("*.py")
    found = [
        f"{path.relative_to(REPO)}: {where}"
        for path in [*MODULES, *plugins]
        for where in _assignments_into_config(path.read_text())
    ]
    assert not found, "assigned into a config (make a new one: run_config.amended): " + "; ".join(
        found
    )


# What surrounds training rather than trains (docs/architecture.md, "Core and extras"): the search,
# the tools, the export, a new project's files, the sweep reports, a tracker. The entry points
# (the hydra-ddp command) may import both; the core (every other module) imports no extra.
EXTRAS = (
    "hydra_ddp.search",
    "hydra_ddp.tools",
    "hydra_ddp.export",
    "hydra_ddp.generate",
    "hydra_ddp.init",
    "hydra_ddp.sweeps",
    "hydra_ddp.trackers",
    "hydra_ddp.warm",
    "hydra_ddp.clusters",
)
ENTRY = ("hydra_ddp.cli", "hydra_ddp.__main__")


def _is(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == prefix or name.startswith(prefix + ".") for prefix in prefixes)


def _modules_imported(tree: ast.AST) -> set[str]:
    """The package's modules an import names, at any depth: `from hydra_ddp.sweeps import trials`
    names hydra_ddp.sweeps.trials (a module or a name in the package: both are listed)."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            found |= {node.module} | {f"{node.module}.{alias.name}" for alias in node.names}
    return {name for name in found if name.startswith("hydra_ddp")}


CORE = [p for p in MODULES if not _is(_name(p), EXTRAS + ENTRY)]


def test_the_extras_and_entry_points_name_modules_that_exist():
    names = {_name(p) for p in MODULES}
    for prefix in EXTRAS + ENTRY:
        assert any(_is(name, (prefix,)) for name in names), f"{prefix} names no module"


@pytest.mark.parametrize("path", CORE, ids=_name)
def test_the_core_imports_no_extra(path: Path):
    extras = sorted(m for m in _modules_imported(ast.parse(path.read_text())) if _is(m, EXTRAS))
    assert not extras, f"{_name(path)} (core) imports {extras}: an extra (docs/architecture.md)"


def test_docs_architecture_md_states_the_cores_size():
    """Its modules and lines as the page states them, within 5 % of the tree's (a page that keeps
    up with every line would be edited at every change)."""
    text = (REPO / "docs" / "architecture.md").read_text()
    stated = re.search(r"The core is (\d+)\s+modules\s+and\s+about\s+([\d,]+)\s+lines", text)
    assert stated, "docs/architecture.md does not state the core's size"
    modules = [p for p in CORE if p.name != "__init__.py"]
    lines = sum(p.read_text().count("\n") for p in CORE)
    assert int(stated.group(1)) == len(modules)
    assert abs(int(stated.group(2).replace(",", "")) - lines) <= 0.05 * lines, (
        f"the core: {lines} lines"
    )


# Constructors of more than six parameters (none: one built from many YAML keys reads them into a
# settings object, as the W&B and MLflow loggers' Settings and the sweeper's OptunaSweeperConf).
WIDE_CONSTRUCTORS: set[str] = set()


def _wide_constructors(path: Path, module: str) -> set[str]:
    """Classes whose __init__ takes more than six parameters besides self (a config section's
    dataclass fields are the schema's, not a constructor's)."""
    wide = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, ast.FunctionDef) and item.name == "__init__":
                    args = item.args
                    if len(args.posonlyargs) + len(args.args) + len(args.kwonlyargs) - 1 > 6:
                        wide.add(f"{module}.{node.name}")
    return wide


def test_no_constructor_takes_more_than_six_parameters():
    plugins = REPO / "src" / "hydra_plugins"
    found = set().union(
        *(_wide_constructors(p, _name(p)) for p in MODULES),
        *(
            _wide_constructors(p, ".".join(p.relative_to(plugins.parent).with_suffix("").parts))
            for p in plugins.rglob("*.py")
        ),
    )
    assert found == WIDE_CONSTRUCTORS, f"over six parameters: {sorted(found - WIDE_CONSTRUCTORS)}"


# The loop: its epochs (trainer.py) and its step (step.py), read in one sitting.
LOOP = ("training/trainer.py", "training/step.py")
# A step's acts: the backward, the optimizer's step and the gradients' reset.
STEP_ACTS = re.compile(r"\.backward\(|\.zero_grad\(|scaler\.step\(|optimizer\.step\(")
# Modules that call one outside a training step: the FLOP count runs a backward on the meta device.
ACTS_OUTSIDE_A_STEP = {"reporting/flops.py"}


def test_the_loop_is_two_modules_under_600_lines_and_the_only_place_a_step_acts():
    package = REPO / "src" / "hydra_ddp"
    lines = sum(len((package / name).read_text().splitlines()) for name in LOOP)
    assert lines < 600, f"the loop ({' + '.join(LOOP)}) is {lines} lines"
    acting = {
        str(path.relative_to(package)) for path in MODULES if STEP_ACTS.search(path.read_text())
    }
    assert acting == {"training/step.py"} | ACTS_OUTSIDE_A_STEP, acting


# One blueprint per process (blueprint.py): the model built on the meta device, and the task built,
# in one place each; a batch's or a checkpoint's shapes without data are data/batches.py's.
META_DEVICE = re.compile(r"""device\(\s*["']meta["']\s*\)|device\s*=\s*["']meta["']""")
NAMES_THE_META_DEVICE = {"blueprint.py", "data/batches.py"}


def test_the_meta_device_and_the_task_are_each_built_in_one_place():
    package = REPO / "src" / "hydra_ddp"
    meta = {str(p.relative_to(package)) for p in MODULES if META_DEVICE.search(p.read_text())}
    assert meta == NAMES_THE_META_DEVICE, f"the meta device named in {sorted(meta)}"
    building = {
        str(p.relative_to(package))
        for p in MODULES
        if re.search(r"\btasks\.build\(|\bbuild_task\(", p.read_text())
    }
    assert building == {"blueprint.py"}, f"a task built in {sorted(building)}"
    assert META_DEVICE.search('torch.device("meta")') and META_DEVICE.search("device='meta'")


def _import_graph(type_only: bool) -> dict[str, set[str]]:
    """Module → the package's modules it imports by name, at any depth (function-level too); with
    `type_only` False, imports under `if TYPE_CHECKING:` are left out (they never run). A package's
    own __init__, run on the way to its submodules, is not an edge: only what a statement names."""
    names = {_name(p).removesuffix(".__init__") for p in MODULES}
    graph: dict[str, set[str]] = {}
    for path in MODULES:
        tree = ast.parse(path.read_text())
        skipped: set[int] = set()
        if not type_only:
            for node in ast.walk(tree):
                if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                    skipped |= {id(inner) for inner in ast.walk(node)}
        found = set()
        for node in ast.walk(tree):
            if id(node) in skipped:
                continue
            if isinstance(node, ast.Import):
                found |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module:
                for alias in node.names:
                    both = f"{node.module}.{alias.name}"
                    found.add(both if both in names else node.module)
        graph[_name(path).removesuffix(".__init__")] = {m for m in found if m in names}
    return graph


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected sets of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in graph.get(node, ()):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(found)


def test_no_import_circle_not_even_one_that_type_annotations_close():
    assert _circles({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [["a", "b"]]
    assert _circles(_import_graph(type_only=False)) == [], "modules that import each other"
    # an `if TYPE_CHECKING:` import never runs, but the pair still knows too much of each other
    assert _circles(_import_graph(type_only=True)) == [], "modules that name each other's types"


# A module named in a string (a `_target_`, an entry started by name) is an import all the same. The
# ones that cross the layers, each for its reason:
NAMED_ACROSS = {
    # the workers start in a new process by their entry's name: the launch side imports no loop
    ("hydra_ddp.launch.workers", "hydra_ddp.training.worker"),
    # trainer.step's target must subclass the step: named, not imported, by the launch side
    ("hydra_ddp.launch.checks", "hydra_ddp.training.step.Step"),
    # a 0.1.0 checkpoint's config names no task: the one those runs trained, as a config value
    ("hydra_ddp.config.from_checkpoint", "hydra_ddp.tasks.Classification"),
    # the package's aliases of moved modules name where each lives now (hydra_ddp.MOVED)
    *(("hydra_ddp.__init__", new) for new in hydra_ddp.MOVED.values()),
}


def _named_modules(source: str) -> set[str]:
    """The package's dotted names a module's strings hold (`hydra_ddp.x.y`, a module or a name in
    one)."""
    return {
        node.value
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Constant)
        and isinstance(node.value, str)
        and re.fullmatch(r"hydra_ddp(\.\w+)+", node.value)
    }


def test_no_string_names_a_module_up_or_sideways_or_an_extra_from_the_core():
    wrong = set()
    for path in MODULES:
        module, unit = _name(path), _unit(path)
        for named in _named_modules(path.read_text()):
            other = named.split(".")[1]
            if other not in LAYER_OF or other == unit or (module, named) in NAMED_ACROSS:
                continue
            up = LAYER_OF[other] >= LAYER_OF.get(unit, len(LAYERS))
            extra = _is(named, EXTRAS) and not _is(module, EXTRAS + ENTRY)
            if up or extra:
                wrong.add((module, named))
    assert not wrong, f"strings that name a module above or beside their own, or an extra: {wrong}"
    assert _named_modules('x = "hydra_ddp.search.pruning.Pruning"; y = "hydra_ddp"') == {
        "hydra_ddp.search.pruning.Pruning"
    }


def test_a_moved_modules_old_name_imports_the_module_itself():
    """An old `_target_` (a checkpoint's or a config's from before the move) builds what it
    named."""
    import importlib

    from hydra.utils import get_class

    for old, new in hydra_ddp.MOVED.items():
        assert not (REPO / "src" / (old.replace(".", "/") + ".py")).exists(), old
        assert importlib.import_module(old) is importlib.import_module(new)
    from hydra_ddp.config import targets
    from hydra_ddp.trackers.wandb_logger import WandB

    assert get_class("hydra_ddp.reporting.wandb_logger.WandB") is WandB
    # as the launch side checks a logger of a config recorded before the move
    assert targets.check({"_target_": "hydra_ddp.reporting.wandb_logger.WandB"}, "logger") is WandB
