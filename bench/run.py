"""`make bench`: the project's train.py against a DDP loop written by hand (plain, and tuned), the
default run, world-size scaling, options, and the limit: the same processes without communication.

    .venv/bin/python bench/run.py                 # 3 repetitions × 200 steps of every configuration
    .venv/bin/python bench/run.py --quick         # a smoke test of the harness: 1 × 20 steps
    # one section (parity, default, scaling, options, comm, checkpoint, strategy, strategy_gpt,
    # ceiling, ceiling_gpt):
    .venv/bin/python bench/run.py --only comm
    # one line, beside its reference:
    .venv/bin/python bench/run.py --only options --cases timing --out /tmp/bench
    make bench ARGS="--reps 5 --steps 500 --out /tmp/bench"
    # make train, then and now:
    .venv/bin/python bench/run.py --only default --reps 7 --against a88e844

Prints the report and writes it to OUT/REPORT.md (replaced each time; --report names another
file, so that an --only run leaves a full report beside it whole), with every run's figures in
OUT/<timestamp>.json. Run it on a quiet machine: it measures wall-clock time.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from importlib.metadata import version
from pathlib import Path
from typing import Any, Optional

import provenance

import report
from measure import (
    FLOORS,
    METRICS,
    REPO,
    BenchError,
    Case,
    Workload,
    command,
    measure,
    measure_floor,
    printable,
)

# Performance options: sets of project overrides, measured at 2 ranks against the first.
# Add a line to measure another.
OPTIONS: dict[str, tuple[str, ...]] = {
    "defaults (threads = cores ÷ ranks)": ("trainer.threads=null",),
    "threads=2 per rank": ("trainer.threads=2",),
    "data.preload (tensor batches)": ("data.preload=true",),
    "precision=bf16": ("trainer.precision=bf16",),
    "accumulate=2 (no_sync)": ("trainer.accumulate=2",),
    # The fast settings `auto` turns on (performance.py, parallel/strategies/ddp.py), turned off one
    # by one.
    "ddp: bucket view + static graph off": (
        "strategy.gradient_as_bucket_view=false",
        "strategy.static_graph=false",
    ),
    "channels_last off": ("trainer.channels_last=false",),
    "shared memory off (gloo's all-reduce)": ("strategy.shared_memory=false",),
    "num_workers=1": ("data.num_workers=1", "data.persistent_workers=true"),
    "torch.compile (inductor)": ("trainer.compile=true",),
    # What the per-rank timing (src/hydra_ddp/training/meter.py) costs: the defaults have it on.
    "per-rank timing off": ("trainer.timing=false",),
}

# DDP communication hooks (src/hydra_ddp/parallel/comm.py), at 2 ranks against DDP's own all-reduce
# through gloo.
COMM_HOOKS = ("fp16", "bf16")

# Mid-run checkpoints (rank 0 snapshots at the step boundary, a thread writes): every N steps.
CHECKPOINT_EVERY = 20

# Every setting `auto` chooses, turned off: the project as it ran before they became defaults.
AUTO_OFF = (
    "trainer.channels_last=false",
    "strategy.gradient_as_bucket_view=false",
    "strategy.static_graph=false",
    "strategy.shared_memory=false",
)

DEFAULT_OUT = Path(__file__).resolve().parent / "results"


def world_sizes(cores: int) -> list[int]:
    """1, 2, 4, … up to the core count (1 and 2 on any machine)."""
    sizes = [1, 2]
    while sizes[-1] * 2 <= cores:
        sizes.append(sizes[-1] * 2)
    return sizes


def plan(cores: int) -> dict[str, list[Case]]:
    """Each section's cases, its reference first."""
    return {
        "parity": [
            Case("hand-written", "handwritten"),
            # The same loop with the stock one-liners the project turns on (channels_last, DDP's
            # gradient_as_bucket_view and static_graph, a forkserver): the second reference.
            Case("expert (hand-tuned)", "expert"),
            Case("project (train.py)", "project"),
            Case("project, launcher=torchrun", "project", overrides=("launcher=torchrun",)),
            # Workers as fresh interpreters, as before the forkserver (startup.py): what it saves.
            Case(
                "project, start_method=spawn", "project", overrides=("launcher.start_method=spawn",)
            ),
            Case("project, auto settings off", "project", overrides=AUTO_OFF),
            # A multirun's later job: the parent and the forkserver are there already.
            Case("project, a sweep's second job", "sweep"),
        ],
        # `make train` as a user runs it: its wall time against its training time, beside the same
        # work written by hand.
        "default": [
            Case("hand-written (bench/handwritten_train.py)", "handwritten_train"),
            Case("make train (the default run)", "default"),
        ],
        "scaling": [Case(f"nproc={n}", "project", nproc=n) for n in world_sizes(cores)],
        "options": [
            Case(label, "project", overrides=overrides) for label, overrides in OPTIONS.items()
        ],
        # A hook replaces the shared-memory all-reduce: each is compared with gloo's, and the
        # default last.
        "comm": [
            Case(
                "comm_hook=none, gloo's all-reduce",
                "project",
                overrides=("strategy.shared_memory=false",),
            )
        ]
        + [
            Case(f"comm_hook={hook}", "project", overrides=(f"strategy.comm_hook={hook}",))
            for hook in COMM_HOOKS
        ]
        + [
            Case(
                "comm_hook=powersgd (rank 1, from step 0)",
                "project",
                overrides=("strategy.comm_hook=powersgd", "strategy.powersgd.start_step=0"),
            ),
            Case("comm_hook=none, shared memory (the default)", "project"),
        ],
        "checkpoint": [
            Case("a checkpoint at the end only", "project"),
            Case(
                f"a checkpoint every {CHECKPOINT_EVERY} steps",
                "project",
                overrides=(f"checkpoint.every_n_steps={CHECKPOINT_EVERY}",),
            ),
        ],
        "strategy": [
            Case("ddp", "project"),
            Case("ddp, channels_last off", "project", overrides=("trainer.channels_last=false",)),
            Case("fsdp", "project", overrides=("strategy=fsdp",)),
            Case(
                "fsdp, reshard_after_forward=false",
                "project",
                overrides=("strategy=fsdp", "strategy.reshard_after_forward=false"),
            ),
        ],
        "strategy_gpt": [
            Case(f"gpt: {name}", "project", overrides=(f"strategy={name}",), task="text")
            for name in ("ddp", "fsdp", "tp")
        ],
        # The limit: the same processes without communicating (bench/ceiling.py), and what reaches
        # it.
        "ceiling": [
            Case("ceiling (2 processes, no communication)", "ceiling"),
            # What moving in step costs by itself: the ceiling's processes meet after each backward.
            Case("ceiling in lockstep (a barrier per step)", "lockstep"),
            # The least a synchronous step adds: lockstep and the gradients averaged, without DDP or
            # a loop.
            Case("ceiling with the exchange (lockstep, gradients averaged)", "exchange"),
            Case("project (train.py)", "project"),
            Case("expert (hand-tuned)", "expert"),
            Case("hand-written", "handwritten"),
        ],
        "ceiling_gpt": [
            Case("gpt: ceiling (2 processes, no communication)", "ceiling", task="text"),
            Case("gpt: project (train.py)", "project", task="text"),
        ],
    }


