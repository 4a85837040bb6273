"""Datasets stored as many shard files on disk, read in windows of shards, never loaded whole.

A shard directory holds `manifest.json` (each split's shards, their sample counts, sizes and
CRC-32s) and the shard files. A shard holds a fixed number of samples (tuples or dicts of arrays),
field by field: a field of one shape as one block, one whose samples differ in their first dimension
(token ids) as its values end to end and their offsets; read through memory maps (only the pages a
read touches come from disk). Token ids are padded per batch where the manifest gives a padding id.

A sample's address is (shard, offset), and the training order is index arithmetic over the
manifest's counts (sampling.ShardWindowSampler): shards in a seeded order each epoch, samples
shuffled within windows of consecutive positions. Every rank, loader worker and resumed run computes
the same order without reading anything: a mid-epoch resume is exact at any world size, and the
order does not depend on the number of loader workers.

Write shards with `python -m hydra_ddp.tools.shards write DIR --source digits` (any source of
conf/data, or your own function returning splits), or `write()` from your own code, one sample at a
time: nothing is held but one shard. Check them with `python -m hydra_ddp.tools.shards verify DIR`.
"""

from __future__ import annotations

import bisect
import collections
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch
from torch.utils.data import Dataset

from hydra_ddp.config.schema import DataConf
from hydra_ddp.data.shard_files import FORMAT, MAGIC, MANIFEST, READABLE, VERSION, ShardInfo, pad
from hydra_ddp.data.shard_files import write as write  # shards.write, as documented
from hydra_ddp.errors import UserError

# memory maps a reader keeps open: more than a shuffle window spans at the default sizes
OPEN_SHARDS = 64


class ShardError(UserError):
    """A shard directory or file that cannot be read as written: what is wrong, and what to do."""


# --- reading ------------------------------------------------------------------------------------
def read_manifest(root: str | os.PathLike) -> dict[str, Any]:
    path = Path(root).expanduser()
    if not path.is_dir():
        raise ShardError(
            f"data.dataset.root={str(root)!r}: no such directory; write shards there first ({_HOW})"
        )
    manifest_path = path / MANIFEST
    if not manifest_path.is_file():
        found = len(list(path.glob("*.shard")))
        what = (
            f"{found} shard files but no {MANIFEST} (a write stopped part-way?)"
            if found
            else "no shards"
        )
        raise ShardError(
            f"data.dataset.root={str(root)!r} holds {what}; write shards there ({_HOW})"
        )
    try:
        manifest = json.loads(manifest_path.read_text())
    except (OSError, ValueError) as e:
        raise ShardError(
            f"{manifest_path} cannot be read ({e}); write the shards again ({_HOW})"
        ) from None
    if manifest.get("format") != FORMAT or manifest.get("version") not in READABLE:
        raise ShardError(
            f"{manifest_path} is not a {FORMAT} v{VERSION} "
            f"manifest; write the shards again ({_HOW})"
        )
    return manifest


_HOW = "python -m hydra_ddp.tools.shards write DIR --source digits"


def split_shards(root: str | os.PathLike, manifest: dict[str, Any], split: str) -> list[ShardInfo]:
    shards = [ShardInfo(**entry) for entry in manifest["splits"].get(split, [])]
    if not shards or not sum(s.samples for s in shards):
        raise ShardError(
            f"{Path(root) / MANIFEST}: the {split} split has "
            "no samples; write it (or pick another root)"
        )
    return shards


def check_files(root: str | os.PathLike, shards: list[ShardInfo]) -> None:
    """Every shard present at its written size (a stat each, no reads): a missing or truncated shard
    is found before launch. A shard whose bytes changed in place is found when it is opened."""
    for shard in shards:
        path = Path(root) / shard.file
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            raise ShardError(f"shard {path} is missing; write the shards again ({_HOW})") from None
        if size != shard.bytes:
            raise ShardError(
                f"shard {path} has {size} bytes, its manifest says {shard.bytes} "
                f"(truncated or rewritten); write the shards again ({_HOW})"
            )


