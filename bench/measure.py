"""One measured run of either side: the command, its start time, and the figures the run reports.

The project's side is `train.py` on synthetic data, read back from the run's summary.json; the
baselines are `bench/handwritten.py` and `bench/expert.py` (the same loop tuned by hand), which
write the same fields. Time to first step is taken
from this process's clock before the command starts, so interpreter start-up and imports count
the same on both sides.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

REPO = Path(__file__).resolve().parents[1]
HANDWRITTEN = Path(__file__).resolve().parent / "handwritten.py"
EXPERT = Path(__file__).resolve().parent / "expert.py"  # the same loop with stock PyTorch's tuning
# `make train`'s work, by hand
HANDWRITTEN_TRAIN = Path(__file__).resolve().parent / "handwritten_train.py"
CEILING = Path(__file__).resolve().parent / "ceiling.py"  # the project's run without communication

# The figures every run yields; the report shows the median of each over the repetitions.
METRICS = (
    "steady_samples_per_sec",
    "median_step_time_s",
    "time_to_first_step_s",
    "time_to_workers_ready_s",
    "peak_rss_mb",
)
# What a run must write (summary.json, or the baseline's JSON) for those figures.
REPORTED = (
    "steps",
    "world_size",
    "steady_samples_per_sec",
    "median_step_time_s",
    "first_step_at",
    "workers_ready_at",
    "peak_rss_mb",
)
# What any DDP script imports before its first step: torch, and torch._dynamo (DDP's constructor
# and forward use it). One interpreter doing only that is a floor for a cold start: timed as Python
# runs it, and with the garbage collector off while the imports load, as the project's processes
# load them (hydra_ddp.launch.startup.frozen_imports). Keyed as the results file keeps them.
FLOOR_IMPORTS = "import torch, torch._dynamo"
FLOORS = {
    "startup_floor": FLOOR_IMPORTS,
    "startup_floor_gc_off": f"import gc; gc.disable(); {FLOOR_IMPORTS}",
}
# The hand-written loop ends, as pytorch/examples' scripts do, through the interpreter's teardown,
# where gloo's threads (alive after destroy_process_group) race static destructors: now and then a
# worker aborts with this line after rank 0 wrote the result (2 of 40 runs here). Such a run still
# counts, and the report says how many there were. (The project's workers end with os._exit for
# that reason: worker._exit_after_teardown.)
ABORT_AT_EXIT = "terminate called without an active exception"
# A sweep of two jobs, run one after the other in one command by Hydra's own launcher.
SWEEP = ("trainer.seed=0,1",)


class BenchError(Exception):
    """A run failed or reported something other than what was asked; shown in one message at the
    top."""


@dataclass(frozen=True)
class Workload:
    """What every run trains: the same on both sides."""

    steps: int
    batch_size: int = 64  # per rank
    test_size: int = 256  # the project evaluates once at the end: kept small

    @property
    def warmup_steps(self) -> int:
        """The steps both sides leave out of samples/s and step time: 10, or a tenth of a shorter
        run."""
        return min(10, self.steps // 10)

    def train_size(self, nproc: int) -> int:
        """Images enough for every step in one epoch, so no epoch boundary falls inside the
        timing."""
        return self.steps * self.batch_size * nproc


@dataclass(frozen=True)
class Case:
    """One configuration to measure: the project with extra overrides, or the hand-written loop."""

    label: str
    # "project", "handwritten", "expert" (bench/expert.py), "default": `make train`'s run as it is
    # (the digits, 12 epochs),
    # "handwritten_train": the same work by hand (bench/handwritten_train.py), or
    # "sweep": the project's command as a two-job multirun (-m SWEEP), whose second job is measured,
    # or "ceiling": the project's config trained in independent processes, without communication
    # (bench/ceiling.py), "lockstep": the same, meeting at a barrier after each backward (nothing
    # exchanged), or "exchange": in lockstep and the gradients averaged through shared memory (no
    # DDP, no loop).
    side: str
    nproc: int = 2
    overrides: tuple[str, ...] = ()
    # "images": synthetic images and the seeds' CNN; "text": the transformer (+experiment=text_gpt)
    # on Python's source, a global batch of the workload's batch size in sequences.
    task: str = "images"
    # A checkout of another commit (run.py --against): "default" runs its train.py, with its own
    # src.
    repo: Optional[str] = None


def command(case: Case, workload: Workload, out_dir: Path) -> tuple[list[str], Path]:
    """The command line for a case, and the JSON file it leaves its figures in."""
    train_size = workload.train_size(case.nproc)
    if case.side in ("handwritten", "expert"):
        out = out_dir / "result.json"
        cmd = [
            str(HANDWRITTEN if case.side == "handwritten" else EXPERT),
            str(out),
            f"--steps={workload.steps}",
            f"--nproc={case.nproc}",
            f"--batch-size={workload.batch_size}",
            f"--train-size={train_size}",
        ]
        return [sys.executable, *cmd], out
    if case.side == "handwritten_train":
        return [
            sys.executable,
            str(HANDWRITTEN_TRAIN),
            str(out_dir / "result.json"),
            f"--run-dir={out_dir}",
        ], out_dir / "result.json"
    # what `make train` runs: no override but where the run directory goes
    if case.side == "default":
        return [
            sys.executable,
            str(Path(case.repo or REPO) / "train.py"),
            f"hydra.run.dir={out_dir}",
        ], (out_dir / "summary.json")
    # windows of 65 bytes, enough for every step in one epoch, 20 % held out
    if case.task == "text":
        data = [
            "+experiment=text_gpt",
            f"data.global_batch_size={workload.batch_size}",
            f"data.dataset.max_bytes={int(workload.steps * workload.batch_size * 65 * 1.3)}",
        ]
    else:
        data = [
            "data=synthetic",
            f"data.batch_size={workload.batch_size}",
            f"data.dataset.train_size={train_size}",
            f"data.dataset.test_size={workload.test_size}",
        ]
    overrides = [
        *data,
        f"trainer.nproc={case.nproc}",
        f"trainer.max_steps={workload.steps}",
        "trainer.epochs=1000",
        "trainer.progress=false",
        *case.overrides,
    ]
    # the same overrides, settled as train.py settles them
    if case.side in ("ceiling", "lockstep", "exchange"):
        out = out_dir / "result.json"
        mode = [] if case.side == "ceiling" else [f"--{case.side}"]
        return [
            sys.executable,
            str(CEILING),
            *mode,
            f"--warmup={workload.warmup_steps}",
            str(out),
            "--",
            *overrides,
        ], out
    if case.side == "sweep":  # Hydra takes -m before the overrides
        return (
            [sys.executable, "train.py", "-m", *overrides, *SWEEP, f"hydra.sweep.dir={out_dir}"],
            out_dir / "1" / "summary.json",
        )
    return [
        sys.executable,
        "train.py",
        *overrides,
        f"hydra.run.dir={out_dir}",
    ], out_dir / "summary.json"


def measure(case: Case, workload: Workload) -> dict[str, Any]:
    """Run the case once; its figures (METRICS), plus steps, world size and the command's wall
    time."""
    with tempfile.TemporaryDirectory(prefix="hydra-ddp-bench-") as tmp:
        cmd, result_file = command(case, workload, Path(tmp))
        started = time.time()
        aborted_at_exit = _run(cmd, case, timeout=120 + workload.steps)
        wall = time.time() - started
        if aborted_at_exit and not result_file.exists():
            raise BenchError(
                f"{case.label}: a worker aborted ({ABORT_AT_EXIT}) before the result was written"
            )
        reported = _read(result_file, case)
        # the second job's clock starts where the first job ended: its summary written
        if case.side == "sweep":
            first = _read(result_file.parent.parent / "0" / "summary.json", case)
            started = first["first_step_at"] - first["time_to_first_step_s"] + first["wall_time_s"]
    # The default run's two sides train 12 epochs of the digits, not the workload's steps.
    own_workload = case.side not in ("default", "handwritten_train")
    if own_workload and (reported["steps"], reported["world_size"]) != (workload.steps, case.nproc):
        raise BenchError(
            f"{case.label}: ran {reported['steps']} steps on {reported['world_size']} rank(s), "
            f"not the {workload.steps} on {case.nproc} asked for"
        )
    return {
        "steady_samples_per_sec": reported["steady_samples_per_sec"],
        "median_step_time_s": reported["median_step_time_s"],
        "time_to_first_step_s": reported["first_step_at"] - started,
        # When the last worker's own code began: its interpreter, its imports (or the forkserver's)
        # done.
        "time_to_workers_ready_s": reported["workers_ready_at"] - started,
        "peak_rss_mb": reported["peak_rss_mb"],
        "steps": reported["steps"],
        "world_size": reported["world_size"],
        "wall_time_s": wall,
        "aborted_at_exit": aborted_at_exit,  # the hand-written loop's only (ABORT_AT_EXIT)
        "allreduce_bytes_per_step": reported.get("allreduce_bytes_per_step"),  # the project's only
        # per rank, the largest
        "model_state_bytes": (reported.get("model_state_bytes") or {}).get("total"),
        "checkpoints": reported.get("checkpoints"),
        "checkpoint_stall_s": reported.get("checkpoint_stall_s"),  # the median save's, on rank 0
        # Where a run's time goes, as its summary says (the project's only): the steps, evaluation,
        # saves.
        "train_time_s": reported.get("train_time_s"),
        "eval_time_s": reported.get("eval_time_s"),
        "checkpoint_time_s": reported.get("checkpoint_time_s"),
        # Seconds per step by phase, per rank (the project's summary, the ceiling's processes).
        "ranks": reported.get("ranks"),
    }


def measure_floor(imports: str) -> float:
    """From the start of one interpreter doing `imports` (a FLOORS value) to their end, on this
    harness's clock as the runs are (not to the process's end: the interpreter's teardown of torch
    takes a second more)."""
    started = time.time()
    done = subprocess.run(
        [sys.executable, "-c", f"{imports}; import time; print(time.time())"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    if done.returncode:
        raise BenchError(f"`python -c {imports!r}` failed: {done.stderr.strip().splitlines()[-1:]}")
    return float(done.stdout.split()[-1]) - started


def printable(cmd: list[str]) -> str:
    """The command as one would type it in the repository root: paths inside it made relative."""

    def short(arg: str) -> str:
        path = os.path.normpath(arg)
        return os.path.relpath(path, REPO) if Path(path).is_relative_to(REPO) else arg

    return shlex.join(short(arg) for arg in cmd)


def _run(cmd: list[str], case: Case, timeout: float) -> bool:
    """Run a command to its end; True where the hand-written loop aborted at its exit
    (ABORT_AT_EXIT), which measure() accepts if the result was written whole."""
    # A session of its own, so a hung run's workers can be killed with it.
    env = None
    if case.repo:  # that commit's code, not this checkout's (installed in the venv as editable)
        paths = [f"{case.repo}/src", os.environ.get("PYTHONPATH")]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in paths if p)}
    proc = subprocess.Popen(
        cmd,
        cwd=case.repo or REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        output, _ = proc.communicate(timeout=timeout)
    # a timeout, or Ctrl-C (which the run's own session does not get)
    except BaseException as error:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        if isinstance(error, subprocess.TimeoutExpired):
            raise BenchError(
                f"{case.label}: no result after {timeout:.0f} s, killed: {shlex.join(cmd)}"
            ) from None
        raise
    if (
        proc.returncode != 0
        and case.side in ("handwritten", "expert", "handwritten_train")
        and ABORT_AT_EXIT in output
    ):
        return True
    if proc.returncode != 0:
        tail = "\n".join(output.strip().splitlines()[-15:])
        raise BenchError(f"{case.label}: exit code {proc.returncode}: {shlex.join(cmd)}\n{tail}")
    return False


def _read(result_file: Path, case: Case) -> dict[str, Any]:
    if not result_file.exists():
        raise BenchError(f"{case.label}: the run finished but wrote no {result_file.name}")
    try:
        reported = json.loads(result_file.read_text())
    except json.JSONDecodeError as error:  # cut short: a worker killed while rank 0 wrote it
        raise BenchError(f"{case.label}: {result_file.name} is not whole JSON ({error})") from None
    missing = [key for key in REPORTED if reported.get(key) is None]
    if missing:
        raise BenchError(
            f"{case.label}: {result_file.name} lacks {', '.join(missing)}: the benchmark needs them"
        )
    return reported
