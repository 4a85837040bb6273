"""Tasks: the built-in ones' metrics are exact sums, a user's own task trains, evaluates and is
searched without a line of src/ changed, and a task that cannot work is one line."""

from __future__ import annotations

import csv
import json
import math
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from hydra import compose, initialize_config_dir

from hydra_ddp import tasks
from hydra_ddp.config import resolve
from hydra_ddp.config.schema import register_schema
from hydra_ddp.errors import UserError

from support import (
    QUICK,
    REPO,
    assert_float64_alike,
    check_ok,
    csv_losses,
    float64,
    run_eval,
    run_train,
    summary,
    with_pythonpath,
    write_lab,
)

register_schema()


def _chunked_metrics(task: tasks.Task, output: torch.Tensor, target: torch.Tensor, chunks: int) -> dict[str, float]:
    """What the evaluation computes: each chunk's state, added in chunk order, then compute()."""
    states = [task.state(o, t) for o, t in zip(output.chunk(chunks), target.chunk(chunks))]
    assert all(s.dtype == torch.float64 and s.shape == (task.state_size,) for s in states)
    return task.compute(torch.stack(states).sum(0).tolist())


def test_regression_metrics_are_the_textbook_ones_from_exact_sums():
    from sklearn.metrics import mean_absolute_error, mean_squared_error, r2_score

    gen = torch.Generator().manual_seed(0)
    target = torch.randn(300, generator=gen) * 3 + 1
    output = (target + torch.randn(300, generator=gen)).unsqueeze(1)  # a model's (batch, 1)
    got = _chunked_metrics(tasks.Regression(), output, target, chunks=7)
    y, p = target.double().numpy(), output[:, 0].double().numpy()
    assert got["mse"] == got["loss"] == pytest.approx(mean_squared_error(y, p), rel=1e-6)  # errors in float32
    assert got["mae"] == pytest.approx(mean_absolute_error(y, p), rel=1e-6)
    assert got["r2"] == pytest.approx(r2_score(y, p), rel=1e-6)
    assert tasks.Regression().loss(output, target) == F.mse_loss(output[:, 0], target)


def test_segmentation_metrics_come_from_the_confusion_matrix():
    gen = torch.Generator().manual_seed(0)
    k = 4
    target = torch.randint(0, k - 1, (6, 5, 5), generator=gen)  # class 3 never occurs in the masks
    output = torch.randn(6, k, 5, 5, generator=gen)
    got = _chunked_metrics(tasks.Segmentation(k), output, target, chunks=3)
    predicted = output.argmax(1)
    assert got["pixel_accuracy"] == (predicted == target).double().mean().item()
    ious = []
    for c in range(k):
        inter = ((predicted == c) & (target == c)).sum().item()
        union = ((predicted == c) | (target == c)).sum().item()
        if union:
            ious.append(inter / union)
    assert got["mean_iou"] == pytest.approx(sum(ious) / len(ious), rel=1e-12)
    assert got["loss"] == pytest.approx(F.cross_entropy(output, target).item(), rel=1e-6)


def test_classification_and_language_model_metrics():
    gen = torch.Generator().manual_seed(0)
    logits, labels = torch.randn(50, 10, generator=gen), torch.randint(0, 10, (50,), generator=gen)
    got = _chunked_metrics(tasks.Classification(), logits, labels, chunks=4)
    assert got["accuracy"] == (logits.argmax(1) == labels).double().mean().item()
    assert got["loss"] == pytest.approx(F.cross_entropy(logits, labels).item(), rel=1e-6)
    tokens, targets = torch.randn(8, 256, 12, generator=gen), torch.randint(0, 256, (8, 12), generator=gen)
    lm = _chunked_metrics(tasks.LanguageModel(), tokens, targets, chunks=3)
    assert lm["perplexity"] == math.exp(lm["loss"])
    assert lm["loss"] == pytest.approx(F.cross_entropy(tokens, targets).item(), rel=1e-6)


