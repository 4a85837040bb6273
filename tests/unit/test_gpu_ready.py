"""What differs on CUDA + NCCL, tested as far as a CPU allows, in this process: every `auto` settled
alike on every rank of an outside launch, a rank's GPU among those it sees, the process group's
backend per device, fp16 under FSDP and the loss's dtype (the runs: tests/e2e/test_gpu_ready.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hydra_ddp import tasks
from hydra_ddp.config import fingerprint
from hydra_ddp.config.schema import register_schema
from hydra_ddp.errors import UserError
from hydra_ddp.launch import checks, resolve
from hydra_ddp.parallel import distributed, strategies
from hydra_ddp.runtime import ranks

from support import REPO

register_schema()

# Every key whose value `auto` (or null) lets the launch side decide.
EVERY_AUTO = (
    "trainer.nproc=auto",
    "trainer.device=auto",
    "backend=auto",
    "trainer.threads=null",
    "trainer.channels_last=auto",
    "strategy.gradient_as_bucket_view=auto",
    "strategy.static_graph=auto",
    "strategy.shared_memory=auto",
    "strategy.sync_batchnorm=auto",
    "trainer.monitor_mode=auto",
    "backend.timeout_s=auto",
    "+experiment=cifar10_resnet18",
    "data.dataset.root=/nonexistent",
)


def _compose(*overrides: str):
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base=None):
        return compose(config_name="config", overrides=list(overrides))


SRUN = {
    "SLURM_STEP_ID": "0",
    "SLURM_STEP_NUM_TASKS": "2",
    "SLURM_STEP_NODELIST": "n1",
    "SLURMD_NODENAME": "n1",
    "SLURM_STEP_TASKS_PER_NODE": "2",
    "SLURM_JOB_ID": "42",
    "SLURM_NODEID": "0",
}


@pytest.mark.parametrize("launcher", ["torchrun", "srun"])
def test_every_auto_is_settled_alike_on_every_rank_of_an_outside_launch(
    tmp_path: Path, monkeypatch, launcher: str
):
    """Each rank fills the config in itself; rank 0 alone also checks it (it alone knows the run
    directory). The fingerprints the ranks compare must agree."""
    prints = []
    for rank in (0, 1):
        env = (
            {
                "RANK": str(rank),
                "WORLD_SIZE": "2",
                "LOCAL_RANK": str(rank),
                "LOCAL_WORLD_SIZE": "2",
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": "29500",
            }
            if launcher == "torchrun"
            else {**SRUN, "SLURM_PROCID": str(rank), "SLURM_LOCALID": str(rank)}
        )
        found = ranks.external_launch(env)
        assert found and found[1].rank == rank
        for key, value in {
            **env,
            **(ranks.srun_environment(env) if launcher == "srun" else {}),
        }.items():
            monkeypatch.setenv(key, value)
        plain = resolve.resolve(
            _compose(*EVERY_AUTO), tmp_path / f"rank{rank}", found, checked=False
        )
        if rank == 0:
            # rank 0's check runs, and changes nothing
            with pytest.raises(UserError, match="data=cifar10"):
                checks.check(plain, tmp_path / "rank0")
        prints.append(fingerprint.config_fingerprint(plain))
        assert plain.strategy.sync_batchnorm is False  # settled: no GPU here
    assert prints[0] == prints[1]


@pytest.mark.parametrize(
    "local_rank, local_world, visible, outside, expected",
    [
        (3, 8, 8, True, 3),  # torchrun on an 8-GPU node: every rank sees every GPU
        (3, 8, 8, False, 3),  # spawn
        # srun --gpus-per-task=1, submitit gpus_per_task: one GPU a task, its own
        (5, 8, 1, True, 0),
        (0, 1, 1, False, 0),
        (1, 2, 1, False, None),  # two spawned workers, one GPU: NCCL would refuse
        (1, 4, 2, True, None),  # two GPUs for four tasks
    ],
)
def test_a_rank_takes_a_gpu_it_sees(local_rank, local_world, visible, outside, expected):
    if expected is None:
        with pytest.raises(UserError, match="one GPU per process"):
            distributed.gpu_index(local_rank, local_world, visible, outside)
    else:
        assert distributed.gpu_index(local_rank, local_world, visible, outside) == expected


def test_the_gpu_count_is_per_task_under_srun():
    # srun --gpus-per-task=1: 8 tasks on the node, each seeing its own one GPU.
    host = distributed.Host(cuda=True, gpus=1, nccl=True, mpi=False)
    assert distributed.resolve_backend("auto", "cuda", 8, host, outside_launch=True) == "nccl"
    with pytest.raises(UserError, match="trainer.nproc=1"):  # the same GPU for 8 spawned workers
        distributed.resolve_backend("auto", "cuda", 8, host, outside_launch=False)


def test_backend_auto_gets_ncclss_one_gpu_per_process_check():
    host = distributed.Host(cuda=True, gpus=2, nccl=True, mpi=False)
    for name in ("auto", "nccl"):
        with pytest.raises(UserError, match="8 process.* 2 GPU"):
            distributed.resolve_backend(name, "cuda", 8, host)
    assert distributed.resolve_backend("auto", "cuda", 2, host) == "nccl"
    assert distributed.resolve_backend("auto", "cpu", 8, host) == "gloo"


def _gpu_host(monkeypatch, gpus: int = 2) -> None:
    monkeypatch.setenv(distributed.CHECK_GPUS_ENV, str(gpus))  # what train.py --check --gpus=N sets


def test_cpu_offload_on_nccl_gives_its_cpu_shards_gloo(tmp_path: Path, monkeypatch):
    _gpu_host(monkeypatch)
    plain = resolve.resolve(
        _compose("+experiment=text_gpt", "strategy=fsdp", "strategy.cpu_offload=true"),
        tmp_path,
        None,
        checked=False,
    )
    assert plain.backend.name == "cpu:gloo,cuda:nccl"
    assert plain.backend.timeout_s == 600  # NCCL's: a dead peer may go unseen until then
    plain = resolve.resolve(
        _compose("+experiment=text_gpt", "strategy=fsdp"), tmp_path, None, checked=False
    )
    assert plain.backend.name == "nccl"
    settings = _compose("strategy=fsdp", "strategy.cpu_offload=true").strategy
    # gloo takes both devices already
    assert strategies.get("fsdp").backend(settings, "gloo") == "gloo"


def test_fp16_under_fsdp_is_refused_in_one_line_and_the_loss_is_float32(
    tmp_path: Path, monkeypatch
):
    _gpu_host(monkeypatch)
    plain = resolve.resolve(
        _compose("+experiment=text_gpt", "strategy=fsdp", "strategy.param_dtype=fp16"),
        tmp_path,
        None,
        checked=False,
    )
    with pytest.raises(UserError, match="param_dtype=fp16 .* use bf16") as refused:
        checks.check(plain, tmp_path)
    assert "\n" not in str(refused.value)
    # Whatever the model computes in, the loss is summed in float32 (by every built-in task).
    for task in (tasks.Classification(), tasks.LanguageModel(), tasks.Segmentation(10)):
        _float32_loss(task)
    regression = tasks.Regression().loss(torch.randn(8, 1).to(torch.bfloat16), torch.randn(8))
    assert regression.dtype == torch.float32


def _float32_loss(task) -> None:
    logits, target = torch.randn(64, 10).to(torch.bfloat16), torch.randint(0, 10, (64,))
    loss = task.loss(logits, target)
    assert loss.dtype == torch.float32
    assert loss == torch.nn.functional.cross_entropy(logits.float(), target)
    full = torch.randn(8, 10)
    assert task.loss(full, target[:8]).data_ptr() != full.data_ptr()  # fp32: the same values
    assert torch.equal(
        task.loss(full, target[:8]), torch.nn.functional.cross_entropy(full, target[:8])
    )
