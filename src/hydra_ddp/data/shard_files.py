"""The shard format on disk, and writing it: a shard file's layout (a header, then each field's
block, aligned), a shard's entry in the manifest, and `write`, which turns each split's samples into
shard files and the manifest (data.shards reads them; `shards.write` is this function)."""

from __future__ import annotations

import json
import os
import zlib
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch
from torch.utils.data import Dataset

from hydra_ddp.errors import UserError

FORMAT = "hydra-ddp-shards"
VERSION = 2  # 2: ragged fields (values and offsets); version 1 directories read as before
READABLE = (1, 2)
MAGIC = b"HDDPSHRD"
ALIGN = 64  # each field's block starts at a multiple of this: aligned memory maps
MANIFEST = "manifest.json"


@dataclass(frozen=True)
class ShardInfo:
    file: str  # relative to the directory
    samples: int
    bytes: int
    crc32: int


# --- writing -------------------------------------------------------------------------------------
def _fields(sample: Any) -> tuple[str, list[tuple[str, np.ndarray]]]:
    """(structure, [(name, array)]) of one sample: a tuple/list of leaves, or a dict of them."""
    if isinstance(sample, Mapping):
        return "dict", [(str(key), _array(value, key)) for key, value in sample.items()]
    if isinstance(sample, (tuple, list)):
        return "tuple", [(str(i), _array(value, i)) for i, value in enumerate(sample)]
    raise UserError(
        f"a shard sample must be a tuple or a dict of arrays, got {type(sample).__name__}"
    )


def _array(value: Any, name: Any) -> np.ndarray:
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().numpy()
    array = np.asarray(value)
    if array.dtype == object or array.dtype.kind in "USV":
        raise UserError(
            f"a shard sample's field {name!r} is "
            f"{type(value).__name__}: only numbers and arrays store"
        )
    return array


def pad(length: int) -> int:
    return -length % ALIGN


def _write_shard(path: Path, samples: list[Any]) -> ShardInfo:
    """One shard file, written in one go from the samples given to it."""
    structure, first = _fields(samples[0])
    names = [name for name, _ in first]
    columns: dict[str, list[np.ndarray]] = {name: [] for name in names}
    for i, sample in enumerate(samples):
        kind, fields = _fields(sample)
        if kind != structure or [name for name, _ in fields] != names:
            raise UserError(
                f"sample {i} of {path.name} has fields {[n for n, _ in fields]}, not {names}"
            )
        for name, array in fields:
            columns[name].append(array)
    blocks = []  # (field, array): a field's block, or a ragged field's values then its offsets
    header: dict[str, Any] = {"samples": len(samples), "structure": structure, "fields": []}
    offset = 0  # from the start of the data, fixed up below once the header's length is known
    for name in names:
        arrays = columns[name]
        shapes, dtypes = {a.shape for a in arrays}, {a.dtype for a in arrays}
        ragged = (
            len(shapes) > 1
            and all(a.ndim >= 1 for a in arrays)
            and len({a.shape[1:] for a in arrays}) == 1
        )
        if len(dtypes) != 1 or (len(shapes) != 1 and not ragged):
            raise UserError(
                f"field {name!r} of {path.name} has shapes {sorted(shapes)} and dtypes "
                f"{sorted(map(str, dtypes))}: a field needs one dtype, and shapes that "
                "differ in their first dimension at most (a sequence of any length)"
            )
        entry = {"name": name, "dtype": arrays[0].dtype.str, "offset": offset}
        if ragged:
            values = np.ascontiguousarray(np.concatenate(arrays))
            ends = np.cumsum([0, *(len(a) for a in arrays)], dtype=np.int64)
            entry.update(shape=list(arrays[0].shape[1:]), ragged=True, values=len(values))
            entry["offsets_at"] = offset + values.nbytes + pad(values.nbytes)
            parts = [values, ends]
        else:
            block = np.ascontiguousarray(np.stack(arrays))
            entry["shape"] = list(block.shape[1:])
            parts = [block]
        for part in parts:
            blocks.append(part)
            offset += part.nbytes + pad(part.nbytes)
        header["fields"].append(entry)
    # Offsets are from the data's start (the header's end, aligned): the header's length cannot
    # change them.
    encoded = json.dumps(header).encode()
    crc = 0
    head = MAGIC + len(encoded).to_bytes(8, "little") + encoded
    with open(path, "wb") as f:
        for chunk in (head, bytes(pad(len(head)))):
            f.write(chunk)
            crc = zlib.crc32(chunk, crc)
        for block in blocks:
            for chunk in (block.tobytes(), bytes(pad(block.nbytes))):
                f.write(chunk)
                crc = zlib.crc32(chunk, crc)
        size = f.tell()
    return ShardInfo(path.name, len(samples), size, crc)


def write(
    root: str | os.PathLike,
    splits: Mapping[str, Iterable[Any]],
    samples_per_shard: int,
    meta: Optional[Mapping[str, Any]] = None,
) -> dict[str, Any]:
    """Write each split's samples (any iterable: a Dataset, a generator) as shards of
    `samples_per_shard` samples under `root`, and the manifest last (a directory without one is not
    a shard directory: a write that stopped part-way is never read). `meta`: what the data is (its
    number of classes, image size, ...), checked against data.* before a run. Returns the
    manifest."""
    if samples_per_shard < 1:
        raise UserError(f"samples_per_shard={samples_per_shard}: at least 1")
    out = Path(root)
    out.mkdir(parents=True, exist_ok=True)
    (out / MANIFEST).unlink(missing_ok=True)
    manifest: dict[str, Any] = {
        "format": FORMAT,
        "version": VERSION,
        "meta": dict(meta or {}),
        "splits": {},
    }
    for split, samples in splits.items():
        shards: list[ShardInfo] = []
        pending: list[Any] = []
        for sample in _iterate(samples):
            pending.append(sample)
            if len(pending) == samples_per_shard:
                shards.append(_write_shard(out / f"{split}-{len(shards):06d}.shard", pending))
                pending = []
        if pending:
            shards.append(_write_shard(out / f"{split}-{len(shards):06d}.shard", pending))
        manifest["splits"][split] = [vars(s) for s in shards]
    (out / (MANIFEST + ".tmp")).write_text(json.dumps(manifest, indent=1))
    os.replace(out / (MANIFEST + ".tmp"), out / MANIFEST)
    return manifest


def _iterate(samples: Iterable[Any]) -> Iterator[Any]:
    # a map-style dataset may not iterate
    if isinstance(samples, Dataset) and hasattr(samples, "__len__"):
        return (samples[i] for i in range(len(samples)))  # type: ignore[arg-type]
    return iter(samples)
