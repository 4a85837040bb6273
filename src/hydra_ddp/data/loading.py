"""Loaders: the splits built alike on every rank, the training loader (sharded, seeded per sample)
and the evaluation splits in fixed chunks."""

from __future__ import annotations

import logging
import math
import platform
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, NamedTuple, Optional

import torch
import torch.distributed as dist
from hydra.utils import instantiate
from torch.utils.data import DataLoader, Dataset, IterableDataset, Sampler, Subset

from hydra_ddp.config.schema import DataConf
from hydra_ddp.data import batches, shards
from hydra_ddp.data.loader_workers import FORK_BLOCKING_STOPS, loader_worker_init
from hydra_ddp.data.sampling import (
    ResumableDistributedSampler,
    SeededSamples,
    ShardWindowSampler,
    sample_seed,
)
from hydra_ddp.errors import EveryRankError, UserError
from hydra_ddp.runtime import hangs
from hydra_ddp.runtime.ranklog import FILE_ONLY
from hydra_ddp.runtime.ranks import RankInfo

log = logging.getLogger(__name__)


class EvalSplit:
    """One split for evaluation, this rank's part: chunks of `batch_size` consecutive samples
    (chunk c holds samples c·B … c·B+B-1), chunk c on rank c mod W. No padding, so every sample
    counts once; and a chunk is the same batch at any world size, so its sums are too.

    Iterating yields (chunk, first sample index, batch); `passes` counts the iterations begun (the
    test split's must end at one).
    """

    def __init__(
        self,
        dataset: Dataset,
        batch_size: int,
        rank: RankInfo,
        device: torch.device,
        preload: bool,
        loader_options: dict[str, Any],
    ):
        self.samples = len(dataset)  # type: ignore[arg-type]
        self.batch_size = batch_size
        self.num_chunks = math.ceil(self.samples / batch_size)
        self.chunks = range(rank.rank, self.num_chunks, rank.world_size)
        self.rounds = math.ceil(self.num_chunks / rank.world_size)  # the most chunks any rank holds
        self.dataset = dataset
        self.passes = 0
        self.tensors = batches.to_device(batches.whole(dataset), device) if preload else None
        self.collate = batches.collate_for(dataset)
        loader_options = {**loader_options, "collate_fn": self.collate}
        self.loader = (
            None
            if preload
            else DataLoader(
                dataset,
                batch_sampler=[list(self._indices(c)) for c in self.chunks],
                **loader_options,
            )
        )

    def _indices(self, chunk: int) -> range:
        return range(chunk * self.batch_size, min(self.samples, (chunk + 1) * self.batch_size))

    def __len__(self) -> int:
        return len(self.chunks)

    def filler(self) -> Any:
        """One sample as a batch: the batch of the forwards a rank runs past its own chunks when
        every rank must run as many (a sharded model gathers its parameters in each)."""
        if self.tensors is not None:
            return batches.take(self.tensors, slice(0, 1))
        return self.collate([self.dataset[0]])

    def __iter__(self) -> Iterator[tuple[int, int, Any]]:
        self.passes += 1
        if self.tensors is not None:
            for chunk in self.chunks:
                where = self._indices(chunk)
                yield chunk, where.start, batches.take(self.tensors, slice(where.start, where.stop))
        else:
            for chunk, batch in zip(self.chunks, self.loader):
                yield chunk, chunk * self.batch_size, batch


class TensorBatches:
    """Batches sliced from whole tensors (a preloaded TensorDataset or TensorTree): one indexing op
    per tensor per batch instead of a Python call per sample. Same sampler, same order: the same
    batches as a DataLoader."""

    def __init__(self, tensors: Any, sampler: Sampler[int], batch_size: int, drop_last: bool):
        self.tensors, self.sampler, self.batch_size, self.drop_last = (
            tensors,
            sampler,
            batch_size,
            drop_last,
        )

    def __len__(self) -> int:
        n = len(self.sampler)  # type: ignore[arg-type]
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, ...]]:
        device = next(batches.leaves(self.tensors))[1].device
        indices = torch.tensor(list(self.sampler), dtype=torch.long, device=device)
        for start in range(0, len(self) * self.batch_size, self.batch_size):
            batch = indices[start : start + self.batch_size]
            yield batches.take(self.tensors, batch)


class Loaders(NamedTuple):
    train: Iterable
    val: Optional[EvalSplit]  # None with data.val_fraction=0: nothing to validate on
    test: EvalSplit
    train_sampler: ResumableDistributedSampler
    batch_size: int  # per rank, of the training batches


