"""A test-only dataset that records every sample read from it, to prove when a split is read."""

import os
import time
from pathlib import Path

from torch.utils.data import Dataset

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