def test_every_chunking_gives_the_same_bits_when_chunks_are_added_in_order():
    """The evaluation's guarantee: a chunk's state is computed alike wherever it runs, and the
    states are added in chunk order. A world size only changes which rank computes which chunk."""
    gen = torch.Generator().manual_seed(1)
    output, target = torch.randn(64, 3, 8, 8, generator=gen), torch.randint(0, 3, (64, 8, 8), generator=gen)
    task = tasks.Segmentation(3)
    states = [task.state(o, t) for o, t in zip(output.split(16), target.split(16))]
    for ranks in (1, 2, 3):
        slots = torch.zeros(len(states), task.state_size, dtype=torch.float64)
        for rank in range(ranks):  # each rank fills its chunks' slots; the all-reduce adds the zeros elsewhere
            mine = torch.zeros_like(slots)
            for chunk in range(rank, len(states), ranks):
                mine[chunk] = task.state(output.split(16)[chunk], target.split(16)[chunk])
            slots += mine
        assert task.compute(slots.sum(0).tolist()) == task.compute(torch.stack(states).sum(0).tolist())


@pytest.mark.parametrize(
    "target, task, message",
    [
        (torch.tensor(3), tasks.Regression(), "needs real-valued targets, and the data's are int64"),
        (torch.tensor(0.5), tasks.Classification(), "needs integer class labels, and the data's targets are float32"),
        (torch.tensor(3), tasks.Segmentation(3), r"needs a mask .* shape \(\)"),
        (torch.zeros(8, 8, dtype=torch.long), tasks.Classification(), r"one class label per sample.* shape \(8, 8\)"),
        (torch.tensor(2), tasks.LanguageModel(), "a sequence of next tokens per sample"),
    ],
)
def test_a_task_that_does_not_fit_the_data_says_why(target, task, message):
    problem = tasks.misfit(task, [target], outputs=1)
    assert problem is not None and "\n" not in problem
    assert problem.startswith(f"task {type(task).__name__} does not fit the data: ")
    assert re.search(message, problem), problem


class _Reserved(tasks.Task):
    metrics = {"loss": "min", "samples": "max"}


class _Sideways(tasks.Task):
    metrics = {"loss": "min", "score": "up"}


@pytest.mark.parametrize(
    "target, message",
    [
        (f"{__name__}._Reserved", "its metric 'samples' is also what the evaluation itself reports"),
        (f"{__name__}._Sideways", "its metric 'score' has direction 'up'"),
        ("torch.nn.Linear", "is not a hydra_ddp.tasks.Task: subclass it"),
    ],
)
def test_a_task_that_declares_what_cannot_work_is_one_line(target, message):
    cfg = {"_target_": target, **({"in_features": 1, "out_features": 1} if "Linear" in target else {})}
    with pytest.raises(UserError, match=message) as refused:
        tasks.build(cfg)
    assert "\n" not in str(refused.value)


def _resolved(tmp_path: Path, *overrides: str) -> dict:
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base=None):
        return resolve.resolve(compose(config_name="config", overrides=list(overrides)), tmp_path, None)


def test_the_monitor_names_a_metric_of_the_task_and_takes_its_direction(tmp_path: Path):
    regression = ("task=regression", "data=diabetes", "model=mlp")
    with pytest.raises(
        UserError,
        match="trainer.monitor='val/accuracy' is not a metric of this task; choose one of "
        "val/loss, val/mse, val/mae, val/r2, train/loss",
    ):
        _resolved(tmp_path, *regression, "trainer.monitor=val/accuracy")
    assert _resolved(tmp_path, *regression, "trainer.monitor=val/r2")["trainer"]["monitor_mode"] == "max"
    assert _resolved(tmp_path, *regression, "trainer.monitor=val/mae")["trainer"]["monitor_mode"] == "min"
    # auto: the task's own choice, in its direction.
    for overrides, chosen in (
        (regression, ("val/loss", "min")),
        (("+experiment=shapes_segnet",), ("val/mean_iou", "max")),
        ((), ("val/accuracy", "max")),
        (("+experiment=text_gpt",), ("val/loss", "min")),
    ):
        trainer = _resolved(tmp_path, *overrides, "trainer.monitor=auto")["trainer"]
        assert (trainer["monitor"], trainer["monitor_mode"]) == chosen, overrides


