"""The task: classification (loss, accuracy, exact distributed evaluation: hydra-ddp's), trained
with label smoothing. Evaluation keeps the plain cross-entropy, so runs with and without smoothing
compare."""

import torch
import torch.nn.functional as F

from hydra_ddp.tasks import Classification


class SmoothedClassification(Classification):
    def __init__(self, smoothing: float = 0.1):
        super().__init__()
        self.smoothing = smoothing

    def loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(output.float(), target, label_smoothing=self.smoothing)
