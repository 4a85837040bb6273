"""Datasets (built from conf/data/*.yaml through `_target_`), samplers and loaders.

Every dataset function returns `(train, test)`, or `(train, val, test)` where the source has a
validation split of its own; otherwise `data.val_fraction` of the training set becomes the
validation split, chosen by `trainer.seed` (the same on every rank and every launcher).

Training shards with DistributedSampler (padded so every rank runs the same number of steps,
unless `data.even_shards=false`). Evaluation splits into fixed chunks of `eval_batch_size`
consecutive samples, dealt to the ranks in turn: every sample counts once, and a chunk is computed
alike at any world size, so the metrics are bit-equal whether 1, 2 or 3 ranks evaluate
(evaluation.py sums the chunks in order).
"""

from __future__ import annotations

import functools
import importlib.util
import itertools
import math
import os
from pathlib import Path
from typing import Any, Iterable, Iterator, NamedTuple, Optional

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from hydra.utils import instantiate
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Sampler, Subset, TensorDataset

SPLITS = ("train", "val", "test")

from hydra_ddp.distributed import RankInfo
from hydra_ddp.errors import UserError


def _split(n: int, test_fraction: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    n_test = max(1, round(n * test_fraction))
    return order[n_test:], order[:n_test]


def _standardize(train: torch.Tensor, test: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    mean, std = train.mean(), train.std()
    return (train - mean) / std, (test - mean) / std


@functools.cache  # read once a process (train.py --check reads it for every config it checks)
def _load_digits() -> tuple[np.ndarray, np.ndarray]:
    """The digits' (images, labels), read from the file scikit-learn ships: importing
    sklearn.datasets to read it would cost each worker seconds of start-up."""
    spec = importlib.util.find_spec("sklearn")  # finds the package without importing it
    path = Path(spec.submodule_search_locations[0]) / "datasets" / "data" / "digits.csv.gz" if spec else None
    if path is None or not path.is_file():  # another layout: let scikit-learn find it
        from sklearn.datasets import load_digits

        raw = load_digits()
        return raw.images, raw.target
    table = np.loadtxt(path, delimiter=",")  # 64 pixels, then the label, per row (as load_digits reads it)
    return table[:, :-1].reshape(-1, 8, 8), table[:, -1].astype(np.int64)


def digits(image_size: int = 28, test_fraction: float = 0.2, seed: int = 0) -> tuple[Dataset, Dataset]:
    """scikit-learn's 1,797 8×8 digits, bilinearly resized to image_size², held in memory."""
    raw_images, raw_labels = _load_digits()
    images = torch.from_numpy(raw_images).float().unsqueeze(1) / 16.0
    images = F.interpolate(images, size=(image_size, image_size), mode="bilinear", align_corners=False)
    labels = torch.from_numpy(raw_labels).long()
    train_idx, test_idx = _split(len(labels), test_fraction, seed)
    train_x, test_x = _standardize(images[train_idx], images[test_idx])
    return TensorDataset(train_x, labels[train_idx]), TensorDataset(test_x, labels[test_idx])


def python_source(context: int = 64, max_bytes: int = 262_144, test_fraction: float = 0.1,
                  seed: int = 0) -> tuple[Dataset, Dataset]:
    """Byte-level language modelling on text every machine with Python has: the standard library's
    own top-level source files, in name order, up to max_bytes. Samples are disjoint windows of
    `context` + 1 bytes: the input is the first `context`, the target the same shifted by one."""
    import sysconfig

    root = Path(sysconfig.get_paths()["stdlib"])
    text = bytearray()
    for path in sorted(root.glob("*.py")):
        text += path.read_bytes()
        if len(text) >= max_bytes:
            break
    windows = torch.from_numpy(np.frombuffer(bytes(text[:max_bytes]), dtype=np.uint8).astype(np.int64))
    count = (len(windows) - 1) // (context + 1)
    if count < 2:
        raise UserError(f"data=text: {len(windows)} bytes make fewer than 2 windows of data.dataset.context={context}")
    windows = windows[: count * (context + 1)].view(count, context + 1)
    train_idx, test_idx = _split(count, test_fraction, seed)
    return (TensorDataset(windows[train_idx, :-1], windows[train_idx, 1:]),
            TensorDataset(windows[test_idx, :-1], windows[test_idx, 1:]))


def synthetic(
    train_size: int = 8192,
    test_size: int = 1024,
    in_channels: int = 1,
    image_size: int = 28,
    num_classes: int = 10,
    seed: int = 0,
) -> tuple[Dataset, Dataset]:
    """Random images and labels, generated in memory (same on every rank: seeded)."""
    gen = torch.Generator().manual_seed(seed)
    n = train_size + test_size
    x = torch.randn(n, in_channels, image_size, image_size, generator=gen)
    y = torch.randint(0, num_classes, (n,), generator=gen)
    return TensorDataset(x[:train_size], y[:train_size]), TensorDataset(x[train_size:], y[train_size:])


def _require_dir(root: str, what: str) -> Path:
    path = Path(root).expanduser().resolve()
    if not path.is_dir():
        raise UserError(f"{what}: directory {str(path)!r} does not exist; set data.dataset.root to it")
    return path


def mnist(root: str, download: bool = False) -> tuple[Dataset, Dataset]:
    from torchvision import datasets, transforms

    tf = transforms.Compose([transforms.ToTensor(), transforms.Normalize((0.1307,), (0.3081,))])
    return (
        datasets.MNIST(root, train=True, download=download, transform=tf),
        datasets.MNIST(root, train=False, download=download, transform=tf),
    )


CIFAR10_FILES = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]


class ImageArrays(Dataset):
    """uint8 H×W×C images and their labels in memory, each image through a torchvision transform."""

    def __init__(self, images: np.ndarray, labels: np.ndarray, transform: Any):
        self.images, self.labels, self.transform = images, labels, transform

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        from PIL import Image

        return self.transform(Image.fromarray(self.images[index])), int(self.labels[index])


def cifar10(root: str, download: bool = False, augment: bool = False) -> tuple[Dataset, Dataset]:
    """CIFAR-10's python batches under root/cifar-10-batches-py (any files in that format: torchvision's
    md5 check is for downloads). `augment`: the standard random 4-pixel-padded crop and horizontal
    flip for training, drawn per sample and epoch (SeededSamples): exact across a mid-epoch resume
    and the same at any world size."""
    import pickle

    from torchvision import datasets, transforms

    if download:
        datasets.CIFAR10(root, train=True, download=True)
        datasets.CIFAR10(root, train=False, download=True)
    folder = Path(root) / "cifar-10-batches-py"

    def read(names: list[str]) -> tuple[np.ndarray, np.ndarray]:
        images, labels = [], []
        for name in names:
            with open(folder / name, "rb") as f:
                batch = pickle.load(f, encoding="latin1")
            images.append(batch["data"])
            labels += batch["labels"]
        return np.concatenate(images).reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1), np.array(labels)

    normalize = [transforms.ToTensor(), transforms.Normalize((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616))]
    flips = [transforms.RandomCrop(32, padding=4), transforms.RandomHorizontalFlip()] if augment else []
    return (ImageArrays(*read(CIFAR10_FILES[:5]), transforms.Compose(flips + normalize)),
            ImageArrays(*read(CIFAR10_FILES[5:]), transforms.Compose(normalize)))


