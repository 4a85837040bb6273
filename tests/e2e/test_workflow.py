"""The experiment workflow on real 2-rank gloo runs: pick on validation, test once, eval.py, stop
early or on a diverged loss, a time budget, fine-tuning, gradient clipping, an Optuna search;
and seeing inside a run: which rank is slow, and why."""

from __future__ import annotations

import csv
import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from hydra_ddp.checkpoint import files
from hydra_ddp.config import run_config

from support import (
    HELPERS,
    QUICK,
    REPO,
    assert_no_orphans,
    check_ok,
    csv_step_losses,
    documented,
    losses,
    run_eval,
    run_train,
    scalars,
    summary,
)


def _val_wall_times(run_dir: Path) -> list[float]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0})
    acc.Reload()
    return [e.wall_time for e in acc.Scalars("val/loss")]


def _step_of(path: Path) -> int:
    return torch.load(path, weights_only=True)["position"]["step"]


@pytest.mark.timeout(400)
def test_selected_on_validation_tested_once_and_eval_py_gives_the_same_bits_at_any_world_size(
    tmp_path: Path,
):
    run_dir, reads = tmp_path / "run", tmp_path / "reads"
    reads.mkdir()
    # Selecting the highest validation loss picks the first epoch: the tested weights are not the
    # last ones.
    proc = run_train(
        run_dir,
        "trainer.epochs=3",
        "trainer.monitor=val/loss",
        "trainer.monitor_mode=max",
        "data.dataset._target_=recording.digits_recording_test",
        f"+data.dataset.reads={reads}",
    )
    check_ok(proc)
    s = summary(run_dir)
    first_epoch_step = s["history"][0]["step"]
    assert [h["epoch"] for h in s["history"]] == [1, 2, 3] and s["monitor"]["best_epoch"] == 1
    assert s["tested"]["weights"] == "best" and s["tested"]["step"] == first_epoch_step < s["steps"]
    assert s["objective"] == s["val_loss"] == max(h["val_loss"] for h in s["history"])
    assert _step_of(run_dir / "checkpoints" / "best.pt") == first_epoch_step
    assert len(scalars(run_dir, "val/loss")) == 3 and len(scalars(run_dir, "test/loss")) == 1

    # The test split was read once, every sample once, after the last validation.
    records = [line.split() for f in reads.iterdir() for line in f.read_text().splitlines()]
    assert sorted(int(i) for i, _ in records) == list(range(s["test_samples"]))
    assert min(float(t) for _, t in records) > max(_val_wall_times(run_dir))
    assert s["test_passes"] == 1

    # eval.py on the run directory takes best.pt and, on 1 rank or 2, reports the run's test
    # metrics, bit-equal.
    for n in (1, 2):
        eval_dir = tmp_path / f"eval{n}"
        check_ok(
            run_eval(
                eval_dir,
                *documented("README.md", "eval.py ckpt=outputs/runs/DATE/TIME predict=true"),
                f"ckpt={run_dir}",
                f"trainer.nproc={n}",
            )
        )
        result = json.loads((eval_dir / "eval.json").read_text())
        assert result["step"] == first_epoch_step and result["world_size"] == n
        assert (result["test_loss"], result["test_accuracy"]) == (
            s["test_loss"],
            s["test_accuracy"],
        )
        rows = list(csv.DictReader(open(eval_dir / "predictions.csv")))
        assert [int(r["index"]) for r in rows] == list(range(s["test_samples"]))
        assert sum(r["label"] == r["predicted"] for r in rows) == round(
            s["test_accuracy"] * s["test_samples"]
        )
    assert (tmp_path / "eval1" / "predictions.csv").read_text() == (
        tmp_path / "eval2" / "predictions.csv"
    ).read_text()

    # A checkpoint of another model: one line, before any worker starts.
    wrong = run_eval(tmp_path / "wrong", f"ckpt={run_dir}", "model=mlp")
    assert wrong.returncode != 0 and "is of another model" in wrong.stderr
    assert len(wrong.stderr.strip().splitlines()) == 1 and "launching" not in wrong.stdout


