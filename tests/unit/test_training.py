"""The loop's pieces in this process: the monitor's best and patience, the straggler named (on real
gloo ranks, exact evaluation and global train losses: tests/e2e/test_training.py)."""

from __future__ import annotations


def test_monitor_selects_the_best_and_counts_patience_with_min_delta():
    from hydra_ddp.monitor import Monitor

    loss = Monitor("val/loss", "min", patience=2, min_delta=0.05)
    seen = [
        loss.update({"val_loss": v}, step, step)
        for step, v in enumerate([float("nan"), 1.0, 0.98, 0.9, 0.95], 1)
    ]
    assert seen == [False, True, True, True, False]  # any improvement is the best; nan never is
    assert (loss.best, loss.best_step) == (0.9, 4)
    # 0.98 was better, but not by min_delta; 0.9 was
    assert loss.stale == 1 and not loss.should_stop
    loss.update({"val_loss": 0.91}, 6, 6)
    assert loss.should_stop
    accuracy = Monitor("val/accuracy", "max")
    assert accuracy.update({"val_accuracy": 0.5}, 1, 1) and not accuracy.update(
        {"val_accuracy": 0.4}, 2, 2
    )
    restored = Monitor("val/accuracy", "max")
    restored.load(accuracy.state())
    assert restored == accuracy
    other = Monitor("val/loss", "min")
    other.load(accuracy.state())  # another metric's record says nothing about this one
    assert other.best is None


def test_the_straggler_is_the_rank_that_waits_least_named_with_its_extra_cost():
    from hydra_ddp.reporting.stragglers import per_rank, straggler

    def rank(data, forward, backward, steps=10):  # seconds per step → totals
        return {
            "steps": steps,
            "data": data * steps,
            "forward": forward * steps,
            "backward": backward * steps,
            "optimizer": 0.001 * steps,
            "other": 0.001 * steps,
        }

    # Rank 2 waits 60 ms per step for data; the others wait for it inside their backward.
    rows = per_rank([rank(0.001, 0.02, 0.09), rank(0.001, 0.02, 0.09), rank(0.061, 0.02, 0.03)])
    assert [round(r["sync_wait_s"], 6) for r in rows] == [0.06, 0.06, 0.0]
    found = straggler(rows)
    assert (
        found["rank"] == 2 and found["cause"] == "data" and "rank 2: data wait" in found["message"]
    )
    # Waiting that no phase of one rank explains, or that is small, names nobody.
    assert straggler(per_rank([rank(0.001, 0.02, 0.035), rank(0.001, 0.02, 0.03)])) is None
    assert straggler(per_rank([rank(0.001, 0.02, 0.09), rank(0.001, 0.021, 0.03)])) is None
    assert per_rank([]) == [] and straggler([]) is None
