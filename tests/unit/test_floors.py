"""The dependencies' lower bounds are releases the suite runs (docs/releases.md): a floor below the
installed release is a promise no test keeps. When an upgrade moves the suite past a floor, this
fails until the floor is raised (or an oldest-versions run is added that tests it)."""

from __future__ import annotations

import re
import tomllib
from importlib.metadata import version

from support import REPO

# The ranges the code depends on in ways an older release breaks (FSDP2, DTensor, Hydra's
# composition, Optuna's ask/tell, transformers' packed positions).
HELD = ("torch", "torchvision", "hydra-core", "optuna", "transformers")


def _release(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", text.split("+")[0])[:3])


def _floors() -> dict[str, str]:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    specs = project["dependencies"] + project["optional-dependencies"]["transformers"]
    floors = {}
    for spec in specs:
        name, _, rest = re.match(r"([A-Za-z0-9_.-]+)\s*(>=\s*([\w.]+))?", spec).groups()
        if name in HELD:
            assert rest, f"pyproject.toml: {name} has no lower bound"
            floors[name] = rest
    return floors


def test_each_held_floor_is_the_release_the_suite_runs():
    floors = _floors()
    assert set(floors) == set(HELD), f"pyproject.toml lacks a range for {set(HELD) - set(floors)}"
    for name, floor in floors.items():
        installed = _release(version(name))
        wanted = _release(floor)
        # The floor names a major.minor (torch 2.14) or a full release (hydra-core 1.3.8): the
        # installed release must match it as far as it goes, so the floor is what ran.
        assert installed[: len(wanted)] == wanted, (
            f"{name}: the suite runs {version(name)}, the floor is {floor}; raise the floor in "
            "pyproject.toml (and docs/releases.md) or test the floor in a venv of its own"
        )
