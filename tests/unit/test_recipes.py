"""The launch recipes agree with each other (no process; tests/e2e/test_recipes.py has their tools
read them and runs the SkyPilot task's nodes): the project's Kubeflow runtime gives its node pods
the TrainJob's command and env, and every recipe trains with the same overrides."""

from __future__ import annotations

import yaml

from support import REPO

K8S = REPO / "scripts" / "k8s"


def _load(path):
    return yaml.safe_load(path.read_text())


def test_the_runtimes_node_container_is_the_trainjobs_trainer():
    """A TrainJob on runtimeRef hydra-ddp without command and env runs what trainjob.yaml runs on
    torch-distributed: the same entrypoint, PYTHONUNBUFFERED and PET_LOCAL_ADDR from the pod's
    IP."""
    runtime = _load(K8S / "runtime.yaml")
    trainer = _load(K8S / "trainjob.yaml")["spec"]["trainer"]
    (job,) = runtime["spec"]["template"]["spec"]["replicatedJobs"]
    (container,) = job["template"]["spec"]["template"]["spec"]["containers"]
    assert (runtime["kind"], runtime["metadata"]["name"], job["name"], container["name"]) == (
        "ClusterTrainingRuntime",
        "hydra-ddp",
        "node",
        "node",
    )
    assert "torch" in runtime["spec"]["mlPolicy"]  # the plugin that sets PET_*
    assert container["command"] == trainer["command"]
    assert container["env"] == trainer["env"]
    assert container["image"] == trainer["image"]


def test_every_recipe_trains_with_the_same_overrides():
    """The same training from a TrainJob and a SkyPilot task:
    the global batch fixed, so any nodes × workers split trains alike."""
    trainjob_args = _load(K8S / "trainjob.yaml")["spec"]["trainer"]["args"]
    task = _load(REPO / "scripts" / "skypilot" / "train.yaml")
    assert task["envs"]["OVERRIDES"].split() == trainjob_args == ["data.global_batch_size=64"]
