"""Where the loop is: what a checkpoint needs to continue exactly."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


@dataclass
class Position:
    """Changed in place only: the loop's collaborators hold the same one."""

    epoch: int = 0
    batch: int = 0  # batches done in `epoch`
    step: int = 0  # optimizer steps done in all
    epoch_loss_sum: float = 0.0
    epoch_loss_count: int = 0

    def next_epoch(self) -> None:
        self.epoch, self.batch, self.epoch_loss_sum, self.epoch_loss_count = self.epoch + 1, 0, 0.0, 0

    def epoch_loss(self) -> float:
        """The mean global loss of the epoch's steps so far."""
        return self.epoch_loss_sum / max(1, self.epoch_loss_count)

    def state(self) -> dict[str, Any]:
        return asdict(self)

    def load(self, saved: dict[str, Any]) -> None:
        for key, value in asdict(Position(**saved)).items():
            setattr(self, key, value)
