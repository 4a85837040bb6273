"""A causal language model on dict batches (`input_ids`, `labels`, and `attention_mask` or
`position_ids`): a Hugging Face `transformers` `...ForCausalLM`, or the built-in GPT called the same
way. The batch goes in as `model(**inputs)` without its labels, and the loss is computed here from
the logits, as sums over the counted tokens: a step weighs every token alike, however its batches
are split over micro-batches and ranks (Task.units), and the evaluation adds sums of token losses
and counts, which a mean cannot do."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

from hydra_ddp.data import batches
from hydra_ddp.errors import UserError
from hydra_ddp.tasks.base import IGNORED, Task, full_precision, highest_beyond


class CausalLM(Task):
    """Next-token prediction where the labels are the inputs (transformers' convention): position
    t's logits predict label t+1, and a label of -100 (padding, a packed document's first token)
    counts in nothing. The loss and accuracy are per counted token; perplexity is exp of the
    per-token loss."""

    metrics = {"loss": "min", "accuracy": "max", "perplexity": "min"}
    monitored = "loss"
    state_size = 3  # the counted tokens' losses summed, those predicted right, the tokens counted
    # per sequence: counted tokens, right ones, mean loss
    prediction_columns = ("tokens", "correct", "loss")
    integer_columns = ("tokens", "correct")

    def split(self, batch: Any) -> tuple[Any, Any]:
        if not isinstance(batch, Mapping) or "labels" not in batch:
            raise UserError(
                "task=causal_lm takes dict batches with input_ids and labels, and "
                f"the data gives {batches.describe(batch)}: choose data=documents, "
                "data=text_dicts or a data source of such dicts (task=language_model "
                "takes (inputs, next tokens) pairs; docs/language_models.md)"
            )
        return batch, batch["labels"]

    def check_target(self, target: torch.Tensor, outputs: int) -> Optional[str]:
        """Token ids beyond the vocabulary (data.num_classes, which the models' embeddings read):
        one line at the first batch, not an embedding's IndexError."""
        highest = highest_beyond(target, outputs)
        if highest is None:
            return None
        return (
            f"its token ids go up to {highest}, and data.num_classes={outputs} "
            "(the model's vocabulary): set data.num_classes to the "
            f"tokenizer's vocabulary (at least {highest + 1})"
        )

    def forward(self, model: nn.Module, batch: Any) -> tuple[Any, Any]:
        inputs, labels = self.split(batch)
        # Without its labels: a transformers model would compute its own per-batch mean loss too.
        return model(**{key: value for key, value in inputs.items() if key != "labels"}), labels

    def units(self, batch: Any) -> torch.Tensor:
        """The tokens the loss counts: every label after the first that is not -100."""
        return _counted(self.split(batch)[1])

    def tokens(self, batch: Any) -> int:
        """The tokens a batch trains on (its counted labels): a language model's throughput in
        tokens/s."""
        return int(_counted(self.split(batch)[1]))

    def _token_losses(
        self, output: Any, target: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Per position (batch, time): the loss of predicting the next label, whether predicted
        right, whether counted. The labels are shifted, not the logits (no copy of the largest
        tensor); the last position predicts nothing."""
        logits = full_precision(getattr(output, "logits", output))
        following = F.pad(target[:, 1:], (0, 1), value=IGNORED)
        counted = following != IGNORED
        losses = F.cross_entropy(
            logits.flatten(0, 1), following.flatten(), ignore_index=IGNORED, reduction="none"
        ).view_as(following)
        correct = (logits.argmax(-1) == following) & counted
        return losses, correct, counted

    def loss_sum(self, output: Any, target: torch.Tensor) -> torch.Tensor:
        logits = full_precision(getattr(output, "logits", output))
        following = F.pad(target[:, 1:], (0, 1), value=IGNORED)
        return F.cross_entropy(
            logits.flatten(0, 1), following.flatten(), ignore_index=IGNORED, reduction="sum"
        )

    def loss(self, output: Any, target: torch.Tensor) -> torch.Tensor:
        """The batch's mean over its counted tokens (what train.py --check and the FLOP count
        run)."""
        return self.loss_sum(output, target) / _counted(target).clamp(min=1)

    def state(self, output: Any, target: torch.Tensor) -> torch.Tensor:
        losses, correct, counted = self._token_losses(output, target)
        return torch.stack([losses.double().sum(), correct.sum().double(), counted.sum().double()])

    def compute(self, total: list[float]) -> dict[str, float]:
        loss_sum, correct, count = total
        loss = loss_sum / count if count else math.nan
        return {
            "loss": loss,
            "accuracy": correct / count if count else math.nan,
            "perplexity": math.exp(min(loss, 700.0)) if count else math.nan,
        }

    def crosses_documents(self, model: nn.Module, batch: Any) -> Optional[float]:
        """For a packed batch (position ids that restart mid-row): how far the model's logits for a
        document move when an earlier document shares its row, relative to their size (about 0: the
        model attends within each document only). None where no row holds two documents."""
        positions = batch.get("position_ids") if isinstance(batch, Mapping) else None
        if positions is None:
            return None
        restarts = positions[:, 1:] != positions[:, :-1] + 1
        rows = restarts.any(1).nonzero()
        if not len(rows):
            return None
        row = int(rows[0])
        start = int(restarts[row].nonzero()[0]) + 1
        later = restarts[row, start:].nonzero()
        end = start + int(later[0]) + 1 if len(later) else positions.shape[1]
        ids, where = batch["input_ids"][row : row + 1], positions[row : row + 1]
        training = model.training
        model.eval()
        try:
            with torch.no_grad():
                packed = getattr(model(input_ids=ids, position_ids=where), "logits", None)
                alone = getattr(
                    model(input_ids=ids[:, start:end], position_ids=where[:, start:end]),
                    "logits",
                    None,
                )
        except Exception:  # noqa: BLE001  (a model that takes no position ids: the first step reports it, on every rank)
            return None
        finally:
            model.train(training)
        if packed is None or alone is None:
            return None
        packed, alone = packed[0, start:end].float(), alone[0].float()
        return ((packed - alone).abs().max() / alone.abs().max().clamp(min=1e-12)).item()

    def predict(self, output: Any, target: torch.Tensor) -> torch.Tensor:
        losses, correct, counted = self._token_losses(output, target)
        tokens = counted.sum(1)
        mean = losses.double().sum(1) / tokens.clamp(min=1)
        return torch.stack([tokens.double(), correct.sum(1).double(), mean], 1)


def _counted(labels: torch.Tensor) -> torch.Tensor:
    """The labels a causal model predicts: every one after the first that is not -100."""
    return (labels[:, 1:] != IGNORED).sum()


# a relative move of a document's logits beyond float noise (1e-6 here): another document seen
CROSSING = 1e-3


def packing_warning(
    task: Task, model: nn.Module, dataset: Any, looked_at: int = 256
) -> Optional[str]:
    """One line when the training set is packed documents and the model attends across them (its
    logits for a document move with the document before it in the window), checked on the first
    window of two documents or more among the first `looked_at` samples, before training; None
    otherwise (not packed, no such window, a model that attends within each document)."""
    if not isinstance(task, CausalLM):
        return None
    window = None
    for index in range(min(len(dataset), looked_at)):
        sample = dataset[index]
        positions = sample.get("position_ids") if isinstance(sample, Mapping) else None
        if positions is None:
            return None  # not packed
        if bool((positions[1:] != positions[:-1] + 1).any()):
            window = batches.collate_for(dataset)([sample])
            break
    if window is None:
        return None
    moved = task.crosses_documents(
        model, batches.to_device(window, next(model.parameters()).device)
    )
    if moved is None or moved <= CROSSING:
        return None
    return (
        f"{type(model).__name__} attends across the documents packed into a "
        f"window (a document's logits move by {moved:.1e} with the one before "
        "it): it does not read restarting position_ids as document boundaries. "
        "Use a model that does (the built-in GPT; transformers' with sdpa or "
        "flash attention, 4.54 or later), or data.dataset.packing=false"
    )
