"""Each strategy's rules, decided from the config alone (before launch, no process group): what it
is made of, how many model replicas it makes, and what it refuses.

- ddp: a whole replica on every rank; DDP all-reduces the gradients (its knobs: strategy.*, conf/strategy/ddp.yaml).
- fsdp: FSDP2 (`fully_shard`): parameters, gradients and optimizer state sharded over the ranks.
- tp: tensor parallel over all ranks with the model's plan (`tp_plan`); one model replica.
- fsdp_tp: a 2-D mesh [dp, tp], tensor parallel inside groups of `tp_size`, FSDP across them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hydra_ddp.errors import UserError, first_line, root_cause


@dataclass(frozen=True)
class Plan:
    """What a strategy is made of: DDP's replicas, FSDP's shards, tensor parallel, or shards of
    tensor-parallel groups."""

    name: str
    replicate: bool = False  # DDP: a whole replica per rank
    shard: bool = False  # FSDP over the data-parallel ranks
    tensor_parallel: bool = False  # the model's tp_plan over groups of tp_size ranks

    def tp_size(self, settings: dict[str, Any], world: int) -> int:
        """Ranks per tensor-parallel group (1: none)."""
        if not self.tensor_parallel:
            return 1
        return int(settings["tp_size"]) if self.shard else world

    def replicas(self, settings: dict[str, Any], world: int) -> int:
        """Model replicas, each reading its own batches: every rank, but for tensor parallel's groups."""
        size = self.tp_size(settings, world)
        if size < 1 or world % size:
            raise UserError(
                f"strategy.tp_size={size} does not divide the world size {world}: "
                f"choose a divisor of {world} (the mesh is world ÷ tp_size by tp_size)"
            )
        return world // size

    def refusals(self, plain: dict[str, Any]) -> list[tuple[bool, str]]:
        """(refused, why) for what this strategy cannot do with these settings."""
        settings, trainer = plain["strategy"], plain["trainer"]
        if self.replicate:
            return []
        name = self.name
        return [
            (
                settings["comm_hook"] != "none",
                f"strategy.comm_hook={settings['comm_hook']} is DDP's: FSDP reduce-scatters its own "
                "gradients; leave it none",
            ),
            (
                not plain["data"]["even_shards"],
                "data.even_shards=false needs DDP's Join, which FSDP does not support; keep data.even_shards=true",
            ),
            (trainer["compile"], f"trainer.compile=true is not supported with strategy={name} yet; leave it false"),
            (
                trainer["channels_last"] is True,
                "trainer.channels_last=true makes convolution weights non-contiguous, "
                "which FSDP cannot shard; leave it auto or false",
            ),
            (settings["sync_batchnorm"] is True, "strategy.sync_batchnorm=true is DDP's; leave it auto or false"),
            (
                str(trainer["precision"]) == "16",
                f"trainer.precision=16 (a GradScaler) is not supported with "
                f"strategy={name}; use strategy.mixed_precision=bf16 or "
                "trainer.precision=bf16",
            ),
            (
                self.tensor_parallel and bool(settings["mixed_precision"] or settings["cpu_offload"]),
                "strategy.mixed_precision and strategy.cpu_offload are not supported with tensor parallel yet; "
                "leave them null and false",
            ),
            (
                settings["cpu_offload"] and trainer["device"] != "cuda",
                "strategy.cpu_offload=true keeps parameters on the CPU between uses on GPUs; on the CPU it has "
                "nothing to offload: leave it false",
            ),
            (
                settings["mixed_precision"] == "fp16",
                "strategy.mixed_precision=fp16 would need loss scaling over the "
                "shards, which FSDP2 here does not do (small gradients would "
                "underflow silently); use bf16: fp32's range, no scaler",
            ),
        ]

    def sync_batchnorm(self, setting: Any, device: str) -> Any:
        """strategy.sync_batchnorm's `auto`: on with CUDA under DDP (the only strategy it serves)."""
        return device == "cuda" and self.replicate if setting == "auto" else setting


PLANS = {
    plan.name: plan
    for plan in (
        Plan("ddp", replicate=True),
        Plan("fsdp", shard=True),
        Plan("tp", tensor_parallel=True),
        Plan("fsdp_tp", shard=True, tensor_parallel=True),
    )
}


def plan(name: str) -> Plan:
    if name not in PLANS:
        raise UserError(f"unknown strategy {name!r}; choose {', '.join(PLANS)} (conf/strategy/)")
    return PLANS[name]


def check(plain: dict[str, Any]) -> None:
    """What the chosen strategy cannot do, found before launch (the tensor-parallel plan, which needs
    the model, is checked by check_tp_plan)."""
    settings = plain["strategy"]
    chosen = plan(settings["name"])
    if chosen.tensor_parallel:
        check_tp_plan(plain, chosen)
    for refused, why in chosen.refusals(plain):
        if refused:
            raise UserError(f"strategy={chosen.name}: {why}")


def check_tp_plan(plain: dict[str, Any], chosen: Plan) -> None:
    """Tensor parallel needs the model's plan, and a world size it splits over (built on the meta device)."""
    import torch
    from hydra.utils import instantiate

    world = plain["trainer"]["nproc"] * plain["launcher"]["nnodes"]
    size = world // chosen.replicas(plain["strategy"], world)  # ranks per tensor-parallel group
    try:
        with torch.device("meta"):
            model = instantiate(plain["model"])
    except Exception as error:  # noqa: BLE001  (the model's own complaint: a shape it cannot take, say)
        raise UserError(
            f"strategy={chosen.name}: {plain['model']['_target_']} does not build: {first_line(root_cause(error))}"
        ) from None
    try:
        tp_plan = getattr(model, "tp_plan", None)
        if tp_plan is None:
            raise UserError(
                f"strategy={chosen.name} needs a model with a tensor-parallel plan (a tp_plan method, as "
                f"model=gpt has); {plain['model']['_target_']} has none: use strategy=ddp or fsdp"
            )
        tp_plan(size)
    except ValueError as e:
        raise UserError(f"strategy={chosen.name}: {e}") from None
