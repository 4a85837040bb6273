"""Every pair of options from two config groups through train.py's check: kit code, both a script
and a module. conftest.py runs it as a script in the background, at the CPU's idle priority, while
the rest of the suite runs; tests/e2e/test_check.py imports it (`import pair_checks`, from tests/ on
sys.path, as support and servers) for the pairs, and reads the results at the end, or, run alone,
checks them itself (check_all).

    python tests/pair_checks.py OUT.json
"""

from __future__ import annotations

import contextlib
import io
import itertools
import json
import multiprocessing
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CONF = REPO / "conf"
GROUPS = (
    "backend",
    "init_method",
    "launcher",
    "strategy",
    "task",
    "model",
    "data",
    "optim",
    "scheduler",
    "logger",
    "debug",
    "experiment",
    "hparams_search",
)


def options(group: str) -> list[str]:
    prefix = "+" if group == "experiment" else ""
    return [f"{prefix}{group}={path.stem}" for path in sorted((CONF / group).glob("*.yaml"))]


def pairs() -> list[tuple[str, str]]:
    """Every option of every group, each against every other group's."""
    found = {group: options(group) for group in GROUPS}
    return [
        (a, b)
        for one, other in itertools.combinations(GROUPS, 2)
        for a in found[one]
        for b in found[other]
    ]


def defaults() -> set[str]:
    """The default run's option of each group (conf/config.yaml): choosing it changes nothing."""
    import yaml

    entries = yaml.safe_load((CONF / "config.yaml").read_text())["defaults"]
    return {
        f"{group}={option}"
        for entry in entries
        if isinstance(entry, dict)
        for group, option in entry.items()
        if isinstance(option, str)
    }


def check(overrides: tuple[str, ...]) -> tuple[tuple[str, ...], str, str]:
    """(overrides, "ok" | "error" | "crash", the line or what was raised)."""
    from hydra_ddp.errors import UserError
    from hydra_ddp.tools import preflight

    with tempfile.TemporaryDirectory() as folder, contextlib.redirect_stdout(io.StringIO()):
        try:
            preflight.check(CONF, list(overrides), Path(folder) / "run")
        except UserError as error:
            return overrides, "error", str(error)
        except Exception as error:  # noqa: BLE001  (what the test exists to find)
            return overrides, "crash", f"{type(error).__name__}: {error}"
    return overrides, "ok", ""


def check_all() -> list[tuple[tuple[str, str], str, str]]:
    """(pair, outcome, what) for every pair. A pair with a group's default option composes the same
    config as its other option alone (two defaults: the default run), so each distinct config is
    checked once and its outcome is every such pair's."""
    every, default = pairs(), defaults()
    essence = {pair: tuple(option for option in pair if option not in default) for pair in every}
    # each check composes anew, on both cores
    with multiprocessing.get_context("spawn").Pool(2) as pool:
        outcomes = {
            key: (outcome, what)
            for key, outcome, what in pool.map(check, sorted(set(essence.values())), chunksize=8)
        }
    return [(pair, *outcomes[essence[pair]]) for pair in every]


if __name__ == "__main__":
    out = Path(sys.argv[1])
    results = check_all()
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(json.dumps([[list(pair), outcome, what] for pair, outcome, what in results]))
    tmp.replace(out)  # whole or not at all: the test reads it once it exists