def image_folder(
    root: str, image_size: int = 64, grayscale: bool = False, test_fraction: float = 0.2, seed: int = 0
) -> tuple[Dataset, ...]:
    """root/<class>/<image>, split into train and test by a seeded permutation; or root/train/<class>/…
    with root/val/ and root/test/ beside it, each used where present (a missing test/ is split
    from train/ as above; a missing val/ is carved later by data.val_fraction)."""
    from torchvision import datasets, transforms

    steps = [transforms.Resize(image_size), transforms.CenterCrop(image_size)]
    if grayscale:
        steps.append(transforms.Grayscale(1))
    steps.append(transforms.ToTensor())
    transform = transforms.Compose(steps)
    folders = split_folders(Path(root))
    if not folders:
        full = datasets.ImageFolder(str(root), transform=transform)
        train_idx, test_idx = _split(len(full), test_fraction, seed)
        return Subset(full, train_idx.tolist()), Subset(full, test_idx.tolist())
    train = datasets.ImageFolder(str(folders["train"]), transform=transform)
    if "test" in folders:
        test: Dataset = datasets.ImageFolder(str(folders["test"]), transform=transform)
    else:
        train_idx, test_idx = _split(len(train), test_fraction, seed)
        train, test = Subset(train, train_idx.tolist()), Subset(train, test_idx.tolist())
    if "val" in folders:
        return train, datasets.ImageFolder(str(folders["val"]), transform=transform), test
    return train, test


