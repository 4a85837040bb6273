"""Faults injected into real runs: exact resume, pre-emption, killed and hung ranks, bad
checkpoints."""

from __future__ import annotations

import os
import pickle
import random
import shlex
import signal
import subprocess
from pathlib import Path

import pytest
import torch

from support import (
    HELPERS,
    QUICK,
    REPO,
    assert_no_orphans,
    assert_same_params,
    assert_same_run,
    check_ok,
    final_params,
    finish,
    make_image_folder,
    run_eval,
    run_processes,
    run_train,
    start_train,
    summary,
    tmpfs,
    train_env,
    wait_for,
)

HALF, FULL = 15, 30  # steps; an epoch of digits on 2 ranks is 21 steps: both stops fall mid-epoch


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> Path:
    """The reference: FULL steps without interruption."""
    run_dir = tmp_path_factory.mktemp("straight") / "run"
    check_ok(run_train(run_dir, f"trainer.max_steps={FULL}"))
    return run_dir


def test_stop_and_resume_mid_epoch_is_bit_identical(straight: Path, run_dir: Path):
    check_ok(run_train(run_dir, f"trainer.max_steps={HALF}"))
    assert summary(run_dir)["steps"] == HALF
    check_ok(run_train(run_dir, f"trainer.max_steps={FULL}", "trainer.resume=auto"))
    s = summary(run_dir)
    assert s["steps"] == FULL and s["resumed_from"].endswith(f"step-{HALF:08d}.pt")
    assert_same_run(run_dir, straight)
    # The control: the same checkpoint's weights alone (trainer.init_from: the data's position, the
    # optimizer and the random streams start anew, Lightning #20550) do not end as the straight run.
    fresh = run_dir.with_name("weights_alone")
    init = f"trainer.init_from={run_dir / 'checkpoints' / f'step-{HALF:08d}.pt'}"
    check_ok(run_train(fresh, f"trainer.max_steps={FULL - HALF}", init))
    with pytest.raises(AssertionError):
        assert_same_params(final_params(fresh), final_params(straight))
    # Continued once more, the complete run trains nothing and says so in one line; its outputs
    # stay as they were (the launcher sets the summary aside, and puts it back).
    outputs = ("summary.json", "metrics.csv", f"checkpoints/step-{FULL:08d}.pt")
    before = {name: (run_dir / name).read_bytes() for name in outputs}
    again = run_train(run_dir, f"trainer.max_steps={FULL}", "trainer.resume=auto")
    check_ok(again)
    lines = [line for line in again.stderr.splitlines() if line.startswith("hydra-ddp:")]
    assert lines == [
        f"hydra-ddp: the run in {run_dir} is complete (step {FULL}, ended by "
        "max_steps): nothing to train; its summary, checkpoints and logs are "
        "as they were (raise trainer.epochs or trainer.max_steps to train on)"
    ], again.stderr
    assert {name: (run_dir / name).read_bytes() for name in outputs} == before
    # Given more steps, it trains on from there.
    check_ok(run_train(run_dir, f"trainer.max_steps={FULL + 2}", "trainer.resume=auto"))
    assert summary(run_dir)["steps"] == FULL + 2


def test_checkpoints_load_with_weights_only_and_keep_the_last_k(straight: Path, run_dir: Path):
    check_ok(
        run_train(
            run_dir, "trainer.max_steps=12", "checkpoint.every_n_steps=2", "checkpoint.keep=2"
        )
    )
    ckpt = run_dir / "checkpoints"
    assert sorted(p.name for p in ckpt.glob("step-*.pt")) == [
        "step-00000010.pt",
        "step-00000012.pt",
    ]
    state = torch.load(ckpt / "last.pt", weights_only=True)
    assert not any(k.startswith("module.") for k in state["model"])
    assert state["position"]["step"] == 12 and len(state["rng"]) == 2  # per-rank RNG states
    assert isinstance(state["config"], dict)
    assert (ckpt / "last.pt").stat().st_mode & 0o077 == 0  # private
    assert (ckpt / "best.pt").exists()


