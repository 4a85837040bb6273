"""The training recipe end to end: a per-step warmup schedule resumed bit for bit mid-warmup with
accumulation (losses and rates), the same rates at another world size for one global batch; the
weight-decay groups under FSDP, resumed bit for bit; activation checkpointing's losses equal to
the same run's without it, under DDP and FSDP; the weights' moving average evaluated, checkpointed
(FSDP: sharded), resumed bit for bit, read by eval.py and written by the export."""

from __future__ import annotations

import csv
import json
import re
import signal
from pathlib import Path

import pytest
import torch

from support import (
    ONCE,
    check_ok,
    csv_step_losses,
    documented,
    finish,
    run_eval,
    run_export,
    run_train,
    start_train,
    summary,
)


def csv_rates(run_dir: Path) -> list[tuple[int, str]]:
    """metrics.csv's per-step learning rates, as written."""
    with open(run_dir / "metrics.csv", newline="") as f:
        return [(int(r["step"]), r["train/lr"]) for r in csv.DictReader(f) if r.get("train/lr")]


WARMUP = (
    "scheduler=warmup_cosine",
    "scheduler.warmup_steps=8",
    "trainer.accumulate=2",
    "trainer.max_steps=14",
    "trainer.log_every=1",
    "trainer.threads=1",
    "data.global_batch_size=64",
)


@pytest.mark.timeout(300)
def test_a_warmup_schedule_resumes_mid_warmup_bit_for_bit_and_is_the_same_at_any_world_size(
    tmp_path: Path,
):
    straight = tmp_path / "straight"
    check_ok(run_train(straight, *WARMUP))
    rates = csv_rates(straight)
    assert [step for step, _ in rates] == list(range(1, 15))
    values = [float(rate) for _, rate in rates]
    warmup = [0.02 * k / 8 for k in range(1, 9)]  # per optimizer step, from optim=sgd's lr 0.02
    assert values[:8] == pytest.approx(warmup)
    assert values[8] == pytest.approx(0.02) and values[-1] < values[8] / 2  # then the cosine
    # The control: the same schedule stepped per micro-batch (accelerate #963;
    # tests/helpers/per_micro_batch.py) fails those rates from its second step on.
    micro = tmp_path / "per_micro_batch"
    check_ok(run_train(micro, *WARMUP, "scheduler._target_=per_micro_batch.warmup_cosine"))
    stepped = [float(rate) for _, rate in csv_rates(micro)]
    assert len(stepped) == 14 and stepped[0] == pytest.approx(warmup[0])
    assert all(got != pytest.approx(want) for got, want in zip(stepped[1:4], warmup[1:4]))

    # SIGTERM at rank 0's 9th forward: the 5th optimizer step (of 2 batches each), mid-warmup.
    stopped = tmp_path / "stopped"
    probe = (
        "model._target_=probes.signal_at",
        "+model.of=hydra_ddp.models.MnistCNN",
        "+model.step=9",
        ONCE,
    )
    done = finish(start_train(stopped, *WARMUP, *probe))
    assert done.returncode == 128 + signal.SIGTERM, done.stderr
    assert 3 <= summary(stopped)["steps"] < 8
    check_ok(run_train(stopped, *WARMUP, "trainer.resume=auto"))
    assert csv_rates(stopped) == rates and csv_step_losses(stopped) == csv_step_losses(straight)

    # One rank, the same global batch: the same steps, so the same rate at every step, to the bit.
    alone = tmp_path / "alone"
    check_ok(run_train(alone, *WARMUP, "trainer.nproc=1"))
    assert csv_rates(alone) == rates


SHORT = ("trainer.max_steps=6", "trainer.log_every=1", "trainer.threads=1")
GPT = ("+experiment=text_gpt", *SHORT)


def decay_line(run_dir: Path) -> str:
    """Rank 0's report of the weight-decay groups (its log line, without the time stamp)."""
    lines = [
        line for line in (run_dir / "train.log").read_text().splitlines() if "[rank 0]" in line
    ]
    found = [re.sub(r"^.*\] - ", "", line) for line in lines if "weight decay" in line]
    assert len(found) == 1, found  # reported once
    return found[0]


@pytest.mark.timeout(400)
def test_the_decay_groups_are_the_models_own_names_under_fsdp_and_resume_bit_for_bit(
    tmp_path: Path,
):
    ddp = tmp_path / "ddp"
    check_ok(run_train(ddp, *GPT, "trainer.max_steps=1"))
    # TinyGPT at dim 128, depth 4: its linears' weights decay (4 × 6 + the head), the rest do not.
    assert decay_line(ddp).startswith(
        "weight decay 0.1 on 25 tensors (819,200 parameters); none on 44 tensors"
    )

    # README.md's sharded transformer
    fsdp = (*documented("README.md", "strategy=fsdp +experiment=text_gpt"), *SHORT)
    straight = tmp_path / "straight"
    check_ok(run_train(straight, *fsdp))
    # FSDP's sharded parameters, by the model's names
    assert decay_line(straight) == decay_line(ddp)
    stopped = tmp_path / "stopped"
    probe = (
        "model._target_=probes.signal_at",
        "+model.of=hydra_ddp.models.TinyGPT",
        "+model.step=4",
        ONCE,
    )
    done = finish(start_train(stopped, *fsdp, *probe), timeout=300)
    assert done.returncode == 128 + signal.SIGTERM, done.stderr
    check_ok(run_train(stopped, *fsdp, "trainer.resume=auto"))
    assert csv_step_losses(stopped) == csv_step_losses(straight) and csv_rates(
        stopped
    ) == csv_rates(straight)


