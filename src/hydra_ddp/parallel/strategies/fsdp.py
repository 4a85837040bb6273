"""strategy=fsdp: FSDP2 (torch.distributed.fsdp.fully_shard): parameters, gradients and optimizer
state sharded over the ranks; each unit (a model's shard_units(), else each child with parameters)
and the root gathered for its own forward and backward only. For models whose state does not fit
one device."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Annotated, Any, Optional

import torch
from torch import nn

from hydra_ddp.checkpoint import layouts
from hydra_ddp.config.domains import OneOf
from hydra_ddp.config.section import Section
from hydra_ddp.parallel.strategies.base import Strategy, not_ddp_refusals, refuse, start_from_rank0
from hydra_ddp.recipe import activation_checkpointing


@dataclass
class FSDPSettings(Section):
    # fsdp: FSDP2, parameters, gradients and optimizer state sharded over the ranks.
    name: Annotated[str, OneOf("fsdp")] = "fsdp"
    # Free each unit's gathered parameters after its forward (less memory, one more all-gather in
    # the backward); false keeps them until the backward.
    reshard_after_forward: bool = True
    # Parameters cast to this for the compute (bf16), gradients reduced in fp32. null: fp32.
    # (fp16 is refused: it would need loss scaling over the shards.)
    mixed_precision: Annotated[Optional[str], OneOf("bf16", "fp16")] = None
    # Parameters and optimizer state kept on the CPU between uses (GPUs only).
    cpu_offload: bool = False
    # Recompute blocks' activations in the backward instead of keeping them (less memory, about one
    # more forward): none, full (every block) or every_k (every k-th block). For models that name
    # their blocks (model=gpt, transformers models); bit-equal losses.
    activation_checkpointing: activation_checkpointing.Mode = "none"
    activation_checkpointing_every: activation_checkpointing.Every = 2  # every_k's k


def shard_refusals(cfg: Any) -> list[tuple[bool, str]]:
    """(refused, why) for FSDP's own settings."""
    settings, trainer = cfg.strategy, cfg.trainer
    return [
        (
            settings.cpu_offload and trainer.device != "cuda",
            "strategy.cpu_offload=true keeps parameters on the CPU between uses on GPUs; on the CPU it has "
            "nothing to offload: leave it false",
        ),
        (
            settings.mixed_precision == "fp16",
            "strategy.mixed_precision=fp16 would need loss scaling over the shards, which FSDP2 here does not "
            "do (small gradients would underflow silently); use bf16: fp32's range, no scaler",
        ),
    ]


def shard(module: nn.Module, settings: Any, mesh: Any) -> None:
    """fully_shard each unit, then the root, over `mesh` (None: all ranks)."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    dtype = {None: None, "bf16": torch.bfloat16}[settings.mixed_precision]  # fp16 is refused (above)
    options = dict(
        mesh=mesh,
        reshard_after_forward=bool(settings.reshard_after_forward),
        # Parameters in `dtype` for the compute; gradients reduced and kept in fp32.
        mp_policy=MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32 if dtype else None),
        offload_policy=CPUOffloadPolicy() if settings.cpu_offload else OffloadPolicy(),
    )
    for unit in shard_units(module):
        fully_shard(unit, **options)
    fully_shard(module, **options)


def shard_units(module: nn.Module) -> list[nn.Module]:
    """The modules FSDP shards one by one (their parameters gathered together): the model's blocks
    (recipe.activation_checkpointing.blocks: a `shard_units()` method, e.g. a transformer's blocks;
    a Hugging Face model's decoder layers, as Accelerate wraps them); else each child with parameters."""
    return activation_checkpointing.blocks(module) or [
        child for child in module.children() if any(True for _ in child.parameters())
    ]


@contextlib.contextmanager
def no_sync(model: nn.Module) -> Iterator[None]:
    """Gradients stay unsharded and local until the last micro-batch."""
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


class FSDP(Strategy):
    """Parameters, gradients and optimizer state sharded over all ranks."""

    name = "fsdp"
    Settings = FSDPSettings

    @classmethod
    def check(cls, cfg: Any) -> None:
        refuse(cls.name, not_ddp_refusals(cfg, cls.name) + shard_refusals(cfg))
        activation_checkpointing.check(cfg)

    @classmethod
    def backend(cls, settings: Any, backend: str) -> str:
        """NCCL takes CUDA tensors only, and CPU offload keeps the shards on the CPU: the collectives on
        them (the finite-weights check, the gradient norm) go to gloo, the rest to NCCL, in one group."""
        return "cpu:gloo,cuda:nccl" if backend == "nccl" and settings.cpu_offload else backend

    def __init__(self, cfg: Any, device: torch.device):
        super().__init__(cfg, device)
        # Every save and copy of the best weights goes through DCP's state_dict helpers (ShardedState):
        # imported while the run starts, not at the first of them in the middle of training.
        import torch.distributed.checkpoint.state_dict  # noqa: F401

    def wrap(self, module: nn.Module, shared: Optional[bool] = None) -> nn.Module:
        self.module = module
        start_from_rank0(module)
        activation_checkpointing.apply(module, self.cfg.strategy)  # inside the units FSDP gathers
        shard(module, self.cfg.strategy, mesh=None)
        self.model = module
        self.state = layouts.ShardedState(module)
        return module

    def no_sync(self) -> Any:
        return no_sync(self.model)