def split_folders(root: Path) -> dict[str, Path]:
    """{split: folder} when root holds train/ (and val/, test/) and nothing else; {} for root/<class>/."""
    subfolders = {d.name: Path(d.path) for d in os.scandir(root) if d.is_dir()} if root.is_dir() else {}
    if "train" in subfolders and set(subfolders) <= set(SPLITS):
        return subfolders
    return {}


def check_source(dataset_cfg: Any, num_classes: int) -> None:
    """Fail before launch, naming the path, when a dataset's files are missing.

    Checks the datasets shipped here that read from disk; a user's own `_target_` is checked
    when it is built.
    """
    target = str(dataset_cfg.get("_target_", ""))
    root = dataset_cfg.get("root")
    if target.endswith(".image_folder"):
        path = _require_dir(root, "data=imagefolder")
        folders = split_folders(path) or {"": path}
        found = {split: _class_folders(folder) for split, folder in folders.items()}
        classes = found.get("train", found.get(""))
        for split, names in found.items():
            if names != classes:
                raise UserError(f"data=imagefolder: {str(folders[split])!r} has classes {names}, train/ has "
                                f"{classes}: every split needs the same class folders")
        if len(classes) != num_classes:
            raise UserError(
                f"data=imagefolder: {str(path)!r} has {len(classes)} classes but data.num_classes={num_classes}; "
                f"set data.num_classes={len(classes)}"
            )
    elif target.endswith((".mnist", ".cifar10")) and not dataset_cfg.get("download", False):
        path = _require_dir(root, f"data={target.rsplit('.', 1)[1]}")
        missing = [n for n in CIFAR10_FILES if not (path / "cifar-10-batches-py" / n).is_file()]
        if target.endswith(".cifar10") and missing:
            raise UserError(f"data=cifar10: {str(path / 'cifar-10-batches-py')!r} lacks {', '.join(missing)} (CIFAR-10's "
                            "python version); set data.dataset.root, or data.dataset.download=true where the network allows")


def _class_folders(path: Path) -> list[str]:
    from torchvision.datasets.folder import IMG_EXTENSIONS

    classes = sorted(d.name for d in os.scandir(path) if d.is_dir())
    if not classes:
        raise UserError(f"data=imagefolder: {str(path)!r} has no class subfolders (expected root/<class>/<image>)")
    empty = [c for c in classes if not any(f.lower().endswith(IMG_EXTENSIONS) for f in os.listdir(path / c))]
    if empty:
        raise UserError(f"data=imagefolder: class folder(s) {empty} under {str(path)!r} hold no images")
    return classes


