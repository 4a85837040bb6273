"""A run's directory and the name of everything written in it: the one place an output is named.

RUN_DIR/train.log (eval.log)      every rank's log
RUN_DIR/summary.json (eval.json)  the result
RUN_DIR/checkpoints/              step-N, last, best
RUN_DIR/.staging/                 sharded checkpoints on their way to a bucket (checkpoint.dir)
RUN_DIR/metrics.csv, tensorboard/ the loggers'
RUN_DIR/predictions.csv           eval.py predict=true
RUN_DIR/profile/rankR.json        trainer.profile
RUN_DIR/error.txt                 a sweep job's failure
RUN_DIR/rendezvous.store          init_method=file
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Optional, Union

# What Hydra writes into a run directory before the job's code runs: .hydra/ and the log file.
HYDRA_FILES = frozenset({"config.yaml", "hydra.yaml", "overrides.yaml"})


class RunDir:
    """Where each output of a run lives (no file is created here)."""

    def __init__(self, path: Union[str, Path]):
        self.path = Path(path)

    def __fspath__(self) -> str:
        return str(self.path)

    def __str__(self) -> str:
        return str(self.path)

    def log(self, job: str) -> Path:
        """The workers' log: train.log, or eval.py's eval.log."""
        return self.path / f"{job}.log"

    def result(self, job: str) -> Path:
        """The run's summary (train) or eval.py's result."""
        return self.path / ("eval.json" if job == "eval" else "summary.json")

    summary = property(lambda self: self.path / "summary.json")
    # An earlier run's summary while a run continues in its directory: put back if this one writes
    # none.
    earlier_summary = property(lambda self: self.path / ".summary.earlier.json")
    eval_result = property(lambda self: self.path / "eval.json")
    predictions = property(lambda self: self.path / "predictions.csv")
    checkpoints = property(lambda self: self.path / "checkpoints")
    staging = property(lambda self: self.path / ".staging")
    metrics_csv = property(lambda self: self.path / "metrics.csv")
    tensorboard = property(lambda self: self.path / "tensorboard")
    profile = property(lambda self: self.path / "profile")
    # a sweep job's one-line failure, written by train.py
    error = property(lambda self: self.path / "error.txt")
    # How Slurm ended a job that never finished (cancelled, timeout…):
    # hydra_plugins/hydra_ddp_slurm.
    slurm_state = property(lambda self: self.path / "slurm_state.txt")
    rendezvous_store = property(lambda self: self.path / "rendezvous.store")
    mlflow_run_id = property(lambda self: self.path / "mlflow_run_id")
    # logger=wandb; its files in wandb/
    wandb_run_id = property(lambda self: self.path / "wandb_run_id")

    def discard_if_untouched(self, job: str) -> bool:
        """Remove a run directory that holds only what Hydra made for this command (.hydra/, an
        empty log): a config refused before launch leaves no run behind. Anything else in it (an
        earlier run's checkpoints, a line in the log) keeps it all. Whether it was removed."""
        hydra, log = self.path / ".hydra", self.log(job)
        try:
            entries = {p.name for p in self.path.iterdir()}
            # .hydra/ is there: Hydra made this directory for the run (not so an outside launch's
            # other ranks, whose run directory is the working one).
            untouched = (
                hydra.is_dir()
                and entries <= {".hydra", log.name}
                and {p.name for p in hydra.iterdir()} <= HYDRA_FILES
                and (not log.exists() or log.stat().st_size == 0)
            )
        except OSError:
            return False
        if untouched:
            shutil.rmtree(self.path, ignore_errors=True)
        return untouched


# The default run directories this process claimed: {the name asked for: the one it got}.
_CLAIMED: dict[str, str] = {}


def claim_new(path: str) -> str:
    """A run directory of its own for this run, made here: `path` (the config's default, named to
    the second), or where another run made it first, `path-2`, `path-3`, … Two runs started in the
    same second (a Slurm array, two terminals) would otherwise share one directory, its log,
    checkpoints and metrics. Made with mkdir, which only one process can win; the same answer for
    the same `path` every time this process asks (Hydra resolves the run directory more than once).

    Registered as the config resolver `hydra_ddp.new_dir` (conf/config.yaml's hydra.run.dir)."""
    if path in _CLAIMED:
        return _CLAIMED[path]
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    for number in range(1, 10_000):
        candidate = path if number == 1 else f"{path}-{number}"
        try:
            os.mkdir(candidate)
        except FileExistsError:
            continue
        _CLAIMED[path] = candidate
        return candidate
    raise RuntimeError(f"no free run directory next to {path}")  # ten thousand runs in one second


def claimed_instead(run_dir: Path) -> Optional[str]:
    """The default name this run asked for, where another run had already taken it (else None)."""
    for asked, got in _CLAIMED.items():
        if asked != got and Path(got).resolve() == run_dir.resolve():
            return asked
    return None