@pytest.fixture
def lab(tmp_path: Path) -> tuple[tuple[str, ...], dict[str, str]]:
    """A user's package and config folder outside the repository: the overrides that choose them and
    the environment that imports them."""
    write_lab(tmp_path / "lab")
    overrides = (
        f"hydra.searchpath=[file://{tmp_path / 'lab' / 'labconf'}]",
        "task=binary",
        "model=scorer",
        "data=blobs",
        "trainer.monitor=val/balanced_accuracy",
        "optim=adam",
        "scheduler=none",
    )
    return overrides, with_pythonpath(tmp_path / "lab")


@pytest.mark.timeout(400)
def test_a_users_own_task_trains_evaluates_exactly_and_is_searched(tmp_path: Path, lab):
    overrides, env = lab
    run_dir = tmp_path / "run"
    check_ok(run_train(run_dir, *overrides, "trainer.epochs=8", "optim.lr=0.01", env=env))
    s = summary(run_dir)
    assert s["world_size"] == 2 and s["metrics"] == ["loss", "balanced_accuracy"]
    assert s["monitor"] == {**s["monitor"], "metric": "val/balanced_accuracy", "mode": "max"}
    assert s["objective"] == s["val_balanced_accuracy"] > 0.7 and s["test_samples"] == 100
    # eval.py on its checkpoint: the run's test metrics, bit for bit, at 1 and at 2 ranks.
    for ranks in (1, 2):
        check_ok(
            run_eval(tmp_path / f"eval{ranks}", f"ckpt={run_dir}", f"trainer.nproc={ranks}", "predict=true", env=env)
        )
        result = json.loads((tmp_path / f"eval{ranks}" / "eval.json").read_text())
        assert {k: result[k] for k in ("test_loss", "test_balanced_accuracy", "test_samples")} == {
            k: s[k] for k in ("test_loss", "test_balanced_accuracy", "test_samples")
        }
    rows = list(csv.DictReader(open(tmp_path / "eval1" / "predictions.csv")))
    assert list(rows[0]) == ["index", "label", "score"] and len(rows) == 100 and rows[0]["label"] in ("0", "1")
    # An Optuna search whose objective is the task's own metric.
    sweep = tmp_path / "sweep"
    check_ok(
        run_train(
            tmp_path / "unused",
            "-m",
            *overrides,
            "hparams_search=digits",
            "hydra.sweeper.n_trials=2",
            *QUICK,
            "optim.weight_decay=0",
            f"hydra.sweep.dir={sweep}",
            env=env,
            timeout=300,
        )
    )
    trials = list(csv.DictReader(open(sweep / "sweep.csv")))
    assert len(trials) == 2 and {t["status"] for t in trials} == {"ok"}
    assert all(float(t["objective"]) == summary(Path(t["run_dir"]))["val_balanced_accuracy"] for t in trials)
    assert "val_balanced_accuracy" in trials[0] and "test_balanced_accuracy" in trials[0]


def test_a_task_whose_loss_is_not_a_scalar_is_one_line_before_anything_is_lost(tmp_path: Path, lab):
    overrides, env = lab
    bad = (*overrides, "task._target_=mylab.task.PerSample")
    check = run_train(tmp_path / "checked", "--check", *bad, env=env)
    assert check.returncode == 2 and check.stderr.strip().splitlines() == [
        "hydra-ddp: error: model=scorer with data=blobs: the loss of one batch has shape (2,), not a scalar"
    ], check.stderr
    run = run_train(tmp_path / "run", *bad, *QUICK, env=env)
    assert run.returncode != 0 and run.stderr.strip().splitlines()[-1].startswith(
        "hydra-ddp: error: task PerSample: its loss is ("
    )
    assert "not a scalar; reduce it (e.g. .mean()) in the task's loss()" in run.stderr
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_a_task_that_does_not_fit_the_data_stops_every_rank_in_one_line(tmp_path: Path):
    proc = run_train(tmp_path / "run", "task=regression", *QUICK)  # the digits' class labels
    assert proc.returncode != 0
    lines = [line for line in proc.stderr.strip().splitlines() if line.startswith("hydra-ddp:")]
    assert lines == [
        "hydra-ddp: error: task Regression does not fit the data: it needs real-valued targets, and the data's are "
        "int64 (class labels?): choose a regression dataset (data=diabetes, data=synthetic_regression) or "
        f"task=classification (log: {tmp_path / 'run' / 'train.log'})"
    ], proc.stderr
    assert not (tmp_path / "run" / "checkpoints").exists()


