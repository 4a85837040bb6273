"""A test-only dataset that records every sample read from it, to prove when a split is read."""

import os
import time
from pathlib import Path

from torch.utils.data import Dataset, IterableDataset

from hydra_ddp.data import digits


class Recorded(Dataset):
    """`base`, appending "index time" to READS/<pid>.txt on every read."""

    def __init__(self, base: Dataset, reads: str):
        self.base, self.reads = base, Path(reads)

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, index: int):
        with open(self.reads / f"{os.getpid()}.txt", "a") as f:
            f.write(f"{index} {time.time()}\n")
        return self.base[index]


def digits_recording_test(reads: str, **kwargs):
    """The default digits, their test split recorded."""
    train, test = digits(**kwargs)
    return train, Recorded(test, reads)


class SlowOnRank(Dataset):
    """`base`, each read taking `delay_s` longer on one rank: a rank held back by its data."""

    def __init__(self, base: Dataset, rank: int, delay_s: float):
        self.base, self.rank, self.delay_s = base, rank, delay_s

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, index: int):
        import torch.distributed as dist

        if dist.get_rank() == self.rank:
            time.sleep(self.delay_s)  # the slowness under test, not a wait for anything
        return self.base[index]


def digits_slow_on_rank(slow_rank: int, delay_s: float, **kwargs):
    """The default digits, their training reads slow on one rank (validation keeps its own pace)."""
    train, test = digits(**kwargs)
    return SlowOnRank(train, slow_rank, delay_s), test, test


def digits_recording_train(reads: str, **kwargs):
    """The default digits, their training split recorded (into READS, made here)."""
    Path(reads).mkdir(parents=True, exist_ok=True)
    train, test = digits(**kwargs)
    return Recorded(train, reads), test


def sharded_recording_train(reads: str, root: str, shuffle_window: int = 8192):
    """A shard directory's splits (data=shards), its training split recorded (into READS, made
    here): the reads of a split that is read in shard windows, by ranks and their loader workers."""
    from hydra_ddp.data.shards import ShardedDataset, sharded

    class RecordedShards(ShardedDataset):
        def __getitems__(self, indices):
            with open(Path(reads) / f"{os.getpid()}.txt", "a") as f:
                f.writelines(f"{index} {time.time()}\n" for index in indices)
            return super().__getitems__(indices)

    Path(reads).mkdir(parents=True, exist_ok=True)
    train, *rest = sharded(root, shuffle_window)
    return (RecordedShards(train.root, train.shards, train.shuffle_window, train.pad_id), *rest)


class Stream(IterableDataset):
    """A stream of the digits' training samples (an IterableDataset, as webdataset or datasets'
    streaming give): what the loop refuses, in one line that says how to write it as shards."""

    def __init__(self, **kwargs):
        self.kwargs = kwargs  # a data config's keys, taken as the digits' (image_size, seed, ...)

    def __iter__(self):
        train, _ = digits(
            **{k: v for k, v in self.kwargs.items() if k in ("image_size", "test_fraction", "seed")}
        )
        return iter(train)


def streamed(**kwargs):
    """The digits with their training split as a stream: refused by the workers, which build it."""
    _, test = digits(**kwargs)
    return Stream(**kwargs), test
