"""The loop's hooks: side jobs on a fixed set of events, each handed a small frozen record of what
happened, never the loop itself. Every rank calls every event at the same point of the loop, so a
collective inside one lines up across the ranks.

    running(fit)             a context around the whole fit (Fit: where, who, from which step)
    step_ended(event)        after each optimizer step (StepEnded): a reason to end the run, or None
    logged(event)            a loss window's global losses, known a step or more later (Logged)
    validated(event)         after a validation (Validated): a reason to end the run, or None
    checkpoint_saved(event)  a checkpoint complete on disk (CheckpointSaved)
    fit_ended(event)         the last step trained, before the end's validation and test

A reason to end the run is a word (a search's pruner says "pruned"), the summary's `ended_by`; it
must be the same on every rank (decide from global values, or broadcast one rank's verdict, as
search/pruning.py does). The worker assembles the run's hooks: the progress bar, the profiler
(trainer.profile), a search trial's pruner, then trainer.hooks' own (docs/extending.md). What is
part of a step's arithmetic (clipping, the optimizer, the weights' average) stays in the step, so a
hook cannot change what a run trains unless it ends it.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Union

import torch


@dataclass(frozen=True)
class Fit:
    run_dir: Path
    rank: int
    world_size: int
    device: torch.device
    first_step: int  # 0, or the step a resumed run continues from
    total_steps: int  # the step the run ends at unless something ends it early


@dataclass(frozen=True)
class StepEnded:
    step: int  # optimizer steps so far, this one included
    epoch: int  # counted from 0
    lr: float  # the first parameter group's rate, for the next step
    samples: int  # this rank's samples in the step
    # This rank's part of the step's loss, on the device (its mean over the ranks is the step's
    # loss); reading it (.item()) waits for the device: the loop itself reads losses a window later.
    loss: torch.Tensor
    grad_norm: Optional[torch.Tensor]  # the global norm before clipping (trainer.grad_clip); None


@dataclass(frozen=True)
class Logged:
    steps: tuple[int, ...]
    losses: tuple[float, ...]  # each step's global loss, alike on every rank


@dataclass(frozen=True)
class Validated:
    step: int
    epoch: int  # epochs completed
    metrics: Mapping[str, float]  # global: val_loss, val_<metric>, train_loss
    ended_by: Optional[str]  # what already ends the run here (early stopping), or None


@dataclass(frozen=True)
class CheckpointSaved:
    step: int
    path: Union[Path, str]  # a file or a directory; in object storage its URL (docs/storage.md)


@dataclass(frozen=True)
class FitEnded:
    step: int
    epoch: int
    ended_by: Optional[str]  # early_stopping, max_time, a signal's name, a hook's word; None


EVENTS = ("running", "step_ended", "logged", "validated", "checkpoint_saved", "fit_ended")


class Hook:
    """A side job of the loop: each event does nothing here; a hook overrides the ones it needs."""

    def running(self, fit: Fit) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def step_ended(self, event: StepEnded) -> Optional[str]:
        return None

    def logged(self, event: Logged) -> None:
        return None

    def validated(self, event: Validated) -> Optional[str]:
        return None

    def checkpoint_saved(self, event: CheckpointSaved) -> None:
        return None

    def fit_ended(self, event: FitEnded) -> None:
        return None


def wrong_events(cls: type) -> list[str]:
    """The events `cls` overrides with other than one argument (a hook written for the loop's
    earlier events, which took the trainer): what launch refuses in one line."""
    wrong = []
    for name in EVENTS:
        method = getattr(cls, name, None)
        if method is None or method is getattr(Hook, name):
            continue
        try:
            inspect.signature(method).bind(None, None)  # self, the event
        except TypeError:
            wrong.append(name)
    return wrong


def build(configs: list[Any], *builtin: Optional[Hook]) -> list[Hook]:
    """The run's hooks: the built-in ones that are on (None: off), then trainer.hooks' in order."""
    from hydra.utils import instantiate

    return [hook for hook in builtin if hook is not None] + [
        instantiate(config) for config in configs
    ]


def ending(hooks: list[Hook], event: str, payload: Any) -> Optional[str]:
    """Every hook's `event` with `payload`; the first reason one gives to end the run (the later
    hooks still see the event)."""
    reason = None
    for hook in hooks:
        said = getattr(hook, event)(payload)
        reason = reason or said
    return reason


def tell(hooks: list[Hook], event: str, payload: Any) -> None:
    for hook in hooks:
        getattr(hook, event)(payload)
