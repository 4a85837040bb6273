"""Where a run's numbers go: rank 0's loggers, chosen in conf/logger/ (several at once).

Every logger receives the same global (all-reduced) values from the Reporter. Adding one is a
small class with these methods and a YAML file naming it with `_target_`; the Reporter passes
`run_dir`, `config` (the run's RunConfig; `recorded(config)` is it made plain) and `resume_step`
(the step a resumed run continues after, or None) besides the YAML's own keys.
"""

from __future__ import annotations

import csv
import dataclasses
import os
import re
import time
from pathlib import Path
from typing import IO, Any, ClassVar, Optional

import yaml

from hydra_ddp.config.run_config import RunConfig
from hydra_ddp.errors import install_line
from hydra_ddp.rundir import RunDir

_EVENT_FILE = re.compile(r"^events\.out\.tfevents\.(\d+)\.")  # then host, pid, a counter


def recorded(config: RunConfig) -> dict[str, Any]:
    """The run's config made plain, as it is recorded (a YAML, a table of parameters)."""
    return dataclasses.asdict(config) if dataclasses.is_dataclass(config) else dict(config)


def config_yaml(config: RunConfig) -> str:
    """The resolved config as YAML: the text OmegaConf.to_yaml gives, dumped straight from the
    dict instead of through a DictConfig built first, in a third of the time (on rank 0, before the
    first step)."""
    return yaml.safe_dump(recorded(config), sort_keys=False, allow_unicode=True)


