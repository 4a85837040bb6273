"""What a run trains, known before it trains: its task, and its model built on the meta device
(shapes and dtypes, no memory, any size). Built once per process and config and handed to what asks
of it: the checks (blocks to checkpoint or compile, a tensor-parallel plan, parameter names, the
weights a checkpoint must fit), the settling (2-D convolutions: channels_last) and the FLOP count.
The one place a model is built on the meta device, and a task built (a batch's shapes alone are
data/batches.py's)."""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Mapping
from typing import Any, Optional

import torch
from hydra.utils import instantiate
from torch import nn

from hydra_ddp import tasks


class Building:
    """A model built by a function, two ways: on the meta device, and for real on the CPU (what the
    FLOP count takes: reporting/flops.py)."""

    def __init__(self, build: Callable[[], nn.Module]):
        self.build = build

    def on_meta(self) -> nn.Module:
        """A new build on the meta device, for what runs it (the FLOP count's forward and
        backward)."""
        with torch.device("meta"):
            return self.build()

    def for_real(self) -> nn.Module:
        """A real build on the CPU: the FLOP count of a model that reads its inputs' values."""
        return self.build()


class Blueprint(Building):
    def __init__(self, model_cfg: Mapping[str, Any], task_cfg: Mapping[str, Any]):
        super().__init__(functools.partial(instantiate, model_cfg))
        self.model_cfg, self.task_cfg = model_cfg, task_cfg
        self._task: Optional[tasks.Task] = None
        self._model: Optional[nn.Module] = None
        self._error: Optional[Exception] = None

    @property
    def task(self) -> tasks.Task:
        if self._task is None:
            self._task = tasks.build(self.task_cfg)
        return self._task

    def model(self) -> nn.Module:
        """The model on the meta device, built once: what the checks read (not run). Raises what
        building raises, each time it is asked."""
        if self._model is None and self._error is None:
            try:
                self._model = self.on_meta()
            except Exception as error:  # noqa: BLE001  (raised to each caller, who reports it)
                self._error = error
        if self._error is not None:
            raise self._error
        return self._model

    def model_or_none(self) -> Optional[nn.Module]:
        """The model on the meta device, or None where it does not build before launch (one that
        asks for its rank as it is built: the workers settle what needs it)."""
        try:
            return self.model()
        except Exception:  # noqa: BLE001  (a model that does not build is the checks' to report)
            return None


def of(model_cfg: Mapping[str, Any], task_cfg: Mapping[str, Any]) -> Blueprint:
    """The blueprint of this model and task, made once in this process (train.py --check, the
    launch side's checks and settling, and a worker share it)."""
    key = json.dumps([model_cfg, task_cfg], sort_keys=True, default=str)
    if key not in _MADE:
        _MADE[key] = Blueprint(model_cfg, task_cfg)
    return _MADE[key]


_MADE: dict[str, Blueprint] = {}
