"""A user's project: the directory `hydra-ddp` runs from (or the nearest above it) whose
pyproject.toml has a [tool.hydra-ddp] table, or that holds a conf/ of its own. Its config groups are
searched ahead of the package's (hydra_plugins/hydra_ddp_project), and its root is importable, so
`hydra-ddp train task=my_task` finds the project's YAML and its Python package without flags.

    [tool.hydra-ddp]
    conf = "conf"     # the project's config groups, relative to pyproject.toml (the default)
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from hydra_ddp.errors import UserError

PROVIDER = "hydra-ddp-project"


@dataclass(frozen=True)
class Project:
    root: Path
    conf: Optional[Path]  # None: the project has no config groups of its own


def find(start: Optional[Path] = None) -> Optional[Project]:
    """The project `start` (the working directory) is in: the nearest directory at or above it with
    a pyproject.toml that has [tool.hydra-ddp]; else `start` itself when it holds conf/. None: no
    project."""
    here = (start or Path.cwd()).resolve()
    for folder in (here, *here.parents):
        settings = _settings(folder / "pyproject.toml")
        if settings is not None:
            conf = folder / str(settings.get("conf", "conf"))
            if "conf" in settings and not conf.is_dir():
                raise UserError(
                    f"{folder / 'pyproject.toml'}: [tool.hydra-ddp] conf = "
                    f"{str(conf)!r} is not a directory; make it, or leave the key out"
                )
            return Project(folder, conf if conf.is_dir() else None)
    return Project(here, here / "conf") if (here / "conf").is_dir() else None


def _settings(pyproject: Path) -> Optional[dict]:
    if not pyproject.is_file():
        return None
    import tomllib

    try:
        tool = tomllib.loads(pyproject.read_text()).get("tool", {})
    except (OSError, ValueError) as error:
        raise UserError(
            f"{pyproject} cannot be read ({error}); fix it, or run from another directory"
        ) from None
    settings = tool.get("hydra-ddp")
    return settings if isinstance(settings, dict) else None


def importable(project: Optional[Project]) -> None:
    """The project's root (and its src/, for a src layout) first on sys.path: its package imports
    here, and in every worker (they are given the parent's sys.path)."""
    if project is None:
        return
    for folder in (project.root / "src", project.root):
        if folder.is_dir() and str(folder) not in sys.path:
            sys.path.insert(0, str(folder))


def shadowed(project_conf: Path, package_conf: Path) -> list[str]:
    """group/option.yaml files of the project that a built-in option of the same name would have
    been: the project's wins; said in one line each."""
    found = []
    for path in sorted(project_conf.rglob("*.yaml")):
        relative = path.relative_to(project_conf)
        if len(relative.parts) > 1 and (package_conf / relative).is_file():
            group, option = "/".join(relative.parts[:-1]), relative.stem
            found.append(
                f"hydra-ddp: {project_conf / relative} replaces the built-in {group}={option} "
                "(the project's file wins; rename it to keep both)"
            )
    return found


def same_dir(a: str | os.PathLike, b: str | os.PathLike) -> bool:
    try:
        return Path(a).resolve() == Path(b).resolve()
    except OSError:
        return False


def package_conf() -> Optional[Path]:
    """Where the package's own config groups are (hydra_ddp.conf): in a clone with an editable
    install, the repository's conf/ itself."""
    import importlib.util

    spec = importlib.util.find_spec("hydra_ddp.conf")
    locations = list(spec.submodule_search_locations or []) if spec else []
    return Path(locations[0]) if locations else None


def extra_conf(found: Optional[Project]) -> Optional[Path]:
    """The project's config groups, when they are not the package's own (a clone's conf/)."""
    if found is None or found.conf is None:
        return None
    own = package_conf()
    return None if own is not None and same_dir(found.conf, own) else found.conf


def package_config_path() -> str:
    """The package's config groups as a config_path Hydra takes: hydra_ddp.conf's directory (an
    installed package's, or a clone's conf/ through its editable install), else the clone's conf/
    found from this file (src/hydra_ddp/ run from the source tree)."""
    found = package_conf()
    return str(found if found is not None else Path(__file__).resolve().parents[2] / "conf")
