"""The one monitored metric (trainer.monitor): which weights are best, and when to stop early.

Every value it sees is global (all-reduced by the evaluation or the loss window), so every rank
reaches the same decision at the same step without a collective of its own.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any, Optional

AUTO = "auto"


def names(directions: Mapping[str, str]) -> list[str]:
    """What trainer.monitor may name (TensorBoard's tags): the task's metrics on the validation
    split (`directions`: the task's metric → its better direction), and the training loss."""
    return [f"val/{name}" for name in directions] + ["train/loss"]


def mode_of(metric: str, configured: str, directions: Mapping[str, str] = {}) -> str:
    """min or max: `auto` is the task's direction for the metric (min for a loss)."""
    if configured != "auto":
        return configured
    split, _, name = metric.partition("/")
    if split == "val" and name in directions:
        return directions[name]
    return "min" if metric.endswith("loss") else "max"


def settle(
    metric: Optional[str], mode: str, directions: Mapping[str, str], default: str
) -> tuple[Optional[str], str]:
    """trainer.monitor and monitor_mode with `auto` settled: the task's `default` metric on the
    validation split, in the metric's direction."""
    if metric == AUTO:
        metric = f"val/{default}"
    return metric, mode_of(metric, mode, directions) if metric else mode


def worst(metric: Optional[str], mode: str) -> Optional[float]:
    """What a failed or diverged run reports to a sweeper: a value every finished run beats (`mode`
    settled: min or max)."""
    if metric is None:
        return None
    return -math.inf if mode == "max" else math.inf


@dataclass
class Monitor:
    # None: nothing monitored (no validation split); the last weights are tested
    metric: Optional[str]
    mode: str = "max"
    patience: Optional[int] = None
    min_delta: float = 0.0
    best: Optional[float] = None
    best_step: Optional[int] = None
    best_epoch: Optional[int] = None
    # Validations since the last improvement by more than min_delta.
    stale: int = 0

    @classmethod
    def from_config(cls, trainer_cfg: Any) -> Monitor:
        metric = trainer_cfg.monitor
        stopping = trainer_cfg.early_stopping
        return cls(
            metric,
            mode_of(metric, trainer_cfg.monitor_mode) if metric else "max",
            stopping.patience,
            stopping.min_delta,
        )

    def value(self, metrics: dict[str, float]) -> Optional[float]:
        return value_of(self.metric, metrics)

    def update(self, metrics: dict[str, float], step: int, epoch: int) -> bool:
        """Take a validation's metrics; True when the monitored value is the best so far."""
        value = self.value(metrics)
        if value is None:
            return False
        sign = 1.0 if self.mode == "max" else -1.0
        if math.isnan(value):
            gain = math.nan  # never an improvement, not even the first value
        else:
            gain = math.inf if self.best is None else sign * (value - self.best)
        self.stale = 0 if gain > self.min_delta else self.stale + 1
        if gain > 0:
            self.best, self.best_step, self.best_epoch = value, step, epoch
            return True
        return False

    @property
    def should_stop(self) -> bool:
        return self.patience is not None and self.stale >= self.patience

    def state(self) -> dict[str, Any]:
        return asdict(self)

    def load(self, state: Optional[dict[str, Any]]) -> None:
        """The best value and patience count so far, from a checkpoint of a run that monitored the
        same metric."""
        if state and state.get("metric") == self.metric and state.get("mode") == self.mode:
            self.best, self.best_step, self.best_epoch = (
                state["best"],
                state["best_step"],
                state["best_epoch"],
            )
            self.stale = state["stale"]


def value_of(metric: Optional[str], metrics: Mapping[str, float]) -> Optional[float]:
    """A monitored metric's value among a validation's metrics (`val/loss` is `val_loss` there)."""
    return metrics.get(metric.replace("/", "_")) if metric else None
