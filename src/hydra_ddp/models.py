"""Models, built from conf/model/*.yaml through `_target_`."""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn
import torch.nn.functional as F


class MnistCNN(nn.Module):
    """The seeds' MNIST CNN: conv 1→20 k5, conv 20→50 k5, fc 800→500, fc 500→10 (at 28×28)."""

    def __init__(self, in_channels: int = 1, num_classes: int = 10, image_size: int = 28):
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, 20, 5)
        self.conv2 = nn.Conv2d(20, 50, 5)
        side = ((image_size - 4) // 2 - 4) // 2
        if side < 1:
            raise ValueError(f"MnistCNN needs image_size >= 16, got {image_size}")
        self.fc1 = nn.Linear(50 * side * side, 500)
        self.fc2 = nn.Linear(500, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        x = F.relu(self.fc1(torch.flatten(x, 1)))
        return self.fc2(x)


class MLP(nn.Module):
    def __init__(self, in_features: int, num_classes: int = 10, hidden: Sequence[int] = (256, 128)):
        super().__init__()
        layers: list[nn.Module] = [nn.Flatten()]
        width = in_features
        for h in hidden:
            layers += [nn.Linear(width, h), nn.ReLU()]
            width = h
        layers.append(nn.Linear(width, num_classes))
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class _RepeatChannels(nn.Module):
    """Feeds grayscale images to a network that expects RGB."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.expand(-1, 3, -1, -1)


def torchvision_classifier(name: str, num_classes: int = 10, in_channels: int = 3, small_input: bool = False) -> nn.Module:
    """Any torchvision classification model by name, randomly initialised (no weight download).

    `small_input` (ResNets): the CIFAR stem, a 3×3 stride-1 convolution and no max-pool, so 32×32
    images are not shrunk to 8×8 before the first block."""
    import torchvision  # imported here: it costs start-up time the default model does not need

    available = torchvision.models.list_models(module=torchvision.models)
    if name not in available:
        raise ValueError(f"unknown torchvision model {name!r}; choose one of: {', '.join(sorted(available))}")
    model = torchvision.models.get_model(name, weights=None, num_classes=num_classes)
    if small_input:
        if not (hasattr(model, "conv1") and hasattr(model, "maxpool")):
            raise ValueError(f"small_input applies to ResNets (conv1 and maxpool), not {name!r}")
        model.conv1 = nn.Conv2d(3, model.conv1.out_channels, kernel_size=3, stride=1, padding=1, bias=False)
        model.maxpool = nn.Identity()
    if in_channels == 1:
        return nn.Sequential(_RepeatChannels(), model)
    if in_channels != 3:
        raise ValueError(f"torchvision models take 1 or 3 input channels, got {in_channels}")
    return model
