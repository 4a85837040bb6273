"""train.py as a user runs it: real multi-process gloo runs through the real launchers."""

from __future__ import annotations

import csv
import json
import os
import re
import shlex
import sys
from pathlib import Path

import pytest
import yaml

from support import (
    QUICK,
    assert_no_orphans,
    assert_same_params,
    assert_same_run,
    check_ok,
    documented,
    documented_command,
    event_files,
    final_params,
    free_port,
    run_train,
    scalars,
    step_losses,
    summary,
    text,
)

SUMMARY_KEYS = {
    "world_size",
    "backend",
    "launcher",
    "init_method",
    "epochs",
    "steps",
    "train_loss",
    "val_loss",
    "val_accuracy",
    "test_loss",
    "test_accuracy",
    "tested",
    "monitor",
    "objective",
    "samples_per_sec",
    "wall_time_s",
}


def test_default_run_leaves_one_complete_run_directory(run_dir: Path):
    proc = run_train(run_dir, "trainer.epochs=2")
    check_ok(proc)
    s = summary(run_dir)
    assert SUMMARY_KEYS <= s.keys()
    assert s["world_size"] == 2 and s["backend"] == "gloo" and s["launcher"] == "spawn"
    assert s["init_method"] == "env" and s["epochs"] == 2
    # DDP: a whole replica per rank, and fp32 gradients all-reduced (4 bytes an element: the CNN's
    # 431,080).
    assert (
        s["strategy"] == "ddp"
        and s["comm_hook"] == "none"
        and s["allreduce_bytes_per_step"] == 4 * 431_080
    )
    assert s["model_state_bytes"]["params"] == 4 * 431_080
    assert s["test_samples"] == 359  # every held-out digit exactly once
    assert s["test_accuracy"] > 0.5 and s["samples_per_sec"] > 0
    # Validation (a tenth of the training digits) selects the weights; the test reads them once.
    assert s["val_samples"] == 144
    assert s["monitor"]["metric"] == "val/accuracy" and s["objective"] == s["val_accuracy"]
    assert s["tested"]["step"] == s["monitor"]["best_step"] and s["test_passes"] == 1
    # Start-up in its two parts, in order: the workers' imports done, then their first step.
    assert 0 < s["time_to_workers_ready_s"] < s["time_to_first_step_s"] < s["wall_time_s"]
    assert "start-up" in proc.stdout
    # Model FLOPs: the CNN's forward and backward per sample (hand count in test_flops.py), the CPU
    # peak measured on the ranks, the MFU between them.
    flops = s["flops"]
    assert flops["per_sample"] == 13_182_000 and flops["peak_source"].startswith("measured: fp32")
    assert flops["per_sec_per_rank"] == pytest.approx(13_182_000 * s["steady_samples_per_sec"] / 2)
    assert 0 < flops["mfu"] < 1 and flops["mfu"] == pytest.approx(
        flops["per_sec_per_rank"] / flops["peak_per_rank"]
    )
    assert re.search(
        r"model FLOP/s +[\d.]+ GFLOP/s per rank .*; MFU 0\.\d+ of [\d.]+ GFLOP/s \(measured",
        proc.stdout,
    )

    # One event file, with per-step train loss, per-epoch validation, one test, lr, throughput, the
    # config.
    assert len(event_files(run_dir)) == 1
    train_loss = step_losses(run_dir)
    assert [step for step, _ in train_loss] == list(range(1, s["steps"] + 1))
    val_accuracy = scalars(run_dir, "val/accuracy")
    assert len(val_accuracy) == 2 and max(v for _, v in val_accuracy) == pytest.approx(
        s["val_accuracy"]
    )
    assert scalars(run_dir, "test/accuracy") == [(s["steps"], pytest.approx(s["test_accuracy"]))]
    # metrics.csv beside it: the same numbers, one row per step.
    with open(run_dir / "metrics.csv", newline="") as f:
        rows = {int(r["step"]): r for r in csv.DictReader(f)}
    assert sorted(rows) == list(range(1, s["steps"] + 1))
    assert [float(rows[step]["train/loss"]) for step, _ in train_loss] == pytest.approx(
        [v for _, v in train_loss]
    )
    assert float(rows[s["steps"]]["test/accuracy"]) == s["test_accuracy"]
    # Every rank's time per phase; balanced ranks raise no straggler.
    assert [r["rank"] for r in s["ranks"]] == [0, 1] and s["straggler"] is None, s["ranks"]
    assert "straggler" not in proc.stdout
    assert len(scalars(run_dir, "train/lr")) == 2
    assert len(scalars(run_dir, "train/samples_per_sec")) == 2
    # The resolved config as YAML, in the event file and in the log: the values this run trained
    # with.
    [config_text] = text(run_dir, "config")
    config_text = config_text.removeprefix("```yaml\n").removesuffix("```")
    config = yaml.safe_load(config_text)
    assert (
        config["trainer"]["epochs"] == 2
        and config["trainer"]["nproc"] == 2
        and config["strategy"]["shared_memory"] is True
    )

    # The resolved config, one log file holding every rank, and the console showing rank 0 only.
    assert (run_dir / ".hydra" / "config.yaml").exists()
    log = (run_dir / "train.log").read_text()
    assert "[rank 0]" in log and "[rank 1]" in log
    assert "config\n" + config_text.rstrip() in log
    assert "[rank 1]" not in proc.stdout and "run summary" in proc.stdout
    assert "step/s" not in proc.stderr  # no progress bar in a pipe
    threads = max(1, len(os.sched_getaffinity(0)) // 2)
    assert f"{threads} CPU thread(s)" in log
    assert not list(run_dir.glob("*.store"))
    assert_no_orphans(proc.pid)


def test_every_launcher_and_init_method_gives_identical_losses_and_weights(tmp_path: Path):
    # The default run (spawn, env) is test_default_run_leaves_one_complete_run_directory's; here it
    # runs as the installed command, `hydra-ddp train`, in the clone (its conf/ found there).
    runs = {
        "spawn": (("launcher=spawn", "init_method=tcp"), (), "train.py"),
        "torchrun": (("launcher=torchrun", "init_method=file"), (), "train.py"),
        "external": (
            (),
            (sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"),
            "train.py",
        ),
        "command": ((), (str(Path(sys.executable).parent / "hydra-ddp"), "train"), None),
    }
    results, weights, seen = {}, {}, {}
    for name, (overrides, prefix, script) in runs.items():
        probes = tmp_path / f"{name}-probes"
        probes.mkdir()
        proc = run_train(
            tmp_path / name, *QUICK, *overrides, *_probe(probes), prefix=prefix, script=script
        )
        check_ok(proc)
        results[name] = step_losses(tmp_path / name)
        assert len(results[name]) == 8
        weights[name] = final_params(tmp_path / name)  # the checkpoint written at the end (last.pt)
        # under every launcher: each worker's start, before its first step
        s = summary(tmp_path / name)
        assert 0 < s["time_to_workers_ready_s"] < s["time_to_first_step_s"] < s["wall_time_s"], name
        assert not list((tmp_path / name).glob("*.store"))  # the file store is removed at exit
        seen[name] = [json.loads((probes / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    # Bit for bit: every step's loss, and the final weights.
    assert results["spawn"] == results["torchrun"] == results["external"] == results["command"]
    for name in ("torchrun", "external", "command"):
        assert_same_params(weights[name], weights["spawn"])
    assert [summary(tmp_path / name)["init_method"] for name in runs] == [
        "tcp",
        "file",
        "env",
        "env",
    ]
    # Each init method reached init_process_group as its URL, on every rank, and the group's store
    # is the one that URL names: tcp's host and port, a file store, the outside torchrun's
    # MASTER_PORT.
    tcp = seen["spawn"][0]
    assert tcp["init_method"] == f"tcp://127.0.0.1:{tcp['port']}" and tcp["store"] == "TCPStore", (
        seen["spawn"]
    )
    assert (
        seen["torchrun"][0]["init_method"] == f"file://{tmp_path / 'torchrun' / 'rendezvous.store'}"
    )
    assert seen["torchrun"][0]["store"] == "FileStore"
    assert (
        seen["external"][0]["init_method"] == "env://"
        and seen["external"][0]["store"] == "TCPStore"
    )
    for name in runs:
        assert seen[name][0] == seen[name][1], name
    assert summary(tmp_path / "external")["launcher"] == "torchrun"
    # The outside launch made exactly one run directory: rank 1 followed rank 0.
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.endswith("-probes")) == [
        "command",
        "external",
        "spawn",
        "torchrun",
    ]
    assert len(event_files(tmp_path / "external")) == 1


def _probe(folder: Path) -> tuple[str, ...]:
    return ("model._target_=probes.RendezvousProbe", f"+model.probe_dir={folder}")


def test_init_method_env_meets_at_an_exported_master_port_and_refuses_a_busy_one(tmp_path: Path):
    import socket

    probes = tmp_path / "probes"
    probes.mkdir()
    port = free_port()
    proc = run_train(
        tmp_path / "run",
        "trainer.max_steps=2",
        *_probe(probes),
        env={"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)},
    )
    check_ok(proc)
    for rank in (0, 1):
        seen = json.loads((probes / f"rank{rank}.json").read_text())
        assert (seen["init_method"], seen["host"], seen["port"]) == ("env://", "127.0.0.1", port), (
            seen
        )
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        taken = busy.getsockname()[1]
        proc = run_train(tmp_path / "busy", "trainer.max_steps=2", env={"MASTER_PORT": str(taken)})
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        f"hydra-ddp: error: MASTER_PORT={taken} (exported) is already in use on "
        "127.0.0.1; export a free port, or unset MASTER_PORT (a free one is picked)"
    ], proc.stderr
    # refused before any worker started
    assert "[rank " not in (tmp_path / "busy" / "train.log").read_text()


def test_legacy_distributed_launch_passes_local_rank_and_trains_as_spawn_does(
    run_dir: Path, spawned: Path
):
    # docs/usage.md's command: PYTHON -m torch.distributed.launch --nproc_per_node=2 train.py
    command = shlex.split(documented_command("docs/usage.md", "-m torch.distributed.launch"))
    prefix = (sys.executable, *command[1 : command.index("train.py")])
    words = documented("docs/usage.md", "-m torch.distributed.launch")
    proc = run_train(run_dir, *words, *QUICK, prefix=prefix)
    check_ok(proc)
    assert summary(run_dir)["world_size"] == 2
    assert_same_run(run_dir, spawned)  # bit for bit: losses (TensorBoard, metrics.csv) and weights


def test_explicit_file_store_path_can_be_reused(tmp_path: Path):
    store = tmp_path / "shared.store"
    for attempt in ("first", "second"):  # a second run must not trip over the first one's store
        check_ok(
            run_train(tmp_path / attempt, *QUICK, "init_method=file", f"init_method.path={store}")
        )
        assert summary(tmp_path / attempt)["init_method"] == "file"
    assert not store.exists()


@pytest.mark.parametrize("launcher", ["spawn", "torchrun"])
def test_failed_rank_is_named_in_one_line_and_leaves_no_orphans(run_dir: Path, launcher: str):
    proc = run_train(
        run_dir,
        *QUICK,
        f"launcher={launcher}",
        "model._target_=faulty.FailOnRank",
        "+model.fail_rank=1",
    )
    assert proc.returncode != 0
    errors = [line for line in proc.stderr.splitlines() if "hydra-ddp: error" in line]
    assert len(errors) == 1 and "rank 1" in errors[0] and "injected failure" in errors[0], (
        proc.stderr
    )
    assert "Traceback" not in proc.stdout + proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    log = (run_dir / "train.log").read_text()
    assert "injected failure" in log  # the traceback is kept in the log
    assert_no_orphans(proc.pid)
    # Rank 0 went on to the shared-memory all-reduce's set-up (strategy.shared_memory) and left no
    # segment.
    pids = {line.rsplit(", pid ", 1)[1].strip() for line in log.splitlines() if ", pid " in line}
    assert pids and not [
        p.name for p in Path("/dev/shm").glob("hydra-ddp-*") if p.name.split("-")[2] in pids
    ]


def test_nccl_on_cpu_fails_fast_with_one_line(run_dir: Path):
    proc = run_train(run_dir, "backend=nccl", "trainer.device=cpu")
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "nccl" in lines[0] and "gloo" in lines[0], proc.stderr
    # Refused before anything was launched or logged: the directory Hydra made for the run is gone.
    assert not run_dir.exists(), sorted(p.name for p in run_dir.rglob("*"))


def test_a_refusal_in_a_directory_that_holds_a_run_keeps_every_file(run_dir: Path):
    check_ok(run_train(run_dir, "trainer.max_steps=2"))
    before = sorted(str(p.relative_to(run_dir)) for p in run_dir.rglob("*"))
    # no trainer.resume: refused, "holds checkpoints"
    proc = run_train(run_dir, "trainer.max_steps=2")
    assert proc.returncode == 2 and "holds checkpoints" in proc.stderr
    assert sorted(str(p.relative_to(run_dir)) for p in run_dir.rglob("*")) == before


def test_outside_launch_problem_found_by_rank_zero_stops_every_rank_with_its_line(run_dir: Path):
    """Only rank 0 knows the run directory; its verdict reaches rank 1 before either trains."""
    check_ok(run_train(run_dir, "trainer.max_steps=2"))
    prefix = (sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2")
    proc = run_train(run_dir, *QUICK, prefix=prefix, timeout=120)
    assert proc.returncode != 0
    errors = [line for line in proc.stderr.splitlines() if line.startswith("hydra-ddp: error:")]
    assert len(errors) == 2 and errors[0] == errors[1] and "holds checkpoints" in errors[0], (
        proc.stderr
    )
    assert "DistNetworkError" not in proc.stderr and "Connection reset" not in proc.stderr, (
        proc.stderr
    )
