"""A search trial's pruning, as a hook of the loop: after each validation rank 0 reports the
monitored value to the trial through the study's storage and asks the pruner; every rank learns the
answer from rank 0, so the ranks stop together, at the same step. The worker adds it to the
run's hooks for a trial whose sweeper names a pruner (training/worker.py)."""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Optional

import torch
import torch.distributed as dist

from hydra_ddp import hooks, monitor

log = logging.getLogger(__name__)


class Pruning(hooks.Hook):
    """The trial this run is (the trial section's values, set by the search's sweeper for each
    trial's job), judged on the monitored metric (`metric`: trainer.monitor)."""

    def __init__(
        self, number: int, study: str, storage: str, pruner: str, pruner_args: Any, metric: str
    ):
        self.number, self.metric, self.device = number, metric, torch.device("cpu")
        self.study = (study, storage, pruner, dict(pruner_args))
        self.trial: Optional[Any] = None

    def running(self, fit: hooks.Fit) -> contextlib.AbstractContextManager:
        self.device = fit.device
        if fit.rank == 0:  # only rank 0 talks to the storage
            import optuna

            from hydra_ddp.search.study import pruner_of, storage_of

            name, storage, pruner, pruner_args = self.study
            study = optuna.load_study(
                study_name=name, storage=storage_of(storage), pruner=pruner_of(pruner, pruner_args)
            )
            trial_id = study._storage.get_trial_id_from_study_id_trial_number(
                study._study_id, self.number
            )
            self.trial = optuna.trial.Trial(study, trial_id)
        return contextlib.nullcontext()

    def validated(self, event: hooks.Validated) -> Optional[str]:
        """Report the monitored value (global) after the epoch; "pruned" where the pruner says so,
        on every rank. Epochs, not steps: trials with other batch sizes compare at the same
        point."""
        value = monitor.value_of(self.metric, event.metrics)
        verdict = False
        if self.trial is not None and value is not None:
            self.trial.report(float(value), event.epoch)
            verdict = bool(self.trial.should_prune())
        flag = torch.tensor([1 if verdict else 0], dtype=torch.int64, device=self.device)
        dist.broadcast(flag, src=0)
        if not flag.item() or event.ended_by:
            return None
        log.warning(
            "pruned at step %d: the search's pruner stops this trial (%s %.6g)",
            event.step,
            self.metric,
            value,
        )
        return "pruned"