# The ceiling's paired ratios are the acceptance figures of the compute-ceiling work: at least 7
# pairs.
CEILING_REPS = 7
CEILING_SECTIONS = ("ceiling", "ceiling_gpt")


def run_section(
    name: str,
    cases: list[Case],
    workload: Workload,
    reps: int,
    floors: Optional[dict[str, list[float]]] = None,
) -> list[dict[str, Any]]:
    """Every case once per repetition, interleaved, so drift in the machine hits all alike: in the
    listed order, then reversed (A B C, C B A, …), so a case's distance in time from the reference
    evens out too, and a drift over a pair of repetitions cancels in the paired ratios (report.py).
    `floors`: also time each of FLOORS once per repetition, appending to its list here."""
    runs: dict[str, list[dict[str, Any]]] = {case.label: [] for case in cases}
    for rep in range(1, reps + 1):
        for key, times in (floors or {}).items():
            times.append(measure_floor(FLOORS[key]))
            print(
                f"[{name} {rep}/{reps}] floor: {FLOORS[key]}  {times[-1]:5.2f} s",
                file=sys.stderr,
                flush=True,
            )
        for case in cases if rep % 2 else cases[::-1]:
            result = measure(case, workload)
            runs[case.label].append(result)
            print(
                f"[{name} {rep}/{reps}] {case.label:<30} "
                f"{result['steady_samples_per_sec']:6.0f} samples/s  step "
                f"{result['median_step_time_s'] * 1000:6.1f} ms  first step "
                f"{result['time_to_first_step_s']:5.2f} s  RSS {result['peak_rss_mb']:4.0f} MB",
                file=sys.stderr,
                flush=True,
            )
    reference = medians(runs[cases[0].label])
    summary = []
    for case in cases:
        median = medians(runs[case.label])
        summary.append(
            {
                "label": case.label,
                "side": case.side,
                "nproc": case.nproc,
                "overrides": list(case.overrides),
                "command": printable(command(case, workload, Path("RUN_DIR"))[0]),
                "runs": runs[case.label],
                "median": median,
                "allreduce_bytes_per_step": runs[case.label][0].get("allreduce_bytes_per_step"),
                "model_state_bytes": runs[case.label][0].get("model_state_bytes"),
                "checkpoints": runs[case.label][0].get("checkpoints"),
                "checkpoint_stall_s": statistics.median(
                    run["checkpoint_stall_s"] or 0.0 for run in runs[case.label]
                ),
                "vs_reference": None if case is cases[0] else compare(median, reference),
                "against": case.repo is not None,  # the project at another commit (--against)
            }
        )
    return summary


