"""A real Slurm cluster (started by the slurm_cluster fixture): train.py through
hydra-submitit-launcher across two nodes and on one node with two tasks, and through
scripts/slurm/train.sbatch's srun on one, equal to the same run under spawn; a cancelled job
reported by the sweep; pre-empted by Slurm's signal, requeued, and resumed by itself with
bit-identical weights."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from support import (
    REPO,
    assert_same_run,
    check_ok,
    finish,
    run_train,
    start_train,
    summary,
    train_env,
    wait_for,
)

# Three epochs of digits on 2 ranks (21 steps each), a checkpoint every 4 steps: the pre-emption
# test signals the job once the first is written, and 60 steps remain for the signal to arrive.
# One thread per rank everywhere: two nodes of one task would take two each, another summation
# order.
RUN = (
    "trainer.max_steps=64",
    "trainer.log_every=2",
    "checkpoint.every_n_steps=4",
    "trainer.threads=1",
)


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    """The same run under launcher=spawn, uninterrupted."""
    run_dir = tmp_path_factory.mktemp("slurm-reference") / "run"
    check_ok(run_train(run_dir, *RUN))
    return run_dir


def slurm(env: dict[str, str], *args: str) -> str:
    return subprocess.run(
        args, env=env, capture_output=True, text=True, check=True, timeout=30
    ).stdout.strip()


@pytest.mark.timeout(300)
def test_submitit_launcher_runs_one_group_across_two_nodes(
    slurm_cluster, reference, tmp_path: Path
):
    if slurm_cluster.nodes != 2:
        pytest.skip("the cluster has one node: two need iproute2 and nsenter")
    sweep = tmp_path / "sweep"
    proc = run_train(
        tmp_path / "unused",
        "-m",
        *RUN,
        "hydra/launcher=slurm",
        "hydra.launcher.nodes=2",
        "hydra.launcher.tasks_per_node=1",
        "hydra.launcher.cpus_per_task=1",
        "hydra.launcher.timeout_min=10",
        f"hydra.sweep.dir={sweep}",
        env=slurm_cluster.env,
        timeout=240,
    )
    check_ok(proc)
    s = summary(sweep / "0")
    assert (s["world_size"], s["nnodes"], s["launcher"]) == (2, 2, "submitit (slurm)"), s
    # Bit-identical to spawn's on one node: every step's loss, and the final weights.
    assert_same_run(sweep / "0", reference)


@pytest.mark.timeout(300)
def test_submitit_launcher_on_one_node_reports_a_cancelled_job(
    slurm_cluster, reference, tmp_path: Path
):
    if not slurm_cluster.accounting:
        pytest.skip(
            "submitit sees a cancelled job through sacct: apt-get install slurmdbd mariadb-server"
        )
    sweep = tmp_path / "sweep"
    env = {**train_env(), **slurm_cluster.env}

    def queued() -> dict[str, str]:  # task → state; an array job's tasks are JOB_0, JOB_1, JOB_2
        listed = slurm(env, "squeue", "-h", "-r", "-o", "%i %T").split("\n")
        return dict(line.split() for line in listed if line)

    # Jobs an earlier test left in the queue (still completing on a busy machine, say) are not the
    # sweep's: a soak beside a CPU hog once cancelled another job's tasks instead of the sweep's.
    earlier = {task.split("_")[0] for task in queued()}
    # Three jobs of one node and two tasks, one at a time: the first is the reference run; the third
    # is cancelled at once, while the whole array waits (Slurm keeps no record of it), the second
    # once the first runs (accounting says CANCELLED).
    proc = start_train(
        tmp_path / "unused",
        "-m",
        *RUN,
        "trainer.seed=0,1,2",
        "hydra/launcher=slurm",
        "hydra.launcher.tasks_per_node=2",
        "hydra.launcher.cpus_per_task=1",
        "hydra.launcher.array_parallelism=1",
        "hydra.launcher.timeout_min=10",
        f"hydra.sweep.dir={sweep}",
        env=env,
    )
    tasks: dict[str, str] = {}

    def queue_shows(*wanted: str) -> bool:
        tasks.clear()
        tasks.update(
            (task, state) for task, state in queued().items() if task.split("_")[0] not in earlier
        )
        return all(
            any(f"{task.split('_')[-1]} {state}" == want for task, state in tasks.items())
            for want in wanted
        )

    wait_for(lambda: queue_shows("2 PENDING"), 60, "the sweep's jobs to be queued", proc)
    third = next(
        task for task, state in tasks.items() if task.endswith("_2") and state == "PENDING"
    )
    array = third.split("_")[0] + "_"
    slurm(env, "scancel", third)
    seen = f"the queue before the sweep: {sorted(earlier)}; the sweep's at the cancel: {tasks}"
    wait_for(lambda: queue_shows("0 RUNNING", "1 PENDING"), 60, "the first job to start", proc)
    slurm(env, "scancel", f"{array}1")
    done = finish(proc, timeout=240)
    # a sweep with a job that did not finish is not a success
    assert done.returncode == 1, f"{done.stderr}\n{seen}"
    for task in (1, 2):
        assert f"Slurm job {array}{task} ended CANCELLED without a result" in done.stderr, (
            done.stderr
        )
    report = (sweep / "sweep.md").read_text()
    assert report.count("| cancelled: Slurm job") == 2 and report.count("| ok |") == 1, report
    s = summary(sweep / "0")
    assert (s["world_size"], s["nnodes"], s["launcher"]) == (2, 1, "submitit (slurm)"), s
    # Bit-identical to spawn's: every step's loss, and the final weights.
    assert_same_run(sweep / "0", reference)


@pytest.mark.timeout(300)
def test_sbatch_script_is_preempted_requeued_and_resumes_exactly(
    slurm_cluster, reference, tmp_path: Path
):
    run_dir, output = tmp_path / "run", tmp_path / "slurm.out"
    env = {**train_env(), **slurm_cluster.env, "PYTHON": sys.executable}
    # One node, two tasks (the script's own #SBATCH lines).
    job = subprocess.run(
        [
            "sbatch",
            "--parsable",
            f"--output={output}",
            str(REPO / "scripts/slurm/train.sbatch"),
            *RUN,
            f"hydra.run.dir={run_dir}",
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        check=True,
        timeout=30,
    ).stdout.strip()
    seen: list[str] = []

    # the job's state and reason as squeue lists them ("" once it has left the queue)
    def state() -> str:
        now = slurm(env, "squeue", "-h", "-j", job, "-o", "%T %r")
        if not seen or seen[-1] != now:
            seen.append(now)
        return now.split(" ")[0]

    wait_for(
        lambda: (run_dir / "checkpoints" / "step-00000004.pt").exists(), 120, "the first checkpoint"
    )
    slurm(env, "scancel", "--signal=USR1", job)  # pre-emption: to every task of the job's steps
    # The workers checkpoint and stop; the script requeues the job, which Slurm holds back for the
    # credential lifetime (cluster.sh: 5 s) and then starts again by itself. Not released early with
    # `scontrol update StartTime=now`: on the same node inside that window it fails ("Job credential
    # revoked", 2 of 4 tries here).
    wait_for(lambda: state() == "PENDING", 60, f"job {job} requeued")
    wait_for(lambda: state() == "", 120, f"the requeued job {job} to finish")
    log = output.read_text()
    assert "stopped for pre-emption (exit 138): requeueing" in log and "attempt 2" in log, (
        seen,
        log,
    )
    s = summary(run_dir)
    assert s["launcher"] == "srun" and s["world_size"] == 2 and s["steps"] == 64, s
    assert s["resumed_from"] and s["resumed_from"] != str(
        run_dir / "checkpoints" / "step-00000064.pt"
    ), s
    # The uninterrupted run's, bit for bit: every step's loss once (none twice, none lost), and the
    # weights.
    assert_same_run(run_dir, reference)
