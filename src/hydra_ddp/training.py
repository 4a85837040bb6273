"""The training loop and the distributed evaluation. Every rank runs all of it: collectives line up."""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from tqdm import tqdm

from hydra_ddp.data import Loaders
from hydra_ddp.reporting import Reporter

log = logging.getLogger(__name__)


@dataclass
class LossWindow:
    """Per-step training losses, made global (averaged over ranks) with one all-reduce per window.

    A collective every step would stall the loop; one every `size` steps costs nothing.
    """

    size: int
    steps: list[int] = field(default_factory=list)
    losses: list[torch.Tensor] = field(default_factory=list)

    def add(self, step: int, loss: torch.Tensor) -> bool:
        self.steps.append(step)
        self.losses.append(loss.detach())
        return len(self.steps) >= self.size

    def flush(self) -> tuple[list[int], list[float]]:
        """Every rank must call this at the same points."""
        if not self.steps:
            return [], []
        stacked = torch.stack(self.losses).double()
        dist.all_reduce(stacked)
        values = (stacked / dist.get_world_size()).tolist()
        steps, self.steps, self.losses = self.steps, [], []
        return steps, values


@torch.no_grad()
def evaluate(model: nn.Module, loader: torch.utils.data.DataLoader, device: torch.device) -> dict[str, float]:
    """Exact global loss and accuracy: each rank sums its disjoint shard, then one all-reduce.

    Takes the unwrapped module: ranks may hold different batch counts, and DDP's forward would
    start collectives that then fail to line up.
    """
    model.eval()
    totals = torch.zeros(3, dtype=torch.float64, device=device)  # loss sum, correct, count
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        logits = model(x)
        totals[0] += F.cross_entropy(logits, y, reduction="sum").double()
        totals[1] += (logits.argmax(1) == y).sum()
        totals[2] += y.numel()
    dist.all_reduce(totals)
    loss_sum, correct, count = totals.tolist()
    return {"test_loss": loss_sum / count, "test_accuracy": correct / count, "test_samples": int(count)}


def fit(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Optional[Any],
    loaders: Loaders,
    device: torch.device,
    trainer_cfg: Any,
    reporter: Reporter,
    progress: bool,
) -> dict[str, Any]:
    """Train `trainer_cfg.epochs` epochs (or `max_steps` steps), evaluating after each epoch."""
    world_size = dist.get_world_size()
    steps_per_epoch = len(loaders.train)
    max_steps = trainer_cfg.max_steps or steps_per_epoch * trainer_cfg.epochs
    epochs = min(trainer_cfg.epochs, math.ceil(max_steps / steps_per_epoch))
    window = LossWindow(trainer_cfg.log_every)
    step, samples, train_time = 0, 0, 0.0
    epoch_losses: list[float] = []
    metrics: dict[str, float] = {}

    bar = tqdm(total=max_steps, disable=not progress, unit="step", dynamic_ncols=True)
    for epoch in range(epochs):
        loaders.train_sampler.set_epoch(epoch)  # a new shuffle each epoch, the same on every rank
        model.train()
        epoch_losses, epoch_samples = [], 0
        started = time.perf_counter()
        for x, y in loaders.train:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            optimizer.zero_grad(set_to_none=True)
            loss = F.cross_entropy(model(x), y)
            loss.backward()  # DDP all-reduces the gradients here
            optimizer.step()
            step += 1
            epoch_samples += y.numel()
            if window.add(step, loss):
                steps, losses = window.flush()
                reporter.train_losses(steps, losses)
                epoch_losses += losses
                bar.set_postfix(loss=f"{losses[-1]:.4f}", refresh=False)
            bar.update()
            if step >= max_steps:
                break
        steps, losses = window.flush()
        reporter.train_losses(steps, losses)
        epoch_losses += losses
        epoch_time = time.perf_counter() - started
        train_time += epoch_time
        samples += epoch_samples

        lr = optimizer.param_groups[0]["lr"]
        if scheduler is not None:
            scheduler.step()
        metrics = evaluate(model.module, loaders.test, device)
        reporter.scalars(
            {
                "train/epoch_loss": sum(epoch_losses) / len(epoch_losses),
                "test/loss": metrics["test_loss"],
                "test/accuracy": metrics["test_accuracy"],
                "train/lr": lr,
                # Every rank ran the same number of batches: local samples × world size is global.
                "perf/samples_per_sec": epoch_samples * world_size / epoch_time,
            },
            step,
        )
        log.info(
            "epoch %d/%d  step %d  train loss %.4f  test loss %.4f  test accuracy %.4f",
            epoch + 1, epochs, step, sum(epoch_losses) / len(epoch_losses),
            metrics["test_loss"], metrics["test_accuracy"],
        )
    bar.close()
    return {
        "epochs": epochs,
        "steps": step,
        "train_loss": sum(epoch_losses) / len(epoch_losses),
        **metrics,
        "samples_per_sec": samples * world_size / train_time,
        "train_time_s": train_time,
    }
