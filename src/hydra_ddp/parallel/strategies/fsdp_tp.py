"""strategy=fsdp_tp: a 2-D mesh [dp, tp]: tensor parallel inside groups of `tp_size` neighbouring
ranks (tp.py, the model's plan), FSDP2 across the groups (fsdp.py's settings); each group is a
replica with its own batches. World size = dp × tp_size."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, Optional

import torch
from torch import nn

from hydra_ddp.checkpoint import layouts
from hydra_ddp.config.domains import AtLeast, OneOf
from hydra_ddp.parallel.strategies import fsdp, tp
from hydra_ddp.parallel.strategies.base import (
    Strategy,
    clip_global_norm,
    not_ddp_refusals,
    refuse,
    start_from_rank0,
)
from hydra_ddp.recipe import activation_checkpointing, compiling


@dataclass
class FSDPTPSettings(fsdp.FSDPSettings):
    # fsdp_tp: tensor parallel in groups of tp_size, FSDP across them.
    name: Annotated[str, OneOf("fsdp_tp")] = "fsdp_tp"
    # Ranks per tensor-parallel group (the world size divided by it: FSDP's dimension).
    tp_size: Annotated[int, AtLeast(1)] = 2


class FSDPWithTP(Strategy):
    """Tensor parallel inside each group, FSDP across the groups."""

    name = "fsdp_tp"
    Settings = FSDPTPSettings

    @classmethod
    def tp_size(cls, settings: Any, world: int) -> int:
        return int(settings.tp_size)

    @classmethod
    def check(cls, cfg: Any) -> None:
        tp.check_plan(cfg, cls)
        settings = cfg.strategy
        tensor_parallel_limits = [
            (
                int(settings.replicate) != 1,
                "strategy.replicate (HSDP) is not supported with "
                "tensor parallel yet: the mesh is [dp, tp]; leave it 1",
            ),
            (
                bool(
                    settings.param_dtype
                    or settings.reduce_dtype
                    or settings.output_dtype
                    or settings.cpu_offload
                ),
                "strategy.param_dtype, reduce_dtype, output_dtype and cpu_offload are "
                "not supported with tensor parallel yet; leave them null and false",
            ),
        ]
        refuse(
            cls.name,
            not_ddp_refusals(cfg, cls.name) + fsdp.shard_refusals(cfg) + tensor_parallel_limits,
        )
        activation_checkpointing.check(cfg)

    @classmethod
    def backend(cls, settings: Any, backend: str) -> str:
        return fsdp.FSDP.backend(settings, backend)

    def __init__(self, cfg: Any, device: torch.device):
        super().__init__(cfg, device)
        import torch.distributed.checkpoint.state_dict  # noqa: F401  (fsdp.py's reason)

    def wrap(self, module: nn.Module, shared: Optional[bool] = None) -> nn.Module:
        self.module = module
        start_from_rank0(module)
        tp.parallelize(self, module)  # inside each group
        activation_checkpointing.apply(module, self.cfg.strategy)
        # Blocks of DTensors, before FSDP's hooks.
        compiling.compile_blocks(module, self.cfg.trainer, self.compile_dynamic)
        fsdp.shard(module, self.cfg.strategy, mesh=self.mesh["dp"])  # across the groups
        self.model = module
        self.state = layouts.ShardedState(module)
        return module

    def no_sync(self) -> Any:
        return fsdp.no_sync(self.model)

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        return clip_global_norm(self.model.parameters(), max_norm, self.device)
