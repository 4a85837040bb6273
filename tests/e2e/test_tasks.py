"""Tasks in real runs: a user's own task trains, evaluates and is searched without a line of src/
changed, a task that cannot work stops every rank in one line, and the built-in regression and
segmentation tasks train alike at any world size (the metrics' sums: tests/unit/test_tasks.py)."""

from __future__ import annotations

import csv
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from support import (
    QUICK,
    assert_float64_alike,
    check_ok,
    csv_losses,
    documented,
    float64,
    run_eval,
    run_train,
    summary,
    with_pythonpath,
    write_lab,
)

HYDRA_DDP = str(Path(sys.executable).parent / "hydra-ddp")


@pytest.fixture
def lab(tmp_path: Path) -> tuple[tuple[str, ...], dict[str, str]]:
    """docs/tasks.md's files in a clone's way: a package on PYTHONPATH and a config folder Hydra
    searches; the overrides that choose them and the environment that imports them."""
    write_lab(tmp_path / "lab")
    overrides = (
        f"hydra.searchpath=[file://{tmp_path / 'lab' / 'labconf'}]",
        "task=binary",
        "model=scorer",
        "data=blobs",
        "optim=adam",
        "scheduler=none",
    )
    return overrides, with_pythonpath(tmp_path / "lab")


@pytest.mark.timeout(400)
def test_a_users_own_task_trains_evaluates_exactly_and_is_searched_in_an_init_project(
    tmp_path: Path,
):
    # docs/tasks.md as it stands: `hydra-ddp init my-lab`, the page's six files written into it,
    # then its three commands run in the project (its conf/ and my_lab found with nothing set).
    made = subprocess.run(
        [HYDRA_DDP, "init", "my-lab"], cwd=tmp_path, capture_output=True, text=True, timeout=60
    )
    check_ok(made)
    project = write_lab(tmp_path / "my-lab", conf="conf")
    run_dir = tmp_path / "run"
    train = documented("docs/tasks.md", "hydra-ddp train task=binary")
    check_ok(run_train(run_dir, *train, prefix=(HYDRA_DDP, "train"), script=None, cwd=project))
    s = summary(run_dir)
    assert s["world_size"] == 2 and s["metrics"] == ["loss", "balanced_accuracy"]
    # the task's own `monitored`, as the page's comment says
    assert s["monitor"] == {**s["monitor"], "metric": "val/balanced_accuracy", "mode": "max"}
    assert s["objective"] == s["val_balanced_accuracy"] > 0.7 and s["test_samples"] == 100
    # hydra-ddp eval on its checkpoint: the run's test metrics, bit for bit, at 1 and at 2 ranks.
    for ranks in (1, 2):
        check_ok(
            run_train(
                tmp_path / f"eval{ranks}",
                *documented("docs/tasks.md", "hydra-ddp eval ckpt="),
                f"ckpt={run_dir}",
                f"trainer.nproc={ranks}",
                prefix=(HYDRA_DDP, "eval"),
                script=None,
                cwd=project,
            )
        )
        result = json.loads((tmp_path / f"eval{ranks}" / "eval.json").read_text())
        assert {k: result[k] for k in ("test_loss", "test_balanced_accuracy", "test_samples")} == {
            k: s[k] for k in ("test_loss", "test_balanced_accuracy", "test_samples")
        }
    rows = list(csv.DictReader(open(tmp_path / "eval1" / "predictions.csv")))
    assert (
        list(rows[0]) == ["index", "label", "score"]
        and len(rows) == 100
        and rows[0]["label"] in ("0", "1")
    )
    # An Optuna search whose objective is the task's own metric.
    sweep = tmp_path / "sweep"
    check_ok(
        run_train(
            tmp_path / "unused",
            *documented("docs/tasks.md", "hydra-ddp train -m task=binary"),
            "hydra.sweeper.n_trials=2",
            *QUICK,
            "optim.weight_decay=0",
            f"hydra.sweep.dir={sweep}",
            prefix=(HYDRA_DDP, "train"),
            script=None,
            cwd=project,
            timeout=300,
        )
    )
    trials = list(csv.DictReader(open(sweep / "sweep.csv")))
    assert len(trials) == 2 and {t["status"] for t in trials} == {"ok"}
    assert all(
        float(t["objective"]) == summary(Path(t["run_dir"]))["val_balanced_accuracy"]
        for t in trials
    )
    assert "val_balanced_accuracy" in trials[0] and "test_balanced_accuracy" in trials[0]