@pytest.mark.timeout(300)
def test_eval_py_gives_the_same_bits_at_4_and_8_ranks_as_at_1(tmp_path: Path):
    # The test split in chunks of 32 (12 of them): 8 ranks hold 1 or 2 chunks, 4 ranks 3 each. Every
    # world size evaluates with the run's threads per rank (the checkpoint's), so the same kernels.
    run_dir = tmp_path / "run"
    check_ok(run_train(run_dir, "trainer.max_steps=10"))
    results = []
    for n in (1, 4, 8):
        eval_dir = tmp_path / f"eval{n}"
        check_ok(
            run_eval(
                eval_dir,
                *documented("docs/workflow.md", "ckpt=outputs/runs/DATE/TIME trainer.nproc=1"),
                f"ckpt={run_dir}",
                f"trainer.nproc={n}",
                "data.eval_batch_size=32",
            )
        )
        result = json.loads((eval_dir / "eval.json").read_text())
        assert result["world_size"] == n
        results.append({k: result[k] for k in ("test_loss", "test_accuracy", "test_samples")})
    assert results[0] == results[1] == results[2] and results[0]["test_samples"] == 359, results


def _stop_steps(run_dir: Path) -> dict[int, int]:
    found = re.findall(
        r"\[rank (\d)\]\S* - early stopping at step (\d+)", (run_dir / "train.log").read_text()
    )
    return {int(rank): int(step) for rank, step in found}


def test_early_stopping_stops_both_ranks_at_the_same_step_and_tests_the_best(run_dir: Path):
    # No learning: validation never improves on the first epoch, and patience 2 ends epoch 3.
    stopping = ("optim.lr=0", "trainer.epochs=10", "trainer.early_stopping.patience=2")
    proc = run_train(run_dir, *stopping, "trainer.progress=true")
    check_ok(proc)
    s = summary(run_dir)
    assert s["ended_by"] == "early_stopping" and len(s["history"]) == 3
    assert _stop_steps(run_dir) == {0: s["steps"], 1: s["steps"]}
    assert s["tested"]["step"] == s["history"][0]["step"] and "early stopping" in proc.stdout
    # The bar counted to the run's end (10 epochs of 21 steps) and says why it stopped short.
    bar = proc.stderr.replace("\r", "\n").splitlines()
    assert any(
        f"{s['steps']}/210" in line and line.startswith("ended by early_stopping") for line in bar
    ), bar[-3:]

    # Continued, the ended run trains nothing, says so, and keeps its outputs as they were.
    outputs = ("summary.json", "metrics.csv", "checkpoints/last.pt")
    before = {name: (run_dir / name).read_bytes() for name in outputs}
    again = run_train(run_dir, *stopping, "trainer.resume=auto")
    check_ok(again)
    said = f"is complete (step {s['steps']}, ended by early_stopping): nothing to train"
    assert said in again.stderr and "raise trainer.early_stopping.patience" in again.stderr, (
        again.stderr
    )
    assert {name: (run_dir / name).read_bytes() for name in outputs} == before
    assert not (run_dir / ".summary.earlier.json").exists()


def _diverged_in_one_line(proc: subprocess.CompletedProcess, run_dir: Path) -> str:
    """The one line a diverged run ends with: non-zero, every rank's decision reported once, no
    summary."""
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert "worker rank" not in lines[0]  # every rank's decision, reported once
    assert not (run_dir / "summary.json").exists()
    assert_no_orphans(proc.pid)
    return lines[0]


def test_a_diverged_loss_ends_the_run_in_one_line_and_keeps_the_last_good_checkpoint(run_dir: Path):
    proc = run_train(run_dir, "optim.lr=1e30", "checkpoint.every_n_steps=1", "trainer.max_steps=20")
    assert "training diverged: the loss is nan at step 2" in _diverged_in_one_line(proc, run_dir)
    last = torch.load(run_dir / "checkpoints" / "last.pt", weights_only=True)
    assert last["position"]["step"] == 1 and all(
        torch.isfinite(v).all() for v in last["model"].values()
    )


