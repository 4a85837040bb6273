"""Test-only models that fail in chosen ranks, to exercise failure reporting through real launchers."""

import threading

import torch.distributed as dist

from hydra_ddp.models import MnistCNN


class FailOnRank(MnistCNN):
    def __init__(self, fail_rank: int = 1, **kwargs):
        super().__init__(**kwargs)
        if dist.get_rank() == fail_rank:
            raise RuntimeError(f"injected failure in rank {fail_rank}")


class HangOnRank(MnistCNN):
    """Stops making progress in one rank after a few steps (as a deadlocked or stalled process would)."""

    def __init__(self, hang_rank: int = 1, after_steps: int = 3, **kwargs):
        super().__init__(**kwargs)
        self.hang_rank, self.after_steps, self.calls = hang_rank, after_steps, 0

    def forward(self, x):
        self.calls += 1
        if self.training and self.calls > self.after_steps and dist.get_rank() == self.hang_rank:
            threading.Event().wait()  # forever: only the collective timeout can end this run
        return super().forward(x)
