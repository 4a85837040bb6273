"""bench/gpu_check.py between GPU loans: its dry run checks every case it would launch, on the
CPU."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from support import REPO, gpu_check


@pytest.mark.timeout(120)
def test_dry_run_checks_every_launch_of_every_case_and_passes():
    # As its docs run it: from the repository, nothing on PYTHONPATH (the script finds its own
    # helpers).
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
        len(module.DRY_RUN_GPUS[case.section])
        * (len(case.runs) + len(case.bench) + len(case.calls))
        for case in module.CASES
    )
    checked = [line for line in proc.stdout.splitlines() if line.startswith("dry-run ok: ")]
    assert len(checked) == expected, proc.stdout
    assert (
        f"dry-run: {expected} launch checks over {len(module.CASES)} cases, 0 problem(s)"
        in proc.stdout
    )
    for case in module.CASES:  # each case, at each GPU count it runs at
        for gpus in module.DRY_RUN_GPUS[case.section]:
            assert any(
                line.startswith(f"dry-run ok: {case.name} [{gpus} GPU(s)]") for line in checked
            ), case.name
