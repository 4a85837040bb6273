"""What a worker builds for the loop, in three parts its collaborators each take what they need
from: what is trained and where (Trained), what changes the weights (Optimization), and the run
around the loop (Run: where it reports and saves, when it must stop). The loaders and the run's
length go to the loop as they are."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import nn

from hydra_ddp.checkpoint.checkpointer import Checkpointer
from hydra_ddp.hooks import Hook
from hydra_ddp.parallel.strategies import Strategy
from hydra_ddp.recipe.ema import EMA
from hydra_ddp.reporting.run_report import Reporter
from hydra_ddp.tasks import Task
from hydra_ddp.training.state import StopRequest


@dataclass(frozen=True)
class Trained:
    task: Task
    model: nn.Module  # what the loop calls: the strategy's wrapped model
    strategy: Strategy
    device: torch.device
    memory_format: torch.memory_format


@dataclass(frozen=True)
class Optimization:
    optimizer: torch.optim.Optimizer
    scheduler: Optional[Any]
    ema: Optional[EMA]  # the weights' moving average (trainer.ema.decay), or None


@dataclass(frozen=True)
class Run:
    reporter: Reporter
    checkpointer: Checkpointer
    stop: StopRequest
    started_at: float  # when the command started: the time budget counts from it
    hooks: list[Hook]  # the side jobs on the loop's events, as the worker assembled them
