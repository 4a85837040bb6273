"""What a worker builds for the loop from the run's config, handed over as one object: the task, the
model as the strategy spreads it, the optimizer and schedule, the loaders and the run's length, rank
0's reporter, the checkpointer, and where and how the run executes (device, memory format, the stop
request)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import nn

from hydra_ddp.checkpoint.checkpointer import Checkpointer
from hydra_ddp.data import Loaders
from hydra_ddp.parallel.strategies import Strategy
from hydra_ddp.recipe.ema import EMA
from hydra_ddp.reporting.run_report import Reporter
from hydra_ddp.tasks import Task
from hydra_ddp.training.length import RunLength
from hydra_ddp.training.stop import StopRequest


@dataclass
class Parts:
    task: Task
    model: nn.Module  # what the loop calls: the strategy's wrapped model
    strategy: Strategy
    optimizer: torch.optim.Optimizer
    scheduler: Optional[Any]
    ema: Optional[EMA]  # the weights' moving average (trainer.ema.decay), or None
    loaders: Loaders
    length: RunLength  # batches per epoch, optimizer steps: what the loop counts to
    reporter: Reporter
    checkpointer: Checkpointer
    stop: StopRequest
    device: torch.device
    memory_format: torch.memory_format
    progress: bool  # a progress bar (rank 0, at a terminal)
    started_at: float  # when the command started: the time budget counts from it
