"""The parent's validation, from train.py itself: a tracker whose package is not installed fails
before any process starts, with one clear line (the schema's checks in process:
tests/unit/test_config.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from support import REPO, train_env


# cold: the package is hidden in this command's own process (a warm start's fork has its own)
@pytest.mark.cold
@pytest.mark.parametrize("package, title", [("mlflow", "MLflow"), ("wandb", "Weights & Biases")])
def test_a_tracker_without_its_package_installed_fails_before_launch(
    tmp_path: Path, package: str, title: str
):
    """As if the package were not installed (a None entry in sys.modules is how Python marks a
    module that must not be imported): one line saying how to install it, and no worker started."""
    code = (
        f"import runpy, sys; sys.modules['{package}'] = None; sys.argv = ['train.py', "
        f"'logger=[tensorboard,{package}]', 'hydra.run.dir={tmp_path / 'run'}']; "
        "runpy.run_path('train.py', run_name='__main__')"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO,
        env=train_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert (
        len(lines) == 1
        and f"needs {title}" in lines[0]
        and f"pip install -e '.[{package}]'" in lines[0]
    ), proc.stderr
    assert not (tmp_path / "run").exists()  # refused before launch: no run directory left