@pytest.mark.parametrize(
    "launcher, signum, exit_signal",
    [
        ("spawn", signal.SIGTERM, signal.SIGTERM),
        ("torchrun", signal.SIGTERM, signal.SIGTERM),
        # Slurm's warning: the agent knows only TERM and INT
        ("torchrun", signal.SIGUSR1, signal.SIGTERM),
    ],
)
def test_sigterm_to_the_launcher_checkpoints_and_resume_continues_exactly(
    straight: Path, run_dir: Path, launcher: str, signum: int, exit_signal: int
):
    proc = start_train(
        run_dir,
        f"launcher={launcher}",
        f"trainer.max_steps={FULL}",
        "checkpoint.every_n_steps=4",
        "trainer.log_every=2",
    )
    wait_for(
        lambda: (run_dir / "checkpoints" / "step-00000004.pt").exists(),
        90,
        "the first checkpoint",
        proc,
    )
    # A single-node run's rendezvous (our store, gloo's sockets, torchrun's agent) listens on
    # loopback only.
    addresses = _listening_addresses(set(run_processes(proc.pid)))
    os.kill(proc.pid, signum)
    # Well inside torchrun's 30 s shutdown grace, after which it would SIGKILL the workers.
    done = finish(proc, timeout=25)
    assert done.returncode == 128 + exit_signal, done.stderr
    name = signal.Signals(exit_signal).name
    assert f"stopped by {name}" in done.stderr and "trainer.resume=auto" in done.stderr
    # the command to continue keeps the run's overrides
    assert f"launcher={launcher}" in done.stderr
    stopped_at = summary(run_dir)["steps"]
    assert stopped_at < FULL and (run_dir / "checkpoints" / f"step-{stopped_at:08d}.pt").exists()
    assert_no_orphans(done.pid)
    assert addresses and addresses <= {"127.0.0.1"}, addresses

    check_ok(
        run_train(
            run_dir, f"launcher={launcher}", f"trainer.max_steps={FULL}", "trainer.resume=auto"
        )
    )
    assert summary(run_dir)["steps"] == FULL
    assert_same_run(run_dir, straight)


def _log(run_dir: Path) -> str:
    log = run_dir / "train.log"
    return log.read_text() if log.exists() else ""


def _worker_pid(run_dir: Path, rank: int) -> int:
    for line in _log(run_dir).splitlines():
        if f"[rank {rank}]" in line and ", pid " in line:
            return int(line.rsplit(", pid ", 1)[1])
    return 0


def test_killed_worker_under_spawn_stops_the_job_and_names_the_rank(run_dir: Path):
    proc = start_train(run_dir, "trainer.epochs=100", "checkpoint.every_epoch=false")
    pid = wait_for(lambda: _worker_pid(run_dir, 1), 90, "rank 1 to start", proc)
    wait_for(lambda: "epoch 1/" in _log(run_dir), 90, "training", proc)
    os.kill(pid, signal.SIGKILL)
    done = finish(proc, timeout=60)
    assert done.returncode != 0
    # The killed rank, or the peer that lost it first: either way one line saying which and why.
    assert "hydra-ddp: error: worker rank" in done.stderr, done.stderr
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert_no_orphans(done.pid)


