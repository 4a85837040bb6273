"""The training loop and the distributed evaluation. Every rank runs all of it: collectives line up."""

from __future__ import annotations

import contextlib
import logging
import math
import os
import signal
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterator, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms import Join
from tqdm import tqdm

from hydra_ddp import checkpoint
from hydra_ddp.checkpoint import Checkpointer
from hydra_ddp.data import Loaders
from hydra_ddp.errors import EveryRankError, UserError
from hydra_ddp.evaluation import evaluate
from hydra_ddp.monitor import Monitor
from hydra_ddp.reporting import Reporter
from hydra_ddp.strategy import DDPStrategy
from hydra_ddp.timing import StepTimer, per_rank, straggler

log = logging.getLogger(__name__)

WARMUP_STEPS = 10  # excluded from the steady-state throughput and step time


class StopRequest:
    """Pre-emption (SIGTERM; Slurm's SIGUSR1, submitit's SIGUSR2) or Ctrl-C: noted here, agreed on by
    all ranks at the next sync."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2)

    FORCE_AFTER_S = 1.0  # a second signal this much later stops at once, without the checkpoint

    def __init__(self) -> None:
        self.signum: Optional[int] = None
        self.noted_at = 0.0

    def install(self) -> None:
        for sig in self.SIGNALS:
            signal.signal(sig, self._note)

    def _note(self, signum: int, frame: Any) -> None:
        # A Ctrl-C reaches a worker twice at once (from the terminal, and passed on by the launcher):
        # only a later one, a person asking again, means "now".
        if self.signum is not None and time.monotonic() - self.noted_at > self.FORCE_AFTER_S:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
        if self.signum is None:
            self.signum, self.noted_at = signum, time.monotonic()


@dataclass
class LossWindow:
    """Per-step training losses made global (averaged over ranks) with one all-reduce per window.

    A collective every step would stall the loop; one every `size` steps costs little, and less
    when it overlaps the next step (start, then collect a step later: the loop does not wait for
    the round trip). The same all-reduce carries the stop flags (a signal; the time budget
    spent), so every rank stops at the same step. Losses travel in
    fixed slots (one per step since the last flush, with a count of the ranks that ran it), so
    every rank sends the same number of values even when some ran out of batches a step earlier
    (uneven shards); a rank learns the global last step from the counts.
    """

    size: int
    first: int = 1  # the step in the first slot: the one after the last flush (the same on every rank)
    steps: list[int] = field(default_factory=list)
    losses: list[torch.Tensor] = field(default_factory=list)
    pending: Optional[tuple[Any, torch.Tensor]] = None  # a started all-reduce (its work, its tensor), not yet read

    def add(self, step: int, loss: torch.Tensor) -> bool:
        self.steps.append(step)
        self.losses.append(loss.detach())
        return len(self.steps) >= self.size

    def flush(self, stop: bool, device: torch.device,
              out_of_time: bool = False) -> tuple[list[int], list[float], bool, bool]:
        """(steps, global losses, whether any rank wants to stop, whether any rank's time is up).
        Every rank calls it at the same points."""
        self.start(stop, device, out_of_time)
        return self.collect()

    def start(self, stop: bool, device: torch.device, out_of_time: bool = False) -> None:
        """Send the window's losses and this rank's flags; collect() reads the result. Every rank
        calls it at the same points, with none pending."""
        if self.pending is not None:
            raise RuntimeError("loss window: start() while an all-reduce is pending; collect() it first")
        slots = self.size + 1  # uneven shards: one step more than a window, at an epoch's end
        if len(self.steps) > slots:
            raise RuntimeError(f"loss window holds {len(self.steps)} steps, more than its {slots} slots")
        packed = torch.zeros(2 * slots + 2, dtype=torch.float64, device=device)
        if self.steps:
            where = torch.tensor([s - self.first for s in self.steps], device=device)
            packed[where] = torch.stack(self.losses).double()
            packed[slots + where] = 1.0
        packed[-2] = 1.0 if stop else 0.0
        packed[-1] = 1.0 if out_of_time else 0.0
        self.pending = (dist.all_reduce(packed, async_op=True), packed)
        self.steps, self.losses = [], []

    def collect(self) -> tuple[list[int], list[float], bool, bool]:
        """The started all-reduce's result, as flush() returns it (waiting for it if need be)."""
        if self.pending is None:
            raise RuntimeError("loss window: collect() with no all-reduce started")
        work, packed = self.pending
        self.pending = None
        work.wait()
        slots = self.size + 1
        sums, counts = packed[:slots].tolist(), packed[slots:-2].tolist()
        done = [i for i, count in enumerate(counts) if count]
        steps = [self.first + i for i in done]
        values = [sums[i] / counts[i] for i in done]
        self.first = steps[-1] + 1 if steps else self.first
        stop_flag, time_flag = packed[-2:].tolist()
        return steps, values, bool(stop_flag), bool(time_flag)


@dataclass
class Position:
    """Where the loop is: what a checkpoint needs to continue exactly."""

    epoch: int = 0
    batch: int = 0  # batches done in `epoch`
    step: int = 0  # optimizer steps done in all
    epoch_loss_sum: float = 0.0
    epoch_loss_count: int = 0


def supervised_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The training loss, in float32 whatever the model computes in (autocast, FSDP's mixed
    precision): a bf16 or fp16 loss would round the sum over the batch. For fp32 outputs the cast
    is no operation."""
    return F.cross_entropy(output.float(), target)


def accumulation_group(batch: int, accumulate: int, batches_per_epoch: int) -> int:
    """How many batches the optimizer step of the epoch's `batch`-th (from 1) batch takes: `accumulate`,
    but fewer for the epoch's last step when the batches do not divide (divided by its own size, it
    takes the mean gradient of its batches, as every other step does)."""
    first = (batch - 1) // accumulate * accumulate + 1
    return min(accumulate, batches_per_epoch - first + 1)


class Trainer:
    """Runs the epochs: batches, global loss logging, validation, checkpoints, stopping (on request,
    early, on the time budget, on divergence), and the one test of the selected weights at the end."""

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: Optional[Any],
        loaders: Loaders,
        device: torch.device,
        cfg: Any,
        reporter: Reporter,
        checkpointer: Checkpointer,
        stop: StopRequest,
        progress: bool,
        started_at: float = 0.0,
        *,
        strategy: DDPStrategy,
    ):
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        self.strategy = strategy  # what differs between DDP and FSDP (strategy.py)
        self.loaders, self.device, self.cfg = loaders, device, cfg
        self.reporter, self.checkpointer, self.stop = reporter, checkpointer, stop
        self.progress = progress
        self.pos = Position()
        # Anomaly mode checks the (global) loss for nan at every step: a window of one.
        self.window = LossWindow(1 if cfg.trainer.detect_anomaly else cfg.trainer.log_every)
        # Mid-epoch windows are read a step after they are sent; anomaly mode stops at the step itself.
        self.overlap_window = not cfg.trainer.detect_anomaly
        self.profiler: Optional[Any] = None
        precision = str(cfg.trainer.precision)
        self.amp_dtype = {"32": None, "bf16": torch.bfloat16, "16": torch.float16}[precision]
        self.scaler = torch.amp.GradScaler(device.type, enabled=precision == "16")  # fp16 only: bf16 needs none
        self.memory_format = torch.channels_last if cfg.trainer.channels_last else torch.preserve_format
        self.grad_clip = cfg.trainer.grad_clip
        # Read every step: plain ints, not config lookups.
        self.accumulate, self.every_n_steps = cfg.trainer.accumulate, cfg.checkpoint.every_n_steps
        self.grad_norms: list[tuple[int, torch.Tensor]] = []  # (step, global norm before clipping), until logged
        max_time = cfg.trainer.max_time
        self.deadline = started_at + max_time if max_time else None
        self.timer = StepTimer(cfg.trainer.timing, device)  # this rank's time per phase (timing.py): the straggler report
        self.step_times: list[float] = []  # seconds per step, this process
        self.step_samples: list[int] = []  # samples per step, this rank
        self.first_step_at: Optional[float] = None
        self.monitor = Monitor.from_config(cfg.trainer)
        self.best_weights: Optional[dict[str, torch.Tensor]] = None  # a copy, on the CPU, while not the current ones
        self.val_metrics: dict[str, Any] = {}  # the last validation's
        self.history: list[dict[str, Any]] = []  # every validation of this run
        self.test_metrics: dict[str, Any] = {}
        self.tested: Optional[dict[str, Any]] = None  # which weights the test used
        self.train_loss = float("nan")  # the last evaluated (possibly partial) epoch's mean
        self.stopped_by: Optional[str] = None  # a signal: checkpoint and exit at once
        self.ended_by: Optional[str] = None  # early_stopping or max_time: checkpoint, test, and finish
        self.saved: tuple[int, bool] = (-1, False)  # (step, as best.pt) of the last checkpoint
        # Where the time outside the steps goes: checkpoint_time_s is the stall, serialising at the step
        # boundary and waiting for the write at the end (the write itself runs beside training).
        # A checkpoint mid-epoch is also inside its step's time.
        self.overheads = {"eval_time_s": 0.0, "checkpoint_time_s": 0.0, "checkpoints": 0}
        self.save_stalls: list[float] = []  # how long each save held rank 0 at its step boundary

    # --- checkpoint state -----------------------------------------------------------------------
    def state(self) -> dict[str, Any]:
        return {
            # FQN-keyed, whole (ddp) or this rank's shards (the others): any strategy loads either.
            **self.strategy.checkpoint_state(self.optimizer),
            "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
            "scaler": self.scaler.state_dict() if self.scaler.is_enabled() else None,
            "position": asdict(self.pos),
            "monitor": self.monitor.state(),
            "comm_hook": self.strategy.comm_state(),  # PowerSGD's error feedback and warm start
        }

    def resume_from(self, path: Path, state: dict[str, Any]) -> None:
        self.checkpointer.restore(state, path, self.strategy, self.optimizer, self.scheduler)
        if state.get("scaler") and self.scaler.is_enabled():
            self.scaler.load_state_dict(state["scaler"])
        self.pos = Position(**state["position"])
        problem = self.strategy.load_comm_state(state.get("comm_hook"), self.pos.step)
        if problem:
            log.warning("resuming from %s: %s", path, problem)
        self.window.first = self.pos.step + 1
        self.monitor.load(state.get("monitor"))
        if self.monitor.best_step is not None and self.monitor.best_step != self.pos.step:
            self.best_weights = self._best_from_disk()
        log.info("resumed from %s at epoch %d, batch %d, step %d", path, self.pos.epoch, self.pos.batch, self.pos.step)

    def _best_from_disk(self) -> Optional[dict[str, torch.Tensor]]:
        """The best weights of the run so far, from best (every rank reads it, as the resumed checkpoint)."""
        path = self.checkpointer.published("best")
        try:
            state = self.checkpointer.load(path)
            weights = checkpoint.model_weights(path, state)
        except UserError as e:
            log.warning("the best weights so far are not in %s (%s): the test will use the last weights", path, e)
            return None
        if state["position"]["step"] != self.monitor.best_step:
            log.warning("%s is from step %d, not the best step %d: the test will use the last weights",
                        path, state["position"]["step"], self.monitor.best_step)
            return None
        return {k: v.cpu() for k, v in weights.items()}

    def _save(self) -> None:
        best = self.monitor.best_step == self.pos.step  # validated here, and the best so far: best.pt
        # Once per step; again only to publish as best.pt a step the first save did not.
        saved_step, saved_as_best = self.saved
        if saved_step == self.pos.step and (saved_as_best or not best):
            return
        self._check_finite_weights()
        before = self.overheads["checkpoint_time_s"]
        with self._timed("checkpoint_time_s"):
            self.checkpointer.save(self.state(), self.pos.step, best)
        self.save_stalls.append(self.overheads["checkpoint_time_s"] - before)
        self.overheads["checkpoints"] += 1
        self.saved = (self.pos.step, best)

    def _checkpoints_on(self) -> bool:
        return bool(self.cfg.checkpoint.every_epoch or self.cfg.checkpoint.every_n_steps)

    def _saves_at_end(self) -> bool:
        """A run with checkpoints, and any run that stops to be continued, ends with one."""
        return bool(self._checkpoints_on() or self.stopped_by or self.ended_by == "max_time")

    # --- the loop -------------------------------------------------------------------------------
    def fit(self) -> dict[str, Any]:
        trainer_cfg = self.cfg.trainer
        self.batches_per_epoch = len(self.loaders.train)
        self.common_batches, longest = self._epoch_lengths()
        self.uneven = self.common_batches != longest
        steps_per_epoch = math.ceil(longest / trainer_cfg.accumulate)  # the same on every rank
        max_steps = trainer_cfg.max_steps or steps_per_epoch * trainer_cfg.epochs
        epochs = min(trainer_cfg.epochs, math.ceil(max_steps / steps_per_epoch))
        bar = tqdm(total=max_steps, initial=self.pos.step, disable=not self.progress, unit="step", dynamic_ncols=True)
        with contextlib.ExitStack() as stack:
            self.profiler = stack.enter_context(self._profiling())
            stack.enter_context(torch.autograd.set_detect_anomaly(bool(trainer_cfg.detect_anomaly)))
            validated_at = self._epochs(epochs, max_steps, bar)
        bar.close()
        self._finish(validated_at, epochs)
        return self._results(epochs)

    def _epochs(self, epochs: int, max_steps: int, bar: tqdm) -> int:
        """Train the epochs; the step of the last validation."""
        trainer_cfg = self.cfg.trainer
        validated_at = -1
        while self.pos.epoch < epochs and self.pos.step < max_steps and not (self.stopped_by or self.ended_by):
            epoch = self.pos.epoch
            self._run_epoch(epoch, max_steps, bar)
            if self._epoch_complete():
                self.train_loss = self._epoch_loss()
                best = False
                if trainer_cfg.eval_every_epoch:
                    best = self._validate(f"epoch {epoch + 1}/{epochs}", epoch + 1)
                    validated_at = self.pos.step
                if self.scheduler is not None:
                    self.scheduler.step()
                self.pos = Position(epoch=epoch + 1, step=self.pos.step)
                if self.cfg.checkpoint.every_epoch or self._step_checkpoint_due() or (best and self._checkpoints_on()):
                    self._save()
                if self.monitor.should_stop and not self.ended_by:
                    self.ended_by = "early_stopping"
                    log.warning("early stopping at step %d: %s has not improved by more than %g for %d validation(s) "
                                "(best %.6g at step %d)", self.pos.step, self.monitor.metric, self.monitor.min_delta,
                                self.monitor.stale, self.monitor.best, self.monitor.best_step)
        return validated_at

    def _finish(self, validated_at: int, epochs: int) -> None:
        """The end: a last validation where there was none at this step, the last checkpoint, the test."""
        if validated_at != self.pos.step and not self.stopped_by:
            # Ended mid-epoch (max_steps, the time budget), or no validation per epoch: validate the end.
            if self.pos.batch:
                self.train_loss = self._epoch_loss()
            where = f"epoch {self.pos.epoch + 1}/{epochs}, batch {self.pos.batch}" if self.pos.batch else "end"
            self._validate(where, self.pos.epoch)
        if self._saves_at_end():
            self._save()  # the last state (and best.pt)
        with self._timed("checkpoint_time_s"):
            self.checkpointer.finish()  # the last write is on disk before the summary says the run is done
        if not self.stopped_by:  # a signal asks for a quick exit: the test waits for the resumed run's end
            self._test()
        self.ranks = per_rank(self.timer.gather(self.device))
        self.straggler = straggler(self.ranks)
        if self.straggler:
            log.warning("straggler: %s", self.straggler["message"])

    def _epoch_lengths(self) -> tuple[int, int]:
        """(fewest, most) batches per epoch of any rank. Equal but for data.even_shards=false, where
        shard lengths differ by up to one sample."""
        if self.cfg.data.even_shards:
            return self.batches_per_epoch, self.batches_per_epoch
        counts = torch.tensor([-self.batches_per_epoch, self.batches_per_epoch], device=self.device)
        dist.all_reduce(counts, op=dist.ReduceOp.MAX)
        shortest, longest = -int(counts[0].item()), int(counts[1].item())
        return shortest, longest

    def _epoch_complete(self) -> bool:
        """Every rank ran all its batches (not stopped by max_steps or a signal): the same answer everywhere."""
        done = self.pos.batch >= self.batches_per_epoch
        if not self.uneven:
            return done  # every rank ran the same batches
        flag = torch.tensor([1 if done else 0], device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        return bool(flag.item())

    def _run_epoch(self, epoch: int, max_steps: int, bar: tqdm) -> None:
        """One epoch (or its rest, after a resume): optimizer steps of `accumulate` batches each."""
        sampler = self.loaders.train_sampler
        sampler.set_epoch(epoch)  # a new shuffle each epoch, the same on every rank
        sampler.skip(self.pos.batch * self.cfg.data.batch_size)  # resuming mid-epoch: no batch replayed
        self.model.train()
        with self._join():
            stopped = self._run_batches(max_steps, bar)
        if not stopped:
            if self.uneven:
                self._sync_optimizer_state()
            self._flush(bar)  # also brings ranks that ran out a step early to the global step

    def _join(self) -> contextlib.AbstractContextManager:
        """Uneven shards: DDP's Join lets a rank that ran out of batches shadow the others' gradient
        all-reduces (with zeros; the average is over the ranks that still had a batch)."""
        if self.cfg.data.even_shards:
            return contextlib.nullcontext()
        return Join([getattr(self.model, "_orig_mod", self.model)], divide_by_initial_world_size=False)

    def _sync_optimizer_state(self) -> None:
        """After an uneven epoch, Join has given every rank the weights of the ranks that ran longest
        (rank 0 among them); their optimizer state (momentum, Adam's moments) follows from rank 0."""
        tensors = [v for state in self.optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)]
        if self.scaler.is_enabled():
            tensors += [v for v in (self.scaler._scale, self.scaler._growth_tracker) if v is not None]
        for value in tensors:
            on_device = value.to(self.device)  # e.g. Adam's step counter lives on the CPU; nccl needs the GPU
            dist.broadcast(on_device, src=0)
            value.copy_(on_device)

    def _run_batches(self, max_steps: int, bar: tqdm) -> bool:
        """The epoch's batches; True when the ranks agreed to stop early."""
        accumulate = self.accumulate
        micro_losses: list[torch.Tensor] = []
        samples = 0
        last = time.perf_counter()
        for x, y in self.timer.batches(self.loaders.train):
            self.pos.batch += 1
            # Gradients are all-reduced once per optimizer step, on its last batch.
            sync = self.pos.batch % accumulate == 0 or self.pos.batch == self.batches_per_epoch
            micro_losses.append(self._run_batch(x, y, sync, accumulation_group(self.pos.batch, accumulate,
                                                                                self.batches_per_epoch)))
            samples += y.numel()
            if not sync:
                continue
            loss = micro_losses[0] if len(micro_losses) == 1 else torch.stack(micro_losses).mean()
            now = time.perf_counter()
            self.step_times.append(now - last)
            self.step_samples.append(samples)
            micro_losses, samples, last = [], 0, now
            if self.first_step_at is None:
                self.first_step_at = time.time()
            self.pos.step += 1
            self.timer.end_step()
            if self.profiler is not None:
                self.profiler.step()
            bar.update()
            window_full = self.window.add(self.pos.step, loss)
            if self.pos.step >= max_steps:
                break
            if self.pos.batch >= self.common_batches:
                # The epoch's last batch: the flush, and the checkpoint if due, follow the loop (and
                # the evaluation, for best.pt). With uneven shards the shortest ranks are out of
                # batches from here on: no collective of ours until every rank has left the loop.
                continue
            if self._report_pending(bar):
                self._flush(bar)  # the step since: the checkpoint's epoch loss must include it
                return True
            if window_full and self.overlap_window:
                self.window.start(**self._window_flags())  # read a step later, while the next step runs
            elif window_full and self._flush(bar):
                return True
            if self._step_checkpoint_due():
                stop = self._flush(bar)  # the checkpoint's epoch loss must include every step so far
                self._save()
                if stop:
                    return True
        return False

    def _step_checkpoint_due(self) -> bool:
        every_n = self.every_n_steps
        return bool(every_n) and self.pos.step % every_n == 0

    def _run_batch(self, x: torch.Tensor, y: torch.Tensor, sync: bool, group: int = 1) -> torch.Tensor:
        """Forward and backward of one batch; the optimizer steps on `sync` batches only. `group`: the
        batches of this optimizer step, whose mean loss its gradient is."""
        x = x.to(self.device, non_blocking=True, memory_format=self.memory_format)
        y = y.to(self.device, non_blocking=True)
        with contextlib.nullcontext() if sync else self.strategy.no_sync():  # no all-reduce mid-accumulation
            with torch.autocast(self.device.type, dtype=self.amp_dtype, enabled=self.amp_dtype is not None):
                loss = supervised_loss(self.model(x), y)
            self.timer.lap("forward")
            scaled = loss / group if group > 1 else loss  # no extra op in the graph for 1
            self.scaler.scale(scaled).backward()  # DDP all-reduces here on sync
            self.timer.lap("backward")
        if sync:
            if self.grad_clip:
                self.scaler.unscale_(self.optimizer)  # fp16: clip the true gradients, not the scaled ones
                # The gradients are all-reduced already: the same norm, and the same clipping, on every rank.
                norm = self.strategy.clip_grad_norm(self.grad_clip)  # FSDP, TP: over the shards
                self.grad_norms.append((self.pos.step + 1, norm.detach()))
            self.scaler.step(self.optimizer)
            self.scaler.update()
            self.optimizer.zero_grad(set_to_none=True)
            self.timer.lap("optimizer")
        return loss.detach()

    def _flush(self, bar: tqdm) -> bool:
        """Report the window's global losses (and a window started earlier, still pending); True when
        the ranks agreed to stop (a signal, the time budget)."""
        stop = self._report_pending(bar)
        return self._report(*self.window.flush(**self._window_flags()), bar) or stop

    def _report_pending(self, bar: tqdm) -> bool:
        """The window started a step ago, if any, reported; True when the ranks agreed to stop."""
        return self.window.pending is not None and self._report(*self.window.collect(), bar)

    def _window_flags(self) -> dict[str, Any]:
        """What this rank sends with a window: a stop requested, its time budget spent."""
        return {"stop": self.stop.signum is not None, "device": self.device,
                "out_of_time": self.deadline is not None and time.time() >= self.deadline}

    def _report(self, steps: list[int], losses: list[float], stop: bool, time_up: bool, bar: tqdm) -> bool:
        """Log a window's global losses, act on its flags; True when the ranks agreed to stop."""
        self.reporter.series("train/loss", steps, losses)
        if self.grad_norms:
            norm_steps, norms = zip(*self.grad_norms)
            self.reporter.series("train/grad_norm", norm_steps, torch.stack(norms).tolist())
            self.grad_norms = []
        self.pos.epoch_loss_sum += sum(losses)
        self.pos.epoch_loss_count += len(losses)
        if losses:
            bar.set_postfix(loss=f"{losses[-1]:.4f}", refresh=False)
            self.pos.step = max(self.pos.step, steps[-1])  # a rank that ran out of batches a step early catches up
        if not all(math.isfinite(loss) for loss in losses):  # global values: every rank stops here
            bad = next(step for step, loss in zip(steps, losses) if not math.isfinite(loss))
            self._diverged(f"the loss is {losses[steps.index(bad)]} at step {bad}")
        if stop and not self.stopped_by:
            name = signal.Signals(self.stop.signum).name if self.stop.signum else "a signal to another rank"
            self.stopped_by = name
            log.warning("stop requested (%s): saving a checkpoint at step %d and exiting", name, self.pos.step)
        elif time_up and not self.ended_by:
            self.ended_by = "max_time"
            log.warning("trainer.max_time (%gs) is spent: a checkpoint at step %d, the test, and the end",
                        self.cfg.trainer.max_time, self.pos.step)
        return stop or time_up

    def _check_finite_weights(self) -> None:
        """Before a checkpoint: weights that are already nan or inf are never saved as good ones."""
        params = list(self.strategy.local_tensors())  # FSDP: this rank's shards
        finite = torch.stack([torch.isfinite(p).all() for p in params]).all().to(torch.int32).reshape(1)
        dist.all_reduce(finite, op=dist.ReduceOp.MIN)
        if not finite.item():
            self._diverged(f"the weights are not finite after step {self.pos.step}")

    def _diverged(self, what: str) -> None:
        """Stop every rank with one line; the last checkpoint (written from finite weights) is kept."""
        self.checkpointer.finish()  # a write in flight completes: it is the last good one
        last = self.checkpointer.published("last")
        kept = (f"the last good checkpoint is kept: {last} (step {self.saved[0]})" if self.saved[0] >= 0
                else "no checkpoint was written")
        raise EveryRankError(f"training diverged: {what}; {kept}. Lower optim.lr, or set trainer.grad_clip")

    def _validate(self, where: str, epoch: int) -> bool:
        """Validation (when there is a split for it) and the monitored metric; True: the best weights so far."""
        metrics: dict[str, Any] = {"train_loss": self.train_loss}
        if self.loaders.val is not None:
            with self._timed("eval_time_s"):
                metrics.update(self._evaluate(self.loaders.val, "val"))
        self.val_metrics = metrics
        scalars = {"train/epoch_loss": self.train_loss, "train/lr": self.optimizer.param_groups[0]["lr"],
                   "perf/samples_per_sec": self._samples_per_sec(self.step_times, self.step_samples)}
        if "val_loss" in metrics:
            scalars.update({"val/loss": metrics["val_loss"], "val/accuracy": metrics["val_accuracy"]})
        epoch_ranks = per_rank(self.timer.gather(self.device, since_last=True))  # every rank's, this epoch
        if self.timer.reported_steps:
            for row in epoch_ranks:
                scalars.update({f"perf/rank{row['rank']}/{k[:-6]}": v for k, v in row.items() if k.endswith("_share")})
        self.reporter.scalars(scalars, self.pos.step)
        best = self.monitor.update(metrics, self.pos.step, epoch)
        self.history.append({"epoch": epoch, "step": self.pos.step, **metrics, "best": best})
        if best:  # kept aside (on the CPU) for the test, in case later epochs do worse
            # FSDP: gathered to rank 0 (the others keep an empty dict, and receive them from rank 0).
            self.best_weights = {k: v.detach().to("cpu", copy=True) for k, v in self.strategy.model_state().items()}
        shown = f"  val loss {metrics['val_loss']:.4f}  val accuracy {metrics['val_accuracy']:.4f}" \
            if "val_loss" in metrics else ""
        log.info("%s  step %d  train loss %.4f%s%s", where, self.pos.step, self.train_loss, shown,
                 f"  (best {self.monitor.metric})" if best else "")
        return best

    def _evaluate(self, split: Any, name: str) -> dict[str, Any]:
        """Exact evaluation of one split, as this strategy needs it run and added up."""
        return evaluate(self.strategy.eval_module, split, self.device, name, self.memory_format,
                        lockstep=self.strategy.lockstep_eval, **self.strategy.eval_reduction())

    def _test(self) -> None:
        """The test split's one reading, on the selected weights: the best by trainer.monitor, else the last."""
        weights, step = "last", self.pos.step
        if self.monitor.best_step is not None:
            if self.monitor.best_step == self.pos.step:
                weights = "best"
            elif self.best_weights is not None:
                self.strategy.load_model_state(self.best_weights, everywhere=False)  # training is over
                weights, step = "best", self.monitor.best_step
        with self._timed("eval_time_s"):
            self.test_metrics = self._evaluate(self.loaders.test, "test")
        saved = self._saves_at_end()
        self.tested = {
            "weights": weights, "step": step,
            "epoch": self.monitor.best_epoch if weights == "best" else self.pos.epoch,
            "checkpoint": str(self.checkpointer.published(weights)) if saved else None,
            "monitor": self.monitor.metric, "monitor_value": self.monitor.best if weights == "best" else None,
        }
        self.reporter.scalars({"test/loss": self.test_metrics["test_loss"],
                               "test/accuracy": self.test_metrics["test_accuracy"]}, self.pos.step)
        log.info("test (once, on the %s weights: step %d%s)  test loss %.4f  test accuracy %.4f", weights, step,
                 f", {self.monitor.metric} {self.monitor.best:.4f}" if weights == "best" else "",
                 self.test_metrics["test_loss"], self.test_metrics["test_accuracy"])

    def _profiling(self) -> contextlib.AbstractContextManager:
        """torch.profiler on its schedule (cfg.profiler) on the chosen ranks: a Chrome/Perfetto trace
        per rank in run_dir/profile/, and the top operators by self time in the log."""
        settings, rank = self.cfg.profiler, dist.get_rank()
        if not self.cfg.trainer.profile or (settings.ranks is not None and rank not in settings.ranks):
            return contextlib.nullcontext()
        from torch.profiler import ProfilerActivity, profile, schedule

        cuda = self.device.type == "cuda"
        out = self.reporter.run_dir / "profile"
        out.mkdir(exist_ok=True)

        def ready(prof: Any) -> None:
            trace = out / f"rank{rank}.json"
            prof.export_chrome_trace(str(trace))
            table = prof.key_averages().table(sort_by="self_cuda_time_total" if cuda else "self_cpu_time_total",
                                              row_limit=settings.row_limit)
            log.info("profile of rank %d (steps %d…%d): %s\n%s", rank, settings.wait + settings.warmup + 1,
                     settings.wait + settings.warmup + settings.active, trace, table)

        return profile(
            activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else []),
            schedule=schedule(wait=settings.wait, warmup=settings.warmup, active=settings.active, repeat=1),
            on_trace_ready=ready,
        )

    @contextlib.contextmanager
    def _timed(self, overhead: str) -> Iterator[None]:
        """Adds the time spent inside to self.overheads[overhead]."""
        started = time.perf_counter()
        try:
            yield
        finally:
            self.overheads[overhead] += time.perf_counter() - started

    def _epoch_loss(self) -> float:
        return self.pos.epoch_loss_sum / max(1, self.pos.epoch_loss_count)

    def _samples_per_sec(self, times: list[float], samples: list[int]) -> float:
        # Every replica runs the same number of batches: local samples × replicas is the global count.
        return sum(samples) * self.strategy.data_parallel_size() / max(sum(times), 1e-9)

    def _results(self, epochs: int) -> dict[str, Any]:
        warm = min(WARMUP_STEPS, len(self.step_times) // 10)
        monitor = self.monitor
        selected = next((h for h in self.history if h["step"] == monitor.best_step), self.val_metrics)
        return {
            "epochs": epochs,
            "steps": self.pos.step,
            "train_loss": self.train_loss,
            # The selected weights' validation (the best by the monitor, else the last validation).
            "val_loss": selected.get("val_loss"),
            "val_accuracy": selected.get("val_accuracy"),
            "val_samples": selected.get("val_samples"),
            **self.test_metrics,
            "tested": self.tested,
            "test_passes": self.loaders.test.passes,
            "monitor": {"metric": monitor.metric, "mode": monitor.mode, "best": monitor.best,
                        "best_step": monitor.best_step, "best_epoch": monitor.best_epoch},
            "objective": monitor.best,  # what train.py returns to a sweeper
            "history": self.history,
            "samples_per_sec": self._samples_per_sec(self.step_times, self.step_samples),
            "steady_samples_per_sec": self._samples_per_sec(self.step_times[warm:], self.step_samples[warm:]),
            "median_step_time_s": statistics.median(self.step_times[warm:]) if self.step_times else 0.0,
            "train_time_s": sum(self.step_times),
            **self.overheads,  # rank 0's
            "checkpoint_stall_s": statistics.median(self.save_stalls) if self.save_stalls else None,  # per save
            "ranks": self.ranks,  # seconds per step by phase, per rank (timing.py)
            "straggler": self.straggler,
            "first_step_at": self.first_step_at,
            "stopped_by": self.stopped_by,
            "ended_by": self.ended_by or ("max_steps" if self.cfg.trainer.max_steps and
                                          self.pos.step >= self.cfg.trainer.max_steps else "epochs"),
        }
