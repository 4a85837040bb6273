"""Regression (real-valued targets) and segmentation (a class per pixel)."""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn.functional as F

from hydra_ddp.errors import UserError
from hydra_ddp.tasks.base import Task, beyond_classes, full_precision
from hydra_ddp.tasks.classification import _dtype


class Regression(Task):
    """Mean squared error. Reports the MSE (also the loss), the mean absolute error and R² (the
    pooled coefficient of determination: 1 − SSE / total sum of squares about the mean)."""

    metrics = {"loss": "min", "mse": "min", "mae": "min", "r2": "max"}
    # Σ squared error, Σ absolute error, the values, Σ target, Σ target²
    state_size = 5
    prediction_columns = ("target", "predicted")

    def loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        out = full_precision(output)
        return F.mse_loss(out.reshape(target.shape), target.to(out.dtype))

    def state(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        target = target.float()
        error = (full_precision(output).reshape(target.shape) - target).double()
        t = target.double()
        count = torch.tensor(float(target.numel()), dtype=torch.float64, device=t.device)
        return torch.stack(
            [error.square().sum(), error.abs().sum(), count, t.sum(), t.square().sum()]
        )

    def compute(self, total: list[float]) -> dict[str, float]:
        squared, absolute, count, t_sum, t_squares = total
        spread = t_squares - t_sum * t_sum / count  # Σ (t − mean)²
        mse = squared / count
        return {
            "loss": mse,
            "mse": mse,
            "mae": absolute / count,
            "r2": 1.0 - squared / spread if spread > 0 else float("nan"),
        }

    def predict(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        if target[0].numel() != 1:
            raise UserError(
                f"predict=true writes one target per sample, and these have {target[0].numel()}"
            )
        return torch.stack([target.double().reshape(-1), output.double().reshape(-1)], 1)

    def check_target(self, target: torch.Tensor, outputs: int) -> Optional[str]:
        if not target.is_floating_point():
            return (
                "it needs real-valued targets, and the data's are "
                f"{_dtype(target)} (class labels?): choose a regression dataset "
                "(data=diabetes, data=synthetic_regression) or task=classification"
            )
        if target.numel() != outputs:
            return (
                f"each sample has {target.numel()} target value(s) and the model "
                f"makes data.num_classes={outputs} output(s): make them equal"
            )
        return None


class Segmentation(Task):
    """A class per pixel: cross-entropy over logits (batch, classes, H, W) against masks (batch, H,
    W). Reports pixel accuracy and the mean IoU over the classes present (in the masks or the
    predictions), both from the split's confusion matrix."""

    metrics = {"loss": "min", "pixel_accuracy": "max", "mean_iou": "max"}
    monitored = "mean_iou"
    prediction_columns = ("pixels", "correct")  # per image
    integer_columns = ("pixels", "correct")

    def __init__(self, num_classes: int):
        self.num_classes = num_classes
        # the losses' sum, the pixels, the confusion matrix
        self.state_size = 2 + num_classes * num_classes

    def loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(full_precision(output), target)

    def state(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        logits = full_precision(output)
        losses = F.cross_entropy(logits, target, reduction="none").double()
        k = self.num_classes
        confusion = torch.bincount(
            (target * k + logits.argmax(1)).flatten(), minlength=k * k
        ).double()
        head = torch.stack(
            [
                losses.sum(),
                torch.tensor(float(target.numel()), dtype=torch.float64, device=losses.device),
            ]
        )
        return torch.cat([head, confusion])

    def compute(self, total: list[float]) -> dict[str, float]:
        loss_sum, pixels, *cells = total
        k = self.num_classes
        confusion = [cells[i * k : (i + 1) * k] for i in range(k)]  # [true][predicted]
        correct = sum(confusion[i][i] for i in range(k))
        ious = []
        for i in range(k):
            union = sum(confusion[i]) + sum(row[i] for row in confusion) - confusion[i][i]
            if union > 0:
                ious.append(confusion[i][i] / union)
        return {
            "loss": loss_sum / pixels,
            "pixel_accuracy": correct / pixels,
            "mean_iou": sum(ious) / len(ious) if ious else float("nan"),
        }

    def predict(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        correct = (output.argmax(1) == target).flatten(1).sum(1)
        pixels = torch.full_like(correct, target[0].numel())
        return torch.stack([pixels.double(), correct.double()], 1)

    def check_target(self, target: torch.Tensor, outputs: Any) -> Optional[str]:
        if target.dim() != 2:
            return (
                "it needs a mask (height × width of class indices) per sample, "
                f"and the data's targets have shape {tuple(target.shape)}: "
                "choose a dataset with masks (data=shapes)"
            )
        if target.is_floating_point():
            return f"its masks must hold class indices, and the data's are {_dtype(target)}"
        return beyond_classes(target, outputs)