def run_default(cases: list[Case], workload: Workload, reps: int) -> list[dict[str, Any]]:
    """The default run and its hand-written counterpart, `reps` times, interleaved: where their wall
    time goes besides training, from what they report. Each repetition follows a timing of the
    collector-off floor, so the runs are compared with it at the same moment (the machine's speed
    drifts between the sections)."""
    runs: dict[str, list[dict[str, Any]]] = {case.label: [] for case in cases}
    for rep in range(1, reps + 1):
        floor = measure_floor(FLOORS["startup_floor_gc_off"])
        for case in cases if rep % 2 else cases[::-1]:
            result = {**measure(case, workload), "floor_s": floor}
            runs[case.label].append(result)
            print(
                f"[default {rep}/{reps}] {case.label}: wall {result['wall_time_s']:5.2f} "
                f"s  training {result['train_time_s']:5.2f} s  first step "
                f"{result['time_to_first_step_s']:5.2f} s  floor {floor:5.2f} s",
                file=sys.stderr,
                flush=True,
            )
    summary = []
    for case in cases:
        case_runs = runs[case.label]
        figures = (
            "wall_time_s",
            "train_time_s",
            "time_to_first_step_s",
            "eval_time_s",
            "checkpoint_time_s",
            "floor_s",
        )
        median = {
            figure: statistics.median(run[figure] for run in case_runs)
            if case_runs[0][figure] is not None
            else None
            for figure in figures
        }
        median["beyond_training_s"] = statistics.median(
            run["wall_time_s"] - run["train_time_s"] for run in case_runs
        )
        # What the run adds to importing torch: the same difference less the floor timed just
        # before.
        median["beyond_floor_s"] = statistics.median(
            run["wall_time_s"] - run["train_time_s"] - run["floor_s"] for run in case_runs
        )
        summary.append(
            {
                "label": case.label,
                "side": case.side,
                "command": printable(command(case, workload, Path("RUN_DIR"))[0]),
                "runs": case_runs,
                "median": median,
                "checkpoints": case_runs[0]["checkpoints"],
                "against": case.repo is not None,  # make train at another commit (--against)
            }
        )
    return summary


