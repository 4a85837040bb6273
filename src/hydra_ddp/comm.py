"""DDP's gradient communication hooks as a config choice (`ddp.comm_hook`).

- none: DDP's own all-reduce of fp32 gradients.
- fp16 / bf16: gradients cast to 16 bits for the all-reduce, and back: half the bytes on the
  wire, and the sums lose precision (bf16 keeps fp32's range, fp16 three more digits). Neither
  keeps state between steps, so resume stays exact.

They pay off where the network is the bottleneck (many nodes, slow links); on one machine,
where the all-reduce is a memory copy, the casts can cost more than they save (bench/).

PowerSGD is not offered yet: its state is laid out by DDP's buckets, which DDP lays out anew
after its first step (so a resumed run's first step would read another layout than the
checkpoint's), and on gloo its overlapping all-reduces of two buckets arrived out of order on
the other rank (a collective mismatch, measured with torch 2.14).
"""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

HOOKS = ("none", "fp16", "bf16")


def register(model: nn.parallel.DistributedDataParallel, name: str) -> None:
    """Register the configured hook on the DDP model, before its first step."""
    if name != "none":
        model.register_comm_hook(None, getattr(default_hooks, f"{name}_compress_hook"))


def bytes_per_step(model: nn.Module, name: str) -> int:
    """Gradient bytes each rank all-reduces per step."""
    per_element = 2 if name in ("fp16", "bf16") else None
    return sum((per_element or p.element_size()) * p.numel() for p in model.parameters() if p.requires_grad)
