"""A step that clips each rank's gradients by that rank's own norm: the bug of clipping by a local
norm under sharding (pytorch #149768, #170862), for tests/e2e/test_strategy.py to show that its
comparison catches it."""

import torch

from hydra_ddp.training.step import Step


class LocalNormClip(Step):
    def __init__(self, *parts, max_norm: float):
        super().__init__(*parts)
        self.max_norm = max_norm

    def update(self):
        # each rank's shards alone: FSDP's DTensor gradients as this rank holds them
        local = [
            p.grad._local_tensor if hasattr(p.grad, "_local_tensor") else p.grad
            for p in self.model.parameters()
            if p.grad is not None
        ]
        norm = torch.sqrt(sum(g.double().pow(2).sum() for g in local))
        scale = (self.max_norm / (norm + 1e-6)).clamp(max=1.0).item()
        for g in local:
            g.mul_(scale)
        super().update()