# The waiting rank's place: the shared-memory all-reduce (the CPU default), or gloo's under DDP's
# backward.
@pytest.mark.parametrize(
    "shared_memory, waits_in",
    [
        ("auto", "the shared-memory all-reduce"),
        ("false", "the backward (DDP's gradient all-reduce)"),
    ],
)
def test_hung_peer_fails_the_run_within_the_timeout_naming_the_stuck_rank_and_line(
    run_dir: Path, shared_memory: str, waits_in: str
):
    proc = run_train(
        run_dir,
        *QUICK,
        "backend.timeout_s=5",
        "model._target_=faulty.HangOnRank",
        "+model.hang_rank=1",
        f"strategy.shared_memory={shared_memory}",
        timeout=90,
    )
    assert proc.returncode != 0
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    stacks = run_dir / "stacks"
    hang_line = next(
        n
        for n, line in enumerate((HELPERS / "faulty.py").read_text().splitlines(), 1)
        if "Event().wait()" in line
    )
    line = proc.stderr.strip()
    assert line.startswith(
        "hydra-ddp: error: a collective timed out after 5 s (backend.timeout_s): rank 1 stuck for "
    ), line
    assert f" s at faulty.py:{hang_line} in forward (threading.Event().wait())" in line, line
    assert (
        f"its stack: {stacks / 'rank1.txt'}; the others: rank 0 waits in {waits_in} at step.py:"
        in line
    ), line
    # Every rank left its stack: the stuck one in the model's forward, the other in the all-reduce.
    assert (
        f'tests/helpers/faulty.py", line {hang_line}, in forward'
        in (stacks / "rank1.txt").read_text()
    )
    assert "in _run_batches" in (stacks / "rank0.txt").read_text()
    # gloo's flight recorder: rank 0 one collective further than rank 1
    if shared_memory == "false":
        assert "(collective #" in line and "after collective #" in line
        entries = [pickle.loads((stacks / f"rank{r}.fr").read_bytes())["entries"] for r in (0, 1)]
        assert (
            max(e["collective_seq_id"] for e in entries[0])
            == max(e["collective_seq_id"] for e in entries[1]) + 1
        )
    assert_no_orphans(proc.pid)


def test_a_rank_waiting_for_its_loader_worker_leaves_the_workers_stack_too(run_dir: Path):
    # Rank 1's loader worker never serves a batch (as a deadlocked one): the rank's own stack shows
    # only that it waits for its loader; the worker's stack, in the same file, shows where it is.
    proc = run_train(
        run_dir,
        *QUICK,
        "backend.timeout_s=10",
        "data.num_workers=1",
        "data.preload=false",
        "data.dataset._target_=faulty.digits_hanging_in_loader",
        "+data.dataset.hang_rank=1",
        timeout=120,
    )
    assert proc.returncode != 0
    hang_line = next(
        n
        for n, text in enumerate((HELPERS / "faulty.py").read_text().splitlines(), 1)
        if "deadlocked loader" in text
    )
    line = proc.stderr.strip()
    assert len(line.splitlines()) == 1 and "rank 1 stuck for " in line, line
    assert f"its loader worker at faulty.py:{hang_line} in __getitem__, its stack: " in line, line
    stack = (run_dir / "stacks" / "rank1.txt").read_text()
    # the rank: waiting for a batch
    assert "in _run_batches" in stack.split("Its loader worker", 1)[0]
    workers = stack.split("Its loader worker, pid")[1:]
    assert len(workers) == 1, stack  # its one worker (data.num_workers=1), in the dataset's wait
    assert f'faulty.py", line {hang_line} in __getitem__' in workers[0], stack
    assert_no_orphans(proc.pid)


def test_busy_port_is_named(run_dir: Path):
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        proc = run_train(run_dir, *QUICK, f"init_method.port={port}")
    assert proc.returncode != 0 and f"port {port}" in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr


def test_bad_checkpoints_fail_in_one_line_and_lose_nothing(run_dir: Path, tmp_path: Path):
    check_ok(run_train(run_dir, "trainer.max_steps=8", "checkpoint.every_n_steps=4"))
    ckpt = run_dir / "checkpoints"

    # A fresh run in a directory that holds checkpoints refuses, and touches none of them.
    before = {p.name: p.stat().st_mtime_ns for p in ckpt.iterdir()}
    proc = run_train(run_dir, *QUICK)
    assert proc.returncode != 0 and "trainer.resume=auto" in proc.stderr, proc.stderr
    assert {p.name: p.stat().st_mtime_ns for p in ckpt.iterdir()} == before

    # A corrupt newest checkpoint: resume=auto falls back to the one before, naming the bad one.
    newest = ckpt / "step-00000008.pt"
    newest.unlink()  # last.pt is a hard link: the step file can be replaced without touching it
    newest.write_bytes(b"PK\x03\x04 truncated")
    proc = run_train(run_dir, "trainer.max_steps=10", "trainer.resume=auto")
    check_ok(proc)
    assert summary(run_dir)["resumed_from"].endswith("step-00000004.pt")
    assert "step-00000008.pt" in (run_dir / "train.log").read_text()  # the bad one is reported

    # Named explicitly, a corrupt checkpoint is an error.
    proc = run_train(tmp_path / "explicit", *QUICK, f"trainer.resume={newest}")
    assert proc.returncode != 0 and "corrupt" in proc.stderr and str(newest) in proc.stderr, (
        proc.stderr
    )
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr

    # A checkpoint hydra-ddp 0.1.0 wrote (its keys renamed since), resumed and evaluated: one line
    # each.
    old = REPO / "tests" / "fixtures" / "checkpoint_0.1.0.pt"
    for proc in (
        run_train(tmp_path / "old", *QUICK, f"trainer.resume={old}"),
        run_eval(tmp_path / "oldeval", f"ckpt={old}"),
    ):
        assert proc.returncode != 0 and "was written by hydra-ddp 0.1" in proc.stderr, proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr

    # A checkpoint of another model: one error listing the keys, not a wall of size mismatches.
    proc = run_train(tmp_path / "mlp", *QUICK, "model=mlp", f"trainer.resume={ckpt / 'last.pt'}")
    assert (
        proc.returncode != 0 and "another model" in proc.stderr and "conv1.weight" in proc.stderr
    ), proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr


def test_crash_during_checkpoint_write_keeps_the_previous_one(tmp_path: Path):
    """A real process killed between writing the temp file and renaming it over the target."""
    import subprocess
    import sys

    target = tmp_path / "step.pt"
    code = """
import os, signal, sys, torch
from pathlib import Path
from hydra_ddp.checkpoint import atomic as atomic_files
target = Path(sys.argv[1])
atomic_files.atomic_write(atomic_files.serialize({"v": torch.ones(3)}, target.parent), target)
real_replace = os.replace
os.replace = lambda *a: os.kill(os.getpid(), signal.SIGKILL)  # die at the worst moment
atomic_files.atomic_write(atomic_files.serialize({"v": torch.zeros(3)}, target.parent), target)
"""
    proc = subprocess.run(
        [sys.executable, "-c", code, str(target)], capture_output=True, timeout=60
    )
    assert proc.returncode == -signal.SIGKILL
    assert torch.equal(torch.load(target, weights_only=True)["v"], torch.ones(3))
    assert list(tmp_path.glob(".step.pt.*.tmp"))  # the half-done write is left aside, never loaded


def _listening_addresses(pids: set[int]) -> set[str]:
    """Local addresses of the TCP sockets these processes listen on (from /proc, no tools
    needed)."""
    inodes = set()
    for pid in pids:
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith("socket:["):
                    inodes.add(target[8:-1])
        except OSError:
            continue
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for row in Path(table).read_text().splitlines()[1:]:
            cols = row.split()
            if cols[3] == "0A" and cols[9] in inodes:  # 0A: LISTEN
                address = cols[1].split(":")[0]
                if len(address) == 8:
                    found.add(".".join(str(b) for b in reversed(bytes.fromhex(address))))
                else:
                    found.add("ipv6:" + address)
    return found


