"""The loop's hooks end to end (hydra_ddp.hooks): docs/extending.md's StopBelow, written to a
package as the page shows it, and a hook that records every event it receives, on two ranks. Each
event comes on every rank at the same points with the same values (the fit around, each optimizer
step, each loss window, each epoch's validation, the checkpoint complete, the fit's end), the
records hold what the run's own files say, nothing changes that the hooks do not ask to (the losses
bit for bit a run's without them), and a hook ends the run after a validation or a step."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from support import (
    check_ok,
    csv_step_losses,
    run_train,
    summary,
    the_pages_module,
    with_pythonpath,
)

# the plain run is the session's reference run of this config (the custom step's plain run too,
# tests/e2e/test_custom_step.py)
RUN = ("trainer.epochs=2", "trainer.threads=1", "trainer.log_every=1", "scheduler=none")
EVENTS = "{_target_:hook_events.Events}"
STOP_BELOW = "{_target_:my_package.hooks.StopBelow,loss:1e9}"  # any validation loss is below


def events(run_dir: Path, rank: int) -> list[dict]:
    return [
        json.loads(line)
        for line in (run_dir / f"hook_events.rank{rank}.jsonl").read_text().splitlines()
    ]


@pytest.mark.timeout(300)
def test_hooks_receive_every_event_alike_on_every_rank_and_may_end_the_run(
    tmp_path: Path, reference_run
):
    plain, hooked = reference_run(*RUN), tmp_path / "hooked"
    env = with_pythonpath(the_pages_module("docs/extending.md", "hooks.py", tmp_path / "user"))
    check_ok(run_train(hooked, *RUN, f"+trainer.hooks=[{STOP_BELOW},{EVENTS}]", env=env))
    epoch_steps = summary(plain)["history"][0]["step"]  # the step the first epoch ended at
    assert 0 < epoch_steps < summary(plain)["steps"]
    ran = summary(hooked)
    # The page's hook ended the run after the first validation: the word it returned.
    assert ran["ended_by"] == "loss_reached" and ran["steps"] == epoch_steps

    seen = {rank: events(hooked, rank) for rank in (0, 1)}
    for rank, got in seen.items():
        kinds = [event["event"] for event in got]
        # the order of the loop: a logged window comes a step or more after its step
        assert [k for k in kinds if k != "logged"] == (
            ["running"] + ["step_ended"] * epoch_steps
            + ["validated", "fit_ended", "ran", "checkpoint_saved"]
        ), f"rank {rank}: {kinds}"  # fmt: skip
        running = got[0]
        assert (running["rank"], running["world_size"]) == (rank, 2)
        assert (running["first_step"], running["total_steps"]) == (0, summary(plain)["steps"])
        assert Path(running["run_dir"]).resolve() == hooked.resolve()
        steps = [event for event in got if event["event"] == "step_ended"]
        assert [event["step"] for event in steps] == list(range(1, epoch_steps + 1))
        assert {(event["epoch"], event["lr"], event["grad_norm"]) for event in steps} == {
            (0, 0.02, None)  # optim=sgd's rate, no schedule, no clipping
        }
        validated = next(event for event in got if event["event"] == "validated")
        assert (validated["step"], validated["epoch"], validated["ended_by"]) == (
            epoch_steps, 1, None,
        )  # fmt: skip
        assert validated["metrics"]["val_loss"] == ran["history"][0]["val_loss"]
        ended = next(event for event in got if event["event"] == "fit_ended")
        assert (ended["step"], ended["ended_by"]) == (epoch_steps, "loss_reached")
        saved = next(event for event in got if event["event"] == "checkpoint_saved")
        assert saved["step"] == epoch_steps and Path(saved["path"]).is_file()
        # The windows' global losses are metrics.csv's, every step once.
        logged = {
            step: loss
            for event in got
            if event["event"] == "logged"
            for step, loss in zip(event["steps"], event["losses"])
        }
        assert [(step, repr(loss)) for step, loss in logged.items()] == csv_step_losses(hooked)
    # The same records on both ranks, but each rank's own: where it is, its samples and loss part.
    mine = ("rank", "samples", "loss")
    assert [{k: v for k, v in e.items() if k not in mine} for e in seen[0]] == [
        {k: v for k, v in e.items() if k not in mine} for e in seen[1]
    ]
    # The hooks changed nothing else: the first epoch's losses are the plain run's, bit for bit.
    assert csv_step_losses(hooked) == csv_step_losses(plain)[:epoch_steps]


# A training step reads in these four of the loop's modules (docs/architecture.md): the loop, the
# step's arithmetic, the state and the meter. The rest of what a step calls is the run's pieces,
# each its own concern: the task, the model, the strategy, the data, the recipe (schedule, average).
A_STEP_READS = {"training/trainer.py", "training/step.py", "training/state.py", "training/meter.py"}


@pytest.mark.timeout(300)
def test_a_hook_may_end_the_run_after_a_step_and_a_step_reads_in_four_of_the_loops_files(
    tmp_path: Path,
):
    hooked = tmp_path / "hooked"
    hooks = "{_target_:hook_events.Events,end_at_step:3},{_target_:hook_events.StepFiles}"
    end = f"+trainer.hooks=[{hooks}]"
    check_ok(run_train(hooked, *RUN, "trainer.max_steps=20", end))
    ran = summary(hooked)
    assert ran["ended_by"] == "a_step_hook" and ran["steps"] == 3
    for rank in (0, 1):
        got = events(hooked, rank)
        assert [e["step"] for e in got if e["event"] == "step_ended"] == [1, 2, 3]
        assert next(e for e in got if e["event"] == "fit_ended")["ended_by"] == "a_step_hook"
        # From one step's end to the next's (a loss window sent and read each step: log_every=1),
        # the code that ran in the loop's package (training/) is in these four files, all of them.
        steps = json.loads((hooked / f"step_files.rank{rank}.json").read_text())
        assert list(steps) == ["2", "3"]
        for step, files in steps.items():
            loop = {name for name in files if name.startswith("training/")}
            assert loop == A_STEP_READS, f"rank {rank}, step {step}: {sorted(files)}"
            assert {"tasks/classification.py", "hooks.py"} <= set(files)  # the profile sees all
