"""The progress bar, as a hook of the loop: optimizer steps against the run's last, the latest
global loss beside them, and why a run stopped short. Rank 0's, at a terminal (trainer.progress)."""

from __future__ import annotations

import contextlib
from typing import Optional

from tqdm import tqdm

from hydra_ddp import hooks


class ProgressBar(hooks.Hook):
    def __init__(self) -> None:
        self.bar: Optional[tqdm] = None

    @classmethod
    def of(cls, shown: bool) -> Optional[ProgressBar]:
        """The hook where the bar is shown (run_report.show_progress); else None."""
        return cls() if shown else None

    @contextlib.contextmanager
    def running(self, fit: hooks.Fit):
        self.bar = tqdm(
            total=fit.total_steps, initial=fit.first_step, unit="step", dynamic_ncols=True
        )
        try:
            yield
        finally:
            self.bar.close()

    def step_ended(self, event: hooks.StepEnded) -> None:
        self.bar.update()

    def logged(self, event: hooks.Logged) -> None:
        if event.losses:
            self.bar.set_postfix(loss=f"{event.losses[-1]:.4f}", refresh=False)

    def fit_ended(self, event: hooks.FitEnded) -> None:
        if event.ended_by and self.bar.n < self.bar.total:
            self.bar.set_description_str(f"ended by {event.ended_by}", refresh=True)
