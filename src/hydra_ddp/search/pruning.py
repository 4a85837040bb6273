"""A search trial's pruning, as a hook of the loop: after each validation rank 0 reports the
monitored value to the trial through the study's storage and asks the pruner; every rank learns the
answer from rank 0, so the ranks stop together, at the same step. The launch side adds it to
trainer.hooks for a trial whose sweeper names a pruner (launch/resolve.py)."""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Optional

import torch
import torch.distributed as dist

from hydra_ddp.hooks import Hook

log = logging.getLogger(__name__)


class Pruning(Hook):
    """The trial this run is (cfg.trial, set by the search's sweeper for each trial's job)."""

    def __init__(self) -> None:
        self.trial: Optional[Any] = None

    def running(self, loop: Any) -> contextlib.AbstractContextManager:
        if loop.reporter.is_main:  # only rank 0 talks to the storage
            import optuna

            from hydra_ddp.search.study import pruner_of, storage_of

            trial_cfg = loop.cfg.trial
            study = optuna.load_study(
                study_name=trial_cfg.study,
                storage=storage_of(trial_cfg.storage),
                pruner=pruner_of(trial_cfg.pruner, trial_cfg.pruner_args),
            )
            trial_id = study._storage.get_trial_id_from_study_id_trial_number(
                study._study_id, trial_cfg.number
            )
            self.trial = optuna.trial.Trial(study, trial_id)
        return contextlib.nullcontext()

    def validated(self, loop: Any, metrics: dict[str, Any], epoch: int) -> Optional[str]:
        """Report the monitored value (global) after `epoch`; "pruned" where the pruner says so, on
        every rank. Epochs, not steps: trials with other batch sizes compare at the same point."""
        monitor = loop.monitor
        value = monitor.value(metrics)
        verdict = False
        if self.trial is not None and value is not None:
            self.trial.report(float(value), epoch)
            verdict = bool(self.trial.should_prune())
        flag = torch.tensor([1 if verdict else 0], dtype=torch.int64, device=loop.device)
        dist.broadcast(flag, src=0)
        if not flag.item() or loop.ending.ended_by:
            return None
        log.warning(
            "pruned at step %d: the search's pruner stops this trial (%s %.6g)",
            loop.pos.step,
            monitor.metric,
            value,
        )
        return "pruned"
