"""Rank 0's reporting of a run: the loggers (preloaded while the ranks start), the progress bar,
summary.json and the summary printed at the end."""

from __future__ import annotations

import json
import logging
import os
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Optional

from hydra_ddp.config.run_config import RunConfig
from hydra_ddp.reporting import flops, loggers
from hydra_ddp.rundir import RunDir
from hydra_ddp.runtime.ranklog import FILE_ONLY
from hydra_ddp.runtime.ranks import RankInfo

log = logging.getLogger(__name__)


def _logger_nodes(cfg: RunConfig) -> list[Any]:
    """The configured loggers' config nodes (a logger set to null is off)."""
    return [node for node in (cfg.logger or {}).values() if node is not None]


def preload_loggers(cfg: RunConfig) -> None:
    """Rank 0, before the process group: the configured loggers' imports (Logger.preload). A logger
    that cannot load fails where it is made, after the group is up, as every rank's error."""
    from hydra.utils import get_class

    for node in _logger_nodes(cfg):
        try:
            getattr(get_class(node["_target_"]), "preload", lambda: None)()
        except Exception:  # noqa: BLE001  (the Reporter reports it)
            pass


def show_progress(setting: Optional[bool], rank: RankInfo) -> bool:
    """A progress bar on rank 0 when it writes to a terminal; quiet in pipes and CI."""
    if not rank.is_main:
        return False
    return sys.stderr.isatty() if setting is None else setting


class Reporter:
    """Rank 0's loggers (conf/logger/: TensorBoard and metrics.csv by default) and summary; a silent
    stand-in on the other ranks."""

    def __init__(
        self, rank: RankInfo, run_dir: Path, cfg: RunConfig, resume_step: Optional[int] = None
    ):
        self.run_dir = run_dir
        self.is_main = rank.is_main
        self.loggers: list[Any] = []
        if rank.is_main:
            from hydra.utils import instantiate

            log.info("config\n%s", loggers.config_yaml(cfg).rstrip(), extra=FILE_ONLY)
            for node in _logger_nodes(cfg):
                # A partial of the YAML's own keys, called with the rest: passed to instantiate,
                # the whole config would be made a DictConfig and back, for each logger.
                make = instantiate(node, _partial_=True, _recursive_=False, _convert_="all")
                self.loggers.append(make(run_dir=run_dir, config=cfg, resume_step=resume_step))

    def series(self, tag: str, steps: Iterable[int], values: Iterable[float]) -> None:
        for step, value in zip(steps, values):
            self.scalars({tag: value}, step)

    def scalars(self, values: dict[str, float], step: int) -> None:
        for logger in self.loggers:
            logger.metrics(values, step)

    def flush(self) -> None:
        """What the loggers hold is on disk: before a checkpoint (Logger.flush)."""
        for logger in self.loggers:
            logger.flush()

    def finish(self, summary: dict[str, Any], hparams: dict[str, Any]) -> None:
        """The loggers' last words, summary.json and the one-screen summary (rank 0)."""
        for logger in self.loggers:
            logger.finish(summary, hparams)
        self.close()
        if not self.is_main:
            return
        # Atomic: the parent takes a summary.json of this run as proof that the run completed.
        write_json(summary, RunDir(self.run_dir).summary)
        log.info("run summary\n%s", format_summary(summary))

    def close(self) -> None:
        for logger in self.loggers:
            logger.close()
        self.loggers = []


