"""Random streams: augmentation drawn per sample from (seed, epoch, index), a model stream per rank,
and what follows from it: distinct ranks, the same training at any world size, an exact mid-epoch
resume with augmentation on. Real 2-rank gloo runs on CIFAR-10's file format."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from support import (
    assert_same_params,
    check_ok,
    final_params,
    finish,
    losses,
    run_train,
    start_train,
    summary,
    write_cifar,
)

PER_FILE = 64  # 5 training files: 320 images, 288 after validation's tenth; 9 steps of 32 an epoch


def augmented(root: Path) -> tuple[str, ...]:
    return (
        "data=cifar10",
        f"data.dataset.root={root}",
        "data.dataset.augment=true",
        "trainer.threads=1",
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
    # Every image is the same: only the crops and flips make the batches, and each rank's are its own.
    assert all(a != b for a, b in zip(*batches)), batches
    assert draws[0] != draws[1]  # the model's stream (dropout's) is the rank's own


@pytest.mark.timeout(400)
def test_augmented_training_is_the_same_at_any_world_size_and_resumes_exactly_mid_epoch(tmp_path: Path):
    root = write_cifar(tmp_path / "data", PER_FILE)
    common = (*augmented(root), "data.global_batch_size=32", "trainer.max_steps=12")
    sweep = tmp_path / "sweep"
    check_ok(
        run_train(tmp_path / "unused", "-m", *common, "trainer.nproc=1,2", f"hydra.sweep.dir={sweep}", timeout=300)
    )
    one, two = (losses(sweep / job) for job in ("0", "1"))
    assert len(one) == len(two) == 12
    # Global batch b is the same samples with the same crops and flips at either world size: only the
    # float summation order differs.
    assert two[:10] == pytest.approx(one[:10], rel=1e-6)

    # SIGTERM at step 5 of 9 in the first epoch, and resumed: the uninterrupted run, bit for bit.
    stopped = tmp_path / "stopped"
    proc = start_train(stopped, *common, "model._target_=probes.SignalAt", "+model.step=5")
    done = finish(proc, timeout=120)
    assert done.returncode == 128 + signal.SIGTERM, done.stderr
    steps = summary(stopped)["steps"]
    assert 5 <= steps < 9, steps  # mid-epoch
    check_ok(run_train(stopped, *common, "trainer.resume=auto"))
    assert summary(stopped)["steps"] == 12
    assert losses(stopped) == two
    assert_same_params(final_params(stopped), final_params(sweep / "1"))
