"""What a run shows and leaves behind: rank-tagged logs, rank 0's TensorBoard file, summary.json.

Every rank logs to the run's one log file; only rank 0 prints to the console, writes
TensorBoard events and the summary. Non-zero ranks get a Reporter whose writes do nothing.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path
from typing import Any, Iterable, Optional

from omegaconf import OmegaConf

from hydra_ddp.distributed import RankInfo

log = logging.getLogger(__name__)

LOG_FILE = "train.log"  # eval.py's workers: eval.log
SUMMARY_FILE = "summary.json"
TENSORBOARD_DIR = "tensorboard"
_FORMAT = "[%(asctime)s][rank {rank}][%(name)s][%(levelname)s] - %(message)s"
# `extra=` for records that belong in the log file only (tracebacks: the console gets one line).
FILE_ONLY = {"file_only": True}


def log_file(task: str) -> str:
    return "eval.log" if task == "eval" else LOG_FILE


def setup_logging(rank: RankInfo, run_dir: Path, task: str = "train") -> None:
    """All ranks append to run_dir/train.log (eval.log; tagged with the rank); rank 0 also prints."""
    root = logging.getLogger()
    for handler in root.handlers[:]:  # an externally launched rank 0 still holds Hydra's handlers
        root.removeHandler(handler)
        handler.close()
    formatter = logging.Formatter(_FORMAT.format(rank=rank.rank))
    handlers: list[logging.Handler] = [logging.FileHandler(run_dir / log_file(task), mode="a")]
    if rank.is_main:
        console = logging.StreamHandler(sys.stdout)
        console.addFilter(lambda record: not getattr(record, "file_only", False))
        handlers.append(console)
    for handler in handlers:
        handler.setFormatter(formatter)
        root.addHandler(handler)
    root.setLevel(logging.INFO)


def show_progress(setting: Optional[bool], rank: RankInfo) -> bool:
    """A progress bar on rank 0 when it writes to a terminal; quiet in pipes and CI."""
    if not rank.is_main:
        return False
    return sys.stderr.isatty() if setting is None else setting


class Reporter:
    """Rank 0's TensorBoard writer and summary; a silent stand-in on the other ranks."""

    def __init__(self, rank: RankInfo, run_dir: Path, cfg: Any, purge_step: Optional[int] = None):
        self.run_dir = run_dir
        self.writer = None
        if rank.is_main:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(log_dir=str(run_dir / TENSORBOARD_DIR), purge_step=purge_step)
            config_yaml = OmegaConf.to_yaml(cfg)
            self.writer.add_text("config", "```yaml\n" + config_yaml + "```", 0)

    def series(self, tag: str, steps: Iterable[int], values: Iterable[float]) -> None:
        if self.writer:
            for step, value in zip(steps, values):
                self.writer.add_scalar(tag, value, step)

    def scalars(self, values: dict[str, float], step: int) -> None:
        if self.writer:
            for tag, value in values.items():
                self.writer.add_scalar(tag, value, step)

    def finish(self, summary: dict[str, Any], hparams: dict[str, Any]) -> None:
        """The hparams table, summary.json and the one-screen summary (rank 0)."""
        if not self.writer:
            return
        from torch.utils.tensorboard.summary import hparams as hparams_summary

        metrics = {f"hparam/{k}": summary[k] for k in ("val_accuracy", "val_loss", "test_accuracy", "test_loss",
                                                       "samples_per_sec") if summary.get(k) is not None}
        # Written into this writer's own file: SummaryWriter.add_hparams would open a second one.
        for event in hparams_summary(hparams, metrics):
            self.writer.file_writer.add_summary(event)
        for tag, value in metrics.items():
            self.writer.add_scalar(tag, value, summary["steps"])
        self.writer.close()
        self.writer = None
        # Atomic: the parent takes a summary.json of this run as proof that the run completed.
        tmp = self.run_dir / f".{SUMMARY_FILE}.tmp"
        tmp.write_text(json.dumps(summary, indent=2) + "\n")
        os.replace(tmp, self.run_dir / SUMMARY_FILE)
        log.info("run summary\n%s", format_summary(summary))

    def close(self) -> None:
        if self.writer:
            self.writer.close()
            self.writer = None


def format_summary(s: dict[str, Any]) -> str:
    tested, monitor = s["tested"] or {}, s["monitor"]
    ended = {"early_stopping": f"early stopping (best at epoch {monitor['best_epoch']})",
             "max_time": "trainer.max_time spent"}.get(s["ended_by"], s["ended_by"])
    rows = [
        ("world size", f"{s['world_size']} ({s['nnodes']} node(s) × {s['nproc_per_node']}, {s['device']})"),
        ("backend / launcher", f"{s['backend']} / {s['launcher']}"),
        ("init method", s["init_method"]),
        ("epochs / steps", f"{s['epochs']} / {s['steps']} (ended by {ended})"),
        ("train loss", f"{s['train_loss']:.4f}"),
    ]
    if s.get("val_loss") is not None:
        rows.append(("val loss / accuracy", f"{s['val_loss']:.4f} / {s['val_accuracy']:.4f}"
                     + (f" (best {monitor['metric']}, step {monitor['best_step']})" if monitor["best_step"] is not None
                        else " (last)")))
    if tested:
        on = (f"{tested['weights']} weights, step {tested['step']}"
              + (f": {tested['checkpoint']}" if tested["checkpoint"] else ""))
        rows += [("test loss", f"{s['test_loss']:.4f}"),
                 ("test accuracy", f"{s['test_accuracy']:.4f} ({s['test_samples']} samples; once, on the {on})")]
    rows += [
        ("throughput", f"{s['samples_per_sec']:.0f} samples/s"),
        ("fast settings", ", ".join(name.split(".")[-1] for name, on in s.get("settings", {}).items() if on) or "none"),
        ("wall time", f"{s['wall_time_s']:.1f} s (training {s['train_time_s']:.1f} s, evaluation "
                      f"{s['eval_time_s']:.1f} s, {s['checkpoints']} checkpoint(s) {s['checkpoint_time_s']:.1f} s)"),
        ("run directory", s["run_dir"]),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"  {k:<{width}}  {v}" for k, v in rows)
