"""Every output opened in the tool a user opens it with: MLflow and W&B read back through their own
clients; TensorBoard and the MLflow UI served from the project's venv on loopback against real
runs' outputs and read through their HTTP APIs; and,
marked `look` (`make look`, not in `make test`), looked at in headless Chromium, the screenshots
going to LOOK_DIR (make look: docs/img)."""

from __future__ import annotations

import os
import shlex
import signal
from pathlib import Path

import pytest

import servers
from support import (
    QUICK,
    check_ok,
    documented_command,
    finish,
    losses,
    run_train,
    start_train,
    summary,
    wait_for,
    wandb_series,
    wandb_starts,
)

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
    """A run stopped by SIGTERM and resumed (trainer.resume=auto) with every logger (W&B offline),
    and a two-job multirun, both into outputs/mlflow.db as the default mlflow logger config puts it
    (relative to the launch folder)."""
    base = tmp_path_factory.mktemp("outputs")
    store = f"sqlite:///{base}/outputs/mlflow.db"
    common = (
        "logger=[tensorboard,csv,mlflow,wandb]",
        f"logger.mlflow.tracking_uri={store}",
        f"logger.mlflow.artifact_location={base}/outputs/mlartifacts",
        "logger.wandb.mode=offline",
        "trainer.max_steps=30",
        "checkpoint.every_n_steps=4",
        "trainer.log_every=2",
    )
    run_dir = base / "run"
    proc = start_train(run_dir, *common)
    wait_for(
        lambda: (run_dir / "checkpoints" / "step-00000004.pt").exists(),
        120,
        "the first checkpoint",
        proc,
    )
    # to every process of the run, as Slurm's scancel signals a job step
    os.killpg(proc.pid, signal.SIGTERM)
    stopped = finish(proc, timeout=60)
    assert stopped.returncode == 128 + signal.SIGTERM and "checkpoint saved" in stopped.stderr, (
        stopped.stderr
    )
    check_ok(run_train(run_dir, *common, "trainer.resume=auto"))
    check_ok(
        run_train(
            base / "unused",
            "-m",
            *QUICK,
            "trainer.nproc=1",
            "optim.lr=0.01,0.02",
            f"hydra.sweep.dir={base / 'sweep'}",
            "logger=[tensorboard,mlflow]",
            f"logger.mlflow.tracking_uri={store}",
            f"logger.mlflow.artifact_location={base}/outputs/mlartifacts",
        )
    )
    return base


@pytest.mark.timeout(300)
def test_mlflow_and_wandb_runs_read_back_and_continue_after_sigterm_without_duplicate_steps(
    outputs: Path,
):
    """Through their own clients: MLflow's tracking client on the store, wandb's own records."""
    from mlflow.tracking import MlflowClient

    run_dir = outputs / "run"
    client = MlflowClient(tracking_uri=f"sqlite:///{outputs}/outputs/mlflow.db")
    runs = client.search_runs([client.get_experiment_by_name("hydra-ddp").experiment_id])
    [run] = [r for r in runs if r.info.run_name == "run"]  # the resumed run is the same MLflow run
    assert run.info.status == "FINISHED"
    history = sorted(
        (m.step, m.value) for m in client.get_metric_history(run.info.run_id, "train/loss")
    )
    assert [step for step, _ in history] == list(range(1, 31))  # the whole curve, no step twice
    assert [v for _, v in history] == pytest.approx(losses(run_dir))
    assert run.data.params["optim.lr"] == "0.02" and run.data.params["trainer.max_steps"] == "30"
    assert (run.data.tags["world_size"], run.data.tags["backend"], run.data.tags["launcher"]) == (
        "2",
        "gloo",
        "spawn",
    )
    assert run.data.tags["tested_checkpoint"].endswith("best.pt")
    assert [a.path for a in client.list_artifacts(run.info.run_id)] == ["summary.json"]

    # W&B: one offline run from rank 0 of the two, both starts under the id the run directory keeps.
    starts = wandb_starts(run_dir)
    run_id = (run_dir / "wandb_run_id").read_text().strip()
    assert len(starts) == 2 and {s["id"] for s in starts} == {run_id}, [s["path"] for s in starts]
    assert all(s["path"].parent.name.startswith("offline-run-") for s in starts)
    # the stopped start, not the finished one
    assert starts[0]["preempting"] and not starts[1]["preempting"]
    curve = wandb_series(starts, "train/loss")
    assert [step for step, _ in curve] == list(range(1, 31))  # continued, no step twice
    assert [v for _, v in curve] == pytest.approx(losses(run_dir))
    rows = [row["_step"] for s in starts for row in s["history"]]
    assert rows == sorted(set(rows)), rows  # W&B's own row counter only grows: `wandb sync` appends
    config = starts[1]["config"]
    assert config["optim"]["lr"] == 0.02 and config["trainer"]["max_steps"] == 30
    done = summary(run_dir)
    assert (
        starts[1]["summary"]["test_accuracy"] == done["test_accuracy"]
        and starts[1]["summary"]["steps"] == 30
    )
    assert [(kind, refs) for kind, refs in starts[1]["artifacts"]] == [
        ("model", [Path(done["tested"]["checkpoint"]).resolve().as_uri()])
    ]  # a reference, not an upload


