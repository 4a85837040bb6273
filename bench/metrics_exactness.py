"""Task metrics: the project's exact states of sums against torchmetrics, at world sizes 1, 2 and 3.

    .venv/bin/pip install torchmetrics   # not a dependency of the project: for this comparison only
    .venv/bin/python bench/metrics_exactness.py

One evaluation split (regression outputs and targets; segmentation logits and masks), in fixed
chunks dealt to the ranks in turn, as data.EvalSplit deals them. Each world size runs real gloo
process groups. Two ways to the metrics:

- hydra-ddp's (evaluation.evaluate): each chunk's task.state in its own slot, all-reduced, added in
  chunk order, then task.compute;
- torchmetrics': each rank's metric objects update() on its chunks, compute() syncs their states
  (gathered and summed over the ranks, as torchmetrics reduces "sum" states).

It records each metric's value per world size (as float.hex), whether every world size gives the
same bits, and the time per chunk of each way's per-chunk work on this host. Writes
bench/results/metrics_exactness.json and .md.
"""

from __future__ import annotations

import json
import os
import platform
import sys
import time
from datetime import timedelta
from pathlib import Path

import provenance
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

from hydra_ddp import tasks  # noqa: E402
from hydra_ddp.parallel import distributed  # noqa: E402
from hydra_ddp.runtime.ranks import RankInfo  # noqa: E402

SAMPLES, CHUNK, CLASSES, SIDE = 20_000, 256, 5, 16
RESULTS = REPO / "bench" / "results"