def medians(runs: list[dict[str, Any]]) -> dict[str, float]:
    return {metric: statistics.median(run[metric] for run in runs) for metric in METRICS}


def compare(m: dict[str, float], reference: dict[str, float]) -> dict[str, float]:
    return {
        "throughput_ratio": m["steady_samples_per_sec"] / reference["steady_samples_per_sec"],
        "step_time_ratio": m["median_step_time_s"] / reference["median_step_time_s"],
        "startup_difference_s": m["time_to_first_step_s"] - reference["time_to_first_step_s"],
        "rss_ratio": m["peak_rss_mb"] / reference["peak_rss_mb"],
    }


def machine() -> dict[str, Any]:
    return {
        "cpu": provenance.cpu_model(),
        "cpu_count": os.cpu_count(),
        "usable_cores": len(os.sched_getaffinity(0)),
        "torch": version("torch"),  # not imported: the harness itself stays light
        "python": platform.python_version(),
        "platform": platform.platform(),
    }


def save(
    results: dict[str, Any], text: str, out_dir: Path, stamp: str, report_name: str = "REPORT.md"
) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    files = {
        out_dir / f"{stamp}.json": json.dumps(results, indent=2) + "\n",
        out_dir / report_name: text,
    }
    for path, content in files.items():
        tmp = path.with_name(path.name + ".tmp")  # a crash never leaves half a file
        tmp.write_text(content)
        tmp.replace(path)
    return list(files)


def positive_int(value: str) -> int:
    if not value.isdigit() or int(value) < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value!r}")
    return int(value)


def parse_args(argv: Optional[list[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--reps",
        type=positive_int,
        help="repetitions of each configuration (default 3; --quick: 1)",
    )
    parser.add_argument(
        "--parity-reps",
        type=positive_int,
        help="repetitions in the parity section (default: --reps). Its ratios "
        "against the hand-written loop are the acceptance figures, and "
        "one run's samples/s varies by ±10%% here between processes of "
        "the same command: more repetitions steady their medians",
    )
    parser.add_argument(
        "--ceiling-reps",
        type=positive_int,
        help=f"repetitions in the ceiling sections (default {CEILING_REPS}, or --reps where "
        "more; --quick: 1): each is a pair, the project and its ceiling back to back",
    )
    parser.add_argument(
        "--gpt-steps",
        type=positive_int,
        help="training steps per run of the transformer's "
        "ceiling section (default: half of --steps)",
    )
    parser.add_argument(
        "--steps", type=positive_int, help="training steps per run (default 200; --quick: 20)"
    )
    parser.add_argument(
        "--against",
        metavar="COMMIT",
        help="the default section also runs `make train` at this commit (a worktree "
        "of it, its own src), in turns with today's: is the first step as soon, "
        "the wall time no longer? The ceiling section runs the project at that "
        "commit too: what the changes since bought, as a share of the ceiling",
    )
    parser.add_argument("--quick", action="store_true", help="a tiny run to smoke-test the harness")
    parser.add_argument(
        "--only",
        nargs="+",
        choices=[
            "parity",
            "default",
            "scaling",
            "options",
            "comm",
            "checkpoint",
            "strategy",
            "strategy_gpt",
            "ceiling",
            "ceiling_gpt",
        ],
        help="run these sections only (default: all)",
    )
    parser.add_argument(
        "--cases",
        nargs="+",
        metavar="TEXT",
        help="only the cases whose label contains one of these (a section's reference always runs)",
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=DEFAULT_OUT,
        help=f"results folder (default {DEFAULT_OUT.relative_to(REPO)})",
    )
    parser.add_argument(
        "--report",
        default="REPORT.md",
        metavar="NAME",
        help="the report's file name in --out (default REPORT.md; e.g. PARITY.md for an --only run "
        "beside a full report)",
    )
    args = parser.parse_args(argv)
    args.reps = args.reps or (1 if args.quick else 3)
    args.parity_reps = args.parity_reps or args.reps
    args.ceiling_reps = args.ceiling_reps or (1 if args.quick else max(CEILING_REPS, args.reps))
    args.steps = args.steps or (20 if args.quick else 200)
    args.gpt_steps = args.gpt_steps or max(20, args.steps // 2)
    return args


def checkout(commit: str, stack: contextlib.ExitStack) -> dict[str, str]:
    """A worktree of `commit` in a temporary folder, removed when the bench ends."""
    git = ["git", "-C", str(REPO)]
    resolved = subprocess.run(
        [*git, "rev-parse", "--short", f"{commit}^{{commit}}"], capture_output=True, text=True
    )
    if resolved.returncode:
        raise SystemExit(f"bench: error: --against {commit}: not a commit of this repository")
    short = resolved.stdout.strip()
    path = (
        Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="hydra-ddp-against-"))) / short
    )
    subprocess.run([*git, "worktree", "add", "--quiet", "--detach", str(path), short], check=True)
    stack.callback(subprocess.run, [*git, "worktree", "remove", "--force", str(path)], check=False)
    return {"commit": short, "path": str(path)}


