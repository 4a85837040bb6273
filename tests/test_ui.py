"""Every output opened in the tool a user opens it with: TensorBoard and the MLflow UI served from
the project's venv on loopback against real runs' outputs and read through their HTTP APIs; and,
marked `look` (`make look`, not in `make test`), looked at in headless Chromium, the screenshots
going to LOOK_DIR (make look: docs/img)."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

import servers
from support import QUICK, check_ok, finish, losses, run_train, start_train, summary, wait_for

RUN_COLOUR = (255, 112, 67)  # TensorBoard's colour for the first run (#ff7043)


def _shot(tmp: Path, name: str) -> Path:
    if servers.CHROMIUM is None:
        pytest.skip("Chromium is not installed (apt-get install chromium)")
    """Where a screenshot goes: LOOK_DIR when set (make look: docs/img), else the test's folder."""
    folder = Path(os.environ["LOOK_DIR"]) if os.environ.get("LOOK_DIR") else tmp
    folder.mkdir(parents=True, exist_ok=True)
    return folder / name


@pytest.fixture(scope="module")
def outputs(tmp_path_factory) -> Path:
    """A run stopped by SIGTERM and resumed (trainer.resume=auto), and a two-job multirun, both into
    outputs/mlflow.db as the default mlflow logger config puts it (relative to the launch folder)."""
    base = tmp_path_factory.mktemp("outputs")
    store = f"sqlite:///{base}/outputs/mlflow.db"
    common = ("logger=[tensorboard,csv,mlflow]", f"logger.mlflow.tracking_uri={store}",
              f"logger.mlflow.artifact_location={base}/outputs/mlartifacts",
              "trainer.max_steps=30", "checkpoint.every_n_steps=4", "trainer.log_every=2")
    run_dir = base / "run"
    proc = start_train(run_dir, *common)
    wait_for(lambda: (run_dir / "checkpoints" / "step-00000004.pt").exists(), 120, "the first checkpoint", proc)
    os.killpg(proc.pid, signal.SIGTERM)
    assert finish(proc, timeout=60).returncode == 128 + signal.SIGTERM
    check_ok(run_train(run_dir, *common, "trainer.resume=auto"))
    check_ok(run_train(base / "unused", "-m", *QUICK, "trainer.nproc=1", "optim.lr=0.01,0.02",
                       f"hydra.sweep.dir={base / 'sweep'}", "logger=[tensorboard,mlflow]",
                       f"logger.mlflow.tracking_uri={store}", f"logger.mlflow.artifact_location={base}/outputs/mlartifacts"))
    return base


@pytest.mark.timeout(400)
def test_tensorboard_shows_the_resumed_run_once_with_one_continuous_curve(outputs: Path, tmp_path: Path):
    run_dir, s = outputs / "run", summary(outputs / "run")
    with servers.tensorboard(run_dir, tmp_path / "tensorboard.log") as url:
        assert servers.get(f"{url}/data/runs") == ["tensorboard"]  # one run, though two event files
        tags = servers.get(f"{url}/data/plugin/scalars/tags")["tensorboard"]
        assert {"train/loss", "val/loss", "val/accuracy", "test/loss", "test/accuracy"} <= tags.keys()

        def series(tag: str) -> list[tuple[int, float]]:
            return [(step, value) for _, step, value in
                    servers.get(f"{url}/data/plugin/scalars/scalars?run=tensorboard&tag={tag}")]

        curve = series("train/loss")
        assert [step for step, _ in curve] == list(range(1, 31))  # continued after the SIGTERM, no step twice
        assert [v for _, v in curve] == pytest.approx(losses(run_dir))
        assert len(series("val/accuracy")) == s["epochs"]  # one a validated epoch
        assert series("test/accuracy") == [(s["steps"], pytest.approx(s["test_accuracy"]))]  # once
        assert servers.get(f"{url}/data/plugin/text/tags") == {"tensorboard": ["config/text_summary"]}
        experiment = servers.get(f"{url}/data/plugin/hparams/experiment", {"experimentName": ""})
        assert {"lr", "world_size", "model"} <= {h["name"] for h in experiment["hparamInfos"]}
        assert "hparam/test_accuracy" in {m["name"]["tag"] for m in experiment["metricInfos"]}



