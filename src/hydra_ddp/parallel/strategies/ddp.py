"""strategy=ddp: a whole replica of the model on every rank, its gradients all-reduced by
DistributedDataParallel, through the configured communication hook (parallel/comm.py) or, for CPU
ranks on one host, through shared memory (parallel/shared_memory.py).

Its `auto` settings (chosen per model and device from measurements, bench/results; each only where
it changes no result beyond float tolerance, and each can be set to true or false instead):

- gradient_as_bucket_view: gradients live in DDP's all-reduce buckets, not copied in and out of
  them; bit-identical results, less memory.
- static_graph: DDP records the order gradients become ready in the first step and buckets by it;
  bit-identical results. Off with gradient accumulation (DDP's reducer asserts on a no_sync step in
  a static graph), uneven shards (Join stands in for ranks that ran out) and the whole model's
  torch.compile (trainer.compile=model; its blocks' compile keeps it).
- shared_memory: the gradient all-reduce through a shared segment instead of gloo's loopback TCP,
  where every rank is a CPU process on this host; bit-identical at 2 ranks, the sums in another
  order (within float tolerance) at more. Not with a comm hook (it is one), uneven shards (Join's
  shadow all-reduces bypass hooks) or the whole model's torch.compile (its blocks' keeps it).
  Whether the segment can be made is the workers' to find: where it cannot, an `auto` falls back.
- sync_batchnorm: BatchNorm layers as SyncBatchNorm; auto is on with CUDA (DDP refuses it on the
  CPU).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Optional

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils._pytree import tree_flatten

from hydra_ddp.config import strategy_settings
from hydra_ddp.config.run_config import Requested, RunConfig
from hydra_ddp.errors import EveryRankError, UserError
from hydra_ddp.parallel import comm, elastic, layouts, shared_memory
from hydra_ddp.parallel.strategies.base import Strategy
from hydra_ddp.recipe import activation_checkpointing, compiling

AUTO = "auto"
# The settings that are DistributedDataParallel's own keyword arguments.
DDP_ARGUMENTS = (
    "bucket_cap_mb",
    "gradient_as_bucket_view",
    "static_graph",
    "find_unused_parameters",
)


def config_blockers(cfg: Requested) -> list[str]:
    """The settings that rule the shared-memory all-reduce out."""
    reasons = []
    if cfg.strategy.comm_hook != "none":
        reasons.append(f"strategy.comm_hook={cfg.strategy.comm_hook} is a hook of its own")
    if not cfg.data.even_shards:
        reasons.append("data.even_shards=false (Join's shadow all-reduces bypass hooks)")
    # DDP's hooks inside the compiled graph (blocks keep them outside)
    if cfg.trainer.compile == "model":
        reasons.append("trainer.compile=model")
    return reasons


class DDP(Strategy):
    """A whole replica per rank; DDP all-reduces the gradients."""

    name = "ddp"
    Settings = strategy_settings.DDPSettings
    fast_settings = (
        "strategy.gradient_as_bucket_view",
        "strategy.static_graph",
        "strategy.shared_memory",
    )
    tunable = ("strategy.bucket_cap_mb", "strategy.shared_memory", "strategy.comm_hook")
    sharded_checkpoints = False  # rank 0 holds everything: it writes one file
    # evaluation runs on the cfg module: ranks may hold different chunk counts
    lockstep_eval = False

    @classmethod
    def allows_channels_last(cls) -> bool:
        return True

    @classmethod
    def settle(
        cls, cfg: Requested, world: int, local_world: int
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        settings, trainer = cfg.strategy, cfg.trainer
        values: dict[str, Any] = {}
        if settings.sync_batchnorm == AUTO:
            values["strategy.sync_batchnorm"] = trainer.device == "cuda"
        blockers = cls.shared_memory_blockers(cfg, world, local_world)
        auto = {
            "gradient_as_bucket_view": True,
            "static_graph": elastic.most_accumulation(cfg, cls.replicas_at(cfg)) == 1
            and cfg.data.even_shards
            and trainer.compile != "model",
            "shared_memory": not blockers and world > 1,  # one rank: nothing to all-reduce
        }
        if settings.shared_memory is True and world > 1 and blockers:
            raise UserError(
                f"strategy.shared_memory=true does not combine with {'; '.join(blockers)}; "
                "set strategy.shared_memory=auto or false"
            )
        was_auto = [key for key in auto if getattr(settings, key) == AUTO]
        settled = {f"strategy.{key}": auto[key] for key in was_auto}
        values.update(settled)
        if settings.shared_memory is True and world < 2:  # one rank: nothing to all-reduce
            values["strategy.shared_memory"] = False
        return values, settled

    @staticmethod
    def shared_memory_blockers(cfg: Requested, world: int, local_world: int) -> list[str]:
        trainer = cfg.trainer
        return config_blockers(cfg) + shared_memory.unavailable(
            cfg.backend.name, trainer.device, world, local_world
        )

    @classmethod
    def check(cls, cfg: Requested, model: Callable[[], nn.Module]) -> None:
        settings, trainer, data = cfg.strategy, cfg.trainer, cfg.data
        if settings.comm_hook != "none" and not data.even_shards:
            raise UserError(
                f"strategy.comm_hook={settings.comm_hook} does not "
                "combine with data.even_shards=false (Join's shadow "
                "all-reduces bypass the hook); use one or the other"
            )
        if (
            settings.static_graph is True
            and elastic.most_accumulation(cfg, cls.replicas_at(cfg)) > 1
        ):
            at_fewer = trainer.accumulate == 1  # an elastic run's, at fewer nodes than it may have
            raise UserError(
                "strategy.static_graph=true does not combine with trainer.accumulate > 1 "
                f"{'(an elastic run accumulates at fewer nodes) ' if at_fewer else ''}(DDP's "
                "reducer fails on a no_sync step in a static graph); set "
                "strategy.static_graph=auto or false"
            )
        if settings.shared_memory is True and trainer.device != "cpu":
            raise UserError(
                "strategy.shared_memory=true does not combine with "
                f"trainer.device={trainer.device} (it sums CPU "
                "tensors); set strategy.shared_memory=auto or false"
            )
        if settings.sync_batchnorm and trainer.device != "cuda":
            raise UserError(
                "strategy.sync_batchnorm=true needs GPUs (this torch's DDP refuses "
                "SyncBatchNorm on the CPU); set it false, or train with trainer.device=cuda"
            )
        if not data.even_shards and settings.sync_batchnorm:
            raise UserError(
                "data.even_shards=false does not combine with strategy.sync_batchnorm=true "
                "(Join cannot stand in for SyncBatchNorm's collectives); use one or the other"
            )
        activation_checkpointing.check(cfg, model)

    def __init__(self, cfg: RunConfig, device: torch.device):
        super().__init__(cfg, device)
        self.comm: Optional[comm.PowerSGD] = None  # a communication hook that keeps state
        self.shared: Optional[shared_memory.SharedMemoryAllReduce] = None
        # What the hook sends each step; none counted under Join (uneven shards), where DDP's own
        # all-reduce runs: Join's shadow all-reduces bypass hooks, and its average needs DDP's
        # divisor.
        self.traffic: Optional[comm.Traffic] = None

    def wrap(
        self, module: nn.Module, dynamic: Optional[bool] = False, shared: Optional[bool] = None
    ) -> nn.Module:
        """`shared`: the shared-memory all-reduce's setting, where not strategy.shared_memory's (a
        segment that could not be made: gloo's)."""
        settings = self.cfg.strategy
        if settings.sync_batchnorm:
            module = nn.SyncBatchNorm.convert_sync_batchnorm(module)
        activation_checkpointing.apply(module, settings)
        # Inside DDP: its hooks stay out of the graphs.
        compiling.compile_blocks(module, self.cfg.trainer, dynamic)
        self.module = module
        shared = bool(settings.shared_memory if shared is None else shared)
        # the rest: comm.py's, shared_memory.py's
        options = {key: getattr(settings, key) for key in DDP_ARGUMENTS}
        traffic = comm.Traffic()
        if shared:
            # Before DDP: where the segment cannot be shared, every rank raises
            # SharedMemoryUnavailable here.
            gradient_bytes = sum(
                p.numel() * p.element_size() for p in module.parameters() if p.requires_grad
            )
            self.shared = shared_memory.SharedMemoryAllReduce(
                None, gradient_bytes, self.cfg.backend.timeout_s, traffic
            )
        device_ids = [self.device.index] if self.device.type == "cuda" else None
        self.model = DistributedDataParallel(module, device_ids=device_ids, **options)
        if options["static_graph"]:
            _check_first_output(self.model)
        if self.shared:
            self.model.register_comm_hook(None, self.shared.hook)
            self.traffic = traffic
        elif self.cfg.data.even_shards:
            self.comm = comm.register(self.model, settings.comm_hook, traffic, settings.powersgd)
            self.traffic = traffic
        self.state = layouts.WholeState(module, self.model)
        return self.model

    def no_sync(self) -> Any:
        return self.model.no_sync()

    def comm_state(self) -> Optional[dict[str, Any]]:
        return self.comm.state() if self.comm else None

    def load_comm_state(self, saved: Optional[dict[str, Any]], step: int) -> Optional[str]:
        return self.comm.load(saved, step) if self.comm else None

    def summary(self) -> dict[str, Any]:
        # The gradient bytes this rank sent in the last step, as the hook counted them (None: not
        # counted).
        return {
            "comm_hook": self.cfg.strategy.comm_hook,
            "allreduce_bytes_per_step": self.traffic.last_step if self.traffic else None,
        }


def _check_first_output(model: nn.Module) -> None:
    """Under a static graph, DDP averages the first step's gradients from a callback its own
    autograd node queues on the output's tensors, which it finds by flattening the output (tuples,
    lists, dicts, named tuples, transformers' ModelOutput). An output it cannot flatten (a
    dataclass) hides them: the first step's gradients would never be averaged, and the replicas
    would part for good, silently. Checked on the first training forward, then the hook is gone."""

    def check(module: nn.Module, inputs: Any, output: Any) -> None:
        if not module.training:
            return
        handle.remove()
        if not any(isinstance(leaf, torch.Tensor) for leaf in tree_flatten(output)[0]):
            raise EveryRankError(
                f"the model returns a {type(output).__name__}, in which DDP finds no tensor "
                "(it looks into tuples, lists, dicts and named tuples, not dataclasses): "
                "with strategy.static_graph the first step's gradients would not be "
                "averaged. Return one of those, or set strategy.static_graph=false"
            )

    handle = model.register_forward_hook(check)
