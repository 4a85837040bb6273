"""The loop's hooks end to end (hydra_ddp.hooks): a user's hook, named in trainer.hooks, sees every
event on every rank at the same points (the fit around, each optimizer step, each epoch's
validation), changes nothing it does not ask to (the losses bit for bit a run's without it), and
may end the run after a validation, as a search's pruner does."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from support import check_ok, csv_step_losses, run_train, summary

# the plain run is the session's reference run of this config (the custom step's plain run too,
# tests/e2e/test_custom_step.py)
RUN = ("trainer.epochs=2", "trainer.threads=1", "trainer.log_every=1", "scheduler=none")
HOOK = "+trainer.hooks=[{_target_:hook_events.Events,end_after_epoch:1}]"


def events(run_dir: Path, rank: int) -> list[dict]:
    return [
        json.loads(line)
        for line in (run_dir / f"hook_events.rank{rank}.jsonl").read_text().splitlines()
    ]


@pytest.mark.timeout(300)
def test_a_users_hook_sees_every_event_on_every_rank_and_may_end_the_run(
    tmp_path: Path, reference_run
):
    plain, hooked = reference_run(*RUN), tmp_path / "hooked"
    check_ok(run_train(hooked, *RUN, HOOK))
    epoch_steps = summary(plain)["history"][0]["step"]  # the step the first epoch ended at
    assert 0 < epoch_steps < summary(plain)["steps"]

    expected = (
        [{"event": "running", "step": 0}]
        + [{"event": "step_ended", "step": step} for step in range(1, epoch_steps + 1)]
        + [{"event": "validated", "epoch": 1, "step": epoch_steps}]
        + [{"event": "ran", "step": epoch_steps}]
    )
    for rank in (0, 1):
        seen = events(hooked, rank)
        validated = next(event for event in seen if event["event"] == "validated")
        assert {"val_loss", "train_loss"} <= set(validated.pop("metrics")), validated
        assert seen == expected, f"rank {rank}"
    ran = summary(hooked)
    assert ran["ended_by"] == "ended_by_a_hook" and ran["steps"] == epoch_steps
    # The hook changed nothing else: the first epoch's losses are the plain run's, bit for bit.
    assert csv_step_losses(hooked) == csv_step_losses(plain)[:epoch_steps]
