"""DDP communication hooks (ddp.comm_hook): each trains across real gloo ranks, and resume stays exact."""

from __future__ import annotations

import math
from pathlib import Path

from conftest import assert_same_params, check_ok, final_params, run_train, scalars, summary

HALF, FULL = 6, 12  # steps, both within the first epoch of digits on 2 ranks


def test_each_hook_trains_sends_half_the_bytes_and_resumes_exactly(tmp_path: Path):
    sent = {}
    # "none", DDP's own all-reduce, is what every other test trains with. Both hooks in one multirun,
    # whose jobs share the forkserver's imports.
    sweep = tmp_path / "sweep"
    check_ok(run_train(tmp_path / "unused", "-m", f"trainer.max_steps={FULL}", "trainer.log_every=2",
                       "ddp.comm_hook=fp16,bf16", f"hydra.sweep.dir={sweep}"))
    for job, hook in enumerate(("fp16", "bf16")):
        run_dir = sweep / str(job)
        losses = [v for _, v in scalars(run_dir, "train/loss")]
        assert len(losses) == FULL and all(math.isfinite(v) for v in losses), (hook, losses)
        assert losses[-1] < losses[0], (hook, losses)  # it learns
        s = summary(run_dir)
        assert s["comm_hook"] == hook
        sent[hook] = s["allreduce_bytes_per_step"]
    elements = sum(t.numel() for t in final_params(sweep / "0").values())
    assert sent["fp16"] == sent["bf16"] == 2 * elements  # 2 bytes a gradient element, not 4

    # Stopped halfway and resumed, a hooked run ends with the uninterrupted run's weights.
    resumed = tmp_path / "resumed"
    check_ok(run_train(resumed, f"trainer.max_steps={HALF}", "trainer.log_every=2", "ddp.comm_hook=bf16"))
    check_ok(run_train(resumed, f"trainer.max_steps={FULL}", "trainer.log_every=2", "trainer.resume=auto",
                       "ddp.comm_hook=bf16"))
    assert summary(resumed)["steps"] == FULL
    assert_same_params(final_params(resumed), final_params(sweep / "1"))
