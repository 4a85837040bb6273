"""The loop's measurements, in one meter: this rank's time per phase of each step (the timer: the
straggler report, reporting/stragglers.py), its steps' time and samples (throughput, the median
step), rank 0's time outside the steps (evaluation, checkpoint stalls), and the loss window (the
steps' global losses, with the ranks' stop flags).

What is timed depends on where the work runs:
- On the CPU (and any device but CUDA): host clocks at each phase boundary. The host does the work.
- On CUDA: an event on the current stream at each boundary. The host only queues kernels and runs
  ahead; the all-reduce holds the stream, not the host, at the end of backward, so host clocks
  would show no sync wait and put it wherever the host next waits for the device. The stream's time
  between events holds it: backward includes the all-reduce wait, and the phases add up to the
  stream's time per step. The data phase is the stream's time from the host asking for the batch to
  its arrival: the host's wait for the loader less what queued kernels hid of it (a hidden wait
  costs nothing). Events are read once the stream has passed them, without waiting, and all of them
  at the per-epoch gather, after one wait for the device: a synchronisation per phase would stall
  the very queue it times.

Per batch: a few clock reads or event records; per epoch: one small all-gather.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Optional, Union

import torch
import torch.distributed as dist

from hydra_ddp.config.schema import TrainerConf
from hydra_ddp.reporting.stragglers import PHASES, per_rank, straggler

# CUDA: once this many intervals wait, read those the stream has passed (bounded memory, no
# waiting); at four times as many, wait for the device (the host cannot normally run that far ahead
# of it).
READ_EVERY = 256


class HostClock:
    """Host time, added at each boundary: on the CPU the host does the work."""

    def __init__(self) -> None:
        self.mark = time.perf_counter()

    def lap(self, totals: dict[str, float], phase: str) -> None:
        now = time.perf_counter()
        totals[phase] += now - self.mark
        self.mark = now

    def settle(self) -> None:
        """Nothing to do: every lap is added at once."""


def cuda_event(device: torch.device) -> Any:
    """A timing event, recorded now on the device's current stream."""
    event = torch.cuda.Event(enable_timing=True)
    event.record(torch.cuda.current_stream(device))
    return event


class StreamClock:
    """Time on the device's stream between events recorded at the boundaries. An interval is added
    once the stream has passed its end: recording never waits for the device."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.mark = cuda_event(device)
        # (totals, phase, start, end), oldest first
        self.pending: list[tuple[dict[str, float], str, Any, Any]] = []

    def lap(self, totals: dict[str, float], phase: str) -> None:
        now = cuda_event(self.device)
        self.pending.append((totals, phase, self.mark, now))
        self.mark = now
        if len(self.pending) >= READ_EVERY:
            self._read(wait=len(self.pending) >= 4 * READ_EVERY)

    def settle(self) -> None:
        """Every interval added, after waiting for the stream to pass the last boundary."""
        self._read(wait=True)

    def _read(self, wait: bool) -> None:
        if wait:
            self.mark.synchronize()
        passed = 0
        for totals, phase, start, end in self.pending:
            if not end.query():
                break  # the stream passes events in order: the later ones are still ahead of it
            totals[phase] += start.elapsed_time(end) / 1000  # milliseconds
            passed += 1
        del self.pending[:passed]


class StepTimer:
    """This rank's running totals per phase (seconds) and its step count: on CUDA devices the
    stream's time (StreamClock), elsewhere the host's (HostClock)."""

    def __init__(self, enabled: bool = True, device: Union[torch.device, str, None] = None) -> None:
        self.enabled = enabled
        on_cuda = enabled and device is not None and torch.device(device).type == "cuda"
        self.clock = StreamClock(torch.device(device)) if on_cuda else HostClock()
        self.totals = dict.fromkeys(PHASES, 0.0)
        self.steps = 0
        # An epoch's first step is left out: it absorbs the epoch boundary (rank 0's validation
        # share and checkpoint), which would show as the other ranks' sync wait.
        self.counting = self.totals
        self.scratch = dict.fromkeys(PHASES, 0.0)
        # the totals at the last report: per-epoch deltas
        self.reported = dict.fromkeys(PHASES, 0.0)
        self.reported_steps = 0

    def batches(self, loader: Iterable) -> Iterator[Any]:
        """The loader's batches, timing the wait for each."""
        if not self.enabled:
            yield from loader
            return
        iterator = iter(loader)
        self.counting = self.scratch
        while True:
            self.clock.lap(self.counting, "other")  # logging, checkpoints, the loss window
            try:
                batch = next(iterator)
            except StopIteration:
                return
            self.clock.lap(self.counting, "data")
            yield batch

    def lap(self, phase: str) -> None:
        """The time since the last lap (or the batch's arrival) goes to `phase`."""
        if self.enabled:
            self.clock.lap(self.counting, phase)

    def end_step(self) -> None:
        if self.counting is self.totals:
            self.steps += 1
        self.counting = self.totals

    def gather(self, device: torch.device, since_last: bool = False) -> list[dict[str, float]]:
        """Every rank's totals (or their change since the last call with since_last): one
        all-gather. Nothing when timing is off."""
        if not self.enabled:
            return []
        self.clock.settle()  # CUDA: the intervals still unread, after one wait for the device
        values = [self.steps] + [self.totals[p] for p in PHASES]
        if since_last:
            values = [self.steps - self.reported_steps] + [
                self.totals[p] - self.reported[p] for p in PHASES
            ]
            self.reported, self.reported_steps = dict(self.totals), self.steps
        mine = torch.tensor(values, dtype=torch.float64, device=device)
        everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
        dist.all_gather(everyone, mine)
        return [dict(zip(("steps", *PHASES), t.tolist())) for t in everyone]