@pytest.mark.timeout(400)
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_activation_checkpointing_trains_the_same_bits(tmp_path: Path, strategy: str):
    plain, checkpointed = tmp_path / "plain", tmp_path / "checkpointed"
    # Under FSDP, the commands README.md and docs/transformer.md give.
    commands = {
        "ddp": (
            ("+experiment=text_gpt", "strategy=ddp"),
            ("+experiment=text_gpt", "strategy=ddp", "strategy.activation_checkpointing=full"),
        ),
        "fsdp": (
            documented("README.md", "strategy=fsdp +experiment=text_gpt"),
            documented("docs/transformer.md", "strategy.activation_checkpointing=full"),
        ),
    }
    without, with_checkpointing = commands[strategy]
    check_ok(run_train(plain, *without, *SHORT))
    check_ok(run_train(checkpointed, *with_checkpointing, *SHORT))
    assert len(csv_step_losses(plain)) == 6
    assert csv_step_losses(checkpointed) == csv_step_losses(plain)
    assert summary(checkpointed)["test_loss"] == summary(plain)["test_loss"]


EMA_RUNS = {
    # the default CNN on the digits, checkpointed per epoch (a file); the GPT under FSDP (shards)
    "ddp": (
        "trainer.max_steps=30",
        "trainer.log_every=1",
        "trainer.threads=1",
        "data.global_batch_size=64",
    ),
    "fsdp": (*GPT, "strategy=fsdp"),
}
PROBES = {
    "ddp": (
        "model._target_=probes.signal_at",
        "+model.of=hydra_ddp.models.MnistCNN",
        "+model.step=17",
        ONCE,
    ),
    "fsdp": (
        "model._target_=probes.signal_at",
        "+model.of=hydra_ddp.models.TinyGPT",
        "+model.step=4",
        ONCE,
    ),
}


@pytest.mark.timeout(500)
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_the_weights_average_is_evaluated_checkpointed_resumed_and_exported(
    tmp_path: Path, strategy: str
):
    from safetensors.torch import load_file

    from hydra_ddp.checkpoint import files

    common = (*EMA_RUNS[strategy], "trainer.ema.decay=0.8")
    straight = tmp_path / "straight"
    check_ok(run_train(straight, *common))
    s = summary(straight)
    assert s["tested"]["ema"] is True
    metrics = [f"test_{name}" for name in s["metrics"]]
    test = {k: s[k] for k in metrics}

    # SIGTERM mid-run and resumed: the same losses, and the same average (the test reads it), to the
    # bit.
    stopped = tmp_path / "stopped"
    done = finish(start_train(stopped, *common, *PROBES[strategy]), timeout=300)
    assert done.returncode == 128 + signal.SIGTERM, done.stderr
    assert 0 < summary(stopped)["steps"] < s["steps"]
    check_ok(run_train(stopped, *common, "trainer.resume=auto", timeout=300))
    assert csv_step_losses(stopped) == csv_step_losses(straight)
    assert {k: summary(stopped)[k] for k in metrics} == test
    assert summary(stopped)["history"] == s["history"]  # each validation, of the average

    # The checkpoint holds both, in the strategy's layout (FSDP: each rank's shards of the average).
    path = files.find(str(straight), "ckpt")
    state = files.read(path, "ckpt")
    assert path.is_dir() == (strategy == "fsdp") and files.evaluated(state) == "ema"
    assert state["ema"].keys() == state["model"].keys()

    # eval.py evaluates the average, at one rank: the run's test metrics, bit for bit.
    check_ok(run_eval(tmp_path / "eval", f"ckpt={straight}", "trainer.nproc=1", timeout=300))
    result = json.loads((tmp_path / "eval" / "eval.json").read_text())
    assert result["weights"] == "ema" and {k: result[k] for k in test} == test

    # The export writes the average: the tested weights, not the last trained ones.
    out = tmp_path / "model.safetensors"
    exported = run_export(f"ckpt={straight}", f"out={out}")
    assert exported.returncode == 0, exported.stderr
    weights = load_file(str(out))
    assert "weights: ema" in out.with_name("model.yaml").read_text()
    average = files.model_weights(path, state)
    assert all(torch.equal(weights[k], average[k]) for k in average)
    trained = state["model"] if not path.is_dir() else None
    if trained is not None:
        assert any(
            not torch.equal(weights[k], trained[k])
            for k in trained
            if trained[k].is_floating_point()
        )
