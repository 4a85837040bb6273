"""The trials report of a sweep that is not over world sizes (hyperparameters, an Optuna search):
every trial ranked by its objective, `sweep.csv` and `sweep.md`; the checks a search gets before its
first trial; and the cells both reports share."""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any, Optional

from omegaconf import DictConfig

TRIAL_COLUMNS = [
    "rank",
    "job",
    "swept",
    "status",
    "monitor",
    "objective",
    "steps",
    "ended_by",
    "wall_time_s",
    "run_dir",
    "error",
]
METRICS_AT = 6  # where in TRIAL_COLUMNS the metric columns go


def metric_columns(rows: list[dict[str, Any]], splits: tuple[str, ...]) -> list[str]:
    """{split}_{metric} for the metrics the jobs' tasks report (in their order; every job's,
    once)."""
    names = list(dict.fromkeys(name for r in rows for name in r.get("metrics") or ()))
    return [f"{split}_{name}" for split in splits for name in names]


def fmt(value: Any, digits: int = 3) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.{digits}f}" if abs(value) < 100 else f"{value:,.0f}"
    return str(value)


def rank_trials(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Best first by the objective (in the monitored metric's direction), pruned trials among them
    by their best value so far; failed trials last."""
    scored = [r for r in rows if r["status"] in ("ok", "pruned") and r.get("objective") is not None]
    mode = scored[0]["mode"] if scored else "max"
    scored.sort(key=lambda r: (-r["objective"] if mode == "max" else r["objective"], r["job"]))
    ranked = scored + [r for r in rows if r not in scored]
    for place, r in enumerate(ranked, 1):
        r["rank"] = place if r in scored else None
    return ranked


def write_csv(path: Path, rows: list[dict[str, Any]], columns: list[str]) -> None:
    """`rows` as CSV with these columns (a row's other keys left out)."""
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)


def write_trials(rows: list[dict[str, Any]], sweep_dir: Path) -> list[dict[str, Any]]:
    ranked = rank_trials(rows)
    metrics = metric_columns(ranked, ("val", "test"))
    at = METRICS_AT
    write_csv(sweep_dir / "sweep.csv", ranked, TRIAL_COLUMNS[:at] + metrics + TRIAL_COLUMNS[at:])
    monitor = next((r["monitor"] for r in ranked if r.get("monitor")), None)
    best = ranked[0] if ranked and ranked[0]["rank"] == 1 else None
    lines = [f"# Sweep report: {sweep_dir}", ""]
    if best:
        lines += [
            f"Best: job {best['job']} ({best['swept']}), {monitor} "
            f"{fmt(best['objective'], 4)}: {best['run_dir']}",
            "",
        ]
    lines += [
        f"| rank | job | parameters | status | {monitor or 'objective'} (best) | "
        + "".join(f"{m.replace('_', ' ')} | " for m in metrics)
        + "steps | ended by | wall s |",
        "|" + " --- |" * (8 + len(metrics)),
    ]
    for r in ranked:
        cells = [
            r["rank"],
            r["job"],
            r["swept"],
            r["status"] + (f": {r['error']}" if r.get("error") else ""),
            r.get("objective"),
            *(r.get(m) for m in metrics),
            r.get("steps"),
            r.get("ended_by"),
            r.get("wall_time_s"),
        ]
        lines.append("| " + " | ".join(fmt(c, 4) for c in cells) + " |")
    lines += [
        "",
        "Ranked by the objective: trainer.monitor's best "
        "value over each trial's validations (never the",
        "test set's). Each trial's test metrics are of its selected weights, read once.",
        "",
    ]
    (sweep_dir / "sweep.md").write_text("\n".join(lines))
    return ranked


def searching(config: DictConfig) -> bool:
    """An optimising sweeper (Optuna) rather than a grid of jobs."""
    return "optuna" in str((config.hydra.get("sweeper") or {}).get("_target_", ""))


def check_search(config: DictConfig) -> Optional[str]:
    """An optimising sweeper (Optuna) needs a monitored metric, optimised in its own direction."""
    direction = (config.hydra.get("sweeper") or {}).get("direction")
    if direction is None or not searching(config):
        return None
    from hydra_ddp import tasks

    metric, mode = tasks.monitor_of(config)
    if metric is None:
        return (
            "the Optuna sweeper optimises trainer.monitor: "
            "set it (e.g. trainer.monitor=val/accuracy)"
        )
    pruner = (config.hydra.get("sweeper") or {}).get("pruner", "none")
    # nothing is monitored
    if pruner != "none" and metric.startswith("val/") and not config.data.val_fraction:
        return (
            f"hydra.sweeper.pruner={pruner} needs a monitored metric after "
            "each epoch, and data.val_fraction=0 leaves no validation: set "
            "data.val_fraction (e.g. 0.1), or hydra.sweeper.pruner=none"
        )
    wanted = {"max": "maximize", "min": "minimize"}[mode]
    given = [
        str(d).lower().split(".")[-1]
        for d in (direction if not isinstance(direction, str) else [direction])
    ]
    if given != [wanted]:
        return (
            f"hydra.sweeper.direction={direction} but trainer.monitor={metric} "
            f"is best at its {'highest' if wanted == 'maximize' else 'lowest'}: "
            f"set hydra.sweeper.direction={wanted}"
        )
    return None
