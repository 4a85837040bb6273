"""The training loop: epochs of optimizer steps, the global loss window, and the points where
validation, checkpoints and stopping happen. Every rank runs all of it: collectives line up."""

from __future__ import annotations

import contextlib
import logging
import math
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch.distributed.algorithms import Join

from hydra_ddp import hooks
from hydra_ddp.checkpoint import checkpointer as checkpointing
from hydra_ddp.config.run_config import RunConfig
from hydra_ddp.data import Loaders
from hydra_ddp.monitor import Monitor
from hydra_ddp.recipe import schedules
from hydra_ddp.training import reports
from hydra_ddp.training.length import RunLength
from hydra_ddp.training.parts import Optimization, Run, Trained
from hydra_ddp.training.position import Position
from hydra_ddp.training.saving import Saving
from hydra_ddp.training.step import build as step_of
from hydra_ddp.training.step import optimizer_steps
from hydra_ddp.training.stop import Ending
from hydra_ddp.training.throughput import Overheads, Throughput
from hydra_ddp.training.timing import StepTimer
from hydra_ddp.training.validation import Validation
from hydra_ddp.training.window import LossWindow

log = logging.getLogger(__name__)


class Trainer:
    """Runs the epochs: batches, global loss logging, validation, checkpoints, stopping (on request,
    early, on the time budget, on divergence), and the one test of the selected weights at the
    end."""

    def __init__(
        self,
        cfg: RunConfig,
        trained: Trained,
        optimization: Optimization,
        loaders: Loaders,
        length: RunLength,
        run: Run,
    ):
        """The loop and its collaborators, each given its settings and the parts it works with."""
        settings, device = cfg.trainer, trained.device
        self.settings, self.model = settings, trained.model
        self.loaders, self.device = loaders, device
        self.pos, self.overheads = Position(), Overheads()
        # this rank's time per phase (timing.py): the straggler report
        self.timer = StepTimer(settings.timing, device)
        self.step = step_of(
            settings.step, settings, trained, optimization, self.timer, cfg.data.num_classes
        )
        self.monitor = monitor = Monitor.from_config(settings)
        self.saving = Saving(
            cfg.checkpoint, run.checkpointer, self.step, monitor, self.pos, self.overheads
        )
        self.validation = Validation(
            trained, optimization.ema, loaders, run.reporter, monitor, self.overheads
        )
        self.ending = Ending(run.stop, settings.max_time, run.started_at)
        self.hooks = run.hooks  # side jobs on the loop's events (hooks.py)
        self.cfg = cfg
        self.throughput = Throughput(trained.strategy.data_parallel_size())
        self.reporter = run.reporter
        self.schedule = schedules.Stepping(optimization.scheduler, optimization.optimizer)
        self.accumulate = settings.accumulate  # read every batch: a plain int, not a config lookup
        # the tuner's short runs time their steps, no validation or test
        self.evaluates_at_end = cfg.job != "tune"
        # Anomaly mode checks the (global) loss for nan at every step: a window of one.
        self.window = LossWindow(1 if settings.detect_anomaly else settings.log_every)
        # Mid-epoch windows are read a step after they are sent (anomaly mode: at the step).
        self.overlap_window = not settings.detect_anomaly
        self.train_loss = float("nan")  # the last evaluated (possibly partial) epoch's mean
        self.length = length
        self.batches_per_epoch = length.batches_per_epoch
        self.common_batches = length.common_batches
        self.uneven = length.uneven
        self.ranks: list[dict[str, Any]] = []
        self.straggler: Optional[dict[str, Any]] = None
        self.world_size = dist.get_world_size()
        self.pos.started(self.world_size)  # a resumed run's history replaces it

    def resume_from(self, path: Path, state: dict[str, Any], cause: str = "resume") -> None:
        """Continue from a checkpoint (`cause`: why, should the world size differ;
        position.resize_cause)."""
        self.saving.resume_from(path, state)
        self.pos.regroup(checkpointing.saved_accumulation(state), self.accumulate)
        resize = self.pos.continued_at(self.world_size, saved_ranks=len(state["rng"]), cause=cause)
        if resize:
            self.reporter.scalars({"train/world_size": self.world_size}, self.pos.step)
            log.info("world size %(from)d → %(world_size)d at step %(step)d (%(cause)s)", resize)
        self.window.first = self.pos.step + 1
        if self.monitor.best_step is not None and self.monitor.best_step != self.pos.step:
            self.validation.best_weights = self.saving.best_from_disk()
        where = (path, self.pos.epoch, self.pos.batch, self.pos.step)
        log.info("resumed from %s at epoch %d, batch %d, step %d", *where)

    # --- the recipe ------------------------------------------------------------------------------
    def fit(self) -> dict[str, Any]:
        max_steps, epochs = self.length.max_steps, self.length.epochs
        run_dir, rank, total = Path(self.reporter.run_dir), dist.get_rank(), self.length.total_steps
        fit = hooks.Fit(run_dir, rank, self.world_size, self.device, self.pos.step, total)
        with contextlib.ExitStack() as stack:
            for hook in self.hooks:
                stack.enter_context(hook.running(fit))
            anomaly = torch.autograd.set_detect_anomaly(bool(self.settings.detect_anomaly))
            stack.enter_context(anomaly)
            validated_at = self._epochs(epochs, max_steps)
            early = self.ending.stopped_by or self.ending.ended_by  # a signal, max_time, a hook…
            ended = hooks.FitEnded(self.pos.step, self.pos.epoch, early)
            hooks.tell(self.hooks, "fit_ended", ended)
        self._finish(validated_at, epochs)
        return reports.results(self, epochs)

    def _epochs(self, epochs: int, max_steps: int) -> int:
        """Train the epochs; the step of the last validation."""
        validated_at = -1
        while self.pos.epoch < epochs and self.pos.step < max_steps and not self.ending.now:
            epoch = self.pos.epoch
            self._run_epoch(epoch, max_steps)
            if _epoch_complete(self.pos.batch >= self.batches_per_epoch, self.uneven, self.device):
                self.train_loss = self.pos.epoch_loss()
                best = False
                if self.settings.eval_every_epoch:
                    best = self._validate(f"epoch {epoch + 1}/{epochs}", epoch + 1)
                    validated_at = self.pos.step
                self.schedule.epoch_ended()
                self.pos.next_epoch()
                if self.saving.due_at_epoch_end(best):
                    self._save()
                if self.settings.eval_every_epoch:
                    self._after_validation(epoch + 1)
        return validated_at

    def _after_validation(self, epoch: int) -> None:
        """Early stopping, then the hooks' verdicts on an epoch's validation (every rank alike)."""
        self.ending.after_validation(self.monitor, self.pos.step)
        metrics = dict(self.validation.last)  # a copy: the loop's own stays as it is
        event = hooks.Validated(self.pos.step, epoch, metrics, self.ending.ended_by)
        self.ending.ended_by_hook(hooks.ending(self.hooks, "validated", event))

    def _save(self) -> None:
        """A checkpoint, the loggers' steps on disk first: a run killed after it resumes with no
        step up to it missing from metrics.csv or TensorBoard (the resume keeps those up to its
        step)."""
        self.reporter.flush()
        self._saved(self.saving.save())

    def _saved(self, complete: list[tuple[int, Path]]) -> None:
        for step, path in complete:
            hooks.tell(self.hooks, "checkpoint_saved", hooks.CheckpointSaved(step, path))

    def _finish(self, validated_at: int, epochs: int) -> None:
        """The end: a last validation where there was none at this step, the last checkpoint, the
        test."""
        evaluates = self.evaluates_at_end and not self.ending.stopped_by
        if validated_at != self.pos.step and evaluates:
            # Ended mid-epoch (max_steps, the time budget), or no validation per epoch: validate the
            # end.
            where = "end"
            if self.pos.batch:
                self.train_loss = self.pos.epoch_loss()
                where = f"epoch {self.pos.epoch + 1}/{epochs}, batch {self.pos.batch}"
            self._validate(where, self.pos.epoch)
        # a run that stops to be continued too
        saves_at_end = self.saving.on or self.ending.to_be_continued
        if saves_at_end:
            self._save()  # the last state (and best.pt)
        self._saved(self.saving.finish())
        # not after a signal, which asks for a quick exit: the test waits for the resumed run's end
        if evaluates:
            self.validation.test(
                self.pos.step, self.pos.epoch, self.saving.published if saves_at_end else None
            )
        self.ranks, self.straggler = reports.rank_times(self)
        if self.straggler:
            log.warning("straggler: %s", self.straggler["message"])

    # --- an epoch's batches ---------------------------------------------------------------------
    def _run_epoch(self, epoch: int, max_steps: int) -> None:
        """One epoch (or its rest, after a resume): optimizer steps of `accumulate` batches each."""
        sampler = self.loaders.train_sampler
        sampler.set_epoch(epoch)  # a new shuffle each epoch, the same on every rank
        # resuming mid-epoch: no batch replayed
        sampler.skip(self.pos.batch * self.loaders.batch_size)
        self.schedule.epoch_started(self.pos.step)
        self.model.train()
        with joined(self.model, self.loaders.train_sampler):
            stopped = self._run_batches(max_steps)
        if not stopped:
            if self.uneven:
                self.step.sync_optimizer_state()
            self._flush()  # also brings ranks that ran out a step early to the global step

    def _run_batches(self, max_steps: int) -> bool:
        """The epoch's optimizer steps; True when the ranks agreed to stop early."""
        self.throughput.start()
        batches = self.timer.batches(self.loaders.train)
        plans = optimizer_steps(
            batches, self.accumulate, self.pos.batch, self.length, together=self.step.over_units
        )
        for plan in plans:
            self.pos.batch += len(plan.sizes)
            loss, samples, tokens = self.step.run(plan, self.pos.step + 1)
            self.throughput.step_done(samples, tokens)
            self.pos.step += 1
            self.schedule.optimizer_stepped(self.pos.step)
            self.timer.end_step()
            ended_by = hooks.ending(self.hooks, "step_ended", self._step_ended(loss, samples))
            self.ending.ended_by_hook(ended_by)
            window_full = self.window.add(self.pos.step, loss)
            if self.pos.step >= max_steps:
                break
            if self.pos.batch >= self.common_batches:
                # The epoch's last batch: the flush, and the checkpoint if due, follow the loop (and
                # the evaluation, for best.pt). With uneven shards the shortest ranks are out of
                # batches from here on: no collective of ours until every rank has left the loop.
                continue
            if ended_by or self._report_pending():
                self._flush()  # the step since: the checkpoint's epoch loss must include it
                return True
            if window_full and self.overlap_window:
                # read a step later, while the next runs
                self.window.start(device=self.device, **self.ending.flags())
            elif window_full and self._flush():
                return True
            if self.saving.due_at_step():
                stop = self._flush()  # the checkpoint's epoch loss must include every step so far
                self._save()
                if stop:
                    return True
        return False

    def _step_ended(self, loss: torch.Tensor, samples: int) -> hooks.StepEnded:
        norms = self.step.grad_norms
        norm = norms[-1][1] if norms and norms[-1][0] == self.pos.step else None
        lr = self.step.optimizer.param_groups[0]["lr"]
        return hooks.StepEnded(self.pos.step, self.pos.epoch, lr, samples, loss.detach(), norm)

    # --- the loss window ------------------------------------------------------------------------
    def _flush(self) -> bool:
        """Report the window's global losses (and a window started earlier, still pending); True
        when the ranks agreed to stop (a signal, the time budget)."""
        stop = self._report_pending()
        return self._report(*self.window.flush(device=self.device, **self.ending.flags())) or stop

    def _report_pending(self) -> bool:
        """The window started a step ago, if any, reported; True when the ranks agreed to stop."""
        return self.window.pending is not None and self._report(*self.window.collect())

    def _report(self, steps: list[int], losses: list[float], stop: bool, time_up: bool) -> bool:
        """Log a window's global losses, act on its flags; True when the ranks agreed to stop."""
        reports.step_rows(self, steps, losses)
        hooks.tell(self.hooks, "logged", hooks.Logged(tuple(steps), tuple(losses)))
        self.pos.epoch_loss_sum += sum(losses)
        self.pos.epoch_loss_count += len(losses)
        if losses:
            # a rank that ran out of batches a step early catches up
            self.pos.step = max(self.pos.step, steps[-1])
        if not all(math.isfinite(loss) for loss in losses):  # global values: every rank stops here
            bad = next(step for step, loss in zip(steps, losses) if not math.isfinite(loss))
            self.saving.diverged(f"the loss is {losses[steps.index(bad)]} at step {bad}")
        return self.ending.agree(stop, time_up, self.pos.step)

    # --- validation and results -----------------------------------------------------------------
    def _validate(self, where: str, epoch: int) -> bool:
        """Validation (when there is a split for it) and the monitored metric; True: the best
        weights so far."""
        metrics = self.validation.validate(self.train_loss)
        self.reporter.scalars(reports.epoch_scalars(self, metrics), self.pos.step)
        best = self.validation.record(metrics, self.pos.step, epoch)
        shown = f"  {self.validation.shown(metrics, 'val')}" if "val_samples" in metrics else ""
        note = f"  (best {self.monitor.metric})" if best else ""
        log.info(
            "%s  step %d  train loss %.4f%s%s", where, self.pos.step, self.train_loss, shown, note
        )
        return best


def _epoch_complete(done: bool, uneven: bool, device: torch.device) -> bool:
    """Every rank ran all its batches of the epoch (`done`: this one did; not stopped by max_steps
    or a signal): the same answer everywhere."""
    if not uneven:
        return done  # every rank ran the same batches
    flag = torch.tensor([1 if done else 0], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def joined(model: torch.nn.Module, sampler: Any) -> contextlib.AbstractContextManager:
    """Uneven shards: DDP's Join lets a rank that ran out of batches shadow the others' gradient
    all-reduces (with zeros; the average is over the ranks that still had a batch)."""
    if sampler.pad:
        return contextlib.nullcontext()
    return Join([getattr(model, "_orig_mod", model)], divide_by_initial_world_size=False)
