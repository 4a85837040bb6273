"""Shared helpers: run train.py as a user would, and read back what a run leaves behind."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import pytest

pytest_plugins = ["ci_skips"]  # under CI=true a skip fails the run

REPO = Path(__file__).resolve().parents[1]
HELPERS = Path(__file__).resolve().parent / "helpers"
# A short real run: the default data and model, a few steps.
QUICK = ("trainer.max_steps=8", "trainer.log_every=3")


def train_env() -> dict[str, str]:
    env = dict(os.environ)
    # Test-only models and datasets (tests/helpers) must be importable by every worker.
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HELPERS), env.get("PYTHONPATH")]))
    env.pop("RANK", None)
    env.pop("WORLD_SIZE", None)
    return env


def start_train(run_dir: Path, *overrides: str, prefix: tuple[str, ...] = (), script: str = "train.py",
                env: dict[str, str] | None = None) -> subprocess.Popen:
    """Start `python train.py OVERRIDES hydra.run.dir=RUN_DIR` (or under a launcher given as prefix;
    `env`: variables added to the environment).

    It gets a session of its own: the test can find (and on timeout kill) every process it started.
    """
    cmd = [*(prefix or (sys.executable,)), str(REPO / script), *overrides, f"hydra.run.dir={run_dir}"]
    return subprocess.Popen(
        cmd, cwd=REPO, env={**train_env(), **(env or {})}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True,
    )


def finish(proc: subprocess.Popen, timeout: float = 150) -> subprocess.CompletedProcess:
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise AssertionError(f"train.py ran past {timeout} s\nstdout:\n{out}\nstderr:\n{err}") from None
    result = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    result.pid = proc.pid  # type: ignore[attr-defined]  # the session id of everything it started
    return result


def run_train(run_dir: Path, *overrides: str, prefix: tuple[str, ...] = (), timeout: float = 150,
              env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return finish(start_train(run_dir, *overrides, prefix=prefix, env=env), timeout)


def run_eval(run_dir: Path, *overrides: str, timeout: float = 150) -> subprocess.CompletedProcess:
    """`python eval.py OVERRIDES hydra.run.dir=RUN_DIR`."""
    return finish(start_train(run_dir, *overrides, script="eval.py"), timeout)


def wait_for(condition, timeout: float, what: str, proc: subprocess.Popen | None = None):
    """Poll until condition() is truthy; fail naming `what` (or the run's output, if it ended)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"run ended (exit {proc.returncode}) before {what}: {proc.communicate()}")
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def session_processes(sid: int) -> dict[int, str]:
    """Live processes left in a finished run's session (pid: command line)."""
    pids = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            fields = stat.rsplit(")", 1)[1].split()
            if int(fields[3]) == sid and fields[0] != "Z":  # fields[3]: session id
                cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                pids[int(entry)] = cmdline
    return pids


def assert_no_orphans(sid: int, grace_s: float = 10.0) -> None:
    """Nothing a run started outlives it by more than grace_s (a helper such as multiprocessing's
    resource tracker exits on its own once its parent has gone, a moment later)."""
    deadline = time.monotonic() + grace_s
    while (left := session_processes(sid)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not left, f"processes left behind: {left}"


def free_port() -> int:
    """A port that was free a moment ago: only for launchers that need a port named in advance
    (mpirun); train.py's own launches bind port 0 and hold it."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def check_ok(proc: subprocess.CompletedProcess) -> None:
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"


def summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def event_files(run_dir: Path) -> list[Path]:
    return sorted(run_dir.rglob("events.out.tfevents.*"))


def scalars(run_dir: Path, tag: str) -> list[tuple[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    # The whole folder: a resumed run adds a file, and TensorBoard drops the old one's later steps.
    acc = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0})
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars(tag)]


def text(run_dir: Path, tag: str) -> list[str]:
    """The texts logged under `tag` (SummaryWriter.add_text), in step order."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"tensors": 0})
    acc.Reload()
    return [e.tensor_proto.string_val[0].decode() for e in acc.Tensors(f"{tag}/text_summary")]


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    return tmp_path / "run"


def final_params(run_dir: Path) -> dict:
    """The last checkpoint's model weights: a file (ddp), or every rank's shards put together."""
    from hydra_ddp import checkpoint

    path = checkpoint.find(str(run_dir), "test")
    path = (run_dir / "checkpoints" / "last").resolve() if path.is_dir() else run_dir / "checkpoints" / "last.pt"
    return checkpoint.model_weights(path, checkpoint.read(path, "test"))


def assert_same_params(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert torch_equal(a[key], b[key]), key


def torch_equal(x, y) -> bool:
    import torch

    return torch.equal(x, y)


@pytest.fixture(scope="session")
def slurm_cluster():
    """A real Slurm cluster for the session (tests/slurm/cluster.sh: munged, slurmctld and a slurmd
    per node on free ports, in a folder of their own): two nodes, n1 and n2, each in a network
    namespace of its own where iproute2 and nsenter exist, else one; with job accounting (slurmdbd
    and a private MariaDB) where those are installed. `.env`: the variables its commands and jobs
    need; `.nodes`: how many; `.accounting`: whether sacct works."""
    import shutil
    import tempfile
    import types

    if os.geteuid() != 0:
        pytest.skip("the Slurm tests start munged and slurmd, which need root")
    missing = [tool for tool in ("munged", "mungekey", "slurmctld", "slurmd", "sbatch") if shutil.which(tool) is None]
    if missing:
        pytest.skip(f"Slurm is not installed ({', '.join(missing)} missing): "
                    "apt-get install --no-install-recommends slurmctld slurmd slurm-client munge")
    nodes = 2 if shutil.which("ip") and shutil.which("nsenter") else 1
    folder = Path(tempfile.mkdtemp(prefix="hddp-slurm-", dir="/tmp"))  # munged's socket needs 755 parents
    script = str(REPO / "tests" / "slurm" / "cluster.sh")
    up = subprocess.run([script, "up", str(folder), str(nodes)], capture_output=True, text=True, timeout=90)
    try:
        assert up.returncode == 0, f"the Slurm cluster did not start: {up.stderr}"
        # `export NAME=VALUE` lines: SLURM_CONF, and with two nodes the interface gloo must use there.
        env = dict(line.removeprefix("export ").split("=", 1) for line in up.stdout.split("\n") if line.startswith("export "))
        accounting = env.pop("HDDP_SLURM_ACCOUNTING", None) == "1"
        yield types.SimpleNamespace(env=env, nodes=nodes, accounting=accounting)
    finally:
        daemons = [int(f.read_text()) for f in (folder / "pids").glob("*")] if (folder / "pids").is_dir() else []
        tag = (folder / "net").read_text().strip() if (folder / "net").is_file() else None
        subprocess.run([script, "down", str(folder)], capture_output=True, text=True, timeout=90)
        shutil.rmtree(folder, ignore_errors=True)
        # Nothing of the cluster is left: no daemon it started, no namespace, no host name.
        assert not [pid for pid in daemons if Path(f"/proc/{pid}").exists()], "a Slurm or munge daemon outlived the cluster"
        if tag:
            namespaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30).stdout
            assert f"hddp-{tag}-" not in namespaces and f"hddp-slurm {tag}" not in Path("/etc/hosts").read_text()


@contextlib.contextmanager
def tmpfs(where: Path, size: str) -> Iterator[Path]:
    """A real tmpfs of `size` (mount's units: 6m) mounted at `where`: a small disk or /dev/shm.
    Skips the test where mounting is not allowed (needs root and mount(8))."""
    import shutil

    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a tmpfs needs root and mount(8)")
    where.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
                          capture_output=True, text=True)
    if done.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=True)
