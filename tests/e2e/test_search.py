"""Searches on Optuna (hydra/sweeper=optuna, the project's own sweeper over Optuna's ask/tell API):
whole DDP jobs pruned at an epoch's end, trials that start as soon as a slot is free, and a study
that a rerun of the same command continues after a crash (the search space and the samplers, in
process: tests/unit/test_search.py)."""

from __future__ import annotations

import csv
import os
import signal
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from support import QUICK, check_ok, documented, finish, run_train, start_train, summary, wait_for


def _study(sweep: Path, name: str = "digits"):
    import optuna

    from hydra_ddp.search.study import JOURNAL, storage_of

    return optuna.load_study(study_name=name, storage=storage_of(str(sweep / JOURNAL)))


def test_a_pruner_without_a_monitored_metric_is_refused_before_the_first_trial(tmp_path: Path):
    proc = run_train(
        tmp_path / "unused",
        "-m",
        "hparams_search=digits",
        "data.val_fraction=0",
        f"hydra.sweep.dir={tmp_path / 'sweep'}",
    )
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        "hydra-ddp: error: hydra.sweeper.pruner=median needs a monitored metric "
        "after each epoch, and data.val_fraction=0 leaves no validation: set "
        "data.val_fraction (e.g. 0.1), or hydra.sweeper.pruner=none"
    ]
    assert not (tmp_path / "sweep" / "0").exists()


@pytest.mark.timeout(400)
def test_hopeless_trials_are_pruned_and_the_best_is_reported(tmp_path: Path):
    sweep = tmp_path / "sweep"
    # lr 1e-6 learns nothing, lr 10 jumps around: once 2 trials are complete, a trial whose accuracy
    # after an epoch is below the median of theirs at that epoch stops there. docs/search.md's
    # command (hparams_search=digits is a multirun: hydra.mode MULTIRUN), a smaller search.
    check_ok(
        run_train(
            tmp_path / "unused",
            *documented("docs/search.md", "+hydra.sweeper.pruner_args={n_startup_trials:2}"),
            "hydra.sweeper.n_trials=6",
            "trainer.epochs=3",
            "optim.lr=choice(0.05,0.000001,10)",
            "data.batch_size=32",
            "optim.weight_decay=0",
            "hydra.sweeper.sampler.seed=1",
            f"hydra.sweep.dir={sweep}",
            timeout=360,
        )
    )
    rows = list(csv.DictReader(open(sweep / "sweep.csv")))
    assert len(rows) == 6
    pruned = [r for r in rows if r["status"] == "pruned"]
    assert pruned, rows
    full = max(int(r["steps"]) for r in rows if r["status"] == "ok")
    for row in pruned:
        s = summary(Path(row["run_dir"]))
        assert s["ended_by"] == "pruned" and s["steps"] < full == 63
    study = _study(sweep)
    assert sorted(t.state.name for t in study.trials).count("PRUNED") == len(pruned)
    best = OmegaConf.load(sweep / "optimization_results.yaml")
    assert (
        rows[0]["rank"] == "1"
        and float(rows[0]["objective"]) == best.best_value == study.best_value
    )
    assert (
        best.best_params == {"optim.lr": 0.05} and "Best: job" in (sweep / "sweep.md").read_text()
    )


