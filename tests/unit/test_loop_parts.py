"""The training loop's collaborators as plain objects: its state, the stop protocol, the meter's
overheads and throughput (no process group)."""

from __future__ import annotations

import signal
import time

import pytest

from hydra_ddp.monitor import Monitor
from hydra_ddp.training.length import RunLength, ended_by
from hydra_ddp.training.meter import WARMUP_STEPS, Overheads, Throughput
from hydra_ddp.training.state import Ending, StopRequest, TrainState
from hydra_ddp.training.step import optimizer_steps, sample_weights


def test_the_state_moves_to_the_next_epoch_in_place_and_round_trips_a_checkpoint():
    monitor = Monitor("val/loss", "min")
    state = TrainState(monitor, epoch=2, batch=7, step=40, epoch_loss_sum=3.0, epoch_loss_count=4)
    held = state  # a collaborator's reference
    assert state.epoch_loss() == 0.75
    state.next_epoch()
    assert held is state
    assert (state.epoch, state.batch, state.step, state.epoch_loss_count) == (3, 0, 40, 0)
    other = TrainState(Monitor("val/loss", "min", best=0.5, best_step=90, best_epoch=4, stale=2))
    other.step, other.epoch, other.world_sizes = 99, 5, [{"step": 0, "world_size": 2}]
    saved = other.saved()
    assert set(saved) == {"position", "monitor"}  # one unit: where it is, and the best so far
    state.load({**saved, "model": "the rest of a checkpoint, not the state's"})
    assert held.saved() == saved and held.monitor is monitor and monitor.best_step == 90
    with pytest.raises(TypeError):  # a checkpoint's position has exactly these fields
        state.load({**saved, "position": {**saved["position"], "unknown": 1}})
    position = {k: v for k, v in saved["position"].items() if k != "world_sizes"}
    older = {**saved, "position": position}
    state.load(older)  # a checkpoint from before the world sizes were kept
    assert (state.step, state.world_sizes) == (99, [])


@pytest.mark.parametrize(
    "batches, accumulate, done, groups",
    [
        (10, 4, 0, [4, 4, 2]),
        (8, 4, 0, [4, 4]),
        (3, 1, 0, [1, 1, 1]),
        (2, 4, 0, [2]),
        (10, 4, 4, [4, 2]),  # resumed after one step: the loader skipped its batches
    ],
)
def test_an_epochs_batches_are_grouped_by_optimizer_step(batches, accumulate, done, groups):
    from types import SimpleNamespace

    length = SimpleNamespace(batches_per_epoch=batches, batch_samples=8, last_batch_samples=5)
    for together in (True, False):  # fetched before the step, or as its forwards take them
        steps = [
            (plan.sizes, list(plan.batches))
            for plan in optimizer_steps(range(done, batches), accumulate, done, length, together)
        ]
        assert [len(group) for _, group in steps] == groups
        assert [b for _, group in steps for b in group] == list(range(done, batches))
        assert [sizes for sizes, _ in steps][-1][-1] == 5 and all(
            size == 8 for sizes, _ in steps[:-1] for size in sizes
        )


def test_micro_batches_of_unequal_samples_weigh_by_their_samples():
    assert sample_weights([32, 32, 32]) is None  # alike: each its mean ÷ 3, as the loop always did
    assert sample_weights([32]) is None
    assert sample_weights([8, 4]) == [8 / 12, 4 / 12]  # an epoch's short last batch weighs less


def test_the_ending_sends_this_ranks_flags_and_settles_what_the_ranks_agreed():
    request = StopRequest()
    ending = Ending(request, max_time=None, started_at=time.time())
    assert ending.flags() == {"stop": False, "out_of_time": False} and not ending.now
    assert ending.agree(stop=False, time_up=False, step=3) is False
    request.signum = signal.SIGTERM
    assert ending.flags()["stop"]
    assert ending.agree(stop=True, time_up=True, step=4) is True
    assert ending.stopped_by == "SIGTERM" and ending.ended_by is None and ending.to_be_continued


