"""Test-only models that fail in chosen ranks, to exercise failure reporting through real launchers."""

import torch.distributed as dist

from hydra_ddp.models import MnistCNN


class FailOnRank(MnistCNN):
    def __init__(self, fail_rank: int = 1, **kwargs):
        super().__init__(**kwargs)
        if dist.get_rank() == fail_rank:
            raise RuntimeError(f"injected failure in rank {fail_rank}")
