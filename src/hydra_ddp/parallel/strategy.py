"""How the model is spread over the ranks (conf/strategy/): the one place the loop asks.

A strategy is composed from its plan (parallel/plans.py) as torchtitan composes its
parallelisms: a layout of the ranks (how many data-parallel replicas, how many ranks per
tensor-parallel group), the wrapping applied in order (tensor parallel inside a group, then FSDP
across groups, or DDP's replicas), a state layout (whole or sharded, parallel/state.py) and the
gradient synchronisation that accumulation skips.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, Optional

import torch
import torch.distributed as dist
from omegaconf import OmegaConf
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from hydra_ddp.parallel import comm, plans, shared_memory, state
from hydra_ddp.parallel.distributed import RankInfo
from hydra_ddp.parallel.plans import Plan

# The ddp strategy's settings that are DistributedDataParallel's own keyword arguments.
DDP_ARGUMENTS = ("bucket_cap_mb", "gradient_as_bucket_view", "static_graph", "find_unused_parameters")


def build(cfg: Any, device: torch.device) -> Strategy:
    return Strategy(plans.plan(cfg.strategy.name), cfg, device)


class Replicas:
    """DDP: a whole replica per rank, its gradients all-reduced through the configured hook (comm.py)
    or through shared memory (shared_memory.py)."""

    def __init__(self, cfg: Any, device: torch.device):
        self.cfg, self.device = cfg, device
        self.comm: Optional[comm.PowerSGD] = None  # a communication hook that keeps state
        self.shared: Optional[shared_memory.SharedMemoryAllReduce] = None
        # What the hook sends each step; none counted under Join (uneven shards), where DDP's own
        # all-reduce runs: Join's shadow all-reduces bypass hooks, and its average needs DDP's divisor.
        self.traffic: Optional[comm.Traffic] = None

    def wrap(self, module: nn.Module, shared: bool) -> nn.Module:
        settings = self.cfg.strategy
        options = {key: settings[key] for key in DDP_ARGUMENTS}  # the rest is comm.py's, shared_memory.py's
        traffic = comm.Traffic()
        if shared:
            # Before DDP: where the segment cannot be shared, every rank raises SharedMemoryUnavailable here.
            gradient_bytes = sum(p.numel() * p.element_size() for p in module.parameters() if p.requires_grad)
            self.shared = shared_memory.SharedMemoryAllReduce(None, gradient_bytes, self.cfg.backend.timeout_s, traffic)
        model = DDP(module, device_ids=[self.device.index] if self.device.type == "cuda" else None, **options)
        if self.shared:
            model.register_comm_hook(None, self.shared.hook)
            self.traffic = traffic
        elif self.cfg.data.even_shards:
            self.comm = comm.register(model, settings.comm_hook, traffic, settings.powersgd)
            self.traffic = traffic
        return model


class Strategy:
    """The model as the plan spreads it: wrapped, checkpointed, synchronised and evaluated."""

    def __init__(self, plan: Plan, cfg: Any, device: torch.device):
        self.plan, self.name, self.cfg, self.device = plan, plan.name, cfg, device
        world = dist.get_world_size()
        self.tp_size = plan.tp_size(OmegaConf.to_container(cfg.strategy), world)
        self.dp_size = world // self.tp_size
        self.replicas = Replicas(cfg, device) if plan.replicate else None
        # Evaluation runs on the plain module under DDP (ranks may hold different chunk counts); a
        # sharded or split forward exchanges tensors: every rank runs as many forwards.
        self.lockstep_eval = not plan.replicate
        self.sharded_checkpoints = not plan.replicate
        self.module: nn.Module = nn.Module()  # the plain module (its parameters sharded or not)
        self.model: nn.Module = nn.Module()  # what the loop calls: DDP's wrapper, or the module itself
        self.mesh: Any = None
        self.state: Any = None
        if not plan.replicate:
            # Every save and copy of the best weights goes through DCP's state_dict helpers (ShardedState):
            # imported while the run starts, not at the first of them in the middle of training.
            import torch.distributed.checkpoint.state_dict  # noqa: F401

    def wrap(self, module: nn.Module, shared_memory: Optional[bool] = None) -> nn.Module:
        """The module spread as planned. `shared_memory`: the gradient all-reduce's setting, where not
        strategy.shared_memory's (a segment that could not be made: gloo's)."""
        self.module = module
        if self.replicas:
            shared = self.cfg.strategy.shared_memory if shared_memory is None else shared_memory
            self.model = self.replicas.wrap(module, bool(shared))
            self.state = state.WholeState(module, self.model)
            return self.model
        start_from_rank0(module)
        if self.plan.tensor_parallel:
            self._tensor_parallel(module)  # inside each group
        if self.plan.shard:
            self._shard(module, mesh=self.mesh["dp"] if self.mesh is not None else None)  # across the groups
        self.model = module
        self.state = state.ShardedState(module)
        return module

    def _tensor_parallel(self, module: nn.Module) -> None:
        """Megatron style over `tp_size` ranks: the model's plan (`tp_plan(size)`: submodule →
        "colwise" or "rowwise") splits those linears' weights, the rest is replicated."""
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            RowwiseParallel,
            parallelize_module,
        )

        # Ranks r = dp × tp_size + tp: a replica's tp ranks are neighbours (on one node, fast links).
        self.mesh = init_device_mesh(self.device.type, (self.dp_size, self.tp_size), mesh_dim_names=("dp", "tp"))
        styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
        tp_plan = module.tp_plan(self.tp_size)
        parallelize_module(module, self.mesh["tp"], {name: styles[style]() for name, style in tp_plan.items()})

    def _shard(self, module: nn.Module, mesh: Any) -> None:
        """FSDP2: fully_shard each unit, then the root, over `mesh` (None: all ranks)."""
        from torch.distributed.fsdp import (
            CPUOffloadPolicy,
            MixedPrecisionPolicy,
            OffloadPolicy,
            fully_shard,
        )

        settings = self.cfg.strategy
        dtype = {None: None, "bf16": torch.bfloat16}[settings.mixed_precision]  # fp16 is refused (plans.py)
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

    # --- what the loop asks ---------------------------------------------------------------------
    def no_sync(self) -> contextlib.AbstractContextManager:
        """Gradient accumulation: no synchronisation between replicas until the group's last batch."""
        if self.replicas:
            return self.model.no_sync()
        if self.plan.shard:
            return self._fsdp_no_sync()
        return contextlib.nullcontext()  # one replica: no gradient to synchronise between replicas

    @contextlib.contextmanager
    def _fsdp_no_sync(self) -> Iterator[None]:
        # Gradients stay unsharded and local until the last micro-batch.
        self.model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            self.model.set_requires_gradient_sync(True)

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        """Clip the global gradient norm; returns it (before clipping), the same on every rank."""
        if self.plan.tensor_parallel:
            return clip_global_norm(self.model.parameters(), max_norm, self.device)
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)
        return norm.full_tensor() if hasattr(norm, "full_tensor") else norm  # FSDP: a DTensor

    def data_shard(self, rank: RankInfo) -> RankInfo:
        """Which share of the data this rank reads: its replica's (every tp rank of a replica alike)."""
        if self.tp_size == 1:
            return rank
        return RankInfo(
            rank=rank.rank // self.tp_size,
            world_size=self.dp_size,
            local_rank=rank.local_rank // self.tp_size,
            local_world_size=max(1, rank.local_world_size // self.tp_size),
        )

    def data_parallel_size(self) -> int:
        """How many different batches one step trains on (the replicas)."""
        return self.dp_size

    def eval_reduction(self) -> dict[str, Any]:
        """How evaluation sums add up (evaluation.evaluate's reduce and group): over all ranks; under
        tensor parallel over the replicas only (a replica's tp ranks computed the same sums), and with
        one replica not at all."""
        if self.tp_size == 1:
            return {"reduce": True, "group": None}
        if self.dp_size == 1:
            return {"reduce": False, "group": None}
        return {"reduce": True, "group": self.mesh["dp"].get_group()}

    @property
    def eval_module(self) -> nn.Module:
        return self.module

    # --- state ----------------------------------------------------------------------------------
    def model_state(self) -> dict[str, torch.Tensor]:
        return self.state.model_state()

    def load_model_state(self, saved: dict[str, torch.Tensor], everywhere: bool = True) -> None:
        self.state.load_model_state(saved, everywhere)

    def load_optimizer_state(self, optimizer: torch.optim.Optimizer, saved: dict[str, Any]) -> None:
        self.state.load_optimizer_state(optimizer, saved)

    def checkpoint_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        return self.state.checkpoint_state(optimizer)

    def load_sharded(self, path: Any, optimizer: torch.optim.Optimizer) -> None:
        state.load_sharded(self.model, path, optimizer)

    def local_tensors(self) -> Iterator[torch.Tensor]:
        return self.state.local_tensors()

    def comm_state(self) -> Optional[dict[str, Any]]:
        """The communication hook's state for a checkpoint (PowerSGD's; every rank calls it)."""
        return self.replicas.comm.state() if self.replicas and self.replicas.comm else None

    def load_comm_state(self, saved: Optional[dict[str, Any]], step: int) -> Optional[str]:
        """A checkpoint's hook state into the hook; a warning, where it could not all be taken."""
        return self.replicas.comm.load(saved, step) if self.replicas and self.replicas.comm else None

    def bytes_per_step(self) -> Optional[int]:
        """The gradient bytes this rank sent in the last step, as DDP's hook counted them (None: not counted)."""
        traffic = self.replicas.traffic if self.replicas else None
        return traffic.last_step if traffic else None


def clip_global_norm(parameters: Iterator[nn.Parameter], max_norm: float, device: torch.device) -> torch.Tensor:
    """Clip the gradients to a global norm computed over every layout at once: plain tensors
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
    # torch.nn.utils.clip_grad_norm_'s arithmetic, in the gradients' dtype (a float32 norm would round
    # a float64 model's scale; it moved such a run by 1e-9 from one rank's).
    norm = total.sqrt().to(grads[0].dtype if grads else torch.float32)
    scale = (max_norm / (norm + 1e-6)).clamp(max=1.0).item()
    for g in grads:
        g.mul_(scale)
    return norm


def start_from_rank0(module: nn.Module) -> None:
    """Every rank starts from rank 0's weights (DDP's constructor does this for DDP): a model built
    from the same seed already agrees, but trainer.init_from's were loaded on rank 0 only."""
    with torch.no_grad():
        for tensor in list(module.parameters()) + list(module.buffers()):
            dist.broadcast(tensor.data, src=0)


def shard_units(module: nn.Module) -> list[nn.Module]:
    """The modules FSDP shards one by one (their parameters gathered together): the model's own
    choice (a `shard_units()` method, e.g. a transformer's blocks), else each child with parameters."""
    if hasattr(module, "shard_units"):
        return list(module.shard_units())
    return [child for child in module.children() if any(True for _ in child.parameters())]


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