def test_weights_gone_infinite_before_a_checkpoint_end_the_run_in_one_line_and_are_not_saved(
    run_dir: Path,
):
    # The first step's loss is finite (taken before the update); the update, mostly weight decay
    # (1e34 × 1e6 × w), is not: the check before the checkpoint after it finds inf in the weights,
    # every rank stops there, and nothing is written (without the check, last.pt would hold them).
    proc = run_train(
        run_dir,
        "optim.lr=1e34",
        "optim.weight_decay=1e6",
        "checkpoint.every_n_steps=1",
        "trainer.max_steps=20",
    )
    line = _diverged_in_one_line(proc, run_dir)
    assert (
        "training diverged: the weights are not finite after step 1; no checkpoint was written"
        in line
    )
    assert (run_dir / "train.log").is_file() and not list(
        run_dir.rglob("*.pt")
    )  # the run's folder: no checkpoint in it


def test_max_time_stops_resumably_and_init_from_fine_tunes_from_the_checkpoint(tmp_path: Path):
    run_dir = tmp_path / "run"
    # A budget spent before the first step (a millisecond; a cold start alone took more than a
    # second, a warm one may not): the flags of the first loss window (sent at step 3, read while
    # step 4 runs) stop the run at step 4.
    proc = run_train(run_dir, "trainer.max_time=0.001", "trainer.log_every=3", "trainer.epochs=2")
    check_ok(proc)
    s = summary(run_dir)
    assert s["ended_by"] == "max_time" and s["steps"] == 4 and s["tested"]["step"] == 4
    assert _step_of(run_dir / "checkpoints" / "last.pt") == 4
    assert (
        "trainer.max_time spent at step 4" in proc.stderr and "trainer.resume=auto" in proc.stderr
    )
    check_ok(run_train(run_dir, "trainer.resume=auto", "trainer.log_every=3", "trainer.epochs=2"))
    resumed = summary(run_dir)
    assert resumed["ended_by"] == "epochs" and resumed["resumed_from"].endswith("step-00000004.pt")
    assert [h["epoch"] for h in resumed["history"]] == [1, 2] and resumed["steps"] == 2 * resumed[
        "history"
    ][0]["step"]
    # the same run, continued
    assert "differs from the checkpoint's" not in (run_dir / "train.log").read_text()
    # Continued with other values: they apply, and the log says which differ from the checkpoint's.
    check_ok(
        run_train(
            run_dir,
            "trainer.resume=auto",
            "trainer.log_every=3",
            "trainer.epochs=3",
            "optim.lr=0.05",
        )
    )
    warned = [
        line
        for line in (run_dir / "train.log").read_text().splitlines()
        if "differs from the checkpoint's" in line
    ]
    # one line a key
    assert len(warned) == 2 and "optim.lr: 0.02 → 0.05" in warned[0] + warned[1], warned
    assert "trainer.epochs: 2 → 3" in warned[0] + warned[1], warned

    # Fine-tuning: the run's best weights but a fresh classifier; no learning, so step 1 shows the
    # start.
    source = torch.load(run_dir / "checkpoints" / "best.pt", weights_only=True)["model"]
    tuned_dir = tmp_path / "tuned"
    check_ok(
        run_train(
            tuned_dir,
            f"trainer.init_from={run_dir}",
            "trainer.init_ignore=[head]",
            "optim.lr=0",
            "trainer.max_steps=1",
            "checkpoint.every_n_steps=1",
        )
    )
    start = torch.load(tuned_dir / "checkpoints" / "last.pt", weights_only=True)
    assert start["position"]["step"] == 1 and summary(tuned_dir)["init_from"].endswith("best.pt")
    assert all(
        torch.equal(start["model"][k], source[k]) for k in source if not k.startswith("fc2.")
    )
    assert not torch.equal(start["model"]["fc2.weight"], source["fc2.weight"])

    # Another head size without init_ignore: one line before launch, naming what to leave out.
    wrong = run_train(tmp_path / "wrong", f"trainer.init_from={run_dir}", "data.num_classes=5")
    assert wrong.returncode != 0 and len(wrong.stderr.strip().splitlines()) == 1
    assert "fc2.weight (10, 500)→(5, 500)" in wrong.stderr and "trainer.init_ignore" in wrong.stderr


