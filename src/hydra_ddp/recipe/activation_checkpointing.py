"""Activation checkpointing (strategy.activation_checkpointing): a block keeps only its inputs after
its forward and runs its forward again in the backward, trading compute for the memory of its
activations (torchtitan's activation_checkpoint.mode, Lightning's activation_checkpointing_policy).

The recomputation runs the same kernels on the same inputs, with the RNG state of the first run
(dropout's masks), so losses and gradients are bit-equal to a run without it. Parameter names stay
the model's own (the block's forward is wrapped, the module is not): checkpoints, FSDP's units and
the optimizer's groups are unchanged. The FLOP count (reporting/flops.py) builds its own copy of the
model and counts model FLOPs only, without the recomputation.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, Optional, Union

import torch.utils.checkpoint
from torch import nn

from hydra_ddp.config.run_config import RunConfig
from hydra_ddp.config.strategy_settings import DDPSettings, FSDPSettings
from hydra_ddp.errors import UserError


def blocks(module: nn.Module) -> Optional[list[nn.Module]]:
    """The model's repeated blocks, as it names them: a `shard_units()` method (the GPT here), or a
    Hugging Face model's decoder layers (the classes its `_no_split_modules` names). None: it names
    none."""
    if hasattr(module, "shard_units"):
        return list(module.shard_units())
    layer_classes = set(getattr(module, "_no_split_modules", None) or ())
    layers = [m for m in module.modules() if type(m).__name__ in layer_classes]
    return layers or None


def chosen(found: list[nn.Module], mode: str, every: int) -> list[nn.Module]:
    """The blocks `mode` checkpoints: all (full), every `every`-th from the first (every_k),
    none."""
    if mode == "full":
        return list(found)
    if mode == "every_k":
        return [block for i, block in enumerate(found) if i % every == 0]
    return []


def apply(module: nn.Module, settings: Union[DDPSettings, FSDPSettings]) -> int:
    """Checkpoint the blocks the strategy's settings choose, in place; how many."""
    if settings.activation_checkpointing == "none":
        return 0
    found = blocks(module)
    if not found:  # refused before launch (check); a model that changed since is the same line
        raise UserError(no_blocks(settings.activation_checkpointing, type(module).__name__))
    picked = chosen(
        found, settings.activation_checkpointing, settings.activation_checkpointing_every
    )
    for block in picked:
        # an instance attribute: the module stays
        block.forward = functools.partial(_recomputed, block.forward)
    return len(picked)


def _recomputed(forward: Any, *args: Any, **kwargs: Any) -> Any:
    return torch.utils.checkpoint.checkpoint(forward, *args, use_reentrant=False, **kwargs)


def no_blocks(mode: str, model: str) -> str:
    return (
        f"strategy.activation_checkpointing={mode} needs a model that names its "
        "blocks (a shard_units() method, as model=gpt has, or a transformers "
        f"model's _no_split_modules); {model} names none: leave it none"
    )


def check(cfg: RunConfig, on_meta: Callable[[], nn.Module]) -> None:
    """Before launch: a model that names blocks to checkpoint (`on_meta`: the blueprint's)."""
    mode = cfg.strategy.activation_checkpointing
    if mode == "none":
        return
    try:
        model = on_meta()
    except Exception:  # noqa: BLE001  (a model that does not build is the dry build's, or the run's, to report)
        return
    if not blocks(model):
        raise UserError(no_blocks(mode, cfg.model["_target_"]))
