"""Where the time goes: each step's time and samples (throughput, the median step), and the time
spent outside the steps (evaluation, checkpoint stalls)."""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Optional

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
