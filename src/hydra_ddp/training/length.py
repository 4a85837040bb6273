"""How long the run is, in batches and optimizer steps: what the loop counts to, and what a per-step
learning-rate schedule is stretched over. Found once in the worker, from its loaders."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from hydra_ddp.config.schema import TrainerConf
from hydra_ddp.data import Loaders


@dataclass(frozen=True)
class RunLength:
    batches_per_epoch: int  # this rank's
    common_batches: int  # the fewest of any rank: equal but for data.even_shards=false
    most_batches: int  # the most of any rank
    steps_per_epoch: int  # optimizer steps, the same on every rank
    epochs: int  # epochs the run enters
    # where the loop stops at the latest: trainer.max_steps, else every epoch's steps
    max_steps: int
    batch_samples: int = 0  # a batch's samples on this rank (data.batch_size)
    # the epoch's last batch's: fewer where this rank's samples do not divide
    last_batch_samples: int = 0

    @property
    def uneven(self) -> bool:
        return self.common_batches != self.most_batches

    @property
    def total_steps(self) -> int:
        """The optimizer steps the run takes unless stopped early: a schedule's length."""
        return min(self.max_steps, self.steps_per_epoch * self.epochs)


def measure(settings: TrainerConf, loaders: Loaders, device: torch.device) -> RunLength:
    """`settings`: the trainer section. With the global batch fixed (an elastic run's), every world
    size gives the same steps per epoch, so a resized run keeps its length."""
    batches = len(loaders.train)
    fewest, most = epoch_lengths(loaders, batches, device)
    steps_per_epoch = math.ceil(most / settings.accumulate)
    max_steps = settings.max_steps or steps_per_epoch * settings.epochs
    epochs = min(settings.epochs, math.ceil(max_steps / steps_per_epoch))
    per_batch = loaders.batch_size
    # data.drop_last: a whole one
    last = min(per_batch, len(loaders.train_sampler) - (batches - 1) * per_batch)
    return RunLength(batches, fewest, most, steps_per_epoch, epochs, max_steps, per_batch, last)


def epoch_lengths(
    loaders: Loaders, batches_per_epoch: int, device: torch.device
) -> tuple[int, int]:
    """(fewest, most) batches per epoch of any rank. Equal but for data.even_shards=false, where
    shard lengths differ by up to one sample."""
    if loaders.train_sampler.pad:
        return batches_per_epoch, batches_per_epoch
    counts = torch.tensor([-batches_per_epoch, batches_per_epoch], device=device)
    dist.all_reduce(counts, op=dist.ReduceOp.MAX)
    return -int(counts[0].item()), int(counts[1].item())


def ended_by(length: RunLength, position: dict[str, int], early_stopped: bool) -> Optional[str]:
    """What ends a run at a checkpoint's position before it trains a step under these settings (its
    epochs, its max_steps, early stopping's patience spent), or None: the loop's own bounds."""
    if position["epoch"] >= length.epochs:
        return "epochs"
    if position["step"] >= length.max_steps:
        return "max_steps"
    return "early_stopping" if early_stopped else None
