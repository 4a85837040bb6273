"""Kubernetes, as its trainers launch workloads: train.py in a pod of Kubeflow Trainer's TrainJob or
the training-operator's PyTorchJob (the pods' variables, read in process:
tests/unit/test_kubernetes.py), and scripts/k8s/trainjob.yaml's pods run as two hosts in network
namespaces, training as one node of two workers does, bit for bit.

No cluster runs here: what is tested is the contract between a controller and train.py. Each "pod"
runs the command, args and env that the manifest gives its container, with what the controller and
the kubelet would add (_pod says what, and what stands in for what), and after the manifest's args
the test's own overrides, as a user adds theirs: a short run, one thread a rank, the pod's run
directory. The manifest itself is not applied anywhere: no cluster has checked its schema."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest
import yaml

from support import (
    IN_POD,
    PYTORCHJOB,
    QUICK,
    REPO,
    TwoHosts,
    assert_same_run,
    check_ok,
    run_train,
    step_losses,
    summary,
    train_env,
)

MANIFEST = REPO / "scripts" / "k8s" / "trainjob.yaml"
IMAGE_ROOT = "/workspace"  # the project's place in the image (scripts/k8s/Dockerfile)
# A short run, one thread a rank on both sides (a thread count changes the float sums' order).
SETTINGS = (*QUICK, "trainer.threads=1")


# --- train.py in a pod
# ------------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_a_bad_pod_environment_is_one_line_before_anything_is_composed(run_dir: Path):
    proc = run_train(run_dir, env={**PYTORCHJOB, "PET_NODE_RANK": "2"}, timeout=50)
    assert proc.returncode != 0
    assert proc.stderr.splitlines() == [
        "hydra-ddp: error: PET_NODE_RANK=2 must be this pod's index among the job's "
        "2 nodes (PET_NNODES=2): 0 to 1; Kubeflow sets both, check the job's numNodes"
    ], proc.stderr
    assert not run_dir.exists()  # Hydra never ran


@pytest.mark.timeout(60)
def test_a_pytorchjob_pod_with_pet_variables_checks_as_its_node_of_torchrun(run_dir: Path):
    proc = run_train(run_dir, "--check", env=PYTORCHJOB, timeout=50)
    check_ok(proc)
    assert "config OK: 4 worker(s) on cpu (torchrun, backend gloo" in proc.stdout, proc.stdout


# --- The manifest's pods, as two hosts
# ---------------------------------------------------------------


def _trainjob() -> dict:
    (job,) = [
        doc
        for doc in yaml.safe_load_all(MANIFEST.read_text())
        if doc and doc.get("kind") == "TrainJob"
    ]
    assert (
        job["apiVersion"] == "trainer.kubeflow.org/v1alpha1"
        and job["spec"]["runtimeRef"]["name"] == "torch-distributed"
    )
    return job


def _pod(
    job: dict, index: int, addresses: list[str], controller_env: dict[str, str]
) -> tuple[list[str], dict[str, str]]:
    """Pod `index`'s command line and environment, as the cluster would make them from the manifest.

    Taken as written: trainer.command, trainer.args, trainer.env; an env value from the downward
    API's status.podIP is the pod's address (its namespace's here). Substituted: the image's root
    (/workspace) is this repository, and the image's `python` this venv's (first on PATH).
    Added, as the Trainer's torch plugin does (kubeflow/trainer,
    pkg/runtime/framework/plugins/torch): PET_NNODES = numNodes, PET_NPROC_PER_NODE =
    numProcPerNode, PET_NODE_RANK = the pod's index and PET_MASTER_PORT = 29500; PET_MASTER_ADDR,
    node 0's pod's DNS name there (<job>-node-0-0.<job>), is node 0's address here (no DNS).
    `controller_env`, where given, replaces those PET_* (another controller's variables). The
    kubelet's KUBERNETES_SERVICE_HOST marks a pod; gloo is told the pods' network interface
    (GLOO_SOCKET_IFNAME; in a pod, its hostname's address serves)."""
    trainer = job["spec"]["trainer"]
    command = [
        part.replace(IMAGE_ROOT, str(REPO), 1) if part.startswith(f"{IMAGE_ROOT}/") else part
        for part in trainer["command"]
    ]
    written = {}
    for var in trainer.get("env", []):
        if "valueFrom" in var:
            assert var["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}, (
                f"no stand-in here for {var}"
            )
            written[var["name"]] = addresses[index]
        else:
            written[var["name"]] = var["value"]
    pet = {
        "PET_NNODES": str(trainer["numNodes"]),
        "PET_NPROC_PER_NODE": str(trainer["numProcPerNode"]),
        "PET_NODE_RANK": str(index),
        "PET_MASTER_ADDR": addresses[0],
        "PET_MASTER_PORT": "29500",
    }
    env = {
        **train_env(),
        **written,
        **IN_POD,
        **(controller_env or pet),
        "GLOO_SOCKET_IFNAME": "hddp0",
        "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ["PATH"]]),
    }
    return [*command, *trainer["args"]], env


def _run_pods(
    hosts: TwoHosts, tmp_path: Path, job: dict, controller_env=lambda index: {}
) -> list[Path]:
    """Both pods at once, each in its namespace with a run directory of its own (its own
    filesystem); the run directories, node 0's first."""
    run_dirs = [tmp_path / f"pod{index}" for index in range(2)]
    pods = [_pod(job, index, hosts.addresses, controller_env(index)) for index in range(2)]
    commands = [
        [*command, *SETTINGS, f"hydra.run.dir={run_dir}"]
        for (command, _), run_dir in zip(pods, run_dirs)
    ]
    for result in hosts.run(commands, [env for _, env in pods]):
        check_ok(result)
    return run_dirs


@pytest.fixture(scope="module")
def one_node(reference_run) -> Path:
    """The manifest's training on one node of two workers (the default spawn launcher): the
    session's reference run of that config (the SkyPilot task's, tests/e2e/test_recipes.py)."""
    return reference_run(*_trainjob()["spec"]["trainer"]["args"], *SETTINGS, "trainer.nproc=2")


def _trains_as_one_node(pods: list[Path], one_node: Path, launcher: str) -> None:
    """Node 0's pod holds the run (its summary, TensorBoard, checkpoints), the other pod none of it,
    and it is the one node's run: every step's loss and the final weights, bit for bit."""
    assert [(pod / "summary.json").exists() for pod in pods] == [True, False]
    assert not (pods[1] / "tensorboard").exists() and not (pods[1] / "checkpoints").exists()
    s = summary(pods[0])
    assert (s["world_size"], s["nnodes"], s["launcher"]) == (2, 2, launcher)
    assert len(step_losses(one_node)) >= 2
    assert_same_run(pods[0], one_node)


needs_namespaces = pytest.mark.skipif(
    shutil.which("ip") is None or os.geteuid() != 0,
    reason="network namespaces need root and iproute2's `ip`",
)


@needs_namespaces
@pytest.mark.timeout(300)  # with the one-node run it is compared with
def test_the_trainjobs_two_pods_train_as_one_node_of_two_workers(tmp_path: Path, one_node: Path):
    job = _trainjob()
    assert (job["spec"]["trainer"]["numNodes"], job["spec"]["trainer"]["numProcPerNode"]) == (2, 1)
    with TwoHosts(str(os.getpid())) as hosts:
        pods = _run_pods(hosts, tmp_path, job)
    _trains_as_one_node(pods, one_node, "torchrun")


@needs_namespaces
@pytest.mark.timeout(180)
def test_pods_given_only_rank_and_world_size_train_as_one_node_of_two(
    tmp_path: Path, one_node: Path
):
    """The same image in pods given no PET_*, only MASTER_ADDR, MASTER_PORT, WORLD_SIZE and RANK (a
    controller or a pod spec of one's own; the training-operator also sets PET_*): one worker per
    pod, its rank the pod's RANK, meeting at the master's MASTER_ADDR:MASTER_PORT (23456)."""
    with TwoHosts(str(os.getpid())) as hosts:
        pods = _run_pods(
            hosts,
            tmp_path,
            _trainjob(),
            lambda index: {
                "RANK": str(index),
                "WORLD_SIZE": "2",
                "MASTER_ADDR": hosts.addresses[0],
                "MASTER_PORT": "23456",
            },
        )
    _trains_as_one_node(pods, one_node, "kubernetes (PyTorchJob)")
