"""Per-rank timing (training/meter.py, reporting/stragglers.py): the straggler report from per-rank
totals, and the timer's bookkeeping on the host's clock and on a CUDA stream's events (stand-ins
here; cuda_check, at the end, is the same on a real GPU)."""

from __future__ import annotations

import time
import types
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from hydra_ddp.reporting.stragglers import PHASES, per_rank, straggler
from hydra_ddp.training import meter as timing
from hydra_ddp.training.meter import StepTimer

# Seconds per phase of one batch; powers of two, so that the sums are exact.
HOST = {"data": 0.5, "forward": 0.25, "backward": 0.125, "optimizer": 0.0625, "other": 0.03125}
STREAM = {"data": 0.0078125, "forward": 1.0, "backward": 2.0, "optimizer": 0.25, "other": 0.015625}


def totals(data: float, forward: float, backward: float, steps: int = 10) -> dict[str, float]:
    """A rank's gathered totals from its seconds per step."""
    return {
        "steps": steps,
        "data": data * steps,
        "forward": forward * steps,
        "backward": backward * steps,
        "optimizer": 0.001 * steps,
        "other": 0.001 * steps,
    }


def test_a_rank_slow_in_forward_is_named_for_the_others_sync_wait():
    # Rank 1's forward takes 60 ms longer; the others wait for it in their backward's all-reduce.
    rows = per_rank(
        [totals(0.001, 0.02, 0.09), totals(0.001, 0.08, 0.03), totals(0.001, 0.02, 0.09)]
    )
    assert [round(r["sync_wait_s"], 6) for r in rows] == [0.06, 0.0, 0.06]
    # the fastest rank's: the compute
    assert all(r["backward_s"] == pytest.approx(0.03) for r in rows)
    found = straggler(rows)
    assert found["rank"] == 1 and found["cause"] == "forward"
    assert found["message"].startswith("rank 1: forward") and "trainer.threads" in found["message"]


def test_no_notable_wait_names_nobody():
    assert straggler(per_rank([totals(0.001, 0.02, 0.031), totals(0.001, 0.02, 0.03)])) is None
    assert straggler(per_rank([totals(0.001, 0.08, 0.03)])) is None  # one rank waits for nobody
    assert per_rank([]) == [] and straggler([]) is None


def run_epoch(timer: StepTimer, advance: Callable[[str], None], batches: int = 3):
    """The training loop's calls for one epoch; advance(phase) moves the clocks on by that phase's
    time."""

    def loader() -> Iterator[int]:
        for i in range(batches):
            advance("data")  # inside next(): the wait for the batch
            yield i

    for _ in timer.batches(loader()):
        for phase in ("forward", "backward", "optimizer"):
            advance(phase)
            timer.lap(phase)
        timer.end_step()
        advance("other")


def expected(seconds: dict[str, float], epochs: int, batches: int = 3) -> dict[str, float]:
    """An epoch's first step is left out, but not the loop's work after it."""
    counted = epochs * (batches - 1)
    return {
        "steps": counted,
        **{p: seconds[p] * counted for p in PHASES[:-1]},
        "other": seconds["other"] * epochs * batches,
    }


class ManualClock:
    """The host clock, moved on by the test."""

    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now

    def advance(self, phase: str) -> None:
        self.now += HOST[phase]


@pytest.fixture
def host(monkeypatch: pytest.MonkeyPatch) -> ManualClock:
    clock = ManualClock()
    monkeypatch.setattr(timing, "time", types.SimpleNamespace(perf_counter=clock.perf_counter))
    return clock


@pytest.fixture
def one_rank(tmp_path: Path) -> Iterator[None]:
    dist.init_process_group(
        "gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1
    )
    yield
    dist.destroy_process_group()


def test_the_host_clock_adds_each_phase_and_gathers_per_epoch_and_in_all(
    host: ManualClock, one_rank: None
):
    timer = StepTimer(True)
    assert isinstance(timer.clock, timing.HostClock)
    run_epoch(timer, host.advance)
    assert timer.gather(torch.device("cpu"), since_last=True) == [expected(HOST, epochs=1)]
    run_epoch(timer, host.advance)
    assert timer.gather(torch.device("cpu"), since_last=True) == [expected(HOST, epochs=1)]
    assert timer.gather(torch.device("cpu")) == [expected(HOST, epochs=2)]


def test_timing_off_times_nothing_and_touches_no_device(
    host: ManualClock, monkeypatch: pytest.MonkeyPatch
):
    monkeypatch.setattr(timing, "cuda_event", None)  # called: a TypeError
    for device in (None, "cpu", torch.device("cuda", 0)):
        timer = StepTimer(False, device)
        run_epoch(timer, host.advance)
        assert (
            timer.totals == dict.fromkeys(PHASES, 0.0) and timer.gather(torch.device("cpu")) == []
        )
    assert isinstance(StepTimer(True, "cpu").clock, timing.HostClock)