class ResumableDistributedSampler(DistributedSampler):
    """DistributedSampler that can start part-way into an epoch, for an exact mid-epoch resume.

    `pad=False`: disjoint shards (rank r takes positions r, r+W, … of the epoch's shuffle), every
    sample once per epoch; shard lengths then differ by at most one sample, and ranks may run out
    of batches one batch apart (the loop keeps their collectives matched with DDP's Join).
    """

    def __init__(self, *args: Any, pad: bool = True, keyed: bool = False, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.pad = pad
        self.keyed = keyed  # yield (epoch, index): the key a SeededSamples dataset draws its randomness from
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
        indices = itertools.islice(super().__iter__() if self.pad else self._shard(), self.start, None)
        return ((self.epoch, index) for index in indices) if self.keyed else indices

    def _shard(self) -> Iterator[int]:
        n = len(self.dataset)  # type: ignore[arg-type]
        # The same shuffle as DistributedSampler's: one permutation per epoch, equal on every rank.
        order = torch.randperm(n, generator=torch.Generator().manual_seed(self.seed + self.epoch)) \
            if self.shuffle else torch.arange(n)
        return iter(order[self.rank :: self.num_replicas].tolist())

    def __len__(self) -> int:
        return max(0, self.num_samples - self.start)


def sample_seed(seed: int, epoch: int, index: int) -> int:
    """A 64-bit seed for one sample in one epoch (splitmix64 over the three): distinct per sample and
    epoch, and a function of nothing else, so not of the rank, the world size or the step."""
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


class EvalSplit:
    """One split for evaluation, this rank's part: chunks of `batch_size` consecutive samples
    (chunk c holds samples c·B … c·B+B-1), chunk c on rank c mod W. No padding, so every sample
    counts once; and a chunk is the same batch at any world size, so its sums are too.

    Iterating yields (chunk, first sample index, inputs, labels); `passes` counts the iterations
    begun (the test split's must end at one).
    """

    def __init__(self, dataset: Dataset, batch_size: int, rank: RankInfo, device: torch.device,
                 preload: bool, loader_options: dict[str, Any]):
        self.samples = len(dataset)  # type: ignore[arg-type]
        self.batch_size = batch_size
        self.num_chunks = math.ceil(self.samples / batch_size)
        self.chunks = range(rank.rank, self.num_chunks, rank.world_size)
        self.rounds = math.ceil(self.num_chunks / rank.world_size)  # the most chunks any rank holds
        self.dataset = dataset
        self.passes = 0
        self.tensors = tuple(t.to(device) for t in dataset.tensors) if preload else None  # type: ignore[attr-defined]
        self.loader = None if preload else DataLoader(
            dataset, batch_sampler=[list(self._indices(c)) for c in self.chunks], **loader_options
        )

    def _indices(self, chunk: int) -> range:
        return range(chunk * self.batch_size, min(self.samples, (chunk + 1) * self.batch_size))

    def __len__(self) -> int:
        return len(self.chunks)

    def filler(self) -> torch.Tensor:
        """One sample as a batch: the input of the forwards a rank runs past its own chunks when every
        rank must run as many (a sharded model gathers its parameters in each)."""
        if self.tensors is not None:
            return self.tensors[0][:1]
        return self.dataset[0][0].unsqueeze(0)

    def __iter__(self) -> Iterator[tuple[int, int, torch.Tensor, torch.Tensor]]:
        self.passes += 1
        if self.tensors is not None:
            for chunk in self.chunks:
                where = self._indices(chunk)
                x, y = (t[where.start : where.stop] for t in self.tensors)
                yield chunk, where.start, x, y
        else:
            for chunk, (x, y) in zip(self.chunks, self.loader):
                yield chunk, chunk * self.batch_size, x, y


class TensorBatches:
    """Batches sliced from whole tensors (a preloaded TensorDataset): one indexing op per batch
    instead of a Python call per sample. Same sampler, same order: the same batches as a DataLoader."""

    def __init__(self, tensors: tuple[torch.Tensor, ...], sampler: Sampler[int], batch_size: int, drop_last: bool):
        self.tensors, self.sampler, self.batch_size, self.drop_last = tensors, sampler, batch_size, drop_last

    def __len__(self) -> int:
        n = len(self.sampler)  # type: ignore[arg-type]
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, ...]]:
        indices = torch.tensor(list(self.sampler), dtype=torch.long, device=self.tensors[0].device)
        for start in range(0, len(self) * self.batch_size, self.batch_size):
            batch = indices[start : start + self.batch_size]
            yield tuple(t[batch] for t in self.tensors)


class Loaders(NamedTuple):
    train: Iterable
    val: Optional[EvalSplit]  # None with data.val_fraction=0: nothing to validate on
    test: EvalSplit
    train_sampler: ResumableDistributedSampler
    batch_size: int  # per rank, of the training batches


def build_datasets(data_cfg: Any, rank: RankInfo, seed: int) -> dict[str, Optional[Dataset]]:
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
        raise UserError(f"data.dataset ({dataset_cfg.get('_target_')}) must return (train, test) or "
                        f"(train, val, test), got {type(splits).__name__}")
    train, *val, test = splits
    if data_cfg.overfit_batches:  # the first samples, trained and validated on: loss must reach ~0
        n = min(len(train), data_cfg.overfit_batches * data_cfg.batch_size * rank.world_size)
        train = TensorDataset(*(t[:n] for t in train.tensors)) if isinstance(train, TensorDataset) \
            else Subset(train, list(range(n)))
        return {"train": train, "val": train, "test": test}
    fraction = data_cfg.val_fraction
    if fraction == 0:
        return {"train": train, "val": None, "test": test}
    if val:
        return {"train": train, "val": val[0], "test": test}
    train, carved = carve(train, fraction, seed)
    return {"train": train, "val": carved, "test": test}


