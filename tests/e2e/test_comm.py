"""DDP communication hooks (strategy.comm_hook): each trains across real gloo ranks, and resume
stays exact."""

from __future__ import annotations

import math
from pathlib import Path

from support import (
    assert_same_params,
    check_ok,
    final_params,
    losses,
    run_train,
    step_losses,
    summary,
)

HALF, FULL = 6, 12  # steps, both within the first epoch of digits on 2 ranks


def test_each_hook_trains_sends_half_the_bytes_and_resumes_exactly(tmp_path: Path):
    sent = {}
    # Both hooks, and "none" (DDP's fp32 all-reduce through gloo) beside them, in one multirun whose
    # jobs share the forkserver's imports.
    sweep = tmp_path / "sweep"
    check_ok(
        run_train(
            tmp_path / "unused",
            "-m",
            f"trainer.max_steps={FULL}",
            "trainer.log_every=2",
            "strategy.comm_hook=fp16,bf16,none",
            "strategy.shared_memory=false",
            f"hydra.sweep.dir={sweep}",
        )
    )
    for job, hook in enumerate(("fp16", "bf16", "none")):
        run_dir = sweep / str(job)
        curve = losses(run_dir)
        assert len(curve) == FULL and all(math.isfinite(v) for v in curve), (hook, curve)
        assert curve[-1] < curve[0], (hook, curve)  # it learns
        s = summary(run_dir)
        assert s["comm_hook"] == hook
        sent[hook] = s["allreduce_bytes_per_step"]
    # What each hook handed to gloo's all-reduce, counted in the workers: half of DDP's fp32 bytes,
    # and 2 bytes for each gradient element.
    elements = sum(t.numel() for t in final_params(sweep / "0").values())
    assert sent["none"] == 4 * elements and sent["fp16"] == sent["bf16"] == sent["none"] // 2

    # Stopped halfway and resumed, a hooked run is the uninterrupted run bit for bit: every step's
    # loss once, and the final weights.
    for job, hook in enumerate(("fp16", "bf16")):
        resumed = tmp_path / f"resumed-{hook}"
        hooked = (
            "trainer.log_every=2",
            f"strategy.comm_hook={hook}",
            "strategy.shared_memory=false",
        )
        check_ok(run_train(resumed, f"trainer.max_steps={HALF}", *hooked))
        check_ok(run_train(resumed, f"trainer.max_steps={FULL}", "trainer.resume=auto", *hooked))
        assert summary(resumed)["steps"] == FULL and summary(resumed)["resumed_from"], hook
        assert step_losses(resumed) == step_losses(sweep / str(job)), hook
        assert_same_params(final_params(resumed), final_params(sweep / str(job)))


def test_powersgd_sends_low_rank_gradients_and_resumes_exactly(tmp_path: Path):
    import torch

    # Several DDP buckets (0.5 MB each of the CNN's 1.7 MB), compressing from step 4: stopped at
    # step 6 with error feedback and warm-start state in flight, and resumed.
    hook = (
        "strategy.comm_hook=powersgd",
        "strategy.powersgd.start_step=4",
        "strategy.bucket_cap_mb=0.5",
        "trainer.log_every=2",
    )
    full, resumed = tmp_path / "full", tmp_path / "resumed"
    check_ok(run_train(full, *hook, f"trainer.max_steps={FULL}"))
    curve = losses(full)
    assert len(curve) == FULL and all(math.isfinite(v) for v in curve) and curve[-1] < curve[0], (
        curve
    )

    # Rank 1, as counted on the tensors the hook handed to gloo in the last step: each weight matrix
    # as P and Q, (rows + columns) numbers, the vectors whole, 4 bytes each.
    params = final_params(full)

    def sent(t):
        rows, columns = t.shape[0], t.numel() // t.shape[0]
        return (
            rows + columns if t.dim() > 1 and 2 * (rows + columns) <= rows * columns else t.numel()
        )

    s = summary(full)
    assert s["comm_hook"] == "powersgd"
    assert s["allreduce_bytes_per_step"] == 4 * sum(sent(t) for t in params.values())
    assert s["allreduce_bytes_per_step"] * 50 < 4 * sum(t.numel() for t in params.values())

    # The checkpoint holds the state: Q of every compressed matrix, and each rank's error feedback.
    state = torch.load(full / "checkpoints" / "last.pt", weights_only=True)["comm_hook"]
    compressed = sorted(n for n, t in params.items() if sent(t) < t.numel())
    assert sorted(state["q"]) == state["error_names"] == compressed and state["step"] == FULL
    assert len(state["errors"]) == 2 and all(e.abs().sum() > 0 for e in state["errors"])

    check_ok(run_train(resumed, *hook, f"trainer.max_steps={HALF}"))
    check_ok(run_train(resumed, *hook, f"trainer.max_steps={FULL}", "trainer.resume=auto"))
    assert summary(resumed)["steps"] == FULL
    assert_same_params(final_params(resumed), final_params(full))
