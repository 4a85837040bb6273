"""The model: a small MLP from a point to the spirals' logits."""

from torch import nn


class SpiralNet(nn.Module):
    def __init__(self, hidden: int = 64, num_classes: int = 3):
        super().__init__()
        self.layers = nn.Sequential(
            nn.Linear(2, hidden),
            nn.ReLU(),
            nn.Linear(hidden, hidden),
            nn.ReLU(),
            nn.Linear(hidden, num_classes),
        )

    def forward(self, points):
        return self.layers(points)
