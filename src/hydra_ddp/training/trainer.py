"""The training loop: epochs of optimizer steps, the global loss window, and the points where
validation, checkpoints and stopping happen. Every rank runs all of it: collectives line up."""

from __future__ import annotations

import contextlib
import logging
import math
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms import Join

from hydra_ddp import hooks
from hydra_ddp.checkpoint import checkpointer as checkpointing
from hydra_ddp.config.run_config import RunConfig
from hydra_ddp.data import Loaders
from hydra_ddp.monitor import Monitor
from hydra_ddp.training.length import RunLength
from hydra_ddp.training.meter import Meter
from hydra_ddp.training.parts import Optimization, Run, Trained
from hydra_ddp.training.saving import Saving
from hydra_ddp.training.state import Ending, TrainState
from hydra_ddp.training.step import build as step_of
from hydra_ddp.training.step import optimizer_steps
from hydra_ddp.training.validation import Validation

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
        self.state = TrainState(Monitor.from_config(settings))
        # time, throughput, overheads, the loss window
        self.meter = Meter(settings, device, trained.strategy.data_parallel_size())
        self.step = step_of(
            settings.step, settings, trained, optimization, self.meter.timer, cfg.data.num_classes
        )
        overheads = self.meter.overheads
        self.saving = Saving(cfg.checkpoint, run.checkpointer, self.step, self.state, overheads)
        self.validation = Validation(
            trained, optimization.ema, loaders, run.reporter, self.state.monitor, overheads
        )
        self.ending = Ending(run.stop, settings.max_time, run.started_at)
        self.hooks = run.hooks  # side jobs on the loop's events (hooks.py)
        self.cfg, self.reporter = cfg, run.reporter
        self.accumulate = settings.accumulate  # read every batch: a plain int, not a config lookup
        # the tuner's short runs time their steps, no validation or test
        self.evaluates_at_end = cfg.job != "tune"
        self.train_loss = float("nan")  # the last evaluated (possibly partial) epoch's mean
        self.length = length
        self.world_size = dist.get_world_size()
        self.state.started(self.world_size)  # a resumed run's history replaces it

    def resume_from(self, path: Path, state: dict[str, Any], cause: str = "resume") -> None:
        """Continue from a checkpoint (`cause`: why, should the world size differ;
        state.resize_cause)."""
        self.saving.resume_from(path, state)
        self.state.regroup(checkpointing.saved_accumulation(state), self.accumulate)
        resize = self.state.continued_at(self.world_size, len(state["rng"]), cause)
        if resize:
            self.reporter.scalars({"train/world_size": self.world_size}, self.state.step)
            log.info("world size %(from)d → %(world_size)d at step %(step)d (%(cause)s)", resize)
        self.meter.window.first = self.state.step + 1
        best_step = self.state.monitor.best_step
        if best_step is not None and best_step != self.state.step:
            self.validation.best_weights = self.saving.best_from_disk()
        where = (path, self.state.epoch, self.state.batch, self.state.step)
        log.info("resumed from %s at epoch %d, batch %d, step %d", *where)

    # --- the recipe ------------------------------------------------------------------------------
    def fit(self) -> None:
        max_steps, epochs = self.length.max_steps, self.length.epochs
        run_dir, rank, total = Path(self.reporter.run_dir), dist.get_rank(), self.length.total_steps
        fit = hooks.Fit(run_dir, rank, self.world_size, self.device, self.state.step, total)
        with contextlib.ExitStack() as stack:
            for hook in self.hooks:
                stack.enter_context(hook.running(fit))
            anomaly = torch.autograd.set_detect_anomaly(bool(self.settings.detect_anomaly))
            stack.enter_context(anomaly)
            validated_at = self._epochs(epochs, max_steps)
            early = self.ending.stopped_by or self.ending.ended_by  # a signal, max_time, a hook…
            ended = hooks.FitEnded(self.state.step, self.state.epoch, early)
            hooks.tell(self.hooks, "fit_ended", ended)
        self._finish(validated_at, epochs)

    def _epochs(self, epochs: int, max_steps: int) -> int:
        """Train the epochs; the step of the last validation."""
        validated_at = -1
        while self.state.epoch < epochs and self.state.step < max_steps and not self.ending.now:
            epoch = self.state.epoch
            self._run_epoch(epoch, max_steps)
            done = self.state.batch >= self.length.batches_per_epoch
            if _epoch_complete(done, self.length.uneven, self.device):
                self.train_loss = self.state.epoch_loss()
                best = False
                if self.settings.eval_every_epoch:
                    best = self._validate(f"epoch {epoch + 1}/{epochs}", epoch + 1)
                    validated_at = self.state.step
                self.step.schedule.epoch_ended()
                self.state.next_epoch()
                if self.saving.every_epoch or self._checkpoint_due() or (best and self.saving.on):
                    self._save()
                if self.settings.eval_every_epoch:
                    self._after_validation(epoch + 1)
        return validated_at

    def _after_validation(self, epoch: int) -> None:
        """Early stopping, then the hooks' verdicts on an epoch's validation (every rank alike)."""
        self.ending.after_validation(self.state.monitor, self.state.step)
        metrics = dict(self.validation.last)  # a copy: the loop's own stays as it is
        event = hooks.Validated(self.state.step, epoch, metrics, self.ending.ended_by)
        self.ending.ended_by_hook(hooks.ending(self.hooks, "validated", event))

    def _save(self, finish: bool = False) -> None:
        """A checkpoint, the loggers' steps on disk first: a run killed after it resumes with no
        step up to it missing from metrics.csv or TensorBoard (the resume keeps those up to its
        step). `finish`: none, but the last write waited for."""
        self.reporter.flush()
        for step, path in self.saving.finish() if finish else self.saving.save():
            hooks.tell(self.hooks, "checkpoint_saved", hooks.CheckpointSaved(step, path))

    def _finish(self, validated_at: int, epochs: int) -> None:
        """The end: a last validation where there was none at this step, the last checkpoint, the
        test."""
        evaluates = self.evaluates_at_end and not self.ending.stopped_by
        if validated_at != self.state.step and evaluates:
            # Ended mid-epoch (max_steps, the time budget), or no validation per epoch: validate the
            # end.
            where = "end"
            if self.state.batch:
                self.train_loss = self.state.epoch_loss()
                where = f"epoch {self.state.epoch + 1}/{epochs}, batch {self.state.batch}"
            self._validate(where, self.state.epoch)
        # a run that stops to be continued too
        saves_at_end = self.saving.on or self.ending.to_be_continued
        if saves_at_end:
            self._save()  # the last state (and best.pt)
        self._save(finish=True)
        # not after a signal, which asks for a quick exit: the test waits for the resumed run's end
        if evaluates:
            self.validation.test(
                self.state.step, self.state.epoch, self.saving.published if saves_at_end else None
            )
        straggler = self.meter.time_ranks()  # gathered: every rank
        if straggler:
            log.warning("straggler: %s", straggler["message"])

    # --- an epoch's batches ---------------------------------------------------------------------
    def _run_epoch(self, epoch: int, max_steps: int) -> None:
        """One epoch (or its rest, after a resume): optimizer steps of `accumulate` batches each."""
        sampler = self.loaders.train_sampler
        sampler.set_epoch(epoch)  # a new shuffle each epoch, the same on every rank
        # resuming mid-epoch: no batch replayed
        sampler.skip(self.state.batch * self.loaders.batch_size)
        self.step.schedule.epoch_started(self.state.step)
        self.model.train()
        with joined(self.model, self.loaders.train_sampler):
            stopped = self._run_batches(max_steps)
        if not stopped:
            if self.length.uneven:
                self.step.sync_optimizer_state()
            self._flush()  # also brings ranks that ran out a step early to the global step

    def _run_batches(self, max_steps: int) -> bool:
        """The epoch's optimizer steps; True when the ranks agreed to stop early."""
        meter = self.meter
        meter.throughput.start()
        batches = meter.timer.batches(self.loaders.train)
        plans = optimizer_steps(
            batches, self.accumulate, self.state.batch, self.length, together=self.step.over_units
        )
        for plan in plans:
            self.state.batch += len(plan.sizes)
            loss, samples, tokens = self.step.run(plan, self.state.step + 1)
            meter.step_done(samples, tokens)
            self.state.step += 1
            ended_by = hooks.ending(self.hooks, "step_ended", self._step_ended(loss, samples))
            self.ending.ended_by_hook(ended_by)
            window_full = meter.window.add(self.state.step, loss)
            if self.state.step >= max_steps:
                break
            if self.state.batch >= self.length.common_batches:
                # The epoch's last batch: the flush, and the checkpoint if due, follow the loop (and
                # the evaluation, for best.pt). With uneven shards the shortest ranks are out of
                # batches from here on: no collective of ours until every rank has left the loop.
                continue
            if ended_by or self._report_pending():
                self._flush()  # the step since: the checkpoint's epoch loss must include it
                return True
            if window_full and meter.overlap_window:
                # read a step later, while the next runs
                meter.window.start(device=self.device, **self.ending.flags())
            elif window_full and self._flush():
                return True
            if self._checkpoint_due():
                stop = self._flush()  # the checkpoint's epoch loss must include every step so far
                self._save()
                if stop:
                    return True
        return False

    def _checkpoint_due(self) -> bool:
        every = self.saving.every_n_steps
        return bool(every) and self.state.step % every == 0

    def _step_ended(self, loss: torch.Tensor, samples: int) -> hooks.StepEnded:
        norms = self.step.grad_norms
        norm = norms[-1][1] if norms and norms[-1][0] == self.state.step else None
        lr = self.step.optimizer.param_groups[0]["lr"]
        return hooks.StepEnded(self.state.step, self.state.epoch, lr, samples, loss.detach(), norm)

    # --- the loss window ------------------------------------------------------------------------
    def _flush(self) -> bool:
        """Report the window's global losses (and a window started earlier, still pending); True
        when the ranks agreed to stop (a signal, the time budget)."""
        stop = self._report_pending()
        window = self.meter.window
        return self._report(*window.flush(device=self.device, **self.ending.flags())) or stop

    def _report_pending(self) -> bool:
        """The window started a step ago, if any, reported; True when the ranks agreed to stop."""
        window = self.meter.window
        return window.pending is not None and self._report(*window.collect())

    def _report(self, steps: list[int], losses: list[float], stop: bool, time_up: bool) -> bool:
        """Log a window's global losses, act on its flags; True when the ranks agreed to stop."""
        # a step's loss, gradient norm and rate in one row (a later step's wait for its loss)
        norms, rates = self.step.take_logged(steps[-1] if steps else 0)
        for step, loss in zip(steps, losses):
            row = {"train/loss": loss, "train/grad_norm": norms.get(step)}
            row["train/lr"] = rates.get(step)
            self.reporter.scalars({tag: v for tag, v in row.items() if v is not None}, step)
        hooks.tell(self.hooks, "logged", hooks.Logged(tuple(steps), tuple(losses)))
        self.state.epoch_loss_sum += sum(losses)
        self.state.epoch_loss_count += len(losses)
        if losses:
            # a rank that ran out of batches a step early catches up
            self.state.step = max(self.state.step, steps[-1])
        if not all(math.isfinite(loss) for loss in losses):  # global values: every rank stops here
            bad = next(step for step, loss in zip(steps, losses) if not math.isfinite(loss))
            self.saving.diverged(f"the loss is {losses[steps.index(bad)]} at step {bad}")
        return self.ending.agree(stop, time_up, self.state.step)

    # --- validation and results -----------------------------------------------------------------
    def _validate(self, where: str, epoch: int) -> bool:
        """Validation (when there is a split for it) and the monitored metric; True: the best
        weights so far."""
        metrics = self.validation.validate(self.train_loss)
        scalars = {
            "train/epoch_loss": self.train_loss,
            **self.step.schedule.epoch_rate(),
            "train/samples_per_sec": self.meter.throughput.samples_per_sec(),
            **(self.validation.tagged(metrics, "val") if "val_samples" in metrics else {}),
            **self.meter.epoch_shares(),  # gathered: every rank
        }
        self.reporter.scalars(scalars, self.state.step)
        best = self.validation.record(metrics, self.state.step, epoch)
        shown = f"  {self.validation.shown(metrics, 'val')}" if "val_samples" in metrics else ""
        note = f"  (best {self.state.monitor.metric})" if best else ""
        log.info(
            "%s  step %d  train loss %.4f%s%s", where, self.state.step, self.train_loss, shown, note
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
