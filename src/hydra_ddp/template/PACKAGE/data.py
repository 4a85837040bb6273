"""The data: three interleaved spirals in the plane, one class each, made in memory from a seed."""

import math

import torch
from torch.utils.data import TensorDataset


def spirals(train_size: int = 3072, test_size: int = 768, noise: float = 0.15, seed: int = 0):
    """(train, test): points (x, y) and their spiral's index. Every rank makes the same ones
    (seeded)."""
    generator = torch.Generator().manual_seed(seed)
    n = train_size + test_size
    labels = torch.randint(0, 3, (n,), generator=generator)
    radius = torch.rand(n, generator=generator)
    angle = labels * (2 * math.pi / 3) + 3 * math.pi * radius
    points = torch.stack([radius * torch.cos(angle), radius * torch.sin(angle)], 1)
    points += noise * radius[:, None] * torch.randn(n, 2, generator=generator)
    return TensorDataset(points[:train_size], labels[:train_size]), TensorDataset(
        points[train_size:], labels[train_size:]
    )