def test_a_signal_to_another_rank_stops_this_one_too_and_the_budget_ends_the_run():
    ending = Ending(StopRequest(), max_time=0.001, started_at=time.time() - 1)
    assert ending.flags()["out_of_time"]
    assert ending.agree(stop=False, time_up=True, step=9)
    assert ending.ended_by == "max_time" and ending.to_be_continued and ending.now
    other = Ending(StopRequest(), max_time=None, started_at=0.0)
    other.agree(stop=True, time_up=False, step=1)
    assert other.stopped_by == "a signal to another rank"


def test_early_stopping_does_not_replace_an_earlier_ending():
    stale = Monitor("val/loss", "min", patience=2, best=0.5, best_step=3, stale=2)
    patient = Monitor("val/loss", "min", patience=3, best=0.5, best_step=3, stale=2)
    ending = Ending(StopRequest(), max_time=1.0, started_at=0.0)
    ending.agree(stop=False, time_up=True, step=5)
    ending.after_validation(stale, step=6)
    assert ending.ended_by == "max_time"
    fresh = Ending(StopRequest(), max_time=None, started_at=0.0)
    fresh.after_validation(patient, step=6)
    assert fresh.ended_by is None
    fresh.after_validation(stale, step=6)
    assert fresh.ended_by == "early_stopping" and not fresh.to_be_continued


def test_overheads_count_each_save_and_its_stall():
    overheads = Overheads()
    for _ in range(3):
        with overheads.saving():
            pass
    with overheads.timed("eval_time_s"):
        pass
    results = overheads.results()
    assert results["checkpoints"] == 3 and len(overheads.save_stalls) == 3
    assert results["checkpoint_time_s"] == pytest.approx(sum(overheads.save_stalls))
    assert results["checkpoint_stall_s"] is not None and results["eval_time_s"] >= 0
    with pytest.raises(RuntimeError):
        with overheads.saving():
            raise RuntimeError("a failed save")
    assert overheads.checkpoints == 3  # a failed save is not counted


def test_throughput_counts_every_replica_and_leaves_out_the_warm_up():
    throughput = Throughput(replicas=4)
    throughput.step_times = [1.0] * 5 + [0.5] * 95
    throughput.step_samples = [8] * 100
    results = throughput.results()
    assert results["samples_per_sec"] == pytest.approx(800 * 4 / (5 + 47.5))
    assert WARMUP_STEPS == 10  # 10 of 100 steps left out: the 5 slow ones and 5 more
    assert results["steady_samples_per_sec"] == pytest.approx(90 * 8 * 4 / (90 * 0.5))
    assert results["median_step_time_s"] == 0.5 and results["train_time_s"] == pytest.approx(52.5)


def test_a_continued_run_has_nothing_to_train_only_at_one_of_its_bounds():
    # 3 epochs of 21 steps; or max_steps=30, which the run reaches in its second epoch.
    by_epochs = RunLength(21, 21, 21, 21, epochs=3, max_steps=63)
    by_steps = RunLength(21, 21, 21, 21, epochs=2, max_steps=30)
    assert (
        ended_by(by_epochs, {"epoch": 3, "step": 63, "batch": 0}, early_stopped=False) == "epochs"
    )
    assert ended_by(by_epochs, {"epoch": 2, "step": 42, "batch": 0}, early_stopped=False) is None
    assert (
        ended_by(by_epochs, {"epoch": 2, "step": 42, "batch": 0}, early_stopped=True)
        == "early_stopping"
    )
    assert (
        ended_by(by_steps, {"epoch": 1, "step": 30, "batch": 9}, early_stopped=False) == "max_steps"
    )
    assert ended_by(by_steps, {"epoch": 1, "step": 29, "batch": 8}, early_stopped=False) is None
