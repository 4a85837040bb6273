"""logger=wandb: one Weights & Biases run per job, from rank 0, offline unless an account is set up.

The run's W&B files live in RUN_DIR/wandb/ (`wandb sync RUN_DIR/wandb/offline-run-*` uploads an
offline run later, its resumed parts in order). A resumed or requeued job continues the same W&B
run: its id is kept in RUN_DIR/wandb_run_id, and what the stopped run logged is read back from its
own files so that no (metric, step) pair is logged twice.

Rows are logged with W&B's own `_step` counting log calls, always increasing (across resumes too),
and the training step as `trainer/step`, the x-axis of every chart (`define_metric`): the loss
window's series and the test metrics at the best step arrive after rows of later steps, which a
plain `step=` would drop.
"""

from __future__ import annotations

import dataclasses
import json
import netrc
import os
import secrets
import string
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Optional
from urllib.parse import urlparse

from hydra_ddp.config.run_config import RunConfig
from hydra_ddp.errors import install_line
from hydra_ddp.reporting.loggers import Logger, recorded
from hydra_ddp.rundir import RunDir

STEP = "trainer/step"  # the x-axis
_BLOCK, _HEADER = 32768, 7  # the .wandb file: LevelDB's log format after a 7-byte header
_FULL, _FIRST, _LAST = 1, 2, 4


def choose_mode(mode: str) -> str:
    """auto: what WANDB_MODE says, else online when an API key is set up (WANDB_API_KEY or a
    `wandb login` entry in ~/.netrc), else offline: clusters and these machines have no account."""
    if mode != "auto":
        return mode
    if os.environ.get("WANDB_MODE"):
        return os.environ["WANDB_MODE"]
    if os.environ.get("WANDB_API_KEY"):
        return "online"
    host = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname
    try:
        return "online" if netrc.netrc().authenticators(host or "") else "offline"
    except (OSError, netrc.NetrcParseError):
        return "offline"


def new_run_id() -> str:
    """W&B's form: 8 characters of a-z and 0-9."""
    return "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(8))


def records(path: Path) -> Iterator[Any]:
    """The protobuf Records of one `run-ID.wandb` file, in order (a run cut off mid-write: those
    before the cut)."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    if data[:4] != b":W&B":
        raise ValueError(f"{path} is not a W&B run file")
    pos, parts = _HEADER, b""
    while pos + 7 <= len(data):
        left = _BLOCK - pos % _BLOCK
        if left < 7:  # a block's tail too short for a record header is padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if length == 0 and kind == 0:  # zero padding to the block's end
            pos += left
            continue
        chunk = data[pos + 7 : pos + 7 + length]
        if len(chunk) < length:
            return
        pos += 7 + length
        parts = chunk if kind in (_FULL, _FIRST) else parts + chunk
        if kind in (_FULL, _LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(parts)
            yield record


def run_files(wandb_root: Path, run_id: str) -> list[Path]:
    """A W&B run's files under RUN_DIR/wandb, oldest first: one per start of the job."""
    return sorted(wandb_root.glob(f"wandb/*-{run_id}/run-{run_id}.wandb"))


def values(items: Any) -> dict[str, Any]:
    """A history row's or a summary update's items ({key or nested key: value}) as a dict."""
    return {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in items}


def history(path: Path) -> list[dict[str, Any]]:
    """The rows a run file logged, each a dict (its `_step` included)."""
    return [
        values(record.history.item)
        for record in records(path)
        if record.WhichOneof("record_type") == "history"
    ]


