"""The tests' kit: run train.py (and eval.py) as a user would, read back what a run leaves behind
(its summary, TensorBoard scalars and texts, step losses, metrics.csv, checkpoints), make the data
the tests need (nothing is downloaded), and compare runs.

The tests live in two layers: tests/unit (in the test's own process: no subprocess, no server, no
cluster) and tests/e2e (real processes: train.py and eval.py as a user runs them, launchers,
signals, servers, a Slurm cluster). Tests of both import the kit as `from support import ...` (and
`import servers`, `import pair_checks`): tests/unit and tests/e2e are packages (an __init__.py each)
and tests/ is not, so pytest's default (`prepend`) import mode puts tests/ first on sys.path before
importing conftest.py or any test module. conftest.py holds only fixtures, hooks and plugins; what
two test modules share is here, never in a test module (no test module imports another)."""

from __future__ import annotations

import contextlib
import csv
import importlib.util
import json
import os
import pickle
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]
# the kit's folder: support.py, servers.py, ci_skips.py, pair_checks.py
TESTS = Path(__file__).resolve().parent
HELPERS = TESTS / "helpers"
# A short real run: the default data and model, a few steps.
QUICK = ("trainer.max_steps=8", "trainer.log_every=3")
# Beside a probe that stops a run (tests/helpers/probes.py): it stops it once, not again when the
# run is continued (a continuation takes the run's own overrides, the probe's among them).
ONCE = "+model.resume=${trainer.resume}"


# --- Running train.py and eval.py
# ------------------------------------------------------------------


def train_env() -> dict[str, str]:
    env = dict(os.environ)
    # Test-only models and datasets (tests/helpers) must be importable by every worker.
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HELPERS), env.get("PYTHONPATH")]))
    env.pop("RANK", None)
    env.pop("WORLD_SIZE", None)
    return env


