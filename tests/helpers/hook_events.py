"""A test-only hook of the loop: every event it sees, per rank, appended to the run's
hook_events.rankR.jsonl; and, asked to, the run ended after an epoch's validation."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Optional

import torch.distributed as dist

from hydra_ddp.hooks import Hook


class Events(Hook):
    def __init__(self, end_after_epoch: Optional[int] = None):
        self.end_after_epoch = end_after_epoch

    def _write(self, loop: Any, **event: Any) -> None:
        path = Path(loop.reporter.run_dir) / f"hook_events.rank{dist.get_rank()}.jsonl"
        with open(path, "a") as f:
            f.write(json.dumps(event) + "\n")

    @contextlib.contextmanager
    def _around(self, loop: Any) -> Iterator[None]:
        self._write(loop, event="running", step=loop.pos.step)
        yield
        self._write(loop, event="ran", step=loop.pos.step)

    def running(self, loop: Any) -> contextlib.AbstractContextManager:
        return self._around(loop)

    def step_ended(self, loop: Any, step: int) -> None:
        self._write(loop, event="step_ended", step=step)

    def validated(self, loop: Any, metrics: dict[str, Any], epoch: int) -> Optional[str]:
        self._write(
            loop, event="validated", epoch=epoch, step=loop.pos.step, metrics=sorted(metrics)
        )
        return "ended_by_a_hook" if epoch == self.end_after_epoch else None