class WandB(Logger):
    """One W&B run per job: the resolved config as its config, every metric at its training step,
    the summary as its summary, the tested checkpoint as a model artifact (a reference to the
    file, not an upload, unless checkpoint_artifact=upload). A multirun's jobs share a group named
    after the sweep. A run stopped by a signal is marked preempting: W&B shows it as preempted
    unless the job comes back."""

    requires = (("wandb", "Weights & Biases", install_line("wandb", "wandb")),)

    @classmethod
    def preload(cls) -> None:
        import wandb  # noqa: F401

    @dataclasses.dataclass(frozen=True)
    class Settings:
        """conf/logger/wandb.yaml's keys (checked against these fields before launch)."""

        project: str = "hydra-ddp"
        entity: Optional[str] = None
        mode: str = "auto"
        dir: Optional[str] = None
        tags: Optional[list[str]] = None
        checkpoint_artifact: str = "reference"

    def __init__(
        self, run_dir: Path, config: RunConfig, resume_step: Optional[int] = None, **keys: Any
    ):
        """`keys`: the YAML's, as Settings."""
        import wandb

        chosen = self.Settings(**keys)
        if chosen.checkpoint_artifact not in ("reference", "upload", "none"):
            raise ValueError(
                "logger.wandb.checkpoint_artifact: expected reference, "
                f"upload or none, got {chosen.checkpoint_artifact!r}"
            )
        self.checkpoint_artifact = chosen.checkpoint_artifact
        self.root = Path(chosen.dir) if chosen.dir else Path(run_dir)
        id_file = RunDir(run_dir).wandb_run_id
        # Resumed (a checkpoint, or trainer.resume=auto starting over): the same W&B run.
        resumed = resume_step is not None and id_file.exists()
        run_id = id_file.read_text().strip() if resumed else new_run_id()
        self.last_step: dict[str, int] = {}  # per metric: the last training step already logged
        next_row = 0
        for path in run_files(self.root, run_id) if resumed else []:
            for row in history(path):
                next_row = max(next_row, int(row.get("_step", -1)) + 1)
                for key in row if STEP in row else ():
                    if not key.startswith("_"):
                        self.last_step[key] = max(self.last_step.get(key, -1), int(row[STEP]))
        self.next_row = next_row
        sweep = config.sweep
        group = name = None
        if sweep:
            sweep_dir = Path(sweep.dir)
            group = f"{sweep_dir.parent.name}/{sweep_dir.name}"  # multirun/DATE/TIME: DATE/TIME
            name = f"{group}/{sweep.job}"
        settings = wandb.Settings(
            console="off",
            silent=True,
            x_disable_stats=True,
            disable_git=True,
            save_code=False,
            x_disable_meta=True,
        )
        self.run = wandb.init(
            project=chosen.project,
            entity=chosen.entity,
            id=run_id,
            resume="allow" if resumed else None,
            mode=choose_mode(chosen.mode),
            dir=str(self.root),
            group=group,
            name=name or Path(run_dir).name,
            job_type="train",
            tags=chosen.tags,
            config=recorded(config),
            settings=settings,
        )
        id_file.write_text(run_id + "\n")
        self.run.define_metric(STEP)
        self.run.define_metric("*", step_metric=STEP)
        self.finished = False

    def metrics(self, values: dict[str, float], step: int) -> None:
        row = {
            key: float(value) for key, value in values.items() if step > self.last_step.get(key, -1)
        }
        # a resumed run skips what the stopped one logged (a crash can log past its checkpoint)
        if row:
            row[STEP] = step
            self.run.log(row, step=self.next_row)
            self.next_row += 1

    def finish(self, summary: dict[str, Any], hparams: dict[str, Any]) -> None:
        self.run.summary.update({key: value for key, value in summary.items() if value is not None})
        tested = summary.get("tested") or {}
        if tested.get("checkpoint") and self.checkpoint_artifact != "none":
            self._log_checkpoint(Path(tested["checkpoint"]), tested)
        # resumable: preempted, not finished, unless the job comes back
        if summary.get("stopped_by"):
            self.run.mark_preempting()
        self._end(0)

    def _log_checkpoint(self, path: Path, tested: dict[str, Any]) -> None:
        import wandb

        artifact = wandb.Artifact(
            f"model-{self.run.id}",
            type="model",
            metadata={"step": tested.get("step"), "weights": tested.get("weights")},
        )
        if self.checkpoint_artifact == "reference":
            artifact.add_reference(path.resolve().as_uri(), name=path.name)
        elif path.is_dir():  # a sharded (DCP) checkpoint
            artifact.add_dir(str(path), name=path.name)
        else:
            artifact.add_file(str(path), name=path.name)
        self.run.log_artifact(artifact, aliases=["tested", f"step-{tested.get('step')}"])

    def close(self) -> None:
        if not self.finished:  # stopped by a failure: the run failed, the files so far are kept
            self._end(1)

    def _end(self, exit_code: int) -> None:
        """Finish the run and wait for W&B's service to write (or upload) all of it: its own atexit
        hook does not run in a multiprocessing worker, and run.finish() alone returns before the
        service has flushed the run file (seen: a file cut at a block boundary)."""
        import wandb

        self.run.finish(exit_code=exit_code)
        wandb.teardown(exit_code=exit_code)
        self.finished = True
