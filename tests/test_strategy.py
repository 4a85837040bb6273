"""strategy=fsdp (FSDP2) against DDP on real gloo ranks: the same losses, exact resume, resharding."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from conftest import (
    assert_same_params, check_ok, final_params, finish, run_train, scalars, start_train, summary, wait_for,
)

STEPS = 24  # an epoch of digits on 2 ranks is 21 steps: one checkpoint at its end, at step 21
COMMON = (f"trainer.max_steps={STEPS}", "trainer.log_every=2", "checkpoint.every_n_steps=4")


def losses(run_dir: Path) -> list[float]:
    return [v for _, v in scalars(run_dir, "train/loss")]


@pytest.mark.timeout(400)
def test_fsdp_trains_like_ddp_resumes_exactly_and_reshards(tmp_path: Path):
    ddp, fsdp, stopped = tmp_path / "ddp", tmp_path / "fsdp", tmp_path / "stopped"
    check_ok(run_train(ddp, *COMMON))
    check_ok(run_train(fsdp, *COMMON, "strategy=fsdp"))
    # The same global batches: the step losses agree (sums may run in another order as they grow).
    a, b = losses(ddp), losses(fsdp)
    assert len(a) == len(b) == STEPS
    assert b[:10] == pytest.approx(a[:10], rel=1e-6) and b == pytest.approx(a, rel=1e-4)
    s = summary(fsdp)
    assert s["strategy"] == "fsdp" and summary(ddp)["strategy"] == "ddp"
    # Sharded: each rank holds about half of DDP's parameters, gradients and optimizer state.
    ratio = s["model_state_bytes"]["total"] / summary(ddp)["model_state_bytes"]["total"]
    assert 0.45 < ratio < 0.55, (s["model_state_bytes"], summary(ddp)["model_state_bytes"])

    # Stopped by SIGTERM and resumed at 2 ranks: the uninterrupted run's weights, bit for bit.
    proc = start_train(stopped, *COMMON, "strategy=fsdp")
    wait_for(lambda: (stopped / "checkpoints" / "step-00000004.pt").exists(), 90, "the first checkpoint", proc)
    os.kill(proc.pid, signal.SIGTERM)
    done = finish(proc, timeout=60)
    assert done.returncode == 128 + signal.SIGTERM, done.stderr
    check_ok(run_train(stopped, *COMMON, "strategy=fsdp", "trainer.resume=auto"))
    assert summary(stopped)["steps"] == STEPS
    assert_same_params(final_params(stopped), final_params(fsdp))
    assert losses(stopped) == losses(fsdp)

    # The epoch-end checkpoint (step 21, validated there) resumed on 1 rank, and under ddp: the same
    # step, the same weights, so the same validation loss (evaluation is exact at any world size).
    epoch_end = fsdp / "checkpoints" / "step-00000021.pt"
    at_21 = next(h for h in s["history"] if h["step"] == 21)
    for name, overrides in (("one-rank", ("trainer.nproc=1", "strategy=fsdp")), ("as-ddp", ("strategy=ddp",))):
        check_ok(run_train(tmp_path / name, "trainer.max_steps=21", *overrides, f"trainer.resume={epoch_end}"))
        resumed = summary(tmp_path / name)
        assert resumed["steps"] == 21 and resumed["val_loss"] == pytest.approx(at_21["val_loss"], rel=1e-6, abs=0)


# The transformer, small: 2 blocks of width 32 on 64 KiB of text (25 steps an epoch at 2 ranks).
GPT = ("+experiment=text_gpt", "model.dim=32", "model.depth=2", "data.dataset.context=32",
       "data.dataset.max_bytes=65536", "trainer.max_steps=20", "trainer.log_every=2")


def test_fsdp_trains_the_transformer_like_ddp_with_its_blocks_as_units(tmp_path: Path):
    for name in ("ddp", "fsdp"):
        check_ok(run_train(tmp_path / name, *GPT, f"strategy={name}"))
    a, b = losses(tmp_path / "ddp"), losses(tmp_path / "fsdp")
    assert len(a) == len(b) == 20
    assert b[:10] == pytest.approx(a[:10], rel=1e-6) and b == pytest.approx(a, rel=1e-4)
    held = {name: summary(tmp_path / name)["model_state_bytes"]["total"] for name in ("ddp", "fsdp")}
    assert 0.45 < held["fsdp"] / held["ddp"] < 0.55, held
