"""Learning-rate schedules stepped every optimizer step (scheduler=warmup_cosine, warmup_linear,
warmup_constant, wsd): a linear warmup, then a decay over the run's optimizer steps, as nanoGPT's
get_lr, torchtitan's lr_scheduler and Hugging Face's get_*_schedule_with_warmup do.

The rate of a step is a pure function of its number: each parameter group's initial rate times
factor(step). A resumed run (at any world size, after a resize) continues at exactly the rate the
uninterrupted run had, and accumulation counts optimizer steps, not batches. torch's own schedulers
(scheduler=cosine, step) keep stepping once per epoch.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Optional, Union

import torch
from hydra.utils import instantiate
from torch.optim.lr_scheduler import LRScheduler

from hydra_ddp.errors import UserError

DECAYS = ("cosine", "linear", "sqrt", "constant")


@dataclass(frozen=True)
class Shape:
    """factor(step) for steps 0 … total − 1: (step + 1) / warmup over the first `warmup` steps, then
    held at 1 until `decay_from`, then down to `min_ratio` along `decay` at the last step's end."""

    total: int
    warmup: int
    decay_from: int
    decay: str = "cosine"
    min_ratio: float = 0.0

    def factor(self, step: int) -> float:
        if step < self.warmup:
            return (step + 1) / self.warmup
        if step < self.decay_from or self.decay == "constant":
            return 1.0
        progress = min(1.0, (step - self.decay_from) / max(1, self.total - self.decay_from))
        falling = {
            "cosine": 0.5 * (1.0 + math.cos(math.pi * progress)),
            "linear": 1.0 - progress,
            "sqrt": 1.0 - math.sqrt(progress),  # WSD's "1 - sqrt" cooldown
        }[self.decay]
        return self.min_ratio + (1.0 - self.min_ratio) * falling


class StepSchedule:
    """Sets each parameter group's rate to its initial rate × the shape's factor for the coming
    optimizer step. The loop calls `at(step)` after every optimizer step (and at a resume), with the
    number of steps taken so far."""

    per_step = True

    def __init__(self, optimizer: torch.optim.Optimizer, shape: Shape, name: str):
        self.optimizer, self.shape, self.name = optimizer, shape, name
        for group in optimizer.param_groups:
            # torch's schedulers keep the base rate there too
            group.setdefault("initial_lr", group["lr"])
        self.step_count = 0
        self.at(0)

    def at(self, step: int) -> None:
        self.step_count = step
        factor = self.shape.factor(step)
        for group in self.optimizer.param_groups:
            group["lr"] = group["initial_lr"] * factor

    def get_last_lr(self) -> list[float]:
        return [group["lr"] for group in self.optimizer.param_groups]

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step_count}  # the shape is the config's: this command's values apply

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.at(int(state["step"]))


def _warmup(name: str, total: int, warmup_steps: Optional[int], warmup_ratio: float) -> int:
    """Warmup steps: warmup_steps where given, else warmup_ratio of the run (Hugging Face's rule);
    shorter than the run, or one line."""
    if warmup_steps is not None and warmup_steps < 0:
        raise UserError(
            f"scheduler={name}: warmup_steps={warmup_steps} is negative; give 0 or more steps"
        )
    if not 0 <= warmup_ratio < 1:
        raise UserError(
            f"scheduler={name}: warmup_ratio={warmup_ratio} is not a share of the run in [0, 1)"
        )
    # a tiny run: none
    warmup = warmup_steps if warmup_steps is not None else int(warmup_ratio * total)
    if warmup >= total:
        raise UserError(
            f"scheduler={name}: a warmup of {warmup} steps is not "
            f"shorter than the run's {total} optimizer steps; lower "
            "scheduler.warmup_steps (or warmup_ratio), or train longer"
        )
    return warmup


def _total(name: str, total_steps: Optional[int]) -> int:
    if not total_steps:
        raise UserError(
            f"scheduler={name} needs the run's length in optimizer steps, and this run has none "
            "(its data has no length): set trainer.max_steps"
        )
    return int(total_steps)


def _check_ratio(name: str, min_lr_ratio: float) -> None:
    if not 0 <= min_lr_ratio <= 1:
        raise UserError(
            f"scheduler={name}: min_lr_ratio={min_lr_ratio} is not a share of the rate in [0, 1]"
        )


class _WarmupThenDecay:
    """A schedule's builder (what conf/scheduler/NAME.yaml's `_target_` names): a linear warmup,
    then the rate down along `decay` to min_lr_ratio × the rate at the run's end."""

    def __init__(self, name: str, decay: str):
        self.name, self.decay = name, decay
        self.__doc__ = (
            f"A linear warmup, then a {decay} decay to min_lr_ratio × the rate at the run's end."
        )

    def __call__(
        self,
        optimizer: torch.optim.Optimizer,
        total_steps: Optional[int],
        warmup_steps: Optional[int] = None,
        warmup_ratio: float = 0.0,
        min_lr_ratio: float = 0.0,
    ) -> StepSchedule:
        return _decaying(
            self.name, self.decay, optimizer, total_steps, warmup_steps, warmup_ratio, min_lr_ratio
        )


warmup_cosine = _WarmupThenDecay("warmup_cosine", "cosine")
warmup_linear = _WarmupThenDecay("warmup_linear", "linear")


