"""Which samples a rank trains on, and the randomness each sample draws: a sampler that resumes
mid-epoch, and a seed per (epoch, sample)."""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Iterator
from typing import Any, Optional

import torch
from torch.utils.data import Dataset, DistributedSampler


class ResumableDistributedSampler(DistributedSampler):
    """DistributedSampler that can start part-way into an epoch, for an exact mid-epoch resume.

    `pad=False`: disjoint shards (rank r takes positions r, r+W, … of the epoch's shuffle), every
    sample once per epoch; shard lengths then differ by at most one sample, and ranks may run out
    of batches one batch apart (the loop keeps their collectives matched with DDP's Join).
    """

    def __init__(
        self,
        *args: Any,
        pad: bool = True,
        keyed: bool = False,
        by_length: Optional[tuple[torch.Tensor, int, int]] = None,
        **kwargs: Any,
    ):
        """`by_length`: (each sample's length, samples per optimizer step over all ranks, steps per
        window) to group the epoch's order by length (group_by_length), or None."""
        super().__init__(*args, **kwargs)
        self.pad = pad
        # yield (epoch, index): the key a SeededSamples dataset draws its randomness from
        self.keyed = keyed
        self.by_length = by_length
        self.start = 0
        if not pad:
            self.num_samples = len(range(self.rank, len(self.dataset), self.num_replicas))  # type: ignore[arg-type]

    def set_epoch(self, epoch: int) -> None:
        super().set_epoch(epoch)
        self.start = 0

    def skip(self, samples: int) -> None:
        """Leave out this epoch's first `samples` indices (already trained on before the stop)."""
        self.start = samples

    def __iter__(self) -> Iterator[Any]:
        if self.by_length is None:
            everyone = super().__iter__() if self.pad else self._shard(self._order())
        else:
            everyone = self._shard(
                grouped_by_length(self._order(), *self.by_length, self.seed, self.epoch)
            )
        indices = itertools.islice(everyone, self.start, None)
        return ((self.epoch, index) for index in indices) if self.keyed else indices

    def _order(self) -> torch.Tensor:
        """The epoch's order of every sample: DistributedSampler's shuffle, one permutation per
        epoch seeded by seed + epoch, equal on every rank."""
        n = len(self.dataset)  # type: ignore[arg-type]
        if not self.shuffle:
            return torch.arange(n)
        return torch.randperm(n, generator=torch.Generator().manual_seed(self.seed + self.epoch))

    def _shard(self, order: torch.Tensor) -> Iterator[int]:
        """This rank's positions r, r+W, … of the order; padded as DistributedSampler pads (the
        first samples again) where every rank takes as many."""
        if self.pad and len(order) < self.total_size:
            order = torch.cat(
                [
                    order,
                    order.repeat(math.ceil(self.total_size / len(order)))[
                        : self.total_size - len(order)
                    ],
                ]
            )
        return iter(
            order[self.rank : self.total_size if self.pad else None : self.num_replicas].tolist()
        )

    def __len__(self) -> int:
        return max(0, self.num_samples - self.start)


def grouped_by_length(
    order: torch.Tensor, lengths: torch.Tensor, step: int, window: int, seed: int, epoch: int
) -> torch.Tensor:
    """The epoch's `order` with the samples of each window of `window` optimizer steps (`step`
    samples each, over all ranks) sorted by length, longest first, so that a step's samples are of
    similar lengths (less padding), then the window's steps in an order seeded by (seed, epoch,
    window). Steps stay whole and aligned (only the epoch's last may be short, and stays last), so
    the split of a step over ranks and micro-batches, hence the world size, changes nothing."""
    size = step * window
    parts = []
    for number, start in enumerate(range(0, len(order), size)):
        chunk = order[start : start + size]
        chunk = chunk[torch.sort(lengths[chunk], descending=True, stable=True).indices]
        steps = list(chunk.split(step))
        whole = len(steps) - (len(steps[-1]) < step)  # a short last step of the epoch stays last
        shuffle = sample_seed(seed, epoch, number) & 0x7FFF_FFFF_FFFF_FFFF
        permuted = torch.randperm(whole, generator=torch.Generator().manual_seed(shuffle)).tolist()
        parts += [steps[i] for i in permuted] + steps[whole:]
    return torch.cat(parts) if parts else order


