"""The stop protocol: a signal noted on one rank, or the time budget spent, agreed on by every rank
at the next loss window, so all stop at the same step."""

from __future__ import annotations

import logging
import os
import signal
import time
from typing import Any, Optional

from hydra_ddp.runtime.signals import STOP_SIGNALS

log = logging.getLogger(__name__)


class StopRequest:
    """Pre-emption or Ctrl-C (signals.STOP_SIGNALS): noted here, agreed on by all ranks at the next
    sync."""

    FORCE_AFTER_S = 1.0  # a second signal this much later stops at once, without the checkpoint

    def __init__(self) -> None:
        self.signum: Optional[int] = None
        self.noted_at = 0.0

    def install(self) -> None:
        for sig in STOP_SIGNALS:
            signal.signal(sig, self._note)

    def _note(self, signum: int, frame: Any) -> None:
        # A Ctrl-C reaches a worker twice at once (from the terminal, and passed on by the
        # launcher): only a later one, a person asking again, means "now".
        if self.signum is not None and time.monotonic() - self.noted_at > self.FORCE_AFTER_S:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
        if self.signum is None:
            self.signum, self.noted_at = signum, time.monotonic()


class Ending:
    """Why the loop ends before its last step. `stopped_by`: a signal (checkpoint and exit at once:
    the test waits for the resumed run's end); `ended_by`: early_stopping or max_time (checkpoint,
    test, and finish)."""

    def __init__(self, request: StopRequest, max_time: Optional[float], started_at: float):
        self.request = request
        self.max_time = max_time
        self.deadline = started_at + max_time if max_time else None
        self.stopped_by: Optional[str] = None
        self.ended_by: Optional[str] = None

    @property
    def now(self) -> bool:
        return bool(self.stopped_by or self.ended_by)

    @property
    def to_be_continued(self) -> bool:
        """Stopped so that a resumed run goes on: it ends with a checkpoint."""
        return bool(self.stopped_by or self.ended_by == "max_time")

    def flags(self) -> dict[str, bool]:
        """What this rank sends with a loss window: a stop requested, its time budget spent."""
        return {
            "stop": self.request.signum is not None,
            "out_of_time": self.deadline is not None and time.time() >= self.deadline,
        }

    def agree(self, stop: bool, time_up: bool, step: int) -> bool:
        """Act on a window's global flags; True when the ranks agreed to stop."""
        if stop and not self.stopped_by:
            name = (
                signal.Signals(self.request.signum).name
                if self.request.signum
                else "a signal to another rank"
            )
            self.stopped_by = name
            log.warning(
                "stop requested (%s): saving a checkpoint at step %d and exiting", name, step
            )
        elif time_up and not self.ended_by:
            self.ended_by = "max_time"
            log.warning(
                "trainer.max_time (%gs) is spent: a checkpoint at step %d, the test, and the end",
                self.max_time,
                step,
            )
        return stop or time_up

    def ended_by_hook(self, reason: Optional[str]) -> None:
        """A hook's word ends the run (hooks.py), unless something ended it already."""
        self.ended_by = self.ended_by or reason

    def after_validation(self, monitor: Any, step: int) -> None:
        """An epoch's validation's verdict on early stopping (every rank alike); a search's pruner
        is a hook (search/pruning.py)."""
        if monitor.should_stop:
            self.early_stop(monitor, step)

    def early_stop(self, monitor: Any, step: int) -> None:
        """The monitored metric stopped improving (monitor.should_stop)."""
        if self.ended_by:
            return
        self.ended_by = "early_stopping"
        log.warning(
            "early stopping at step %d: %s has not improved by more than %g for %d validation(s) "
            "(best %.6g at step %d)",
            step,
            monitor.metric,
            monitor.min_delta,
            monitor.stale,
            monitor.best,
            monitor.best_step,
        )
