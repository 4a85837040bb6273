"""The loss window: per-step training losses made global with one all-reduce per window, which
also carries every rank's stop flags."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.distributed as dist


@dataclass
class LossWindow:
    """Per-step training losses made global (averaged over ranks) with one all-reduce per window.

    A collective every step would stall the loop; one every `size` steps costs little, and less
    when it overlaps the next step (start, then collect a step later: the loop does not wait for
    the round trip). The same all-reduce carries the stop flags (a signal; the time budget
    spent), so every rank stops at the same step. Losses travel in
    fixed slots (one per step since the last flush, with a count of the ranks that ran it), so
    every rank sends the same number of values even when some ran out of batches a step earlier
    (uneven shards); a rank learns the global last step from the counts.
    """

    size: int
    # the step in the first slot: the one after the last flush (the same on every rank)
    first: int = 1
    steps: list[int] = field(default_factory=list)
    losses: list[torch.Tensor] = field(default_factory=list)
    # a started all-reduce (its work, its tensor), not yet read
    pending: Optional[tuple[Any, torch.Tensor]] = None

    def add(self, step: int, loss: torch.Tensor) -> bool:
        self.steps.append(step)
        self.losses.append(loss.detach())
        return len(self.steps) >= self.size

    def flush(
        self, stop: bool, device: torch.device, out_of_time: bool = False
    ) -> tuple[list[int], list[float], bool, bool]:
        """(steps, global losses, whether any rank wants to stop, whether any rank's time is up).
        Every rank calls it at the same points."""
        self.start(stop, device, out_of_time)
        return self.collect()

    def start(self, stop: bool, device: torch.device, out_of_time: bool = False) -> None:
        """Send the window's losses and this rank's flags; collect() reads the result. Every rank
        calls it at the same points, with none pending."""
        if self.pending is not None:
            raise RuntimeError(
                "loss window: start() while an all-reduce is pending; collect() it first"
            )
        slots = self.size + 1  # uneven shards: one step more than a window, at an epoch's end
        if len(self.steps) > slots:
            raise RuntimeError(
                f"loss window holds {len(self.steps)} steps, more than its {slots} slots"
            )
        packed = torch.zeros(2 * slots + 2, dtype=torch.float64, device=device)
        if self.steps:
            where = torch.tensor([s - self.first for s in self.steps], device=device)
            packed[where] = torch.stack(self.losses).double()
            packed[slots + where] = 1.0
        packed[-2] = 1.0 if stop else 0.0
        packed[-1] = 1.0 if out_of_time else 0.0
        self.pending = (dist.all_reduce(packed, async_op=True), packed)
        self.steps, self.losses = [], []

    def collect(self) -> tuple[list[int], list[float], bool, bool]:
        """The started all-reduce's result, as flush() returns it (waiting for it if need be)."""
        if self.pending is None:
            raise RuntimeError("loss window: collect() with no all-reduce started")
        work, packed = self.pending
        self.pending = None
        work.wait()
        slots = self.size + 1
        sums, counts = packed[:slots].tolist(), packed[slots:-2].tolist()
        done = [i for i, count in enumerate(counts) if count]
        steps = [self.first + i for i in done]
        values = [sums[i] / counts[i] for i in done]
        self.first = steps[-1] + 1 if steps else self.first
        stop_flag, time_flag = packed[-2:].tolist()
        return steps, values, bool(stop_flag), bool(time_flag)
