"""A run's directory and the name of everything written in it: the one place an output is named.

    RUN_DIR/train.log (eval.log)   every rank's log        RUN_DIR/summary.json (eval.json)  the result
    RUN_DIR/checkpoints/           step-N, last, best      RUN_DIR/metrics.csv, tensorboard/ the loggers'
    RUN_DIR/predictions.csv        eval.py predict=true    RUN_DIR/profile/rankR.json        trainer.profile
    RUN_DIR/error.txt              a sweep job's failure   RUN_DIR/rendezvous.store          init_method=file
"""

from __future__ import annotations

from pathlib import Path
from typing import Union


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
    eval_result = property(lambda self: self.path / "eval.json")
    predictions = property(lambda self: self.path / "predictions.csv")
    checkpoints = property(lambda self: self.path / "checkpoints")
    metrics_csv = property(lambda self: self.path / "metrics.csv")
    tensorboard = property(lambda self: self.path / "tensorboard")
    profile = property(lambda self: self.path / "profile")
    error = property(lambda self: self.path / "error.txt")  # a sweep job's one-line failure, written by train.py
    # How Slurm ended a job that never finished (cancelled, timeout…): hydra_plugins/hydra_ddp_slurm.
    slurm_state = property(lambda self: self.path / "slurm_state.txt")
    rendezvous_store = property(lambda self: self.path / "rendezvous.store")
    mlflow_run_id = property(lambda self: self.path / "mlflow_run_id")
    wandb_run_id = property(lambda self: self.path / "wandb_run_id")  # logger=wandb; its files in wandb/
