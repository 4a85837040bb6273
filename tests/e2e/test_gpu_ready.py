"""What differs on CUDA + NCCL, in real runs on a CPU: sync_batchnorm=auto under an outside
torchrun, the deterministic switch in the workers, and the first failure named when the other ranks
were aborted (the settling itself, in process: tests/unit/test_gpu_ready.py)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from support import QUICK, check_ok, run_train, summary


def test_sync_batchnorm_auto_under_an_outside_torchrun_trains(run_dir: Path):
    prefix = (sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2")
    check_ok(
        run_train(run_dir, "strategy.sync_batchnorm=auto", "trainer.max_steps=2", prefix=prefix)
    )
    assert summary(run_dir)["steps"] == 2


def test_deterministic_sets_every_kernel_switch_in_the_workers(tmp_path: Path):
    probes = tmp_path / "probes"
    probes.mkdir()
    check_ok(
        run_train(
            tmp_path / "run",
            *QUICK,
            "trainer.deterministic=true",
            "model._target_=probes.DeterminismProbe",
            f"+model.probe_dir={probes}",
        )
    )
    for rank in (0, 1):
        seen = json.loads((probes / f"rank{rank}.json").read_text())
        assert seen == {
            "deterministic_algorithms": True,
            "cudnn_deterministic": True,
            "cudnn_benchmark": False,
            "cudnn_tf32": False,
            "matmul_tf32": False,
            "cublas_workspace": ":4096:8",
        }, seen
    assert summary(tmp_path / "run")["deterministic"] is True


@pytest.mark.parametrize("launcher", ["spawn", "torchrun"])
def test_the_first_failure_is_named_when_the_other_ranks_were_aborted(run_dir: Path, launcher: str):
    proc = run_train(
        run_dir,
        *QUICK,
        f"launcher={launcher}",
        "model._target_=faulty.FailThenAbort",
        "+model.fail_rank=1",
    )
    assert proc.returncode != 0
    assert proc.stderr.strip().splitlines() == [
        "hydra-ddp: error: worker rank 1 failed: RuntimeError: injected failure: "
        f"out of memory on this rank (full traceback: {run_dir / 'train.log'})"
    ], proc.stderr
