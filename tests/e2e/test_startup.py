"""The forkserver's workers, as multiprocessing really forks them: what they inherit of its
imports; and the warm start (hydra_ddp.warm), whose forks run a command as it would run cold."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from support import (
    QUICK,
    REPO,
    assert_same_run,
    check_ok,
    finish,
    run_train,
    start_train,
    train_env,
    wait_for,
)

# A worker forked from the forkserver that train.py starts (startup.preload) reports on its garbage
# collector; and frozen_imports hands back the collector as it found it.
PROBE = """
import gc, json, multiprocessing, sys
from hydra_ddp.launch import startup

def report(queue):
    queue.put({"enabled": gc.isenabled(), "frozen": gc.get_freeze_count(),
               "torch": "torch._dynamo" in sys.modules})

if __name__ == "__main__":
    with startup.frozen_imports():
        inside = gc.isenabled()
    after = gc.isenabled()
    gc.disable()
    with startup.frozen_imports():
        pass
    stays_off = not gc.isenabled()
    gc.enable()
    startup.preload()
    context = multiprocessing.get_context("forkserver")
    queue = context.Queue()
    worker = context.Process(target=report, args=(queue,))
    worker.start()
    found = queue.get(timeout=60)
    worker.join(timeout=30)
    print(json.dumps({"inside": inside, "after": after, "stays_off": stays_off, "worker": found,
                      "exitcode": worker.exitcode}))
"""


def test_forkserver_workers_inherit_frozen_imports_with_the_collector_on(tmp_path: Path):
    script = tmp_path / "probe.py"  # a file: the forked worker imports its target from it
    script.write_text(PROBE)
    done = subprocess.run(
        [sys.executable, str(script)],
        cwd=REPO,
        env=train_env(),
        capture_output=True,
        text=True,
        timeout=150,
    )
    assert done.returncode == 0, done.stderr
    found = json.loads(done.stdout.splitlines()[-1])
    # Off while the imports load, back on after; left off where it was off.
    assert found["inside"] is False and found["after"] is True and found["stays_off"] is True
    worker = found["worker"]
    # torch arrived imported, its objects frozen out of every collection (hundreds of thousands),
    # and the collector runs in the worker: a training loop's garbage cycles are still freed.
    assert worker["torch"] is True and worker["enabled"] is True, worker
    assert worker["frozen"] > 100_000, worker
    assert found["exitcode"] == 0


def _descendants(pid: int) -> list[int]:
    """Every live process below `pid` (by /proc's parent links)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if fields[0] != "Z":
                children.setdefault(int(fields[1]), []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


@pytest.mark.cold  # it starts a warm process of its own, and runs the same config cold beside it
@pytest.mark.timeout(420)
def test_a_warm_start_trains_the_same_bits_as_a_cold_one_and_ends_as_its_command_ends(
    tmp_path: Path,
):
    """docs/startup.md's warm start, through its commands: `hydra-ddp warm start` prints the line
    that points a shell at it; a run forked from it is a cold run's bits (every step's loss in
    TensorBoard and metrics.csv, the final weights); SIGTERM to the command stops the run with its
    checkpoint and the command's exit status; SIGKILL to the command leaves nothing of its fork
    behind; what a fork cannot take (a variable torch reads at import) starts cold, in one line;
    `stop` ends it."""
    hydra_ddp = Path(sys.executable).with_name("hydra-ddp")
    path = str(tmp_path / "w.sock")
    env = {**train_env(), "HYDRA_DDP_WARM": path}

    def warm(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [str(hydra_ddp), "warm", *args], env=env, capture_output=True, text=True, timeout=150
        )

    started = warm("start")
    assert started.returncode == 0, started.stderr
    pid = int(re.search(r"warm process (\d+) at", started.stderr).group(1))
    try:
        assert started.stdout == f"export HYDRA_DDP_WARM={path}\n"

        cold = run_train(tmp_path / "cold", *QUICK)
        forked = run_train(tmp_path / "warm", *QUICK, env={"HYDRA_DDP_WARM": path})
        check_ok(cold)
        check_ok(forked)
        assert "starting cold" not in forked.stderr
        assert_same_run(tmp_path / "warm", tmp_path / "cold", "a warm start against a cold one")
        status = warm("status")
        assert status.returncode == 0 and "1 command(s) served, 0 running" in status.stdout, status

        # SIGTERM reaches the run through its command: it checkpoints and stops, the command ends so
        proc = start_train(tmp_path / "stopped", "trainer.epochs=100", env={"HYDRA_DDP_WARM": path})
        wait_for(lambda: (tmp_path / "stopped" / "metrics.csv").exists(), 60, "training", proc)
        proc.send_signal(signal.SIGTERM)
        stopped = finish(proc)
        assert stopped.returncode == 128 + signal.SIGTERM, stopped.stderr
        assert "hydra-ddp: error: stopped by SIGTERM at step" in stopped.stderr
        assert list((tmp_path / "stopped" / "checkpoints").glob("step-*.pt"))

        # SIGKILL to the command: its fork, the fork's forkserver and the workers end with it
        proc = start_train(tmp_path / "killed", "trainer.epochs=100", env={"HYDRA_DDP_WARM": path})
        wait_for(lambda: (tmp_path / "killed" / "metrics.csv").exists(), 60, "training", proc)
        assert len(_descendants(pid)) >= 3, "the fork, its forkserver and the workers"
        proc.kill()
        proc.communicate()
        wait_for(lambda: not _descendants(pid), 20, "the fork and its workers to end")
        assert "0 running" in warm("status").stdout

        # read when torch is imported: a fork would not see it, so the command starts cold
        differs = subprocess.run(
            [sys.executable, "train.py", "--check"],
            cwd=REPO,
            env={**env, "OMP_NUM_THREADS": "1"},
            capture_output=True,
            text=True,
            timeout=150,
        )
        assert differs.returncode == 0, differs.stderr
        assert differs.stderr.splitlines()[0] == (
            "hydra-ddp: note: starting cold: OMP_NUM_THREADS differs from the warm process's, "
            "and is read when torch or Python starts"
        )
        stopping = warm("stop")
        assert stopping.returncode == 0 and f"stopped the warm process at {path}" in stopping.stderr
        wait_for(lambda: not Path(f"/proc/{pid}").exists(), 30, "the warm process to end")
        assert not Path(path).exists()
        assert warm("status").returncode == 1
    finally:  # whatever failed, the warm process does not outlive the test
        if Path(f"/proc/{pid}").exists():
            os.kill(pid, signal.SIGKILL)
