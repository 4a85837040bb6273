"""Data the tests make for themselves (nothing is downloaded): files in the formats the project reads."""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np


def write_cifar(root: Path, per_batch: int = 20, identical: bool = False) -> Path:
    """CIFAR-10's python batches (data_batch_1…5, test_batch, batches.meta) under
    root/cifar-10-batches-py, of random images; or of one image repeated (`identical`: then only
    augmentation tells two samples apart). Returns root."""
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        images = rng.integers(0, 256, (per_batch, 3072), dtype=np.uint8)
        if identical:
            images[:] = np.arange(3072) % 251  # a pattern that crops and flips change
        batch = {"data": images, "labels": rng.integers(0, 10, per_batch).tolist()}
        (folder / name).write_bytes(pickle.dumps(batch))
    (folder / "batches.meta").write_bytes(pickle.dumps({"label_names": [f"class{i}" for i in range(10)]}))
    return root


def relative_gaps(got: list[float], expected: list[float]) -> list[float]:
    """|got - expected| / |expected| step by step, as a running maximum (the gap so far)."""
    assert len(got) == len(expected), (len(got), len(expected))
    gaps, worst = [], 0.0
    for a, b in zip(got, expected):
        worst = max(worst, abs(a - b) / max(abs(b), 1e-12))
        gaps.append(worst)
    return gaps


def assert_within_float_noise(got: list[float], expected: list[float], *noise: list[float],
                              factor: float = 10.0, floor: float = 1e-6) -> None:
    """`got` trains like `expected` but for the order of float sums. How far that order alone moves a
    run depends on the CPU's kernels and grows with the steps (chaotically, at a rate no fixed
    tolerance knows: 1e-7 on one host can be 7e-4 twenty steps later on another), so the bound is
    measured on this host, in this test: `noise` holds `expected`'s run trained again with only the
    summation order changed (other CPU threads, another memory format). At every step the gap so far
    must stay within `factor` times the largest such gap so far, or within `floor` (where the
    noise runs happen to agree bit for bit)."""
    limit = [max(column) for column in zip(*(relative_gaps(run, expected) for run in noise))]
    gaps = relative_gaps(got, expected)
    bad = [(step, gap, bound) for step, (gap, bound) in enumerate(zip(gaps, limit), 1)
           if gap > factor * bound + floor]
    assert not bad, (f"gap beyond {factor}x this host's float-order noise (+{floor}) at (step, gap, noise): "
                     f"{[(s, f'{g:.2e}', f'{b:.2e}') for s, g, b in bad[:5]]}")
