"""A Hugging Face transformers causal language model end to end (+experiment=hf_llama: a small Llama
config, no download, vocabulary 256 over the byte-level text): dict batches with an attention mask,
the model computing its own loss, with accumulation and bf16 autocast under DDP and FSDP (its
decoder layers the sharding units; its samples preloaded); SIGTERM'd and resumed bit for bit;
eval.py reproducing the run's test metrics bit for bit at another world size; the FLOP count and
tokens/s in its summary."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest

from support import (
    ONCE,
    check_ok,
    csv_step_losses,
    documented,
    finish,
    run_eval,
    run_train,
    start_train,
    summary,
)

pytest.importorskip("transformers")  # the extra: .ci/run installs it; under CI=true a skip fails

FULL = 8
METRICS = ("test_loss", "test_accuracy", "test_perplexity", "test_samples")
COMMON = (
    "trainer.accumulate=2",
    "trainer.precision=bf16",
    "data.batch_size=16",
    "trainer.log_every=1",
    f"trainer.max_steps={FULL}",
)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_a_transformers_model_trains_resumes_after_sigterm_and_evaluates_exactly(
    tmp_path: Path, strategy: str
):
    # README.md's command under DDP, docs/tasks.md's under FSDP (its accumulation and bf16 too).
    command = {
        "ddp": (*documented("README.md", "+experiment=hf_llama"), "strategy=ddp"),
        "fsdp": documented("docs/tasks.md", "+experiment=hf_llama strategy=fsdp"),
    }[strategy]
    # FSDP's run also preloads its dict samples (whole tensors sliced per batch, a TensorTree).
    common = (*command, *COMMON, f"data.preload={strategy == 'fsdp'}")
    straight = tmp_path / "straight"
    check_ok(run_train(straight, *common, timeout=300))
    s = summary(straight)
    assert (
        s["steps"] == FULL
        and s["world_size"] == 2
        and s["metrics"] == ["loss", "accuracy", "perplexity"]
    )
    assert s["flops"]["per_sample"] > 0 and s["tokens_per_sec"] == pytest.approx(
        64 * s["samples_per_sec"]
    )
    # below ln(256) = 5.55 once it has learnt anything
    assert s["test_samples"] > 0 and 0 < s["test_loss"] < 6

    # SIGTERM at rank 0's 7th forward (step 4's first micro-batch), then resumed: the same bits.
    stopped = tmp_path / "stopped"
    probe = (
        "model._target_=probes.signal_at",
        "+model.of=hydra_ddp.hf.causal_lm",
        "+model.step=7",
        ONCE,
    )
    done = finish(start_train(stopped, *common, *probe), timeout=300)
    assert done.returncode == 128 + signal.SIGTERM, done.stderr
    assert 3 <= summary(stopped)["steps"] < FULL
    check_ok(run_train(stopped, *common, "trainer.resume=auto", timeout=300))
    assert csv_step_losses(stopped) == csv_step_losses(straight)
    assert {k: summary(stopped)[k] for k in METRICS} == {k: s[k] for k in METRICS}

    # eval.py on the checkpoint at 1 rank (the run had 2): the run's test metrics, bit for bit.
    check_ok(run_eval(tmp_path / "eval", f"ckpt={straight}", "trainer.nproc=1", timeout=300))
    result = json.loads((tmp_path / "eval" / "eval.json").read_text())
    assert {k: result[k] for k in METRICS} == {k: s[k] for k in METRICS}
