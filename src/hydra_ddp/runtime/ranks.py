"""Who am I: the one place rank 0 is decided. No torch here: train.py asks before importing it,
and nothing that delays the forkserver it starts next (not even dataclasses or typing)."""

from __future__ import annotations

import os
from collections import namedtuple
from collections.abc import Mapping

# Kubernetes: the kubelet sets this in every container; the Trainer's controllers set PET_NNODES
# (torchrun's settings) in a pod whose train.py starts the node's workers (clusters/kubernetes.py).
IN_POD = "KUBERNETES_SERVICE_HOST"
PET_NNODES = "PET_NNODES"


def in_pod(env: Mapping[str, str]) -> bool:
    return IN_POD in env


def launches_workers(env: Mapping[str, str]) -> bool:
    """`python train.py` in a pod that PET_* describe, with no torchrun in between: it starts this
    node's workers itself (under torchrun, TORCHELASTIC_RUN_ID: it is one of torchrun's workers)."""
    return PET_NNODES in env and "TORCHELASTIC_RUN_ID" not in env


class RankInfo(namedtuple("RankInfo", ["rank", "world_size", "local_rank", "local_world_size"])):
    """This process among the workers (immutable): its rank and local rank, and how many there
    are."""

    __slots__ = ()

    @property
    def is_main(self) -> bool:
        """Rank 0 owns every side effect: console, files, TensorBoard, checkpoints."""
        return self.rank == 0


# Environment variables by which launchers tell a process who it is:
# (rank, world size, local rank, local world size).
_RANK_ENVS = (
    # torchrun, torch.distributed.launch, submitit, srun
    ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"),
    (
        "OMPI_COMM_WORLD_RANK",
        "OMPI_COMM_WORLD_SIZE",
        "OMPI_COMM_WORLD_LOCAL_RANK",
        "OMPI_COMM_WORLD_LOCAL_SIZE",
    ),
    ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"),  # MPICH, Intel MPI
)
# a pod's one worker, RANK and WORLD_SIZE from its controller
ONE_PER_POD = "kubernetes (PyTorchJob)"


def _launcher_name(env: Mapping[str, str]) -> str:
    if "SUBMITIT_EXECUTOR" in env:
        return f"submitit ({env['SUBMITIT_EXECUTOR']})"
    if "OMPI_COMM_WORLD_RANK" in env or "PMI_RANK" in env:
        return "mpirun"
    # srun's tasks, not torchrun's under srun
    if "SLURM_STEP_ID" in env and "TORCHELASTIC_RUN_ID" not in env:
        return "srun"
    if in_pod(env) and "TORCHELASTIC_RUN_ID" not in env:  # RANK and WORLD_SIZE the pod's, no PET_*
        return ONE_PER_POD
    return "torchrun"


def external_launch(env: Mapping[str, str] = os.environ) -> tuple[str, RankInfo] | None:
    """(launcher name, rank) when this process was started as a worker by an outside launcher."""
    if launches_workers(env):
        # `python train.py` in a pod with PET_*: it launches the pod's workers (RANK counts pods)
        return None
    if "RANK" not in env and srun_task(env):
        env = {**env, **srun_environment(env)}
    for rank, world, local, local_world in _RANK_ENVS:
        if rank in env and world in env:
            world_size, name = int(env[world]), _launcher_name(env)
            # without local ranks: local rank 0 of 1; elsewhere one node of all
            alone = name == ONE_PER_POD
            return name, RankInfo(
                rank=int(env[rank]),
                world_size=world_size,
                local_rank=int(env.get(local, 0 if alone else env[rank])),
                local_world_size=int(env.get(local_world, 1 if alone else world_size)),
            )
    return None


def srun_task(env: Mapping[str, str]) -> bool:
    """One of several tasks of an srun step (not submitit's: it says so itself)."""
    return (
        "SLURM_STEP_ID" in env
        and "SUBMITIT_EXECUTOR" not in env
        and int(env.get("SLURM_STEP_NUM_TASKS", "1")) > 1
    )


def srun_environment(env: Mapping[str, str]) -> dict[str, str]:
    """One of several tasks of an srun step (`srun python train.py`): the rank is the task's,
    the master the step's first node, its port from the job id unless MASTER_PORT is set (a task
    alone in its step is not adopted: train.py then launches its workers itself)."""
    # only here: runtime/ranks.py imports nothing heavy
    from submitit.slurm.slurm import _parse_node_list

    hosts = _parse_node_list(env["SLURM_STEP_NODELIST"])
    node = (
        hosts.index(env["SLURMD_NODENAME"])
        if env.get("SLURMD_NODENAME") in hosts
        else int(env["SLURM_NODEID"])
    )
    per_node = [
        int(n)
        for group in env["SLURM_STEP_TASKS_PER_NODE"].split(",")  # "2(x3),1": 2, 2, 2, 1
        for n in [group.split("(")[0]]
        * (int(group.split("(x")[1].rstrip(")")) if "(x" in group else 1)
    ]
    return {
        "RANK": env["SLURM_PROCID"],
        "WORLD_SIZE": env["SLURM_STEP_NUM_TASKS"],
        "LOCAL_RANK": env["SLURM_LOCALID"],
        "LOCAL_WORLD_SIZE": str(per_node[node]),
        "MASTER_ADDR": env.get("MASTER_ADDR") or hosts[0],
        "MASTER_PORT": env.get("MASTER_PORT") or str(20000 + int(env["SLURM_JOB_ID"]) % 20000),
    }
