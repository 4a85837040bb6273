"""The scaling report's figure, scaling.png: samples/s and efficiency by world size, and each job's
global training loss by step (from its metrics.csv, else its TensorBoard file)."""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any, Optional

from hydra_ddp.rundir import RunDir


def train_losses(job_dir: Path) -> list[tuple[int, float]]:
    """(step, global train loss) from a job's metrics.csv (else its TensorBoard file): what the
    loss panel overlays."""
    if RunDir(job_dir).metrics_csv.is_file():
        with open(RunDir(job_dir).metrics_csv, newline="") as f:
            return [
                (int(r["step"]), float(r["train/loss"]))
                for r in csv.DictReader(f)
                if r.get("train/loss")
            ]
    if not RunDir(job_dir).tensorboard.is_dir():
        return []
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(RunDir(job_dir).tensorboard), size_guidance={"scalars": 0})
    acc.Reload()
    if "train/loss" not in acc.Tags().get("scalars", []):
        return []
    return [(e.step, e.value) for e in acc.Scalars("train/loss")]


def plot(rows: list[dict[str, Any]], path: Path, sweep_dir: Optional[Path] = None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    done = [r for r in rows if r["status"] == "ok" and r.get("samples_per_sec")]
    failed = [r for r in rows if r["status"] != "ok"]
    fig, (ax_tp, ax_eff, ax_loss) = plt.subplots(1, 3, figsize=(16, 4.4))
    sizes = sorted({r["world_size"] for r in done})
    by_size = len(sizes) == len(done) and len(sizes) > 1  # one job per world size: plot against it
    if by_size:
        done.sort(key=lambda r: r["world_size"])
        x = [r["world_size"] for r in done]
        base = done[0]
        ideal = [base["samples_per_sec"] * n / base["world_size"] for n in x]
        ax_tp.plot(x, ideal, "--", color="grey", label="ideal (linear)")
        ax_tp.plot(
            x, [r["samples_per_sec"] for r in done], "o-", color="tab:blue", label="measured"
        )
        ax_tp.set_xlabel("world size (processes)")
        ax_tp.set_xticks(x)
        ax_eff.plot(x, [r["efficiency"] for r in done], "o-", color="tab:green")
        ax_eff.axhline(1.0, ls="--", color="grey")
        ax_eff.set_xlabel("world size (processes)")
        ax_eff.set_xticks(x)
        ax_tp.legend()
    else:  # another key was swept: one bar per job
        labels = [r["swept"] for r in done]
        ax_tp.bar(labels, [r["samples_per_sec"] for r in done], color="tab:blue")
        ax_eff.bar(labels, [r["efficiency"] for r in done], color="tab:green")
        for ax in (ax_tp, ax_eff):
            ax.tick_params(axis="x", labelrotation=20)
    ax_tp.set_ylabel("samples / s")
    ax_tp.set_ylim(bottom=0)
    ax_tp.set_title("Throughput")
    ax_eff.set_ylabel("scaling efficiency")
    ax_eff.set_ylim(0, max([1.1] + [r["efficiency"] * 1.1 for r in done]))
    ax_eff.set_title("Efficiency (speed-up ÷ world-size ratio)")
    # Scaling out must not change the science: with data.global_batch_size the curves coincide.
    # Dashes and narrowing widths keep curves that lie on top of each other visible.
    for i, r in enumerate(done if sweep_dir else []):
        curve = train_losses(sweep_dir / str(r["job"]))
        if curve:
            ax_loss.plot(
                *zip(*curve),
                ls=("-", "--", ":", "-.")[i % 4],
                lw=max(0.8, 3.0 - 0.6 * i),
                label=r["swept"],
            )
    ax_loss.set_xlabel("optimizer step")
    ax_loss.set_ylabel("train loss (global)")
    ax_loss.set_title("Training loss by job")
    if ax_loss.lines:
        ax_loss.legend(fontsize=8)
    for ax in (ax_tp, ax_eff, ax_loss):
        ax.grid(alpha=0.3)
    if failed:
        ended = "; ".join(f"job {r['job']} {r['status']} ({r['swept']})" for r in failed)
        fig.text(0.5, 0.01, f"not finished: {ended}", ha="center", color="tab:red")
    fig.suptitle(
        "Scaling: " + (", ".join(sorted({r["swept"].split("=")[0] for r in rows})) or "sweep")
    )
    fig.tight_layout(rect=(0, 0.04 if failed else 0, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
