"""An exponential moving average of the weights (trainer.ema.decay), as timm's ModelEmaV3 and
Lightning's WeightAveraging keep one: updated after every optimizer step, ema ← decay·ema +
(1 − decay)·weights. Validation, the choice of best, the test, eval.py and the export read it; the
optimizer keeps training the live weights.

The average is kept in the parameters' own layout (FSDP's and TP's shards: each rank averages its
own), and goes to and from a checkpoint through the model: swapped in, the model's state is the
average's, in the strategy's checkpoint layout. Buffers (BatchNorm's statistics) are the live
model's."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Optional

import torch
from torch import nn


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """A rank's own values (a DTensor's shard; a tensor as it is), written in place through it."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


class EMA:
    """The average of `module`'s parameters (the strategy's module: its parameters as the strategy
    spread them)."""

    def __init__(self, module: nn.Module, decay: float):
        self.module, self.decay = module, decay
        self.params = [p for p in module.parameters()]
        with torch.no_grad():
            self.average = [_local(p).detach().clone() for p in self.params]

    @torch.no_grad()
    def update(self) -> None:
        """After an optimizer step: every rank averages its own share of the weights."""
        torch._foreach_lerp_(self.average, [_local(p) for p in self.params], 1.0 - self.decay)

    @torch.no_grad()
    def reset(self) -> None:
        """The average starts again from the weights as they are (a resume from a run that kept
        none)."""
        for average, p in zip(self.average, self.params):
            average.copy_(_local(p))

    def tensors(self) -> list[torch.Tensor]:
        """This rank's share of the average (for an uneven epoch's broadcast from rank 0)."""
        return self.average

    @contextlib.contextmanager
    def swapped(self, keep: bool = False) -> Iterator[None]:
        """The average in the model for the duration, then the live weights back. `keep`: what the
        model holds at the end becomes the average (a checkpoint's average loaded through the
        model)."""
        _resharded(self.module)
        with torch.no_grad():
            live = [_local(p).detach().clone() for p in self.params]
            for p, average in zip(self.params, self.average):
                _local(p).copy_(average)
        try:
            yield
        finally:
            _resharded(self.module)  # an evaluation may leave FSDP's gathered copies of the average
            with torch.no_grad():
                for p, average, own in zip(self.params, self.average, live):
                    if keep:
                        average.copy_(_local(p))
                    _local(p).copy_(own)


def _resharded(module: nn.Module) -> None:
    """FSDP's units back to their shards (strategy.reshard_after_forward=false keeps them gathered
    after a forward): the shards are what the average is copied to and from, and the next forward
    gathers them anew."""
    for unit in module.modules():
        if hasattr(unit, "reshard") and hasattr(unit, "unshard"):
            unit.reshard()


def build(module: nn.Module, decay: Optional[float]) -> Optional[EMA]:
    return EMA(module, decay) if decay is not None else None