WARMUP_STEPS = 10  # excluded from the steady-state throughput and step time


@dataclass
class Overheads:
    """Rank 0's time outside the steps. checkpoint_time_s is the stall: serialising at the step
    boundary and waiting for the write at the end (the write itself runs beside training). A
    checkpoint mid-epoch is also inside its step's time."""

    eval_time_s: float = 0.0
    checkpoint_time_s: float = 0.0
    checkpoints: int = 0
    # how long each save held rank 0 at its step boundary
    save_stalls: list[float] = field(default_factory=list)
    # of that, waiting for the write (or upload) before to finish (Checkpointer.waited_s)
    write_wait_s: float = 0.0

    @contextlib.contextmanager
    def timed(self, kind: str) -> Iterator[None]:
        """Adds the time spent inside to `kind` (eval_time_s or checkpoint_time_s)."""
        started = time.perf_counter()
        try:
            yield
        finally:
            setattr(self, kind, getattr(self, kind) + time.perf_counter() - started)

    @contextlib.contextmanager
    def saving(self) -> Iterator[None]:
        """One checkpoint's save: its stall counted and kept."""
        before = self.checkpoint_time_s
        with self.timed("checkpoint_time_s"):
            yield
        self.save_stalls.append(self.checkpoint_time_s - before)
        self.checkpoints += 1

    def results(self) -> dict[str, Any]:
        return {
            "eval_time_s": self.eval_time_s,
            "checkpoint_time_s": self.checkpoint_time_s,
            "checkpoints": self.checkpoints,
            "checkpoint_stall_s": statistics.median(self.save_stalls) if self.save_stalls else None,
            "checkpoint_write_wait_s": self.write_wait_s,
        }  # per save


