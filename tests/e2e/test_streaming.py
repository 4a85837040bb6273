"""Sharded data read in shard windows (data=shards), through the real launcher and loader workers:
every sample once per epoch at 1, 2 and 3 ranks with and without loader workers; a mid-epoch stop
continued bit for bit; a resume at another world size reading every remaining sample once; the
test split's metrics the same at any world size and the same as the in-memory digits'; a damaged
shard one line."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from hydra_ddp.data import digits, shards

from support import (
    ONCE,
    assert_same_run,
    check_ok,
    csv_step_losses,
    documented,
    finish,
    run_eval,
    run_train,
    start_train,
    summary,
)

TRAIN_SAMPLES = 1438  # the digits' training split, as data=digits holds it


@pytest.fixture(scope="module")
def shard_dir(tmp_path_factory) -> Path:
    """The default digits as 180 training shards of 8 (the last of 6) and 45 test shards."""
    root = tmp_path_factory.mktemp("digits-shards")
    train, test = digits()
    shards.write(root, {"train": train, "test": test}, 8, {"in_channels": 1, "image_size": 28})
    return root


def _reads(folder: Path) -> Counter:
    return Counter(
        int(line.split()[0])
        for path in folder.glob("*.txt")
        for line in path.read_text().splitlines()
    )


def _recorded(root: Path, window: int = 100) -> tuple[str, ...]:
    return (
        "data=shards",
        f"data.dataset.root={root}",
        "data.dataset._target_=recording.sharded_recording_train",
        f"data.dataset.shuffle_window={window}",
        "data.val_fraction=0",
        "data.global_batch_size=32",
    )


@pytest.mark.timeout(400)
def test_one_epoch_reads_every_sample_once_at_1_2_and_3_ranks_with_and_without_loader_workers(
    tmp_path: Path, shard_dir: Path
):
    sweep = tmp_path / "sweep"
    check_ok(
        run_train(
            tmp_path / "unused",
            "-m",
            *_recorded(shard_dir),
            "data.global_batch_size=null",
            "data.batch_size=16",
            "data.even_shards=false",  # disjoint shares: every sample exactly once, none repeated
            "trainer.epochs=1",
            "trainer.nproc=1,2,3",
            "data.num_workers=0,2",
            "+data.dataset.reads=${hydra:runtime.output_dir}/reads",
            f"hydra.sweep.dir={sweep}",
            timeout=360,
        )
    )
    jobs = sorted(sweep.glob("[0-9]*"), key=lambda p: int(p.name))
    assert len(jobs) == 6
    for job in jobs:
        s = summary(job)
        seen = _reads(job / "reads")
        assert seen == Counter(range(TRAIN_SAMPLES)), (
            job.name,
            [i for i, n in seen.items() if n != 1][:10],
        )
        assert s["epochs"] == 1 and s["world_size"] in (1, 2, 3), job.name


@pytest.mark.timeout(400)
def test_a_mid_epoch_stop_continues_with_the_uninterrupted_runs_samples_bit_for_bit(
    tmp_path: Path, shard_dir: Path
):
    common = (
        "data=shards",
        f"data.dataset.root={shard_dir}",
        "data.dataset.shuffle_window=64",
        "data.num_workers=2",
        "data.persistent_workers=true",
        "trainer.epochs=2",  # the stop mid-epoch 1, the resumed run through epoch 2's new order
        "trainer.log_every=1",
    )
    straight = tmp_path / "straight"
    check_ok(
        run_train(
            straight, *common, "checkpoint.every_n_steps=5", "checkpoint.keep=10", timeout=300
        )
    )
    # SIGTERM at rank 0's 9th forward (of 23 a epoch): the run stops where the ranks agree,
    # checkpointed.
    stopped = tmp_path / "stopped"
    probe = (
        "model._target_=probes.signal_at",
        "+model.of=hydra_ddp.models.MnistCNN",
        "+model.step=9",
        ONCE,
    )
    done = finish(start_train(stopped, *common, *probe), timeout=300)
    assert done.returncode == 128 + signal.SIGTERM, done.stderr
    assert 0 < summary(stopped)["steps"] < 23
    check_ok(run_train(stopped, *common, "trainer.resume=auto", timeout=300))
    assert csv_step_losses(stopped) == csv_step_losses(straight)
    metrics = ("test_loss", "test_accuracy")
    assert {k: summary(stopped)[k] for k in metrics} == {k: summary(straight)[k] for k in metrics}

    # A run killed outright (SIGKILL, a lost node) restarts from its last step checkpoint: step 15
    # of 46, mid-epoch, continued in a run directory of its own.
    restarted = tmp_path / "restarted"
    checkpoint = straight / "checkpoints" / "step-00000015.pt"
    check_ok(run_train(restarted, *common, f"trainer.resume={checkpoint}", timeout=300))
    assert csv_step_losses(restarted) == [row for row in csv_step_losses(straight) if row[0] > 15]

    # The test split, streamed at 1 and at 2 ranks, and the same samples held in memory
    # (data=digits): the same chunks, so the same metrics, to the bit.
    results = []
    for name, overrides in (
        ("one", ("data=shards", f"data.dataset.root={shard_dir}", "trainer.nproc=1")),
        (
            "two",
            (
                "data=shards",
                f"data.dataset.root={shard_dir}",
                "trainer.nproc=2",
                "data.num_workers=2",
            ),
        ),
        ("memory", ("data=digits", "trainer.nproc=2")),
    ):
        # One thread per rank at either world size: the same kernels, so the same sums in each
        # chunk.
        settings = ("data.eval_batch_size=72", "trainer.threads=1")
        check_ok(run_eval(tmp_path / name, f"ckpt={straight}", *overrides, *settings, timeout=300))
        result = json.loads((tmp_path / name / "eval.json").read_text())
        results.append({key: result[key] for key in ("test_loss", "test_accuracy", "test_samples")})
    assert results[0] == results[1] == results[2], results
    assert results[0]["test_samples"] == 359


@pytest.mark.timeout(400)
def test_a_resume_at_another_world_size_reads_every_remaining_sample_once(
    tmp_path: Path, shard_dir: Path
):
    first = tmp_path / "first"
    # Stopped at step 3 of 45 at 2 ranks (no loader workers: nothing read ahead), continued at 1.
    check_ok(
        run_train(
            first,
            *_recorded(shard_dir),
            "trainer.nproc=2",
            "trainer.epochs=1",
            "trainer.max_steps=3",
            "checkpoint.every_n_steps=3",
            f"+data.dataset.reads={first / 'reads'}",
        )
    )
    after = tmp_path / "after"
    check_ok(
        run_train(
            after,
            *_recorded(shard_dir),
            "trainer.nproc=1",
            "trainer.epochs=1",
            f"trainer.resume={next((first / 'checkpoints').glob('step-00000003*'))}",
            f"+data.dataset.reads={after / 'reads'}",
        )
    )
    assert sum(_reads(first / "reads").values()) == 3 * 32  # three global batches
    seen = _reads(first / "reads") + _reads(after / "reads")
    assert seen == Counter(range(TRAIN_SAMPLES)), [i for i, n in seen.items() if n != 1][:10]
    s = summary(after)
    assert (s["world_size"], s["steps"], s["global_batch_size"]) == (1, 45, 32)


@pytest.mark.timeout(300)
def test_a_damaged_shard_is_one_line_before_launch_or_when_read(tmp_path: Path, shard_dir: Path):
    root = tmp_path / "shards"
    shutil.copytree(shard_dir, root)
    shard = root / "train-000007.shard"
    content = shard.read_bytes()
    shard.write_bytes(content[:-100])  # truncated: its size tells, before anything starts
    refused = run_train(tmp_path / "refused", "data=shards", f"data.dataset.root={root}")
    assert refused.returncode == 2
    assert (
        refused.stderr.strip()
        .splitlines()[-1]
        .endswith(
            f"shard {shard} has {len(content) - 100} bytes, its manifest says "
            f"{len(content)} (truncated or rewritten); write the shards again "
            "(python -m hydra_ddp.tools.shards write DIR --source digits)"
        )
    ), refused.stderr
    assert not (tmp_path / "refused").exists()

    # its size intact, its header broken: found by the rank reading it
    shard.write_bytes(b"garbage!" + content[8:])
    failed = run_train(
        tmp_path / "failed", "data=shards", f"data.dataset.root={root}", "data.num_workers=2"
    )
    assert failed.returncode != 0
    last = failed.stderr.strip().splitlines()[-1]
    assert f"shard {shard} is corrupt (not a shard file (bad magic or header length))" in last, (
        failed.stderr
    )
    assert "Traceback" not in failed.stderr and "Caught" not in last


@pytest.mark.timeout(500)
def test_tokenized_documents_stream_from_shards_with_the_same_guarantees(tmp_path: Path):
    # Documents of different lengths, tokenized and written by the shard tool (each document's ids
    # whole: a ragged field; the tokenizer beside the manifest), padded per batch as data=documents
    # pads. docs/language_models.md's command, run in tmp_path (its folder is relative), cut down.
    write = documented("docs/language_models.md", "--source documents")
    root = tmp_path / write[1]  # write DIR: the folder the command names, under tmp_path
    source = ("--arg", "context=48", "--arg", "vocab_size=300", "--arg", "max_bytes=60000")
    written = subprocess.run(
        [sys.executable, "-m", "hydra_ddp.tools.shards", *write, *source],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert written.returncode == 0, written.stderr
    meta = json.loads((root / "manifest.json").read_text())["meta"]
    assert (meta["vocab_size"], meta["pad_id"], meta["context"]) == (300, 1, 48) and (
        root / "tokenizer.json"
    ).is_file()
    text = (
        "task=causal_lm",
        "data=shards",
        f"data.dataset.root={root}",
        "data.num_classes=300",
        "data.val_fraction=0",
        "data.global_batch_size=16",
        "model=gpt",
        "model.context=48",
        "model.dim=32",
        "model.depth=1",
        "model.heads=4",
        "trainer.log_every=1",
        "trainer.epochs=1",
    )
    # A mid-epoch stop (SIGTERM at rank 0's 5th forward), continued bit for bit.
    straight, stopped = tmp_path / "straight", tmp_path / "stopped"
    check_ok(run_train(straight, *text, "trainer.max_steps=12"))
    probe = (
        "model._target_=probes.signal_at",
        "+model.of=hydra_ddp.models.TinyGPT",
        "+model.step=5",
        ONCE,
    )
    done = finish(start_train(stopped, *text, "trainer.max_steps=12", *probe))
    assert done.returncode == 128 + signal.SIGTERM, done.stderr
    check_ok(run_train(stopped, *text, "trainer.max_steps=12", "trainer.resume=auto"))
    assert_same_run(stopped, straight, "documents from shards, resumed")
    # Stopped at step 3 at 2 ranks, continued at 1 to the epoch's end: every document once.
    first, after = tmp_path / "first", tmp_path / "after"
    recorded = (*text, "data.dataset._target_=recording.sharded_recording_train")
    stop = ("trainer.max_steps=3", "checkpoint.every_n_steps=3")
    check_ok(
        run_train(
            first, *recorded, "trainer.nproc=2", *stop, f"+data.dataset.reads={first / 'reads'}"
        )
    )
    resume = f"trainer.resume={first / 'checkpoints' / 'step-00000003.pt'}"
    check_ok(
        run_train(
            after, *recorded, "trainer.nproc=1", resume, f"+data.dataset.reads={after / 'reads'}"
        )
    )
    documents = sum(
        entry["samples"]
        for entry in json.loads((root / "manifest.json").read_text())["splits"]["train"]
    )
    assert _reads(first / "reads") + _reads(after / "reads") == Counter(range(documents))
    assert summary(after)["tokens_per_step"] > 0
