"""Exact distributed evaluation, and eval.py's job in the workers: a saved checkpoint evaluated on
one split."""

from __future__ import annotations

import csv
import logging
import os
import time
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist
from hydra.utils import instantiate
from torch import nn

from hydra_ddp import blueprint, data, performance
from hydra_ddp.checkpoint import files as checkpoints
from hydra_ddp.config.run_config import RunConfig
from hydra_ddp.data import batches
from hydra_ddp.reporting import run_report
from hydra_ddp.rundir import RunDir
from hydra_ddp.runtime.ranks import RankInfo
from hydra_ddp.tasks import Task

log = logging.getLogger(__name__)


@torch.no_grad()
def evaluate(
    model: nn.Module,
    split: data.EvalSplit,
    device: torch.device,
    task: Task,
    name: str = "test",
    memory_format: torch.memory_format = torch.preserve_format,
    predictions: bool = False,
    lockstep: bool = False,
    reduce: bool = True,
    group: Optional[dist.ProcessGroup] = None,
) -> dict[str, Any]:
    """{name}_{metric} for each of the task's metrics, and {name}_samples, over the whole split (the
    same on every rank); with `predictions`, also rank 0's rows of the task's prediction columns,
    one per sample, in dataset order.

    Each chunk's state of sums (task.state) has its own row; the rows are all-reduced (each is
    nonzero on one rank only: adding zeros is exact) and added in chunk order, so the totals, and
    the metrics, are the same bits at any world size.

    Takes the unwrapped module: ranks may hold different chunk counts, and DDP's forward would
    start collectives that then fail to line up. A sharded (FSDP) module's forward must run on
    every rank alike (`lockstep`): a rank with fewer chunks runs forwards on a filler sample,
    unused. `group`: the ranks whose sums add up (None: all; under tensor parallel, one rank per
    model replica); `reduce=False`: this rank evaluated the whole split (the one replica of pure
    tensor parallel), its sums are whole already.
    """
    model.eval()
    # Per chunk: the task's state, then the samples counted.
    sums = torch.zeros(split.num_chunks, task.state_size + 1, dtype=torch.float64, device=device)
    rows = torch.zeros(
        split.samples if predictions else 0,
        len(task.prediction_columns),
        dtype=torch.float64,
        device=device,
    )
    for chunk, first, batch in split:
        count = task.samples(batch)
        output, target = task.forward(model, batches.to_device(batch, device, memory_format))
        sums[chunk, :-1] = task.state(output, target)
        sums[chunk, -1] = count
        if predictions:
            rows[first : first + count] = task.predict(output, target)
    if lockstep:
        for _ in range(split.rounds - len(split)):
            task.forward(model, batches.to_device(split.filler(), device, memory_format))
    if reduce:
        dist.all_reduce(sums, group=group)
    *state, samples = sums.sum(0).tolist()
    values = task.compute(state)
    metrics: dict[str, Any] = {f"{name}_{metric}": values[metric] for metric in task.metrics}
    metrics[f"{name}_samples"] = int(samples)
    if predictions and reduce:
        dist.reduce(rows, dst=0, group=group)
        metrics["predictions"] = rows.cpu()
    return metrics


# --- eval.py: every worker's half ----------------------------------------------------------------
def run(
    cfg: RunConfig, out: Path, rank: RankInfo, device: torch.device, started_at: float
) -> dict[str, Any]:
    """Evaluate the checkpoint on the split; rank 0 writes eval.json (and predictions.csv)."""
    job = cfg.eval
    splits = data.build_datasets(cfg.data, rank, cfg.trainer.seed)
    split = data.eval_split(splits[job.split], cfg.data, rank, cfg.trainer.seed, device)
    task = blueprint.of(cfg.model, cfg.task).task
    model = instantiate(cfg.model)
    if rank.is_main:  # only rank 0 reads the file: it need not be on every node
        path = checkpoints.location(job.ckpt)
        model.load_state_dict(checkpoints.model_weights(path, checkpoints.read(path, "ckpt")))
    model.to(device)
    for tensor in model.state_dict().values():
        dist.broadcast(tensor, src=0)
    memory_format = performance.memory_format(cfg.trainer.channels_last)
    model.to(memory_format=memory_format)  # as the run evaluated it: the same bits
    started = time.perf_counter()
    metrics = evaluate(
        model, split, device, task, job.split, memory_format, predictions=job.predict
    )
    rows = metrics.pop("predictions", None)
    result = {
        "checkpoint": job.ckpt,
        "step": job.step,
        "epoch": job.epoch,
        "split": job.split,
        # The weights the run evaluated: their moving average where it kept one (trainer.ema).
        "weights": "ema" if cfg.trainer.ema.decay is not None else "trained",
        **metrics,
        "metrics": list(task.metrics),
        "world_size": rank.world_size,
        "launcher": cfg.launcher.name,
        "device": device.type,
        "eval_time_s": time.perf_counter() - started,
        "wall_time_s": time.time() - started_at,
        "run_dir": str(out),
        "predictions": str(RunDir(out).predictions) if job.predict else None,
        "stopped_by": None,
    }
    if rank.is_main:
        if rows is not None:
            _write_predictions(rows, task, RunDir(out).predictions)
        run_report.write_json(result, RunDir(out).eval_result)
        name = job.split
        shown = ", ".join(
            f"{name} {metric} {result[f'{name}_{metric}']!r}" for metric in task.metrics
        )
        log.info(
            "%s of %s (step %d) on %d rank(s): %s (%d samples)",
            RunDir(out).eval_result,
            job.ckpt,
            job.step,
            rank.world_size,
            shown,
            result[f"{name}_samples"],
        )
        if rows is not None:
            log.info("predictions, a row per %s sample: %s", name, RunDir(out).predictions)
    return result


def _write_predictions(rows: torch.Tensor, task: Task, path: Path) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    whole = [column in task.integer_columns for column in task.prediction_columns]
    with open(tmp, "w", newline="") as file:
        writer = csv.writer(file)
        writer.writerow(["index", *task.prediction_columns])
        for index, row in enumerate(rows.tolist()):
            writer.writerow(
                [index, *(int(v) if integer else f"{v:.6f}" for v, integer in zip(row, whole))]
            )
    os.replace(tmp, path)
