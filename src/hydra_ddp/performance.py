"""Fast settings by default: what `auto` means for trainer.channels_last (here) and for the
strategy's own knobs (its module's settle: DDP's bucket view, static graph, shared memory).

Each is chosen per model and device from measurements (bench/results), and only where it changes
no result beyond float tolerance; anything that does (bf16, fp16, compile backends) stays opt-in.
Every one can be set to true or false instead, and the summary names the values the run used.

- channels_last, for models with 2-D convolutions: their kernels run faster on NHWC memory; the
  sums change order, within float tolerance. Other models gain nothing from it, and only DDP's
  replicas take it (FSDP shards contiguous parameters only).
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

from hydra_ddp.config.run_config import RunConfig

AUTO = "auto"


def channels_last(setting: Any, allowed: bool, has_conv2d: Optional[bool]) -> Optional[bool]:
    """trainer.channels_last settled: `auto` is on for a model with 2-D convolutions where the
    strategy allows it; None where the model could not be built before launch (the workers settle
    it)."""
    if setting != AUTO:
        return bool(setting)
    if not allowed:
        return False
    return has_conv2d


def needs_model(setting: Any, allowed: bool) -> bool:
    """Whether channels_last's `auto` needs to know the model."""
    return setting == AUTO and allowed


def has_conv2d(model: nn.Module) -> bool:
    return any(isinstance(m, nn.Conv2d) for m in model.modules())


def settings(
    cfg: RunConfig, names: tuple[str, ...], model: nn.Module, allowed: bool
) -> dict[str, bool]:
    """The run's values of channels_last and the strategy's fast settings (`names`), as the summary
    names them: settled on the launch side, but channels_last for a model that could only be built
    in the workers."""
    values = {"trainer.channels_last": cfg.trainer.channels_last}
    values.update({name: getattr(cfg.strategy, name.split(".")[1]) for name in names})
    if values["trainer.channels_last"] == AUTO:
        values["trainer.channels_last"] = allowed and has_conv2d(model)
    return {name: bool(value) for name, value in values.items()}


def memory_format(channels_last: bool) -> torch.memory_format:
    """The memory format inputs and weights take: trainer.channels_last, settled."""
    return torch.channels_last if channels_last else torch.preserve_format