class ShardFile:
    """One shard's fields as memory maps, checked against the manifest when opened."""

    def __init__(self, path: Path, info: ShardInfo):
        try:
            with open(path, "rb") as f:
                magic, length = f.read(len(MAGIC)), int.from_bytes(f.read(8), "little")
                if magic != MAGIC or not 0 < length < info.bytes:
                    raise ValueError("not a shard file (bad magic or header length)")
                header = json.loads(f.read(length))
            start = len(MAGIC) + 8 + length
            start += pad(start)
            if header["samples"] != info.samples:
                raise ValueError(f"{header['samples']} samples, the manifest says {info.samples}")
            self.structure, self.columns = header["structure"], []
            for field in header["fields"]:
                ragged, name = field.get("ragged"), field["name"]
                # a ragged field: its values, then offsets
                rows = field["values"] if ragged else info.samples
                values = _map(
                    path,
                    info,
                    name,
                    np.dtype(field["dtype"]),
                    (rows, *field["shape"]),
                    start + field["offset"],
                )
                ends = (
                    _map(
                        path,
                        info,
                        name,
                        np.dtype(np.int64),
                        (info.samples + 1,),
                        start + field["offsets_at"],
                    )
                    if ragged
                    else None
                )
                self.columns.append((name, values, ends))
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ShardError(
                f"shard {path} is corrupt ({e}); write the shards again ({_HOW}), or find "
                f"the bad ones with python -m hydra_ddp.tools.shards verify {path.parent}"
            ) from None

    def take(self, offsets: Any) -> list[Any]:
        """The samples at `offsets` (a sorted array), each a tuple or a dict of tensors."""
        values = []
        for name, column, ends in self.columns:
            if ends is None:
                values.append((name, torch.from_numpy(np.array(column[offsets]))))
            else:  # a ragged field: each sample's own slice of the values
                values.append(
                    (
                        name,
                        [
                            torch.from_numpy(np.array(column[ends[i] : ends[i + 1]]))
                            for i in offsets
                        ],
                    )
                )
        if self.structure == "dict":
            return [{name: value[i] for name, value in values} for i in range(len(offsets))]
        return [tuple(value[i] for _, value in values) for i in range(len(offsets))]


def _map(
    path: Path, info: ShardInfo, name: str, dtype: np.dtype, shape: tuple[int, ...], offset: int
) -> Any:
    if offset + dtype.itemsize * int(np.prod(shape)) > info.bytes:
        raise ValueError(f"field {name!r} runs past the end of the file")
    return np.memmap(path, dtype, "r", offset, shape)


class ShardedDataset(Dataset):
    """One split of a shard directory: sample i is the i-th in the manifest's shard order. Reads go
    to the shards through memory maps, a few dozen kept open per process (a loader worker opens its
    own after the fork)."""

    # samples as stored: no per-sample seeding needed (loading.draws_randomness)
    draws_randomness = False

    def __init__(
        self,
        root: str | os.PathLike,
        shards: list[ShardInfo],
        shuffle_window: int,
        pad_id: Optional[int] = None,
    ):
        """`pad_id`: a directory of token ids' padding id (its manifest's meta): batches are
        padded."""
        self.root, self.shards, self.shuffle_window, self.pad_id = (
            Path(root),
            list(shards),
            shuffle_window,
            pad_id,
        )
        self.shard_sizes = [s.samples for s in self.shards]
        # sample index of each shard's first
        self.starts = np.cumsum([0, *self.shard_sizes]).tolist()
        self._open: collections.OrderedDict[int, ShardFile] = collections.OrderedDict()
        if pad_id is not None:
            from hydra_ddp.data.text import PadCollate

            self.collate = PadCollate(pad_id)  # samples of different lengths, padded per batch

    def __len__(self) -> int:
        return self.starts[-1]

    def __getstate__(self) -> dict[str, Any]:  # to a spawned loader worker: without the open maps
        return {**self.__dict__, "_open": collections.OrderedDict()}

    def _shard(self, number: int) -> ShardFile:
        shard = self._open.pop(number, None) or ShardFile(
            self.root / self.shards[number].file, self.shards[number]
        )
        self._open[number] = shard  # the most recently used last
        if len(self._open) > OPEN_SHARDS:
            self._open.popitem(last=False)
        return shard

    def locate(self, index: int) -> tuple[int, int]:
        """(shard, offset) of sample `index`."""
        if not 0 <= index < len(self):
            raise IndexError(f"sample {index} of {len(self)}")
        shard = bisect.bisect_right(self.starts, index) - 1
        return shard, index - self.starts[shard]

    def __getitem__(self, index: int) -> Any:
        shard, offset = self.locate(index)
        return self._shard(shard).take(np.array([offset]))[0]

    def __getitems__(self, indices: list[int]) -> list[Any]:
        """A batch's samples, read shard by shard (DataLoader calls this with a batch's indices)."""
        where = [self.locate(i) for i in indices]
        by_shard: dict[int, list[int]] = collections.defaultdict(list)
        for position, (shard, _) in enumerate(where):
            by_shard[shard].append(position)
        samples: list[Any] = [None] * len(indices)
        for shard, positions in by_shard.items():
            offsets = np.array([where[p][1] for p in positions])
            for position, sample in zip(positions, self._shard(shard).take(offsets)):
                samples[position] = sample
        return samples

    def subset(self, shards: list[int]) -> ShardedDataset:
        """The same directory's split, of these shards only."""
        return ShardedDataset(
            self.root, [self.shards[i] for i in shards], self.shuffle_window, self.pad_id
        )