def test_dataset_that_does_not_divide_does_not_hang(tmp_path: Path, run_dir: Path):
    """9 training images, 2 ranks, batch 4: the train sampler pads, so both ranks run 2 batches an
    epoch."""
    root = make_image_folder(tmp_path / "images", classes=("a", "b"), per_class=6)
    proc = run_train(
        run_dir,
        "data=imagefolder",
        f"data.dataset.root={root}",
        "data.num_classes=2",
        "data.image_size=16",
        "data.dataset.test_fraction=0.25",
        "data.batch_size=4",
        "trainer.epochs=2",
        "backend.timeout_s=30",
        "model=mlp",
        "data.val_fraction=0",
    )  # all 9 train
    check_ok(proc)
    s = summary(run_dir)
    # 12 images: 9 train, 3 test, each counted once
    assert s["steps"] == 4 and s["test_samples"] == 3


def test_ctrl_c_in_a_terminal_checkpoints_once_and_stops(straight: Path, run_dir: Path):
    """Ctrl-C reaches every process of the foreground group at once (the launcher passes it on too):
    the workers must take that as one request, not as "asked twice, stop without a checkpoint"."""
    proc = start_train(
        run_dir, f"trainer.max_steps={FULL}", "checkpoint.every_n_steps=4", "trainer.log_every=2"
    )
    wait_for(
        lambda: (run_dir / "checkpoints" / "step-00000004.pt").exists(),
        90,
        "the first checkpoint",
        proc,
    )
    os.killpg(proc.pid, signal.SIGINT)  # what the terminal does
    done = finish(proc, timeout=25)
    assert done.returncode == 128 + signal.SIGINT, done.stderr
    assert "stopped by SIGINT" in done.stderr
    stopped = summary(run_dir)
    # the printed summary said "ended by epochs"
    assert stopped["stopped_by"] == stopped["ended_by"] == "SIGINT"
    assert "(ended by SIGINT: checkpointed, to be continued)" in done.stdout + _log(run_dir)
    assert_no_orphans(done.pid)
    # The line it printed, run as printed from where it was started: it continues the run.
    again = done.stderr.split("continue with: ", 1)[1].splitlines()[0]
    proc = subprocess.Popen(
        shlex.split(again),
        cwd=REPO,
        env=train_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    check_ok(finish(proc))
    assert summary(run_dir)["steps"] == FULL
    assert_same_run(run_dir, straight)


CHAOS_STEPS = 40  # epoch ends at step 21; the final evaluation and checkpoint at 40


def _chaos_plan(rng: random.Random) -> str:
    """Three kills, one per torchrun attempt, in random order, of random ranks, at random
    moments."""
    kinds = ["step", "eval", "ckpt"]
    rng.shuffle(kinds)
    # early enough that every attempt gets there
    n = {"step": rng.randint(1, 3), "eval": 1, "ckpt": 1}
    return ";".join(
        f"{attempt}:{kind}:{rng.randint(0, 1)}:{n[kind]}" for attempt, kind in enumerate(kinds)
    )


@pytest.mark.timeout(600)  # a reference run and four torchrun attempts
def test_chaos_kills_under_torchrun_restarts_finish_bit_identical(tmp_path: Path):
    # Validation in chunks of 32: both ranks evaluate (in one chunk of 256 only rank 0 would, and a
    # planned kill of rank 1 "during evaluation" would never come).
    common = (
        f"trainer.max_steps={CHAOS_STEPS}",
        "checkpoint.every_n_steps=4",
        "trainer.log_every=2",
        "data.eval_batch_size=32",
    )
    straight = tmp_path / "straight"
    check_ok(run_train(straight, *common))
    plan = os.environ.get("CHAOS_PLAN") or _chaos_plan(
        random.Random(int.from_bytes(os.urandom(4), "big"))
    )
    chaotic = tmp_path / "chaos"
    # shown with a failure: rerun it with CHAOS_PLAN='...'
    print(f"chaos plan (attempt:kind:rank:n): {plan}")
    proc = run_train(
        chaotic,
        *common,
        "launcher=torchrun",
        "launcher.max_restarts=3",
        "model._target_=faulty.ChaosCNN",
        f"+model.chaos='{plan}'",
        timeout=400,
    )
    assert proc.returncode == 0, (
        f"plan {plan}: exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    )
    starts = [
        line
        for line in _log(chaotic).splitlines()
        if "[rank 0]" in line and "CPU thread(s)" in line
    ]
    assert len(starts) == 4, f"plan {plan}: expected 3 kills and 4 attempts, saw {len(starts)}"
    s = summary(chaotic)
    # the last attempt continued from a checkpoint
    assert s["steps"] == CHAOS_STEPS and s["resumed_from"], plan
    assert_same_run(chaotic, straight, plan)  # the plan is printed above too
    assert_no_orphans(proc.pid)


@pytest.mark.parametrize("launcher", ["spawn", "torchrun"])
def test_sigkill_to_the_parent_leaves_no_worker_and_resume_is_exact(
    straight: Path, run_dir: Path, launcher: str
):
    proc = start_train(
        run_dir,
        f"launcher={launcher}",
        f"trainer.max_steps={FULL}",
        "checkpoint.every_n_steps=4",
        "trainer.log_every=2",
    )
    wait_for(
        lambda: (run_dir / "checkpoints" / "step-00000004.pt").exists(),
        90,
        "the first checkpoint",
        proc,
    )
    os.kill(proc.pid, signal.SIGKILL)  # no handler runs: the workers must notice on their own
    proc.wait(timeout=30)
    assert_no_orphans(proc.pid)
    check_ok(
        run_train(
            run_dir, f"launcher={launcher}", f"trainer.max_steps={FULL}", "trainer.resume=auto"
        )
    )
    assert summary(run_dir)["steps"] == FULL
    assert_same_run(run_dir, straight)


def test_crash_while_exiting_after_a_complete_run_is_a_warning(run_dir: Path):
    # Under torchrun a worker's interpreter shuts down normally (spawn's workers end with os._exit
    # once their outputs are closed), so its exit handlers run: one aborts on purpose.
    proc = run_train(
        run_dir,
        *QUICK,
        "launcher=torchrun",
        "model._target_=faulty.AbortAtExit",
        "+model.abort_rank=1",
    )
    check_ok(proc)  # the summary proves every rank finished: the run stands
    warnings = [line for line in proc.stderr.splitlines() if line.startswith("hydra-ddp: warning:")]
    assert len(warnings) == 1 and "worker rank 1 ended badly" in warnings[0], proc.stderr
    assert "SIGABRT" in warnings[0] or "Signal 6" in warnings[0], warnings[0]
    assert summary(run_dir)["steps"] == 8


@pytest.fixture
def small_disk(tmp_path: Path):
    """A 6 MiB tmpfs: room for one checkpoint of the CNN (3.3 MiB with momentum), not two."""
    with tmpfs(tmp_path / "disk", "6m") as mount:
        yield mount


def test_full_disk_during_a_checkpoint_stops_in_one_line_and_resume_is_exact(
    straight: Path, small_disk: Path
):
    import subprocess

    run_dir = small_disk / "run"
    overrides = (f"trainer.max_steps={FULL}", "checkpoint.every_n_steps=2", "trainer.log_every=2")
    proc = run_train(run_dir, *overrides)
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "hydra-ddp: error:" in lines[0], proc.stderr
    assert (
        str(run_dir / "checkpoints") in lines[0] and "needs 3." in lines[0] and "MiB" in lines[0]
    ), lines[0]
    kept = sorted(p.name for p in (run_dir / "checkpoints").glob("step-*.pt"))
    assert kept == ["step-00000002.pt"]
    assert (
        torch.load(run_dir / "checkpoints" / "last.pt", weights_only=True)["position"]["step"] == 2
    )
    assert not list((run_dir / "checkpoints").glob(".*.tmp"))  # nothing half-written left behind

    subprocess.run(["mount", "-o", "remount,size=64m", str(small_disk)], check=True)  # room made
    check_ok(run_train(run_dir, *overrides, "trainer.resume=auto"))
    s = summary(run_dir)
    assert s["steps"] == FULL and s["resumed_from"].endswith("step-00000002.pt")
    assert_same_run(run_dir, straight)
