"""Launch recipes beyond Slurm: scripts/skypilot/train.yaml (a SkyPilot task) and scripts/k8s/*.yaml
(a Kubeflow Trainer v2 TrainJob and the project's ClusterTrainingRuntime).

No cloud and no cluster runs here. The files are read by the tools' own parsers, installed from the
registry into a venv of their own (pyproject.toml's `recipes` extra: SkyPilot pins older click and
uvicorn than MLflow's, so it stays out of the dev venv): SkyPilot's `Task.from_yaml`, which checks
a task against SkyPilot's schema, and the Trainer's API models (kubeflow-trainer-api), which type
every field; a manifest must come back from them unchanged, so an unknown field fails too. And the
SkyPilot task's `run` script runs as SkyPilot runs it, on two hosts (network namespaces), training
as one node of two workers does, bit for bit (the TrainJob's pods: tests/e2e/test_kubernetes.py)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml

from support import QUICK, REPO, TwoHosts, assert_same_run, check_ok, summary, train_env

TASK = REPO / "scripts" / "skypilot" / "train.yaml"
MANIFESTS = [REPO / "scripts" / "k8s" / "trainjob.yaml", REPO / "scripts" / "k8s" / "runtime.yaml"]
SETTINGS = (*QUICK, "trainer.threads=1")  # one thread a rank on both sides: the same float sums
TASK_ID = "sky-2026-12-06-01-02-03-456789_hddp_1"  # common_utils.get_global_job_id's form

# Run in the recipes venv: each file through its tool's parser, printed back as JSON.
READER = """
import json, sys, yaml
import sky
from kubeflow_trainer_api import models

MODELS = {"TrainJob": models.TrainerV1alpha1TrainJob,
          "ClusterTrainingRuntime": models.TrainerV1alpha1ClusterTrainingRuntime}
task_path, *manifests = sys.argv[1:]
task = sky.Task.from_yaml(task_path)
read = {"task": {"num_nodes": task.num_nodes, "envs": dict(task.envs), "run": task.run,
                 "setup": task.setup, "workdir": task.workdir,
                 "accelerators": [r.accelerators for r in task.resources]}}
for path in manifests:
    with open(path) as f:
        doc = yaml.safe_load(f)
    read[path] = MODELS[doc["kind"]].from_dict(doc).to_dict()