@pytest.mark.timeout(400)
def test_a_trial_starts_as_soon_as_one_of_those_in_flight_ends(tmp_path: Path):
    import optuna

    from hydra_ddp.search.study import JOURNAL, storage_of

    sweep = tmp_path / "sweep"
    sweep.mkdir()
    # The study's first trials, queued through Optuna's own API: a long one, then two short ones.
    study = optuna.create_study(
        study_name="digits", storage=storage_of(str(sweep / JOURNAL)), direction="maximize"
    )
    # The long one: ten times a short one's epochs, beside the two that follow one after the other.
    for epochs in (10, 1, 1):
        study.enqueue_trial({"trainer.epochs": epochs})
    slow = (
        "data.dataset._target_=recording.digits_slow_on_rank",
        "+data.dataset.slow_rank=0",
        "+data.dataset.delay_s=0.001",
    )
    check_ok(
        run_train(
            tmp_path / "unused",
            "-m",
            "hparams_search=digits",
            "hydra.sweeper.n_trials=3",
            "hydra.sweeper.n_jobs=2",
            "hydra.sweeper.pruner=none",
            "trainer.epochs=choice(1,10)",
            *slow,
            "optim.lr=0.05",
            "data.batch_size=32",
            "optim.weight_decay=0",
            f"hydra.sweep.dir={sweep}",
            timeout=360,
        )
    )
    trials = _study(sweep).trials
    assert [t.params["trainer.epochs"] for t in trials] == [10, 1, 1] and {
        t.state.name for t in trials
    } == {"COMPLETE"}
    long_ended = (sweep / "0" / "summary.json").stat().st_mtime
    third_started = (sweep / "2" / ".hydra" / "config.yaml").stat().st_mtime
    assert third_started < long_ended, "the third trial waited for the long one"
    assert summary(sweep / "0")["epochs"] == 10 and summary(sweep / "2")["epochs"] == 1


@pytest.mark.timeout(400)
def test_a_killed_search_continues_to_n_trials_when_run_again(tmp_path: Path):
    sweep = tmp_path / "sweep"
    # docs/search.md's command, run twice (hparams_search=digits is a multirun), in the test's sweep
    # folder
    command = (
        *documented("docs/search.md", "hparams_search=digits hydra.sweep.dir=outputs/search1"),
        "hydra.sweeper.n_trials=4",
        *QUICK,
        "optim.lr=choice(0.05,0.02)",
        "data.batch_size=32",
        "optim.weight_decay=0",
        f"hydra.sweep.dir={sweep}",
    )
    first = start_train(tmp_path / "unused", *command)
    done = lambda: [d for d in sweep.glob("[0-9]*") if (d / "summary.json").exists()]  # noqa: E731
    wait_for(lambda: len(done()) >= 2, 240, "two finished trials", first)
    os.killpg(first.pid, signal.SIGKILL)  # the sweep's parent, and the trial it was running
    finish(first, timeout=30)
    before = {d.name: (d / "summary.json").stat().st_mtime for d in done()}
    check_ok(run_train(tmp_path / "unused", *command, timeout=300))
    trials = _study(sweep).trials
    assert len(trials) == 4
    states = [t.state.name for t in trials]
    assert states.count("COMPLETE") >= 3 and set(states) <= {"COMPLETE", "FAIL"}, states
    for name, mtime in before.items():  # the finished trials were not run again
        assert (sweep / name / "summary.json").stat().st_mtime == mtime and states[
            int(name)
        ] == "COMPLETE"
    rows = list(csv.DictReader(open(sweep / "sweep.csv")))
    assert len(rows) == len([d for d in sweep.glob("[0-9]*") if d.is_dir()])


@pytest.mark.timeout(400)
def test_two_sweeper_processes_on_one_study_run_no_trial_twice(tmp_path: Path):
    """The README's search shape (n_jobs=2, a seeded TPE, its startup trials random): four trials,
    four different sets of values."""
    sweep = tmp_path / "sweep"
    check_ok(
        run_train(
            tmp_path / "unused",
            *documented("README.md", "-m hparams_search=digits hydra.sweeper.n_trials=8"),
            "hydra.sweeper.n_trials=4",
            "hydra.sweeper.pruner=none",
            *QUICK,
            f"hydra.sweep.dir={sweep}",
            timeout=360,
        )
    )
    trials = _study(sweep).trials
    assert len(trials) == 4 and {t.state.name for t in trials} == {"COMPLETE"}
    drawn = [tuple(sorted(t.params.items())) for t in trials]
    assert len(set(drawn)) == 4, drawn
