"""A search trial's pruning: after each validation rank 0 reports the monitored value to the trial
through the study's storage and asks the pruner; every rank learns the answer from rank 0, so the
ranks stop together, at the same step (training.stop.Ending)."""

from __future__ import annotations

import logging
from typing import Any, Optional

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)


class Pruning:
    """The trial this run is (cfg.trial, set by the search's sweeper for each trial's job)."""

    def __init__(self, trial_cfg: Any, is_main: bool, device: torch.device):
        self.device = device
        self.trial: Optional[Any] = None
        if is_main:  # only rank 0 talks to the storage
            import optuna

            from hydra_ddp.search.study import pruner_of, storage_of

            study = optuna.load_study(
                study_name=trial_cfg.study,
                storage=storage_of(trial_cfg.storage),
                pruner=pruner_of(trial_cfg.pruner, trial_cfg.pruner_args),
            )
            trial_id = study._storage.get_trial_id_from_study_id_trial_number(
                study._study_id, trial_cfg.number
            )
            self.trial = optuna.trial.Trial(study, trial_id)

    @classmethod
    def of(cls, cfg: Any, is_main: bool, device: torch.device) -> Optional[Pruning]:
        """The run's pruning, or None outside a search (or with hydra.sweeper.pruner=none)."""
        trial = cfg.trial
        if trial is None or trial.number is None or trial.pruner == "none":
            return None
        return cls(trial, is_main, device)

    def should_prune(self, value: Optional[float], epoch: int) -> bool:
        """Report `value` (the monitored metric, global) after `epoch`; the pruner's verdict, on
        every rank. Epochs, not steps: trials with other batch sizes compare at the same point of
        training."""
        verdict = False
        if self.trial is not None and value is not None:
            self.trial.report(float(value), epoch)
            verdict = bool(self.trial.should_prune())
        flag = torch.tensor([1 if verdict else 0], dtype=torch.int64, device=self.device)
        dist.broadcast(flag, src=0)
        return bool(flag.item())
