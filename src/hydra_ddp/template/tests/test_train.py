"""The project trains: two steps at two ranks, through the hydra-ddp command as you run it."""

import json
import subprocess
import sys
from pathlib import Path

PROJECT = Path(__file__).resolve().parents[1]


def test_two_steps_at_two_ranks(tmp_path: Path):
    run_dir = tmp_path / "run"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "hydra_ddp",
            "train",
            "+experiment=spirals",
            "trainer.nproc=2",
            "trainer.max_steps=2",
            f"hydra.run.dir={run_dir}",
        ],
        cwd=PROJECT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 2 and summary["world_size"] == 2
