"""Every key of the configuration, probed: a value of the wrong type, zero, a negative number and an
unknown word are each either a meaningful setting (its domain in the schema says so) or refused
before launch in one line that names the key. Generated from the schema (config/domains.py), so a
new key cannot skip it; no process is started."""

from __future__ import annotations

import copy
import dataclasses
import functools
import typing
from pathlib import Path
from typing import Any

import pytest
from hydra import compose, initialize_config_dir

from hydra_ddp.config import domains, schema
from hydra_ddp.errors import UserError
from hydra_ddp.launch import composition, resolve
from hydra_ddp.tools.config_reference import NAMED_GROUPS

from support import REPO

schema.register_schema()

STRATEGIES = sorted(p.stem for p in (REPO / "conf" / "strategy").glob("*.yaml"))
# Every key: the sections every run has, then each strategy's own settings (its section's schema is
# the strategy's: `strategy=fsdp` has FSDP's keys). (key, class, field, the strategy to compose.)
KEYS = [(key, cls, name, "ddp") for key, cls, name in domains.fields(schema.Config)] + [
    (key, cls, name, option)
    for option in STRATEGIES
    for key, cls, name in domains.fields(schema.Config, chosen={"strategy": option})
    if key.startswith("strategy.")
]
# eval.py's own keys (ckpt, split, predict).
EVAL_KEYS = [
    (key, cls, name)
    for key, cls, name in domains.fields(schema.EvalConfig)
    if cls is schema.EvalConfig and name not in {f.name for f in dataclasses.fields(schema.Config)}
]
WORD = "no_such_option"
# Probes a Checked key takes as meaningful, each with its reason.
MEANINGFUL = {
    ("init_method.path", WORD): "a file of that name in the working directory is a place to meet",
    ("checkpoint.dir", WORD): "a folder of that name in the working directory holds checkpoints",
}


def _hint(cls: type, name: str) -> Any:
    return typing.get_type_hints(cls)[name]


def _base_type(cls: type, name: str) -> Any:
    hint = _hint(cls, name)
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    return args[0] if typing.get_origin(hint) is typing.Union and len(args) == 1 else hint


def _probes(cls: type, name: str) -> list[Any]:
    kind = _base_type(cls, name)
    if kind in (int, float):
        return [kind(0), kind(-1)]
    if kind is str:
        return [WORD]
    if kind is Any:
        return [WORD, 0, -1]
    return []  # bool (its type is its domain), lists and dicts of the user's own keys


@functools.cache
def _composed(strategy: str) -> dict[str, Any]:
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base=None):
        return resolve.plain_config(
            compose(config_name="config", overrides=[f"strategy={strategy}"])
        )


def test_every_key_has_a_domain_or_is_a_bool():
    bare = [
        key
        for key, cls, name in [k[:3] for k in KEYS] + EVAL_KEYS
        if domains.domain_of(cls, name) is None and _base_type(cls, name) is not bool
    ]
    assert not bare, (
        "keys with no domain (Annotated[type, "
        f"OneOf/Number/Pattern/Checked/Free] in schema.py): {bare}"
    )


def test_the_named_groups_options_are_their_name_keys_domain():
    for group in NAMED_GROUPS:
        options = sorted(p.stem for p in (REPO / "conf" / group).glob("*.yaml"))
        domain = domains.domain_of(schema.Config, group)
        if isinstance(domain, domains.Chosen):  # strategy: each option's own settings class
            assert sorted(domain.options()) == options, group
        else:
            domain = domains.domain_of(type(getattr(schema.Config(), group)), "name")
            assert sorted(domain.options) == options, group


def _set(plain: dict, key: str, value: Any) -> None:
    *parents, last = key.split(".")
    node = plain
    for part in parents:
        node = node[part]
    node[last] = value


CASES = [
    (key, cls, name, strategy, probe)
    for key, cls, name, strategy in KEYS
    for probe in _probes(cls, name)
]


def _case_id(key: str, strategy: str, probe: Any) -> str:
    return f"{key}={probe!r}" + (f" (strategy={strategy})" if key.startswith("strategy.") else "")


