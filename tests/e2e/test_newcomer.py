"""README's front door and tour as a newcomer takes them: a fresh copy of the repository (its files,
as a clone has them), the commands as README.md writes them (support.documented_command; `make
train` as docs/tutorial.md gives it, README's being in the suite's own block), whole (not cut to two
steps as the docs test runs every page's), and what each line promises checked. The venv is the
suite's (its install is what `.ci/run` proves from a clean checkout); `make train` must find it up
to date.

The tour's other lines (a sharded transformer, a Hugging Face model, packed documents, torchrun
over tcp) run in shorter runs of their own tests or in the docs test (the doc map, docs/testing.md):
their whole runs take minutes each on 2 cores.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from support import REPO, documented_command, train_env


def _bash(command: str, clone: Path, timeout: float) -> subprocess.CompletedProcess:
    env = {k: v for k, v in train_env().items() if k != "PYTHONPATH"}  # a newcomer's shell
    done = subprocess.run(
        ["bash", "-c", command], cwd=clone, env=env, capture_output=True, text=True, timeout=timeout
    )
    assert done.returncode == 0, (
        f"{command}: exit {done.returncode}\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}"
    )
    return done


def _runs(clone: Path) -> list[Path]:
    return sorted(p.parent for p in (clone / "outputs" / "runs").glob("*/*/summary.json"))


@pytest.fixture(scope="module")
def clone(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("newcomer") / "hydra-ddp"
    files = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.splitlines()
    for name in files:
        if (REPO / name).is_file():
            (folder / name).parent.mkdir(parents=True, exist_ok=True)
            # mtimes kept: make compares them with the venv's stamp
            shutil.copy2(REPO / name, folder / name)
    (folder / ".venv").symlink_to(Path(sys.executable).parents[1])
    stale = subprocess.run(["make", "-q", ".venv/.installed"], cwd=folder).returncode
    assert not stale, "the suite's venv is older than pyproject.toml or setup.py: run make first"
    return folder


@pytest.mark.timeout(600)
def test_the_front_door_and_the_tour_do_what_their_lines_say(clone: Path):
    # make train: "the classic MNIST CNN on scikit-learn's handwritten digits with 2 CPU workers ...
    # and tests the weights that did best on validation, once".
    _bash(documented_command("docs/tutorial.md", "make train"), clone, timeout=300)
    (first,) = _runs(clone)
    s = json.loads((first / "summary.json").read_text())
    config = (first / ".hydra" / "config.yaml").read_text()
    assert "MnistCNN" in config and "hydra_ddp.data.digits" in config, config
    assert s["world_size"] == 2 and s["device"] == "cpu" and s["launcher"] == "spawn"
    assert s["test_passes"] == 1 and s["tested"]["step"] == s["monitor"]["best_step"]
    first_steps = s["steps"]

    # "ResNet-18 on random images and labels: a speed check, at chance accuracy by design".
    _bash(documented_command("README.md", "train.py model=resnet18"), clone, timeout=300)
    (resnet,) = set(_runs(clone)) - {first}
    s = json.loads((resnet / "summary.json").read_text())
    # 10 classes: 0.1
    assert s["steps"] == 20 and 0.0 <= s["test_accuracy"] < 0.2, s["test_accuracy"]

    # "not only classifiers": a regression, its own metrics.
    _bash(documented_command("README.md", "train.py task=regression"), clone, timeout=300)
    (regression,) = set(_runs(clone)) - {first, resnet}
    s = json.loads((regression / "summary.json").read_text())
    assert {"test_mse", "test_mae", "test_r2"} <= set(s) and "test_accuracy" not in s

    # "compose and check; launch nothing".
    before = set(_runs(clone))
    checked = _bash(
        documented_command("README.md", "train.py --check trainer.nproc=4"), clone, timeout=120
    )
    assert (
        "hydra-ddp: config OK: 4 worker(s) on cpu" in checked.stdout and set(_runs(clone)) == before
    )

    # "continue a run (stopped, or given more epochs) from its newest good checkpoint": the first
    # run, complete, trains nothing and says so; given another epoch, it trains on from its end.
    resume = documented_command(
        "README.md", "train.py hydra.run.dir=outputs/runs/DATE/TIME trainer.resume=auto"
    )
    date_time = os.path.relpath(first, clone / "outputs" / "runs")
    done = _bash(resume.replace("DATE/TIME", date_time), clone, timeout=120)
    assert f"is complete (step {first_steps}, ended by epochs): nothing to train" in done.stderr
    epochs = json.loads((first / "summary.json").read_text())["epochs"]
    _bash(
        resume.replace("DATE/TIME", date_time) + f" trainer.epochs={epochs + 1}", clone, timeout=300
    )
    s = json.loads((first / "summary.json").read_text())
    assert s["epochs"] == epochs + 1 and s["resumed_from"] is not None
