"""The optimizer over the model's parameters, in weight-decay groups: param_groups.no_decay names
the parameters that get none (auto: biases, every norm layer's weights, embeddings, as nanoGPT's
configure_optimizers and timm's param_groups_weight_decay do; or name patterns). Names are the
model's own (as the model's config builds it), not a wrapper's: the same under DDP, FSDP and TP."""

from __future__ import annotations

import fnmatch
import logging
from collections.abc import Mapping
from typing import Any

import torch
from hydra.utils import instantiate
from torch import nn

log = logging.getLogger(__name__)

NONE, AUTO = "none", "auto"


def no_decay_names(module: nn.Module, no_decay: Any) -> list[str]:
    """The parameters (by name, in the model's order) that get no weight decay."""
    if no_decay in (None, NONE):
        return []
    if no_decay == AUTO:
        return [
            name for name, owner, param in _named(module) if param.ndim <= 1 or _is_embedding(owner)
        ]
    patterns = list(no_decay)
    return [
        name for name, _, _ in _named(module) if any(fnmatch.fnmatchcase(name, p) for p in patterns)
    ]


def unmatched(module: nn.Module, patterns: list[str]) -> list[str]:
    """The patterns that name none of the model's parameters (a misspelt name would silently
    decay)."""
    names = [name for name, _, _ in _named(module)]
    return [p for p in patterns if not any(fnmatch.fnmatchcase(name, p) for name in names)]


def _named(module: nn.Module) -> list[tuple[str, nn.Module, nn.Parameter]]:
    """(name, the module that owns it, parameter), each parameter once (a tied one by its first
    name)."""
    seen: set[int] = set()
    found = []
    for prefix, owner in module.named_modules():
        for local, param in owner.named_parameters(recurse=False):
            if id(param) in seen:
                continue
            seen.add(id(param))
            found.append((f"{prefix}.{local}" if prefix else local, owner, param))
    return found


def _is_embedding(owner: nn.Module) -> bool:
    return isinstance(owner, (nn.Embedding, nn.EmbeddingBag)) or type(owner).__name__.endswith(
        "Embedding"
    )


def _kind(param: torch.Tensor) -> Any:
    """A DTensor's mesh, or None for a plain tensor."""
    return getattr(param, "device_mesh", None)


def _by_kind(groups: list[dict]) -> list[dict]:
    """Each group split where it mixes plain tensors with DTensors, or DTensors of two meshes, as TP
    leaves a model (its parallel layers' parameters DTensors, the rest plain; under fsdp_tp, meshes
    of 2 and 1 dimensions): torch's foreach optimizer kernels, CUDA's default, refuse such a list.
    The same settings in each part, so the arithmetic per parameter is unchanged."""
    split = []
    for group in groups:
        kinds: dict[Any, list] = {}
        for param in group["params"]:
            kinds.setdefault(_kind(param), []).append(param)
        split += [{**group, "params": params} for params in kinds.values()]
    return split


def build(
    optim_cfg: Mapping[str, Any], no_decay: Any, module: nn.Module, wrapped: nn.Module
) -> torch.optim.Optimizer:
    """`module`: the model as its config built it (after the strategy spread it: FSDP's and TP's
    parameters are its own, sharded); `wrapped`: what the loop calls. Without groups, the
    optimizer takes the wrapped model's parameters, as it always has."""
    make = instantiate(optim_cfg)
    names = set(no_decay_names(module, no_decay))
    if no_decay in (None, NONE):
        # one group, as torch makes of a list
        return make(_by_kind([{"params": list(wrapped.parameters())}]))
    decayed, undecayed = [], []
    for name, _, param in _named(module):
        (undecayed if name in names else decayed).append(param)
    if not undecayed:
        log.warning(
            "param_groups.no_decay=%s names none of the model's parameters: all are decayed",
            no_decay,
        )
    groups = [{"params": decayed}, {"params": undecayed, "weight_decay": 0.0}]
    optimizer = make(_by_kind([group for group in groups if group["params"]]))
    decay = optimizer.defaults.get("weight_decay")
    log.info(
        "weight decay %s on %d tensors (%s parameters); none on "
        "%d tensors (%s parameters: param_groups.no_decay=%s)",
        decay,
        len(decayed),
        f"{sum(p.numel() for p in decayed):,}",
        len(undecayed),
        f"{sum(p.numel() for p in undecayed):,}",
        no_decay if isinstance(no_decay, str) else list(no_decay),
    )
    return optimizer