def sample_seed(seed: int, epoch: int, index: int) -> int:
    """A 64-bit seed for one sample in one epoch (splitmix64 over the three): distinct per sample
    and epoch, and a function of nothing else, so not of the rank, the world size or the step."""
    value = 0
    for part in (seed, epoch, index):
        value = (value ^ part) + 0x9E3779B97F4A7C15 & 0xFFFFFFFFFFFFFFFF
        value = (value ^ value >> 30) * 0xBF58476D1CE4E5B9 & 0xFFFFFFFFFFFFFFFF
        value = (value ^ value >> 27) * 0x94D049BB133111EB & 0xFFFFFFFFFFFFFFFF
        value ^= value >> 31
    return value


class SeededSamples(Dataset):
    """A training set whose samples draw their randomness (torchvision's random crops and flips, any
    transform drawing from torch's generator) from a seed of (trainer.seed, epoch, sample index):
    every sample augmented its own way, each epoch anew, and the same way at any world size, on any
    rank, in any loader worker, and after a mid-epoch resume. The sampler hands it (epoch, index)
    keys; the caller's own random stream (the model's dropout) is left as it was."""

    def __init__(self, dataset: Dataset, seed: int):
        self.dataset, self.seed = dataset, seed

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __getitem__(self, key: tuple[int, int]) -> Any:
        epoch, index = key
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(sample_seed(self.seed, epoch, index))
            return self.dataset[index]


class ShardWindowOrder:
    """One epoch's order of a sharded dataset's samples, computed, never stored whole: the shards in
    a permutation seeded by (seed, epoch), their samples laid end to end, and the positions shuffled
    within consecutive windows of `window` (each window its own seeded permutation). Position p
    holds `self[p]`, a sample index; only the window being read is held, and only while it is
    read."""

    def __init__(
        self, shard_sizes: list[int], seed: int, epoch: int, window: int, shuffle: bool = True
    ):
        count = len(shard_sizes)
        self.shards = (
            torch.randperm(count, generator=torch.Generator().manual_seed(seed + epoch)).tolist()
            if shuffle
            else list(range(count))
        )
        # From the sizes alone (not the dataset's own index): the order is a function of the sizes,
        # the seed and the epoch, computed once per epoch.
        # each shard's first sample index in the dataset
        starts = [0, *itertools.accumulate(shard_sizes)]
        self.first_index = [starts[s] for s in self.shards]
        self.bounds = [0, *itertools.accumulate(shard_sizes[s] for s in self.shards)]  # by position
        self.size, self.seed, self.epoch = self.bounds[-1], seed, epoch
        self.window = window if shuffle else 1
        self._cached: tuple[int, list[int]] = (-1, [])

    def __len__(self) -> int:
        return self.size

    def _within(self, number: int) -> list[int]:
        if self._cached[0] != number:
            length = min(self.window, self.size - number * self.window)
            seed = sample_seed(self.seed, self.epoch, number) & 0x7FFF_FFFF_FFFF_FFFF
            self._cached = (
                number,
                torch.randperm(length, generator=torch.Generator().manual_seed(seed)).tolist(),
            )
        return self._cached[1]

    def __getitem__(self, position: int) -> int:
        if self.window > 1:
            number, offset = divmod(position, self.window)
            position = number * self.window + self._within(number)[offset]
        shard = bisect.bisect_right(self.bounds, position) - 1
        return self.first_index[shard] + position - self.bounds[shard]


class ShardWindowSampler(ResumableDistributedSampler):
    """ResumableDistributedSampler's contract (position r, r+W, … of the epoch's order to rank r;
    `pad`, `skip`, `keyed` alike) over a ShardWindowOrder instead of a permutation of every index:
    a sharded dataset is read window by window, and after b batches of B per rank at W ranks the
    first b·B·W positions are read, at any W (so a resize continues with every other sample
    once)."""

    def __iter__(self) -> Iterator[Any]:
        dataset = self.dataset
        order = ShardWindowOrder(
            dataset.shard_sizes, self.seed, self.epoch, dataset.shuffle_window, self.shuffle
        )  # type: ignore[attr-defined]
        n, rank, ranks = len(order), self.rank, self.num_replicas
        # Padded: the positions past the end wrap to the first ones, as DistributedSampler repeats
        # its first indices.
        indices = (order[(rank + j * ranks) % n] for j in range(self.start, self.num_samples))
        return ((self.epoch, index) for index in indices) if self.keyed else indices