@pytest.mark.timeout(400)
def test_tensorboard_shows_the_resumed_run_once_with_one_continuous_curve(
    outputs: Path, tmp_path: Path
):
    run_dir, s = outputs / "run", summary(outputs / "run")
    with servers.tensorboard(run_dir, tmp_path / "tensorboard.log") as url:
        assert servers.get(f"{url}/data/runs") == ["tensorboard"]  # one run, though two event files
        tags = servers.get(f"{url}/data/plugin/scalars/tags")["tensorboard"]
        assert {
            "train/loss",
            "val/loss",
            "val/accuracy",
            "test/loss",
            "test/accuracy",
        } <= tags.keys()

        def series(tag: str) -> list[tuple[int, float]]:
            return [
                (step, value)
                for _, step, value in servers.get(
                    f"{url}/data/plugin/scalars/scalars?run=tensorboard&tag={tag}"
                )
            ]

        curve = series("train/loss")
        # continued after the SIGTERM, no step twice
        assert [step for step, _ in curve] == list(range(1, 31))
        assert [v for _, v in curve] == pytest.approx(losses(run_dir))
        assert len(series("val/accuracy")) == s["epochs"]  # one a validated epoch
        assert series("test/accuracy") == [(s["steps"], pytest.approx(s["test_accuracy"]))]  # once
        assert servers.get(f"{url}/data/plugin/text/tags") == {
            "tensorboard": ["config/text_summary"]
        }
        experiment = servers.get(f"{url}/data/plugin/hparams/experiment", {"experimentName": ""})
        assert {"lr", "world_size", "model"} <= {h["name"] for h in experiment["hparamInfos"]}
        # Its columns are the run's own series (no one-point hparam/* cards above the curves).
        assert {"test/accuracy", "val/accuracy", "train/samples_per_sec"} <= {
            m["name"]["tag"] for m in experiment["metricInfos"]
        }
        assert not [tag for tag in tags if tag.startswith("hparam/")], tags
        groups = servers.get(
            f"{url}/data/plugin/hparams/session_groups",
            {
                "experimentName": "",
                "allowedStatuses": ["STATUS_UNKNOWN", "STATUS_SUCCESS"],
                "colParams": [],
                "startIndex": 0,
                "sliceSize": 10,
            },
        )["sessionGroups"]
        shown = {v["name"]["tag"]: v["value"] for v in groups[0]["metricValues"]}
        assert shown["test/accuracy"] == pytest.approx(s["test_accuracy"])  # the tested weights


@pytest.mark.timeout(400)
def test_mlflow_ui_as_the_docs_give_it_serves_the_run_and_the_sweep_as_parent_and_children(
    outputs: Path, tmp_path: Path
):
    s = summary(outputs / "run")
    # docs/loggers.md's command, word for word, as servers.mlflow_ui starts it (and a free port)
    program, ui, flag, store = shlex.split(documented_command("docs/loggers.md", "mlflow ui"))
    assert (program, ui, flag) == ("mlflow", "ui", "--backend-store-uri")
    with servers.mlflow_ui(outputs, store, tmp_path / "mlflow.log") as url:
        api = f"{url}/api/2.0/mlflow"
        experiment = servers.get(f"{api}/experiments/get-by-name?experiment_name=hydra-ddp")[
            "experiment"
        ]
        kind = {t["key"]: t["value"] for t in experiment.get("tags", [])}.get(
            "mlflow.experimentKind"
        )
        # MLflow 3's UI opens it in its training view, not GenAI's
        assert kind == "custom_model_development"
        runs = servers.get(f"{api}/runs/search", {"experiment_ids": [experiment["experiment_id"]]})[
            "runs"
        ]
        by_name = {r["info"]["run_name"]: r for r in runs}
        run = by_name["run"]
        # the resumed run is the same MLflow run, finished
        assert run["info"]["status"] == "FINISHED"
        params = {p["key"]: p["value"] for p in run["data"]["params"]}
        tags = {t["key"]: t["value"] for t in run["data"]["tags"]}
        assert params["optim.lr"] == "0.02" and params["trainer.max_steps"] == "30"
        assert (tags["world_size"], tags["backend"], tags["run_dir"]) == (
            "2",
            "gloo",
            str(outputs / "run"),
        )
        history = servers.get(
            f"{api}/metrics/get-history?run_id={run['info']['run_id']}&metric_key=train/loss"
        )
        assert sorted(m["step"] for m in history["metrics"]) == list(range(1, 31))
        metrics = {m["key"]: m["value"] for m in run["data"]["metrics"]}
        assert metrics["test/accuracy"] == pytest.approx(s["test_accuracy"])
        # The multirun: one parent run, its two jobs as children.
        parents = [r for r in runs if r["info"]["run_name"].startswith("sweep ")]
        children = [
            r for r in runs if any(t["key"] == "mlflow.parentRunId" for t in r["data"]["tags"])
        ]
        assert len(parents) == 1 and len(children) == 2
        assert {
            t["value"]
            for r in children
            for t in r["data"]["tags"]
            if t["key"] == "mlflow.parentRunId"
        } == {parents[0]["info"]["run_id"]}
        assert sorted(r["info"]["run_name"] for r in children) == ["sweep/0", "sweep/1"]


