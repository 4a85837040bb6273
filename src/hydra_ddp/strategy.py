"""How the model is spread over the ranks (conf/strategy/): the one place the loop asks.

- ddp: a whole replica on every rank; DDP all-reduces the gradients (its knobs: the `ddp` section).
- fsdp: FSDP2 (`fully_shard`): parameters, gradients and optimizer state sharded over the ranks,
  each unit (a block, and the root) gathered for its forward and backward only. Per-rank model
  state is about 1/world size of DDP's; the arithmetic is the same (checked step by step).
- tp: tensor parallel over all ranks with the model's plan (`tp_plan`); one model replica.
- fsdp_tp: a 2-D mesh [dp, tp], tensor parallel inside groups of `tp_size`, FSDP across them.

Checkpoints: ddp's rank 0 writes the whole state to one file; the sharded strategies write each
rank's shards with torch.distributed.checkpoint (checkpoint.py). Both are keyed by the plain
module's parameter names, so either loads at any world size and under any strategy.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Optional

import torch
import torch.distributed as dist
from omegaconf import OmegaConf
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from hydra_ddp import comm, shared_memory
from hydra_ddp.distributed import RankInfo

NAMES = ("ddp", "fsdp", "tp", "fsdp_tp")
_WRAPPERS = ("_checkpoint_wrapped_module", "_orig_mod")  # attributes that wrap a module in another


def optimizer_state_by_name(module: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """`optimizer.state_dict()` with each parameter's position replaced by its name in `module`:
    what torch.distributed.checkpoint's get_optimizer_state_dict returns for a module that every
    rank holds whole (tests/test_strategy.py compares the two). Done here, that module's import is
    not in every worker's start-up (35 ms), and each save takes 0.1 ms instead of 1 ms.

    Unlike it, an optimizer with no state yet is not stepped once (at lr 0) to make some: saving
    changes nothing. A parameter shared by two modules has its first name, as named_parameters gives it."""
    names = {param: _plain_name(name) for name, param in module.named_parameters()}
    by_position = [names[param] for group in optimizer.param_groups for param in group["params"]]
    state = optimizer.state_dict()
    return {"state": {by_position[index]: value for index, value in state["state"].items()},
            "param_groups": [{**group, "params": [by_position[index] for index in group["params"]]}
                             for group in state["param_groups"]]}


def _plain_name(name: str) -> str:
    """A parameter's name without the wrappers' attributes in it (activation checkpointing's,
    torch.compile's), as DCP names it."""
    return ".".join(part for part in name.split(".") if part not in _WRAPPERS)


def build(cfg: Any, device: torch.device) -> "DDPStrategy":
    return {"ddp": DDPStrategy, "fsdp": FSDPStrategy, "tp": TPStrategy,
            "fsdp_tp": FSDPTPStrategy}[cfg.strategy.name](cfg, device)


class DDPStrategy:
    """A replica per rank, wrapped in DistributedDataParallel."""

    name = "ddp"
    lockstep_eval = False  # evaluation runs on the plain module: ranks may hold different chunk counts
    sharded_checkpoints = False  # rank 0 holds everything: it writes one file

    def __init__(self, cfg: Any, device: torch.device):
        self.cfg, self.device = cfg, device
        self.module: nn.Module = nn.Module()
        self.model: nn.Module = nn.Module()
        self.comm: Optional[comm.PowerSGD] = None  # a communication hook that keeps state
        self.shared: Optional[shared_memory.SharedMemoryAllReduce] = None
        # What the hook sends each step; none counted under Join (uneven shards), where DDP's own
        # all-reduce runs: Join's shadow all-reduces bypass hooks, and its average needs DDP's divisor.
        self.traffic: Optional[comm.Traffic] = None

    def wrap(self, module: nn.Module) -> nn.Module:
        options = OmegaConf.to_container(self.cfg.ddp)
        hook = options.pop("comm_hook")  # comm.py's, not DDP's arguments
        options.pop("powersgd")
        options.pop("sync_batchnorm")  # applied before the model moved to its device (worker)
        traffic = comm.Traffic()
        if options.pop("shared_memory"):  # performance.choose made it true or false
            # Before DDP: where the segment cannot be shared, every rank raises SharedMemoryUnavailable here.
            gradient_bytes = sum(p.numel() * p.element_size() for p in module.parameters() if p.requires_grad)
            self.shared = shared_memory.SharedMemoryAllReduce(None, gradient_bytes, self.cfg.dist.timeout_s, traffic)
        self.module = module
        self.model = DDP(module, device_ids=[self.device.index] if self.device.type == "cuda" else None, **options)
        if self.shared:
            self.model.register_comm_hook(None, self.shared.hook)
            self.traffic = traffic
        elif self.cfg.data.even_shards:
            self.comm = comm.register(self.model, hook, traffic, self.cfg.ddp.powersgd)
            self.traffic = traffic
        return self.model

    def bytes_per_step(self) -> Optional[int]:
        """The gradient bytes this rank sent in the last step, as its hook counted them (None: not counted)."""
        return self.traffic.last_step if self.traffic else None

    def comm_state(self) -> Optional[dict[str, Any]]:
        """The communication hook's state for a checkpoint (PowerSGD's; every rank calls it)."""
        return self.comm.state() if self.comm else None

    def load_comm_state(self, saved: Optional[dict[str, Any]], step: int) -> Optional[str]:
        """A checkpoint's hook state into the hook; a warning, where it could not all be taken."""
        return self.comm.load(saved, step) if self.comm else None

    def no_sync(self) -> contextlib.AbstractContextManager:
        return self.model.no_sync()

    def model_state(self) -> dict[str, torch.Tensor]:
        """The full weights, on rank 0 at least (here every rank has them)."""
        return self.module.state_dict()

    def load_model_state(self, state: dict[str, torch.Tensor], everywhere: bool = True) -> None:
        self.module.load_state_dict(state)

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """Keyed by parameter name (not position): the same layout FSDP's full state has."""
        return optimizer_state_by_name(self.module, optimizer)

    def load_optimizer_state(self, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        set_optimizer_state_dict(self.model, optimizer, state, options=StateDictOptions(full_state_dict=True))

    def checkpoint_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """The model and optimizer as a checkpoint holds them: here the full state (one file)."""
        return {"model": self.model_state(), "optimizer": self.optimizer_state(optimizer)}

    def load_sharded(self, path: Any, optimizer: torch.optim.Optimizer) -> None:
        """A sharded (DCP) checkpoint into this rank's model and optimizer: DCP reads the parts of
        the saved shards that this rank's layout needs, whatever the layout they were saved in."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        model_state, optimizer_state = get_state_dict(self.model, optimizer)
        state = {"model": model_state, "optimizer": optimizer_state}
        dcp.load(state, checkpoint_id=path)
        set_state_dict(self.model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])

    def local_tensors(self) -> Iterator[torch.Tensor]:
        """This rank's share of the parameters (the whole of them)."""
        return (p.detach() for p in self.module.parameters())

    @property
    def eval_module(self) -> nn.Module:
        return self.module

    def data_shard(self, rank: RankInfo) -> RankInfo:
        """Which share of the data this rank reads: its own (every rank a data-parallel replica)."""
        return rank

    def data_parallel_size(self) -> int:
        """How many different batches one step trains on (the replicas)."""
        return dist.get_world_size()

    def eval_reduction(self) -> dict[str, Any]:
        """How evaluation sums add up (evaluation.evaluate's reduce and group): over all ranks."""
        return {"reduce": True, "group": None}

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        """Clip the global gradient norm; returns it (before clipping), the same on every rank."""
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)
        return norm.full_tensor() if hasattr(norm, "full_tensor") else norm  # FSDP: a DTensor


class FSDPStrategy(DDPStrategy):
    """FSDP2: every unit (a model's `shard_units()`, else each child with parameters) and the root
    sharded over all ranks."""

    name = "fsdp"
    lockstep_eval = True  # a sharded forward gathers parameters: every rank runs as many forwards
    sharded_checkpoints = True  # each rank writes its own shards: no rank gathers the full state

    def __init__(self, cfg: Any, device: torch.device):
        super().__init__(cfg, device)
        # Every save and copy of the best weights goes through DCP's state_dict helpers: imported
        # while the run starts, not at the first of them in the middle of training.
        import torch.distributed.checkpoint.state_dict  # noqa: F401

    def wrap(self, module: nn.Module) -> nn.Module:
        start_from_rank0(module)
        self._shard(module, mesh=None)
        self.module = self.model = module
        return module

    def _shard(self, module: nn.Module, mesh: Any) -> None:
        """fully_shard each unit, then the root, over `mesh` (None: all ranks)."""
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

        settings = self.cfg.strategy
        dtype = {None: None, "bf16": torch.bfloat16, "fp16": torch.float16}[settings.mixed_precision]
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

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        # Gradient accumulation: gradients stay unsharded and local until the last micro-batch.
        self.model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            self.model.set_requires_gradient_sync(True)

    def model_state(self) -> dict[str, torch.Tensor]:
        """Gathered: the full weights on rank 0 (on the CPU), none on the other ranks."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        return get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))

    def load_model_state(self, state: dict[str, torch.Tensor], everywhere: bool = True) -> None:
        """Each rank keeps its shard of the full weights: read by every rank (`everywhere`), or
        held by rank 0 alone and sent from there."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        set_model_state_dict(self.model, state, options=StateDictOptions(full_state_dict=True,
                                                                          broadcast_from_rank0=not everywhere))

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        return get_optimizer_state_dict(self.model, optimizer,
                                        options=StateDictOptions(full_state_dict=True, cpu_offload=True))

    def load_optimizer_state(self, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        set_optimizer_state_dict(self.model, optimizer, state, options=StateDictOptions(full_state_dict=True))

    def checkpoint_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """This rank's shards (DTensors) of the model and optimizer state, as DCP saves them."""
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_state, optimizer_state = get_state_dict(self.model, optimizer)
        return {"model": model_state, "optimizer": optimizer_state}

    def local_tensors(self) -> Iterator[torch.Tensor]:
        return (p.detach().to_local() if hasattr(p, "to_local") else p.detach() for p in self.module.parameters())


class TPStrategy(FSDPStrategy):
    """Tensor parallel (Megatron style) over `tp_size` ranks, all of them here: the model's plan
    (`tp_plan(size)`: submodule → "colwise" or "rowwise") splits those linears' weights over the
    ranks, the rest is replicated; the ranks of a model replica read the same batches, and
    activations are exchanged inside each block."""

    name = "tp"
    lockstep_eval = True  # a split forward exchanges activations: every rank runs as many forwards

    def __init__(self, cfg: Any, device: torch.device):
        super().__init__(cfg, device)
        world = dist.get_world_size()
        self.tp_size = self._tp_size(world)
        self.dp_size = world // self.tp_size
        self.mesh: Any = None

    def _tp_size(self, world: int) -> int:
        return world

    def wrap(self, module: nn.Module) -> nn.Module:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        start_from_rank0(module)
        # Ranks r = dp × tp_size + tp: a replica's tp ranks are neighbours (on one node, fast links).
        self.mesh = init_device_mesh(self.device.type, (self.dp_size, self.tp_size), mesh_dim_names=("dp", "tp"))
        styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
        plan = module.tp_plan(self.tp_size)
        parallelize_module(module, self.mesh["tp"], {name: styles[style]() for name, style in plan.items()})
        self.module = self.model = module
        return module

    def no_sync(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()  # one replica: no gradient to synchronise between replicas

    def data_shard(self, rank: RankInfo) -> RankInfo:
        """The replica's share: every tp rank of it reads the same."""
        return RankInfo(rank=rank.rank // self.tp_size, world_size=self.dp_size,
                        local_rank=rank.local_rank // self.tp_size,
                        local_world_size=max(1, rank.local_world_size // self.tp_size))

    def data_parallel_size(self) -> int:
        return self.dp_size

    def eval_reduction(self) -> dict[str, Any]:
        """Over the replicas only (the tp ranks of a replica computed the same sums); with one
        replica, every rank's sums are whole already."""
        if self.dp_size == 1:
            return {"reduce": False, "group": None}
        return {"reduce": True, "group": self.mesh["dp"].get_group()}

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        return clip_global_norm(self.model.parameters(), max_norm, self.device)


class FSDPTPStrategy(TPStrategy):
    """A 2-D mesh [dp, tp]: tensor parallel inside groups of `strategy.tp_size` ranks, FSDP across
    the groups (each replica's shards sharded again over the dp dimension)."""

    name = "fsdp_tp"

    def _tp_size(self, world: int) -> int:
        return int(self.cfg.strategy.tp_size)

    def wrap(self, module: nn.Module) -> nn.Module:
        module = super().wrap(module)  # tensor parallel inside each group
        self._shard(module, mesh=self.mesh["dp"])  # FSDP across the groups
        return module

    no_sync = FSDPStrategy.no_sync  # FSDP's, not tensor parallel's (which has nothing to skip)


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
    norm = total.sqrt().float()
    scale = min(1.0, max_norm / (norm.item() + 1e-6))
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


def local_state_bytes(strategy: DDPStrategy, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Bytes of model state this rank holds between steps: parameters, their gradients (as large,
    during a step) and optimizer state, counting only local shards."""
    for module in strategy.model.modules():  # FSDP without reshard_after_forward: still gathered
        if hasattr(module, "reshard") and hasattr(module, "unshard"):
            module.reshard()
    params = sum(t.numel() * t.element_size() for t in strategy.local_tensors())
    optim = 0
    for state in optimizer.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor):
                local = value.to_local() if hasattr(value, "to_local") else value
                optim += local.numel() * local.element_size()
    return {"params": params, "grads": params, "optimizer": optim, "total": 2 * params + optim}