def build_datasets(data_cfg: DataConf, rank: RankInfo, seed: int) -> dict[str, Optional[Dataset]]:
    """{"train", "val", "test"}: the source's splits, with validation carved from training where the
    source has none (val is None with data.val_fraction=0). Every rank builds them, alike; a
    download happens once, on rank 0, while the others wait."""
    dataset_cfg = data_cfg.dataset
    if dataset_cfg.get("download", False):
        splits = instantiate(dataset_cfg) if rank.is_main else None
        dist.barrier()
        splits = splits if rank.is_main else instantiate(dataset_cfg)
    else:
        splits = instantiate(dataset_cfg)
    if not isinstance(splits, (tuple, list)) or len(splits) not in (2, 3):
        raise UserError(
            f"data.dataset ({dataset_cfg.get('_target_')}) must return (train, test) or "
            f"(train, val, test), got {type(splits).__name__}"
        )
    streams = [type(split).__name__ for split in splits if isinstance(split, IterableDataset)]
    if streams:
        raise EveryRankError(stream_refusal(str(dataset_cfg.get("_target_")), streams[0]))
    train, *val, test = splits
    if data_cfg.overfit_batches:  # the first samples, trained and validated on: loss must reach ~0
        n = min(len(train), data_cfg.overfit_batches * data_cfg.batch_size * rank.world_size)
        train = (
            batches.rows(train, slice(0, n))
            if batches.whole(train) is not None
            else Subset(train, list(range(n)))
        )
        return {"train": train, "val": train, "test": test}
    fraction = data_cfg.val_fraction
    if fraction == 0:
        return {"train": train, "val": None, "test": test}
    if val:
        return {"train": train, "val": val[0], "test": test}
    train, carved = carve(train, fraction, seed)
    return {"train": train, "val": carved, "test": test}


def stream_refusal(target: str, stream: str) -> str:
    """Why a stream (an IterableDataset: webdataset's, datasets' streaming, torchdata's) is refused,
    and how to train on its samples: as shards."""
    return (
        f"data.dataset ({target}) gives a stream ({stream}, an IterableDataset): exact resume and "
        f"every-sample-once evaluation need samples by index; write it as shards (python -m "
        f"hydra_ddp.tools.shards write DIR --source {target}) and train with data=shards "
        "data.dataset.root=DIR (docs/streaming.md)"
    )


def carve(train: Dataset, fraction: float, seed: int) -> tuple[Dataset, Dataset]:
    """(rest, validation): `fraction` of the training set, chosen by a permutation seeded with
    `seed`. In-memory tensors stay whole tensors (sliced), so data.preload keeps working; a shard
    directory gives whole shards."""
    if isinstance(train, shards.ShardedDataset):
        return shards.carve(train, fraction, seed)
    n = len(train)  # type: ignore[arg-type]
    n_val = max(1, round(n * fraction))
    if n_val >= n:
        raise UserError(
            f"data.val_fraction={fraction} leaves no training "
            f"samples out of {n}; choose a smaller one"
        )
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    keep, held_out = order[n_val:].sort().values, order[:n_val].sort().values  # in dataset order
    if batches.whole(train) is not None:
        return batches.rows(train, keep), batches.rows(train, held_out)
    return Subset(train, keep.tolist()), Subset(train, held_out.tolist())


def loader_options(
    data_cfg: DataConf, seed: int, device: torch.device, rank: int = 0
) -> dict[str, Any]:
    workers = data_cfg.num_workers
    # Its own generator: starting an epoch's iterator then draws nothing from the global RNG, which
    # the model (dropout) uses, so a resumed run sees the same random numbers as an unbroken one.
    # Per rank: the loader workers' own seeds (drawn from it) differ between ranks.
    options: dict[str, Any] = dict(
        num_workers=workers,
        pin_memory=data_cfg.pin_memory and device.type == "cuda",
        generator=torch.Generator().manual_seed(sample_seed(seed, -1, rank)),
        collate_fn=batches.collate,  # default_collate's, and dataclass samples too
    )
    if workers > 0:
        options.update(
            persistent_workers=data_cfg.persistent_workers,
            prefetch_factor=data_cfg.prefetch_factor,
            worker_init_fn=loader_worker_init,
        )
        # Forked from the rank, as DataLoader does by default on Linux. A rank is itself a child of
        # the launcher's forkserver, so it would inherit "forkserver" as its default: its loader
        # workers would then be children of a forkserver of the rank's own, watching that forkserver
        # instead of the rank, and could outlive the run (holding its output open) when the rank
        # exits.
        if sys.platform == "linux":
            options["multiprocessing_context"] = FORK_BLOCKING_STOPS
    return options


