"""Validation during training (the monitored metric, the best weights kept aside) and the test's
one reading at the end, on the selected weights: exact evaluations, as the strategy sums them."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from typing import Any, Optional

import torch

from hydra_ddp.data import Loaders
from hydra_ddp.monitor import Monitor
from hydra_ddp.recipe.ema import EMA
from hydra_ddp.reporting.run_report import Reporter
from hydra_ddp.training.evaluation import evaluate
from hydra_ddp.training.meter import Overheads
from hydra_ddp.training.parts import Trained

log = logging.getLogger(__name__)


class Validation:
    """The evaluations of one training run, and what they selected."""

    def __init__(
        self,
        trained: Trained,
        ema: Optional[EMA],
        loaders: Loaders,
        reporter: Reporter,
        monitor: Monitor,
        overheads: Overheads,
    ):
        self.strategy, self.task, self.device = trained.strategy, trained.task, trained.device
        self.loaders, self.memory_format, self.reporter = loaders, trained.memory_format, reporter
        self.monitor, self.overheads = monitor, overheads
        self.ema = ema  # evaluations read the weights' average where the run keeps one
        # a copy, on the CPU, while not the current ones
        self.best_weights: Optional[dict[str, torch.Tensor]] = None
        self.last: dict[str, Any] = {}  # the last validation's metrics
        self.history: list[dict[str, Any]] = []  # every validation of this run
        self.test_metrics: dict[str, Any] = {}
        self.tested: Optional[dict[str, Any]] = None  # which weights the test used

    def evaluate(self, split: Any, name: str, swap: bool = True) -> dict[str, Any]:
        """Exact evaluation of one split, as this strategy needs it run and added up: of the
        weights' average where the run keeps one (`swap`: into the model for it; False: it is there
        already)."""
        averaged = self.ema.swapped() if self.ema is not None and swap else contextlib.nullcontext()
        with self.overheads.timed("eval_time_s"), averaged:
            return evaluate(
                self.strategy.eval_module,
                split,
                self.device,
                self.task,
                name,
                self.memory_format,
                lockstep=self.strategy.lockstep_eval,
                **self.strategy.eval_reduction(),
            )

    def validate(self, train_loss: float) -> dict[str, Any]:
        """The validation split's metrics (none without one), with the epoch's training loss."""
        metrics: dict[str, Any] = {"train_loss": train_loss}
        if self.loaders.val is not None:
            metrics.update(self.evaluate(self.loaders.val, "val"))
        self.last = metrics
        return metrics

    def record(self, metrics: dict[str, Any], step: int, epoch: int) -> bool:
        """A validation's metrics into the monitor and the history; True: the best weights so
        far."""
        best = self.monitor.update(metrics, step, epoch)
        self.history.append({"epoch": epoch, "step": step, **metrics, "best": best})
        if best:  # kept aside (on the CPU) for the test, in case later epochs do worse
            # FSDP: gathered to rank 0 (the others keep an empty dict, and receive them from rank
            # 0).
            with self.ema.swapped() if self.ema is not None else contextlib.nullcontext():
                self.best_weights = {
                    k: v.detach().to("cpu", copy=True)
                    for k, v in self.strategy.model_state().items()
                }
        return best

    def selected(self) -> dict[str, Any]:
        """The selected weights' validation: the best by the monitor, else the last validation."""
        return next((h for h in self.history if h["step"] == self.monitor.best_step), self.last)

    def test(self, step: int, epoch: int, checkpoint: Optional[Callable[[str], str]]) -> None:
        """The test split's one reading, on the selected weights: the best by trainer.monitor, else
        the last. `checkpoint`: the path a checkpoint of those weights is published at (None: none
        saved)."""
        monitor = self.monitor
        weights, tested_step, loaded = "last", step, False
        if monitor.best_step is not None:
            if monitor.best_step == step:
                weights = "best"
            elif self.best_weights is not None:
                # Training is over: the best weights (the average's, where kept) replace the
                # model's.
                self.strategy.load_model_state(self.best_weights, everywhere=False)
                weights, tested_step, loaded = "best", monitor.best_step, True
        self.test_metrics = self.evaluate(self.loaders.test, "test", swap=not loaded)
        self.tested = {
            "weights": weights,
            # the weights' moving average (trainer.ema), not the trained weights
            "ema": self.ema is not None,
            "step": tested_step,
            "epoch": monitor.best_epoch if weights == "best" else epoch,
            "checkpoint": checkpoint(weights) if checkpoint else None,
            "monitor": monitor.metric,
            "monitor_value": monitor.best if weights == "best" else None,
        }
        self.reporter.scalars(self.tagged(self.test_metrics, "test"), step)
        log.info(
            "test (once, on the %s%s weights: step %d%s)  %s",
            weights,
            " averaged (EMA)" if self.ema is not None else "",
            tested_step,
            f", {monitor.metric} {monitor.best:.4f}" if weights == "best" else "",
            self.shown(self.test_metrics, "test"),
        )

    def tagged(self, metrics: dict[str, Any], split: str) -> dict[str, float]:
        """The task's metrics of a split by their TensorBoard tags: {split}_{name} as
        {split}/{name}."""
        return {f"{split}/{name}": metrics[f"{split}_{name}"] for name in self.task.metrics}

    def shown(self, metrics: dict[str, Any], split: str) -> str:
        """The task's metrics of a split for the log: `val loss 0.1234  val accuracy 0.9876`."""
        return "  ".join(
            f"{split} {name} {metrics[f'{split}_{name}']:.4f}" for name in self.task.metrics
        )
