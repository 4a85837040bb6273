"""The sweep report: at the end of a multirun, every job's summary.json side by side (the scaling
report here, the trials report in trials.py).

A Hydra callback (`on_multirun_end`, registered in conf/config.yaml) writes it in the sweep
directory. A sweep over world sizes gets the scaling report, `scaling.csv`, `scaling.md` and
`scaling.png`: samples/s, speed-up over the smallest world size, scaling efficiency and the final
metrics, one row per job. Any other sweep (hyperparameters, an Optuna search) gets the trials
report, `sweep.csv` and `sweep.md`: every trial's parameters and metrics ranked by the objective
(trainer.monitor's best value, a validation metric), naming the best trial's run directory.
A job that failed is a failed row, not a crash of the report. Also runs on its own:

    python -m hydra_ddp.sweeps.scaling outputs/multirun/DATE/TIME
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path
from typing import Any, Optional

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from hydra_ddp.rundir import RunDir
from hydra_ddp.sweeps import scaling_plot
from hydra_ddp.sweeps.trials import (
    check_search,
    fmt,
    metric_columns,
    rank_trials,
    searching,
    write_csv,
    write_trials,
)

log = logging.getLogger(__name__)

# The task's test (and, for a search, validation) metrics go between these: metric_columns.
COLUMNS = [
    "job",
    "swept",
    "status",
    "world_size",
    "global_batch_size",
    "threads_per_rank",
    "samples_per_sec",
    "speedup",
    "efficiency",
    "flops_per_sec_per_rank",
    "mfu",
    "wall_time_s",
    "flags",
    "error",
]
METRICS_AT = 11  # where in COLUMNS the metric columns go
# An efficiency above this is no scaling: the base job was slowed (a busy host, fewer threads) or
# did other work (another global batch), and the row says so.
ABOVE_LINEAR = 1.1
# how a row's threads per rank are chosen unless trainer.threads is set (launch/resolve.py)
THREADS_DEFAULT = (
    "Threads per rank: trainer.threads, by default the CPUs the command may use divided by the "
    "ranks on its node (one rank takes them all)."
)


def _overrides(job_dir: Path) -> list[str]:
    path = job_dir / ".hydra" / "overrides.yaml"
    return [str(o) for o in OmegaConf.load(path)] if path.exists() else []


def collect(sweep_dir: Path) -> list[dict[str, Any]]:
    """One row per job directory (numbered), in job order."""
    jobs = sorted(
        (d for d in sweep_dir.iterdir() if d.is_dir() and d.name.isdigit()),
        key=lambda d: int(d.name),
    )
    overrides = {d: _overrides(d) for d in jobs}
    common = set.intersection(*(set(o) for o in overrides.values())) if jobs else set()
    rows = []
    for job_dir in jobs:
        # A search's trial identity (trial.*) is the job's number, not a parameter.
        swept = (
            " ".join(
                o
                for o in overrides[job_dir]
                if o not in common and not o.lstrip("+").startswith("trial.")
            )
            or "(default)"
        )
        row: dict[str, Any] = {"job": int(job_dir.name), "swept": swept}
        summary_file = RunDir(job_dir).summary
        if summary_file.exists():
            s = json.loads(summary_file.read_text())
            names = s.get("metrics", ["loss", "accuracy"])  # the task's
            row.update(
                status="ok",
                metrics=names,
                **{
                    k: s.get(k)
                    for k in (
                        "world_size",
                        "global_batch_size",
                        "threads_per_rank",
                        "samples_per_sec",
                        "wall_time_s",
                        "objective",
                        "steps",
                        "ended_by",
                        *(f"{split}_{name}" for split in ("val", "test") for name in names),
                    )
                },
            )
            row.update(
                monitor=(s.get("monitor") or {}).get("metric"),
                mode=(s.get("monitor") or {}).get("mode"),
            )
            model_flops = s.get("flops") or {}  # reporting/flops.py: achieved per rank, and the MFU
            row.update(
                flops_per_sec_per_rank=model_flops.get("per_sec_per_rank"),
                mfu=model_flops.get("mfu"),
            )
            if s.get("stopped_by"):
                row["status"] = f"stopped ({s['stopped_by']})"
            elif s.get("ended_by") == "pruned":
                row["status"] = "pruned"  # by the search's pruner: ranked by its best value so far
        else:
            error, state = RunDir(job_dir).error, RunDir(job_dir).slurm_state
            row.update(
                status=state.read_text().strip() if state.exists() else "failed",
                error=error.read_text().strip() if error.exists() else "no summary.json",
            )
        row["run_dir"] = str(job_dir)
        rows.append(row)
    _add_speedup(rows)
    _flag(rows)
    return rows


def _add_speedup(rows: list[dict[str, Any]]) -> None:
    """Speed-up over the smallest world size's throughput; efficiency = speed-up ÷ world-size
    ratio."""
    done = [r for r in rows if r["status"] == "ok" and r.get("samples_per_sec")]
    if not done:
        return
    base = min(done, key=lambda r: (r["world_size"], r["job"]))
    for r in done:
        r["speedup"] = r["samples_per_sec"] / base["samples_per_sec"]
        r["efficiency"] = r["speedup"] / (r["world_size"] / base["world_size"])


def _flag(rows: list[dict[str, Any]]) -> None:
    """A row whose efficiency does not measure scaling says why, against the base job (the smallest
    world size's, which the speed-up divides by): an efficiency above ABOVE_LINEAR, a global batch
    or threads per rank other than the base's."""
    done = [r for r in rows if r.get("efficiency") is not None]
    if not done:
        return
    base = min(done, key=lambda r: (r["world_size"], r["job"]))
    for r in done:
        flags = [
            f"{name} {r.get(key)}, not {base.get(key)} as job {base['job']}'s"
            for key, name in (
                ("global_batch_size", "global batch"),
                ("threads_per_rank", "threads per rank"),
            )
            if r.get(key) != base.get(key)
        ]
        if r["efficiency"] > ABOVE_LINEAR:
            flags.append(
                f"efficiency {r['efficiency']:.2f} > {ABOVE_LINEAR}: not scaling (the base job "
                "was slowed, or did other work)"
            )
        r["flags"] = "; ".join(flags) or None


def warnings(rows: list[dict[str, Any]]) -> list[str]:
    """What the report's top says before its table: jobs whose global batches differ compare
    different work."""
    batches = sorted({r["global_batch_size"] for r in rows if r.get("global_batch_size")})
    if len(batches) < 2:
        return []
    return [
        f"**The jobs' global batches differ ({', '.join(map(str, batches))})**: their samples/s "
        "compare different work, and their efficiencies are no scaling. Sweep world sizes with "
        "data.global_batch_size=N held fixed.",
        "",
    ]


def write(rows: list[dict[str, Any]], sweep_dir: Path) -> None:
    # torch: imported at the sweep's end, not at the launcher's start
    from hydra_ddp.reporting import flops

    metrics = metric_columns(rows, ("test",))
    at = METRICS_AT
    write_csv(sweep_dir / "scaling.csv", rows, COLUMNS[:at] + metrics + COLUMNS[at:])
    header = (
        "| job | swept | status | world size | global batch | threads per rank | samples/s | "
        "speed-up | efficiency | model FLOP/s per rank | MFU | "
        + "".join(f"{m.replace('_', ' ')} | " for m in metrics)
        + "wall s | flags |"
    )
    lines = [
        f"# Scaling report: {sweep_dir}",
        "",
        *warnings(rows),
        header,
        "|" + " --- |" * (13 + len(metrics)),
    ]
    for r in rows:
        achieved = (
            flops.si(r["flops_per_sec_per_rank"], "FLOP/s")
            if r.get("flops_per_sec_per_rank")
            else None
        )
        cells = [
            r["job"],
            r["swept"],
            r["status"] + (f": {r['error']}" if r.get("error") else ""),
            r.get("world_size"),
            r.get("global_batch_size"),
            r.get("threads_per_rank"),
            r.get("samples_per_sec"),
            r.get("speedup"),
            r.get("efficiency"),
            achieved,
            r.get("mfu"),
            *(r.get(m) for m in metrics),
            r.get("wall_time_s"),
            r.get("flags"),
        ]
        lines.append("| " + " | ".join(fmt(c) for c in cells) + " |")
    lines += [
        "",
        "Speed-up is over the smallest world size's "
        "samples/s; efficiency is speed-up divided by the",
        "world-size ratio (1.0 is perfect scaling). "
        "Throughput counts training steps only. Model FLOP/s",
        "and MFU: the summary's `flops` (counted once per run; the peak as each summary names it).",
        f"A row's flags: an efficiency above {ABOVE_LINEAR}, a global batch or threads per rank",
        "not the base job's (the smallest world size's).",
        THREADS_DEFAULT,
        "",
    ]
    (sweep_dir / "scaling.md").write_text("\n".join(lines))
    scaling_plot.plot(rows, sweep_dir / "scaling.png", sweep_dir)


def varies_world_size(rows: list[dict[str, Any]]) -> bool:
    return len({r["world_size"] for r in rows if r["status"] == "ok"}) > 1 or any(
        "trainer.nproc=" in r["swept"] or "launcher.nnodes=" in r["swept"] for r in rows
    )


def report(sweep_dir: Path) -> Optional[tuple[str, list[dict[str, Any]]]]:
    """("scaling" or "sweep", rows) for the report written, or None when there are no jobs."""
    rows = collect(sweep_dir)
    if not rows:
        return None
    if varies_world_size(rows):
        write(rows, sweep_dir)
        return "scaling", rows
    return "sweep", write_trials(rows, sweep_dir)


class SweepReport(Callback):
    """Hydra callback: checks a search's direction at the start; the report once every job has
    run."""

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        problem = check_search(config)
        if problem:
            print(f"hydra-ddp: error: {problem}", file=sys.stderr)
            sys.exit(2)

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        if (config.hydra.get("sweeper") or {}).get("role") == "helper":
            return  # a search's helper process: the main sweeper reports once every trial has ended
        sweep_dir = Path(config.hydra.sweep.dir)
        written = report(sweep_dir) if sweep_dir.is_dir() else None
        if not written:
            return
        kind, rows = written
        failed = [r for r in rows if failed_row(r)]
        best = rank_trials([dict(r) for r in rows])[0]
        from hydra_ddp.reporting.loggers import MLflow

        MLflow.end_sweep(
            sweep_dir,
            len(rows),
            len(failed),
            (best["monitor"], best["objective"])
            if best.get("rank") == 1 and best.get("monitor")
            else None,
        )
        log.info("%s report: %s", kind, sweep_dir / f"{kind}.md")
        print((sweep_dir / f"{kind}.md").read_text())
        # a search goes past failed or diverged trials: they rank last
        if failed and searching(config):
            print(
                f"hydra-ddp: warning: {len(failed)} of {len(rows)} trials failed (ranked last in "
                f"{sweep_dir / 'sweep.md'})",
                file=sys.stderr,
            )
        elif failed:  # a sweep with a failed job does not pass for a success
            print(
                f"hydra-ddp: error: {len(failed)} of {len(rows)} "
                f"jobs failed (see {sweep_dir / f'{kind}.md'})",
                file=sys.stderr,
            )
            sys.exit(1)


def failed_row(row: dict[str, Any]) -> bool:
    """Failed, or ended by Slurm (cancelled, timeout…); a run stopped by a signal has its
    summary."""
    return row["status"] not in ("ok", "pruned") and not row["status"].startswith("stopped")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit("usage: python -m hydra_ddp.sweeps.scaling SWEEP_DIR")
    written = report(Path(sys.argv[1]))
    if not written:
        raise SystemExit(f"no job directories under {sys.argv[1]}")
    print((Path(sys.argv[1]) / f"{written[0]}.md").read_text())