def start_train(
    run_dir: Path,
    *overrides: str,
    prefix: tuple[str, ...] = (),
    script: str | None = "train.py",
    env: dict[str, str] | None = None,
    cwd: Path = REPO,
) -> subprocess.Popen:
    """Start `python train.py OVERRIDES hydra.run.dir=RUN_DIR` (or under a launcher given as prefix;
    script None: the prefix is the whole command, e.g. `hydra-ddp train`; `env`: variables added to
    the environment; `cwd`: where it runs, a project of one's own say).

    It gets a session of its own: the test can find (and on timeout kill) every process it started.
    """
    program = [*(prefix or (sys.executable,)), *([str(REPO / script)] if script else [])]
    cmd = [*program, *overrides, f"hydra.run.dir={run_dir}"]
    return subprocess.Popen(
        cmd,
        cwd=cwd,
        env={**train_env(), **(env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def finish(proc: subprocess.Popen, timeout: float = 150) -> subprocess.CompletedProcess:
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        exited = proc.poll() is not None  # its output still open: something it started lives on
        left = session_processes(proc.pid)
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        what = (
            f"exited, but left processes holding its output: {left}"
            if exited
            else f"ran past {timeout} s"
        )
        raise AssertionError(f"train.py {what}\nstdout:\n{out}\nstderr:\n{err}") from None
    result = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    result.pid = proc.pid  # type: ignore[attr-defined]  # the session id of everything it started
    return result


def run_train(
    run_dir: Path,
    *overrides: str,
    prefix: tuple[str, ...] = (),
    timeout: float = 150,
    env: dict[str, str] | None = None,
    script: str | None = "train.py",
    cwd: Path = REPO,
) -> subprocess.CompletedProcess:
    return finish(
        start_train(run_dir, *overrides, prefix=prefix, script=script, env=env, cwd=cwd), timeout
    )


def run_eval(
    run_dir: Path, *overrides: str, timeout: float = 150, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    """`python eval.py OVERRIDES hydra.run.dir=RUN_DIR`."""
    return finish(start_train(run_dir, *overrides, script="eval.py", env=env), timeout)


def run_export(
    *args: str, cwd: Path | None = None, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    """`python -m hydra_ddp.export ARGS` (docs/export.md); `env`: variables added."""
    return subprocess.run(
        [sys.executable, "-m", "hydra_ddp.export", *args],
        cwd=cwd,
        env={**train_env(), **(env or {})},
        capture_output=True,
        text=True,
        timeout=120,
    )


def the_pages_module(page: str, module: str, package: Path, after: str = "") -> Path:
    """The python block of `page` (docs/…) that opens `# my_package/MODULE`, after the heading
    `after` if given, written under `package` as a user's package: the page's code, as it stands,
    is what the test runs. Returns `package`, for PYTHONPATH."""
    text = (REPO / page).read_text()
    if after:
        text = text.split(after, 1)[1]
    code = re.search(rf"```python\n(# my_package/{re.escape(module)}\n.*?)```", text, re.S)
    assert code, f"{page} has no my_package/{module} block"
    (package / "my_package").mkdir(parents=True, exist_ok=True)
    (package / "my_package" / "__init__.py").write_text("")
    (package / "my_package" / module).write_text(code.group(1))
    return package


def with_pythonpath(*folders: Path) -> dict[str, str]:
    """The environment addition that makes a user's own package (in `folders`) importable by
    train.py and every worker, beside the tests' helpers."""
    return {"PYTHONPATH": os.pathsep.join([*map(str, folders), train_env()["PYTHONPATH"]])}


def check_ok(proc: subprocess.CompletedProcess) -> None:
    assert proc.returncode == 0, (
        f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    )


def wait_for(condition, timeout: float, what: str, proc: subprocess.Popen | None = None):
    """Poll until condition() is truthy; fail naming `what` (or the run's output, if it ended)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        if proc is not None and proc.poll() is not None:
            raise AssertionError(
                f"run ended (exit {proc.returncode}) before {what}: {proc.communicate()}"
            )
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
                cmdline = (
                    Path(f"/proc/{entry}/cmdline")
                    .read_bytes()
                    .replace(b"\0", b" ")
                    .decode(errors="replace")
                )
                pids[int(entry)] = cmdline
    return pids


def assert_no_orphans(sid: int, grace_s: float = 10.0) -> None:
    """Nothing a run started outlives it by more than grace_s (a helper such as multiprocessing's
    resource tracker exits on its own once its parent has gone, a moment later). A run made in a
    fork of the session's warm process (tests/e2e/conftest.py) started everything in that
    process's session instead: nothing but the warm process itself may be left there."""
    warm = warm_pid()
    deadline = time.monotonic() + grace_s
    while (left := _left(sid, warm)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not left, f"processes left behind: {left}"


def _left(sid: int, warm: Optional[int]) -> dict[int, str]:
    left = session_processes(sid)
    if warm is not None:  # its session's id is its pid (started in a session of its own)
        left.update({pid: line for pid, line in session_processes(warm).items() if pid != warm})
    return left


def run_processes(sid: int) -> dict[int, str]:
    """The live processes of a run started in session `sid` (start_train's): the session's, and,
    for a run made in a fork of the session's warm process, that fork's and everything it started
    (in the warm process's session: the suite runs one command at a time)."""
    return _left(sid, warm_pid())


def warm_pid() -> Optional[int]:
    """The pid of the warm process this test's runs start in, if any (HYDRA_DDP_WARM)."""
    from hydra_ddp.warm import command

    path = os.environ.get(command.ENV)
    answer = command.ask(path) if path else None
    return answer["pid"] if answer else None


def free_port() -> int:
    """A port that was free a moment ago: only for launchers that need a port named in advance
    (mpirun); train.py's own launches bind port 0 and hold it."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn_ranks(target, args: tuple = (), nprocs: int = 1) -> None:
    """torch.multiprocessing's spawn for a test's own gloo ranks: `target(rank, *args)` in each,
    its exception raised here as mp.spawn raises it; a rank that returns ends as train.py's workers
    end (training/worker.py's _exit_after_teardown: os._exit, no interpreter finalization). gloo's
    native threads outlive destroy_process_group while C++ still holds the group, and a finished
    rank's static destructors racing them abort it now and then ("terminate called without an
    active exception": a soak of 251ec53 lost a run to it)."""
    import torch.multiprocessing as mp

    mp.start_processes(_rank_then_exit, args=(target, *args), nprocs=nprocs, start_method="spawn")


def _rank_then_exit(rank: int, target, *args) -> None:
    target(rank, *args)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


# --- What a run leaves behind
# ----------------------------------------------------------------------


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


def step_losses(run_dir: Path) -> list[tuple[int, float]]:
    """The run's training loss as TensorBoard holds it (tag train/loss): (step, loss) in step order.
    Compare these where the steps matter too (a resumed run: no step twice, none lost)."""
    return scalars(run_dir, "train/loss")


def losses(run_dir: Path) -> list[float]:
    """step_losses' values alone: the loss curve, in step order."""
    return [loss for _, loss in step_losses(run_dir)]


def csv_step_losses(run_dir: Path) -> list[tuple[int, str]]:
    """metrics.csv's training losses: (step, loss as written, unparsed) for the rows that have
    one."""
    with open(run_dir / "metrics.csv", newline="") as f:
        return [(int(r["step"]), r["train/loss"]) for r in csv.DictReader(f) if r["train/loss"]]


def wandb_starts(run_dir: Path) -> list[dict]:
    """logger=wandb's local files, read with wandb's own protobuf Records: one dict per start of the
    job (a resumed run adds one), oldest first, each with the run's id, group, name, config (as
    logged), history rows, last summary, artifacts' references and whether it was marked
    preempting."""
    from hydra_ddp.trackers import wandb_logger

    starts = []
    for path in sorted((run_dir / "wandb").glob("*run-*/run-*.wandb")):
        start = {"path": path, "history": [], "summary": {}, "artifacts": [], "preempting": False}
        for record in wandb_logger.records(path):
            kind = record.WhichOneof("record_type")
            if kind == "run":
                start.update(
                    id=record.run.run_id,
                    group=record.run.run_group,
                    name=record.run.display_name,
                    project=record.run.project,
                    config={u.key: json.loads(u.value_json) for u in record.run.config.update},
                )
            elif kind == "history":
                start["history"].append(wandb_logger.values(record.history.item))
            elif kind == "summary":
                start["summary"].update(wandb_logger.values(record.summary.update))
            elif kind == "artifact":
                start["artifacts"].append(
                    (record.artifact.type, [m.ref for m in record.artifact.manifest.contents])
                )
            elif kind == "preempting":
                start["preempting"] = True
        starts.append(start)
    return starts


def wandb_series(starts: list[dict], key: str) -> list[tuple[int, float]]:
    """One metric across a W&B run's starts: (training step, value) in the order logged."""
    return [
        (row["trainer/step"], row[key])
        for start in starts
        for row in start["history"]
        if key in row
    ]


def text(run_dir: Path, tag: str) -> list[str]:
    """The texts logged under `tag` (SummaryWriter.add_text), in step order."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"tensors": 0})
    acc.Reload()
    return [e.tensor_proto.string_val[0].decode() for e in acc.Tensors(f"{tag}/text_summary")]


def final_params(run_dir: Path) -> dict:
    """The last checkpoint's model weights: a file (ddp), or every rank's shards put together."""
    from hydra_ddp.checkpoint import files as checkpoints

    path = checkpoints.find(str(run_dir), "test")
    path = (
        (run_dir / "checkpoints" / "last").resolve()
        if path.is_dir()
        else run_dir / "checkpoints" / "last.pt"
    )
    return checkpoint_params(path)


def checkpoint_params(path: Path) -> dict:
    """A checkpoint's model weights (a file, or a sharded directory put together)."""
    from hydra_ddp.checkpoint import files as checkpoints

    return checkpoints.model_weights(path, checkpoints.read(path, "test"))


def assert_same_params(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert torch_equal(a[key], b[key]), key


def assert_same_run(run_dir: Path, reference: Path, what: str = "") -> None:
    """Bit for bit the run `reference` is (a resumed run against the uninterrupted one of the same
    config, world size and threads): every step's loss once, in TensorBoard and in metrics.csv (each
    drops what a stopped run logged after its checkpoint), and the final weights."""
    assert step_losses(run_dir) == step_losses(reference), what
    assert_same_params(final_params(run_dir), final_params(reference))
    assert csv_step_losses(run_dir) == csv_step_losses(reference), f"metrics.csv {what}"


def torch_equal(x, y) -> bool:
    import torch

    return torch.equal(x, y)


# --- Places to run in
# ------------------------------------------------------------------------------


@contextlib.contextmanager
def tmpfs(where: Path, size: str) -> Iterator[Path]:
    """A real tmpfs of `size` (mount's units: 6m) mounted at `where`: a small disk or /dev/shm.
    Skips the test where mounting is not allowed (needs root and mount(8))."""
    import shutil

    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a tmpfs needs root and mount(8)")
    where.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
        capture_output=True,
        text=True,
    )
    if done.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=True)


# --- Data the tests make for themselves: files in the formats the project reads
# --------------------


def write_cifar(root: Path, per_batch: int = 20, identical: bool = False) -> Path:
    """CIFAR-10's python batches (data_batch_1…5, test_batch, batches.meta) under
    root/cifar-10-batches-py, of random images; or of one image repeated (`identical`: then only
    augmentation tells two samples apart). Returns root."""
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        images = rng.integers(0, 256, (per_batch, 3072), dtype=np.uint8)
        if identical:
            images[:] = np.arange(3072) % 251  # a pattern that crops and flips change
        batch = {"data": images, "labels": rng.integers(0, 10, per_batch).tolist()}
        (folder / name).write_bytes(pickle.dumps(batch))
    (folder / "batches.meta").write_bytes(
        pickle.dumps({"label_names": [f"class{i}" for i in range(10)]})
    )
    return root


def make_image_folder(root: Path, classes=("cat", "dog"), per_class=5, size=10) -> Path:
    from PIL import Image

    for c, name in enumerate(classes):
        (root / name).mkdir(parents=True)
        for i in range(per_class):
            pixels = np.full((size, size, 3), 40 * c + i, dtype=np.uint8)
            Image.fromarray(pixels).save(root / name / f"{i}.png")
    return root


# --- A user's own task, model and data (docs/tasks.md's example: tests/e2e/test_tasks.py, the
# doc test's ~/lab) ---
LAB_PAGE = REPO / "docs" / "tasks.md"
# a mistake a user makes, beside the page's files: the loss left unreduced
LAB_MISTAKE = """
from torch.nn import functional as F

from my_lab.binary import Binary


class PerSample(Binary):
    def loss(self, output, target):
        return F.binary_cross_entropy_with_logits(
            output.float().reshape(-1), target.float(), reduction="none"
        )
"""


def lab_files() -> dict[str, str]:
    """docs/tasks.md's files, as the page gives them: each python or yaml block whose first line
    names its path in the project (`# my_lab/binary.py`, `# conf/task/binary.yaml`)."""
    found = {}
    for match in re.finditer(
        r"```(?:python|yaml)\n# ((?:my_lab|conf)/\S+)[^\n]*\n(.*?)```",
        LAB_PAGE.read_text(),
        re.DOTALL,
    ):
        found[match.group(1)] = match.group(2)
    assert len(found) == 6, f"docs/tasks.md: 6 files of the example, found {sorted(found)}"
    return found


def write_lab(folder: Path, conf: str = "labconf") -> Path:
    """docs/tasks.md's files under `folder`: the package `my_lab` (and its mistakes.py) and the
    configs under `conf` (an init project's `conf`, or the clone's extra config folder)."""
    for name, text in {**lab_files(), "my_lab/mistakes.py": LAB_MISTAKE}.items():
        path = folder / (conf + name[len("conf") :] if name.startswith("conf/") else name)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    (folder / "my_lab" / "__init__.py").touch()
    return folder


# --- Configs, composed and resolved in the test's own process
# ---------------------------------------


def compose_cfg(*overrides: str):
    """conf/config.yaml composed with `overrides`, as Hydra composes train.py's."""
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base=None):
        return compose(config_name="config", overrides=list(overrides))


def resolved(tmp_path: Path, *overrides: str, external=None):
    """As train.py resolves it (the schema registered first): a composition error (another
    strategy's knob, say) as its one line."""
    from hydra_ddp.errors import UserError
    from hydra_ddp.launch import composition, resolve

    try:
        composed = compose_cfg(*overrides)
    except Exception as error:
        line = composition.one_line(error)
        if line is None:
            raise
        raise UserError(line) from None
    return resolve.resolve(composed, tmp_path, external)


# --- Comparing runs
# --------------------------------------------------------------------------------


def relative_gaps(got: list[float], expected: list[float]) -> list[float]:
    """|got - expected| / |expected| step by step, as a running maximum (the gap so far)."""
    assert len(got) == len(expected), (len(got), len(expected))
    gaps, worst = [], 0.0
    for a, b in zip(got, expected):
        worst = max(worst, abs(a - b) / max(abs(b), 1e-12))
        gaps.append(worst)
    return gaps


def assert_within_float_noise(
    got: list[float],
    expected: list[float],
    *noise: list[float],
    ceiling: float,
    factor: float = 10.0,
    floor: float = 1e-6,
) -> None:
    """`got` trains like `expected` but for the order of float32 sums, over a run's first steps. How
    far that order alone moves a run depends on the CPU's kernels, so the bound is measured on this
    host, in this test: `noise` holds `expected`'s run trained again with only the summation order
    changed (other CPU threads, another memory format). At every step the gap so far must stay
    within `factor` times the largest such gap so far, or within `floor` (where the noise runs
    happen to agree bit for bit). The bound itself may not pass `ceiling`, a relative gap the caller
    chooses and justifies: measured with the code under test, a nondeterminism bug would widen its
    own bound.

    Only for a run's first steps: later, a ReLU or max-pool choice that goes the other way (a flip)
    grows a world size's difference by orders of magnitude that the noise runs need not meet. Runs
    compared over many steps train in float64 instead (FLOAT64, assert_float64_alike)."""
    limit = [max(column) for column in zip(*(relative_gaps(run, expected) for run in noise))]
    bounds = [factor * bound + floor for bound in limit]
    assert max(bounds) <= ceiling, (
        f"this host's float-order noise gives a bound of {max(bounds):.2e}, over the "
        f"ceiling {ceiling:.0e}: runs that should differ only in the order of their "
        f"sums differ more (noise gaps {[f'{b:.1e}' for b in limit]})"
    )
    gaps = relative_gaps(got, expected)
    bad = [
        (step, gap, bound)
        for step, (gap, bound) in enumerate(zip(gaps, limit), 1)
        if gap > factor * bound + floor
    ]
    assert not bad, (
        f"gap beyond {factor}x this host's float-order noise (+{floor}) at (step, gap, noise): "
        f"{[(s, f'{g:.2e}', f'{b:.2e}') for s, g, b in bad[:5]]}"
    )


# Runs compared across world sizes or strategies train their model in float64 (tests/helpers
# probes.float64; the tasks keep a float64 output's loss in float64). Summing in another order then
# moves a loss by a few units of float64's 2.2e-16, so far below anything that could flip a ReLU or
# a max-pool choice that the difference does not grow chaotically as float32's does (from 1e-7 to
# 7e-4 in 20 steps on an Intel host: FIELD_NOTES), and one bound holds on any x86 host.
# FLOAT64_BOUND: 1e-12, over 4,000 float64 units, leaves room for the differences to grow over a
# test's steps; a real difference (a sample read twice or left out, a gradient averaged over the
# wrong count) moves a loss by 1e-4 or more.
FLOAT64_BOUND = 1e-12


def float64(of: str = "hydra_ddp.models.MnistCNN") -> tuple[str, str]:
    """The overrides that train the configured model `of` in float64."""
    return "model._target_=probes.float64", f"+model.of={of}"


def csv_losses(run_dir: Path) -> list[float]:
    """metrics.csv's training losses, every digit (TensorBoard keeps float32 scalars)."""
    return [float(loss) for _, loss in csv_step_losses(run_dir)]


def assert_float64_alike(
    got: list[float], expected: list[float], bound: float = FLOAT64_BOUND
) -> None:
    """Two float64 runs (float64()) that differ only in the order of their sums: every value within
    `bound`."""
    gaps = relative_gaps(got, expected)
    assert gaps and max(gaps) <= bound, (
        f"float64 runs apart by up to {max(gaps):.2e} (bound "
        f"{bound:.0e}), step by step: {[f'{g:.1e}' for g in gaps]}"
    )


# --- Two hosts on one machine ------------------------------------------------------------------
class TwoHosts:
    """Two network namespaces joined by a veth pair: two hosts on one machine (needs root and
    iproute2)."""

    SUBNET = "10.231.77"

    def __init__(self, tag: str):
        self.names = [f"hddp-{tag}-a", f"hddp-{tag}-b"]
        # the pair's names while in this namespace (15 characters at most)
        self.ends = [f"hv{tag}a", f"hv{tag}b"]
        self.addresses = [f"{self.SUBNET}.1", f"{self.SUBNET}.2"]

    def _ip(self, *args: str) -> None:
        subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=30)

    def __enter__(self) -> TwoHosts:
        # A process killed inside the block (its session ended) leaves its namespaces behind; a
        # later process given the same PID, and so the same names, would fail to make them.
        self.__exit__()
        try:
            for name in self.names:
                self._ip("netns", "add", name)
            self._ip("link", "add", self.ends[0], "type", "veth", "peer", "name", self.ends[1])
            for end, name, address in zip(self.ends, self.names, self.addresses):
                self._ip("link", "set", end, "netns", name)
                # the same name on both hosts
                self._ip("-n", name, "link", "set", end, "name", "hddp0")
                self._ip("-n", name, "addr", "add", f"{address}/24", "dev", "hddp0")
                self._ip("-n", name, "link", "set", "hddp0", "up")
                self._ip("-n", name, "link", "set", "lo", "up")
        except (subprocess.CalledProcessError, OSError) as e:
            self.__exit__()
            detail = getattr(e, "stderr", "") or str(e)
            pytest.skip(f"network namespaces cannot be created here: {detail.strip()}")
        return self

    def run(
        self,
        commands: list[list[str]],
        envs: list[dict[str, str]],
        cwd: Path | None = None,
        timeout: float = 120,
    ) -> list[subprocess.CompletedProcess]:
        """commands[i] on host i with envs[i], all at once, each in a session of its own; their
        results, once all have ended (when one runs past `timeout`, the others are killed too)."""
        procs = []
        try:
            for name, command, env in zip(self.names, commands, envs):
                procs.append(
                    subprocess.Popen(
                        ["ip", "netns", "exec", name, *command],
                        cwd=cwd,
                        env=env,
                        stdout=subprocess.PIPE,
                        stderr=subprocess.PIPE,
                        text=True,
                        start_new_session=True,
                    )
                )
            return [finish(proc, timeout=timeout) for proc in procs]
        finally:
            for proc in procs:
                if proc.poll() is None:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()

    def __exit__(self, *exc) -> None:
        for end in self.ends:  # only there if interrupted before the move into the namespaces
            subprocess.run(["ip", "link", "del", end], capture_output=True, timeout=30)
        for name in self.names:
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30)


# --- The docs' fenced blocks, read (tests/unit/test_docs.py checks them, tests/e2e/test_docs.py
# runs them) ---

# docs/index.md is README.md's copy, made by `make docs`.
PAGES = [
    REPO / "README.md",
    *sorted(p for p in (REPO / "docs").rglob("*.md") if p.name != "index.md"),
]
SHELLS = ("bash",)
MARKS = {
    "needs-gpu": (
        "a GPU host's command (NCCL, CUDA): a train.py one is checked for such a host "
        "(--check --gpus=N)"
    ),
    "needs-cluster": (
        "several real hosts, a GPU partition, a container registry or a Kubernetes cluster"
    ),
    "needs-account": "a hosted service's account (W&B's servers)",
    "the-suite": "make test: the suite this test is part of",
    "installs": (
        "changes the environment the suite runs in: checked only (the extras it names exist)"
    ),
    "elsewhere": (
        "output of an environment the suite is not (a package not installed): not compared"
    ),
}


@dataclass
class Block:
    page: Path
    line: int
    lang: str
    mark: Optional[str]
    commands: list[str] = field(default_factory=list)
    # A text block's transcript: each `$ command` line with the lines the page shows it printing.
    transcript: list[tuple[str, list[str]]] = field(default_factory=list)

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(REPO)}:{self.line}"


def blocks(path: Path) -> list[Block]:
    """Every fenced block of a page, its language and mark; a shell block's commands with their
    continuation lines joined and comment lines left out."""
    found, lines, i = [], path.read_text().split("\n"), 0
    while i < len(lines):
        fence = re.match(r"^\s*```(\S*)", lines[i])
        if not fence:
            i += 1
            continue
        start, body = i, []
        i += 1
        while i < len(lines) and not lines[i].strip().startswith("```"):
            body.append(lines[i])
            i += 1
        i += 1
        before = "\n".join(lines[max(0, start - 2) : start])
        mark = next((m for m in MARKS if f"<!-- doc-test: {m} -->" in before), None)
        block = Block(path, start + 1, fence.group(1), mark)
        current = ""
        for line in body if block.lang in SHELLS else []:
            current += line.rstrip()[:-1].rstrip() + " " if line.rstrip().endswith("\\") else line
            if not line.rstrip().endswith("\\"):
                if current.strip() and not current.strip().startswith("#"):
                    block.commands.append(current.strip())
                current = ""
        for line in body if block.lang == "text" else []:
            if line.startswith("$ "):
                block.transcript.append((line[2:].strip(), []))
            elif block.transcript:
                block.transcript[-1][1].append(line)
        found.append(block)
    return found


BLOCKS = [block for page in PAGES for block in blocks(page)]


def without_comment(command: str) -> str:
    return re.sub(r"\s+#\s.*$", "", command)


def documented_command(page: str, fragment: str) -> str:
    """The documented shell command on `page` (README.md, docs/NAME.md) that contains `fragment`,
    continuation lines joined, its comment left out: one, or the test fails. Calling it (or
    `documented`) with constants makes the calling test the command's runner in the doc map
    (tests/doc_map.py): the doc test runs that command no more."""
    found = {
        without_comment(command)
        for block in BLOCKS
        if block.page == REPO / page and block.lang in SHELLS and block.mark is None
        for command in block.commands
        if fragment in command
    }
    assert len(found) == 1, f"{page}: {len(found)} commands contain {fragment!r}: {sorted(found)}"
    return found.pop()


def documented(page: str, fragment: str) -> list[str]:
    """The words after the script (train.py, eval.py, `-m hydra_ddp.MODULE`, `hydra-ddp COMMAND`)
    of the documented command (documented_command): what a test that runs that command passes, its
    own overrides after them (the last value of a key wins)."""
    import shlex

    command = documented_command(page, fragment)
    words = shlex.split(command)
    for i, word in enumerate(words):
        if word.endswith(("train.py", "eval.py")):
            return words[i + 1 :]
        if word == "-m" and i + 1 < len(words) and words[i + 1].startswith("hydra_ddp"):
            return words[i + 2 :]
        if Path(word).name == "hydra-ddp" and i + 1 < len(words):
            return words[i + 2 :]
    raise AssertionError(
        f"{page}: {command!r} runs no train.py, eval.py, hydra_ddp module or hydra-ddp"
    )


# --- A Kubernetes pod's variables (tests/unit and tests/e2e test_kubernetes.py) -------------------
IN_POD = {"KUBERNETES_SERVICE_HOST": "10.96.0.1"}  # the kubelet's, in every container
TRAINJOB = {
    **IN_POD,
    "PET_NNODES": "2",
    "PET_NPROC_PER_NODE": "2",
    "PET_NODE_RANK": "1",
    "PET_MASTER_ADDR": "job-node-0-0.job",
    "PET_MASTER_PORT": "29500",
}
# The training-operator's pod 1 of 2 (nprocPerNode: 2): WORLD_SIZE counts the workers, RANK the
# pods.
PYTORCHJOB = {
    **TRAINJOB,
    "PET_MASTER_ADDR": "job-master-0",
    "PET_MASTER_PORT": "23456",
    "RANK": "1",
    "WORLD_SIZE": "4",
    "MASTER_ADDR": "job-master-0",
    "MASTER_PORT": "23456",
}


# --- bench/gpu_check.py, imported as a module (tests/unit and tests/e2e test_gpu_check.py)
# ---------
GPU_CHECK = REPO / "bench" / "gpu_check.py"


def gpu_check():
    """bench/gpu_check.py as a module: its cases and its dry run."""
    spec = importlib.util.spec_from_file_location("gpu_check", GPU_CHECK)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