@pytest.mark.timeout(400)
def test_mlflow_ui_as_the_docs_give_it_serves_the_run_and_the_sweep_as_parent_and_children(outputs: Path,
                                                                                            tmp_path: Path):
    s = summary(outputs / "run")
    with servers.mlflow_ui(outputs, "sqlite:///outputs/mlflow.db", tmp_path / "mlflow.log") as url:
        api = f"{url}/api/2.0/mlflow"
        experiment = servers.get(f"{api}/experiments/get-by-name?experiment_name=hydra-ddp")["experiment"]
        runs = servers.get(f"{api}/runs/search", {"experiment_ids": [experiment["experiment_id"]]})["runs"]
        by_name = {r["info"]["run_name"]: r for r in runs}
        run = by_name["run"]
        assert run["info"]["status"] == "FINISHED"  # the resumed run is the same MLflow run, finished
        params = {p["key"]: p["value"] for p in run["data"]["params"]}
        tags = {t["key"]: t["value"] for t in run["data"]["tags"]}
        assert params["optim.lr"] == "0.02" and params["trainer.max_steps"] == "30"
        assert (tags["world_size"], tags["backend"], tags["run_dir"]) == ("2", "gloo", str(outputs / "run"))
        history = servers.get(f"{api}/metrics/get-history?run_id={run['info']['run_id']}&metric_key=train/loss")
        assert sorted(m["step"] for m in history["metrics"]) == list(range(1, 31))
        metrics = {m["key"]: m["value"] for m in run["data"]["metrics"]}
        assert metrics["test/accuracy"] == pytest.approx(s["test_accuracy"])
        # The multirun: one parent run, its two jobs as children.
        parents = [r for r in runs if r["info"]["run_name"].startswith("sweep ")]
        children = [r for r in runs if any(t["key"] == "mlflow.parentRunId" for t in r["data"]["tags"])]
        assert len(parents) == 1 and len(children) == 2
        assert {t["value"] for r in children for t in r["data"]["tags"] if t["key"] == "mlflow.parentRunId"} == {
            parents[0]["info"]["run_id"]}
        assert sorted(r["info"]["run_name"] for r in children) == ["sweep/0", "sweep/1"]


# --- Looked at in a real browser (make look: Chromium's start and render cost more than CI's budget) ---

@pytest.mark.look
@pytest.mark.timeout(400)
def test_tensorboard_in_a_browser_draws_the_loss_curve_and_names_the_run(outputs: Path, tmp_path: Path):
    with servers.tensorboard(outputs / "run", tmp_path / "tensorboard.log") as url:
        # The scalars dashboard draws the curve; the time-series page's text names the run and the metric.
        shot = _shot(tmp_path, "tensorboard.png")
        servers.browse(f"{url}/#scalars&tagFilter=train%2Floss", shot)
        assert servers.drawn_line_span(shot, RUN_COLOUR) > 150, "no train/loss curve drawn"
        page = servers.browse(f"{url}/?tagFilter=train%2Floss#timeseries", tmp_path / "timeseries.png")
        assert "tensorboard" in page and "train/loss" in page


@pytest.mark.look
@pytest.mark.timeout(400)
def test_the_mlflow_run_page_in_a_browser_names_the_run_and_its_metrics(outputs: Path, tmp_path: Path):
    with servers.mlflow_ui(outputs, "sqlite:///outputs/mlflow.db", tmp_path / "mlflow.log") as url:
        api = f"{url}/api/2.0/mlflow"
        experiment = servers.get(f"{api}/experiments/get-by-name?experiment_name=hydra-ddp")["experiment"]
        runs = servers.get(f"{api}/runs/search", {"experiment_ids": [experiment["experiment_id"]]})["runs"]
        run = next(r for r in runs if r["info"]["run_name"] == "run")
        page = servers.browse(f"{url}/#/experiments/{experiment['experiment_id']}/runs/{run['info']['run_id']}",
                              _shot(tmp_path, "mlflow_run.png"), wait_ms=20000)
        assert run["info"]["run_id"] in page and "Finished" in page
        assert "train/loss" in page and "test/accuracy" in page and "world_size" in page