def carve(train: Dataset, fraction: float, seed: int) -> tuple[Dataset, Dataset]:
    """(rest, validation): `fraction` of the training set, chosen by a permutation seeded with `seed`.
    In-memory tensors stay whole tensors (sliced), so data.preload keeps working."""
    n = len(train)  # type: ignore[arg-type]
    n_val = max(1, round(n * fraction))
    if n_val >= n:
        raise UserError(f"data.val_fraction={fraction} leaves no training samples out of {n}; choose a smaller one")
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    keep, held_out = order[n_val:].sort().values, order[:n_val].sort().values  # in dataset order
    if isinstance(train, TensorDataset):
        return TensorDataset(*(t[keep] for t in train.tensors)), TensorDataset(*(t[held_out] for t in train.tensors))
    return Subset(train, keep.tolist()), Subset(train, held_out.tolist())


def loader_options(data_cfg: Any, seed: int, device: torch.device, rank: int = 0) -> dict[str, Any]:
    workers = data_cfg.num_workers
    # Its own generator: starting an epoch's iterator then draws nothing from the global RNG, which
    # the model (dropout) uses, so a resumed run sees the same random numbers as an unbroken one.
    # Per rank: the loader workers' own seeds (drawn from it) differ between ranks.
    options: dict[str, Any] = dict(
        num_workers=workers, pin_memory=data_cfg.pin_memory and device.type == "cuda",
        generator=torch.Generator().manual_seed(sample_seed(seed, -1, rank)),
    )
    if workers > 0:
        options.update(persistent_workers=data_cfg.persistent_workers, prefetch_factor=data_cfg.prefetch_factor)
    return options


def eval_split(dataset: Dataset, data_cfg: Any, rank: RankInfo, seed: int, device: torch.device) -> EvalSplit:
    return EvalSplit(dataset, data_cfg.eval_batch_size, rank, device, _preloaded(dataset, data_cfg),
                     loader_options(data_cfg, seed, device, rank.rank))


def _preloaded(dataset: Dataset, data_cfg: Any) -> bool:
    if data_cfg.preload and not isinstance(dataset, TensorDataset):
        raise UserError("data.preload=true needs in-memory TensorDatasets (digits, synthetic); set it false")
    return bool(data_cfg.preload)


def build_loaders(data_cfg: Any, rank: RankInfo, seed: int, device: torch.device,
                  shard: Optional[RankInfo] = None) -> Loaders:
    """This rank's loaders. `shard`: which share of the data it reads when that is not its rank's
    (tensor parallel: the ranks of a model replica read the same batches)."""
    shard = shard or rank
    splits = build_datasets(data_cfg, rank, seed)
    train_set = splits["train"]
    # In-memory tensors draw no randomness per sample: they are sliced whole (data.preload), unwrapped.
    seeded = not isinstance(train_set, TensorDataset)
    train_sampler = ResumableDistributedSampler(
        train_set, num_replicas=shard.world_size, rank=shard.rank, shuffle=True, seed=seed, pad=data_cfg.even_shards,
        keyed=seeded,
    )
    val, test = (eval_split(splits[s], data_cfg, shard, seed, device) if splits[s] is not None else None
                 for s in ("val", "test"))
    if _preloaded(train_set, data_cfg):
        on_device = tuple(t.to(device) for t in train_set.tensors)  # type: ignore[attr-defined]
        train: Iterable = TensorBatches(on_device, train_sampler, data_cfg.batch_size, data_cfg.drop_last)
    else:
        train = DataLoader(SeededSamples(train_set, seed) if seeded else train_set, batch_size=data_cfg.batch_size,
                           sampler=train_sampler, drop_last=data_cfg.drop_last,
                           **loader_options(data_cfg, seed, device, rank.rank))
    return Loaders(train, val, test, train_sampler, data_cfg.batch_size)  # type: ignore[arg-type]