def main(argv: Optional[list[str]] = None) -> int:
    with contextlib.ExitStack() as stack:
        return _main(argv, stack)


def _main(argv: Optional[list[str]], stack: contextlib.ExitStack) -> int:
    args = parse_args(argv)
    # Each run has a session of its own; SIGTERM becomes SystemExit so measure() can end the run
    # too.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    workload = Workload(steps=args.steps)
    now = time.localtime()
    results: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z", now),
        "commit": provenance.stamp(),
        "invocation": shlex.join(["bench/run.py", *(argv if argv is not None else sys.argv[1:])]),
        "quick": args.quick,
        "reps": args.reps,
        "parity_reps": args.parity_reps,
        "ceiling_reps": args.ceiling_reps,
        # each section's cases, repetition by repetition (run_section)
        "order": "forward, reversed",
        "machine": machine(),
        "workload": {**asdict(workload), "warmup_steps": workload.warmup_steps},
        "sections": {},
    }
    m = results["machine"]
    print(
        f"{m['cpu_count']} cores ({m['usable_cores']} usable), torch {m['torch']}: "
        f"{args.reps} repetition(s) × {args.steps} steps",
        file=sys.stderr,
    )
    if args.against:
        results["against"] = against = checkout(args.against, stack)
    try:
        for name, cases in plan(m["usable_cores"]).items():
            if args.against:  # the same command at that commit, in turns with today's
                at, path = against["commit"], against["path"]
                if name == "default":
                    cases = [*cases, Case(f"make train at {at}", "default", repo=path)]
                if name == "ceiling":
                    cases = [*cases, Case(f"project (train.py) at {at}", "project", repo=path)]
            # the first case is the section's reference: the others are measured against it
            if args.cases:
                cases = cases[:1] + [
                    c for c in cases[1:] if any(text in c.label for text in args.cases)
                ]
            if args.only and name not in args.only:
                continue
            if name == "default":
                results["sections"][name] = run_default(cases, workload, args.reps)
            elif name == "parity" and len(cases) > 1:
                floors: dict[str, list[float]] = {key: [] for key in FLOORS}
                results["sections"][name] = run_section(
                    name, cases, workload, args.parity_reps, floors
                )
                for key, times in floors.items():
                    results[key] = {
                        "command": f"python -c {shlex.quote(FLOORS[key])}",
                        "runs": times,
                        "median": statistics.median(times),
                    }
            elif name in CEILING_SECTIONS:
                own = Workload(steps=args.gpt_steps) if name == "ceiling_gpt" else workload
                results["sections"][name] = run_section(name, cases, own, args.ceiling_reps)
                results["sections"][name][0]["workload"] = {
                    **asdict(own),
                    "warmup_steps": own.warmup_steps,
                }
            elif len(cases) > 1:
                results["sections"][name] = run_section(name, cases, workload, args.reps)
    except BenchError as error:
        print(f"bench: error: {error}", file=sys.stderr)
        return 2
    text = report.render(results)
    print(text)
    for path in save(results, text, args.out, time.strftime("%Y%m%d-%H%M%S", now), args.report):
        print(f"wrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
