"""torch.compile (trainer.compile): the model's blocks one by one, or the whole model.

`blocks` (what `true` means for a model that names its blocks: the GPT's `shard_units()`, a
transformers model's decoder layers) compiles each block's forward, regional compilation as
torchtitan and Accelerate do it: blocks of one structure share one compiled graph, the module stays
itself (its parameter names, so checkpoints, FSDP's units and the optimizer's groups are unchanged),
and its hooks stay outside the graph (DDP's and FSDP's, activation checkpointing's wrapper inside
it). So it composes with every strategy, with activation checkpointing, and with the shared-memory
all-reduce, which the whole model's compile rules out. `model` (what `true` means for a model
without blocks, the CNN) compiles the DDP model whole, as before.

Inductor's caches (compiled kernels, the FX graphs) go into the run directory's `compile_cache/`,
where TORCHINDUCTOR_CACHE_DIR does not say otherwise: a host's ranks share them, and a resumed run
finds them (its first step is the shorter for it: docs/performance.md).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Optional

from torch import nn

from hydra_ddp.config.schema import TrainerConf
from hydra_ddp.errors import UserError
from hydra_ddp.recipe import activation_checkpointing

CACHE = "compile_cache"


def mode(setting: Any, model: Optional[nn.Module]) -> Any:
    """trainer.compile settled: false, "blocks" or "model". `true` is blocks where `model` (built on
    the meta device; None where it did not build before launch) names them, else the whole model."""
    if setting is not True:
        return setting
    return "blocks" if model is not None and activation_checkpointing.blocks(model) else "model"


def check(setting: Any, model: Optional[nn.Module], target: str) -> None:
    """trainer.compile=blocks needs a model that names its blocks."""
    if setting == "blocks" and model is not None and not activation_checkpointing.blocks(model):
        raise UserError(
            "trainer.compile=blocks compiles the model's blocks (a shard_units() method, as "
            f"model=gpt has, or a transformers model's _no_split_modules); {target} names "
            "none: use trainer.compile=model (the whole model, under strategy=ddp) or true"
        )


def dynamic(dataset: Any) -> Optional[bool]:
    """torch.compile's `dynamic` for the blocks of a model trained on `dataset`: None (dynamo's own
    choice: a shape that changes is compiled once more as a dynamic one) where batches are padded
    per batch, their lengths varying; else False. Fixed-shape batches vary in one place, the epoch's
    last batch: under automatic dynamic shapes its other size would recompile every block as a
    dynamic graph, which then runs the full batches too, slower than eager on this CPU (the
    transformers experiment: bench/compile.py); static, it is one more graph of its own."""
    return None if getattr(getattr(dataset, "collate", None), "pads_per_batch", False) else False


def compile_blocks(module: nn.Module, trainer: TrainerConf, dynamic: Optional[bool] = False) -> int:
    """Compile each of the model's blocks in place, where trainer.compile=blocks; how many. Called
    by the strategies after activation checkpointing and before DDP or FSDP wrap the model."""
    if trainer.compile != "blocks":
        return 0
    found = activation_checkpointing.blocks(module)
    if not found:  # refused before launch (check); a model that changed since is the same line
        check("blocks", module, type(module).__name__)
    import torch
    import torch._dynamo

    # a graph that fails to compile runs eagerly (a warning)
    torch._dynamo.config.suppress_errors = True
    for block in found:
        # The forward, not the module: its hooks (DDP's, FSDP's) stay eager, its name and class its
        # own. An instance attribute, over activation checkpointing's where it is one (its wrapper
        # is traced).
        block.forward = torch.compile(
            block.forward, backend=trainer.compile_backend, dynamic=dynamic
        )
    return len(found)


def use_run_cache(run_dir: Path) -> None:
    """Inductor's caches in the run directory, unless TORCHINDUCTOR_CACHE_DIR names a place of its
    own. (Importing torch's inductor sets the variable to its default, /tmp/torchinductor_<user>:
    that value is taken as unset.)"""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    named = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if named is None or os.path.abspath(named) == os.path.abspath(default_cache_dir()):
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(Path(run_dir).resolve() / CACHE)
