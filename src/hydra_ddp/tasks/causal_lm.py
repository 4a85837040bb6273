"""A causal language model that computes its own loss, as every Hugging Face `transformers`
`...ForCausalLM` does when given `labels`: dict batches (`input_ids`, `attention_mask`, `labels`)
go in as `model(**batch)`, the model's own loss trains, and the evaluation's sums come from its
logits (a mean cannot be added across chunks; sums of token losses and counts can)."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F

from hydra_ddp.tasks.base import Task, full_precision

IGNORED = -100  # the label of a position that counts in no loss (padding): transformers' and PyTorch's


class CausalLM(Task):
    """Next-token prediction by a model that shifts its labels itself: position t's logits predict
    label t+1. The loss and accuracy are per counted token; perplexity is exp of the per-token loss."""

    metrics = {"loss": "min", "accuracy": "max", "perplexity": "min"}
    monitored = "loss"
    state_size = 3  # the counted tokens' losses summed, those predicted right, the tokens counted
    prediction_columns = ("tokens", "correct", "loss")  # per sequence: counted tokens, right ones, mean loss
    integer_columns = ("tokens", "correct")

    def split(self, batch: Any) -> tuple[Any, Any]:
        return batch, batch["labels"]

    def forward(self, model: Any, batch: Any) -> tuple[Any, Any]:
        return model(**batch), batch["labels"]

    def loss(self, output: Any, target: torch.Tensor) -> torch.Tensor:
        return output.loss  # the model's own: the mean over the counted tokens, computed in float32

    def _token_losses(self, output: Any, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Per position (batch, time-1): the loss, whether predicted right, whether counted."""
        logits = full_precision(output.logits[:, :-1])
        labels = target[:, 1:]
        counted = labels != IGNORED
        losses = F.cross_entropy(logits.transpose(1, 2), labels, ignore_index=IGNORED, reduction="none")
        correct = (logits.argmax(-1) == labels) & counted
        return losses, correct, counted

    def state(self, output: Any, target: torch.Tensor) -> torch.Tensor:
        losses, correct, counted = self._token_losses(output, target)
        return torch.stack([losses.double().sum(), correct.sum().double(), counted.sum().double()])

    def compute(self, total: list[float]) -> dict[str, float]:
        loss_sum, correct, count = total
        loss = loss_sum / count
        return {"loss": loss, "accuracy": correct / count, "perplexity": math.exp(min(loss, 700.0))}

    def predict(self, output: Any, target: torch.Tensor) -> torch.Tensor:
        losses, correct, counted = self._token_losses(output, target)
        tokens = counted.sum(1)
        mean = losses.double().sum(1) / tokens.clamp(min=1)
        return torch.stack([tokens.double(), correct.sum(1).double(), mean], 1)

    def tokens(self, batch: Any) -> int:
        """The tokens a batch trains on (its counted labels): a language model's throughput in tokens/s."""
        return int((batch["labels"][:, 1:] != IGNORED).sum())
