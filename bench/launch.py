"""What one launch costs before its first step, where that goes, and what a warm start saves.

    python bench/launch.py              # 6 rounds; bench/results/launch_<commit>.json and LAUNCH.md
    python bench/launch.py --rounds 10

Side by side, alternated round by round: the same short run (the default config, two steps, a new
run directory each time) started cold, as `python train.py`, and warm, as the same command with
HYDRA_DDP_WARM set to a warm process started once for the bench (`hydra-ddp warm start`, one that
has served a command before the first timed one). Each run's wall time (the command's start to its
exit, this process's clock), the CPU seconds the machine spent while it ran (every process: /proc/
stat, so run it on a machine left alone), and the summary's own start-up figures (workers ready,
first step done, from the command's start). Then the parts of a cold launch, each timed alone in
one interpreter: the interpreter, train.py's own first import, Hydra, torch and torch._dynamo as a
forkserver imports them (the collector off), and `train.py --check` (the command composing,
resolving and checking the config with everything imported, launching nothing).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import provenance

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"
RUN = ("trainer.max_steps=2",)
PARTS = {
    "interpreter": "pass",
    "train.py's first import (hydra_ddp.cli)": "import hydra_ddp.cli",
    "Hydra": "import hydra",
    "torch and torch._dynamo, the collector off": (
        "import gc; gc.disable(); import torch, torch._dynamo"
    ),
}


def _busy() -> float:
    """Seconds of CPU the machine has spent, every process (user, nice, system, irq)."""
    fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
    user, nice, system, _, _, irq, softirq, steal = (int(v) for v in fields[:8])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def timed(command: list[str], env: dict[str, str]) -> dict[str, float]:
    cpu, start = _busy(), time.monotonic()
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True)
    wall = time.monotonic() - start
    if done.returncode:
        raise SystemExit(f"{' '.join(command)}: exit {done.returncode}\n{done.stderr[-2000:]}")
    if "starting cold" in done.stderr:
        raise SystemExit(f"a warm run started cold: {done.stderr[-500:]}")
    return {"wall_s": wall, "cpu_s": _busy() - cpu}


def one_run(env: dict[str, str], folder: Path) -> dict[str, float]:
    run = folder / f"run{time.monotonic_ns()}"
    result = timed([sys.executable, "train.py", *RUN, f"hydra.run.dir={run}"], env)
    summary = json.loads((run / "summary.json").read_text())
    result["workers_ready_s"] = summary["time_to_workers_ready_s"]
    result["first_step_s"] = summary["time_to_first_step_s"]
    return result


def parts(env: dict[str, str], repeats: int) -> dict[str, float]:
    found: dict[str, list[float]] = {}
    for _ in range(repeats):
        for name, code in PARTS.items():
            found.setdefault(name, []).append(timed([sys.executable, "-c", code], env)["wall_s"])
        check = timed([sys.executable, "train.py", "--check", *RUN], env)
        found.setdefault("train.py --check (compose, resolve, check; no launch)", []).append(
            check["wall_s"]
        )
    return {name: statistics.median(values) for name, values in found.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=6)
    args = parser.parse_args()
    from hydra_ddp.warm import command as warm

    cold_env = {k: v for k, v in os.environ.items() if k != warm.ENV}
    with tempfile.TemporaryDirectory(prefix="hddp-launch-", dir="/tmp") as folder:
        path = str(Path(folder) / "w.sock")
        warm_env = {**cold_env, warm.ENV: path}
        subprocess.run(
            [str(Path(sys.executable).with_name("hydra-ddp")), "warm", "start"],
            env=warm_env,
            check=True,
            capture_output=True,
        )
        try:
            one_run(warm_env, Path(folder))  # its first command: not timed
            one_run(cold_env, Path(folder))  # the cold side's caches as warm as they get
            runs: dict[str, list[dict[str, float]]] = {"cold": [], "warm": []}
            for _ in range(args.rounds):
                runs["cold"].append(one_run(cold_env, Path(folder)))
                runs["warm"].append(one_run(warm_env, Path(folder)))
            cold_parts = parts(cold_env, 3)
        finally:
            warm.stop(path)
    medians = {
        side: {key: statistics.median(r[key] for r in rows) for key in rows[0]}
        for side, rows in runs.items()
    }
    result = {
        "commit": provenance.stamp(),
        "date": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
        "host": {
            "cpu": provenance.cpu_model(),
            "cores": os.cpu_count(),
            "python": platform.python_version(),
        },
        "run": list(RUN),
        "rounds": args.rounds,
        "runs": runs,
        "median": medians,
        "cold_parts_s": cold_parts,
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    name = f"launch_{result['commit']}.json"
    (RESULTS / name).write_text(json.dumps(result, indent=1) + "\n")
    report = _report(result, name)
    (RESULTS / "LAUNCH.md").write_text(report)
    print(report)


def _report(result: dict, name: str) -> str:
    cold, warm = result["median"]["cold"], result["median"]["warm"]
    rows = [
        ("wall time, command start to exit", "wall_s"),
        ("CPU seconds, every process", "cpu_s"),
        ("workers ready (summary, from the command's start)", "workers_ready_s"),
        ("first step done (summary)", "first_step_s"),
    ]
    lines = [
        "# A launch's fixed cost: cold and warm",
        "",
        f"`python bench/launch.py` at `{result['commit']}` ({result['date']} UTC), "
        f"{result['host']['cores']} × {result['host']['cpu']}, Python "
        f"{result['host']['python']}: `train.py {' '.join(result['run'])}`, {result['rounds']} "
        f"rounds alternated, medians. Every run's figures: [{name}]({name}).",
        "",
        "| | cold | warm (`HYDRA_DDP_WARM`) | warm / cold |",
        "|---|---|---|---|",
    ]
    for label, key in rows:
        lines.append(
            f"| {label} | {cold[key]:.2f} s | {warm[key]:.2f} s | {warm[key] / cold[key]:.2f} |"
        )
    lines += [
        "",
        "Where a cold launch's time goes: each part alone, in one interpreter (median of 3). A "
        "cold command imports Hydra and the project, then torch for its checks, while its "
        "forkserver imports torch and torch._dynamo beside it; a warm command's fork has them all.",
        "",
        "| part | seconds |",
        "|---|---|",
    ]
    for part, seconds in result["cold_parts_s"].items():
        lines.append(f"| {part} | {seconds:.2f} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
