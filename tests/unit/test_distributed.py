"""Rank discovery from launcher environments, ports, and the rendezvous store, in this process (the
process group with real gloo ranks: tests/e2e/test_distributed.py)."""

from __future__ import annotations

import socket
from datetime import timedelta

import pytest

from hydra_ddp.errors import UserError
from hydra_ddp.parallel import distributed
from hydra_ddp.runtime import ranks
from hydra_ddp.runtime.ranks import RankInfo

SRUN = {
    "SLURM_STEP_ID": "0",
    "SLURM_STEP_NUM_TASKS": "5",
    "SLURM_STEP_TASKS_PER_NODE": "2(x2),1",
    "SLURM_STEP_NODELIST": "n[1-3]",
    "SLURM_JOB_ID": "4321",
}


def test_srun_tasks_meet_at_the_steps_first_node():
    env = ranks.srun_environment(
        {
            **SRUN,
            "SLURM_PROCID": "2",
            "SLURM_LOCALID": "0",
            "SLURMD_NODENAME": "n2",
            "SLURM_NODEID": "1",
        }
    )
    assert (env["MASTER_ADDR"], env["MASTER_PORT"]) == ("n1", str(20000 + 4321))
    assert (
        ranks.srun_environment(
            {
                **SRUN,
                "SLURM_PROCID": "0",
                "SLURM_LOCALID": "0",
                "SLURM_NODEID": "0",
                "MASTER_PORT": "29500",
            }
        )["MASTER_PORT"]
        == "29500"
    )


@pytest.mark.parametrize(
    "env, expected",
    [
        ({}, None),
        (
            {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"},
            ("torchrun", RankInfo(3, 4, 1, 2)),
        ),
        (
            {
                "OMPI_COMM_WORLD_RANK": "1",
                "OMPI_COMM_WORLD_SIZE": "2",
                "OMPI_COMM_WORLD_LOCAL_RANK": "1",
                "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
            },
            ("mpirun", RankInfo(1, 2, 1, 2)),
        ),
        ({"PMI_RANK": "0", "PMI_SIZE": "2"}, ("mpirun", RankInfo(0, 2, 0, 2))),
        (
            {"RANK": "1", "WORLD_SIZE": "2", "SUBMITIT_EXECUTOR": "slurm"},
            ("submitit (slurm)", RankInfo(1, 2, 1, 2)),
        ),
        # srun's tasks: 2 on each of n1 and n2, then 1 on n3; this one is the second on n2.
        (
            {
                **SRUN,
                "SLURM_PROCID": "3",
                "SLURM_LOCALID": "1",
                "SLURMD_NODENAME": "n2",
                "SLURM_NODEID": "1",
            },
            ("srun", RankInfo(3, 5, 1, 2)),
        ),
        (
            {
                **SRUN,
                "SLURM_PROCID": "4",
                "SLURM_LOCALID": "0",
                "SLURMD_NODENAME": "n3",
                "SLURM_NODEID": "2",
            },
            ("srun", RankInfo(4, 5, 0, 1)),
        ),
        # alone: train.py launches its workers
        ({**SRUN, "SLURM_STEP_NUM_TASKS": "1", "SLURM_PROCID": "0"}, None),
        # the batch script itself, not a step's task
        ({"SLURM_PROCID": "0", "SLURM_NTASKS": "2"}, None),
        # torchrun's workers under srun: torchrun's ranks
        (
            {
                **SRUN,
                "SLURM_PROCID": "0",
                "RANK": "5",
                "WORLD_SIZE": "8",
                "TORCHELASTIC_RUN_ID": "x",
            },
            ("torchrun", RankInfo(5, 8, 5, 8)),
        ),
    ],
)
def test_external_launch_is_read_from_the_environment(env, expected):
    assert ranks.external_launch(env) == expected


def test_only_rank_zero_is_main():
    assert RankInfo(0, 2, 0, 2).is_main and not RankInfo(1, 2, 1, 2).is_main


def test_store_on_port_zero_holds_a_free_loopback_port():
    store = distributed.serve_store("127.0.0.1", 0, timedelta(seconds=10))
    with socket.socket() as s, pytest.raises(OSError):
        s.bind(("127.0.0.1", store.port))  # held: no other job can take it
    with pytest.raises(UserError, match=f"port {store.port}"):
        distributed.serve_store("127.0.0.1", store.port, timedelta(seconds=10))
