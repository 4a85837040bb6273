"""Checkpoint cadence and content: when the loop saves (each epoch, every n steps, a new best, the
end), what a checkpoint holds, resuming from one, and never saving weights that are not finite."""

from __future__ import annotations

import logging
from typing import Any, Optional

import torch
import torch.distributed as dist

from hydra_ddp.checkpoint import files as checkpoints
from hydra_ddp.checkpoint.checkpointer import Checkpointer
from hydra_ddp.checkpoint.files import Location
from hydra_ddp.errors import EveryRankError, UserError
from hydra_ddp.training.meter import Overheads
from hydra_ddp.training.state import TrainState
from hydra_ddp.training.step import Step

log = logging.getLogger(__name__)


class Saving:
    """The loop's checkpoints (the `checkpoint` section's cadence), through the Checkpointer."""

    def __init__(
        self,
        cadence: Any,
        checkpointer: Checkpointer,
        step: Step,
        state: TrainState,
        overheads: Overheads,
    ):
        """`cadence`: the checkpoint section; `step`: holds the states a checkpoint saves."""
        # read every step
        self.every_epoch, self.every_n_steps = bool(cadence.every_epoch), cadence.every_n_steps
        self.checkpointer, self.strategy = checkpointer, step.strategy
        self.scheduler = step.optimization.scheduler
        self.ema = step.optimization.ema  # the weights' moving average (trainer.ema), or None
        self.step, self.train_state, self.overheads = step, state, overheads
        self.monitor = state.monitor
        self.saved: tuple[int, bool] = (-1, False)  # (step, as best) of the last checkpoint

    @property
    def on(self) -> bool:
        return bool(self.every_epoch or self.every_n_steps)

    def state(self) -> dict[str, Any]:
        return {
            # FQN-keyed, whole (ddp) or this rank's shards (the others): any strategy loads either.
            **self.strategy.checkpoint_state(self.step.optimizer),
            "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
            "scaler": self.step.scaler_state(),
            **self.train_state.saved(),  # the position, the monitor
            "comm_hook": self.strategy.comm_state(),  # PowerSGD's error feedback and warm start
            **({"ema": self._ema_state()} if self.ema is not None else {}),
            # a custom step's own (trainer.step): none by default
            **({"step": extra} if (extra := self.step.extra_state()) else {}),
        }

    def _ema_state(self) -> dict[str, torch.Tensor]:
        """The weights' average in the model's checkpoint layout (whole, or this rank's shards):
        copies, as the live weights go back into the model before the checkpoint is written."""
        with self.ema.swapped():
            return {
                k: v.detach().clone() for k, v in self.strategy.checkpoint_model_state().items()
            }

    def _restore_ema(self, path: Location, state: dict[str, Any]) -> None:
        """The checkpoint's average, through the model (so it reshards as the weights do)."""
        if self.ema is None:
            return
        if state.get("ema") is None:
            log.warning(
                "%s holds no average of the weights: trainer.ema starts from the resumed weights",
                path,
            )
            self.ema.reset()
            return
        with self.ema.swapped(keep=True):
            if path.is_dir():
                self.strategy.load_sharded_model(path, "ema")
            else:
                self.strategy.load_model_state(state["ema"], everywhere=True)

    def resume_from(self, path: Location, state: dict[str, Any]) -> None:
        self.checkpointer.restore(state, path, self.strategy, self.step.optimizer, self.scheduler)
        self._restore_ema(path, state)
        self.step.load_scaler_state(state.get("scaler"))
        if "step" in state:
            self.step.load_extra_state(state["step"])
        self.train_state.load(state)
        problem = self.strategy.load_comm_state(state.get("comm_hook"), self.train_state.step)
        if problem:
            log.warning("resuming from %s: %s", path, problem)

    def best_from_disk(self) -> Optional[dict[str, torch.Tensor]]:
        """The best weights of the run so far, from best (every rank reads it, as the resumed
        checkpoint)."""
        path = self.checkpointer.published("best")
        try:
            state = self.checkpointer.load(path)
            weights = checkpoints.model_weights(path, state)
        except UserError as e:
            log.warning(
                "the best weights so far are not in %s (%s): the test will use the last weights",
                path,
                e,
            )
            return None
        if state["position"]["step"] != self.monitor.best_step:
            log.warning(
                "%s is from step %d, not the best step %d: the test will use the last weights",
                path,
                state["position"]["step"],
                self.monitor.best_step,
            )
            return None
        return {k: v.cpu() for k, v in weights.items()}

    def save(self) -> list[tuple[int, Location]]:
        """A checkpoint of this step; the ones now complete on disk (Checkpointer.save)."""
        # validated here, and the best so far: best.pt
        best = self.monitor.best_step == self.train_state.step
        # Once per step; again only to publish as best.pt a step the first save did not.
        saved_step, saved_as_best = self.saved
        if saved_step == self.train_state.step and (saved_as_best or not best):
            return []
        self._check_finite_weights()
        with self.overheads.saving():
            complete = self.checkpointer.save(self.state(), self.train_state.step, best)
        self.overheads.write_wait_s = self.checkpointer.waited_s
        self.saved = (self.train_state.step, best)
        return complete

    def finish(self) -> list[tuple[int, Location]]:
        """The last write is on disk (before the summary says the run is done)."""
        with self.overheads.timed("checkpoint_time_s"):
            complete = self.checkpointer.finish()
        self.overheads.write_wait_s = self.checkpointer.waited_s
        return complete

    def published(self, which: str) -> str:
        return str(self.checkpointer.published(which))

    def _check_finite_weights(self) -> None:
        """Before a checkpoint: weights that are already nan or inf are never saved as good ones."""
        params = list(self.strategy.local_tensors())  # FSDP: this rank's shards
        finite = (
            torch.stack([torch.isfinite(p).all() for p in params]).all().to(torch.int32).reshape(1)
        )
        dist.all_reduce(finite, op=dist.ReduceOp.MIN)
        if not finite.item():
            self.diverged(f"the weights are not finite after step {self.train_state.step}")

    def diverged(self, what: str) -> None:
        """Stop every rank with one line; the last checkpoint (written from finite weights) is
        kept."""
        self.checkpointer.finish()  # a write in flight completes: it is the last good one
        last = self.checkpointer.published("last")
        kept = (
            f"the last good checkpoint is kept: {last} (step {self.saved[0]})"
            if self.saved[0] >= 0
            else "no checkpoint was written"
        )
        raise EveryRankError(
            f"training diverged: {what}; {kept}. Lower optim.lr, or set trainer.grad_clip"
        )
