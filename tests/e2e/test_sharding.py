"""How the data is split over ranks: uneven shards under DDP's Join, and a global batch that makes
training the same at any world size. Real multi-process gloo runs of train.py."""

from __future__ import annotations

import csv
from collections import Counter
from pathlib import Path

import pytest

from support import (
    assert_float64_alike,
    assert_within_float_noise,
    check_ok,
    csv_losses,
    documented,
    float64,
    run_train,
    summary,
)

TRAIN, BATCH, EPOCHS = 65, 8, 2  # 2 ranks: shards of 33 and 32 samples, 5 and 4 batches


def test_uneven_shards_see_every_sample_once_per_epoch_and_end_equal(tmp_path: Path):
    logs = tmp_path / "logs"
    logs.mkdir()
    run_dir = tmp_path / "run"
    proc = run_train(
        run_dir,
        "data=synthetic",
        "data.even_shards=false",
        f"data.batch_size={BATCH}",
        f"trainer.epochs={EPOCHS}",
        "data.dataset._target_=faulty.counted_synthetic",
        f"+data.dataset.log_dir={logs}",
        f"data.dataset.train_size={TRAIN}",
        "data.dataset.test_size=16",
        "trainer.log_every=2",
        "model._target_=faulty.Recorder",
        f"+model.log_dir={logs}",
        "backend.timeout_s=60",
        # 4 chunks of validation: both ranks evaluate, and so mark each epoch's end
        "data.eval_batch_size=4",
    )
    check_ok(proc)
    served = {
        rank: [int(i) for i in (logs / f"samples-rank{rank}.txt").read_text().split()]
        for rank in (0, 1)
    }
    # disjoint shards, no padding
    assert [len(served[0]), len(served[1])] == [33 * EPOCHS, 32 * EPOCHS]
    # every sample once an epoch
    assert Counter(served[0] + served[1]) == {i: EPOCHS for i in range(TRAIN)}
    assert summary(run_dir)["steps"] == 5 * EPOCHS  # the longer shard's batches count
    # Join gives every rank rank 0's weights after an uneven epoch; the optimizer state (momentum)
    # must follow, or the ranks' weights part at the next epoch's second step.
    epochs = [_epochs(logs / f"params-rank{rank}.txt") for rank in (0, 1)]
    assert len(epochs[0]) == len(epochs[1]) == EPOCHS
    for ours, theirs in zip(*epochs):
        assert len(ours) == 5 and len(theirs) == 4  # training forwards: one batch more on rank 0
        assert ours[:4] == theirs
    evals = [
        [v for kind, v in _records(logs / f"params-rank{rank}.txt") if kind == "eval"]
        for rank in (0, 1)
    ]
    assert evals[0] == evals[1]


def _records(path: Path) -> list[tuple[str, str]]:
    return [tuple(line.split()) for line in path.read_text().splitlines()]


def _epochs(path: Path) -> list[list[str]]:
    """Weight checksums at each training forward, one list per epoch (evaluations end an epoch)."""
    epochs, current = [], []
    for kind, value in _records(path):
        if kind == "train":
            current.append(value)
        elif current:
            epochs.append(current)
            current = []
    return epochs


@pytest.mark.timeout(600)  # three sweeps, each with a run of 4 processes on 2 cores
def test_global_batch_size_trains_the_same_at_world_sizes_1_2_and_4(tmp_path: Path):
    """The same samples in every global batch at any world size: only the order of float sums
    differs. Decided in float64 over 20 steps (FLOAT64_BOUND); float32, the default, over the first
    5 steps, against this host's float-order noise (later, a flip makes float32's gap grow past any
    noise run)."""
    # docs/usage.md's sweep: -m trainer.nproc=1,2,4 data.global_batch_size=128
    world_sizes = documented("docs/usage.md", "-m trainer.nproc=1,2,4 data.global_batch_size=128")
    common = (
        "data.drop_last=true",
        "trainer.log_every=5",
        "checkpoint.every_epoch=false",
        "trainer.threads=1",
    )
    sweep = tmp_path / "sweep"
    check_ok(
        run_train(
            tmp_path / "unused",
            *world_sizes,
            *common,
            "trainer.max_steps=20",
            *float64(),
            f"hydra.sweep.dir={sweep}",
            timeout=540,
        )
    )
    curves = {}
    for job, world in enumerate((1, 2, 4)):
        s = summary(sweep / str(job))
        assert (s["world_size"], s["batch_size"], s["global_batch_size"]) == (
            world,
            128 // world,
            128,
        )
        curves[world] = csv_losses(sweep / str(job))
        assert len(curves[world]) == 20
    for world in (2, 4):
        assert_float64_alike(curves[world], curves[1])
    rows = list(csv.DictReader(open(sweep / "scaling.csv")))
    assert [r["global_batch_size"] for r in rows] == ["128"] * 3
    # throughput, efficiency and the loss curves
    assert (sweep / "scaling.png").stat().st_size > 20_000

    # float32 over 5 steps: the world sizes, then this host's noise (one rank, 2 threads, both
    # memory formats).
    short, noise = tmp_path / "float32", tmp_path / "noise"
    check_ok(
        run_train(
            tmp_path / "unused",
            *world_sizes,
            *common,
            "trainer.max_steps=5",
            f"hydra.sweep.dir={short}",
            timeout=300,
        )
    )
    check_ok(
        run_train(
            tmp_path / "unused",
            "-m",
            "data.global_batch_size=128",
            *common[:-1],
            "trainer.max_steps=5",
            "trainer.nproc=1",
            "trainer.threads=2",
            "trainer.channels_last=true,false",
            f"hydra.sweep.dir={noise}",
            timeout=300,
        )
    )
    reference, noisy = csv_losses(short / "0"), [csv_losses(noise / job) for job in ("0", "1")]
    for job in ("1", "2"):
        # Ceiling 1e-5 over 5 steps: about 80 float32 units (1.2e-7), room for a few units of
        # reordered sums a step, compounded; a sample read twice or averaged wrongly moves a loss by
        # 1e-3 or more.
        assert_within_float_noise(csv_losses(short / job), reference, *noisy, ceiling=1e-5)