print(json.dumps(read))
"""


@pytest.fixture(scope="module")
def recipe_tools(tmp_path_factory) -> Path:
    """A venv with the `recipes` extra's packages, resolved from the registry; its python."""
    packages = tomllib.loads((REPO / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]["recipes"]
    venv = tmp_path_factory.mktemp("recipes") / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    proc = subprocess.run(
        # --no-compile: the tools' parsers import a few of the ~100 packages; Python compiles those
        [
            str(python),
            "-m",
            "pip",
            "install",
            "--quiet",
            "--no-compile",
            "--disable-pip-version-check",
            *packages,
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, f"installing {packages} failed:\n{proc.stderr[-3000:]}"
    return python


def _read(python: Path, task: Path, *manifests: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(python), "-c", READER, str(task), *map(str, manifests)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.timeout(900)  # the venv's install: ~100 packages, SkyPilot's among them
def test_the_recipes_are_read_unchanged_by_skypilot_and_the_kubeflow_trainers_api(
    recipe_tools: Path,
):
    proc = _read(recipe_tools, TASK, *MANIFESTS)
    assert proc.returncode == 0, proc.stderr[-3000:]
    read = json.loads(proc.stdout)
    written = yaml.safe_load(TASK.read_text())
    assert read["task"] == {
        "num_nodes": 2,
        "envs": written["envs"],
        "run": written["run"],
        "setup": written["setup"],
        "workdir": ".",
        "accelerators": [{"H100": 8}],
    }
    for manifest in MANIFESTS:
        assert read[str(manifest)] == yaml.safe_load(manifest.read_text()), manifest.name


@pytest.mark.timeout(900)
def test_the_parsers_refuse_a_field_they_do_not_know(recipe_tools: Path, tmp_path: Path):
    """What makes the check above one: a misspelt field is refused (SkyPilot) or comes back
    without it (the Trainer's models drop it: the comparison fails), a mistyped one is refused."""
    task = yaml.safe_load(TASK.read_text())
    task["num_node"] = 2
    (tmp_path / "task.yaml").write_text(yaml.safe_dump(task))
    proc = _read(recipe_tools, tmp_path / "task.yaml")
    refused = proc.returncode != 0 and "Invalid task YAML" in proc.stderr
    assert refused and "'num_node'" in proc.stderr, proc.stderr[-2000:]

    job = yaml.safe_load(MANIFESTS[0].read_text())
    job["spec"]["trainer"]["numNode"] = 2
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
    proc = _read(recipe_tools, TASK, tmp_path / "job.yaml")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "numNode" not in json.loads(proc.stdout)[str(tmp_path / "job.yaml")]["spec"]["trainer"]

    job["spec"]["trainer"]["numNodes"] = "two"
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
    proc = _read(recipe_tools, TASK, tmp_path / "job.yaml")
    assert proc.returncode != 0 and "numNodes" in proc.stderr, proc.stderr[-2000:]


# --- The SkyPilot task's nodes, as two hosts
# ---------------------------------------------------------


def _node_env(index: int, addresses: list[str], gpus: int, overrides: list[str]) -> dict[str, str]:
    """What SkyPilot gives node `index`'s `run` (sky/backends/task_codegen.py): the task's envs
    (OVERRIDES, with the test's own after the task's, as `--env` would set it), SKYPILOT_NODE_RANK,
    SKYPILOT_NUM_NODES, SKYPILOT_NODE_IPS (the head's first), SKYPILOT_NUM_GPUS_PER_NODE and
    SKYPILOT_TASK_ID. gloo is told the hosts' interface (GLOO_SOCKET_IFNAME)."""
    envs = yaml.safe_load(TASK.read_text())["envs"]
    return {
        **train_env(),
        **envs,
        "OVERRIDES": " ".join([envs["OVERRIDES"], *overrides]),
        "SKYPILOT_NODE_RANK": str(index),
        "SKYPILOT_NUM_NODES": str(len(addresses)),
        "SKYPILOT_NODE_IPS": "\n".join(addresses),
        "SKYPILOT_NUM_GPUS_PER_NODE": str(gpus),
        "SKYPILOT_TASK_ID": TASK_ID,
        "GLOO_SOCKET_IFNAME": "hddp0",
    }


def _run_script() -> str:
    return yaml.safe_load(TASK.read_text())["run"]


needs_namespaces = pytest.mark.skipif(
    shutil.which("ip") is None or os.geteuid() != 0,
    reason="network namespaces need root and iproute2's `ip`",
)


@pytest.mark.timeout(120)
def test_the_tasks_run_on_cpu_nodes_checks_as_two_nodes_of_auto_workers(tmp_path: Path):
    """A node without GPUs (SKYPILOT_NUM_GPUS_PER_NODE=0): trainer.nproc's auto, 2 on a CPU."""
    assert (REPO / ".venv" / "bin" / "python").exists(), (
        "the task's setup makes .venv; `make` does here"
    )
    env = _node_env(0, ["10.0.0.1", "10.0.0.2"], 0, ["--check"])
    proc = subprocess.run(
        ["bash", "-c", _run_script()],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=100,
    )
    check_ok(proc)
    assert "config OK: 4 worker(s) on cpu (torchrun, backend gloo" in proc.stdout, proc.stdout


@needs_namespaces
@pytest.mark.timeout(300)  # with the one-node run it is compared with
def test_the_skypilot_tasks_two_nodes_train_as_one_node_of_two_workers(
    tmp_path: Path, reference_run
):
    """Each node runs the task's `run` in the project's root, as SkyPilot runs it in its workdir
    (the `setup` that makes .venv is `make`'s here), one GPU a node standing for
    SKYPILOT_NUM_GPUS_PER_NODE (a worker each, on the CPU); the one-node run is the task's
    overrides at trainer.nproc=2 under the default spawn launcher (the session's reference run of
    that config: the Kubernetes manifest's too, tests/e2e/test_kubernetes.py)."""
    assert (REPO / ".venv" / "bin" / "python").exists(), (
        "the task's setup makes .venv; `make` does here"
    )
    task_overrides = yaml.safe_load(TASK.read_text())["envs"]["OVERRIDES"].split()
    one_node = reference_run(*task_overrides, *SETTINGS, "trainer.nproc=2")

    nodes = [tmp_path / f"node{index}" for index in range(2)]
    with TwoHosts(str(os.getpid())) as hosts:
        envs = [
            _node_env(index, hosts.addresses, 1, [*SETTINGS, f"hydra.run.dir={run_dir}"])
            for index, run_dir in enumerate(nodes)
        ]
        results = hosts.run([["bash", "-c", _run_script()]] * 2, envs, cwd=REPO)
    for result in results:
        check_ok(result)
    assert [(node / "summary.json").exists() for node in nodes] == [True, False]
    s = summary(nodes[0])
    assert (s["world_size"], s["nnodes"], s["launcher"]) == (2, 2, "torchrun")
    assert_same_run(nodes[0], one_node)