@pytest.mark.parametrize(
    "key, cls, name, strategy, probe", CASES, ids=[_case_id(c[0], c[3], c[4]) for c in CASES]
)
def test_a_zero_a_negative_or_an_unknown_word_is_meaningful_or_refused_in_one_line(
    tmp_path: Path, key: str, cls: type, name: str, strategy: str, probe: Any
):
    plain = copy.deepcopy(_composed(strategy))
    _set(plain, key, probe)
    domain = domains.domain_of(cls, name)
    try:
        resolve.resolve(plain, tmp_path, None)
    except UserError as error:
        line = str(error)
        assert "\n" not in line and key in line, line
        return
    # Accepted: the key's domain says the value means something (never accepted silently).
    if isinstance(domain, domains.Checked):
        assert (key, probe) in MEANINGFUL, (
            f"{key}={probe!r} passed its own check ({domain.where}): meaningful?"
        )
    else:
        assert domain.problem(probe) is None, (
            f"{key}={probe!r} was accepted, and its domain refuses it"
        )


TYPED = [
    (key, cls, name, strategy)
    for key, cls, name, strategy in KEYS
    if _base_type(cls, name) in (int, float, bool)
]


@pytest.mark.parametrize(
    "key, cls, name, strategy", TYPED, ids=[_case_id(c[0], c[3], "x") for c in TYPED]
)
def test_a_value_of_the_wrong_type_is_one_line_naming_the_key(
    key: str, cls: type, name: str, strategy: str
):
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base=None):
        with pytest.raises(Exception) as refused:
            compose(config_name="config", overrides=[f"strategy={strategy}", f"{key}=not_a_number"])
    line = composition.one_line(refused.value)
    assert line and "\n" not in line and line.startswith(f"{key}='not_a_number': give "), line


# ckpt is checkpoints.find's (refused in one line: tests/e2e/test_workflow.py), predict a bool.
EVAL_DOMAINS = [
    (key, cls, name)
    for key, cls, name in EVAL_KEYS
    if isinstance(domains.domain_of(cls, name), (domains.OneOf, domains.Number, domains.Pattern))
]


@pytest.mark.parametrize("key, cls, name", EVAL_DOMAINS, ids=[c[0] for c in EVAL_DOMAINS])
def test_eval_py_s_own_keys_are_in_their_domain_or_refused(key: str, cls: type, name: str):
    from omegaconf import OmegaConf

    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base=None):
        composed = OmegaConf.to_container(compose(config_name="eval", overrides=["ckpt=somewhere"]))
    domain = domains.domain_of(cls, name)
    assert _probes(cls, name)
    for probe in _probes(cls, name):
        plain = {**composed, key: probe}
        if domain.problem(probe) is None:
            domains.check(plain, schema.EvalConfig)
        else:
            with pytest.raises(UserError, match=f"^{key}="):
                domains.check(plain, schema.EvalConfig)


# The search's own settings (hydra/sweeper=optuna and its samplers), probed the same way.
def _sweeper_cases() -> list[tuple[str, type, str, Any]]:
    from hydra_plugins.hydra_ddp_optuna import sweeper

    cases = []
    for cls, where in (
        (sweeper.OptunaSweeperConf, "hydra.sweeper"),
        *((conf, "hydra.sweeper.sampler") for conf in sweeper.SAMPLERS.values()),
    ):
        for key, owner, name in domains.fields(cls):
            if name.startswith("_") or name in ("defaults", "sampler"):
                continue
            cases += [(f"{where}.{key}", owner, name, probe) for probe in _probes(owner, name)]
    return cases


SWEEPER_CASES = _sweeper_cases()


# The Optuna sweeper's settings, but its sampler, as Hydra hands them to it: a valid search.
SWEEPER = dict(
    direction="maximize",
    study_name=None,
    storage=None,
    n_trials=4,
    n_jobs=1,
    pruner="median",
    params=None,
)