# --- Looked at in a real browser (make look: Chromium's start and render cost more than CI's
# budget) ---


@pytest.fixture(scope="module")
def default_run(tmp_path_factory) -> Path:
    """What a user's first `make train` makes (the default config, every epoch), with the MLflow
    logger beside the default ones, into outputs/mlflow.db under the launch folder: the
    screenshots'."""
    base = tmp_path_factory.mktemp("default")
    store = f"sqlite:///{base}/outputs/mlflow.db"
    check_ok(
        run_train(
            base / "run",
            "logger=[tensorboard,csv,mlflow]",
            f"logger.mlflow.tracking_uri={store}",
            f"logger.mlflow.artifact_location={base}/outputs/mlartifacts",
            timeout=240,
        )
    )
    return base


@pytest.mark.look
@pytest.mark.timeout(400)
def test_tensorboard_in_a_browser_shows_the_default_runs_curves_first(
    default_run: Path, tmp_path: Path
):
    with servers.tensorboard(default_run / "run", tmp_path / "tensorboard.log") as url:
        # What a user sees first: the time-series view, its cards sorted by tag; no one-point hparam
        # cards.
        shot = _shot(tmp_path, "tensorboard.png")
        page = servers.browse(f"{url}/#timeseries", shot)
        assert "train/loss" in page and "hparam/" not in page
        # The scalars dashboard draws the loss curve in the run's colour.
        curve = tmp_path / "scalars.png"
        servers.browse(f"{url}/#scalars&tagFilter=train%2Floss", curve)
        assert servers.drawn_line_span(curve, RUN_COLOUR) > 150, "no train/loss curve drawn"


@pytest.mark.look
@pytest.mark.timeout(400)
def test_the_mlflow_run_page_in_a_browser_names_the_run_and_its_metrics(
    default_run: Path, tmp_path: Path
):
    # Opened at 0.0.0.0, this host by another name: at localhost MLflow 3 opens its assistant's chat
    # panel over a third of the page on a browser's first visit (a fresh profile's every time).
    with servers.mlflow_ui(
        default_run, "sqlite:///outputs/mlflow.db", tmp_path / "mlflow.log", "0.0.0.0"
    ) as url:
        api = f"{url}/api/2.0/mlflow"
        experiment = servers.get(f"{api}/experiments/get-by-name?experiment_name=hydra-ddp")[
            "experiment"
        ]
        runs = servers.get(f"{api}/runs/search", {"experiment_ids": [experiment["experiment_id"]]})[
            "runs"
        ]
        run = next(r for r in runs if r["info"]["run_name"] == "run")
        # MLflow 3 opens in its GenAI view unless asked for the training one (or switched in its
        # sidebar).
        seen_at = url.replace("127.0.0.1", "0.0.0.0")
        page = servers.browse(
            f"{seen_at}/#/experiments/{experiment['experiment_id']}/runs/{run['info']['run_id']}"
            "?workflowType=machine_learning",
            _shot(tmp_path, "mlflow_run.png"),
            wait_ms=20000,
        )
        assert (
            run["info"]["run_id"] in page and "Finished" in page and "MLflow Assistant" not in page
        )
        assert "train/loss" in page and "test/accuracy" in page and "world_size" in page
