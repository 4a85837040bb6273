"""Kubernetes, as its trainers launch workloads: the pods' variables as train.py reads them
(Kubeflow Trainer's TrainJob, the training-operator's PyTorchJob), in this process: who launches the
workers, torchrun's launch settings, and bad or contradicted variables in one line. The pods'
variables are the kit's (support.TRAINJOB, PYTORCHJOB); tests/e2e/test_kubernetes.py runs the
pods."""

from __future__ import annotations

import re

import pytest

from hydra_ddp.clusters import kubernetes
from hydra_ddp.errors import UserError
from hydra_ddp.runtime import ranks
from hydra_ddp.runtime.ranks import RankInfo

from support import IN_POD, PYTORCHJOB, TRAINJOB

# --- The pods' variables, read -------------------------------------------------------------------


@pytest.mark.parametrize(
    "env, expected",
    [
        (TRAINJOB, None),  # python train.py in a TrainJob's pod: it launches the pod's workers
        # ... in a PyTorchJob's: its RANK and WORLD_SIZE count pods, not workers
        (PYTORCHJOB, None),
        # torchrun train.py in a pod: its workers are torchrun's, whatever PET_* say
        (
            {
                **PYTORCHJOB,
                "RANK": "3",
                "WORLD_SIZE": "4",
                "LOCAL_RANK": "1",
                "LOCAL_WORLD_SIZE": "2",
                "TORCHELASTIC_RUN_ID": "job",
            },
            ("torchrun", RankInfo(3, 4, 1, 2)),
        ),
        # a pod given no PET_*, only RANK and WORLD_SIZE: one worker per pod, the pod's RANK its
        # rank
        (
            {
                **IN_POD,
                "RANK": "1",
                "WORLD_SIZE": "3",
                "MASTER_ADDR": "job-master-0",
                "MASTER_PORT": "23456",
            },
            ("kubernetes (PyTorchJob)", RankInfo(1, 3, 0, 1)),
        ),
        # outside a pod: as before
        ({"RANK": "1", "WORLD_SIZE": "3"}, ("torchrun", RankInfo(1, 3, 1, 3))),
    ],
)
def test_a_pods_variables_say_who_launches_the_workers(env, expected):
    assert ranks.external_launch(env) == expected


def test_a_pods_variables_become_torchruns_launch_settings():
    assert kubernetes.pod_overrides(PYTORCHJOB, ["trainer.max_steps=3"]) == [
        "launcher=torchrun",
        "launcher.nnodes=2",
        "launcher.node_rank=1",
        "launcher.rdzv_endpoint=job-master-0:23456",
        "launcher.rdzv_id=job-master-0",
        "trainer.nproc=2",
    ]
    # Overrides that agree are kept as given; one node needs no launcher; a word leaves
    # trainer.nproc as configured.
    assert kubernetes.pod_overrides(
        TRAINJOB, ["launcher=torchrun", "+launcher.nnodes=02", "trainer.nproc=2"]
    ) == [
        "launcher.node_rank=1",
        "launcher.rdzv_endpoint=job-node-0-0.job:29500",
        "launcher.rdzv_id=job-node-0-0.job",
    ]
    assert (
        kubernetes.pod_overrides({**IN_POD, "PET_NNODES": "1", "PET_NPROC_PER_NODE": "auto"}, [])
        == []
    )
    assert "launcher.local_addr=10.0.0.5" in kubernetes.pod_overrides(
        {**TRAINJOB, "PET_LOCAL_ADDR": "10.0.0.5"}, []
    )
    # The pod-level RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT leave the environment: torchrun's
    # agent sets each worker's.
    environ, argv = dict(PYTORCHJOB), ["train.py", "trainer.max_steps=3"]
    kubernetes.adopt(argv, environ)
    assert argv[2:] == kubernetes.pod_overrides(PYTORCHJOB, []) and environ == {
        k: v
        for k, v in PYTORCHJOB.items()
        if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    }


@pytest.mark.parametrize(
    "env, overrides, says",
    [
        (
            {**TRAINJOB, "PET_NODE_RANK": "2"},
            [],
            "PET_NODE_RANK=2 must be this pod's index among the job's 2 nodes",
        ),
        ({**TRAINJOB, "PET_NNODES": "two"}, [], "PET_NNODES='two' is not a node count"),
        ({**TRAINJOB, "PET_MASTER_PORT": "99999"}, [], "needs node 0's address and port"),
        (
            {**TRAINJOB, "PET_NPROC_PER_NODE": "0"},
            [],
            "PET_NPROC_PER_NODE='0' is not a number of processes",
        ),
        (
            TRAINJOB,
            ["launcher.nnodes=3"],
            "launcher.nnodes=3 on the command line disagrees with this pod's environment, "
            "which says launcher.nnodes=2 (PET_NNODES=2)",
        ),
        (TRAINJOB, ["launcher=spawn"], "launcher=spawn on the command line disagrees"),
    ],
)
def test_a_pods_bad_or_contradicted_variables_say_what_is_wrong(env, overrides, says):
    with pytest.raises(UserError, match=re.escape(says)):
        kubernetes.pod_overrides(env, overrides)
