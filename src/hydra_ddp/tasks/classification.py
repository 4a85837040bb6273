"""Classification (a class per sample) and language modelling (a class per position: the next
token)."""

from __future__ import annotations

import math
from typing import Any, Optional

import torch
import torch.nn.functional as F

from hydra_ddp.tasks.base import IGNORED, Task, beyond_classes, full_precision


class Classification(Task):
    """Cross-entropy over class logits (batch, classes); accuracy of the argmax. Targets are class
    indices, one per sample (subclasses take one per position: the loss and accuracy then count
    positions)."""

    metrics = {"loss": "min", "accuracy": "max"}
    monitored = "accuracy"
    state_size = 3  # the per-target losses' sum, the correct predictions, the targets
    prediction_columns = ("label", "predicted", "probability")
    integer_columns = ("label", "predicted")
    target_dims = 0  # a label per sample

    def loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        # In float32 whatever the model computes in (autocast, FSDP's mixed precision): a bf16 or
        # fp16 loss would round the sum over the batch. For fp32 outputs the cast is no operation.
        return F.cross_entropy(full_precision(output), target)

    def state(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        logits = full_precision(output)
        losses = F.cross_entropy(logits, target, reduction="none").double()
        correct = (logits.argmax(1) == target).sum()
        return torch.stack(
            [
                losses.sum(),
                correct.double(),
                torch.tensor(float(target.numel()), dtype=torch.float64, device=losses.device),
            ]
        )

    def compute(self, total: list[float]) -> dict[str, float]:
        loss_sum, correct, count = total
        return {"loss": loss_sum / count, "accuracy": correct / count}

    def predict(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        logits = full_precision(output)
        predicted = logits.argmax(1)
        probability = logits.softmax(1).gather(1, predicted[:, None])[:, 0]
        return torch.stack([target.double(), predicted.double(), probability.double()], 1)

    def check_target(self, target: torch.Tensor, outputs: int) -> Optional[str]:
        if target.is_floating_point() or target.dtype == torch.bool:
            return (
                "it needs integer class labels, and the data's targets are "
                f"{_dtype(target)}: choose a task for them (task=regression for real values)"
            )
        if target.dim() != self.target_dims:
            return (
                f"it takes {self.wants}, and the data's targets have "
                f"shape {tuple(target.shape)}: choose task=classification "
                "for one label per sample, task=language_model for a "
                "next token per position, task=segmentation for a mask"
            )
        return beyond_classes(target, outputs)

    @property
    def wants(self) -> str:
        return (
            "one class label per sample"
            if self.target_dims == 0
            else f"{self.target_dims}-D targets per sample"
        )


class LanguageModel(Classification):
    """Next-token prediction: logits (batch, vocab, time) against the next tokens (batch, time).
    A next token of -100 (padding) counts in nothing. The loss and accuracy are per counted token,
    in training too (units: a step weighs every token alike, however the batches are split);
    perplexity is exp of the per-token loss."""

    metrics = {"loss": "min", "accuracy": "max", "perplexity": "min"}
    monitored = "loss"
    # per window: counted tokens, right ones, their mean loss
    prediction_columns = ("tokens", "correct", "loss")
    integer_columns = ("tokens", "correct")
    target_dims = 1  # the next token at every position
    wants = "a sequence of next tokens per sample"  # type: ignore[assignment]

    def units(self, batch: Any) -> torch.Tensor:
        return (self.split(batch)[1] != IGNORED).sum()

    def tokens(self, batch: Any) -> int:
        return int(self.units(batch))

    def loss_sum(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(full_precision(output), target, reduction="sum")

    def state(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        logits = full_precision(output)
        losses = F.cross_entropy(logits, target, reduction="none").double()  # 0 where ignored
        correct = (logits.argmax(1) == target).sum()
        return torch.stack([losses.sum(), correct.double(), (target != IGNORED).sum().double()])

    def compute(self, total: list[float]) -> dict[str, float]:
        metrics = super().compute(total)
        # exp(>709) overflows a float
        return {**metrics, "perplexity": math.exp(min(metrics["loss"], 700.0))}

    def predict(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        logits = full_precision(output)
        losses = F.cross_entropy(logits, target, reduction="none").flatten(1)
        correct = (logits.argmax(1) == target).flatten(1).sum(1)
        tokens = (target != IGNORED).flatten(1).sum(1)
        mean = losses.double().sum(1) / tokens.clamp(min=1)
        return torch.stack([tokens.double(), correct.double(), mean], 1)


def _dtype(target: torch.Tensor) -> str:
    return str(target.dtype).removeprefix("torch.")
