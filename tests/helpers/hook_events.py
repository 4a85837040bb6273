"""Test-only hooks of the loop. Events: every event it receives, per rank, appended to the run's
hook_events.rankR.jsonl as the record's values; asked to, the run ended after an epoch's validation
or a step. TakesTheLoop: a hook written for the loop's earlier events (the trainer, then values),
which launch refuses."""

from __future__ import annotations

import contextlib
import dataclasses
import json
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


class TakesTheLoop(hooks.Hook):
    def step_ended(self, loop: Any, step: int) -> None:
        return None
