"""Fast settings by default: what `auto` means for trainer.channels_last and DDP's knobs.

Each is chosen per model and device from measurements (bench/results/REPORT.md, the options
section), and only where it changes no result beyond float tolerance; anything that does (bf16,
fp16, compile backends) stays opt-in. Every one can be set to true or false instead, and the
summary names the values the run used.
"""

from __future__ import annotations

from typing import Any

from torch import nn

AUTO = "auto"
# (config section, key): the settings `auto` applies to.
SETTINGS = (("trainer", "channels_last"), ("ddp", "gradient_as_bucket_view"), ("ddp", "static_graph"))


def choose(cfg: Any, model: nn.Module) -> dict[str, bool]:
    """The value of each setting for this run: the configured one, or what `auto` picks here.

    - channels_last, for models with 2-D convolutions: their kernels run faster on NHWC memory
      (1.25–1.31× samples/s for the CNN on the CPU, measured); the sums change order, within
      float tolerance. Other models gain nothing from it.
    - gradient_as_bucket_view: gradients live in DDP's all-reduce buckets, not copied in and out
      of them; bit-identical results, less memory.
    - static_graph: DDP records the order gradients become ready in the first step and buckets by
      it; bit-identical results (each gradient is still summed over the same ranks). Off with
      gradient accumulation (DDP's reducer asserts on a no_sync step in a static graph), uneven
      shards (Join stands in for ranks that ran out) and torch.compile (not tested with it).
    """
    auto = {
        # FSDP shards contiguous parameters only: channels_last weights are not.
        "trainer.channels_last": cfg.strategy.name == "ddp" and any(isinstance(m, nn.Conv2d) for m in model.modules()),
        "ddp.gradient_as_bucket_view": True,
        "ddp.static_graph": cfg.trainer.accumulate == 1 and cfg.data.even_shards and not cfg.trainer.compile,
    }
    chosen = {}
    for section, key in SETTINGS:
        if section == "ddp" and cfg.strategy.name != "ddp":
            continue  # DDP's own: not used by another strategy
        value = cfg[section][key]
        chosen[f"{section}.{key}"] = auto[f"{section}.{key}"] if value == AUTO else bool(value)
    return chosen


def check(plain: dict[str, Any]) -> list[str]:
    """The settings whose value is neither true, false nor auto (for validate.check)."""
    return [f"{section}.{key}={plain[section][key]!r}" for section, key in SETTINGS
            if plain[section][key] not in (True, False, AUTO)]
