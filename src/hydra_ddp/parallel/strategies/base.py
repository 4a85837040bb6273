"""What every strategy is: the protocol the loop and the launch side ask (Strategy), and the pieces
strategies share (the weights every rank starts from, a global gradient norm over any layout).

A strategy is one module of this package: its settings (a dataclass: the schema of
conf/strategy/NAME.yaml, each key's values beside it), its rules, decided from the config alone
before launch (how many model replicas it makes, what it refuses, its `auto` values), and, in the
worker, the model it wraps and what the loop asks of it (no_sync, clipping, which data a rank
reads, how evaluation sums add up, how its state is saved).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any, ClassVar, Optional

import torch
import torch.distributed as dist
from torch import nn

from hydra_ddp.config.run_config import Requested, RunConfig
from hydra_ddp.config.section import Section
from hydra_ddp.errors import UserError
from hydra_ddp.runtime.ranks import RankInfo


class Strategy:
    """How the model is spread over the ranks: one subclass per strategy (conf/strategy/)."""

    name: ClassVar[str]
    Settings: ClassVar[type]  # strategy.*: the dataclass conf/strategy/NAME.yaml is checked against
    # Its knobs that `auto` settles (settle, below), for the summary: DDP's; the others have none.
    fast_settings: ClassVar[tuple[str, ...]] = ()
    # Its settings the tuner may time (tools/tune.py): DDP's gradient exchange; the others have
    # none.
    tunable: ClassVar[tuple[str, ...]] = ()
    # What the checkpoints hold: one file of the whole state (rank 0 writes it), or each rank's
    # shards.
    sharded_checkpoints: ClassVar[bool] = True
    # Every rank runs as many evaluation forwards (a sharded or split forward exchanges tensors).
    lockstep_eval: ClassVar[bool] = True

    # --- its rules, from the config alone (before launch, no process group) ----------------------
    @classmethod
    def tp_size(cls, settings: Section, world: int) -> int:
        """Ranks per tensor-parallel group (1: none)."""
        return 1

    @classmethod
    def replicas(cls, settings: Section, world: int) -> int:
        """Model replicas, each reading its own batches."""
        size = cls.tp_size(settings, world)
        if size < 1 or world % size:
            raise UserError(
                f"strategy.tp_size={size} does not divide the world size {world}: "
                f"choose a divisor of {world} (the mesh is world ÷ tp_size by tp_size)"
            )
        return world // size

    @classmethod
    def replicas_at(cls, cfg: Requested) -> Callable[[int], int]:
        """Its model replicas at a world size, under `cfg`'s settings (elastic.py's arithmetic)."""
        return lambda world: cls.replicas(cfg.strategy, world)

    @classmethod
    def settle(
        cls, cfg: Requested, world: int, local_world: int
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        """Its settings' values on the launch side, by dotted key, for the config being resolved
        (`cfg`); and those of them that were `auto` and are worth a line in the summary."""
        return {}, {}

    @classmethod
    def check(cls, cfg: Requested, model: Callable[[], nn.Module]) -> None:
        """What this strategy cannot do with these settings (`cfg`: the resolved config, or an
        elastic run's at each of its world sizes as it is settled; `model`: the blueprint's model
        on the meta device, raising what building raises): one line each, before launch."""

    @classmethod
    def backend(cls, settings: Section, backend: str) -> str:
        """The process group's backend string for this strategy's settings."""
        return backend

    @classmethod
    def allows_channels_last(cls) -> bool:
        """channels_last weights: FSDP shards contiguous parameters only."""
        return False

    # --- in the worker ----------------------------------------------------------------------------
    def __init__(self, cfg: RunConfig, device: torch.device):
        self.cfg, self.device = cfg, device
        world = dist.get_world_size()
        self.tp_ranks = self.tp_size(cfg.strategy, world)  # ranks per tensor-parallel group
        self.dp_ranks = world // self.tp_ranks  # model replicas
        self.module: nn.Module = nn.Module()  # the cfg module (its parameters sharded or not)
        # what the loop calls: DDP's wrapper, or the module itself
        self.model: nn.Module = nn.Module()
        self.mesh: Any = None
        self.state: Any = None
        if self.sharded_checkpoints:
            # Every save and copy of the best weights goes through DCP's state_dict helpers
            # (ShardedState): imported while the run starts, not at the first of them in the middle
            # of training.
            import torch.distributed.checkpoint.state_dict  # noqa: F401

    def wrap(
        self, module: nn.Module, dynamic: Optional[bool] = False, shared: Optional[bool] = None
    ) -> nn.Module:
        """The module spread over the ranks; what the loop calls. `dynamic`: trainer.compile=blocks'
        torch.compile(dynamic=...), by the run's data (recipe/compiling.py); `shared`: DDP's
        shared-memory all-reduce, where the worker found its segment cannot be made (False)."""
        raise NotImplementedError

    def no_sync(self) -> contextlib.AbstractContextManager:
        """Gradient accumulation: no synchronisation between replicas until the group's last
        batch."""
        return contextlib.nullcontext()

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        """Clip the global gradient norm; returns it (before clipping), the same on every rank."""
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)
        return norm.full_tensor() if hasattr(norm, "full_tensor") else norm  # FSDP: a DTensor

    def data_shard(self, rank: RankInfo) -> RankInfo:
        """Which share of the data this rank reads: its replica's (every tp rank of a replica
        alike)."""
        if self.tp_ranks == 1:
            return rank
        return RankInfo(
            rank=rank.rank // self.tp_ranks,
            world_size=self.dp_ranks,
            local_rank=rank.local_rank // self.tp_ranks,
            local_world_size=max(1, rank.local_world_size // self.tp_ranks),
        )

    def data_parallel_size(self) -> int:
        """How many different batches one step trains on (the replicas)."""
        return self.dp_ranks

    def eval_reduction(self) -> dict[str, Any]:
        """How evaluation sums add up (evaluation.evaluate's reduce and group): over all ranks;
        under tensor parallel over the replicas only (a replica's tp ranks computed the same sums),
        and with one replica not at all."""
        if self.tp_ranks == 1:
            return {"reduce": True, "group": None}
        if self.dp_ranks == 1:
            return {"reduce": False, "group": None}
        return {"reduce": True, "group": self.mesh["dp"].get_group()}

    def sum_over_replicas(self, tensor: torch.Tensor) -> Optional[dist.Work]:
        """Start adding `tensor` (a count) over the model replicas in place, as eval_reduction adds
        the evaluation's sums: the work to wait for, or None where there is nothing to add."""
        how = self.eval_reduction()
        if not how["reduce"]:
            return None
        return dist.all_reduce(tensor, group=how["group"], async_op=True)

    @property
    def eval_module(self) -> nn.Module:
        return self.module

    # --- its state: whole or sharded (parallel/layouts.py) --------------------------------------
    def model_state(self) -> dict[str, torch.Tensor]:
        return self.state.model_state()

    def load_model_state(self, saved: dict[str, torch.Tensor], everywhere: bool = True) -> None:
        self.state.load_model_state(saved, everywhere)

    def load_optimizer_state(self, optimizer: torch.optim.Optimizer, saved: dict[str, Any]) -> None:
        self.state.load_optimizer_state(optimizer, saved)

    def checkpoint_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        return self.state.checkpoint_state(optimizer)

    def checkpoint_model_state(self) -> dict[str, torch.Tensor]:
        """The model's state in the checkpoint's layout (whole, or this rank's shards)."""
        return self.state.checkpoint_model_state()

    def load_sharded_model(self, path: Any, part: str) -> None:
        from hydra_ddp.parallel import layouts

        layouts.load_sharded_model(self.model, path, part)

    def load_sharded(self, path: Any, optimizer: torch.optim.Optimizer) -> None:
        from hydra_ddp.parallel import layouts

        layouts.load_sharded(self.model, path, optimizer)

    def local_tensors(self) -> Iterator[torch.Tensor]:
        return self.state.local_tensors()

    # --- DDP's gradient exchange: its communication hook (the others have none) ----------------
    def comm_state(self) -> Optional[dict[str, Any]]:
        """The communication hook's state for a checkpoint (PowerSGD's; every rank calls it)."""
        return None

    def load_comm_state(self, saved: Optional[dict[str, Any]], step: int) -> Optional[str]:
        """A checkpoint's hook state into the hook; a warning, where it could not all be taken."""
        return None

    def summary(self) -> dict[str, Any]:
        """What the run's summary says of the gradient exchange (DDP's hook and its measured
        bytes)."""
        return {"comm_hook": None, "allreduce_bytes_per_step": None}


def not_ddp_refusals(cfg: Requested, name: str) -> list[tuple[bool, str]]:
    """(refused, why) for what only DDP's replicas can do: every other strategy refuses them."""
    trainer = cfg.trainer
    return [
        (
            not cfg.data.even_shards,
            "data.even_shards=false needs DDP's Join, which "
            "FSDP does not support; keep data.even_shards=true",
        ),
        (
            trainer.compile == "model",
            "trainer.compile=model compiles the DDP model whole; under "
            f"strategy={name} compile the blocks (trainer.compile=blocks, or true)",
        ),
        (
            trainer.channels_last is True,
            "trainer.channels_last=true makes convolution weights non-contiguous, "
            "which FSDP cannot shard; leave it auto or false",
        ),
        (
            str(trainer.precision) == "16",
            f"trainer.precision=16 (a GradScaler) is not supported with strategy={name}; use "
            "strategy.param_dtype=bf16 or trainer.precision=bf16",
        ),
    ]


def refuse(name: str, refusals: list[tuple[bool, str]]) -> None:
    for refused, why in refusals:
        if refused:
            raise UserError(f"strategy={name}: {why}")


def start_from_rank0(module: nn.Module) -> None:
    """Every rank starts from rank 0's weights (DDP's constructor does this for DDP): a model built
    from the same seed already agrees, but trainer.init_from's were loaded on rank 0 only."""
    with torch.no_grad():
        for tensor in list(module.parameters()) + list(module.buffers()):
            dist.broadcast(tensor.data, src=0)


def clip_global_norm(
    parameters: Iterator[nn.Parameter], max_norm: float, device: torch.device
) -> torch.Tensor:
    """Clip the gradients to a global norm computed over every layout at once: cfg tensors
    (whole on every rank), DTensors split over some mesh dimensions and replicated over others,
    on meshes that cover all ranks or some. Each rank adds its local squared norms, each divided
    by how many ranks hold that same piece, and one all-reduce makes the total."""
    from torch.distributed.tensor import DTensor

    world = dist.get_world_size()
    grads = [p.grad for p in parameters if p.grad is not None]
    total = torch.zeros((), dtype=torch.float64, device=device)
    for g in grads:
        if isinstance(g, DTensor):
            copies = world // g.device_mesh.size()  # ranks outside its mesh hold the same piece
            for dim, placement in enumerate(g.placements):
                if placement.is_replicate():
                    copies *= g.device_mesh.size(dim)
            total += g.to_local().double().pow(2).sum() / copies
        else:
            total += g.double().pow(2).sum() / world
    dist.all_reduce(total)
    # torch.nn.utils.clip_grad_norm_'s arithmetic, in the gradients' dtype (a float32 norm would
    # round a float64 model's scale; it moved such a run by 1e-9 from one rank's).
    norm = total.sqrt().to(grads[0].dtype if grads else torch.float32)
    scale = (max_norm / (norm + 1e-6)).clamp(max=1.0).item()
    for g in grads:
        g.mul_(scale)
    return norm


def local_state_bytes(strategy: Strategy, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Bytes of model state this rank holds between steps: parameters, their gradients (as large,
    during a step) and optimizer state, counting only local shards."""
    for module in strategy.model.modules():  # FSDP without reshard_after_forward: still gathered
        if hasattr(module, "reshard") and hasattr(module, "unshard"):
            module.reshard()
    params = sum(t.numel() * t.element_size() for t in strategy.local_tensors())
    optim = 0
    for value in (v for s in optimizer.state.values() for v in s.values()):
        if isinstance(value, torch.Tensor):
            local = value.to_local() if hasattr(value, "to_local") else value
            optim += local.numel() * local.element_size()
    return {"params": params, "grads": params, "optimizer": optim, "total": 2 * params + optim}