def carve(
    train: ShardedDataset, fraction: float, seed: int
) -> tuple[ShardedDataset, ShardedDataset]:
    """(rest, validation): whole shards, `fraction` of them chosen by a permutation seeded with
    `seed`, so both splits stay shard directories read in windows."""
    count = len(train.shards)
    held = max(1, round(count * fraction))
    if held >= count:
        raise UserError(
            f"data.val_fraction={fraction} holds out {held} of the "
            f"{count} training shards, leaving none; choose a smaller "
            "fraction, write a val split, or write more, smaller shards"
        )
    order = torch.randperm(count, generator=torch.Generator().manual_seed(seed))
    keep, val = sorted(order[held:].tolist()), sorted(order[:held].tolist())
    return train.subset(keep), train.subset(val)


def sharded(root: str, shuffle_window: int = 8192) -> tuple[Dataset, ...]:
    """A shard directory's splits: (train, test), or (train, val, test) where it has a val split.
    `shuffle_window`: training samples are shuffled within windows of this many consecutive
    positions of the epoch's shard order (1: shards in a new order each epoch, each read
    through)."""
    if shuffle_window < 1:
        raise UserError(
            f"data.dataset.shuffle_window={shuffle_window}: "
            "at least 1 (1: no shuffle within shards)"
        )
    manifest = read_manifest(root)
    names = ["train", *(["val"] if manifest["splits"].get("val") else []), "test"]
    pad_id = manifest.get("meta", {}).get("pad_id")
    return tuple(
        ShardedDataset(root, split_shards(root, manifest, name), shuffle_window, pad_id)
        for name in names
    )


def check(dataset_cfg: Mapping[str, Any], data_cfg: DataConf) -> None:
    """Before launch: the directory, its manifest, every shard there at its size, and the data.*
    keys the manifest's meta records (a model built for other data would fail in a worker)."""
    root = dataset_cfg.get("root")
    window = dataset_cfg.get("shuffle_window", 8192)
    if not isinstance(window, int) or window < 1:
        raise UserError(f"data.dataset.shuffle_window={window}: a whole number, at least 1")
    manifest = read_manifest(root)
    for split in ("train", "test", *(["val"] if manifest["splits"].get("val") else [])):
        check_files(root, split_shards(root, manifest, split))
    meta = manifest.get("meta", {})
    if "vocab_size" in meta and data_cfg.num_classes < meta["vocab_size"]:
        raise UserError(
            f"data.num_classes={data_cfg.num_classes} but the shards in "
            f"{root} hold token ids of a vocabulary of {meta['vocab_size']} "
            f"(their tokenizer's); set data.num_classes={meta['vocab_size']}"
        )
    for key, value in meta.items():
        if key in ("num_classes", "in_channels", "image_size") and getattr(data_cfg, key) != value:
            raise UserError(
                f"data.{key}={getattr(data_cfg, key)} but the shards in "
                f"{root} hold data with {key}={value}; set data.{key}={value}"
            )