# A checkpoint that main wrote before the config became the resolved RunConfig (f1d6bc0), with the
# command that made it and what eval.py said of it then (its .json beside it).
PREVIOUS = REPO / "tests" / "fixtures" / "checkpoint_f1d6bc0.pt"


def test_a_checkpoint_the_previous_main_wrote_reads_as_a_resolved_config_evaluates_and_resumes(
    tmp_path: Path,
):
    made = json.loads(PREVIOUS.with_suffix(".json").read_text())
    config = run_config.typed(files.read(PREVIOUS, "ckpt")["config"])
    assert type(config.trainer.nproc) is int and type(config.backend.timeout_s) is int
    assert type(config.strategy.static_graph) is bool

    evaluated = tmp_path / "eval"
    check_ok(run_eval(evaluated, f"ckpt={PREVIOUS}"))
    now, then = json.loads((evaluated / "eval.json").read_text()), made["eval_at_f1d6bc0"]
    assert (now["step"], now["test_samples"]) == (then["step"], then["test_samples"])
    # The same weights and test set: equal but for the last bits where this CPU sums in another
    # order than the one that wrote the figures (float32; about 1e-6 apart). A ceiling, not a
    # calibration: weights not read (a fresh model) or read into the wrong places move the loss of
    # this 10-class model by more than 1e-2.
    assert now["test_loss"] == pytest.approx(then["test_loss"], rel=1e-4)
    assert abs(now["test_accuracy"] - then["test_accuracy"]) <= 1 / then["test_samples"]

    resumed = tmp_path / "resumed"
    train = [o for o in made["train"] if not o.startswith("trainer.max_steps=")]
    check_ok(run_train(resumed, *train, "trainer.max_steps=12", f"trainer.resume={PREVIOUS}"))
    assert [step for step, _ in csv_step_losses(resumed)] == [9, 10, 11, 12]
    assert summary(resumed)["resumed_from"] == str(PREVIOUS)


def test_grad_clip_bounds_every_step_under_bf16_autocast(run_dir: Path):
    clip, lr = 0.1, 0.02
    check_ok(
        run_train(
            run_dir,
            f"trainer.grad_clip={clip}",
            f"optim.lr={lr}",
            "optim.momentum=0",
            "trainer.precision=bf16",
            "checkpoint.every_n_steps=1",
            "checkpoint.keep=5",
            *QUICK,
        )
    )
    norms = scalars(run_dir, "train/grad_norm")
    assert [step for step, _ in norms] == list(range(1, 9)) and all(n > clip for _, n in norms)
    curve = losses(run_dir)
    assert len(curve) == 8 and all(math.isfinite(v) for v in curve), curve  # bf16 autocast trains
    # Plain SGD moves the weights by lr × the clipped gradient: its norm is exactly the clip.
    w = [
        torch.load(run_dir / "checkpoints" / f"step-{i:08d}.pt", weights_only=True)["model"]
        for i in (6, 7)
    ]
    moved = torch.cat([(w[1][k] - w[0][k]).flatten() for k in w[0]]).norm().item()
    assert moved == pytest.approx(lr * clip, rel=1e-2)


