"""Scaling out: multirun sweeps and their report, parallel joblib sweeps, mpirun, two nodes (Slurm:
test_slurm.py)."""

from __future__ import annotations

import csv
import shlex
import shutil
import sys
from pathlib import Path

import pytest

from support import (
    QUICK,
    TwoHosts,
    assert_same_run,
    check_ok,
    documented,
    documented_command,
    finish,
    free_port,
    run_train,
    start_train,
    step_losses,
    summary,
    wandb_starts,
)


def test_world_size_sweep_writes_a_scaling_report_and_groups_its_mlflow_and_wandb_runs(
    tmp_path: Path,
):
    from mlflow.tracking import MlflowClient

    sweep, uri = tmp_path / "sweep", f"sqlite:///{tmp_path}/mlflow.db"
    proc = run_train(
        tmp_path / "unused",
        "-m",
        *QUICK,
        "trainer.nproc=1,2",
        f"hydra.sweep.dir={sweep}",
        "logger=[tensorboard,mlflow,wandb]",
        f"logger.mlflow.tracking_uri={uri}",
        f"logger.mlflow.artifact_location={tmp_path / 'artifacts'}",
        "logger.wandb.mode=offline",
    )
    check_ok(proc)
    # One parent run per sweep, its jobs as children; the sweep's end closes it with the best value.
    client = MlflowClient(tracking_uri=uri)
    runs = client.search_runs([client.get_experiment_by_name("hydra-ddp").experiment_id])
    parents = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    children = [r for r in runs if "mlflow.parentRunId" in r.data.tags]
    assert len(parents) == 1 and len(children) == 2, [r.data.tags for r in runs]
    parent = parents[0]
    assert {r.data.tags["mlflow.parentRunId"] for r in children} == {parent.info.run_id}
    assert sorted(r.data.tags["world_size"] for r in children) == ["1", "2"]
    assert parent.info.status == "FINISHED" and parent.data.metrics["sweep/jobs"] == 2
    best = max(summary(sweep / str(i))["val_accuracy"] for i in (0, 1))
    assert parent.data.metrics["best/val/accuracy"] == pytest.approx(best)
    assert [summary(sweep / str(i))["world_size"] for i in (0, 1)] == [1, 2]
    # every job tested, once
    assert [summary(sweep / str(i))["test_passes"] for i in (0, 1)] == [1, 1]
    # W&B: one run per job (not per rank), the sweep's jobs in one group named after it.
    jobs = [wandb_starts(sweep / str(i)) for i in (0, 1)]
    assert [len(starts) for starts in jobs] == [1, 1]
    assert len({starts[0]["id"] for starts in jobs}) == 2
    assert {starts[0]["group"] for starts in jobs} == {f"{tmp_path.name}/sweep"}
    assert [starts[0]["name"] for starts in jobs] == [
        f"{tmp_path.name}/sweep/0",
        f"{tmp_path.name}/sweep/1",
    ]
    assert [starts[0]["config"]["trainer"]["nproc"] for starts in jobs] == [1, 2]
    rows = list(csv.DictReader(open(sweep / "scaling.csv")))
    assert [r["swept"] for r in rows] == ["trainer.nproc=1", "trainer.nproc=2"]
    assert [r["status"] for r in rows] == ["ok", "ok"]
    assert float(rows[0]["speedup"]) == 1.0 and float(rows[1]["efficiency"]) > 0
    # Model FLOP/s per rank and the MFU, from each job's summary.
    for row, i in zip(rows, (0, 1)):
        assert float(row["flops_per_sec_per_rank"]) == pytest.approx(
            summary(sweep / str(i))["flops"]["per_sec_per_rank"]
        )
        assert 0 < float(row["mfu"]) < 1
    # Left to their defaults, the global batch grows with the ranks (data.batch_size each) and the
    # threads per rank shrink: the report says so at its top and flags the row against job 0's.
    jobs_batch = [summary(sweep / str(i))["global_batch_size"] for i in (0, 1)]
    jobs_threads = [summary(sweep / str(i))["threads_per_rank"] for i in (0, 1)]
    assert jobs_batch[1] == 2 * jobs_batch[0]
    assert [int(r["global_batch_size"]) for r in rows] == jobs_batch
    assert [int(r["threads_per_rank"]) for r in rows] == jobs_threads
    assert rows[0]["flags"] == "" and rows[1]["flags"].startswith(
        f"global batch {jobs_batch[1]}, not {jobs_batch[0]} as job 0's"
    ), rows
    report = (sweep / "scaling.md").read_text()
    assert f"**The jobs' global batches differ ({jobs_batch[0]}, {jobs_batch[1]})**" in report
    assert "Threads per rank: trainer.threads, by default the CPUs" in report
    assert "| model FLOP/s per rank | MFU |" in (sweep / "scaling.md").read_text()
    assert "| trainer.nproc=2 | ok |" in (sweep / "scaling.md").read_text()
    assert (sweep / "scaling.png").stat().st_size > 10_000
    assert "Scaling report" in proc.stdout


def test_failed_job_is_a_failed_row_and_the_sweep_goes_on(tmp_path: Path):
    sweep = tmp_path / "sweep"
    proc = run_train(
        tmp_path / "unused", "-m", *QUICK, "backend=gloo,mpi", f"hydra.sweep.dir={sweep}"
    )
    assert proc.returncode != 0  # a sweep with a failed job does not pass for a success
    # Not a sweep over world sizes: the trials report, the job that ran first, the failed one last.
    rows = list(csv.DictReader(open(sweep / "sweep.csv")))
    assert [(r["swept"], r["status"], r["rank"]) for r in rows] == [
        ("backend=gloo", "ok", "1"),
        ("backend=mpi", "failed", ""),
    ]
    assert (
        "MPI" in rows[1]["error"]
        and float(rows[0]["objective"]) == summary(sweep / "0")["val_accuracy"]
    )
    assert "Best: job 0 (backend=gloo), val/accuracy" in (sweep / "sweep.md").read_text()
    assert "1 of 2 jobs failed" in proc.stderr


