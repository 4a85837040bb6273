"""bench/gpu_check.py between GPU loans: its dry run, in this process, names a case the project
would refuse (tests/e2e/test_gpu_check.py runs the script's dry run over every case it would launch,
on the CPU)."""

from __future__ import annotations

import pytest

from support import gpu_check


@pytest.mark.timeout(60)
def test_dry_run_reports_a_case_the_project_would_refuse(capsys):
    module = gpu_check()
    broken = [
        module.Case(
            "tensor parallel on the CNN",
            module.ONE,
            module.one_run,
            runs=((*module.CNN, module.ONE_RANK, "strategy=tp"),),
        ),
        module.Case(
            "a misspelt option",
            module.ALL,
            module.one_run,
            runs=((*module.CNN, "trainer.nprocs=2"),),
        ),
        module.Case(
            "a bad bench argument",
            module.ONE,
            module.parity,
            runs=((*module.CNN,),),
            bench=(("--device=tpu",),),
            baseline="no such case",
        ),
    ]
    # tp; the key at 2 and at 8 GPUs; the argument; the baseline
    assert module.dry_run(broken) == 1 + 2 + 1 + 1
    out = capsys.readouterr().out
    assert (
        "dry-run FAILED: tensor parallel on the CNN [1 GPU(s)] train.py launch 1/1: "
        "hydra-ddp: error: strategy=tp needs a model" in out
    )
    assert "dry-run FAILED: a misspelt option [8 GPU(s)]" in out and "nprocs" in out
    assert (
        "dry-run FAILED: a bad bench argument [1 GPU(s)] bench/handwritten.py launch 1/1:" in out
        and "tpu" in out
    )
    assert "baseline 'no such case' is no case" in out
    # the good launch still checked
    assert "dry-run ok: a bad bench argument [1 GPU(s)] train.py launch 1/1" in out
