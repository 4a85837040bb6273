"""Where each rank's step time goes, and which rank the others wait for.

Every rank adds up the time of its steps by phase: waiting for the next batch (data), forward,
backward, the optimizer, and the loop's own work between steps (other). The backward of a step's
last batch ends at DDP's gradient all-reduce, which no rank leaves before the slowest arrives: the
backward time a rank spends beyond the fastest rank's is time spent waiting there (sync wait). The
rank that waits least is the one the others wait for, and the phase where it spends more than the
others is the cause.

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

import statistics
import time
from collections.abc import Iterable, Iterator
from typing import Any, Optional, Union

import torch
import torch.distributed as dist

# other: the loop's own work between steps
PHASES = ("data", "forward", "backward", "optimizer", "other")
# Others waiting at least this share of their step time for one rank: a straggler worth naming.
NOTABLE_WAIT = 0.2
ADVICE = {
    "data": "raise data.num_workers (or data.preload=true for "
    "in-memory data), or check this rank's data source",
    "forward": "check this rank's device and its CPU threads "
    "(trainer.threads), or other load on its cores",
    "optimizer": "check this rank's device and its CPU threads "
    "(trainer.threads), or other load on its cores",
    "other": "its work between steps (rank 0: logging and checkpoints): "
    "raise trainer.log_every or checkpoint less often",
}
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


def per_rank(gathered: list[dict[str, float]]) -> list[dict[str, Any]]:
    """Per rank: seconds per step by phase, with backward split into compute (the fastest rank's)
    and sync wait (the rest), and each phase's share of the step."""
    if not gathered:
        return []
    per_step = [{p: g[p] / max(g["steps"], 1) for p in PHASES} for g in gathered]
    backward = min(s["backward"] for s in per_step)
    rows = []
    for rank, s in enumerate(per_step):
        step = sum(s.values())
        phases = {
            "data": s["data"],
            "forward": s["forward"],
            "backward": backward,
            "sync_wait": s["backward"] - backward,
            "optimizer": s["optimizer"],
            "other": s["other"],
        }
        rows.append(
            {
                "rank": rank,
                "step_time_s": step,
                **{f"{k}_s": v for k, v in phases.items()},
                **{f"{k}_share": v / step if step else 0.0 for k, v in phases.items()},
            }
        )
    return rows


def straggler(rows: list[dict[str, Any]]) -> Optional[dict[str, Any]]:
    """The rank the others wait for, when they wait notably, with its dominant extra cost."""
    if len(rows) < 2:
        return None
    slow = min(rows, key=lambda r: r["sync_wait_s"])  # it arrives last: it hardly waits
    others = [r for r in rows if r is not slow]
    waiting = statistics.median(r["sync_wait_share"] for r in others)
    if waiting < NOTABLE_WAIT:
        return None
    excess = {p: slow[f"{p}_s"] - statistics.median(r[f"{p}_s"] for r in others) for p in ADVICE}
    cause = max(excess, key=excess.get)  # type: ignore[arg-type]
    if excess[cause] < 0.5 * statistics.median(r["sync_wait_s"] for r in others):
        # no phase of its own explains the waiting: contention that moves about, not a straggler
        return None
    label = "data wait" if cause == "data" else cause
    others_share = statistics.median(r[f"{cause}_share"] for r in others)
    return {
        "rank": slow["rank"],
        "cause": cause,
        "others_wait_share": waiting,
        "message": (
            f"rank {slow['rank']}: {label} {slow[f'{cause}_share']:.0%} of step time (others "
            f"{others_share:.0%}; they wait {waiting:.0%} of theirs for it) → {ADVICE[cause]}"
        ),
    }
