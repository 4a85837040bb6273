"""The run's summary, read off the Trainer once the loop has ended: the loop's results and how the
worker ran it, as summary.json holds them."""

from __future__ import annotations

import resource
import time
from pathlib import Path
from typing import Any, Optional

from hydra_ddp import blueprint
from hydra_ddp.parallel import distributed, strategies
from hydra_ddp.reporting import flops
from hydra_ddp.runtime.ranks import RankInfo
from hydra_ddp.training.trainer import Trainer


def results(trainer: Trainer) -> dict[str, Any]:
    """The run's outcome, as summary.json holds it (how_it_ran adds how it ran)."""
    monitor, selected = trainer.state.monitor, trainer.validation.selected()
    max_steps, state = trainer.settings.max_steps, trainer.state
    return {
        "epochs": trainer.length.epochs,
        "steps": state.step,
        "train_loss": trainer.train_loss,
        # The selected weights' validation (the best by the monitor, else the last validation).
        **{
            f"val_{name}": selected.get(f"val_{name}")
            for name in [*trainer.validation.task.metrics, "samples"]
        },
        # the task's, in its order (reports' columns)
        "metrics": list(trainer.validation.task.metrics),
        **trainer.validation.test_metrics,
        "tested": trainer.validation.tested,
        "test_passes": trainer.loaders.test.passes,
        "monitor": {
            "metric": monitor.metric,
            "mode": monitor.mode,
            "best": monitor.best,
            "best_step": monitor.best_step,
            "best_epoch": monitor.best_epoch,
        },
        "objective": monitor.best,  # what train.py returns to a sweeper
        "history": trainer.validation.history,
        # throughput, tokens per step (a language model's, else None), rank 0's overheads, each
        # rank's time by phase
        **trainer.meter.results(trainer.step.strategy.sum_over_replicas),
        "world_size_history": state.world_sizes,
        "stopped_by": trainer.ending.stopped_by,
        "ended_by": (
            trainer.ending.stopped_by
            or trainer.ending.ended_by
            or ("max_steps" if max_steps and state.step >= max_steps else "epochs")
        ),
    }


def how_it_ran(
    trainer: Trainer,
    rank: RankInfo,
    out: Path,
    fast: dict[str, bool],
    resume: Optional[tuple[Path, dict[str, Any]]],
    started_at: float,
    entered_at: float,
) -> dict[str, Any]:
    """The run's summary: the loop's results and how the worker ran it (the world and its launch,
    the batches, the settings it settled (`fast`), the state a rank holds, start-up, memory, the
    FLOP count). Every rank calls it: its figures are the ranks' extremes."""
    result = results(trainer)
    cfg, device, task, spread = (
        trainer.cfg,
        trainer.device,
        trainer.step.task,
        trainer.step.strategy,
    )
    # Start-up in two parts: until the last worker's own code began (interpreters, imports: for
    # forks of the forkserver, its imports), then the group, data, model and the first step.
    workers_ready_at = distributed.max_over_ranks(entered_at, device)
    return {
        "world_size": rank.world_size,
        # also under srun, submitit, mpirun
        "nnodes": max(1, rank.world_size // rank.local_world_size),
        "nproc_per_node": rank.local_world_size,
        "backend": cfg.backend.name,
        "launcher": cfg.launcher.name,
        "init_method": cfg.init_method.name,
        "device": device.type,
        "batch_size": cfg.data.batch_size,  # per micro-batch, per model replica
        "accumulate": cfg.trainer.accumulate,
        # per optimizer step: all replicas and micro-batches
        "global_batch_size": cfg.data.global_batch_size,
        "threads_per_rank": cfg.trainer.threads,  # settled at launch (launch/resolve.py)
        "settings": fast,
        "compile": cfg.trainer.compile,  # false, or torch.compile's "blocks" or whole "model"
        "deterministic": cfg.trainer.deterministic,
        "strategy": spread.name,
        # Parameters, gradients and optimizer state held by one rank (the largest): FSDP's
        # shards.
        "model_state_bytes": distributed.most_over_ranks(
            strategies.local_state_bytes(spread, trainer.step.optimizer), device
        ),
        **spread.summary(),  # its gradient exchange: DDP's hook and the bytes it sent
        **result,
        "time_to_first_step_s": result["first_step_at"] - started_at
        if result["first_step_at"]
        else None,
        "workers_ready_at": workers_ready_at,
        "time_to_workers_ready_s": workers_ready_at - started_at,
        "peak_rss_mb": distributed.max_over_ranks(_peak_rss_mb(), device),
        "flops": flops.measure(
            blueprint.of(cfg.model, cfg.task),
            lambda model, batch: task.loss(*task.forward(model, batch)),
            trainer.step.first_batch,
            task.samples(trainer.step.first_batch) if trainer.step.first_batch is not None else 0,
            trainer.step.first_sample,
            result.get("steady_samples_per_sec") or result.get("samples_per_sec"),
            str(cfg.trainer.precision),
            cfg.trainer.peak_flops,
            rank.world_size,
            device,
        ),
        "wall_time_s": time.time() - started_at,
        "run_dir": str(out),
        "resumed_from": str(resume[0]) if resume else None,
        "init_from": cfg.trainer.init_from if not resume else None,
    }


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB
