"""The project on CUDA, in one prepared run (bench/gpu_check.sh): under 5 minutes on one GPU.

    python bench/gpu_check.py             # every case this host can run
    python bench/gpu_check.py --dry-run   # on any CPU: check every case's launches, launch nothing
    python bench/gpu_check.py --only GPT  # the cases whose name holds GPT (say, to rerun a failure)

One list of cases (CASES) drives both. The real run writes OUT/gpu_check.md and OUT/gpu_check.json
(OUT defaults to bench/results) again after every case, so a late failure or a kill keeps the
earlier figures. A case that exits non-zero, times out, leaves no summary or misses its check is
recorded as failed with a one-line reason (the JSON keeps its output's tail) and the next case
runs; the exit code is 1 if any failed. Time: every launch has a timeout (its case's), and each
section a deadline counted from the start (one GPU: 270 s; all GPUs: 550 s, under the machine's
600 s per command). A case with less than 15 s of its section left is recorded as skipped for
time, not run; one cut short by its section's deadline (not by its own limit) is recorded so too.
Data: synthetic sets of a fixed size (a few global batches at 8 GPUs, reused epoch after epoch)
and trainer.max_steps ending each run, so host memory does not grow with the GPU count.

One GPU (trainer.nproc=1 on any host, so the figures compare across hosts; nccl):
- the step timer's CUDA-event clock against a synchronised host clock (tests/unit/test_timing.py's
  cuda_check: within 2× over matmuls queued on the stream);
- parity: train.py against bench/handwritten.py (the seeds' CNN, batch 64), A B A B, and `auto`
  leaving the CPU-only strategy.shared_memory off;
- the CNN with every `auto` setting off; with workers started as fresh interpreters
  (start_method=spawn: the forkserver must not have touched CUDA); with the fp16 communication
  hook; with fp16 autocast and gradient clipping (GradScaler's unscale); under FSDP2 with bf16
  mixed precision and clipping;
- the transformer (+experiment=text_gpt) under ddp, fsdp and tp (a one-rank mesh), a checkpoint
  every 20 steps (sharded, DCP, under fsdp and tp);
- ResNet-50 (torchvision) images/s in bf16 on synthetic 224×224 data held on the GPU, batch 128:
  auto settings off, and the defaults (channels_last, bucket view, static graph);
- the tuner (python -m hydra_ddp.tools.tune tune.precision=true) on the CNN, over pin_memory and
  precision;
- ResNet-50 with torch.compile: last, as the longest, the first to go when time runs short.

All GPUs (where 2 or more are visible, trainer.nproc = their count; else recorded as skipped):
- the CNN under DDP over NCCL: every rank on its own GPU (train.log's "rank r/N on cuda:r"), its
  samples/s against one GPU's;
- a dead peer (tests/helpers faulty.FailOnRank, rank 1): a non-zero exit within the case's 60 s
  (backend.timeout_s is 600 s under NCCL) and exactly one error line, naming rank 1;
- a hung peer (faulty.HangOnRank, rank 1, backend.timeout_s=20): one error line naming rank 1, and
  the NCCL flight recorder's dumps in RUN/stacks/nccl_trace_rank_R;
- ResNet-18 with strategy.sync_batchnorm=true and a global batch of 128: the step losses at 1 GPU
  and at all of them agree within 1e-2 relative (cuDNN's default TF32 convolutions widen it);
- DataParallel against DDP (bench/handwritten.py --parallel dp|ddp), the CNN at 64 per GPU: the
  ratio of their samples/s after warm-up, and GPU 0's peak allocated memory under DataParallel
  against the largest GPU's under DDP (the seeds' claim: DDP faster, DataParallel loading GPU 0
  more). Both read batches as pytorch/examples does, one DataLoader per process: DataParallel's
  one process loads the whole global batch, part of what it costs;
- resume: stopped at step 20, resumed (trainer.resume=auto) to 40 in the same directory, against
  an uninterrupted run: the final weights (checkpoints/last.pt) within 1e-4;
- eval.py ckpt=RUN_DIR on a finished run: the same test accuracy and loss as the run's summary;
- an outside launcher (python -m torch.distributed.run --standalone --nproc_per_node=N);
- PowerSGD (strategy.comm_hook=powersgd, from step 10);
- FSDP2 with CPU offload, on the transformer;
- FSDP2 with fp16 mixed precision: the one-line refusal it expects (exit 2, "would need loss
  scaling") is recorded as refused; another refusal or error fails the case;
- DataParallel against DDP on ResNet-18, 224×224, bf16 autocast, 32 per GPU.
The DataParallel cases report the seeds' claim as holding or not; they fail only if a run does.

The dry run checks each train.py launch with hydra_ddp.tools.preflight.check (`train.py --check
--gpus=N`: one-GPU cases for 1 GPU, all-GPU cases for 2 and 8) and bench/handwritten.py's
arguments with its own parser. It does not check eval.py's side (that needs the run's
checkpoint), the tuner's tune.* arguments (only the run it tunes), nor the outside launcher's
own arguments (its run is checked as train.py's at that many GPUs).

Left out for time (the old check had them): the plain FSDP CNN (FSDP2 runs in the bf16 case and
under the transformer), the bf16 communication hook (the fp16 hook's code with another dtype),
and the tuner's CPU-side knobs (threads, workers: bench/run.py measures them).
"""

import time

START = time.monotonic()  # before the imports: the deadlines count them too

import argparse  # noqa: E402
import contextlib  # noqa: E402
import importlib.util  # noqa: E402
import io  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import platform  # noqa: E402
import re  # noqa: E402
import signal  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import traceback  # noqa: E402
from collections.abc import Callable  # noqa: E402
from dataclasses import asdict, dataclass, field  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Optional  # noqa: E402

import torch  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
# The project and the worker-side test models (faulty.FailOnRank): importable in this process (the
# dry run builds them) and in every worker (ENV below), whoever runs the script and from where.
for _folder in (REPO / "tests" / "helpers", REPO / "tests", REPO / "src"):
    if str(_folder) not in sys.path:
        sys.path.insert(0, str(_folder))
# where this file is loaded as a module (the suite's dry run)
if str(REPO / "bench") not in sys.path:
    sys.path.append(str(REPO / "bench"))  # last: its scripts' names must not shadow anything
import provenance  # noqa: E402

CONF = REPO / "conf"
OUT = Path(os.environ.get("OUT", REPO / "bench" / "results"))
ONE, ALL = "one GPU", "all GPUs"
# from the start: 5 minutes on one GPU, and the machine's 600 s a command
DEADLINE_S = {ONE: 270, ALL: 550}
MIN_START_S = 15  # less than this left: a launch would not reach its first step
DRY_RUN_GPUS = {ONE: (1,), ALL: (2, 8)}
# The worker-side test models (faulty.FailOnRank) must import in every worker.
ENV = {
    **{k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")},
    "PYTHONPATH": os.pathsep.join(
        filter(
            None,
            [
                str(REPO / "src"),
                str(REPO / "tests" / "helpers"),
                str(REPO / "tests"),
                os.environ.get("PYTHONPATH"),
            ],
        )
    ),
    "PYTHONUNBUFFERED": "1",
}
FIGURES = ("steady_samples_per_sec", "median_step_time_s", "time_to_first_step_s", "peak_rss_mb")

# A run over a small set reused epoch after epoch, ended by trainer.max_steps: no per-epoch
# validation or checkpoint inside the timing, no ragged last batch (torch.compile would recompile).
BOUNDED = (
    "trainer.epochs=1000",
    "trainer.progress=false",
    "checkpoint.every_epoch=false",
    "trainer.eval_every_epoch=false",
    "data.drop_last=true",
    "backend=nccl",
)
# 4096 images of 28×28 (13 MB): several steps an epoch at 64 per rank on up to 8 GPUs.
SMALL_IMAGES = ("data=synthetic", "data.dataset.train_size=4096", "data.dataset.test_size=256")
CNN = (*SMALL_IMAGES, "data.batch_size=64", *BOUNDED)
AUTO_OFF = (
    "trainer.channels_last=false",
    "strategy.gradient_as_bucket_view=false",
    "strategy.static_graph=false",
    "strategy.shared_memory=false",
)  # the last is CPU-only: auto leaves it off on CUDA anyway
# The transformer on Python's source: 64 KiB make about 12 batches of 64 sequences an epoch.
GPT = (
    "+experiment=text_gpt",
    "data.global_batch_size=64",
    "data.dataset.max_bytes=65536",
    "checkpoint.every_n_steps=20",
    *BOUNDED,
)
# 576 images of 224×224 (350 MB, held on the GPU): 4 batches of 128 an epoch.
RESNET50 = (
    "model=torchvision",
    "model.name=resnet50",
    "data=synthetic",
    "data.in_channels=3",
    "data.image_size=224",
    "data.num_classes=1000",
    "data.dataset.train_size=576",
    "data.dataset.test_size=128",
    "data.batch_size=128",
    "data.eval_batch_size=128",
    "data.preload=true",
    "trainer.precision=bf16",
    "trainer.max_steps=40",
    *BOUNDED,
)
# A BatchNorm model at a fixed global batch: the same batches at any world size.
SYNC_BN = (
    "model=resnet18",
    *SMALL_IMAGES,
    "data.global_batch_size=128",
    "strategy.sync_batchnorm=true",
    "trainer.log_every=5",
    "trainer.max_steps=20",
    *BOUNDED,
)
ONE_RANK, EVERY_GPU = "trainer.nproc=1", "trainer.nproc={gpus}"
HAND_CNN = ("--device=cuda", "--steps=200", "--batch-size=64", "--train-size=4096")
HAND_RESNET = (
    "--device=cuda",
    "--steps=30",
    "--batch-size=32",
    "--train-size=512",
    "--model=resnet18",
    "--precision=bf16",
    "--nproc={gpus}",
)  # 512 images of 224×224: 300 MB a process


class CaseFailed(Exception):
    def __init__(self, reason: str, detail: str = ""):
        super().__init__(reason)
        self.detail = detail


class Refused(CaseFailed):
    """The project refused the configuration in one line, as it may for a combination it does not
    support."""


class OutOfTime(CaseFailed):
    """A launch stopped at its section's deadline: the budget ran out, not the case."""


@dataclass(frozen=True)
class Case:
    name: str
    section: str  # ONE or ALL
    measure: Callable[["Case", "Session"], dict]
    # train.py overrides of each launch; "{gpus}": the GPU count
    runs: tuple[tuple[str, ...], ...] = ()
    bench: tuple[tuple[str, ...], ...] = ()  # bench/handwritten.py's arguments of each launch
    # "module:function" run in a process of its own (tests/ and src/ importable)
    calls: tuple[str, ...] = ()
    baseline: Optional[str] = None  # the case whose samples/s this one's are shown against
    timeout_s: float = 60
    # A one-line refusal (exit 2) holding this text is recorded as refused, not failed; any other
    # refusal, or an error of another kind, fails the case.
    refusal: Optional[str] = None

    def overrides(self, i: int, gpus: int) -> list[str]:
        return [arg.replace("{gpus}", str(gpus)) for arg in self.runs[i]]

    def bench_args(self, i: int, gpus: int) -> list[str]:
        return [arg.replace("{gpus}", str(gpus)) for arg in self.bench[i]]


class Session:
    """One case's launches: each in a process session of its own (its workers die with it), ended
    by the case's deadline, in a scratch directory of the case's."""

    def __init__(
        self, case: Case, gpus: int, scratch: Path, case_deadline: float, section_deadline: float
    ):
        self.case, self.gpus, self.scratch = case, gpus, scratch
        self.deadline, self.cut_by_section = (
            min(case_deadline, section_deadline),
            section_deadline < case_deadline,
        )

    def command(self, cmd: list[str], what: str, check: bool = True) -> subprocess.CompletedProcess:
        timeout = self.deadline - time.monotonic()
        if timeout <= 0:
            raise (OutOfTime if self.cut_by_section else CaseFailed)(f"{what}: no time left")
        proc = subprocess.Popen(
            cmd,
            cwd=REPO,
            env=ENV,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            out, err = stop(proc)
            why = (
                f"the case's {self.case.timeout_s:.0f} s ran out"
                if not self.cut_by_section
                else "the section's time ran out"
            )
            raise (OutOfTime if self.cut_by_section else CaseFailed)(
                f"{what} stopped after {timeout:.0f} s: {why}", tail(out, err)
            ) from None
        finally:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                # a worker that outlived its launcher holds a GPU
                os.killpg(proc.pid, signal.SIGKILL)
        done = subprocess.CompletedProcess(cmd, proc.returncode, out, err)
        if check and proc.returncode != 0:
            lines = err.strip().splitlines()
            if refused_as_expected(self.case, proc.returncode, lines):
                raise Refused(lines[0])
            raise CaseFailed(
                f"{what} exited {proc.returncode}: {one_line(out, err)}", tail(out, err)
            )
        return done

    def train(
        self,
        overrides: list[str],
        run_dir: Path,
        script: str = "train.py",
        prefix: tuple[str, ...] = (),
        result: str = "summary.json",
    ) -> dict:
        """Run train.py (or eval.py) with these overrides in run_dir: its summary (eval.json)."""
        self.command(
            [*(prefix or (sys.executable,)), script, *overrides, f"hydra.run.dir={run_dir}"], script
        )
        if not (run_dir / result).exists():
            raise CaseFailed(f"{script} exited 0 without {result}")
        return json.loads((run_dir / result).read_text())

    def handwritten(self, args: list[str], name: str) -> dict:
        out = self.scratch / f"{name}.json"
        self.command(
            [sys.executable, "bench/handwritten.py", *args, str(out)], "bench/handwritten.py"
        )
        if not out.exists():
            raise CaseFailed("bench/handwritten.py exited 0 without its result file")
        return json.loads(out.read_text())


def stop(proc: subprocess.Popen) -> tuple[str, str]:
    """End a launch and what it started: SIGTERM first, on which torch.distributed.run's agent ends
    its workers (it starts them in sessions of their own), then SIGKILL. Its output so far."""
    for signum in (signal.SIGTERM, signal.SIGKILL):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signum)
        with contextlib.suppress(subprocess.TimeoutExpired):
            return proc.communicate(timeout=10)
    return "", "(output lost: a process outside its session still holds the pipe)"


def refused_as_expected(case: Case, code: int, lines: list[str]) -> bool:
    """The run was refused in one line, and with the refusal the case expects."""
    return (
        case.refusal is not None
        and code == 2
        and len(lines) == 1
        and lines[0].startswith("hydra-ddp: error:")
        and case.refusal in lines[0]
    )


def one_line(out: str, err: str) -> str:
    """The line that says why: the project's error line, else the last line on stderr (a traceback's
    exception), else on stdout."""
    err_lines, out_lines = (
        [line.strip() for line in text.splitlines() if line.strip()] for text in (err, out)
    )
    errors = [line for line in err_lines + out_lines if "hydra-ddp: error" in line]
    return (errors or err_lines or out_lines or ["no output"])[-1][:300]


def tail(out: str, err: str) -> str:
    return f"stdout: {out[-1500:]}\nstderr: {err[-1500:]}"


def figures_of(summary: dict) -> dict:
    return {key: summary[key] for key in FIGURES if key in summary}


# What each case measures and checks, given its launches (Case.runs, Case.bench).


def one_run(case: Case, run: Session) -> dict:
    """One train.py run: its throughput and start-up."""
    return figures_of(run.train(case.overrides(0, run.gpus), run.scratch / "run"))


def model_state(case: Case, run: Session) -> dict:
    """One run of a sharding strategy: its figures and the model state it holds per rank."""
    summary = run.train(case.overrides(0, run.gpus), run.scratch / "run")
    return {
        **figures_of(summary),
        "model_state_mb": summary["model_state_bytes"]["total"] / 2**20,
        "note": f"model state/rank {summary['model_state_bytes']['total'] / 2**20:.2f} MB",
    }


def parity(case: Case, run: Session) -> dict:
    """The hand-written loop and train.py in turns, A B A B: medians of 2."""
    hand, project = [], []
    for i in range(2):
        hand.append(run.handwritten(case.bench_args(0, run.gpus), f"hand{i}"))
        project.append(run.train(case.overrides(0, run.gpus), run.scratch / f"run{i}"))
    chosen = project[-1].get("settings", {})
    if chosen.get("strategy.shared_memory"):  # it sums CPU tensors: auto must leave it off on CUDA
        raise CaseFailed(f"the default run chose strategy.shared_memory on CUDA: {chosen}")
    figures = {key: statistics.median(p[key] for p in project) for key in FIGURES}
    hand_rate = statistics.median(h["steady_samples_per_sec"] for h in hand)
    ratio = figures["steady_samples_per_sec"] / hand_rate
    return {
        **figures,
        "handwritten_samples_per_sec": hand_rate,
        "parity": ratio,
        "note": f"project / hand-written samples/s {ratio:.3f}× "
        f"(hand-written {hand_rate:,.0f}; medians of 2)",
    }


def tuner(case: Case, run: Session) -> dict:
    """The tuner's last line: the fastest overrides it found."""
    knobs = "tune.knobs=[data.pin_memory,trainer.precision]"
    done = run.command(
        [
            sys.executable,
            "-m",
            "hydra_ddp.tools.tune",
            *case.overrides(0, run.gpus),
            knobs,
            "tune.precision=true",
            "tune.steps=40",
            "tune.repeats=1",
        ],
        "python -m hydra_ddp.tools.tune",
    )
    return {"note": (done.stdout.strip().splitlines() or ["no output"])[-1]}


def rank_per_gpu(case: Case, run: Session) -> dict:
    """Every rank on the GPU of its own index, as each rank's first log line says."""
    run_dir = run.scratch / "run"
    summary = run.train(case.overrides(0, run.gpus), run_dir)
    placed = dict(re.findall(r"rank (\d+)/\d+ on (\S+),", (run_dir / "train.log").read_text()))
    wanted = {str(r): f"cuda:{r}" for r in range(run.gpus)}
    if summary["world_size"] != run.gpus or placed != wanted:
        raise CaseFailed(
            f"world size {summary['world_size']}, ranks placed "
            f"{placed}; wanted rank r on cuda:r for {run.gpus} ranks"
        )
    return {**figures_of(summary), "note": f"{run.gpus} ranks, rank r on cuda:r"}


def failed_naming_rank1(done: subprocess.CompletedProcess, what: str) -> str:
    """The run's one error line, which must name rank 1 (the faulty rank) after a non-zero exit."""
    errors = [line for line in done.stderr.splitlines() if "hydra-ddp: error" in line]
    if done.returncode == 0:
        raise CaseFailed(f"the run with {what} exited 0")
    if len(errors) != 1 or "rank 1" not in errors[0]:
        raise CaseFailed(
            f"{len(errors)} error line(s), wanted one naming "
            f"rank 1: {one_line(done.stdout, done.stderr)}",
            tail(done.stdout, done.stderr),
        )
    return errors[0]


def dead_peer(case: Case, run: Session) -> dict:
    """A rank that fails at start: the launcher must end the run, naming it, long before the
    collective timeout."""
    started = time.monotonic()
    cmd = [
        sys.executable,
        "train.py",
        *case.overrides(0, run.gpus),
        f"hydra.run.dir={run.scratch / 'run'}",
    ]
    done = run.command(cmd, "train.py", check=False)
    took = time.monotonic() - started
    error = failed_naming_rank1(done, "a failing rank 1")
    others = len(done.stderr.strip().splitlines()) - 1
    return {
        "seconds_to_fail": took,
        "note": f"exit {done.returncode} after {took:.1f} s "
        f"({others} other stderr line(s)): {error[:200]}",
    }


def hung_peer(case: Case, run: Session) -> dict:
    """A rank that stops mid-run: NCCL's watchdog ends the collective after backend.timeout_s, the
    run ends in one line naming the stuck rank, and torch's flight recorder (on by default,
    runtime/hangs.py) has dumped the ranks' last collectives into RUN/stacks/nccl_trace_rank_R."""
    run_dir = run.scratch / "run"
    cmd = [sys.executable, "train.py", *case.overrides(0, run.gpus), f"hydra.run.dir={run_dir}"]
    done = run.command(cmd, "train.py", check=False)
    error = failed_naming_rank1(done, "a hung rank 1")
    stacks = run_dir / "stacks"
    dumps = (
        sorted(path.name for path in stacks.glob("nccl_trace_rank_*")) if stacks.is_dir() else []
    )
    if not dumps:
        found = sorted(path.name for path in stacks.iterdir()) if stacks.is_dir() else []
        raise CaseFailed(f"no flight-recorder dump (nccl_trace_rank_R) in {stacks}: {found}")
    return {
        "note": f"exit {done.returncode}: {error[:160]}; the "
        f"flight recorder's dumps: {', '.join(dumps)}"
    }


def step_losses(run_dir: Path) -> list[float]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    return [e.value for e in events.Scalars("train/loss")]


def same_losses(case: Case, run: Session) -> dict:
    """Two runs (runs[0] at 1 GPU, runs[1] at all) whose step losses must agree."""
    for i, name in enumerate(("one", "many")):
        run.train(case.overrides(i, run.gpus), run.scratch / name)
    one, many = step_losses(run.scratch / "one"), step_losses(run.scratch / "many")
    if not one or len(one) != len(many):
        raise CaseFailed(f"{len(one)} step losses at 1 GPU, {len(many)} at {run.gpus}")
    worst = max(abs(a - b) / abs(b) for a, b in zip(many, one))
    if worst > 1e-2:
        raise CaseFailed(
            f"step losses at 1 and {run.gpus} GPUs differ by up to {worst:.1e} relative (over 1e-2)"
        )
    return {
        "worst_relative_difference": worst,
        "note": "largest relative step-loss difference, 1 vs "
        f"{run.gpus} GPUs over {len(one)} steps: {worst:.1e}",
    }


def dp_vs_ddp(case: Case, run: Session) -> dict:
    """The hand-written loop under DDP (bench[0]) and under nn.DataParallel (bench[1])."""
    ddp, dp = (
        run.handwritten(case.bench_args(i, run.gpus), name) for i, name in enumerate(("ddp", "dp"))
    )
    speedup = ddp["steady_samples_per_sec"] / dp["steady_samples_per_sec"]
    dp_gpu0, ddp_most = dp["peak_memory_mb"][0], max(ddp["peak_memory_mb"])
    verdict = "holds" if speedup > 1 and dp_gpu0 > ddp_most else "DOES NOT HOLD"
    return {
        **figures_of(ddp),
        "ddp_over_dp_samples_per_sec": speedup,
        "dp_samples_per_sec": dp["steady_samples_per_sec"],
        "dp_peak_memory_mb": dp["peak_memory_mb"],
        "ddp_peak_memory_mb": ddp["peak_memory_mb"],
        "note": f"DDP / DataParallel samples/s {speedup:.2f}× (DP "
        f"{dp['steady_samples_per_sec']:,.0f}); GPU 0 peak {dp_gpu0:,.0f} MB under "
        f"DP, at most {ddp_most:,.0f} MB per GPU under DDP; the seeds' claim {verdict}",
    }


def resume(case: Case, run: Session) -> dict:
    """runs[0] uninterrupted; runs[1] stops halfway and runs[2] resumes it in the same directory."""
    whole, parts = run.scratch / "whole", run.scratch / "parts"
    run.train(case.overrides(0, run.gpus), whole)
    run.train(case.overrides(1, run.gpus), parts)
    resumed = run.train(case.overrides(2, run.gpus), parts)
    if not resumed.get("resumed_from"):
        raise CaseFailed("the second half did not resume (summary: resumed_from is empty)")
    a, b = (
        torch.load(d / "checkpoints" / "last.pt", map_location="cpu", weights_only=True)["model"]
        for d in (whole, parts)
    )
    worst = max((a[k].double() - b[k].double()).abs().max().item() for k in a)
    if worst > 1e-4:
        raise CaseFailed(
            f"resumed weights differ from the uninterrupted run's by up to {worst:.1e} (over 1e-4)"
        )
    return {
        "max_weight_difference": worst,
        "note": f"resumed at {resumed['resumed_from']}: final weights "
        f"{'bitwise equal to' if worst == 0 else f'within {worst:.1e} of'} the uninterrupted run's",
    }


def evaluate(case: Case, run: Session) -> dict:
    """A run, then eval.py ckpt=RUN_DIR: its test figures must be the run's own."""
    run_dir = run.scratch / "run"
    summary = run.train(case.overrides(0, run.gpus), run_dir)
    result = run.train(
        [f"ckpt={run_dir}"], run.scratch / "eval", script="eval.py", result="eval.json"
    )
    loss_gap = abs(result["test_loss"] - summary["test_loss"]) / abs(summary["test_loss"])
    if result["test_accuracy"] != summary["test_accuracy"] or loss_gap > 1e-5:
        raise CaseFailed(
            f"eval.py: test accuracy {result['test_accuracy']}, loss {result['test_loss']}; "
            f"the run's {summary['test_accuracy']}, {summary['test_loss']}"
        )
    return {
        "note": f"eval.py on {result['world_size']} GPU(s): test "
        f"accuracy {result['test_accuracy']:.4f}, the run's own"
    }


def outside_launcher(case: Case, run: Session) -> dict:
    prefix = (
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={run.gpus}",
    )
    summary = run.train(case.overrides(0, run.gpus), run.scratch / "run", prefix=prefix)
    if summary["world_size"] != run.gpus:
        raise CaseFailed(
            f"world size {summary['world_size']} under torch.distributed.run, wanted {run.gpus}"
        )
    return {
        **figures_of(summary),
        "note": f"{summary['world_size']} ranks, launcher {summary.get('launcher')}",
    }


def calls(case: Case, run: Session) -> dict:
    """Each of the case's functions in a process of its own: it asserts, and its last line is the
    note."""
    notes = []
    for call in case.calls:
        module, function = call.split(":")
        done = run.command([sys.executable, "-c", f"import {module}; {module}.{function}()"], call)
        notes.append((done.stdout.strip().splitlines() or ["ok"])[-1])
    return {"note": "; ".join(notes)}


def powersgd(case: Case, run: Session) -> dict:
    summary = run.train(case.overrides(0, run.gpus), run.scratch / "run")
    if summary.get("comm_hook") != "powersgd":
        raise CaseFailed(f"the summary's comm_hook is {summary.get('comm_hook')!r}, not powersgd")
    return {**figures_of(summary), "note": f"train loss {summary['train_loss']:.4f}"}


DEFAULTS, NCCL_ALL = (
    "CNN, defaults (parity with hand-written)",
    "CNN, DDP over NCCL, rank r on cuda:r",
)
CNN_ONE = (*CNN, ONE_RANK, "trainer.max_steps=200")
GPT_ONE = (*GPT, ONE_RANK, "trainer.max_steps=60")
RESUMABLE = (*CNN, EVERY_GPU, "checkpoint.every_n_steps=20")
CASES = [
    # The step timer's CUDA-event clock against a synchronised host clock
    # (tests/unit/test_timing.py).
    Case("the stream clock", ONE, calls, calls=("unit.test_timing:cuda_check",)),
    Case(DEFAULTS, ONE, parity, runs=(CNN_ONE,), bench=((*HAND_CNN, "--nproc=1"),), timeout_s=150),
    Case("CNN, auto settings off", ONE, one_run, runs=((*CNN_ONE, *AUTO_OFF),), baseline=DEFAULTS),
    Case(
        "CNN, start_method=spawn",
        ONE,
        one_run,
        runs=((*CNN_ONE, "launcher.start_method=spawn"),),
        baseline=DEFAULTS,
    ),
    Case(
        "CNN, comm_hook=fp16",
        ONE,
        one_run,
        runs=((*CNN_ONE, "strategy.comm_hook=fp16"),),
        baseline=DEFAULTS,
    ),
    # GradScaler's unscale before clipping runs only on the GPU (fp16): it must train and log.
    Case(
        "CNN, fp16 + grad_clip=1",
        ONE,
        one_run,
        runs=((*CNN_ONE, "trainer.precision=16", "trainer.grad_clip=1.0"),),
        baseline=DEFAULTS,
    ),
    Case(
        "CNN, FSDP2 bf16 + grad_clip=1",
        ONE,
        model_state,
        baseline=DEFAULTS,
        runs=(
            (
                *CNN_ONE,
                "strategy=fsdp",
                "strategy.param_dtype=bf16",
                "strategy.reduce_dtype=fp32",
                "trainer.grad_clip=1.0",
            ),
        ),
    ),
    # DTensor, DCP checkpoints and the global-norm clipping on CUDA (tensor parallel on a one-rank
    # mesh).
    *(
        Case(
            f"GPT, strategy={name}",
            ONE,
            model_state,
            runs=((*GPT_ONE, f"strategy={name}"),),
            baseline=None if name == "ddp" else "GPT, strategy=ddp",
            timeout_s=90,
        )
        for name in ("ddp", "fsdp", "tp")
    ),
    Case(
        "ResNet-50 bf16, auto settings off",
        ONE,
        one_run,
        runs=((*RESNET50, ONE_RANK, *AUTO_OFF),),
        timeout_s=90,
    ),
    Case(
        "ResNet-50 bf16, defaults",
        ONE,
        one_run,
        runs=((*RESNET50, ONE_RANK),),
        baseline="ResNet-50 bf16, auto settings off",
        timeout_s=90,
    ),
    Case("tuner: pin_memory, precision (CNN)", ONE, tuner, runs=((*CNN, ONE_RANK),), timeout_s=120),
    Case(
        "ResNet-50 bf16 + torch.compile",
        ONE,
        one_run,
        runs=((*RESNET50, ONE_RANK, "trainer.compile=true"),),
        baseline="ResNet-50 bf16, auto settings off",
        timeout_s=180,
    ),
    Case(
        NCCL_ALL,
        ALL,
        rank_per_gpu,
        runs=((*CNN, EVERY_GPU, "trainer.max_steps=200"),),
        baseline=DEFAULTS,
    ),
    Case(
        "a dead peer: rank 1 fails at start",
        ALL,
        dead_peer,
        runs=(
            (
                *CNN,
                EVERY_GPU,
                "trainer.max_steps=200",
                "model._target_=faulty.FailOnRank",
                "+model.fail_rank=1",
            ),
        ),
    ),
    Case(
        "a hung peer: NCCL's flight recorder dumps",
        ALL,
        hung_peer,
        runs=(
            (
                *CNN,
                EVERY_GPU,
                "trainer.max_steps=200",
                "backend.timeout_s=20",
                "model._target_=faulty.HangOnRank",
                "+model.hang_rank=1",
            ),
        ),
        timeout_s=90,
    ),
    Case(
        "ResNet-18 + SyncBatchNorm, 1 GPU vs all",
        ALL,
        same_losses,
        runs=((*SYNC_BN, ONE_RANK), (*SYNC_BN, EVERY_GPU)),
        timeout_s=120,
    ),
    Case(
        "DDP vs DataParallel, CNN (hand-written)",
        ALL,
        dp_vs_ddp,
        timeout_s=120,
        bench=(
            (*HAND_CNN, "--nproc={gpus}", "--parallel=ddp"),
            (*HAND_CNN, "--nproc={gpus}", "--parallel=dp"),
        ),
    ),
    Case(
        "resume on CUDA: 20 + 20 steps vs 40",
        ALL,
        resume,
        timeout_s=150,
        runs=(
            (*RESUMABLE, "trainer.max_steps=40"),
            (*RESUMABLE, "trainer.max_steps=20"),
            (*RESUMABLE, "trainer.max_steps=40", "trainer.resume=auto"),
        ),
    ),
    Case(
        "eval.py ckpt=RUN_DIR",
        ALL,
        evaluate,
        runs=((*RESUMABLE, "trainer.max_steps=20"),),
        timeout_s=90,
    ),
    Case(
        "outside launcher: torch.distributed.run",
        ALL,
        outside_launcher,
        runs=((*CNN, "trainer.max_steps=100"),),
    ),
    Case(
        "PowerSGD",
        ALL,
        powersgd,
        baseline=NCCL_ALL,
        runs=(
            (
                *CNN,
                EVERY_GPU,
                "trainer.max_steps=100",
                "strategy.comm_hook=powersgd",
                "strategy.powersgd.start_step=10",
            ),
        ),
    ),
    Case(
        "GPT, FSDP2 + CPU offload",
        ALL,
        model_state,
        timeout_s=90,
        runs=(
            (*GPT, EVERY_GPU, "trainer.max_steps=40", "strategy=fsdp", "strategy.cpu_offload=true"),
        ),
    ),
    Case(
        "CNN, FSDP2 fp16",
        ALL,
        one_run,
        refusal="strategy.param_dtype=fp16 would need loss scaling",
        runs=(
            (
                *CNN,
                EVERY_GPU,
                "trainer.max_steps=100",
                "strategy=fsdp",
                "strategy.param_dtype=fp16",
            ),
        ),
    ),
    Case(
        "DDP vs DataParallel, ResNet-18 224² bf16 (hand-written)",
        ALL,
        dp_vs_ddp,
        timeout_s=120,
        bench=((*HAND_RESNET, "--parallel=ddp"), (*HAND_RESNET, "--parallel=dp")),
    ),
]


@dataclass
class Result:
    name: str
    section: str
    status: str  # ok, failed, refused, skipped, running
    seconds: float = 0.0
    reason: str = ""
    baseline: Optional[str] = None
    figures: dict = field(default_factory=dict)
    detail: str = ""  # a failure's output tail (JSON only)


def run_case(case: Case, gpus: int) -> Result:
    section_deadline, now = START + DEADLINE_S[case.section], time.monotonic()
    if case.section == ALL and gpus < 2:
        return Result(
            case.name, case.section, "skipped", reason=f"needs 2 or more GPUs; {gpus} here"
        )
    if section_deadline - now < MIN_START_S:
        return Result(
            case.name,
            case.section,
            "skipped",
            reason=f"out of time: the section ends {DEADLINE_S[case.section]} s after the start",
        )
    result = Result(case.name, case.section, "ok", baseline=case.baseline)
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as scratch:
        session = Session(case, gpus, Path(scratch), now + case.timeout_s, section_deadline)
        try:
            result.figures = case.measure(case, session)
        except OutOfTime as cut:
            result.status, result.reason, result.detail = (
                "skipped",
                f"out of time: {cut}",
                cut.detail,
            )
        except Refused as refusal:
            result.status, result.reason = "refused", str(refusal)
        except CaseFailed as failure:
            result.status, result.reason, result.detail = "failed", str(failure), failure.detail
        except Exception as error:  # noqa: BLE001  (a broken measurement fails its case, not the check)
            result.status, result.reason = (
                "failed",
                f"{type(error).__name__}: {str(error).strip()[:300]}",
            )
            result.detail = traceback.format_exc()[-3000:]
    result.seconds = time.monotonic() - now
    return result


def host() -> dict:
    return {
        "gpu": torch.cuda.get_device_name(0),
        "gpus": torch.cuda.device_count(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cpu_cores": os.cpu_count(),
        # where "every record ran CPython 3.11" is checked (docs/releases.md)
        "python": platform.python_version(),
        "os": platform.platform(),
        "date": time.strftime("%Y-%m-%d %H:%M"),
        # The GPU machine gets a copy of the tree without .git: the caller names the commit it sent.
        "commit": os.environ.get("BENCH_COMMIT") or provenance.stamp(),
    }


def markdown(about: dict, results: list[Result]) -> str:
    by_name = {r.name: r for r in results}
    lines = [
        f"# GPU check: {about['gpu']} × {about['gpus']}, torch "
        f"{about['torch']} (CUDA {about['cuda']}), {about['cpu_cores']} "
        f"CPU cores, Python {about['python']} on {about['os']}, {about['date']}, "
        f"commit `{about['commit']}`",
        "",
        "Absolute figures vary between machines; compare the ratios. One-GPU cases run one rank.",
        "",
        "| case | section | status | samples/s | vs baseline | "
        "median step ms | first step s | peak RSS MB | s | notes |",
        "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for r in results:
        f = r.figures
        rate, base = f.get("steady_samples_per_sec"), by_name.get(r.baseline)
        base_rate = base.figures.get("steady_samples_per_sec") if base else None
        cells = [
            f"{rate:,.0f}" if rate else "",
            f"{rate / base_rate:.2f}× {r.baseline}" if rate and base_rate else "",
            f"{f['median_step_time_s'] * 1000:.2f}" if "median_step_time_s" in f else "",
            f"{f['time_to_first_step_s']:.1f}" if "time_to_first_step_s" in f else "",
            f"{f['peak_rss_mb']:.0f}" if "peak_rss_mb" in f else "",
        ]
        notes = r.reason or f.get("note", "")
        lines.append(
            f"| {r.name} | {r.section} | {r.status} | "
            f"{' | '.join(cells)} | {r.seconds:.0f} | {notes} |"
        )
    return "\n".join(lines) + "\n"


def write(about: dict, results: list[Result]) -> None:
    """Both result files, whole, again: what a kill leaves is every case finished so far."""
    report = {
        "host": about,
        "deadlines_s": DEADLINE_S,
        "failed": sum(r.status == "failed" for r in results),
        "cases": [asdict(r) for r in results],
    }
    OUT.mkdir(parents=True, exist_ok=True)
    for name, text in (
        ("gpu_check.md", markdown(about, results)),
        ("gpu_check.json", json.dumps(report, indent=2)),
    ):
        (OUT / f"{name}.tmp").write_text(text + ("" if text.endswith("\n") else "\n"))
        # a kill mid-write leaves the previous file whole
        os.replace(OUT / f"{name}.tmp", OUT / name)


def check_on_gpus(cases: list[Case]) -> int:
    gpus, about = torch.cuda.device_count(), host()
    print(
        f"GPU check: {about['gpu']} × {gpus}; results in {OUT}/gpu_check.md and .json", flush=True
    )
    results: list[Result] = []
    for case in cases:
        write(
            about,
            [
                *results,
                Result(case.name, case.section, "running", reason="a kill ended the check here"),
            ],
        )
        results.append(run_case(case, gpus))
        write(about, results)
        r = results[-1]
        print(
            f"{r.status:8} {r.seconds:5.0f} s  {r.name}: {r.reason or r.figures.get('note', '')}",
            flush=True,
        )
    failed = [r.name for r in results if r.status == "failed"]
    print(
        f"GPU check done in {time.monotonic() - START:.0f} s: "
        f"{len(failed)} failed{f': {failed}' if failed else ''}"
    )
    return 1 if failed else 0


# The dry run: every launch of every case checked on the CPU, nothing launched.


def handwritten_module():
    spec = importlib.util.spec_from_file_location("handwritten", REPO / "bench" / "handwritten.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@contextlib.contextmanager
def rank_zero_group():
    """A one-process gloo group, so that a test model that asks its rank when built
    (faulty.FailOnRank) is built as rank 0 would build it."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def dry_run(cases: list[Case]) -> int:
    """Check every case's launches as the GPU host would run them, one line each; the number of
    problems."""
    names = [case.name for case in cases]
    # --only leaves a case's baseline out, not undefined
    known = {case.name for case in (*CASES, *cases)}
    problems = [
        f"case named twice: {name}" for name in sorted({n for n in names if names.count(n) > 1})
    ]
    problems += [
        f"{case.name}: baseline {case.baseline!r} is no case"
        for case in cases
        if case.baseline and case.baseline not in known
    ]
    handwritten, checks = handwritten_module(), 0
    with rank_zero_group(), tempfile.TemporaryDirectory(prefix="gpu-check-dry-") as scratch:
        for case in cases:
            for gpus in DRY_RUN_GPUS[case.section]:
                for i in range(len(case.runs)):
                    checks += 1
                    what = f"{case.name} [{gpus} GPU(s)] train.py launch {i + 1}/{len(case.runs)}"
                    problems += report(
                        what, check_train(case, i, gpus, Path(scratch) / f"run{checks}")
                    )
                for call in case.calls:
                    checks += 1
                    problems += report(f"{case.name} [{gpus} GPU(s)] {call}", check_call(call))
                for i in range(len(case.bench)):
                    checks += 1
                    what = (
                        f"{case.name} [{gpus} GPU(s)] bench/handwritten.py "
                        f"launch {i + 1}/{len(case.bench)}"
                    )
                    problems += report(what, check_bench(handwritten, case.bench_args(i, gpus)))
    for problem in problems:
        print(f"dry-run FAILED: {problem}", flush=True)
    print(
        f"dry-run: {checks} launch checks over {len(cases)} cases, {len(problems)} problem(s)",
        flush=True,
    )
    return len(problems)


def report(what: str, verdict: tuple[bool, str]) -> list[str]:
    """Print a good launch's line; a bad one is a problem, listed at the end."""
    good, line = verdict
    if good:
        print(f"dry-run ok: {what}: {line}", flush=True)
    return [] if good else [f"{what}: {line}"]


def check_train(case: Case, i: int, gpus: int, run_dir: Path) -> tuple[bool, str]:
    """train.py --check --gpus=N of launch i, in process: (good, its line)."""
    from hydra_ddp.errors import UserError
    from hydra_ddp.tools import preflight

    said = io.StringIO()
    try:
        with contextlib.redirect_stdout(said):
            preflight.check(CONF, case.overrides(i, gpus), run_dir, gpus=gpus)
    except UserError as error:
        line = f"hydra-ddp: error: {error}"
        expected = refused_as_expected(case, 2, [line])
        return expected, f"{'refused: ' if expected else ''}{line}"
    except Exception as error:  # noqa: BLE001  (Hydra's composition errors, among others)
        return False, f"{type(error).__name__}: {(str(error).strip().splitlines() or [''])[0]}"
    return True, said.getvalue().strip()


def check_call(call: str) -> tuple[bool, str]:
    """The function a case calls imports here (it runs only on a GPU): (good, its line)."""
    module, _, function = call.partition(":")
    try:
        found = callable(getattr(importlib.import_module(module), function, None))
    except Exception as error:  # noqa: BLE001
        return False, f"{type(error).__name__}: {error}"
    return found, "imports" if found else f"{module} has no function {function}"


def check_bench(handwritten, args: list[str]) -> tuple[bool, str]:
    """bench/handwritten.py's own parser on the arguments: (good, its line)."""
    with contextlib.redirect_stderr(io.StringIO()) as said:
        try:
            handwritten.parse_args([*args, "result.json"])
        except SystemExit:
            return False, (said.getvalue().strip().splitlines() or ["bad arguments"])[-1]
    return True, "arguments parse"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="check every case's config on the CPU, launch nothing",
    )
    parser.add_argument(
        "--only",
        action="append",
        default=[],
        metavar="TEXT",
        help="only cases whose name holds TEXT",
    )
    args = parser.parse_args()
    cases = [
        case for case in CASES if not args.only or any(text in case.name for text in args.only)
    ]
    if args.dry_run:
        return 1 if dry_run(cases) else 0
    if not torch.cuda.is_available():
        print(
            "gpu_check: no CUDA GPU visible (--dry-run checks the cases on the CPU)",
            file=sys.stderr,
        )
        return 2
    return check_on_gpus(cases)


if __name__ == "__main__":
    sys.exit(main())
