"""Continuing a run at another world size: mid-epoch, with the global batch fixed, every sample of
the epoch is trained on exactly once, under ddp and fsdp; another global batch is one line (the
resize's cause and an elastic worker's share, in process: tests/unit/test_resize.py); a per-step
schedule continues at the rate of its step."""

from __future__ import annotations

import csv
from collections import Counter
from pathlib import Path

import pytest

from hydra_ddp.recipe import schedules

from support import assert_float64_alike, check_ok, csv_losses, float64, run_train, summary

TRAIN_SAMPLES = 1438  # the digits' training split (1,797 less the 359 held out for test)
RECORDED = (
    "data.dataset._target_=recording.digits_recording_train",
    "data.val_fraction=0",
    "data.global_batch_size=32",
    "trainer.epochs=1",
    "scheduler=warmup_linear",  # per optimizer step: its rate after the resize is checked too
    "scheduler.warmup_steps=2",
)


def _read(reads: Path) -> Counter:
    return Counter(
        int(line.split()[0])
        for path in reads.glob("*.txt")
        for line in path.read_text().splitlines()
    )


@pytest.mark.timeout(400)
def test_a_mid_epoch_checkpoint_continues_at_another_world_size_with_every_sample_once(
    tmp_path: Path,
):
    first = tmp_path / "first"
    # Stopped at step 3 of 45, mid-epoch, at 1 and at 2 ranks, under ddp and fsdp (a file; a sharded
    # directory).
    check_ok(
        run_train(
            tmp_path / "unused",
            "-m",
            *RECORDED,
            "trainer.nproc=1,2",
            "strategy=ddp,fsdp",
            "trainer.max_steps=3",
            "checkpoint.every_n_steps=3",
            "+data.dataset.reads=${hydra:runtime.output_dir}/reads",
            f"hydra.sweep.dir={first}",
            timeout=300,
        )
    )
    for job in range(4):
        before = summary(first / str(job))
        after, world = tmp_path / f"after{job}", 3 - before["world_size"]  # 1 → 2, 2 → 1
        check_ok(
            run_train(
                after,
                *RECORDED,
                f"trainer.nproc={world}",
                f"strategy={before['strategy']}",
                f"trainer.resume={next((first / str(job) / 'checkpoints').glob('step-00000003*'))}",
                f"+data.dataset.reads={after / 'reads'}",
            )
        )
        seen = _read(first / str(job) / "reads") + _read(after / "reads")
        # three global batches, no read ahead
        assert sum(_read(first / str(job) / "reads").values()) == 3 * 32, job
        assert seen == Counter(range(TRAIN_SAMPLES)), (
            job,
            [i for i, n in seen.items() if n != 1][:10],
        )
        s = summary(after)
        assert (s["world_size"], s["strategy"], s["steps"], s["global_batch_size"]) == (
            world,
            before["strategy"],
            45,
            32,
        )
        # The run's length is the same at the new world size (the global batch is): each step's rate
        # is the one the schedule gives that step of 45, as an unresized run's would be.
        shape = schedules.Shape(total=45, warmup=2, decay_from=2, decay="linear")
        with open(after / "metrics.csv", newline="") as f:
            rates = [
                (int(r["step"]), float(r["train/lr"])) for r in csv.DictReader(f) if r["train/lr"]
            ]
        assert rates == [(step, 0.02 * shape.factor(step - 1)) for step in range(4, 46)], job
        assert s["world_size_history"] == [
            {"step": 0, "world_size": before["world_size"], "cause": "start"},
            {"step": 3, "from": before["world_size"], "world_size": world, "cause": "resume"},
        ]
    # The control: continued from the same checkpoint without its position (its weights alone,
    # trainer.init_from), the epoch starts over at the new world size (transformers #40245): the
    # count above finds the first three batches' samples read twice.
    job, again = first / "0", tmp_path / "weights_alone"
    check_ok(
        run_train(
            again,
            *RECORDED,
            f"trainer.nproc={3 - summary(job)['world_size']}",
            f"trainer.init_from={next((job / 'checkpoints').glob('step-00000003*'))}",
            f"+data.dataset.reads={again / 'reads'}",
        )
    )
    repeated = _read(job / "reads") + _read(again / "reads")
    assert repeated != Counter(range(TRAIN_SAMPLES))
    assert sum(n == 2 for n in repeated.values()) == 3 * 32


def test_a_mid_epoch_resume_with_another_global_batch_is_one_line(tmp_path: Path):
    first = tmp_path / "first"
    check_ok(
        run_train(
            first,
            "trainer.nproc=1",
            "data.batch_size=32",
            "trainer.max_steps=3",
            "checkpoint.every_n_steps=3",
            "trainer.epochs=1",
        )
    )
    proc = run_train(
        tmp_path / "after",
        "trainer.nproc=2",
        "data.batch_size=32",
        "trainer.epochs=1",
        f"trainer.resume={first / 'checkpoints' / 'step-00000003.pt'}",
    )
    assert proc.returncode != 0
    line = [line for line in proc.stderr.splitlines() if line.startswith("hydra-ddp: error:")]
    assert (
        len(line) == 1
        and "stopped mid-epoch with a global batch of 32 samples per optimizer "
        "step, this run has 64: resume with data.global_batch_size=32 (the "
        "micro-batch or the accumulation follows the world size)"
        in line[0]
    ), proc.stderr


@pytest.mark.timeout(400)
def test_a_resize_keeps_the_micro_batch_and_changes_the_accumulation_with_every_sample_once(
    tmp_path: Path,
):
    # A global batch of 32 in micro-batches of 8: 2 ranks accumulate 2, then (resumed mid-epoch, at
    # step 3) 1 rank accumulates 4. Every sample of the epoch once, and the whole run as an
    # uninterrupted one of 2 ranks but for the order of its float64 sums.
    common = (*RECORDED, "data.batch_size=8", "trainer.log_every=1", *float64())
    first, after, straight = tmp_path / "first", tmp_path / "after", tmp_path / "straight"
    stop = ("trainer.max_steps=3", "checkpoint.every_n_steps=3")
    check_ok(
        run_train(
            first, *common, "trainer.nproc=2", *stop, f"+data.dataset.reads={first / 'reads'}"
        )
    )
    assert (summary(first)["accumulate"], summary(first)["global_batch_size"]) == (2, 32)
    resume = f"trainer.resume={first / 'checkpoints' / 'step-00000003.pt'}"
    check_ok(
        run_train(
            after, *common, "trainer.nproc=1", resume, f"+data.dataset.reads={after / 'reads'}"
        )
    )
    s = summary(after)
    assert (
        s["world_size"],
        s["batch_size"],
        s["accumulate"],
        s["global_batch_size"],
        s["steps"],
    ) == (1, 8, 4, 32, 45)
    assert sum(_read(first / "reads").values()) == 3 * 32  # three global batches, no read ahead
    assert _read(first / "reads") + _read(after / "reads") == Counter(range(TRAIN_SAMPLES))
    check_ok(
        run_train(straight, *common, "trainer.nproc=2", f"+data.dataset.reads={straight / 'reads'}")
    )
    resized = csv_losses(first)[:3] + csv_losses(after)
    assert_float64_alike(
        resized + [s["test_loss"]], csv_losses(straight) + [summary(straight)["test_loss"]]
    )
