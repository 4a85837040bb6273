"""The loop's state and its ending. TrainState: where the loop is and the best value so far, what a
checkpoint needs to continue exactly, saved and restored as one unit (each rank's random streams
are the checkpointer's: it gathers them). Ending: why the loop ends before its last step, decided
here only: a signal noted on one rank or the time budget spent, agreed on by every rank at the next
loss window so all stop at the same step; early stopping; a hook's word."""

from __future__ import annotations

import logging
import os
import signal
import time
from dataclasses import dataclass, field
from typing import Any, Optional

from hydra_ddp.monitor import Monitor
from hydra_ddp.runtime.signals import STOP_SIGNALS

log = logging.getLogger(__name__)

# What a checkpoint's "position" holds: exactly these (an unknown key is refused).
POSITION = ("epoch", "batch", "step", "epoch_loss_sum", "epoch_loss_count", "world_sizes")


@dataclass
class TrainState:
    """Changed in place only: the loop's collaborators hold the same one."""

    monitor: Monitor  # the best value so far, and early stopping's count
    epoch: int = 0
    batch: int = 0  # batches done in `epoch`
    step: int = 0  # optimizer steps done in all
    epoch_loss_sum: float = 0.0
    epoch_loss_count: int = 0
    # The world sizes the run has trained at: {"step", "world_size", "cause"} from its start, and
    # {"step", "from", "world_size", "cause"} for each resume at another size.
    world_sizes: list[dict[str, Any]] = field(default_factory=list)

    def next_epoch(self) -> None:
        self.epoch, self.batch, self.epoch_loss_sum, self.epoch_loss_count = (
            self.epoch + 1,
            0,
            0.0,
            0,
        )

    def epoch_loss(self) -> float:
        """The mean global loss of the epoch's steps so far."""
        return self.epoch_loss_sum / max(1, self.epoch_loss_count)

    def regroup(self, saved_accumulation: int, accumulation: int) -> None:
        """After load(): mid-epoch the position counts this rank's micro-batches, always whole
        optimizer steps: at another accumulation (a resize keeps the global batch), the same steps
        are as many more or fewer."""
        self.batch = self.batch // saved_accumulation * accumulation

    def started(self, world_size: int) -> None:
        self.world_sizes = [{"step": 0, "world_size": world_size, "cause": "start"}]

    def continued_at(
        self, world_size: int, saved_ranks: int, cause: str
    ) -> Optional[dict[str, Any]]:
        """After load(): the run continues at `world_size` from a checkpoint that `saved_ranks`
        wrote (`cause`: resize_cause's). A new world size is recorded, and returned."""
        if not self.world_sizes:  # a checkpoint from before the history was kept
            self.world_sizes = [{"step": 0, "world_size": saved_ranks, "cause": "start"}]
        before = self.world_sizes[-1]["world_size"]
        if before == world_size:
            return None
        entry = {"step": self.step, "from": before, "world_size": world_size, "cause": cause}
        self.world_sizes.append(entry)
        return entry

    def saved(self) -> dict[str, Any]:
        """The checkpoint's entries: the position, and the monitor's."""
        position = {key: getattr(self, key) for key in POSITION}
        return {"position": position, "monitor": self.monitor.state()}

    def load(self, saved: dict[str, Any]) -> None:
        """What saved() wrote (a checkpoint's whole state may be given: the rest is ignored)."""
        unknown = set(saved["position"]) - set(POSITION)
        if unknown:
            raise TypeError(f"a checkpoint's position holds unknown keys: {sorted(unknown)}")
        loaded = TrainState(self.monitor, **saved["position"])
        for key in POSITION:
            setattr(self, key, getattr(loaded, key))
        self.monitor.load(saved.get("monitor"))


def resize_cause(elastic: bool, env: Any = os.environ) -> str:
    """Why a run continues from a checkpoint: torchrun restarted a failed group ("restart": a node
    lost), an elastic group re-formed with the nodes present ("rescale": a node joined), Slurm
    requeued the job ("requeue"), or the user resumed it ("resume")."""
    if int(env.get("TORCHELASTIC_RESTART_COUNT", "0") or 0) > 0:
        return "restart"
    if int(env.get("SLURM_RESTART_COUNT", "0") or 0) > 0:
        return "requeue"
    # a scale-up re-forms the group without spending a restart
    if elastic and "TORCHELASTIC_RUN_ID" in env:
        return "rescale"
    return "resume"


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
    the test waits for the resumed run's end); `ended_by`: early_stopping, max_time or a hook's
    word (checkpoint, test, and finish)."""

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

    def after_validation(self, monitor: Monitor, step: int) -> None:
        """An epoch's validation's verdict on early stopping (every rank alike): the monitored
        metric stopped improving. A search's pruner is a hook (search/pruning.py)."""
        if not monitor.should_stop or self.ended_by:
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
