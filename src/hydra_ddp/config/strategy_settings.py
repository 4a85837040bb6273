"""The strategies' settings (strategy.*; conf/strategy/NAME.yaml extends them): the schema of the
section whose option `strategy=NAME` chooses. Each strategy (parallel/strategies/NAME.py) reads its
own; they live here, with the rest of the schema, so that the config imports nothing above it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, Any, Optional

from hydra_ddp.config.domains import AUTO_BOOL, AtLeast, OneOf, Positive
from hydra_ddp.config.section import Section
from hydra_ddp.errors import UserError

MODES = ("none", "full", "every_k")
# The strategies' settings that take it (DDP's, FSDP's): none, full (every block) or every_k.
Mode = Annotated[str, OneOf(*MODES)]
Every = Annotated[int, AtLeast(1)]
# strategy.comm_hook: DDP's gradient communication hooks (parallel/comm.py).
COMM_HOOKS = ("none", "fp16", "bf16", "powersgd")


@dataclass
class PowerSGDSettings(Section):
    # strategy.comm_hook=powersgd: each weight matrix's gradient sent as a rank-`rank` approximation
    # (1–4 in the paper; higher is closer to the exact gradient and sends more).
    rank: Annotated[int, AtLeast(1)] = 1
    # Plain all-reduce before this optimizer step: the paper's warm-up (torch suggests about a
    # tenth of the training).
    start_step: Annotated[int, AtLeast(0)] = 100


@dataclass
class DDPSettings(Section):
    # ddp: a replica per rank (conf/strategy/: ddp, fsdp, tp, fsdp_tp).
    name: Annotated[str, OneOf("ddp")] = "ddp"
    # DDP's gradient bucket size (MB): smaller starts the all-reduce sooner, larger sends fewer
    # messages.
    bucket_cap_mb: Annotated[float, Positive()] = 25.0
    # true, false, or auto: the fast choice for this run (parallel/strategies/ddp.py's docstring);
    # the summary names it.
    gradient_as_bucket_view: Annotated[Any, AUTO_BOOL] = "auto"
    static_graph: Annotated[Any, AUTO_BOOL] = "auto"  # DDP's static_graph: true, false or auto
    # DDP's search for parameters a forward did not use (slow; only for models that skip some).
    find_unused_parameters: bool = False
    # The gradient all-reduce through shared memory when every rank is a CPU process on this host
    # (parallel/shared_memory.py), instead of gloo's loopback TCP. auto: wherever it can.
    shared_memory: Annotated[Any, AUTO_BOOL] = "auto"
    # DDP's gradient communication hook (parallel/comm.py): none (DDP's fp32 all-reduce), fp16 or
    # bf16 (gradients all-reduced in 16 bits), or powersgd (low-rank, settings below).
    comm_hook: Annotated[str, OneOf(*COMM_HOOKS)] = "none"
    powersgd: PowerSGDSettings = field(default_factory=PowerSGDSettings)
    # BatchNorm layers become SyncBatchNorm (statistics over the global batch, so a BatchNorm model
    # trains alike at any world size). GPUs only: DDP refuses it on the CPU. auto: on with CUDA.
    sync_batchnorm: Annotated[Any, AUTO_BOOL] = False
    # Recompute blocks' activations in the backward instead of keeping them (less memory, about one
    # more forward): none, full (every block) or every_k (every k-th block). For models that name
    # their blocks (model=gpt, transformers models); bit-equal losses.
    activation_checkpointing: Mode = "none"
    activation_checkpointing_every: Every = 2  # every_k's k


@dataclass
class ResolvedDDPSettings(DDPSettings):
    # DDP's settings once the launch has settled them (parallel/strategies/ddp.py): each switch
    # true or false.
    gradient_as_bucket_view: bool = True
    static_graph: bool = False
    shared_memory: bool = False
    sync_batchnorm: bool = False


@dataclass
class FSDPSettings(Section):
    # fsdp: FSDP2, parameters, gradients and optimizer state sharded over the ranks.
    name: Annotated[str, OneOf("fsdp")] = "fsdp"
    # HSDP (hybrid sharding: torchtitan's data_parallel_replicate_degree): the ranks as `replicate`
    # copies of the model, each sharded over world / replicate neighbouring ranks (a node's, with
    # one copy per node), the copies' gradients all-reduced. 1: every rank one shard of a single
    # copy.
    replicate: Annotated[int, AtLeast(1)] = 1
    # Free each unit's gathered parameters after its forward (less memory, one more all-gather in
    # the backward); false keeps them until the backward.
    reshard_after_forward: bool = True
    # FSDP2's mixed-precision policy (torchtitan's mixed_precision_param and _reduce). What each
    # unit's gathered parameters are cast to for the forward and backward: bf16, or null (as they
    # are: fp32). fp16 is refused: it needs loss scaling over the shards, which this strategy does
    # not do.
    param_dtype: Annotated[Optional[str], OneOf("bf16", "fp16", "fp32")] = None
    # What the gradients are reduced (reduce-scattered) in: fp32 (exact sums of bf16 gradients),
    # bf16 (half the traffic), or null (param_dtype's).
    reduce_dtype: Annotated[Optional[str], OneOf("bf16", "fp16", "fp32")] = None
    # What the model's output is cast to for the loss: fp32, or null (as the last unit computes it).
    output_dtype: Annotated[Optional[str], OneOf("bf16", "fp16", "fp32")] = None
    # Parameters and optimizer state kept on the CPU between uses (GPUs only).
    cpu_offload: bool = False
    # Recompute blocks' activations in the backward instead of keeping them (less memory, about one
    # more forward): none, full (every block) or every_k (every k-th block). For models that name
    # their blocks (model=gpt, transformers models); bit-equal losses.
    activation_checkpointing: Mode = "none"
    activation_checkpointing_every: Every = 2  # every_k's k


@dataclass
class TPSettings(Section):
    # tp: tensor parallel over all ranks.
    name: Annotated[str, OneOf("tp")] = "tp"


@dataclass
class FSDPTPSettings(FSDPSettings):
    # fsdp_tp: tensor parallel in groups of tp_size, FSDP across them.
    name: Annotated[str, OneOf("fsdp_tp")] = "fsdp_tp"
    # Ranks per tensor-parallel group (the world size divided by it: FSDP's dimension).
    tp_size: Annotated[int, AtLeast(1)] = 2


# a config that names no strategy (conf/config.yaml's default; a checkpoint from before strategies)
DEFAULT = "ddp"

# By the name `strategy=NAME` gives (parallel/strategies' REGISTRY holds the same names).
SETTINGS: dict[str, type[Section]] = {
    "ddp": DDPSettings,
    "fsdp": FSDPSettings,
    "tp": TPSettings,
    "fsdp_tp": FSDPTPSettings,
}


# Where the resolved settings differ from the requested ones (an `auto` settled).
RESOLVED: dict[str, type[Section]] = {"ddp": ResolvedDDPSettings}


def of(name: str) -> type[Section]:
    """The settings of strategy `name`; a name no strategy has is one line."""
    if name not in SETTINGS:
        raise UserError(
            f"strategy.name={name!r}: choose one of "
            f"{', '.join(SETTINGS)} (strategy=NAME, conf/strategy/)"
        )
    return SETTINGS[name]


def resolved_of(name: str) -> type[Section]:
    """The settings of strategy `name` as a resolved config holds them."""
    return RESOLVED.get(name) or of(name)