class Logger:
    """The interface (every method may do nothing)."""

    # Packages it needs beyond the project's own, each (module, its name, how to install it):
    # checked before launch (launch.checks), so a missing one is one line and no worker starts.
    requires: ClassVar[tuple[tuple[str, str, str], ...]] = ()

    @classmethod
    def preload(cls) -> None:
        """Import what the logger needs, before it is made: rank 0 calls this while the other ranks
        are still starting, so the import does not hold them at the first collective."""

    def metrics(self, values: dict[str, float], step: int) -> None: ...

    def flush(self) -> None:
        """Every step logged so far is on disk (or sent): called before each checkpoint, so a run
        killed after it resumes with none of the steps up to it missing from the logs."""

    def finish(self, summary: dict[str, Any], hparams: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


class TensorBoard(Logger):
    """One event file in run_dir/tensorboard: scalars, the config as text, the hparams table."""

    @classmethod
    def preload(cls) -> None:
        import torch.utils.tensorboard  # noqa: F401  (its import is the slow part of a logger's start)

    def __init__(self, run_dir: Path, config: RunConfig, resume_step: Optional[int] = None):
        from torch.utils.tensorboard import SummaryWriter

        # Resuming: TensorBoard hides the earlier file's events after the checkpoint's step.
        purge_step = resume_step + 1 if resume_step is not None else None
        if purge_step is not None:
            _after_the_newest_event_file(RunDir(run_dir).tensorboard)
        self.writer = SummaryWriter(log_dir=str(RunDir(run_dir).tensorboard), purge_step=purge_step)
        self.writer.add_text("config", "```yaml\n" + config_yaml(config) + "```", 0)

    def metrics(self, values: dict[str, float], step: int) -> None:
        for tag, value in values.items():
            self.writer.add_scalar(tag, value, step)

    def flush(self) -> None:
        self.writer.flush()  # its queue holds up to 10 events, or 2 minutes' worth

    def finish(self, summary: dict[str, Any], hparams: dict[str, Any]) -> None:
        from torch.utils.tensorboard.summary import hparams as hparams_summary

        if summary.get("stopped_by"):
            # To be continued (trainer.resume): the hparams entry is the finished run's. TensorBoard
            # keeps a run's first, so one written now would show the stopped run's metrics for good.
            return
        names = summary.get("metrics", [])  # the task's
        # The hparams table's columns are scalar series the run logged already (the test's metrics,
        # the last validation, the throughput): TensorBoard shows each series' last value there. A
        # series of their own (hparam/...) would stand, one point each, above the curves, which
        # TensorBoard's time-series view sorts by name.
        keys = {f"test/{name}": f"test_{name}" for name in names}
        keys.update({f"val/{name}": f"val_{name}" for name in names})
        keys["train/samples_per_sec"] = "samples_per_sec"
        metrics = {tag: summary[key] for tag, key in keys.items() if summary.get(key) is not None}
        # Written into this writer's own file: SummaryWriter.add_hparams would open a second one.
        for event in hparams_summary(hparams, metrics):
            self.writer.file_writer.add_summary(event)

    def close(self) -> None:
        self.writer.close()


def _after_the_newest_event_file(log_dir: Path) -> None:
    """Return once a new event file's name sorts after every one in `log_dir`.

    TensorBoard reads a folder's files in name order, and a resumed run's purge hides the earlier
    files' later steps only if its own file is read last. Names begin with the second they were
    made in, then host and pid: a restart within the second of the attempt before it (torchrun's,
    after a kill) could sort first, pids compared as text, and TensorBoard then purged the resumed
    run's steps instead (seen in the soak: the curve stopped at the restart's step). So wait until
    the second after the newest file's: under a second, or up to two when that file is from a clock
    a second ahead; a file from a clock further ahead is not waited for."""
    seconds = [
        int(m.group(1))
        for p in log_dir.glob("events.out.tfevents.*")
        if (m := _EVENT_FILE.match(p.name))
    ]
    delay = max(seconds, default=0) + 1 - time.time()
    if 0 < delay <= 2:
        time.sleep(delay)


class CSV(Logger):
    """run_dir/metrics.csv: one row per step that logged anything, one column per metric.

    Steps only grow, so the rows before a new step are final and go to the file when it arrives (a
    step's train loss, its validation and its test come in separate calls); flush() writes the last
    one too, which a later call of its step rewrites. A new metric rewrites the file with the wider
    header; a resumed run keeps the rows up to its checkpoint's step.
    """

    def __init__(
        self,
        run_dir: Path,
        config: RunConfig,
        resume_step: Optional[int] = None,
        filename: str = RunDir(".").metrics_csv.name,
    ):
        self.path = run_dir / filename
        self.rows: list[dict[str, Any]] = []
        self.columns: list[str] = ["step"]
        if resume_step is not None and self.path.exists():
            with open(self.path, newline="") as f:
                reader = csv.DictReader(f)
                self.columns = list(reader.fieldnames or ["step"])
                self.rows = [r for r in reader if int(r["step"]) <= resume_step]
        self.written = 0  # rows already in the file
        self.file_columns: list[str] = []  # its header
        self.file: Optional[IO[str]] = None  # open for appending between rewrites: a row each step
        self.grown = False  # a row already in the file has a value more: rewrite it
        self._rewrite()

    def metrics(self, values: dict[str, float], step: int) -> None:
        if self.rows and int(self.rows[-1]["step"]) == step:
            row = self.rows[-1]
            self.grown = self.grown or len(self.rows) <= self.written
        else:
            self._write(len(self.rows))  # a new step: the rows before it are final
            row = {"step": step}
            self.rows.append(row)
        for name, value in values.items():
            if name not in self.columns:
                self.columns.append(name)
            row[name] = value

    def flush(self) -> None:
        self._write(len(self.rows))

    def _write(self, upto: int) -> None:
        """The rows before `upto` are in the file."""
        if self.grown or self.file_columns != self.columns:
            self._rewrite(upto=max(upto, self.written))
            return
        if upto <= self.written:
            return
        if self.file is None:
            self.file = open(self.path, "a", newline="")
        csv.DictWriter(self.file, fieldnames=self.columns).writerows(self.rows[self.written : upto])
        self.file.flush()  # on disk as it comes, for whoever reads the file during the run
        self.written = upto

    def _rewrite(self, upto: Optional[int] = None) -> None:
        upto = len(self.rows) if upto is None else upto
        self._close_file()
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        with open(tmp, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=self.columns)
            writer.writeheader()
            writer.writerows(self.rows[:upto])
        os.replace(tmp, self.path)
        self.written, self.file_columns, self.grown = upto, list(self.columns), False

    def finish(self, summary: dict[str, Any], hparams: dict[str, Any]) -> None:
        self._rewrite()

    def close(self) -> None:
        self._rewrite()  # which closes the file it appended to

    def _close_file(self) -> None:
        if self.file is not None:
            self.file.close()
            self.file = None


class MLflow(Logger):
    """One MLflow run per job in a tracking store (by default a SQLite file under outputs/): the
    flattened config as params, every metric with its step, tags (world size, backend, launcher,
    run directory), and at the end the summary as an artifact and the tested checkpoint as a tag.

    A resumed run (trainer.resume) continues the same MLflow run, whose id the run directory keeps,
    and logs no step twice. The jobs of a multirun are children of one parent run per sweep.
    """

    requires = (("mlflow", "MLflow", install_line("mlflow", "mlflow")),)

    BATCH = 500  # metrics per request

    @classmethod
    def preload(cls) -> None:
        import mlflow.tracking  # noqa: F401

    @dataclasses.dataclass(frozen=True)
    class Settings:
        """conf/logger/mlflow.yaml's keys (checked against these fields before launch)."""

        tracking_uri: str = "sqlite:///outputs/mlflow.db"
        experiment: str = "hydra-ddp"
        artifact_location: Optional[str] = None

    def __init__(
        self, run_dir: Path, config: RunConfig, resume_step: Optional[int] = None, **keys: Any
    ):
        """`keys`: the YAML's, as Settings."""
        import logging

        from mlflow.tracking import MlflowClient

        # their INFO lines (creating tables, migrations) are not the run's
        for noisy in ("mlflow", "alembic"):
            logging.getLogger(noisy).setLevel(logging.WARNING)

        chosen = self.Settings(**keys)
        self.client = MlflowClient(tracking_uri=chosen.tracking_uri)
        experiment_id = self._experiment(chosen.experiment, chosen.artifact_location)
        id_file = RunDir(run_dir).mlflow_run_id
        self.logged: dict[str, int] = {}  # resumed: the last step already logged, per metric
        self.resumed = resume_step is not None and id_file.exists()
        if self.resumed:
            self.run_id = id_file.read_text().strip()
            self.client.update_run(self.run_id, status="RUNNING")
        else:
            sweep = config.sweep
            tags = {
                "world_size": str(config.trainer.nproc * config.launcher.nnodes),
                "backend": str(config.backend.name),
                "launcher": str(config.launcher.name),
                "run_dir": str(run_dir),
            }
            if sweep:
                tags["mlflow.parentRunId"] = self._parent(experiment_id, Path(sweep.dir))
            run = self.client.create_run(
                experiment_id,
                tags=tags,
                run_name=run_dir.name if not sweep else f"{Path(sweep.dir).name}/{sweep.job}",
            )
            self.run_id = run.info.run_id
            id_file.write_text(self.run_id + "\n")
            self._log_params(recorded(config))
        self.pending: list[Any] = []
        self.finished = False

    def _experiment(self, name: str, artifact_location: Optional[str]) -> str:
        found = self.client.get_experiment_by_name(name)
        if found is not None:
            return found.experiment_id
        location = Path(artifact_location).resolve().as_uri() if artifact_location else None
        try:
            # A model-training experiment: MLflow 3's UI otherwise opens it in its GenAI view.
            return self.client.create_experiment(
                name,
                artifact_location=location,
                tags={"mlflow.experimentKind": "custom_model_development"},
            )
        except Exception:  # created meanwhile by a parallel job
            return self.client.get_experiment_by_name(name).experiment_id

    def _parent(self, experiment_id: str, sweep_dir: Path) -> str:
        """The sweep's parent run, created by the first job (a lock file serialises parallel
        jobs)."""
        import fcntl

        sweep_dir.mkdir(parents=True, exist_ok=True)
        with open(sweep_dir / ".mlflow.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            id_file = RunDir(sweep_dir).mlflow_run_id
            if id_file.exists():
                return id_file.read_text().split()[0]
            parent = self.client.create_run(
                experiment_id,
                run_name=f"sweep {sweep_dir.name}",
                tags={"sweep_dir": str(sweep_dir)},
            )
            # The store too: the sweep's end (end_sweep, in the launching process) closes the parent
            # run.
            id_file.write_text(f"{parent.info.run_id}\n{self.client.tracking_uri}\n")
            return parent.info.run_id

    @classmethod
    def end_sweep(
        cls, sweep_dir: Path, jobs: int, failed: int, best: Optional[tuple[str, float]]
    ) -> None:
        """Close a sweep's parent run, when its jobs logged to MLflow: FINISHED (FAILED if a job
        failed), with the job counts and the best job's value of the monitored metric."""
        id_file = RunDir(sweep_dir).mlflow_run_id
        if not id_file.exists():
            return
        from mlflow.tracking import MlflowClient

        run_id, tracking_uri = id_file.read_text().split()
        client = MlflowClient(tracking_uri=tracking_uri)
        values = {"sweep/jobs": jobs, "sweep/failed": failed}
        if best is not None:
            values[f"best/{best[0]}"] = best[1]
        for key, value in values.items():
            client.log_metric(run_id, key, value)
        client.set_terminated(run_id, "FAILED" if failed else "FINISHED")

    def _log_params(self, plain: dict[str, Any]) -> None:
        from mlflow.entities import Param

        flat: dict[str, str] = {}

        def walk(node: Any, prefix: str) -> None:
            if isinstance(node, dict):
                for key, value in node.items():
                    walk(value, f"{prefix}{key}.")
            else:
                flat[prefix[:-1]] = str(node)[:500]

        walk(plain, "")
        params = [Param(k, v) for k, v in sorted(flat.items())]
        for start in range(0, len(params), 100):
            self.client.log_batch(self.run_id, params=params[start : start + 100])

    def metrics(self, values: dict[str, float], step: int) -> None:
        import time

        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        for key, value in values.items():
            if self.resumed and step <= self._last_logged(key):
                continue  # the stopped run logged it already (a crash can log past its checkpoint)
            self.pending.append(Metric(key, float(value), now, step))
        if len(self.pending) >= self.BATCH:
            self.flush()

    def _last_logged(self, key: str) -> int:
        if key not in self.logged:
            self.logged[key] = max(
                (m.step for m in self.client.get_metric_history(self.run_id, key)), default=-1
            )
        return self.logged[key]

    def flush(self) -> None:
        for start in range(0, len(self.pending), self.BATCH):
            self.client.log_batch(self.run_id, metrics=self.pending[start : start + self.BATCH])
        self.pending = []

    def finish(self, summary: dict[str, Any], hparams: dict[str, Any]) -> None:
        self.flush()
        self.client.log_dict(self.run_id, summary, "summary.json")
        tested = summary.get("tested") or {}
        if tested.get("checkpoint"):
            self.client.set_tag(self.run_id, "tested_checkpoint", tested["checkpoint"])
        # Stopped by a signal: resumable, so not FINISHED (trainer.resume=auto sets it running
        # again).
        self.client.set_terminated(
            self.run_id, "KILLED" if summary.get("stopped_by") else "FINISHED"
        )
        self.finished = True

    def close(self) -> None:
        if not self.finished:  # stopped (a signal, a failure): resumable, so not FINISHED
            self.flush()
            self.client.set_terminated(self.run_id, "KILLED")
            self.finished = True