def write_json(value: Any, path: Path) -> None:
    """Written whole or not at all (temp file, rename): a reader never sees half of it."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(value, indent=2) + "\n")
    os.replace(tmp, path)


def format_summary(s: dict[str, Any]) -> str:
    tested, monitor = s["tested"] or {}, s["monitor"]
    ended = {
        "early_stopping": f"early stopping (best at epoch {monitor['best_epoch']})",
        "max_time": "trainer.max_time spent",
    }.get(s["ended_by"], s["ended_by"])
    if s.get("stopped_by"):
        ended = f"{s['stopped_by']}: checkpointed, to be continued"
    rows = [
        (
            "world size",
            f"{s['world_size']} ({s['nnodes']} node(s) × {s['nproc_per_node']}, {s['device']})",
        ),
        ("backend / launcher", f"{s['backend']} / {s['launcher']}"),
        ("init method", s["init_method"]),
        *(
            [
                (
                    "strategy",
                    f"{s['strategy']}, {s['model_state_bytes']['total'] / 2**20:.2f} "
                    "MB of model state per rank (parameters, gradients, optimizer)",
                )
            ]
            if s.get("model_state_bytes")
            else []
        ),
        ("epochs / steps", f"{s['epochs']} / {s['steps']} (ended by {ended})"),
        *([("batch", _batch_line(s))] if s.get("accumulate") else []),
        ("train loss", f"{s['train_loss']:.4f}"),
    ]
    names = s.get("metrics", ["loss", "accuracy"])  # the task's metrics
    if s.get("val_samples") is not None:
        rows.append(
            (
                f"val {' / '.join(names)}",
                " / ".join(f"{s[f'val_{name}']:.4f}" for name in names)
                + (
                    f" (best {monitor['metric']}, step {monitor['best_step']})"
                    if monitor["best_step"] is not None
                    else " (last)"
                ),
            )
        )
    if tested:
        on = f"{tested['weights']} weights, step {tested['step']}" + (
            f": {tested['checkpoint']}" if tested["checkpoint"] else ""
        )
        rows += [(f"test {name}", f"{s[f'test_{name}']:.4f}") for name in names]
        rows[-1] = (rows[-1][0], f"{rows[-1][1]} ({s['test_samples']} samples; once, on the {on})")
    rows += [
        (
            "throughput",
            f"{s['samples_per_sec']:.0f} samples/s"
            + (f" ({s['tokens_per_sec']:,.0f} tokens/s)" if s.get("tokens_per_sec") else ""),
        ),
        *(
            [("model FLOP/s", flops.line(s["flops"]))]
            if s.get("flops") and flops.line(s["flops"])
            else []
        ),
        *([("straggler", s["straggler"]["message"])] if s.get("straggler") else []),
        (
            "fast settings",
            ", ".join(name.split(".")[-1] for name, on in s.get("settings", {}).items() if on)
            or "none",
        ),
        *(
            [
                (
                    "compiled",
                    {
                        "blocks": "each block (torch.compile)",
                        "model": "the whole model (torch.compile)",
                    }[s["compile"]],
                )
            ]
            if s.get("compile")
            else []
        ),
        *(
            [
                (
                    "start-up",
                    f"workers ready at {s['time_to_workers_ready_s']:.1f} s, the first step "
                    f"done at {s['time_to_first_step_s']:.1f} s (from the command's start)",
                )
            ]
            if s.get("time_to_workers_ready_s") is not None
            and s.get("time_to_first_step_s") is not None
            else []
        ),
        (
            "wall time",
            f"{s['wall_time_s']:.1f} s (training {s['train_time_s']:.1f} "
            f"s, evaluation {s['eval_time_s']:.1f} s, {s['checkpoints']} "
            f"checkpoint(s) {s['checkpoint_time_s']:.1f} s)",
        ),
        ("run directory", s["run_dir"]),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"  {k:<{width}}  {v}" for k, v in rows)


def _batch_line(s: dict[str, Any]) -> str:
    """An optimizer step's samples: micro-batch × accumulation × replicas (and its tokens)."""
    micro, accumulate, total = s["batch_size"], s["accumulate"], s["global_batch_size"]
    replicas = total // (micro * accumulate)
    tokens = f" ({s['tokens_per_step']:,.0f} tokens)" if s.get("tokens_per_step") else ""
    return (
        f"{total} samples per optimizer step{tokens}: micro-batches of {micro} × "
        f"{accumulate} accumulated × {replicas} replica{'s' if replicas > 1 else ''}"
    )


def hparams(cfg: RunConfig, world_size: int) -> dict[str, Any]:
    """The run's key settings, for the loggers' hparams tables."""
    return {
        "world_size": world_size,
        "backend": cfg.backend.name,
        "launcher": cfg.launcher.name,
        "model": cfg.model["_target_"].rsplit(".", 1)[-1],
        "optim": cfg.optim["_target_"].rsplit(".", 1)[-1],
        "lr": cfg.optim.get("lr"),
        "weight_decay": cfg.optim.get("weight_decay"),
        "batch_size": cfg.data.batch_size,
        "epochs": cfg.trainer.epochs,
        "seed": cfg.trainer.seed,
    }
