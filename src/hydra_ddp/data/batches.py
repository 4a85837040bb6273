"""A batch as a tree: any nesting of tuples, lists, dicts, named tuples and dataclasses with tensors
at its leaves (and anything else, such as strings or ids, passed through untouched). The loop moves
a batch to the device, counts its samples and records its shapes here, whatever its shape."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch.utils.data import Dataset, Subset, TensorDataset, default_collate

from hydra_ddp.errors import UserError

# the target of a position that counts in no loss (padding): PyTorch's and transformers' default
IGNORED = -100


def map_tensors(fn: Callable[[torch.Tensor], Any], batch: Any) -> Any:
    """The same tree with fn applied to each tensor; containers keep their types where they can be
    rebuilt from their items (a dict subclass that cannot is given back as a dict)."""
    if isinstance(batch, torch.Tensor):
        return fn(batch)
    if dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        changes = {
            f.name: map_tensors(fn, getattr(batch, f.name))
            for f in dataclasses.fields(batch)
            if f.init
        }
        return dataclasses.replace(batch, **changes)
    if isinstance(batch, Mapping):
        items = {key: map_tensors(fn, value) for key, value in batch.items()}
        if type(batch) is dict:
            return items
        try:
            return type(batch)(items)  # OrderedDict, transformers' BatchEncoding
        except TypeError:
            return items
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # a named tuple
        return type(batch)(*(map_tensors(fn, item) for item in batch))
    if isinstance(batch, (tuple, list)):
        return type(batch)(map_tensors(fn, item) for item in batch)
    return batch


def collate(samples: list[Any]) -> Any:
    """Samples into a batch, as DataLoader's default_collate does (tensors stacked, a tuple's items
    into a list), and dataclass samples into one dataclass of batched fields."""
    first = samples[0]
    if not _holds_dataclass(first):
        return default_collate(samples)
    if dataclasses.is_dataclass(first):
        fields = [f.name for f in dataclasses.fields(first) if f.init]
        return dataclasses.replace(
            first, **{name: collate([getattr(s, name) for s in samples]) for name in fields}
        )
    if isinstance(first, Mapping):
        return {key: collate([s[key] for s in samples]) for key in first}
    if isinstance(first, tuple) and hasattr(first, "_fields"):
        return type(first)(*(collate(list(items)) for items in zip(*samples)))
    return [collate(list(items)) for items in zip(*samples)]


def base_dataset(dataset: Dataset) -> Dataset:
    """The dataset a Subset (a carved validation split, say) views, however deep."""
    while isinstance(dataset, Subset):
        dataset = dataset.dataset
    return dataset


def collate_for(dataset: Dataset) -> Callable[[list[Any]], Any]:
    """How a dataset's samples become a batch: its own `collate` (data.text's padding of samples of
    different lengths), else collate."""
    return getattr(base_dataset(dataset), "collate", collate)


def lengths_of(dataset: Dataset) -> Any:
    """Each sample's length (a tensor), for data.group_by_length: a dataset's own `lengths`, through
    any Subset's indices; None where it has none."""
    views = []
    while isinstance(dataset, Subset):
        views.append(dataset.indices)
        dataset = dataset.dataset
    lengths = getattr(dataset, "lengths", None)
    if lengths is None:
        return None
    lengths = torch.as_tensor(lengths)
    for indices in reversed(views):
        lengths = lengths[torch.as_tensor(indices)]
    return lengths


def _holds_dataclass(sample: Any) -> bool:
    if dataclasses.is_dataclass(sample) and not isinstance(sample, type):
        return True
    if isinstance(sample, Mapping):
        return any(_holds_dataclass(v) for v in sample.values())
    if isinstance(sample, (tuple, list)):
        return any(_holds_dataclass(v) for v in sample)
    return False


def leaves(batch: Any, path: str = "batch") -> Iterator[tuple[str, torch.Tensor]]:
    """(where, tensor) for each tensor of the tree, `where` written as Python would reach it."""
    if isinstance(batch, torch.Tensor):
        yield path, batch
    elif dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        for f in dataclasses.fields(batch):
            yield from leaves(getattr(batch, f.name), f"{path}.{f.name}")
    elif isinstance(batch, Mapping):
        for key, value in batch.items():
            yield from leaves(value, f"{path}[{key!r}]")
    elif isinstance(batch, (tuple, list)):
        for i, item in enumerate(batch):
            yield from leaves(item, f"{path}[{i}]")