def warmup_constant(
    optimizer: torch.optim.Optimizer,
    total_steps: Optional[int],
    warmup_steps: Optional[int] = None,
    warmup_ratio: float = 0.0,
) -> StepSchedule:
    """A linear warmup, then the rate held to the end."""
    return _decaying(
        "warmup_constant", "constant", optimizer, total_steps, warmup_steps, warmup_ratio, 1.0
    )


def _decaying(
    name, decay, optimizer, total_steps, warmup_steps, warmup_ratio, min_lr_ratio
) -> StepSchedule:
    total = _total(name, total_steps)
    _check_ratio(name, min_lr_ratio)
    warmup = _warmup(name, total, warmup_steps, warmup_ratio)
    return StepSchedule(optimizer, Shape(total, warmup, warmup, decay, min_lr_ratio), name)


def wsd(
    optimizer: torch.optim.Optimizer,
    total_steps: Optional[int],
    warmup_steps: Optional[int] = None,
    warmup_ratio: float = 0.0,
    decay_ratio: float = 0.1,
    decay: str = "linear",
    min_lr_ratio: float = 0.0,
) -> StepSchedule:
    """Warmup-stable-decay: a linear warmup, the rate held, then the last decay_ratio of the run
    down to min_lr_ratio × the rate along `decay` (linear, cosine or sqrt: 1 − √progress)."""
    name = "wsd"
    total = _total(name, total_steps)
    _check_ratio(name, min_lr_ratio)
    if decay not in DECAYS[:3]:
        raise UserError(f"scheduler=wsd: decay={decay!r}; choose one of {', '.join(DECAYS[:3])}")
    if not 0 < decay_ratio <= 1:
        raise UserError(
            f"scheduler=wsd: decay_ratio={decay_ratio} is not a share of the run in (0, 1]"
        )
    warmup = _warmup(name, total, warmup_steps, warmup_ratio)
    decay_from = total - math.ceil(decay_ratio * total)
    if decay_from < warmup:
        raise UserError(
            f"scheduler=wsd: the decay's {total - decay_from} steps and the warmup's {warmup} "
            f"overlap in a run of {total} optimizer steps; lower decay_ratio or the warmup"
        )
    return StepSchedule(optimizer, Shape(total, warmup, decay_from, decay, min_lr_ratio), name)


def takes_length(scheduler_cfg: Optional[Mapping[str, Any]]) -> bool:
    """Whether the scheduler config builds a per-step schedule: its builder takes total_steps."""
    return scheduler_cfg is not None and _per_step_builder(instantiate(scheduler_cfg))


def length_free(scheduler_cfg: Mapping[str, Any], steps: int = 1000) -> bool:
    """Whether a per-step schedule of this module gives each step the same rate whatever the run's
    length (a warmup of fixed steps, then a constant rate): its shape for `steps` and for twice as
    many, compared over the first `steps`. Another builder's: not known, so False."""
    builder = instantiate(scheduler_cfg)
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
    shapes = [getattr(builder(optimizer, total_steps=n), "shape", None) for n in (steps, 2 * steps)]
    if not all(isinstance(shape, Shape) for shape in shapes):
        return False
    return all(shapes[0].factor(step) == shapes[1].factor(step) for step in range(steps))


def _per_step_builder(builder: Any) -> bool:
    return "total_steps" in inspect.signature(builder).parameters


def build(
    scheduler_cfg: Optional[Mapping[str, Any]],
    optimizer: torch.optim.Optimizer,
    total_steps: Optional[int],
) -> Optional[Any]:
    """The run's schedule: a per-step one (a builder that takes total_steps: this module's) is given
    the run's optimizer steps; torch's own (stepped per epoch) only the optimizer. None: a constant
    rate."""
    if scheduler_cfg is None:
        return None
    builder = instantiate(scheduler_cfg)
    if _per_step_builder(builder):
        return builder(optimizer, total_steps=total_steps)
    return builder(optimizer)


def per_step(scheduler: Optional[Union[StepSchedule, LRScheduler]]) -> bool:
    return bool(getattr(scheduler, "per_step", False))


class Stepping:
    """When the loop steps the run's schedule (torch's per-epoch schedulers at an epoch's end, a
    StepSchedule after every optimizer step), and a per-step schedule's rates until they are
    logged."""

    def __init__(
        self,
        scheduler: Optional[Union[StepSchedule, LRScheduler]],
        optimizer: torch.optim.Optimizer,
    ):
        self.scheduler, self.optimizer = scheduler, optimizer
        self.per_step = per_step(scheduler)
        self.rates: list[tuple[int, float]] = []  # (step, the rate it took)

    def epoch_started(self, step: int) -> None:
        if self.per_step:
            self.scheduler.at(step)  # also where a rank that ran out of batches caught up

    def optimizer_stepped(self, step: int) -> None:
        """Optimizer step `step` (from 1) is done."""
        if self.per_step:
            self.rates.append((step, self.optimizer.param_groups[0]["lr"]))
            self.scheduler.at(step)  # the next step's rate

    def epoch_ended(self) -> None:
        if self.scheduler is not None and not self.per_step:
            self.scheduler.step()

    def take_rates(self, up_to: int) -> dict[int, float]:
        """The per-step rates of the steps up to `up_to` not taken yet: {step: rate}."""
        taken = {step: rate for step, rate in self.rates if step <= up_to}
        self.rates = self.rates[len(taken) :]  # appended in step order
        return taken

    def epoch_rate(self) -> dict[str, float]:
        """What validation logs of the rate: a per-epoch schedule's (a per-step one's go with the
        loss)."""
        return {} if self.per_step else {"train/lr": self.optimizer.param_groups[0]["lr"]}