# --- The built-in regression and segmentation tasks, end to end ----------------------------------
def test_regression_on_diabetes_reports_r2_and_eval_at_one_rank_gives_its_test_metrics(tmp_path: Path):
    run_dir = tmp_path / "run"
    check_ok(run_train(run_dir, "task=regression", "data=diabetes", "model=mlp"))
    s = summary(run_dir)
    assert s["world_size"] == 2 and any("r2" in key for key in s) and s["test_samples"] == 88
    assert 0 < s["test_r2"] < 1 and s["test_mse"] == s["test_loss"]
    check_ok(run_eval(tmp_path / "eval", f"ckpt={run_dir}", "trainer.nproc=1"))
    result = json.loads((tmp_path / "eval" / "eval.json").read_text())
    assert {k: v for k, v in result.items() if k.startswith("test_")} == {
        k: v for k, v in s.items() if k.startswith("test_") and k != "test_passes"
    }


@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    "experiment, model", [("diabetes_mlp", "hydra_ddp.models.MLP"), ("shapes_segnet", "hydra_ddp.models.SegNet")]
)
def test_regression_and_segmentation_train_alike_at_1_and_2_ranks_and_under_fsdp(
    tmp_path: Path, experiment: str, model: str
):
    # drop_last: a short last batch would differ in its padding between world sizes. float64: only the
    # order of sums differs, so the runs agree within FLOAT64_BOUND over every step (support.py).
    common = (
        f"+experiment={experiment}",
        "trainer.max_steps=10",
        "trainer.log_every=1",
        "data.drop_last=true",
        "trainer.threads=1",
        *float64(model),
    )
    worlds, sharded = tmp_path / "worlds", tmp_path / "fsdp"
    check_ok(
        run_train(tmp_path / "unused", "-m", "trainer.nproc=1,2", *common, f"hydra.sweep.dir={worlds}", timeout=300)
    )
    check_ok(run_train(sharded, "strategy=fsdp", *common, timeout=300))
    one, two = worlds / "0", worlds / "1"
    assert (summary(one)["world_size"], summary(two)["world_size"]) == (1, 2)
    assert summary(one)["global_batch_size"] == summary(two)["global_batch_size"]
    reference = csv_losses(one)
    assert len(reference) == 10 and all(math.isfinite(v) for v in reference)
    assert_float64_alike(csv_losses(two), reference)
    assert summary(sharded)["strategy"] == "fsdp"
    assert_float64_alike(csv_losses(sharded), reference)
    metrics = summary(two)["metrics"]
    assert metrics == (
        ["loss", "mse", "mae", "r2"] if experiment == "diabetes_mlp" else ["loss", "pixel_accuracy", "mean_iou"]
    )
    if experiment != "shapes_segnet":
        return
    # Evaluating the same weights: bit-equal metrics at 1, 2 and 3 ranks (the segmentation's confusion
    # matrix too).
    ckpt = two
    evals = tmp_path / "evals"
    check_ok(
        run_eval(
            tmp_path / "unused", "-m", f"ckpt={ckpt}", "trainer.nproc=1,2,3", f"hydra.sweep.dir={evals}", timeout=300
        )
    )
    results = [json.loads((evals / str(job) / "eval.json").read_text()) for job in range(3)]
    assert [r["world_size"] for r in results] == [1, 2, 3]
    for r in results:
        assert {k: r[k] for k in ("test_loss", "test_pixel_accuracy", "test_mean_iou", "test_samples")} == {
            k: results[0][k] for k in ("test_loss", "test_pixel_accuracy", "test_mean_iou", "test_samples")
        }
    tested = summary(ckpt)  # eval.py on a run directory takes the weights its test took (best.pt)
    assert {k: v for k, v in results[0].items() if k.startswith("test_")} == {
        k: v for k, v in tested.items() if k.startswith("test_") and k != "test_passes"
    }
    assert 0 < results[0]["test_mean_iou"] <= 1
