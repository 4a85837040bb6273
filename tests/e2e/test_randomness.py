"""Random streams: augmentation drawn per sample from (seed, epoch, index), a model stream per rank,
and what follows from it: distinct ranks, the same training at any world size, an exact mid-epoch
resume with augmentation on. Real 2-rank gloo runs on CIFAR-10's file format."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from support import (
    ONCE,
    assert_float64_alike,
    assert_same_run,
    assert_within_float_noise,
    check_ok,
    csv_losses,
    finish,
    float64,
    run_train,
    start_train,
    summary,
    write_cifar,
)

PER_FILE = 64  # 5 training files: 320 images, 288 after validation's tenth; 9 steps of 32 an epoch


def augmented(root: Path, threads: int = 1) -> tuple[str, ...]:
    return (
        "data=cifar10",
        f"data.dataset.root={root}",
        "data.dataset.augment=true",
        f"trainer.threads={threads}",
        "trainer.log_every=2",
    )


def test_two_ranks_augment_their_batches_differently_and_draw_their_own_numbers(tmp_path: Path):
    probes = tmp_path / "probes"
    probes.mkdir()
    root = write_cifar(tmp_path / "data", PER_FILE, identical=True)
    check_ok(
        run_train(
            tmp_path / "run",
            *augmented(root),
            "data.batch_size=16",
            "trainer.max_steps=3",
            "model._target_=probes.InputProbe",
            f"+model.probe_dir={probes}",
        )
    )
    seen = [(probes / f"inputs-rank{rank}.txt").read_text().splitlines() for rank in (0, 1)]
    batches = [[line for line in lines if line.startswith("batch")] for lines in seen]
    draws = [[line for line in lines if line.startswith("draw")] for lines in seen]
    assert len(batches[0]) == len(batches[1]) == 3
    # Every image is the same: only the crops and flips make the batches, and each rank's are its
    # own.
    assert all(a != b for a, b in zip(*batches)), batches
    assert draws[0] != draws[1]  # the model's stream (dropout's) is the rank's own


def _sweep(tmp_path: Path, name: str, *overrides: str) -> Path:
    """A multirun of train.py under tmp_path/name: job i's run in its folder i."""
    check_ok(
        run_train(
            tmp_path / "unused", "-m", *overrides, f"hydra.sweep.dir={tmp_path / name}", timeout=300
        )
    )
    return tmp_path / name


@pytest.mark.timeout(600)  # three multiruns of 2 runs each, a stopped run and its resume
def test_augmented_training_is_the_same_at_any_world_size_and_resumes_exactly_mid_epoch(
    tmp_path: Path,
):
    """Global batch b is the same samples with the same crops and flips at world sizes 1 and 2: only
    the order of float sums differs. Decided in float64 over every step (FLOAT64_BOUND); float32,
    the default, over the first 5 steps against this host's float-order noise (later, a flip makes
    float32's gap grow past any noise run). A SIGTERM mid-epoch, resumed, is the uninterrupted run
    of the same world size and threads, bit for bit."""
    root = write_cifar(tmp_path / "data", PER_FILE)
    common = (*augmented(root), "data.global_batch_size=32", "trainer.max_steps=12")
    wide = _sweep(tmp_path, "float64", *common, "trainer.nproc=1,2", *float64())
    one, two = (csv_losses(wide / job) for job in ("0", "1"))
    assert len(one) == len(two) == 12
    assert_float64_alike(two, one)

    # float32 over 5 steps: the world sizes, then this host's noise (one rank, 2 threads, both
    # memory formats).
    short = _sweep(tmp_path, "float32", *common, "trainer.nproc=1,2")
    one, two = (csv_losses(short / job) for job in ("0", "1"))
    assert len(one) == len(two) == 12
    noise = _sweep(
        tmp_path,
        "noise",
        *augmented(root, threads=2),
        "data.global_batch_size=32",
        "trainer.max_steps=5",
        "trainer.nproc=1",
        "trainer.channels_last=true,false",
    )
    # Ceiling 1e-5 as in test_sharding.py (about 80 float32 units over 5 steps); a crop or a flip
    # drawn differently, or a sample read twice, moves a loss by 1e-3 or more.
    assert_within_float_noise(
        two[:5], one[:5], *(csv_losses(noise / job) for job in ("0", "1")), ceiling=1e-5
    )

    # SIGTERM at step 5 of 9 in the first epoch, and resumed: the uninterrupted run of 2 ranks, bit
    # for bit (every step's loss once, in TensorBoard and metrics.csv, and the final weights).
    stopped = tmp_path / "stopped"
    proc = start_train(stopped, *common, "model._target_=probes.SignalAt", "+model.step=5", ONCE)
    done = finish(proc, timeout=120)
    assert done.returncode == 128 + signal.SIGTERM, done.stderr
    steps = summary(stopped)["steps"]
    assert 5 <= steps < 9, steps  # mid-epoch
    check_ok(run_train(stopped, *common, "trainer.resume=auto"))
    assert summary(stopped)["steps"] == 12
    assert_same_run(stopped, short / "1")
