"""bench/gpu_check.py between GPU loans: its dry run checks every case it would launch, on the CPU."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "bench" / "gpu_check.py"


def gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.timeout(120)
def test_dry_run_checks_every_launch_of_every_case_and_passes():
    # As its docs run it: from the repository, nothing on PYTHONPATH (the script finds its own helpers).
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run(
        [sys.executable, "bench/gpu_check.py", "--dry-run"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=110,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    module = gpu_check()
    expected = sum(
        len(module.DRY_RUN_GPUS[case.section]) * (len(case.runs) + len(case.bench) + len(case.calls))
        for case in module.CASES
    )
    checked = [line for line in proc.stdout.splitlines() if line.startswith("dry-run ok: ")]
    assert len(checked) == expected, proc.stdout
    assert f"dry-run: {expected} launch checks over {len(module.CASES)} cases, 0 problem(s)" in proc.stdout
    for case in module.CASES:  # each case, at each GPU count it runs at
        for gpus in module.DRY_RUN_GPUS[case.section]:
            assert any(line.startswith(f"dry-run ok: {case.name} [{gpus} GPU(s)]") for line in checked), case.name


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
        module.Case("a misspelt option", module.ALL, module.one_run, runs=((*module.CNN, "trainer.nprocs=2"),)),
        module.Case(
            "a bad bench argument",
            module.ONE,
            module.parity,
            runs=((*module.CNN,),),
            bench=(("--device=tpu",),),
            baseline="no such case",
        ),
    ]
    assert module.dry_run(broken) == 1 + 2 + 1 + 1  # tp; the key at 2 and at 8 GPUs; the argument; the baseline
    out = capsys.readouterr().out
    assert (
        "dry-run FAILED: tensor parallel on the CNN [1 GPU(s)] train.py launch 1/1: "
        "hydra-ddp: error: strategy=tp needs a model" in out
    )
    assert "dry-run FAILED: a misspelt option [8 GPU(s)]" in out and "nprocs" in out
    assert "dry-run FAILED: a bad bench argument [1 GPU(s)] bench/handwritten.py launch 1/1:" in out and "tpu" in out
    assert "baseline 'no such case' is no case" in out
    assert "dry-run ok: a bad bench argument [1 GPU(s)] train.py launch 1/1" in out  # the good launch still checked
