"""Kubernetes pods as launchers: what Kubeflow's TrainJob and PyTorchJob tell each pod, as
train.py's launch settings.

Both controllers give every pod torchrun's PET_* variables (torchrun reads them as its flags'
defaults): PET_NNODES, PET_NPROC_PER_NODE, PET_NODE_RANK, PET_MASTER_ADDR, PET_MASTER_PORT; and
PET_RDZV_ID, PET_LOCAL_ADDR where the job sets them.
`torchrun train.py` in a pod is torchrun's launch, as anywhere (its workers have
TORCHELASTIC_RUN_ID). `python train.py` in a pod with PET_* set launches the pod's workers itself,
as launcher=torchrun would with those values: the overrides below, added to the command line before
Hydra composes it. PyTorchJob's pod-level RANK and WORLD_SIZE (and MASTER_ADDR/PORT, PET_MASTER_*'s
copies) count pods, not workers: they are dropped. No torch here: runtime/ranks.py asks before
importing it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, MutableMapping

from hydra_ddp.errors import UserError
from hydra_ddp.runtime.ranks import PET_NNODES

NNODES, NPROC, NODE_RANK, MASTER_ADDR, MASTER_PORT = (
    PET_NNODES,
    "PET_NPROC_PER_NODE",
    "PET_NODE_RANK",
    "PET_MASTER_ADDR",
    "PET_MASTER_PORT",
)
# Read where set (the controllers don't): torchrun's --rdzv-id and --local-addr.
RDZV_ID, LOCAL_ADDR = "PET_RDZV_ID", "PET_LOCAL_ADDR"
# A PyTorchJob pod's view of the pods (WORLD_SIZE: pods, or pods × nprocPerNode; RANK: the pod's
# index); torchrun's agent gives each worker its own.
POD_LEVEL = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def pod_settings(env: Mapping[str, str]) -> dict[str, str]:
    """The launch settings PET_* give (key: value, as overrides), or a UserError naming the
    variable. One node needs no launcher of its own (spawn, or the configured one); several meet at
    node 0's PET_MASTER_ADDR:PET_MASTER_PORT under launcher=torchrun. A number of processes per node
    sets trainer.nproc; a word (auto, gpu, cpu: Kubeflow's) leaves it as configured (auto: one per
    GPU)."""
    nnodes = env[NNODES].strip()
    low, _, high = nnodes.partition(":")  # "MIN:MAX": elastic, as torchrun reads it
    if not (low.isdigit() and (high or low).isdigit() and 1 <= int(low) <= int(high or low)):
        raise UserError(
            f"{NNODES}={nnodes!r} is not a node count: the pod's job should set a positive integer "
            "(Kubeflow: the job's numNodes)"
        )
    most = int(high or low)
    overrides = {}
    if most > 1:
        rank = env.get(NODE_RANK, "").strip()
        if not rank.isdigit() or int(rank) >= most:
            raise UserError(
                f"{NODE_RANK}={rank or '(unset)'} must be this pod's index "
                f"among the job's {most} nodes ({NNODES}={nnodes}): 0 to "
                f"{most - 1}; Kubeflow sets both, check the job's numNodes"
            )
        addr, port = env.get(MASTER_ADDR, "").strip(), env.get(MASTER_PORT, "").strip()
        if not addr or not (port.isdigit() and 0 < int(port) < 65536):
            raise UserError(
                f"{NNODES}={nnodes} needs node 0's address and port in {MASTER_ADDR} "
                f"and {MASTER_PORT} (a port 1-65535), got {addr!r} and {port!r}"
            )
        overrides = {
            "launcher": "torchrun",
            "launcher.nnodes": nnodes,
            "launcher.node_rank": str(int(rank)),
            "launcher.rdzv_endpoint": f"{addr}:{int(port)}",
            # The same on every pod of one job and on no other: node 0's address names the job.
            "launcher.rdzv_id": env.get(RDZV_ID) or addr,
        }
        if env.get(LOCAL_ADDR):  # else the pod's hostname's address, as torchrun's
            overrides["launcher.local_addr"] = env[LOCAL_ADDR]
    nproc = env.get(NPROC, "").strip()
    if nproc.isdigit() and int(nproc) > 0:
        overrides["trainer.nproc"] = nproc
    elif nproc and nproc not in ("auto", "gpu", "cpu"):
        raise UserError(
            f"{NPROC}={nproc!r} is not a number of processes "
            "per node: set a positive integer or auto"
        )
    return overrides


def pod_overrides(env: Mapping[str, str], overrides: list[str]) -> list[str]:
    """The overrides to add to train.py's `overrides` for this pod. The pod's env describes the job
    its controller made (how many pods, which one this is, where node 0 is): it wins over the
    config's defaults and presets. One of those keys set on the command line must agree with it,
    else a UserError: the command line can't give the job another shape than its controller did."""
    settings = pod_settings(env)
    given = {}
    for override in overrides:
        key, sep, value = override.lstrip("+").partition("=")
        if sep and key in settings:
            given[key] = value.strip().strip("'\"")
    for key, value in given.items():
        if _canonical(value) != _canonical(settings[key]):
            raise UserError(
                f"{key}={value} on the command line disagrees with this "
                f"pod's environment, which says {key}={settings[key]} "
                f"({_source(key, env)}); drop the override, or change the job"
            )
    return [f"{key}={value}" for key, value in settings.items() if key not in given]


def adopt(argv: list[str], environ: MutableMapping[str, str] = os.environ) -> None:
    """argv (train.py's) gets this pod's launch settings; the pod-level ranks leave the
    environment."""
    argv += pod_overrides(environ, argv[1:])
    for name in POD_LEVEL:
        environ.pop(name, None)


def _canonical(value: str) -> str:
    return str(int(value)) if value.isdigit() else value


def _source(key: str, env: Mapping[str, str]) -> str:
    """The pod's variables a setting comes from, with their values."""
    names = {
        "launcher": [NNODES],
        "launcher.nnodes": [NNODES],
        "launcher.node_rank": [NODE_RANK],
        "launcher.rdzv_endpoint": [MASTER_ADDR, MASTER_PORT],
        "trainer.nproc": [NPROC],
        "launcher.rdzv_id": [RDZV_ID if env.get(RDZV_ID) else MASTER_ADDR],
        "launcher.local_addr": [LOCAL_ADDR],
    }[key]
    return ", ".join(f"{name}={env[name]}" for name in names)
