"""`train.py --check`: a config composed, resolved and checked exactly as a run would, one line
either way and nothing launched; and every pair of options from two groups either passes it or fails
in one line, while a pair that passes trains."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

import pair_checks
from support import REPO, run_train, summary, train_env


def check_cli(*args: str, tmp_path: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "train.py", "--check", *args, f"hydra.run.dir={tmp_path / 'run'}"],
        cwd=REPO,
        env=train_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_check_says_what_would_run_and_launches_nothing(tmp_path: Path):
    proc = check_cli(tmp_path=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == (
        "hydra-ddp: config OK: 2 worker(s) on cpu (spawn, backend gloo, "
        "init env), ddp, global batch 64; nothing launched"
    )
    assert not (tmp_path / "run").exists()  # no run directory, no log: nothing ran


def test_check_notes_cpu_workers_that_outnumber_the_cores(tmp_path: Path):
    cores = len(os.sched_getaffinity(0))
    proc = check_cli(f"trainer.nproc={cores + 2}", tmp_path=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == (
        f"hydra-ddp: note: {cores + 2} CPU workers on this host's {cores} core(s) share them, 1 "
        f"thread(s) each: slower than trainer.nproc={cores} would be (fine for trying a config)"
    )


def test_a_mismatched_pair_is_one_line_naming_the_options_that_fit(tmp_path: Path):
    # checked alone, or as a run checks it first
    for args in (("--check", "model=gpt"), ("model=gpt",)):
        proc = subprocess.run(
            [sys.executable, "train.py", *args, f"hydra.run.dir={tmp_path / 'run'}"],
            cwd=REPO,
            env=train_env(),
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert proc.returncode == 2
        assert proc.stderr.strip().splitlines() == [
            "hydra-ddp: error: model=gpt needs data.dataset.context, which "
            "data=digits does not have: use data=documents or data=text "
            "(or +experiment=documents_gpt or +experiment=text_gpt)"
        ], proc.stderr


def test_check_for_a_gpu_host_from_a_cpu_host(tmp_path: Path):
    proc = check_cli("--gpus=8", "backend=nccl", tmp_path=tmp_path)
    assert proc.returncode == 0 and "8 worker(s) on cuda (spawn, backend nccl" in proc.stdout, (
        proc.stderr
    )
    # backend=auto: nccl's check too
    proc = check_cli("--gpus=2", "trainer.nproc=8", tmp_path=tmp_path)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "hydra-ddp: error: one GPU per process: 8 process(es) on this node "
        "but this host has 2 GPU(s); set trainer.nproc=2 (or auto), give "
        "each task its own GPU (srun --gpus-per-task=1), or use backend=gloo"
    ]


@pytest.mark.timeout(900)
def test_every_pair_of_options_passes_the_check_or_fails_in_one_line_and_a_passing_pair_trains(
    tmp_path: Path, request: pytest.FixtureRequest
):
    # every option of every group, each against every other group's
    assert len(pair_checks.pairs()) > 700
    # The checks ran in the background since the suite began (conftest.py: pair_checks.py at the
    # CPU's idle priority); this test runs last and waits for them. Run alone, it waits the whole
    # time.
    background = getattr(request.config, "pair_checks", None)
    if background is None:
        results = pair_checks.check_all()
    else:
        proc, out = background
        assert proc.wait(timeout=800) == 0, (
            f"the pair checks failed: {out.with_suffix('.log').read_text()[-3000:]}"
        )
        results = [
            (tuple(pair), outcome, what) for pair, outcome, what in json.loads(out.read_text())
        ]
    assert len(results) == len(pair_checks.pairs())
    crashed = [(pair, what) for pair, outcome, what in results if outcome == "crash"]
    assert not crashed, crashed[:10]
    long = [(pair, what) for pair, outcome, what in results if outcome == "error" and "\n" in what]
    assert not long, long[:10]
    passing = [pair for pair, outcome, _ in results if outcome == "ok"]
    assert len(passing) > 300, len(passing)
    # A bounded sample of the passing pairs trains a step: seeded (HDDP_PAIR_SEED, else 0), so a
    # failure reruns as it was; the pairs it chose are printed.
    seed = int(os.environ.get("HDDP_PAIR_SEED", "0"))
    chosen = random.Random(seed).sample(sorted(passing), 3)
    print(f"pairs trained (HDDP_PAIR_SEED={seed}): {chosen}")
    for pair in chosen:
        run_dir = tmp_path / "-".join(p.replace("=", "_").lstrip("+") for p in pair)
        proc = run_train(run_dir, *pair, "trainer.max_steps=1", "trainer.epochs=1", timeout=240)
        assert proc.returncode == 0, (
            f"{pair} passed the check but did not train (sample seed {seed})",
            proc.stderr,
        )
        assert summary(run_dir)["steps"] == 1, pair