def count(batch: Any) -> int:
    """The samples in a batch: the leading dimension its tensors share (0-D tensors aside). One line
    when they disagree, or when it holds no tensor with a batch dimension."""
    sizes = [(path, tensor.shape[0]) for path, tensor in leaves(batch) if tensor.dim() > 0]
    if not sizes:
        raise UserError(
            f"a batch ({type(batch).__name__}) holds no tensor with a batch dimension: the data "
            "must give tensors (or a task's samples() must say how many samples a batch holds)"
        )
    first_path, first = sizes[0]
    for path, size in sizes[1:]:
        if size != first:
            raise UserError(
                f"a batch's tensors disagree on its size: {first_path} has {first} "
                f"samples, {path} has {size}; give every tensor of a sample the "
                "batch dimension first (or give the task a samples(batch))"
            )
    return first


def to_device(
    batch: Any, device: torch.device, memory_format: torch.memory_format = torch.preserve_format
) -> Any:
    """The batch on the device; `memory_format` (channels_last) for its images: its 4-D
    floating-point tensors (not an integer mask, nor an index)."""
    return map_tensors(
        lambda t: (
            t.to(device, non_blocking=True, memory_format=memory_format)
            if t.dim() == 4 and t.is_floating_point()
            else t.to(device, non_blocking=True)
        ),
        batch,
    )


def on_meta(batch: Any) -> Any:
    """The batch's shapes and dtypes, without its data: for the FLOP count (reporting/flops.py)."""
    return map_tensors(lambda t: torch.empty_like(t, device="meta"), batch)


def shaped(size: Any, dtype: torch.dtype) -> torch.Tensor:
    """A tensor's shape and dtype without its data (the meta device: no memory, any size): a sharded
    checkpoint's weights as its index names them (checkpoint/files.py)."""
    return torch.empty(size, dtype=dtype, device="meta")


def first_sample(batch: Any) -> Any:
    """The batch's first sample, as a batch of one, copied to the CPU (its 0-D tensors whole): what
    the FLOP count runs for real when a model cannot run on the meta device."""
    return map_tensors(lambda t: (t[:1] if t.dim() > 0 else t).detach().to("cpu", copy=True), batch)


def describe(batch: Any) -> str:
    """A batch's structure in a few words, for a message: 'a dict with keys input_ids, labels'."""
    if isinstance(batch, Mapping):
        return f"a {type(batch).__name__} with keys {', '.join(map(str, batch))}"
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):
        return f"a {type(batch).__name__} of {', '.join(batch._fields)}"
    if dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        return f"a {type(batch).__name__} of {', '.join(f.name for f in dataclasses.fields(batch))}"
    if isinstance(batch, (tuple, list)):
        return f"a {type(batch).__name__} of {len(batch)}"
    if isinstance(batch, torch.Tensor):
        return f"one tensor of shape {tuple(batch.shape)}"
    return f"a {type(batch).__name__}"


class TensorTree(Dataset):
    """A dataset held as one tree of whole tensors sharing their first dimension (a dict of tensors,
    say): sample i is the tree of each tensor's row i. Like a TensorDataset (a tuple of tensors), it
    is sliced whole: `data.preload=true` puts it on the device and cuts each batch with one
    index."""

    draws_randomness = False  # no per-sample seeding (data/loading.py)

    def __init__(self, tree: Any):
        self.tree = tree
        self.length = count(tree)

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: Any) -> Any:
        return take(self.tree, index)


def take(tree: Any, index: Any) -> Any:
    """Each tensor of a tree indexed alike (rows, a slice): a batch cut from whole tensors."""
    return map_tensors(lambda t: t[index], tree)


def whole(dataset: Dataset) -> Any:
    """The tree of whole tensors a dataset is held as (a TensorDataset's tuple, a TensorTree's
    tree), or None."""
    if isinstance(dataset, TensorDataset):
        return tuple(dataset.tensors)
    if isinstance(dataset, TensorTree):
        return dataset.tree
    return None


def rows(dataset: Dataset, index: Any) -> Dataset:
    """A whole-tensor dataset's rows `index`, still whole tensors (of the same kind)."""
    if isinstance(dataset, TensorDataset):
        return TensorDataset(*(t[index] for t in dataset.tensors))
    part = TensorTree(take(whole(dataset), index))
    part.about = getattr(dataset, "about", None)  # what its source read (data/about.py)
    return part
