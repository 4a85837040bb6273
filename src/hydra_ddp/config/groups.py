"""What the config groups in conf/ offer, read from their files: for errors that name the options
that would fit
(`model=gpt needs data.dataset.context, which data=digits does not have: use data=text`)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Optional

import yaml
from omegaconf.errors import InterpolationResolutionError

_MISSING_KEY = re.compile(r"Interpolation key '([^']+)' not found")


def mismatch(error: InterpolationResolutionError) -> str:
    """One line for an interpolation that the chosen groups cannot resolve: which option asks for
    which key, which option of the other group lacks it, and the options (and experiments) that have
    it."""
    node = error.full_key or "a value"
    found = _MISSING_KEY.search(str(error))
    if not found:  # a resolver failed, or an interpolation is malformed: say where
        return f"{node}: {str(error).splitlines()[0]}"
    missing = found.group(1)
    choices, conf = _choices_and_conf()
    asking, lacking = node.split(".")[0], missing.split(".")[0]
    asker = f"{asking}={choices[asking]}" if asking in choices else node
    if lacking not in choices or conf is None:
        return (
            f"{asker} refers to {missing}, which this config does not have: choose "
            "groups that fit together (python train.py --check tells before a run)"
        )
    having = [
        name
        for name in _options(conf, lacking)
        if _defines(conf / lacking / f"{name}.yaml", missing.split(".")[1:])
    ]
    fix = (
        f"use {' or '.join(f'{lacking}={name}' for name in having)}"
        if having
        else f"no {lacking} option in conf/ has it"
    )
    recipes = [
        name
        for name in _options(conf, "experiment")
        if _selects(
            conf / "experiment" / f"{name}.yaml",
            {asking: choices.get(asking), lacking: set(having)},
        )
    ]
    if recipes:
        fix += f" (or {' or '.join(f'+experiment={name}' for name in recipes)})"
    return f"{asker} needs {missing}, which {lacking}={choices[lacking]} does not have: {fix}"


def chosen(group: str, node: Any) -> str:
    """How the user chose a group's option: `model=cnn`; else (outside a Hydra job, or a node set
    key by key) the class or function it builds."""
    choice = _choices_and_conf()[0].get(group)
    if choice:
        return f"{group}={choice}"
    target = node.get("_target_", "?") if hasattr(node, "get") else "?"
    return f"{group} ({target})"


def _choices_and_conf() -> tuple[dict[str, str], Optional[Path]]:
    """The group options this run chose, and the primary config folder (none outside a Hydra
    job)."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return {}, None
    runtime = HydraConfig.get().runtime
    conf = next(
        (
            Path(source.path.removeprefix("file://"))
            for source in runtime.config_sources
            if source.provider == "main" and source.schema == "file"
        ),
        None,
    )
    return {k: v for k, v in runtime.choices.items() if isinstance(v, str)}, conf


def _options(conf: Path, group: str) -> list[str]:
    return sorted(path.stem for path in (conf / group).glob("*.yaml"))


def _load(path: Path) -> Any:
    try:
        return yaml.safe_load(path.read_text()) or {}
    except (OSError, yaml.YAMLError):
        return {}


def _defines(path: Path, keys: list[str]) -> bool:
    node = _load(path)
    for key in keys:
        if not isinstance(node, dict) or key not in node:
            return False
        node = node[key]
    return True


def _selects(path: Path, wanted: dict[str, Any]) -> bool:
    """The experiment overrides each group to the wanted option (or one of a set)."""
    chosen: dict[str, str] = {}
    for entry in _load(path).get("defaults", []) if isinstance(_load(path), dict) else []:
        if isinstance(entry, dict):
            for key, value in entry.items():
                chosen[key.removeprefix("override ").lstrip("/")] = value
    return all(
        chosen.get(group) == option or (isinstance(option, set) and chosen.get(group) in option)
        for group, option in wanted.items()
    )
