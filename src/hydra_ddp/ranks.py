"""Who am I: the one place rank 0 is decided. No torch here: train.py asks before importing it."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping, Optional


@dataclass(frozen=True)
class RankInfo:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int

    @property
    def is_main(self) -> bool:
        """Rank 0 owns every side effect: console, files, TensorBoard, checkpoints."""
        return self.rank == 0


# Environment variables by which launchers tell a process who it is:
# (rank, world size, local rank, local world size).
_RANK_ENVS = (
    ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"),  # torchrun, torch.distributed.launch, submitit
    ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"),
    ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"),  # MPICH, Intel MPI
)


def _launcher_name(env: Mapping[str, str]) -> str:
    if "SUBMITIT_EXECUTOR" in env:
        return f"submitit ({env['SUBMITIT_EXECUTOR']})"
    if "OMPI_COMM_WORLD_RANK" in env or "PMI_RANK" in env:
        return "mpirun"
    return "torchrun"


def external_launch(env: Mapping[str, str] = os.environ) -> Optional[tuple[str, RankInfo]]:
    """(launcher name, rank) when this process was started as a worker by an outside launcher."""
    for rank, world, local, local_world in _RANK_ENVS:
        if rank in env and world in env:
            world_size = int(env[world])
            return _launcher_name(env), RankInfo(
                rank=int(env[rank]),
                world_size=world_size,
                local_rank=int(env.get(local, env[rank])),
                local_world_size=int(env.get(local_world, world_size)),
            )
    return None
