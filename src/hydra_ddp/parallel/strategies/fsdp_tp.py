"""strategy=fsdp_tp: a 2-D mesh [dp, tp]: tensor parallel inside groups of `tp_size` neighbouring
ranks (tp.py, the model's plan), FSDP2 across the groups (fsdp.py's settings); each group is a
replica with its own batches. World size = dp × tp_size."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Optional

import torch
from torch import nn

from hydra_ddp.config import strategy_settings
from hydra_ddp.config.run_config import Requested
from hydra_ddp.parallel import layouts
from hydra_ddp.parallel.strategies import fsdp, tp
from hydra_ddp.parallel.strategies.base import (
    Strategy,
    clip_global_norm,
    not_ddp_refusals,
    refuse,
    start_from_rank0,
)
from hydra_ddp.recipe import activation_checkpointing, compiling


class FSDPWithTP(Strategy):
    """Tensor parallel inside each group, FSDP across the groups."""

    name = "fsdp_tp"
    Settings = strategy_settings.FSDPTPSettings

    @classmethod
    def tp_size(cls, settings: strategy_settings.FSDPTPSettings, world: int) -> int:
        return int(settings.tp_size)

    @classmethod
    def check(cls, cfg: Requested, model: Callable[[], nn.Module]) -> None:
        tp.check_plan(cfg, cls, model)
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
        activation_checkpointing.check(cfg, model)

    @classmethod
    def backend(cls, settings: strategy_settings.FSDPTPSettings, backend: str) -> str:
        return fsdp.FSDP.backend(settings, backend)

    def wrap(
        self, module: nn.Module, dynamic: Optional[bool] = False, shared: Optional[bool] = None
    ) -> nn.Module:
        self.module = module
        start_from_rank0(module)
        tp.parallelize(self, module)  # inside each group
        activation_checkpointing.apply(module, self.cfg.strategy)
        # Blocks of DTensors, before FSDP's hooks.
        compiling.compile_blocks(module, self.cfg.trainer, dynamic)
        fsdp.shard(module, self.cfg.strategy, mesh=self.mesh["dp"])  # across the groups
        self.model = module
        self.state = layouts.ShardedState(module)
        return module

    def no_sync(self) -> Any:
        return fsdp.no_sync(self.model)

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        return clip_global_norm(self.model.parameters(), max_norm, self.device)