def test_a_task_whose_loss_is_not_a_scalar_is_one_line_before_anything_is_lost(tmp_path: Path, lab):
    overrides, env = lab
    bad = (*overrides, "task._target_=my_lab.mistakes.PerSample")
    check = run_train(tmp_path / "checked", "--check", *bad, env=env)
    assert check.returncode == 2 and check.stderr.strip().splitlines() == [
        "hydra-ddp: error: model=scorer with data=blobs: "
        "the loss of one batch has shape (2,), not a scalar"
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
        "hydra-ddp: error: task Regression does not fit the data: it needs "
        "real-valued targets, and the data's are int64 (class labels?): choose "
        "a regression dataset (data=diabetes, data=synthetic_regression) or "
        f"task=classification (log: {tmp_path / 'run' / 'train.log'})"
    ], proc.stderr
    assert not (tmp_path / "run" / "checkpoints").exists()


# --- The built-in regression and segmentation tasks, end to end ----------------------------------
def test_regression_on_diabetes_reports_r2_and_eval_at_one_rank_gives_its_test_metrics(
    tmp_path: Path,
):
    run_dir = tmp_path / "run"
    check_ok(
        run_train(run_dir, *documented("README.md", "task=regression data=diabetes model=mlp"))
    )
    s = summary(run_dir)
    assert s["world_size"] == 2 and any("r2" in key for key in s) and s["test_samples"] == 88
    assert 0 < s["test_r2"] < 1 and s["test_mse"] == s["test_loss"]
    check_ok(
        run_eval(
            tmp_path / "eval",
            *documented("docs/workflow.md", "ckpt=outputs/runs/DATE/TIME trainer.nproc=1"),
            f"ckpt={run_dir}",
        )
    )
    result = json.loads((tmp_path / "eval" / "eval.json").read_text())
    assert {k: v for k, v in result.items() if k.startswith("test_")} == {
        k: v for k, v in s.items() if k.startswith("test_") and k != "test_passes"
    }


@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    "experiment, model",
    [("diabetes_mlp", "hydra_ddp.models.MLP"), ("shapes_segnet", "hydra_ddp.models.SegNet")],
)
def test_regression_and_segmentation_train_alike_at_1_and_2_ranks_and_under_fsdp(
    tmp_path: Path, experiment: str, model: str
):
    # drop_last: a short last batch would differ in its padding between world sizes. float64: only
    # the order of sums differs, so the runs agree within FLOAT64_BOUND over every step
    # (support.py).
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
        run_train(
            tmp_path / "unused",
            "-m",
            "trainer.nproc=1,2",
            *common,
            f"hydra.sweep.dir={worlds}",
            timeout=300,
        )
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
        ["loss", "mse", "mae", "r2"]
        if experiment == "diabetes_mlp"
        else ["loss", "pixel_accuracy", "mean_iou"]
    )
    if experiment != "shapes_segnet":
        return
    # Evaluating the same weights: bit-equal metrics at 1, 2 and 3 ranks (the segmentation's
    # confusion matrix too).
    ckpt = two
    evals = tmp_path / "evals"
    check_ok(
        run_eval(
            tmp_path / "unused",
            "-m",
            f"ckpt={ckpt}",
            "trainer.nproc=1,2,3",
            f"hydra.sweep.dir={evals}",
            timeout=300,
        )
    )
    results = [json.loads((evals / str(job) / "eval.json").read_text()) for job in range(3)]
    assert [r["world_size"] for r in results] == [1, 2, 3]
    for r in results:
        assert {
            k: r[k] for k in ("test_loss", "test_pixel_accuracy", "test_mean_iou", "test_samples")
        } == {
            k: results[0][k]
            for k in ("test_loss", "test_pixel_accuracy", "test_mean_iou", "test_samples")
        }
    tested = summary(ckpt)  # eval.py on a run directory takes the weights its test took (best.pt)
    assert {k: v for k, v in results[0].items() if k.startswith("test_")} == {
        k: v for k, v in tested.items() if k.startswith("test_") and k != "test_passes"
    }
    assert 0 < results[0]["test_mean_iou"] <= 1
