"""A run's directory is its own: two runs started in the same second (a Slurm array, two terminals)
each get one, and an explicit hydra.run.dir that a live run holds is refused in one line before
anything is written into it; once that run has ended, resuming into it works (Hydra #2925,
#1817)."""

from __future__ import annotations

import datetime
import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from support import REPO, check_ok, finish, run_train, start_train, summary, train_env, wait_for


@pytest.mark.timeout(300)
def test_runs_started_in_the_same_second_each_get_a_directory_of_their_own(tmp_path: Path):
    # The default directory is named to the second. Every name of the next half minute is taken
    # already (as by runs started in the same second), and two runs start at once: each must get a
    # directory of its own, say so, and write nothing into another's.
    now = datetime.datetime.now()
    for second in range(60):
        moment = now + datetime.timedelta(seconds=second)
        (
            tmp_path
            / "outputs"
            / "runs"
            / moment.strftime("%Y-%m-%d")
            / moment.strftime("%H-%M-%S")
        ).mkdir(parents=True)
    # two ranks each: every rank of a run writes into its run's one directory (docs/hydra-ddp.md)
    command = [sys.executable, str(REPO / "train.py"), "trainer.max_steps=2", "trainer.nproc=2"]
    procs = [
        subprocess.Popen(
            command,
            cwd=tmp_path,
            env=train_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    for proc in procs:
        _, err = proc.communicate(timeout=240)
        assert proc.returncode == 0, err[-2000:]
    run_dirs = sorted(
        path.parent for path in (tmp_path / "outputs" / "runs").glob("*/*/summary.json")
    )
    assert len(run_dirs) == 2, run_dirs
    assert run_dirs[0] != run_dirs[1] and all(
        d.name.rsplit("-", 1)[1] in ("2", "3") for d in run_dirs
    ), run_dirs
    for run_dir in run_dirs:
        s = summary(run_dir)
        assert s["run_dir"] == str(run_dir) and s["steps"] == 2 and s["world_size"] == 2
        log = (run_dir / "train.log").read_text()
        assert "was taken by another run started in the same second" in log
        assert log.count("launching 2 worker(s)") == 1  # its own lines only
        assert not (run_dir / ".hydra-ddp.lock").exists()  # released at the end
    taken = run_dirs[0].with_name(run_dirs[0].name.rsplit("-", 1)[0])
    assert list(taken.iterdir()) == []  # the name another run held: nothing written into it


@pytest.mark.timeout(400)
def test_a_directory_a_live_run_holds_is_refused_and_resumed_into_once_it_ends(tmp_path: Path):
    run_dir = tmp_path / "run"
    first = start_train(run_dir, "trainer.epochs=500", "trainer.log_every=1")
    wait_for(lambda: (run_dir / "metrics.csv").exists(), 120, "the first run's first steps", first)
    record = (run_dir / ".hydra" / "overrides.yaml").read_text()
    second = run_train(run_dir, "trainer.max_steps=2")
    errors = [line for line in second.stderr.splitlines() if line.startswith("hydra-ddp: error:")]
    assert second.returncode == 2 and len(errors) == 1, second.stderr[-2000:]
    assert f"hydra.run.dir={run_dir} is in use by a live run (pid {first.pid})" in errors[0]
    # the first run's record, untouched
    assert (run_dir / ".hydra" / "overrides.yaml").read_text() == record
    assert json.loads((run_dir / ".hydra-ddp.lock").read_text())["pid"] == first.pid
    first.send_signal(signal.SIGTERM)  # stops at a checkpoint, and lets go of the directory
    assert finish(first).returncode == 128 + signal.SIGTERM
    steps = summary(run_dir)["steps"]
    check_ok(
        run_train(
            run_dir,
            "trainer.epochs=500",
            "trainer.log_every=1",
            f"trainer.max_steps={steps + 2}",
            "trainer.resume=auto",
        )
    )
    assert summary(run_dir)["steps"] == steps + 2 and summary(run_dir)["resumed_from"]


@pytest.mark.timeout(300)
def test_an_outside_torchrun_writes_one_run_directory(tmp_path: Path):
    # Every rank of an outside launch runs train.py, and Hydra in each: rank 0's directory is the
    # run's, the others write none (and no .hydra/ in the working directory).
    torchrun = Path(sys.executable).with_name("torchrun")
    command = [
        str(torchrun),
        "--standalone",
        "--nproc_per_node=2",
        str(REPO / "train.py"),
        "trainer.max_steps=2",
    ]
    done = subprocess.run(
        command, cwd=tmp_path, env=train_env(), capture_output=True, text=True, timeout=240
    )
    assert done.returncode == 0, done.stderr[-2000:]
    made = [path for path in (tmp_path / "outputs" / "runs").glob("*/*") if path.is_dir()]
    assert len(made) == 1 and summary(made[0])["world_size"] == 2, made
    assert sorted(p.name for p in tmp_path.iterdir()) == ["outputs"]


@pytest.mark.timeout(300)
def test_relative_paths_hold_with_hydra_job_chdir(tmp_path: Path):
    # hydra.job.chdir=true moves the command into its run directory before the job starts: the
    # data's and a checkpoint's relative paths are still read from where the command was started,
    # before launch and in every worker (Hydra #1185).
    from hydra_ddp.data import digits, shards

    train, test = digits()
    shards.write(
        tmp_path / "shards",
        {"train": train, "test": test},
        64,
        {"in_channels": 1, "image_size": 28},
    )
    command = [sys.executable, str(REPO / "train.py"), "data=shards", "data.dataset.root=shards"]
    command += ["hydra.job.chdir=true", "trainer.max_steps=2", "hydra.run.dir=runs/chdir"]
    done = subprocess.run(
        command, cwd=tmp_path, env=train_env(), capture_output=True, text=True, timeout=240
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert summary(tmp_path / "runs" / "chdir")["steps"] == 2
    # and a checkpoint's relative path: another run, moved into its own directory, resumes from it
    command = [*command[:-2], "trainer.max_steps=4", "hydra.run.dir=runs/chdir2"]
    command += ["trainer.resume=runs/chdir/checkpoints/last.pt"]
    done = subprocess.run(
        command, cwd=tmp_path, env=train_env(), capture_output=True, text=True, timeout=240
    )
    assert done.returncode == 0, done.stderr[-2000:]
    resumed = summary(tmp_path / "runs" / "chdir2")
    assert resumed["steps"] == 4, resumed
    assert resumed["resumed_from"] == str(tmp_path / "runs" / "chdir" / "checkpoints" / "last.pt")


@pytest.mark.timeout(300)
def test_a_continuation_whose_workers_fail_at_start_leaves_the_runs_record(tmp_path: Path):
    # Accepted before launch (a model of the user's that fails only in its workers: the parent
    # cannot build it), then failing in rank 1 before a step: the run's record stays byte for
    # byte, and its log keeps every earlier line. The same continuation without the fault trains,
    # and then the record says how.
    run_dir = tmp_path / "run"
    check_ok(run_train(run_dir, "trainer.max_steps=2"))

    def record() -> dict[str, bytes]:
        files = [*sorted((run_dir / ".hydra").iterdir()), run_dir / "metrics.csv"]
        files += [run_dir / "summary.json", *sorted((run_dir / "checkpoints").iterdir())]
        return {path.name: path.read_bytes() for path in files}

    kept, log = record(), (run_dir / "train.log").read_bytes()
    failed = run_train(
        run_dir, "trainer.resume=auto", "trainer.max_steps=4", "model._target_=faulty.FailOnRank"
    )
    assert failed.returncode != 0 and "injected failure in rank 1" in failed.stderr, failed.stderr
    assert record() == kept
    assert (run_dir / "train.log").read_bytes().startswith(log)
    check_ok(run_train(run_dir, "trainer.resume=auto", "trainer.max_steps=4"))
    assert summary(run_dir)["steps"] == 4
    overrides = (run_dir / ".hydra" / "overrides.yaml").read_text()
    assert "trainer.max_steps=4" in overrides and "FailOnRank" not in overrides, overrides