def _split() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    target = torch.randn(SAMPLES, generator=gen) * 50 + 150  # a score like diabetes's, in float32
    masks = torch.randint(0, CLASSES, (SAMPLES // 10, SIDE, SIDE), generator=gen)
    return {
        "reg_target": target,
        "reg_output": target + torch.randn(SAMPLES, generator=gen) * 40,
        "seg_target": masks,
        "seg_output": torch.randn(SAMPLES // 10, CLASSES, SIDE, SIDE, generator=gen)
        + masks[:, None],
    }


def _chunks(n: int, world: int, rank: int, size: int) -> list[tuple[int, slice]]:
    count = -(-n // size)
    return [(c, slice(c * size, min(n, (c + 1) * size))) for c in range(rank, count, world)]


def _ours(
    task: tasks.Task, output: torch.Tensor, target: torch.Tensor, mine: list, count: int
) -> tuple[dict, float]:
    slots = torch.zeros(count, task.state_size, dtype=torch.float64)
    started = time.perf_counter()
    for chunk, where in mine:
        slots[chunk] = task.state(output[where], target[where])
    spent = time.perf_counter() - started
    dist.all_reduce(slots)
    return task.compute(slots.sum(0).tolist()), spent


def _worker(rank: int, world: int, port: int, results) -> None:
    import torchmetrics

    info = RankInfo(rank, world, rank, world)
    init = {"name": "tcp", "host": "127.0.0.1", "port": None, "path": None, "ports": [port]}
    torch.set_num_threads(1)
    data = _split()
    with distributed.process_group("gloo", init, info, 60, torch.device("cpu")):
        out: dict = {}
        reg_mine = _chunks(SAMPLES, world, rank, CHUNK)
        seg_mine = _chunks(len(data["seg_target"]), world, rank, CHUNK // 10)
        regression = tasks.Regression()
        values, spent = _ours(
            regression,
            data["reg_output"][:, None],
            data["reg_target"],
            reg_mine,
            -(-SAMPLES // CHUNK),
        )
        out["ours"] = {
            "regression": {k: values[k] for k in ("mse", "mae", "r2")},
            "time_per_chunk_s": {},
        }
        out["ours"]["time_per_chunk_s"]["regression"] = spent / max(1, len(reg_mine))
        segmentation = tasks.Segmentation(CLASSES)
        values, spent = _ours(
            segmentation,
            data["seg_output"],
            data["seg_target"],
            seg_mine,
            -(-len(data["seg_target"]) // (CHUNK // 10)),
        )
        out["ours"]["segmentation"] = {
            "mean_iou": values["mean_iou"],
            "pixel_accuracy": values["pixel_accuracy"],
        }
        out["ours"]["time_per_chunk_s"]["segmentation"] = spent / max(1, len(seg_mine))

        mse, mae, r2 = (
            torchmetrics.MeanSquaredError(),
            torchmetrics.MeanAbsoluteError(),
            torchmetrics.R2Score(),
        )
        started = time.perf_counter()
        for _, where in reg_mine:
            for metric in (mse, mae, r2):
                metric.update(data["reg_output"][where], data["reg_target"][where])
        reg_time = (time.perf_counter() - started) / max(1, len(reg_mine))
        iou = torchmetrics.classification.MulticlassJaccardIndex(CLASSES, average="macro")
        accuracy = torchmetrics.classification.MulticlassAccuracy(CLASSES, average="micro")
        started = time.perf_counter()
        for _, where in seg_mine:
            predicted = data["seg_output"][where].argmax(1)
            iou.update(predicted, data["seg_target"][where])
            accuracy.update(predicted, data["seg_target"][where])
        seg_time = (time.perf_counter() - started) / max(1, len(seg_mine))
        out["torchmetrics"] = {
            "regression": {
                "mse": mse.compute().item(),
                "mae": mae.compute().item(),
                "r2": r2.compute().item(),
            },
            "segmentation": {
                "mean_iou": iou.compute().item(),
                "pixel_accuracy": accuracy.compute().item(),
            },
            "time_per_chunk_s": {"regression": reg_time, "segmentation": seg_time},
            "version": torchmetrics.__version__,
        }
        if rank == 0:
            results[world] = out


def main() -> None:
    found: dict[int, dict] = {}
    for world in (1, 2, 3):
        with mp.Manager() as manager:
            results = manager.dict()
            store = distributed.serve_store("127.0.0.1", 0, timedelta(seconds=60))
            mp.spawn(_worker, args=(world, store.port, results), nprocs=world)
            found[world] = dict(results)[world]
            del store
    table = []
    for way in ("ours", "torchmetrics"):
        for task in ("regression", "segmentation"):
            for metric in found[1][way][task]:
                values = [found[w][way][task][metric] for w in (1, 2, 3)]
                table.append(
                    {
                        "way": way,
                        "task": task,
                        "metric": metric,
                        "values_hex": [float(v).hex() for v in values],
                        "bit_equal_at_1_2_3": len({float(v).hex() for v in values}) == 1,
                        "largest_relative_gap": max(
                            abs(v - values[0]) / abs(values[0]) for v in values
                        ),
                    }
                )
    result = {
        "when": time.strftime("%Y-%m-%d %H:%M:%S"),
        "host": platform.processor() or platform.machine(),
        "cpu": provenance.cpu_model(),
        "torch": torch.__version__,
        "torchmetrics": found[1]["torchmetrics"]["version"],
        "samples": SAMPLES,
        "chunk": CHUNK,
        "metrics": table,
        "time_per_chunk_s": {
            way: found[1][way]["time_per_chunk_s"] for way in ("ours", "torchmetrics")
        },
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "metrics_exactness.json").write_text(json.dumps(result, indent=2) + "\n")
    lines = [
        "# Task metrics at world sizes 1, 2, 3: hydra-ddp's states of sums against torchmetrics "
        f"{result['torchmetrics']}",
        "",
        f"{result['when']}, {result['cpu']}, torch {result['torch']}; {SAMPLES} "
        f"regression samples, {SAMPLES // 10} masks of {SIDE}x{SIDE}, chunks "
        "dealt to the ranks in turn (bench/metrics_exactness.py).",
        "",
        "| way | task | metric | bit-equal at 1, 2, 3 ranks | largest relative gap |",
        "| --- | --- | --- | --- | --- |",
    ]
    lines += [
        f"| {r['way']} | {r['task']} | {r['metric']} | "
        f"{'yes' if r['bit_equal_at_1_2_3'] else 'no'} | {r['largest_relative_gap']:.1e} |"
        for r in table
    ]
    times = result["time_per_chunk_s"]
    lines += [
        "",
        "Per-chunk work at one rank (one thread), microseconds:",
        "",
        "| way | regression (3 metrics) | segmentation (2 metrics) |",
        "| --- | --- | --- |",
    ]
    lines += [
        f"| {way} | {times[way]['regression'] * 1e6:.0f} | {times[way]['segmentation'] * 1e6:.0f} |"
        for way in times
    ]
    (RESULTS / "metrics_exactness.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
