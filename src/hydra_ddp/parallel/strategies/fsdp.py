"""strategy=fsdp: FSDP2 (torch.distributed.fsdp.fully_shard): parameters, gradients and optimizer
state sharded over the ranks; each unit (a model's shard_units(), else each child with parameters)
and the root gathered for its own forward and backward only. For models whose state does not fit
one device."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any, Optional

import torch
from torch import nn

from hydra_ddp.config import strategy_settings
from hydra_ddp.config.run_config import Requested
from hydra_ddp.errors import EveryRankError
from hydra_ddp.parallel import layouts
from hydra_ddp.parallel.strategies.base import Strategy, not_ddp_refusals, refuse, start_from_rank0
from hydra_ddp.recipe import activation_checkpointing, compiling


def shard_refusals(cfg: Requested) -> list[tuple[bool, str]]:
    """(refused, why) for FSDP's own settings."""
    settings, trainer, launcher = cfg.strategy, cfg.trainer, cfg.launcher
    # None: not yet settled
    world = trainer.nproc * launcher.nnodes if isinstance(trainer.nproc, int) else None
    copies = int(settings.replicate)
    return [
        (
            world is not None and world % copies != 0,
            f"strategy.replicate={copies} does not divide the {world} ranks (trainer.nproc × "
            f"launcher.nnodes): give a divisor of {world} (launcher.nnodes: a copy per node)",
        ),
        (
            copies > 1 and (launcher.min_nodes or launcher.nnodes) != launcher.nnodes,
            f"strategy.replicate={copies} fixes the mesh, which an elastic "
            "run's resize would change: leave it 1 for launcher.nnodes=MIN:MAX",
        ),
        (
            settings.cpu_offload and trainer.device != "cuda",
            "strategy.cpu_offload=true keeps parameters on the CPU between "
            "uses on GPUs; on the CPU it has nothing to offload: leave it false",
        ),
        *(
            (
                getattr(settings, key) == "fp16",
                f"strategy.{key}=fp16 would need loss scaling over the "
                "shards, which FSDP2 here does not do (small gradients would "
                "underflow silently); use bf16: fp32's range, no scaler",
            )
            for key in ("param_dtype", "reduce_dtype", "output_dtype")
        ),
    ]


DTYPES = {None: None, "bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def mixed_precision(settings: strategy_settings.FSDPSettings, root: bool) -> Any:
    """The strategy's param_dtype, reduce_dtype and output_dtype as FSDP2's MixedPrecisionPolicy:
    the output's dtype the root's only (a unit's output cast back would meet the next unit, or the
    root's own layers, in another dtype than their parameters')."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(
        param_dtype=DTYPES[settings.param_dtype],
        reduce_dtype=DTYPES[settings.reduce_dtype],
        output_dtype=DTYPES[settings.output_dtype] if root else None,
    )


def shard(module: nn.Module, settings: strategy_settings.FSDPSettings, mesh: Any) -> None:
    """fully_shard each unit, then the root, over `mesh` (None: all ranks)."""
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard

    options = dict(
        mesh=mesh,
        reshard_after_forward=bool(settings.reshard_after_forward),
        offload_policy=CPUOffloadPolicy() if settings.cpu_offload else OffloadPolicy(),
    )
    # The sharded parameters stay fp32 whatever the compute's dtype.
    for unit in shard_units(module):
        fully_shard(unit, mp_policy=mixed_precision(settings, root=False), **options)
    fully_shard(module, mp_policy=mixed_precision(settings, root=True), **options)


def hybrid_mesh(settings: strategy_settings.FSDPSettings, device: torch.device) -> Any:
    """HSDP's 2-D mesh [replicate, shard] (a copy's shards on neighbouring ranks: rank = copy ×
    shards + shard), or None: FSDP over every rank. fully_shard reads a 2-D mesh as hybrid."""
    copies = int(settings.replicate)
    if copies == 1:
        return None
    from torch.distributed.device_mesh import init_device_mesh

    world = torch.distributed.get_world_size()
    if world % copies:  # checked before launch; an outside launcher's world size is known only here
        raise EveryRankError(
            f"strategy.replicate={copies} does not divide the {world} ranks: give a divisor"
        )
    return init_device_mesh(
        device.type, (copies, world // copies), mesh_dim_names=("replicate", "shard")
    )


def shard_units(module: nn.Module) -> list[nn.Module]:
    """The modules FSDP shards one by one (their parameters gathered together): the model's blocks
    (recipe.activation_checkpointing.blocks: a `shard_units()` method, e.g. a transformer's blocks;
    a Hugging Face model's decoder layers, as Accelerate wraps them); else each child with
    parameters."""
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
    Settings = strategy_settings.FSDPSettings

    @classmethod
    def check(cls, cfg: Requested, model: Callable[[], nn.Module]) -> None:
        refuse(cls.name, not_ddp_refusals(cfg, cls.name) + shard_refusals(cfg))
        activation_checkpointing.check(cfg, model)

    @classmethod
    def backend(cls, settings: strategy_settings.FSDPSettings, backend: str) -> str:
        """NCCL takes CUDA tensors only, and CPU offload keeps the shards on the CPU: the
        collectives on them (the finite-weights check, the gradient norm) go to gloo, the rest to
        NCCL, in one group."""
        return "cpu:gloo,cuda:nccl" if backend == "nccl" and settings.cpu_offload else backend

    def wrap(
        self, module: nn.Module, dynamic: Optional[bool] = False, shared: Optional[bool] = None
    ) -> nn.Module:
        self.module = module
        start_from_rank0(module)
        activation_checkpointing.apply(module, self.cfg.strategy)  # inside the units FSDP gathers
        # The units' forwards: FSDP's hooks stay eager.
        compiling.compile_blocks(module, self.cfg.trainer, dynamic)
        shard(module, self.cfg.strategy, mesh=hybrid_mesh(self.cfg.strategy, self.device))
        self.model = module
        self.state = layouts.ShardedState(module)
        return module

    def no_sync(self) -> Any:
        return no_sync(self.model)

    def summary(self) -> dict[str, Any]:
        copies = int(self.cfg.strategy.replicate)
        mesh = (
            {"replicate": copies, "shard": torch.distributed.get_world_size() // copies}
            if copies > 1
            else None
        )
        return {**super().summary(), "hsdp": mesh}