class ManualStream:
    """A CUDA stream as the timer sees it: its events hold the stream's time when it reaches them,
    and it reaches them `lag` events behind the newest, or at once up to one synchronized on."""

    def __init__(self, lag: int) -> None:
        self.now, self.lag, self.recorded, self.passed, self.waits = 0.0, lag, 0, 0, 0

    def advance(self, phase: str) -> None:
        self.now += STREAM[phase]

    def record(self, device: torch.device) -> Event:
        assert device.type == "cuda"
        self.recorded += 1
        self.passed = max(self.passed, self.recorded - self.lag)
        return Event(self, self.recorded - 1, self.now)


class Event:
    def __init__(self, stream: ManualStream, index: int, at: float) -> None:
        self.stream, self.index, self.at = stream, index, at

    def query(self) -> bool:
        return self.index < self.stream.passed

    def synchronize(self) -> None:
        self.stream.waits += 1
        self.stream.passed = max(self.stream.passed, self.index + 1)

    def elapsed_time(self, end: Event) -> float:
        assert self.query() and end.query(), "an event read before the stream passed it"
        return (end.at - self.at) * 1000  # milliseconds, like torch.cuda.Event's


def stream_timer(monkeypatch: pytest.MonkeyPatch, lag: int) -> tuple[StepTimer, ManualStream]:
    stream = ManualStream(lag)
    monkeypatch.setattr(timing, "cuda_event", stream.record)
    timer = StepTimer(True, torch.device("cuda", 0))
    assert isinstance(timer.clock, timing.StreamClock)
    return timer, stream


def test_on_cuda_the_phases_are_the_streams_time_read_after_one_wait_at_the_gather(
    host: ManualClock, monkeypatch: pytest.MonkeyPatch, one_rank: None
):
    timer, stream = stream_timer(monkeypatch, lag=10**9)  # the stream passes nothing by itself

    def advance(phase: str) -> None:  # the host's time and the stream's differ: the stream's count
        host.advance(phase)
        stream.advance(phase)

    run_epoch(timer, advance)
    run_epoch(timer, advance)
    # nothing read yet, nobody waited
    assert timer.totals == dict.fromkeys(PHASES, 0.0) and stream.waits == 0
    assert timer.gather(torch.device("cpu")) == [expected(STREAM, epochs=2)]
    assert stream.waits == 1 and not timer.clock.pending


def test_on_cuda_passed_events_are_read_as_they_pile_up_without_waiting(
    host: ManualClock, monkeypatch: pytest.MonkeyPatch
):
    monkeypatch.setattr(timing, "READ_EVERY", 8)
    timer, stream = stream_timer(monkeypatch, lag=3)  # a stream a few events behind the host
    for _ in range(20):
        run_epoch(timer, stream.advance)
        assert len(timer.clock.pending) < 8
    assert stream.waits == 0
    timer.clock.settle()
    assert {"steps": timer.steps, **timer.totals} == expected(STREAM, epochs=20)


def test_on_cuda_a_stream_far_behind_is_waited_for_to_bound_the_events_kept(
    host: ManualClock, monkeypatch: pytest.MonkeyPatch
):
    monkeypatch.setattr(timing, "READ_EVERY", 8)
    timer, stream = stream_timer(monkeypatch, lag=10**9)
    for _ in range(10):
        run_epoch(timer, stream.advance)
        assert len(timer.clock.pending) < 4 * 8
    assert stream.waits > 0


def cuda_check() -> None:
    """The stream clock on a real GPU, for the GPU bench (no test here skips; there is no GPU here):
        PYTHONPATH=tests .venv/bin/python -c "import unit.test_timing as t; t.cuda_check()"
    Matmuls queued in forward count as the device runs them, though the host returns at once."""
    device = torch.device("cuda", torch.cuda.current_device())
    a = torch.randn(4096, 4096, device=device)
    timer = StepTimer(True, device)
    for _ in timer.batches(range(3)):
        for _ in range(10):
            torch.mm(a, a)
        timer.lap("forward")
        timer.end_step()
    timer.clock.settle()
    torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(10):
        torch.mm(a, a)
    torch.cuda.synchronize()
    reference = time.perf_counter() - started
    per_step = timer.totals["forward"] / timer.steps
    assert timer.steps == 2 and 0.5 < per_step / reference < 2, (per_step, reference)
    print(
        f"forward on the stream {per_step * 1e3:.2f} ms per "
        f"step, synchronized host clock {reference * 1e3:.2f} ms"
    )