class Throughput:
    """This process's seconds and this rank's samples per optimizer step."""

    def __init__(self, replicas: int):
        # different batches per step: local samples × replicas is the global count
        self.replicas = replicas
        self.step_times: list[float] = []
        self.step_samples: list[int] = []
        self.tokens = self.token_samples = 0  # a language model's: tokens per sample, for tokens/s
        self.first_step_at: Optional[float] = None
        self.last = time.perf_counter()

    def start(self) -> None:
        """An epoch's steps begin: the first step's time counts from here."""
        self.last = time.perf_counter()

    def step_done(self, samples: int, tokens: Any = None) -> None:
        """`tokens`: the step's, an int or a tensor on the device (added there: read at the end)."""
        now = time.perf_counter()
        if tokens is not None:
            self.tokens, self.token_samples = self.tokens + tokens, self.token_samples + samples
        self.step_times.append(now - self.last)
        self.step_samples.append(samples)
        self.last = now
        if self.first_step_at is None:
            self.first_step_at = time.time()

    def samples_per_sec(self, warm: int = 0) -> float:
        return (
            sum(self.step_samples[warm:]) * self.replicas / max(sum(self.step_times[warm:]), 1e-9)
        )

    def results(self) -> dict[str, Any]:
        warm = min(WARMUP_STEPS, len(self.step_times) // 10)
        return {
            "samples_per_sec": self.samples_per_sec(),
            "steady_samples_per_sec": self.samples_per_sec(warm),
            "median_step_time_s": statistics.median(self.step_times[warm:])
            if self.step_times
            else 0.0,
            "train_time_s": sum(self.step_times),
            # This rank's tokens per sample times the samples/s (a task that counts tokens:
            # Task.tokens).
            "tokens_per_sec": self.samples_per_sec() * float(self.tokens) / self.token_samples
            if self.token_samples
            else None,
        }


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
    # the step in the first slot: the one after the last flush (the same on every rank)
    first: int = 1
    steps: list[int] = field(default_factory=list)
    losses: list[torch.Tensor] = field(default_factory=list)
    # a started all-reduce (its work, its tensor), not yet read
    pending: Optional[tuple[Any, torch.Tensor]] = None

    def add(self, step: int, loss: torch.Tensor) -> bool:
        self.steps.append(step)
        self.losses.append(loss.detach())
        return len(self.steps) >= self.size

    def flush(
        self, stop: bool, device: torch.device, out_of_time: bool = False
    ) -> tuple[list[int], list[float], bool, bool]:
        """(steps, global losses, whether any rank wants to stop, whether any rank's time is up).
        Every rank calls it at the same points."""
        self.start(stop, device, out_of_time)
        return self.collect()

    def start(self, stop: bool, device: torch.device, out_of_time: bool = False) -> None:
        """Send the window's losses and this rank's flags; collect() reads the result. Every rank
        calls it at the same points, with none pending."""
        if self.pending is not None:
            raise RuntimeError(
                "loss window: start() while an all-reduce is pending; collect() it first"
            )
        slots = self.size + 1  # uneven shards: one step more than a window, at an epoch's end
        if len(self.steps) > slots:
            raise RuntimeError(
                f"loss window holds {len(self.steps)} steps, more than its {slots} slots"
            )
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


class Meter:
    """The loop's measurements: the timer, throughput, overheads and the loss window, each read
    through this one object."""

    def __init__(self, settings: TrainerConf, device: torch.device, replicas: int):
        """`settings`: the trainer section; `replicas`: what the gradient all-reduce averages over
        (local samples × replicas is the global count)."""
        self.device = device
        self.timer = StepTimer(settings.timing, device)
        self.throughput = Throughput(replicas)
        self.overheads = Overheads()
        # Anomaly mode checks the (global) loss for nan at every step: a window of one.
        self.window = LossWindow(1 if settings.detect_anomaly else settings.log_every)
        # Mid-epoch windows are read a step after they are sent (anomaly mode: at the step).
        self.overlap_window = not settings.detect_anomaly
        self.ranks: list[dict[str, Any]] = []  # seconds per step by phase, per rank, at the end
        self.straggler: Optional[dict[str, Any]] = None

    def step_done(self, samples: int, tokens: Any) -> None:
        self.throughput.step_done(samples, tokens)
        self.timer.end_step()

    def epoch_shares(self) -> dict[str, float]:
        """Each rank's share of the epoch's step time by phase (gathered: every rank calls it)."""
        scalars: dict[str, float] = {}
        epoch_ranks = per_rank(self.timer.gather(self.device, since_last=True))
        if self.timer.reported_steps:
            for row in epoch_ranks:
                scalars.update(
                    {
                        f"train/time/rank{row['rank']}/{k[:-6]}": v
                        for k, v in row.items()
                        if k.endswith("_share")
                    }
                )
        return scalars

    def time_ranks(self) -> Optional[dict[str, Any]]:
        """Each rank's seconds per step by phase over the run (gathered: every rank calls it), kept
        for the results; the straggler among them, if any."""
        self.ranks = per_rank(self.timer.gather(self.device))
        self.straggler = straggler(self.ranks)
        return self.straggler

    def results(self, sum_over_replicas: Callable[[torch.Tensor], Any]) -> dict[str, Any]:
        """The run's throughput, rank 0's overheads, and the mean tokens an optimizer step trained
        on over every replica (a task that counts tokens, else None; `sum_over_replicas`: the
        strategy's)."""
        throughput, tokens_per_step = self.throughput, None
        if throughput.token_samples and throughput.step_times:
            total = torch.as_tensor(throughput.tokens, device=self.device)
            total = total.to(torch.float64).reshape(())
            work = sum_over_replicas(total)
            if work is not None:
                work.wait()
            tokens_per_step = total.item() / len(throughput.step_times)
        return {
            **throughput.results(),
            "tokens_per_step": tokens_per_step,
            **self.overheads.results(),  # rank 0's
            "ranks": self.ranks,  # reporting/stragglers.py
            "straggler": self.straggler,
            "first_step_at": throughput.first_step_at,
        }