@pytest.mark.timeout(600)  # 16 processes importing torch on 2 cores: minutes beside a busy core
def test_eight_parallel_jobs_never_collide_on_a_port(tmp_path: Path):
    """4 jobs at a time, each launching its own group: every job's launching process binds its
    store's port itself and holds it, so no job can take another's between choosing and binding. One
    rank per job keeps it affordable: the store, its port and the rendezvous through it are the same
    at any size. Both launchers and both single-node stores (TCP, file) run inside joblib's worker
    processes."""
    sweep = tmp_path / "sweep"
    proc = run_train(
        tmp_path / "unused",
        "-m",
        "trainer.max_steps=4",
        "trainer.log_every=2",
        "trainer.nproc=1",
        "hydra/launcher=joblib",
        "hydra.launcher.n_jobs=4",
        "launcher=spawn,torchrun",
        "init_method=env,file",
        "trainer.seed=0,1",
        f"hydra.sweep.dir={sweep}",
        timeout=540,
    )
    check_ok(proc)
    rows = list(csv.DictReader(open(sweep / "sweep.csv")))
    assert len(rows) == 8 and {r["status"] for r in rows} == {"ok"}, rows
    ran = {
        (summary(sweep / str(i))["launcher"], summary(sweep / str(i))["init_method"])
        for i in range(8)
    }
    assert ran == {
        (launcher, init) for launcher in ("spawn", "torchrun") for init in ("env", "file")
    }


@pytest.mark.skipif(shutil.which("ip") is None, reason="iproute2's `ip` is not installed")
@pytest.mark.timeout(480)  # a reference run (spawn), then two nodes of one rank each
def test_two_nodes_in_network_namespaces_match_one_node(tmp_path: Path):
    import os

    if os.geteuid() != 0:
        pytest.skip("creating network namespaces needs root")
    single = tmp_path / "single"
    # One node of two ranks under the default launcher (spawn); one thread per rank on both sides: a
    # different thread count changes float summation order. docs/tutorial.md's one node and its two
    # "nodes", each on a host of its own here, meeting at the first's address.
    one_node = documented("docs/tutorial.md", "trainer.threads=1 hydra.run.dir=outputs/one-node")
    check_ok(run_train(single, *one_node, *QUICK, "launcher=spawn", "trainer.nproc=2"))
    nodes = (
        documented("docs/tutorial.md", "launcher.node_rank=0"),
        documented("docs/tutorial.md", "launcher.node_rank=1"),
    )
    with TwoHosts(str(os.getpid())) as hosts:
        # gloo talks over the link between the hosts
        env_prefix = ("env", "GLOO_SOCKET_IFNAME=hddp0")
        procs = [
            start_train(
                tmp_path / f"node{i}",
                *nodes[i],
                *QUICK,
                f"launcher.rdzv_endpoint={hosts.addresses[0]}:29611",
                "launcher.rdzv_id=two-hosts",
                f"launcher.local_addr={hosts.addresses[i]}",
                prefix=("ip", "netns", "exec", hosts.names[i], *env_prefix, sys.executable),
            )
            for i in range(2)
        ]
        results = [finish(p, timeout=180) for p in procs]
    for result in results:
        check_ok(result)
    owners = [
        tmp_path / f"node{i}" for i in range(2) if (tmp_path / f"node{i}" / "summary.json").exists()
    ]
    assert len(owners) == 1, "exactly one node (global rank 0's) writes the outputs"
    other = ({tmp_path / "node0", tmp_path / "node1"} - set(owners)).pop()
    # The other node says where the run is shown, not only that it launched.
    quiet = results[[tmp_path / f"node{i}" for i in range(2)].index(other)]
    assert (
        "its workers are done; the run's summary is with rank 0's node"
        in quiet.stdout + quiet.stderr
    )
    assert not (other / "tensorboard").exists() and not (other / "checkpoints").exists()
    assert summary(owners[0])["world_size"] == 2 and summary(owners[0])["nnodes"] == 2
    # Bit for bit: every step's loss, and the final weights (the checkpoint written at the end).
    assert len(step_losses(single)) == 8
    assert_same_run(owners[0], single)


@pytest.mark.skipif(
    shutil.which("mpirun") is None, reason="Open MPI is not installed (apt-get install openmpi-bin)"
)
def test_mpirun_starts_the_workers_and_they_train_as_spawns_do(run_dir: Path, spawned: Path):
    # docs/multinode.md's command (mpirun -np 2 PYTHON train.py WORDS), with mpirun's options for
    # a root user, two cores and the tests' helpers, and a free port
    command = shlex.split(documented_command("docs/multinode.md", "mpirun -np 2"))
    python = next(i for i, word in enumerate(command) if word.endswith("/python"))
    assert command[:python] == ["mpirun", "-np", "2"]
    prefix = (
        *command[:python],
        "--allow-run-as-root",
        "--oversubscribe",
        "-x",
        "PYTHONPATH",
        sys.executable,
    )
    proc = run_train(
        run_dir,
        *documented("docs/multinode.md", "mpirun -np 2"),
        *QUICK,
        f"init_method.port={free_port()}",
        prefix=prefix,
    )
    check_ok(proc)
    s = summary(run_dir)
    assert s["world_size"] == 2 and s["launcher"] == "mpirun"
    assert sorted(p.name for p in run_dir.parent.iterdir()) == ["run"]  # one run directory
    assert_same_run(run_dir, spawned)  # bit for bit: losses (TensorBoard, metrics.csv) and weights
