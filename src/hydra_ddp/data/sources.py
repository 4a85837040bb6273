"""The data sources conf/data/*.yaml builds through `_target_`: each returns (train, test), or
(train, val, test) where the source has a validation split of its own. Offline by default:
scikit-learn's digits and diabetes as shipped, synthetic data, files on disk."""

from __future__ import annotations

import functools
import importlib.util
import os
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import Dataset, Subset, TensorDataset

from hydra_ddp.data.batches import TensorTree
from hydra_ddp.errors import UserError

SPLITS = ("train", "val", "test")


def _split(n: int, test_fraction: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    n_test = max(1, round(n * test_fraction))
    return order[n_test:], order[:n_test]


def _first_to_train(train_size: int, *columns: torch.Tensor) -> tuple[Dataset, Dataset]:
    """Generated samples (each column's first dimension) split in order: the first train_size to
    train on, the rest to test."""
    return (
        TensorDataset(*(column[:train_size] for column in columns)),
        TensorDataset(*(column[train_size:] for column in columns)),
    )


def _one_thread(build):
    """A source built as one thread builds it, whatever the caller's torch thread count: a
    reduction's (a mean's, a matrix product's) summation order follows the thread count, and a
    1-rank run (two threads on two cores) would otherwise train on other bits of the same data than
    a 2-rank run."""

    @functools.wraps(build)
    def built(*args: Any, **kwargs: Any) -> Any:
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            return build(*args, **kwargs)
        finally:
            torch.set_num_threads(threads)

    return built


def _standardize(train: torch.Tensor, test: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    mean, std = train.mean(), train.std()
    return (train - mean) / std, (test - mean) / std


def _shipped_path(name: str) -> Path | None:
    """Where scikit-learn keeps a data file it ships (found without importing it), or None."""
    spec = importlib.util.find_spec("sklearn")
    path = Path(spec.submodule_search_locations[0]) / "datasets" / "data" / name if spec else None
    return path if path is not None and path.is_file() else None


@functools.cache  # read once a process (train.py --check reads it for every config it checks)
def _load_digits() -> tuple[np.ndarray, np.ndarray]:
    """The digits' (images, labels), read from the file scikit-learn ships: importing
    sklearn.datasets to read it would cost each worker seconds of start-up."""
    path = _shipped_path("digits.csv.gz")
    if path is None:  # another layout: let scikit-learn find it
        from sklearn.datasets import load_digits

        raw = load_digits()
        return raw.images, raw.target
    # 64 pixels, then the label, per row (as load_digits reads it)
    table = np.loadtxt(path, delimiter=",")
    return table[:, :-1].reshape(-1, 8, 8), table[:, -1].astype(np.int64)


@_one_thread
def digits(
    image_size: int = 28, test_fraction: float = 0.2, seed: int = 0
) -> tuple[Dataset, Dataset]:
    """scikit-learn's 1,797 8×8 digits, bilinearly resized to image_size², held in memory."""
    raw_images, raw_labels = _load_digits()
    images = torch.from_numpy(raw_images).float().unsqueeze(1) / 16.0
    images = F.interpolate(
        images, size=(image_size, image_size), mode="bilinear", align_corners=False
    )
    labels = torch.from_numpy(raw_labels).long()
    train_idx, test_idx = _split(len(labels), test_fraction, seed)
    train_x, test_x = _standardize(images[train_idx], images[test_idx])
    return TensorDataset(train_x, labels[train_idx]), TensorDataset(test_x, labels[test_idx])


def python_source(
    context: int = 64, max_bytes: int = 262_144, test_fraction: float = 0.1, seed: int = 0
) -> tuple[Dataset, Dataset]:
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
    windows = torch.from_numpy(
        np.frombuffer(bytes(text[:max_bytes]), dtype=np.uint8).astype(np.int64)
    )
    count = (len(windows) - 1) // (context + 1)
    if count < 2:
        raise UserError(
            f"data=text: {len(windows)} bytes make fewer than "
            f"2 windows of data.dataset.context={context}"
        )
    windows = windows[: count * (context + 1)].view(count, context + 1)
    train_idx, test_idx = _split(count, test_fraction, seed)
    return (
        TensorDataset(windows[train_idx, :-1], windows[train_idx, 1:]),
        TensorDataset(windows[test_idx, :-1], windows[test_idx, 1:]),
    )


def python_source_dicts(
    tokens: int = 65, max_bytes: int = 262_144, test_fraction: float = 0.1, seed: int = 0
) -> tuple[Dataset, Dataset]:
    """python_source's windows as the dict samples a Hugging Face causal language model takes, of
    `tokens` ids each (with tokens = context + 1, data=text's windows): `input_ids`, an all-ones
    `attention_mask`, and `labels` equal to the ids (the model shifts them). Held as whole tensors
    (a TensorTree), so data.preload works."""
    splits = python_source(tokens - 1, max_bytes, test_fraction, seed)
    trees = []
    for inputs, targets in (split.tensors for split in splits):
        ids = torch.cat([inputs, targets[:, -1:]], 1)
        trees.append(
            TensorTree({"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids})
        )
    return trees[0], trees[1]


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
    return _first_to_train(train_size, x, y)


def _shipped_table(name: str) -> np.ndarray:
    """A table scikit-learn ships in sklearn/datasets/data/, read without importing sklearn."""
    path = _shipped_path(name)
    if path is None:
        raise UserError(
            f"scikit-learn's {name} was not found (is "
            "scikit-learn installed?): pip install scikit-learn"
        )
    return np.loadtxt(path)


@_one_thread
def diabetes(test_fraction: float = 0.2, seed: int = 0) -> tuple[Dataset, Dataset]:
    """scikit-learn's diabetes regression data (442 patients, 10 measurements, a disease-progression
    score), read from the files it ships. Features and targets standardized by the training split's
    mean and spread (per feature), so an MSE of 1 is a prediction no better than the mean."""
    features = torch.from_numpy(_shipped_table("diabetes_data_raw.csv.gz")).float()
    targets = torch.from_numpy(_shipped_table("diabetes_target.csv.gz")).float()
    train_idx, test_idx = _split(len(targets), test_fraction, seed)
    mean, std = features[train_idx].mean(0), features[train_idx].std(0)
    t_mean, t_std = targets[train_idx].mean(), targets[train_idx].std()
    x, y = (features - mean) / std, (targets - t_mean) / t_std
    return TensorDataset(x[train_idx], y[train_idx]), TensorDataset(x[test_idx], y[test_idx])


@_one_thread
def synthetic_regression(
    train_size: int = 4096,
    test_size: int = 512,
    in_features: int = 16,
    noise: float = 0.1,
    seed: int = 0,
) -> tuple[Dataset, Dataset]:
    """y = sin(x · w₁) + x · w₂ + noise, for random x: a regression target a small MLP can learn."""
    gen = torch.Generator().manual_seed(seed)
    n = train_size + test_size
    x = torch.randn(n, in_features, generator=gen)
    w1, w2 = (
        torch.randn(in_features, generator=gen) / in_features**0.5,
        torch.randn(in_features, generator=gen) / 4,
    )
    y = torch.sin(2 * x @ w1) + x @ w2 + noise * torch.randn(n, generator=gen)
    return _first_to_train(train_size, x, y)


def shapes(
    train_size: int = 1024, test_size: int = 256, image_size: int = 16, seed: int = 0
) -> tuple[Dataset, Dataset]:
    """Segmentation of synthetic shapes: each grey image holds a filled square (class 1) and a
    filled disc (class 2) at random places and sizes, over noise; the mask gives each pixel's class
    (0: background; the disc is drawn over the square)."""
    gen = torch.Generator().manual_seed(seed)
    n = train_size + test_size
    rows, cols = torch.meshgrid(torch.arange(image_size), torch.arange(image_size), indexing="ij")
    masks = torch.zeros(n, image_size, image_size, dtype=torch.int64)
    low, high = max(2, image_size // 8), max(3, image_size // 3)
    for i in range(n):
        side, radius = (int(v) for v in torch.randint(low, high, (2,), generator=gen))
        top, left = (int(v) for v in torch.randint(0, image_size - side + 1, (2,), generator=gen))
        masks[i, top : top + side, left : left + side] = 1
        cy, cx = (float(v) for v in torch.randint(radius, image_size - radius, (2,), generator=gen))
        masks[i][(rows - cy) ** 2 + (cols - cx) ** 2 <= radius**2] = 2
    brightness = torch.tensor([0.0, 0.6, 1.0])  # background, square, disc
    images = (
        brightness[masks] + 0.3 * torch.randn(n, image_size, image_size, generator=gen)
    ).unsqueeze(1)
    return _first_to_train(train_size, images, masks)


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
    """CIFAR-10's python batches under root/cifar-10-batches-py (any files in that format:
    torchvision's md5 check is for downloads). `augment`: the standard random 4-pixel-padded crop
    and horizontal flip for training, drawn per sample and epoch (SeededSamples): exact across a
    mid-epoch resume and the same at any world size."""
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

    normalize = [
        transforms.ToTensor(),
        transforms.Normalize((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)),
    ]
    flips = (
        [transforms.RandomCrop(32, padding=4), transforms.RandomHorizontalFlip()] if augment else []
    )
    return (
        ImageArrays(*read(CIFAR10_FILES[:5]), transforms.Compose(flips + normalize)),
        ImageArrays(*read(CIFAR10_FILES[5:]), transforms.Compose(normalize)),
    )


def image_folder(
    root: str,
    image_size: int = 64,
    grayscale: bool = False,
    test_fraction: float = 0.2,
    seed: int = 0,
) -> tuple[Dataset, ...]:
    """root/<class>/<image>, split into train and test by a seeded permutation; or
    root/train/<class>/… with root/val/ and root/test/ beside it, each used where present (a missing
    test/ is split from train/ as above; a missing val/ is carved later by data.val_fraction)."""
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
    """{split: folder} when root holds train/ (and val/, test/) and nothing else; {} for
    root/<class>/."""
    subfolders = (
        {d.name: Path(d.path) for d in os.scandir(root) if d.is_dir()} if root.is_dir() else {}
    )
    if "train" in subfolders and set(subfolders) <= set(SPLITS):
        return subfolders
    return {}
