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

from hydra_ddp.checkpoint import Checkpointer
from hydra_ddp.data import Loaders
from hydra_ddp.reporting import Reporter

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

    A collective every step would stall the loop; one every `size` steps costs nothing. The
    same all-reduce carries the stop flag, so every rank stops at the same step. Losses travel in
    fixed slots (one per step since the last flush, with a count of the ranks that ran it), so
    every rank sends the same number of values even when some ran out of batches a step earlier
    (uneven shards); a rank learns the global last step from the counts.
    """

    size: int
    first: int = 1  # the step in the first slot: the one after the last flush (the same on every rank)
    steps: list[int] = field(default_factory=list)
    losses: list[torch.Tensor] = field(default_factory=list)

    def add(self, step: int, loss: torch.Tensor) -> bool:
        self.steps.append(step)
        self.losses.append(loss.detach())
        return len(self.steps) >= self.size

    def flush(self, stop: bool, device: torch.device) -> tuple[list[int], list[float], bool]:
        """(steps, global losses, whether any rank wants to stop). Every rank calls it at the same points."""
        slots = self.size + 1  # uneven shards: one step more than a window, at an epoch's end
        if len(self.steps) > slots:
            raise RuntimeError(f"loss window holds {len(self.steps)} steps, more than its {slots} slots")
        packed = torch.zeros(2 * slots + 1, dtype=torch.float64, device=device)
        if self.steps:
            where = torch.tensor([s - self.first for s in self.steps], device=device)
            packed[where] = torch.stack(self.losses).double()
            packed[slots + where] = 1.0
        packed[-1] = 1.0 if stop else 0.0
        dist.all_reduce(packed)
        sums, counts = packed[:slots].tolist(), packed[slots:-1].tolist()
        done = [i for i, count in enumerate(counts) if count]
        steps = [self.first + i for i in done]
        values = [sums[i] / counts[i] for i in done]
        self.first = steps[-1] + 1 if steps else self.first
        self.steps, self.losses = [], []
        return steps, values, bool(packed[-1].item())


@torch.no_grad()
def evaluate(model: nn.Module, loader: torch.utils.data.DataLoader, device: torch.device) -> dict[str, float]:
    """Exact global loss and accuracy: each rank sums its disjoint shard, then one all-reduce.

    Takes the unwrapped module: ranks may hold different batch counts, and DDP's forward would
    start collectives that then fail to line up.
    """
    model.eval()
    totals = torch.zeros(3, dtype=torch.float64, device=device)  # loss sum, correct, count
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        logits = model(x)
        totals[0] += F.cross_entropy(logits, y, reduction="sum").double()
        totals[1] += (logits.argmax(1) == y).sum()
        totals[2] += y.numel()
    dist.all_reduce(totals)
    loss_sum, correct, count = totals.tolist()
    return {"test_loss": loss_sum / count, "test_accuracy": correct / count, "test_samples": int(count)}


@dataclass
class Position:
    """Where the loop is: what a checkpoint needs to continue exactly."""

    epoch: int = 0
    batch: int = 0  # batches done in `epoch`
    step: int = 0  # optimizer steps done in all
    epoch_loss_sum: float = 0.0
    epoch_loss_count: int = 0


class Trainer:
    """Runs the epochs: batches, global loss logging, evaluation, checkpoints, stopping on request."""

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
    ):
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        self.loaders, self.device, self.cfg = loaders, device, cfg
        self.reporter, self.checkpointer, self.stop = reporter, checkpointer, stop
        self.progress = progress
        self.pos = Position()
        self.window = LossWindow(cfg.trainer.log_every)
        precision = str(cfg.trainer.precision)
        self.amp_dtype = {"32": None, "bf16": torch.bfloat16, "16": torch.float16}[precision]
        self.scaler = torch.amp.GradScaler(device.type, enabled=precision == "16")  # fp16 only: bf16 needs none
        self.memory_format = torch.channels_last if cfg.trainer.channels_last else torch.preserve_format
        self.step_times: list[float] = []  # seconds per step, this process
        self.step_samples: list[int] = []  # samples per step, this rank
        self.first_step_at: Optional[float] = None
        self.metrics: dict[str, Any] = {}
        self.train_loss = float("nan")  # the last evaluated (possibly partial) epoch's mean
        self.stopped_by: Optional[str] = None
        self.saved: tuple[int, bool] = (-1, False)  # (step, with a metric) of the last checkpoint
        # Where the time outside the steps goes: checkpoint_time_s is the stall, serialising at the step
        # boundary and waiting for the write at the end (the write itself runs beside training).
        # A checkpoint mid-epoch is also inside its step's time.
        self.overheads = {"eval_time_s": 0.0, "checkpoint_time_s": 0.0, "checkpoints": 0}

    # --- checkpoint state -----------------------------------------------------------------------
    def state(self) -> dict[str, Any]:
        return {
            "model": self.model.module.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
            "scaler": self.scaler.state_dict() if self.scaler.is_enabled() else None,
            "position": asdict(self.pos),
        }

    def resume_from(self, path: Path, state: dict[str, Any]) -> None:
        self.checkpointer.restore(state, path, self.model.module, self.optimizer, self.scheduler)
        if state.get("scaler") and self.scaler.is_enabled():
            self.scaler.load_state_dict(state["scaler"])
        self.pos = Position(**state["position"])
        self.window.first = self.pos.step + 1
        log.info("resumed from %s at epoch %d, batch %d, step %d", path, self.pos.epoch, self.pos.batch, self.pos.step)

    def _save(self, metric: Optional[float] = None) -> None:
        # Once per step; again only to bring in a metric the first save did not have (for best.pt).
        saved_step, saved_with_metric = self.saved
        if saved_step == self.pos.step and (saved_with_metric or metric is None):
            return
        with self._timed("checkpoint_time_s"):
            self.checkpointer.save(self.state(), self.pos.step, metric)
        self.overheads["checkpoints"] += 1
        self.saved = (self.pos.step, metric is not None)

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
        evaluated_at = -1
        while self.pos.epoch < epochs and self.pos.step < max_steps and not self.stopped_by:
            epoch = self.pos.epoch
            self._run_epoch(epoch, max_steps, bar)
            if self._epoch_complete():
                self.train_loss = self._epoch_loss()
                if trainer_cfg.eval_every_epoch:
                    self._evaluate(f"epoch {epoch + 1}/{epochs}")
                    evaluated_at = self.pos.step
                if self.scheduler is not None:
                    self.scheduler.step()
                self.pos = Position(epoch=epoch + 1, step=self.pos.step)
                if self.cfg.checkpoint.every_epoch or self._step_checkpoint_due():
                    self._save(self.metrics.get(self.cfg.checkpoint.best_metric))
        bar.close()
        if evaluated_at != self.pos.step:  # stopped mid-epoch (max_steps or a signal), or no eval per epoch
            if self.pos.batch:
                self.train_loss = self._epoch_loss()
            where = f"epoch {self.pos.epoch + 1}/{epochs}, batch {self.pos.batch}" if self.pos.batch else "end"
            self._evaluate(where)
        if self.cfg.checkpoint.every_epoch or self.cfg.checkpoint.every_n_steps or self.stopped_by:
            self._save(self.metrics.get(self.cfg.checkpoint.best_metric))  # the last state, and best.pt
        with self._timed("checkpoint_time_s"):
            self.checkpointer.finish()  # the last write is on disk before the summary says the run is done
        return self._results(epochs)

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
        accumulate = self.cfg.trainer.accumulate
        micro_losses: list[torch.Tensor] = []
        samples = 0
        last = time.perf_counter()
        for x, y in self.loaders.train:
            self.pos.batch += 1
            # Gradients are all-reduced once per optimizer step, on its last batch.
            sync = self.pos.batch % accumulate == 0 or self.pos.batch == self.batches_per_epoch
            micro_losses.append(self._run_batch(x, y, sync))
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
            bar.update()
            window_full = self.window.add(self.pos.step, loss)
            if self.pos.step >= max_steps:
                break
            if self.pos.batch >= self.common_batches:
                # The epoch's last batch: the flush, and the checkpoint if due, follow the loop (and
                # the evaluation, for best.pt). With uneven shards the shortest ranks are out of
                # batches from here on: no collective of ours until every rank has left the loop.
                continue
            if window_full and self._flush(bar):
                return True
            if self._step_checkpoint_due():
                stop = self._flush(bar)  # the checkpoint's epoch loss must include every step so far
                self._save()
                if stop:
                    return True
        return False

    def _step_checkpoint_due(self) -> bool:
        every_n = self.cfg.checkpoint.every_n_steps
        return bool(every_n) and self.pos.step % every_n == 0

    def _run_batch(self, x: torch.Tensor, y: torch.Tensor, sync: bool) -> torch.Tensor:
        """Forward and backward of one batch; the optimizer steps on `sync` batches only."""
        x = x.to(self.device, non_blocking=True, memory_format=self.memory_format)
        y = y.to(self.device, non_blocking=True)
        with contextlib.nullcontext() if sync else self.model.no_sync():  # no all-reduce mid-accumulation
            with torch.autocast(self.device.type, dtype=self.amp_dtype, enabled=self.amp_dtype is not None):
                loss = F.cross_entropy(self.model(x), y)
            self.scaler.scale(loss / self.cfg.trainer.accumulate).backward()  # DDP all-reduces here on sync
        if sync:
            self.scaler.step(self.optimizer)
            self.scaler.update()
            self.optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    def _flush(self, bar: tqdm) -> bool:
        """Report the window's global losses; True when the ranks agreed to stop."""
        steps, losses, stop = self.window.flush(self.stop.signum is not None, self.device)
        self.reporter.train_losses(steps, losses)
        self.pos.epoch_loss_sum += sum(losses)
        self.pos.epoch_loss_count += len(losses)
        if losses:
            bar.set_postfix(loss=f"{losses[-1]:.4f}", refresh=False)
            self.pos.step = steps[-1]  # a rank that ran out of batches a step early catches up
        if stop and not self.stopped_by:
            name = signal.Signals(self.stop.signum).name if self.stop.signum else "a signal to another rank"
            self.stopped_by = name
            log.warning("stop requested (%s): saving a checkpoint at step %d and exiting", name, self.pos.step)
        return stop

    def _evaluate(self, where: str) -> None:
        lr = self.optimizer.param_groups[0]["lr"]
        with self._timed("eval_time_s"):
            self.metrics = evaluate(self.model.module, self.loaders.test, self.device)
        epoch_loss = self.train_loss
        self.reporter.scalars(
            {
                "train/epoch_loss": epoch_loss,
                "test/loss": self.metrics["test_loss"],
                "test/accuracy": self.metrics["test_accuracy"],
                "train/lr": lr,
                "perf/samples_per_sec": self._samples_per_sec(self.step_times, self.step_samples),
            },
            self.pos.step,
        )
        log.info(
            "%s  step %d  train loss %.4f  test loss %.4f  test accuracy %.4f",
            where, self.pos.step, epoch_loss, self.metrics["test_loss"], self.metrics["test_accuracy"],
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

    @staticmethod
    def _samples_per_sec(times: list[float], samples: list[int]) -> float:
        # Every rank runs the same number of batches: local samples × world size is the global count.
        return sum(samples) * dist.get_world_size() / max(sum(times), 1e-9)

    def _results(self, epochs: int) -> dict[str, Any]:
        warm = min(WARMUP_STEPS, len(self.step_times) // 10)
        return {
            "epochs": epochs,
            "steps": self.pos.step,
            "train_loss": self.train_loss,
            **self.metrics,
            "samples_per_sec": self._samples_per_sec(self.step_times, self.step_samples),
            "steady_samples_per_sec": self._samples_per_sec(self.step_times[warm:], self.step_samples[warm:]),
            "median_step_time_s": statistics.median(self.step_times[warm:]) if self.step_times else 0.0,
            "train_time_s": sum(self.step_times),
            **self.overheads,  # rank 0's
            "first_step_at": self.first_step_at,
            "stopped_by": self.stopped_by,
        }