@pytest.mark.timeout(400)
def test_optuna_search_ranks_trials_and_every_rank_uses_its_trial_values(tmp_path: Path):
    sweep = tmp_path / "sweep"
    # The ready search, smaller; lr 1e30 diverges: those trials rank last, and the search goes on.
    proc = run_train(
        tmp_path / "unused",
        "-m",
        "hparams_search=digits",
        "hydra.sweeper.n_trials=4",
        *QUICK,
        "optim.lr=choice(0.05,1e30)",
        "data.batch_size=choice(16,32)",
        "optim.weight_decay=0",
        f"hydra.sweep.dir={sweep}",
        timeout=360,
    )
    check_ok(proc)
    rows = list(csv.DictReader(open(sweep / "sweep.csv")))
    assert len(rows) == 4 and {r["status"] for r in rows} == {"ok", "failed"}, rows
    ok = [r for r in rows if r["status"] == "ok"]
    assert [r["rank"] for r in rows] == [str(i + 1) for i in range(len(ok))] + [""] * (4 - len(ok))
    objectives = [float(r["objective"]) for r in ok]
    assert objectives == sorted(objectives, reverse=True)  # val/accuracy: best first
    assert all("optim.lr=0.05" in r["swept"] for r in ok) and all(
        "diverged" in r["error"] for r in rows[len(ok) :]
    )
    best = OmegaConf.load(sweep / "optimization_results.yaml")
    assert (
        best.best_value == objectives[0]
        and f"Best: job {ok[0]['job']}" in (sweep / "sweep.md").read_text()
    )
    for job in (sweep / r["job"] for r in rows):
        trial = dict(o.split("=", 1) for o in OmegaConf.load(job / ".hydra" / "overrides.yaml"))
        seen = re.findall(
            r"\[rank (\d)\]\S* - rank \d config \w+: (.*)", (job / "train.log").read_text()
        )
        assert sorted(rank for rank, _ in seen) == ["0", "1"]
        for _, values in seen:
            used = dict(v.split("=", 1) for v in values.split())
            assert float(used["optim.lr"]) == float(trial["optim.lr"])
            assert int(used["data.batch_size"]) == int(trial["data.batch_size"])


def test_ranks_handed_different_configs_refuse_to_train(run_dir: Path):
    helper = HELPERS / "per_rank_lr.py"
    prefix = (
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        str(helper),
    )
    proc = run_train(run_dir, *QUICK, prefix=prefix)
    assert proc.returncode != 0
    assert "hydra-ddp: error: the ranks were given different configs" in proc.stderr, proc.stderr
    assert not (run_dir / "checkpoints").exists()
    lines = re.findall(
        r"rank (\d) config (\w+): .*optim.lr=([\d.]+)", (run_dir / "train.log").read_text()
    )
    assert {rank for rank, _, _ in lines} == {"0", "1"} and len(
        {digest for _, digest, _ in lines}
    ) == 2


def test_a_rank_slowed_by_its_data_is_named_with_the_cause(run_dir: Path):
    proc = run_train(
        run_dir,
        "data.dataset._target_=recording.digits_slow_on_rank",
        "+data.dataset.slow_rank=1",
        # 10 ms a sample: beside two busy processes on 2 cores rank 0 still waits 0.85 of its step
        # (at 3 ms its own starved loading left it 0.44 once: SOAK_HISTORY.md)
        "+data.dataset.delay_s=0.01",
        "trainer.max_steps=24",
        "trainer.log_every=4",
    )
    check_ok(proc)
    s = summary(run_dir)
    assert s["straggler"]["rank"] == 1 and s["straggler"]["cause"] == "data", s["ranks"]
    slow, other = s["ranks"][1], s["ranks"][0]
    # rank 0 waits for rank 1's batches
    assert slow["data_share"] > 0.5 and other["sync_wait_share"] > 0.5
    assert (
        "straggler            rank 1: data wait" in proc.stdout
        and "data.num_workers" in proc.stdout
    )
    assert scalars(run_dir, "train/time/rank1/data")[0][1] > 0.5  # per rank, in the loggers too
