"""Where a run's numbers go: rank 0's loggers, chosen in conf/logger/ (several at once).

Every logger receives the same global (all-reduced) values from the Reporter. Adding one is a
small class with these methods and a YAML file naming it with `_target_`; the Reporter passes
`run_dir`, `run_config` (the resolved config) and `resume_step` (the step a resumed run continues
after, or None) besides the YAML's own keys.
"""

from __future__ import annotations

import csv
import os
from pathlib import Path
from typing import Any, Optional

from omegaconf import OmegaConf

TENSORBOARD_DIR = "tensorboard"
CSV_FILE = "metrics.csv"


class Logger:
    """The interface (every method may do nothing)."""

    def metrics(self, values: dict[str, float], step: int) -> None: ...

    def finish(self, summary: dict[str, Any], hparams: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


class TensorBoard(Logger):
    """One event file in run_dir/tensorboard: scalars, the config as text, the hparams table."""

    def __init__(self, run_dir: Path, run_config: dict[str, Any], resume_step: Optional[int] = None):
        from torch.utils.tensorboard import SummaryWriter

        # Resuming: TensorBoard hides the earlier file's events after the checkpoint's step.
        purge_step = resume_step + 1 if resume_step is not None else None
        self.writer = SummaryWriter(log_dir=str(run_dir / TENSORBOARD_DIR), purge_step=purge_step)
        self.writer.add_text("config", "```yaml\n" + OmegaConf.to_yaml(run_config) + "```", 0)

    def metrics(self, values: dict[str, float], step: int) -> None:
        for tag, value in values.items():
            self.writer.add_scalar(tag, value, step)

    def finish(self, summary: dict[str, Any], hparams: dict[str, Any]) -> None:
        from torch.utils.tensorboard.summary import hparams as hparams_summary

        metrics = {f"hparam/{k}": summary[k] for k in ("val_accuracy", "val_loss", "test_accuracy", "test_loss",
                                                       "samples_per_sec") if summary.get(k) is not None}
        # Written into this writer's own file: SummaryWriter.add_hparams would open a second one.
        for event in hparams_summary(hparams, metrics):
            self.writer.file_writer.add_summary(event)
        self.metrics(metrics, summary["steps"])

    def close(self) -> None:
        self.writer.close()


class CSV(Logger):
    """run_dir/metrics.csv: one row per step that logged anything, one column per metric.

    Steps only grow, so a row is written once a later step arrives (a step's train loss, its
    validation and its test come in separate calls). A new metric rewrites the file with the
    wider header; a resumed run keeps the rows up to its checkpoint's step.
    """

    def __init__(self, run_dir: Path, run_config: dict[str, Any], resume_step: Optional[int] = None,
                 filename: str = CSV_FILE):
        self.path = run_dir / filename
        self.rows: list[dict[str, Any]] = []
        self.columns: list[str] = ["step"]
        if resume_step is not None and self.path.exists():
            with open(self.path, newline="") as f:
                reader = csv.DictReader(f)
                self.columns = list(reader.fieldnames or ["step"])
                self.rows = [r for r in reader if int(r["step"]) <= resume_step]
        self.written = 0  # rows already in the file
        self.file_columns: list[str] = []  # its header
        self._rewrite()

    def metrics(self, values: dict[str, float], step: int) -> None:
        if self.rows and int(self.rows[-1]["step"]) == step:
            row = self.rows[-1]
        else:
            self._write_done()
            row = {"step": step}
            self.rows.append(row)
        for name, value in values.items():
            if name not in self.columns:
                self.columns.append(name)
            row[name] = value

    def _write_done(self) -> None:
        """Every row but the last (which may still grow) goes to the file."""
        done = len(self.rows) - 1
        if done <= self.written:
            return
        if self.file_columns != self.columns:
            self._rewrite(upto=done)
            return
        with open(self.path, "a", newline="") as f:
            csv.DictWriter(f, fieldnames=self.columns).writerows(self.rows[self.written:done])
        self.written = done

    def _rewrite(self, upto: Optional[int] = None) -> None:
        upto = len(self.rows) if upto is None else upto
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        with open(tmp, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=self.columns)
            writer.writeheader()
            writer.writerows(self.rows[:upto])
        os.replace(tmp, self.path)
        self.written, self.file_columns = upto, list(self.columns)

    def finish(self, summary: dict[str, Any], hparams: dict[str, Any]) -> None:
        self._rewrite()

    def close(self) -> None:
        self._rewrite()
