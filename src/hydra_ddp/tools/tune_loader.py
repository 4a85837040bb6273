"""Time the data pipeline alone over num_workers × pin_memory, and print the best setting.

    python -m hydra_ddp.tools.tune_loader data=imagefolder data.dataset.root=DIR
    python -m hydra_ddp.tools.tune_loader 'tune.num_workers=[0,2,4]' tune.batches=50

As the seeds advise: find the loader settings that keep up with training before training.
One process, the training loader as one rank of `trainer.nproc` would see it.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import hydra
import torch
from omegaconf import DictConfig

from hydra_ddp import data, project, tools
from hydra_ddp.config.schema import Config, DataConf
from hydra_ddp.data import batches as batch_trees
from hydra_ddp.errors import UserError
from hydra_ddp.launch import resolve
from hydra_ddp.runtime.ranks import RankInfo

CONF_DIR = project.package_config_path()  # the package's config groups (a project's come first)


@dataclass
class LoaderTuneConf:
    num_workers: list[int] = field(default_factory=lambda: [0, 1, 2, 4])
    pin_memory: list[bool] = field(default_factory=lambda: [False, True])
    batches: int = 30  # timed, after one warm-up batch


@dataclass
class LoaderTuneConfig(Config):
    tune: LoaderTuneConf = field(default_factory=LoaderTuneConf)


def time_loader(
    data_cfg: DataConf, rank: RankInfo, device: torch.device, batches_to_time: int
) -> float:
    """Samples per second of iterating the training loader (and copying each batch to `device`)."""
    loader = data.build_loaders(data_cfg, rank, seed=0, device=device).train
    iterator = iter(loader)
    next(iterator)  # workers start and fill their queues: not what a steady epoch pays
    samples, started = 0, time.perf_counter()
    for batch in itertools.islice(iterator, batches_to_time):
        batch_trees.to_device(batch, device)
        samples += batch_trees.count(batch)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return samples / (time.perf_counter() - started)


def tune(cfg: DictConfig) -> list[dict[str, Any]]:
    plain = resolve.plain_config(cfg)
    plain.pop("tune")  # the tuner's own settings, not the run's
    resolved = resolve.resolve(plain, Path.cwd(), external=None)
    nproc = resolved.trainer.nproc
    device = torch.device("cuda" if resolved.trainer.device == "cuda" else "cpu")
    rank = RankInfo(0, nproc, 0, nproc)
    rows = []
    for workers, pin in itertools.product(cfg.tune.num_workers, cfg.tune.pin_memory):
        if pin and device.type != "cuda":
            continue  # pinned memory only speeds up copies to a GPU
        data_cfg = dataclasses.replace(
            resolved.data, num_workers=workers, pin_memory=pin, preload=False
        )
        rows.append(
            {
                "num_workers": workers,
                "pin_memory": pin,
                "samples_per_sec": time_loader(data_cfg, rank, device, cfg.tune.batches),
            }
        )
    return rows


@hydra.main(version_base=None, config_path=CONF_DIR, config_name="config")
def main(cfg: DictConfig) -> None:
    try:
        rows = tune(cfg)
    except UserError as error:
        raise SystemExit(f"hydra-ddp: error: {error}") from None
    print(f"{'num_workers':>11}  {'pin_memory':>10}  {'samples/s':>10}")
    for row in rows:
        print(
            f"{row['num_workers']:>11}  {str(row['pin_memory']):>10}  "
            f"{row['samples_per_sec']:>10.0f}"
        )
    best = max(rows, key=lambda r: r["samples_per_sec"])
    print(
        f"best: data.num_workers={best['num_workers']} "
        f"data.pin_memory={str(best['pin_memory']).lower()}"
    )


if __name__ == "__main__":
    tools.measuring(LoaderTuneConfig)  # the training schema plus `tune`
    main()