def test_every_sweeper_setting_has_a_domain_or_is_a_bool():
    from hydra_plugins.hydra_ddp_optuna import sweeper

    bare = [
        f"{cls.__name__}.{name}"
        for cls in (sweeper.OptunaSweeperConf, *sweeper.SAMPLERS.values())
        for _, owner, name in domains.fields(cls)
        if not name.startswith("_")
        and name not in ("defaults", "sampler")
        and domains.domain_of(owner, name) is None
        and _base_type(owner, name) is not bool
    ]
    assert not bare, bare


@pytest.mark.parametrize(
    "key, cls, name, probe", SWEEPER_CASES, ids=[f"{c[0]}={c[3]!r}" for c in SWEEPER_CASES]
)
def test_a_sweeper_setting_is_meaningful_or_refused_in_one_line(
    key: str, cls: type, name: str, probe: Any
):
    from omegaconf import OmegaConf

    from hydra_plugins.hydra_ddp_optuna import sweeper

    settings = dict(SWEEPER)
    sampler = {"_target_": "optuna.samplers.TPESampler", "seed": 0, "n_startup_trials": 2}
    if key.startswith("hydra.sweeper.sampler."):
        target = next(
            conf._target_ for conf in sweeper.SAMPLERS.values() if conf.__name__ == cls.__name__
        )
        sampler = {"_target_": target, name: probe}
    else:
        settings[name] = probe
    searcher = sweeper.OptunaSweeper(sampler=OmegaConf.create(sampler), **settings)
    domain = domains.domain_of(cls, name)
    try:
        searcher.check()
    except UserError as error:
        assert "\n" not in str(error) and str(error).startswith(f"{key}="), str(error)
        return
    assert isinstance(domain, (domains.Free, domains.Checked)) or domain.problem(probe) is None, (
        f"{key}={probe!r} was accepted, and its domain refuses it"
    )


@pytest.mark.parametrize("sampler", ["tpe", 3, {"seed": 1}])
def test_a_sampler_given_as_a_value_not_a_group_is_refused_in_one_line(sampler: Any):
    # hydra.sweeper.sampler=tpe on the command line replaces the sampler's node by a word: it ended
    # in an AttributeError from the sweeper before.
    from omegaconf import OmegaConf

    from hydra_plugins.hydra_ddp_optuna import sweeper

    searcher = sweeper.OptunaSweeper(
        sampler=OmegaConf.create(sampler) if isinstance(sampler, dict) else sampler, **SWEEPER
    )
    with pytest.raises(
        UserError,
        match=r"^hydra\.sweeper\.sampler=.*: a sampler is chosen by its group, "
        r"hydra/sweeper/sampler=NAME \(tpe, random, cmaes, grid\)",
    ) as raised:
        searcher.check()
    assert "\n" not in str(raised.value)


def test_a_named_groups_yaml_holds_only_what_differs_from_the_schema():
    """Defaults live in the schema: conf/{backend,init_method,launcher,strategy}/NAME.yaml and
    conf/config.yaml's own sections say a value only where it differs from the schema's default."""
    import yaml

    from hydra_ddp.parallel import strategies

    def repeats(values: dict, schema_class: type, where: str) -> list[str]:
        defaults = {
            f.name: getattr(schema_class(), f.name) for f in dataclasses.fields(schema_class)
        }
        return [
            f"{where}: {k}: {v!r}"
            for k, v in values.items()
            if k != "name" and k in defaults and defaults[k] == v
        ]

    found = []
    for group in NAMED_GROUPS:
        for path in sorted((REPO / "conf" / group).glob("*.yaml")):
            values = {
                k: v for k, v in (yaml.safe_load(path.read_text()) or {}).items() if k != "defaults"
            }
            cls = (
                strategies.get(path.stem).Settings
                if group == "strategy"
                else type(getattr(schema.Config(), group))
            )
            found += repeats(values, cls, str(path.relative_to(REPO)))
    top = yaml.safe_load((REPO / "conf" / "config.yaml").read_text())
    for section, values in top.items():
        if section not in ("defaults", "hydra") and isinstance(values, dict):
            found += repeats(
                values, type(getattr(schema.Config(), section)), f"conf/config.yaml {section}"
            )
    assert not found, (
        f"values that repeat the schema's defaults (say them once, in schema.py): {found}"
    )
