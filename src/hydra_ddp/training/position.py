"""Where the loop is: what a checkpoint needs to continue exactly."""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from typing import Any, Optional


@dataclass
class Position:
    """Changed in place only: the loop's collaborators hold the same one."""

    epoch: int = 0
    batch: int = 0  # batches done in `epoch`
    step: int = 0  # optimizer steps done in all
    epoch_loss_sum: float = 0.0
    epoch_loss_count: int = 0
    # The world sizes the run has trained at: {"step", "world_size", "cause"} from its start, and
    # {"step", "from", "world_size", "cause"} for each resume at another size.
    world_sizes: list[dict[str, Any]] = field(default_factory=list)

    def next_epoch(self) -> None:
        self.epoch, self.batch, self.epoch_loss_sum, self.epoch_loss_count = (
            self.epoch + 1,
            0,
            0.0,
            0,
        )

    def epoch_loss(self) -> float:
        """The mean global loss of the epoch's steps so far."""
        return self.epoch_loss_sum / max(1, self.epoch_loss_count)

    def regroup(self, saved_accumulation: int, accumulation: int) -> None:
        """After load(): mid-epoch the position counts this rank's micro-batches, always whole
        optimizer steps: at another accumulation (a resize keeps the global batch), the same steps
        are as many more or fewer."""
        self.batch = self.batch // saved_accumulation * accumulation

    def started(self, world_size: int) -> None:
        self.world_sizes = [{"step": 0, "world_size": world_size, "cause": "start"}]

    def continued_at(
        self, world_size: int, saved_ranks: int, cause: str
    ) -> Optional[dict[str, Any]]:
        """After load(): the run continues at `world_size` from a checkpoint that `saved_ranks`
        wrote (`cause`: resize_cause's). A new world size is recorded, and returned."""
        if not self.world_sizes:  # a checkpoint from before the history was kept
            self.world_sizes = [{"step": 0, "world_size": saved_ranks, "cause": "start"}]
        before = self.world_sizes[-1]["world_size"]
        if before == world_size:
            return None
        entry = {"step": self.step, "from": before, "world_size": world_size, "cause": cause}
        self.world_sizes.append(entry)
        return entry

    def state(self) -> dict[str, Any]:
        return asdict(self)

    def load(self, saved: dict[str, Any]) -> None:
        for key, value in asdict(Position(**saved)).items():
            setattr(self, key, value)


def resize_cause(elastic: bool, env: Any = os.environ) -> str:
    """Why a run continues from a checkpoint: torchrun restarted a failed group ("restart": a node
    lost), an elastic group re-formed with the nodes present ("rescale": a node joined), Slurm
    requeued the job ("requeue"), or the user resumed it ("resume")."""
    if int(env.get("TORCHELASTIC_RESTART_COUNT", "0") or 0) > 0:
        return "restart"
    if int(env.get("SLURM_RESTART_COUNT", "0") or 0) > 0:
        return "requeue"
    # a scale-up re-forms the group without spending a restart
    if elastic and "TORCHELASTIC_RUN_ID" in env:
        return "rescale"
    return "resume"
