"""Fast settings by default: what `auto` means for trainer.channels_last and DDP's knobs.

Each is chosen per model and device from measurements (bench/results/REPORT.md, the options
section), and only where it changes no result beyond float tolerance; anything that does (bf16,
fp16, compile backends) stays opt-in. Every one can be set to true or false instead, and the
summary names the values the run used.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

from hydra_ddp.errors import UserError
from hydra_ddp.parallel import shared_memory

AUTO = "auto"
# (config section, key): the settings `auto` applies to.
SETTINGS = (
    ("trainer", "channels_last"),
    ("strategy", "gradient_as_bucket_view"),
    ("strategy", "static_graph"),
    ("strategy", "shared_memory"),
)


def choose(
    plain: dict[str, Any], has_conv2d: Optional[bool], world_size: int, local_world_size: int
) -> dict[str, bool]:
    """The value of each setting for this run: the configured one, or what `auto` picks here. Run
    once, on the launch side, on the resolved config (device and backend settled). `has_conv2d`
    None: the model could not be built before launch, and channels_last's auto is left to the
    workers (settings()).

    - channels_last, for models with 2-D convolutions: their kernels run faster on NHWC memory
      (bench/results/REPORT.md); the sums change order, within float tolerance. Other models gain
      nothing from it.
    - gradient_as_bucket_view: gradients live in DDP's all-reduce buckets, not copied in and out
      of them; bit-identical results, less memory.
    - static_graph: DDP records the order gradients become ready in the first step and buckets by
      it; bit-identical results (each gradient is still summed over the same ranks). Off with
      gradient accumulation (DDP's reducer asserts on a no_sync step in a static graph), uneven
      shards (Join stands in for ranks that ran out) and torch.compile (not tested with it).
    - shared_memory: the gradient all-reduce through a shared segment instead of gloo's loopback
      TCP, where every rank is a CPU process on this host (shared_memory.py; bench/results/REPORT.md);
      bit-identical at 2 ranks, the sums in another order (within float tolerance) at more. Not with
      a comm hook (it is one), uneven shards (Join's shadow all-reduces bypass hooks) or torch.compile.
      Whether the segment can be made is the workers' to find: where it cannot, an `auto` falls back.
    """
    ddp, trainer = plain["strategy"]["name"] == "ddp", plain["trainer"]
    blockers = config_blockers(plain) + shared_memory.unavailable(
        plain["backend"]["name"], trainer["device"], world_size, local_world_size
    )
    auto = {
        # FSDP shards contiguous parameters only: channels_last weights are not.
        "trainer.channels_last": ddp and has_conv2d if has_conv2d is not None else None,
        "strategy.gradient_as_bucket_view": True,
        "strategy.static_graph": trainer["accumulate"] == 1 and plain["data"]["even_shards"] and not trainer["compile"],
        "strategy.shared_memory": not blockers and world_size > 1,  # one rank: nothing to all-reduce
    }
    chosen = {}
    for section, key in SETTINGS:
        if section == "strategy" and not ddp:
            continue  # DDP's own: not used by another strategy
        value = plain[section][key]
        if value == AUTO and auto[f"{section}.{key}"] is None:
            continue  # the workers' to settle, from the model they build
        chosen[f"{section}.{key}"] = auto[f"{section}.{key}"] if value == AUTO else bool(value)
    if plain["strategy"]["shared_memory"] is True and ddp and world_size > 1 and blockers:
        raise UserError(
            f"strategy.shared_memory=true does not combine with {'; '.join(blockers)}; "
            "set strategy.shared_memory=auto or false"
        )
    if chosen.get("strategy.shared_memory") and world_size < 2:
        chosen["strategy.shared_memory"] = False
    return chosen


def needs_model(plain: dict[str, Any]) -> bool:
    """Whether choose() needs to know the model (channels_last's auto, under DDP)."""
    return plain["trainer"]["channels_last"] == AUTO and plain["strategy"]["name"] == "ddp"


def has_conv2d(model: nn.Module) -> bool:
    return any(isinstance(m, nn.Conv2d) for m in model.modules())


def settings(cfg: Any, model: nn.Module) -> dict[str, bool]:
    """The run's values of SETTINGS (DDP's only under DDP), as the summary names them: settled on
    the launch side, but channels_last for a model that could only be built in the workers."""
    ddp = cfg["strategy"]["name"] == "ddp"
    values = {f"{section}.{key}": cfg[section][key] for section, key in SETTINGS if section != "strategy" or ddp}
    if values["trainer.channels_last"] == AUTO:
        values["trainer.channels_last"] = ddp and has_conv2d(model)
    return {name: bool(value) for name, value in values.items()}


def record(config: dict[str, Any], values: dict[str, bool]) -> dict[str, Any]:
    """`config` (a plain copy, for a checkpoint) with the values the run used: what eval.py and a
    resumed run read back."""
    for name, value in values.items():
        section, key = name.split(".")
        config[section][key] = value
    return config


def memory_format(channels_last: bool) -> torch.memory_format:
    """The memory format inputs and weights take: trainer.channels_last, settled."""
    return torch.channels_last if channels_last else torch.preserve_format


def config_blockers(cfg: Any) -> list[str]:
    """The settings that rule the shared-memory all-reduce out (a plain dict or the config)."""
    reasons = []
    if cfg["strategy"]["name"] != "ddp":
        reasons.append(f"strategy={cfg['strategy']['name']} (it serves DDP)")
    if cfg["strategy"]["comm_hook"] != "none":
        reasons.append(f"strategy.comm_hook={cfg['strategy']['comm_hook']} is a hook of its own")
    if not cfg["data"]["even_shards"]:
        reasons.append("data.even_shards=false (Join's shadow all-reduces bypass hooks)")
    if cfg["trainer"]["compile"]:
        reasons.append("trainer.compile=true")
    return reasons
