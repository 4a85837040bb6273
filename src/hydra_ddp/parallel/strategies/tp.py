"""strategy=tp: tensor parallel over all ranks (torch.distributed.tensor.parallel, Megatron style):
the model's plan (`tp_plan(size)`: submodule → "colwise" or "rowwise"; model=gpt has one) splits
those linears' weights, the rest is replicated. Every rank reads the same batches: one replica."""

from __future__ import annotations

from collections.abc import Callable
from typing import Optional

import torch
from torch import nn

from hydra_ddp.config import strategy_settings
from hydra_ddp.config.run_config import Requested
from hydra_ddp.errors import UserError, first_line, root_cause
from hydra_ddp.parallel import layouts
from hydra_ddp.parallel.strategies.base import (
    Strategy,
    clip_global_norm,
    not_ddp_refusals,
    refuse,
    start_from_rank0,
)
from hydra_ddp.recipe import compiling


def check_plan(cfg: Requested, strategy: type[Strategy], on_meta: Callable[[], nn.Module]) -> None:
    """Tensor parallel needs the model's plan (`on_meta`: the blueprint's model), and a world size
    it splits over."""
    world = cfg.trainer.nproc * cfg.launcher.nnodes
    size = strategy.tp_size(cfg.strategy, world)
    try:
        model = on_meta()
    except Exception as error:  # noqa: BLE001  (the model's own complaint: a shape it cannot take, say)
        raise UserError(
            f"strategy={strategy.name}: {cfg.model['_target_']} "
            f"does not build: {first_line(root_cause(error))}"
        ) from None
    try:
        tp_plan = getattr(model, "tp_plan", None)
        # a transformers model's tp_plan is its own (a dict), not this plan
        if not callable(tp_plan):
            raise UserError(
                f"strategy={strategy.name} needs a model with a "
                "tensor-parallel plan (a tp_plan method, as model=gpt has); "
                f"{cfg.model['_target_']} has none: use strategy=ddp or fsdp"
            )
        tp_plan(size)
    except ValueError as e:
        raise UserError(f"strategy={strategy.name}: {e}") from None


def parallelize(strategy: Strategy, module: nn.Module) -> None:
    """Megatron style over `strategy.tp_ranks` ranks: the model's plan splits its linears. Ranks
    r = dp × tp_ranks + tp: a replica's tp ranks are neighbours (on one node, fast links)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    strategy.mesh = init_device_mesh(
        strategy.device.type, (strategy.dp_ranks, strategy.tp_ranks), mesh_dim_names=("dp", "tp")
    )
    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    tp_plan = module.tp_plan(strategy.tp_ranks)
    parallelize_module(
        module, strategy.mesh["tp"], {name: styles[style]() for name, style in tp_plan.items()}
    )


class TensorParallel(Strategy):
    """The model's layers split over all ranks: one replica."""

    name = "tp"
    Settings = strategy_settings.TPSettings

    @classmethod
    def tp_size(cls, settings: strategy_settings.TPSettings, world: int) -> int:
        return world

    @classmethod
    def check(cls, cfg: Requested, model: Callable[[], nn.Module]) -> None:
        check_plan(cfg, cls, model)
        refuse(cls.name, not_ddp_refusals(cfg, cls.name))

    def wrap(
        self, module: nn.Module, dynamic: Optional[bool] = False, shared: Optional[bool] = None
    ) -> nn.Module:
        self.module = module
        start_from_rank0(module)
        parallelize(self, module)
        compiling.compile_blocks(module, self.cfg.trainer, dynamic)  # blocks of DTensors
        self.model = module
        self.state = layouts.ShardedState(module)
        return module

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        return clip_global_norm(self.model.parameters(), max_norm, self.device)
