"""The run's reports, read off the Trainer at the loop's points: a window's losses and an epoch's
scalars for the loggers; at the end each rank's times, the loop's results, and the summary of how
the worker ran it, as summary.json holds them."""

from __future__ import annotations

import resource
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import torch

from hydra_ddp import blueprint
from hydra_ddp.parallel import distributed, strategies
from hydra_ddp.reporting import flops
from hydra_ddp.runtime.ranks import RankInfo
from hydra_ddp.training.timing import per_rank, straggler

if TYPE_CHECKING:  # the loop reports through this module
    from hydra_ddp.training.trainer import Trainer


def epoch_scalars(trainer: Trainer, metrics: dict[str, Any]) -> dict[str, Any]:
    """An epoch's scalars: its loss, learning rate and throughput, the validation's `metrics` where
    it ran, and each rank's share of the epoch's step time by phase (gathered: every rank calls
    it)."""
    scalars = {
        "train/epoch_loss": trainer.train_loss,
        **trainer.schedule.epoch_rate(),
        "train/samples_per_sec": trainer.throughput.samples_per_sec(),
    }
    if "val_samples" in metrics:
        scalars.update(trainer.validation.tagged(metrics, "val"))
    # every rank's, this epoch
    epoch_ranks = per_rank(trainer.timer.gather(trainer.device, since_last=True))
    if trainer.timer.reported_steps:
        for row in epoch_ranks:
            scalars.update(
                {
                    f"train/time/rank{row['rank']}/{k[:-6]}": v
                    for k, v in row.items()
                    if k.endswith("_share")
                }
            )
    return scalars


def step_rows(trainer: Trainer, steps: list[int], losses: list[float]) -> None:
    """A window's global losses to the loggers: a step's loss, gradient norm and rate in one row (a
    later step's norm and rate wait for its loss)."""
    last = steps[-1] if steps else 0
    norms, rates = trainer.step.take_grad_norms(last), trainer.schedule.take_rates(last)
    for step, loss in zip(steps, losses):
        row = {"train/loss": loss, "train/grad_norm": norms.get(step), "train/lr": rates.get(step)}
        trainer.reporter.scalars(
            {tag: value for tag, value in row.items() if value is not None}, step
        )


def rank_times(trainer: Trainer) -> tuple[list[dict[str, Any]], Optional[dict[str, Any]]]:
    """Each rank's seconds per step by phase over the run (gathered: every rank calls it), and the
    straggler among them, if any."""
    ranks = per_rank(trainer.timer.gather(trainer.device))
    return ranks, straggler(ranks)


def results(trainer: Trainer, epochs: int) -> dict[str, Any]:
    """The run's outcome, as summary.json holds it (the worker adds how it ran)."""
    monitor, selected = trainer.monitor, trainer.validation.selected()
    max_steps = trainer.settings.max_steps
    return {
        "epochs": epochs,
        "steps": trainer.pos.step,
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
        **trainer.throughput.results(),
        "tokens_per_step": tokens_per_step(trainer),  # a language model's, else None
        **trainer.overheads.results(),  # rank 0's
        "ranks": trainer.ranks,  # seconds per step by phase, per rank (timing.py)
        "straggler": trainer.straggler,
        "first_step_at": trainer.throughput.first_step_at,
        "world_size_history": trainer.pos.world_sizes,
        "stopped_by": trainer.ending.stopped_by,
        "ended_by": (
            trainer.ending.stopped_by
            or trainer.ending.ended_by
            or ("max_steps" if max_steps and trainer.pos.step >= max_steps else "epochs")
        ),
    }


def tokens_per_step(trainer: Trainer) -> Optional[float]:
    """The mean tokens an optimizer step trained on, over every replica (a task that counts
    tokens)."""
    throughput = trainer.throughput
    if not throughput.token_samples or not throughput.step_times:
        return None
    total = torch.as_tensor(throughput.tokens, device=trainer.device).to(torch.float64).reshape(())
    work = trainer.step.strategy.sum_over_replicas(total)
    if work is not None:
        work.wait()
    return total.item() / len(throughput.step_times)


def how_it_ran(
    trainer: Trainer,
    rank: RankInfo,
    out: Path,
    result: dict[str, Any],
    fast: dict[str, bool],
    resume: Optional[tuple[Path, dict[str, Any]]],
    started_at: float,
    entered_at: float,
) -> dict[str, Any]:
    """The run's summary: the loop's `result` and how the worker ran it (the world and its launch,
    the batches, the settings it settled (`fast`), the state a rank holds, start-up, memory, the
    FLOP count). Every rank calls it: its figures are the ranks' extremes."""
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
