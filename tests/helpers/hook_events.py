"""Test-only hooks of the loop. Events: every event it receives, per rank, appended to the run's
hook_events.rankR.jsonl as the record's values; asked to, the run ended after an epoch's validation
or a step. StepFiles: the package's files whose code ran from one step's end to the next's, per
step, in step_files.rankR.json. TakesTheLoop: a hook written for the loop's earlier events (the
trainer, then values), which launch refuses."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Optional

import torch

from hydra_ddp import hooks


class Events(hooks.Hook):
    def __init__(self, end_after_epoch: Optional[int] = None, end_at_step: Optional[int] = None):
        self.end_after_epoch, self.end_at_step = end_after_epoch, end_at_step
        self.path: Optional[Path] = None

    def _write(self, event: str, record: Any) -> None:
        values = {
            key: (value.item() if isinstance(value, torch.Tensor) else value)
            for key, value in dataclasses.asdict(record).items()
        }
        with open(self.path, "a") as f:
            f.write(json.dumps({"event": event, **values}, default=str) + "\n")

    @contextlib.contextmanager
    def _around(self, fit: hooks.Fit) -> Iterator[None]:
        self.path = fit.run_dir / f"hook_events.rank{fit.rank}.jsonl"
        self._write("running", fit)
        yield
        with open(self.path, "a") as f:
            f.write(json.dumps({"event": "ran"}) + "\n")

    def running(self, fit: hooks.Fit) -> contextlib.AbstractContextManager:
        return self._around(fit)

    def step_ended(self, event: hooks.StepEnded) -> Optional[str]:
        self._write("step_ended", event)
        return "a_step_hook" if event.step == self.end_at_step else None

    def logged(self, event: hooks.Logged) -> None:
        self._write("logged", event)

    def validated(self, event: hooks.Validated) -> Optional[str]:
        self._write("validated", event)
        return "ended_by_a_hook" if event.epoch == self.end_after_epoch else None

    def checkpoint_saved(self, event: hooks.CheckpointSaved) -> None:
        self._write("checkpoint_saved", event)

    def fit_ended(self, event: hooks.FitEnded) -> None:
        self._write("fit_ended", event)


class StepFiles(hooks.Hook):
    """Python's profiler on the loop's thread, from the fit's start to its end: each function call
    names its file."""

    def __init__(self) -> None:
        self.files: set[str] = set()
        self.steps: dict[int, list[str]] = {}  # step → the files run since the step before's end
        self.started = False

    def _called(self, frame: Any, event: str, arg: Any) -> None:
        if event == "call":
            name = frame.f_code.co_filename
            if "/hydra_ddp/" in name:
                self.files.add(name.rsplit("/hydra_ddp/", 1)[1])

    @contextlib.contextmanager
    def _around(self, fit: hooks.Fit) -> Iterator[None]:
        sys.setprofile(self._called)
        try:
            yield
        finally:
            sys.setprofile(None)
        path = fit.run_dir / f"step_files.rank{fit.rank}.json"
        path.write_text(json.dumps(self.steps))

    def running(self, fit: hooks.Fit) -> contextlib.AbstractContextManager:
        return self._around(fit)

    def step_ended(self, event: hooks.StepEnded) -> None:
        if self.started:  # the first step's files include the epoch's start
            self.steps[event.step] = sorted(self.files)
        self.files, self.started = set(), True


class TakesTheLoop(hooks.Hook):
    def step_ended(self, loop: Any, step: int) -> None:
        return None