def eval_split(
    dataset: Dataset, data_cfg: DataConf, rank: RankInfo, seed: int, device: torch.device
) -> EvalSplit:
    return EvalSplit(
        dataset,
        data_cfg.eval_batch_size,
        rank,
        device,
        _preloaded(dataset, data_cfg),
        loader_options(data_cfg, seed, device, rank.rank),
    )


def _preloaded(dataset: Dataset, data_cfg: DataConf) -> bool:
    if data_cfg.preload and batches.whole(dataset) is None:
        raise UserError(
            "data.preload=true needs datasets held as whole tensors (a "
            "TensorDataset, as digits and synthetic give, or a "
            "data.batches.TensorTree, as text_dicts gives); set it false"
        )
    return bool(data_cfg.preload)


def draws_randomness(dataset: Dataset) -> bool:
    """Whether a dataset's samples may draw random numbers (a transform's): unless it, or the
    dataset a Subset of it views, says `draws_randomness = False`."""
    while isinstance(dataset, Subset):
        dataset = dataset.dataset
    return getattr(dataset, "draws_randomness", True)


def build_loaders(
    data_cfg: DataConf,
    rank: RankInfo,
    seed: int,
    device: torch.device,
    shard: Optional[RankInfo] = None,
) -> Loaders:
    """This rank's loaders. `shard`: which share of the data it reads when that is not its rank's
    (tensor parallel: the ranks of a model replica read the same batches)."""
    shard = shard or rank
    if data_cfg.num_workers > 0 and rank.is_main and not hangs.fork_safe_python():
        log.warning(
            "data.num_workers=%d on Python %s: a loader worker can, "
            "rarely, deadlock as it is forked (CPython gh-112275, fixed in "
            "3.11.10 and 3.12); the watchdog's report names such a worker",
            data_cfg.num_workers,
            platform.python_version(),
            extra=FILE_ONLY,
        )
    splits = build_datasets(data_cfg, rank, seed)
    train_set = splits["train"]
    # In-memory tensors draw no randomness per sample: they are sliced whole (data.preload),
    # unwrapped. So are datasets that say they draw none (`draws_randomness = False`: no transform,
    # no sampling): seeding torch's generator per sample costs about 0.2 ms a sample on a CPU.
    seeded = batches.whole(train_set) is None and draws_randomness(train_set)
    # A shard directory's samples in shard windows (read as a stream); any other dataset by index.
    sampler = (
        ShardWindowSampler
        if isinstance(train_set, shards.ShardedDataset)
        else ResumableDistributedSampler
    )
    train_sampler = sampler(
        train_set,
        num_replicas=shard.world_size,
        rank=shard.rank,
        shuffle=True,
        seed=seed,
        pad=data_cfg.even_shards,
        keyed=seeded,
        by_length=_by_length(train_set, data_cfg),
    )
    val, test = (
        eval_split(splits[s], data_cfg, shard, seed, device) if splits[s] is not None else None
        for s in ("val", "test")
    )
    if _preloaded(train_set, data_cfg):
        on_device = batches.to_device(batches.whole(train_set), device)
        train: Iterable = TensorBatches(
            on_device, train_sampler, data_cfg.batch_size, data_cfg.drop_last
        )
    else:
        train = DataLoader(
            SeededSamples(train_set, seed) if seeded else train_set,
            batch_size=data_cfg.batch_size,
            sampler=train_sampler,
            drop_last=data_cfg.drop_last,
            **{
                **loader_options(data_cfg, seed, device, rank.rank),
                "collate_fn": batches.collate_for(train_set),
            },
        )
    return Loaders(train, val, test, train_sampler, data_cfg.batch_size)  # type: ignore[arg-type]


def save_with_run(data_cfg: DataConf, run_dir: Path) -> Optional[Path]:
    """What the data source keeps with the run (data=documents: its tokenizer, as transformers loads
    it), written by rank 0: where, or None for a source that keeps nothing."""
    from hydra_ddp.config import targets

    source = targets.locate(data_cfg.dataset["_target_"], "data.dataset")
    save = getattr(source, "save_with_run", None)
    return save(data_cfg.dataset, run_dir) if save is not None else None


def _by_length(train_set: Dataset, data_cfg: DataConf) -> Optional[tuple[torch.Tensor, int, int]]:
    """data.group_by_length: (each sample's length, samples per optimizer step, steps per
    window)."""
    if data_cfg.group_by_length is None:
        return None
    lengths = batches.lengths_of(train_set)
    if lengths is None:
        raise EveryRankError(
            f"data.group_by_length={data_cfg.group_by_length}: the training set "
            f"({type(train_set).__name__}) does not say its samples' lengths (a "
            "`lengths` tensor, as data=documents has); leave it null"
        )
    return lengths, data_cfg.global_batch_size, data_cfg.group_by_length
