"""Tasks, in this process: the built-in ones' metrics are exact sums, and a task that cannot work is
one line (a user's own task trained, evaluated and searched: tests/e2e/test_tasks.py)."""

from __future__ import annotations

import math
import re
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hydra import compose, initialize_config_dir

from hydra_ddp import tasks
from hydra_ddp.config.schema import register_schema
from hydra_ddp.errors import UserError
from hydra_ddp.launch import resolve

from support import (
    REPO,
)

register_schema()


def _chunked_metrics(
    task: tasks.Task, output: torch.Tensor, target: torch.Tensor, chunks: int
) -> dict[str, float]:
    """What the evaluation computes: each chunk's state, added in chunk order, then compute()."""
    states = [task.state(o, t) for o, t in zip(output.chunk(chunks), target.chunk(chunks))]
    assert all(s.dtype == torch.float64 and s.shape == (task.state_size,) for s in states)
    return task.compute(torch.stack(states).sum(0).tolist())


def test_regression_metrics_are_the_textbook_ones_from_exact_sums():
    gen = torch.Generator().manual_seed(0)
    target = torch.randn(300, generator=gen) * 3 + 1
    output = (target + torch.randn(300, generator=gen)).unsqueeze(1)  # a model's (batch, 1)
    got = _chunked_metrics(tasks.Regression(), output, target, chunks=7)
    # The textbook formulas over the whole set at once, in numpy's float64 (not scikit-learn's
    # functions: importing sklearn.metrics made this the unit layer's slowest test).
    y, p = target.double().numpy(), output[:, 0].double().numpy()
    mse, mae = np.mean((y - p) ** 2), np.mean(np.abs(y - p))
    r2 = 1 - np.sum((y - p) ** 2) / np.sum((y - y.mean()) ** 2)
    # errors in float32
    assert got["mse"] == got["loss"] == pytest.approx(mse, rel=1e-6)
    assert got["mae"] == pytest.approx(mae, rel=1e-6)
    assert got["r2"] == pytest.approx(r2, rel=1e-6)
    assert tasks.Regression().loss(output, target) == F.mse_loss(output[:, 0], target)


def test_segmentation_metrics_come_from_the_confusion_matrix():
    gen = torch.Generator().manual_seed(0)
    k = 4
    target = torch.randint(0, k - 1, (6, 5, 5), generator=gen)  # class 3 never occurs in the masks
    output = torch.randn(6, k, 5, 5, generator=gen)
    got = _chunked_metrics(tasks.Segmentation(k), output, target, chunks=3)
    predicted = output.argmax(1)
    assert got["pixel_accuracy"] == (predicted == target).double().mean().item()
    ious = []
    for c in range(k):
        inter = ((predicted == c) & (target == c)).sum().item()
        union = ((predicted == c) | (target == c)).sum().item()
        if union:
            ious.append(inter / union)
    assert got["mean_iou"] == pytest.approx(sum(ious) / len(ious), rel=1e-12)
    assert got["loss"] == pytest.approx(F.cross_entropy(output, target).item(), rel=1e-6)


def test_classification_and_language_model_metrics():
    gen = torch.Generator().manual_seed(0)
    logits, labels = torch.randn(50, 10, generator=gen), torch.randint(0, 10, (50,), generator=gen)
    got = _chunked_metrics(tasks.Classification(), logits, labels, chunks=4)
    assert got["accuracy"] == (logits.argmax(1) == labels).double().mean().item()
    assert got["loss"] == pytest.approx(F.cross_entropy(logits, labels).item(), rel=1e-6)
    tokens, targets = (
        torch.randn(8, 256, 12, generator=gen),
        torch.randint(0, 256, (8, 12), generator=gen),
    )
    lm = _chunked_metrics(tasks.LanguageModel(), tokens, targets, chunks=3)
    assert lm["perplexity"] == math.exp(lm["loss"])
    assert lm["loss"] == pytest.approx(F.cross_entropy(tokens, targets).item(), rel=1e-6)


def test_every_chunking_gives_the_same_bits_when_chunks_are_added_in_order():
    """The evaluation's guarantee: a chunk's state is computed alike wherever it runs, and the
    states are added in chunk order. A world size only changes which rank computes which chunk."""
    gen = torch.Generator().manual_seed(1)
    output, target = (
        torch.randn(64, 3, 8, 8, generator=gen),
        torch.randint(0, 3, (64, 8, 8), generator=gen),
    )
    task = tasks.Segmentation(3)
    states = [task.state(o, t) for o, t in zip(output.split(16), target.split(16))]
    for ranks in (1, 2, 3):
        slots = torch.zeros(len(states), task.state_size, dtype=torch.float64)
        # each rank fills its chunks' slots; the all-reduce adds the zeros elsewhere
        for rank in range(ranks):
            mine = torch.zeros_like(slots)
            for chunk in range(rank, len(states), ranks):
                mine[chunk] = task.state(output.split(16)[chunk], target.split(16)[chunk])
            slots += mine
        assert task.compute(slots.sum(0).tolist()) == task.compute(
            torch.stack(states).sum(0).tolist()
        )


@pytest.mark.parametrize(
    "target, task, message",
    [
        (
            torch.tensor(3),
            tasks.Regression(),
            "needs real-valued targets, and the data's are int64",
        ),
        (
            torch.tensor(0.5),
            tasks.Classification(),
            "needs integer class labels, and the data's targets are float32",
        ),
        (torch.tensor(3), tasks.Segmentation(3), r"needs a mask .* shape \(\)"),
        (
            torch.zeros(8, 8, dtype=torch.long),
            tasks.Classification(),
            r"one class label per sample.* shape \(8, 8\)",
        ),
        (torch.tensor(2), tasks.LanguageModel(), "a sequence of next tokens per sample"),
    ],
)
def test_a_task_that_does_not_fit_the_data_says_why(target, task, message):
    problem = tasks.misfit(task, [target], outputs=1)
    assert problem is not None and "\n" not in problem
    assert problem.startswith(f"task {type(task).__name__} does not fit the data: ")
    assert re.search(message, problem), problem


class _Reserved(tasks.Task):
    metrics = {"loss": "min", "samples": "max"}


class _Sideways(tasks.Task):
    metrics = {"loss": "min", "score": "up"}


@pytest.mark.parametrize(
    "target, message",
    [
        (
            f"{__name__}._Reserved",
            "its metric 'samples' is also what the evaluation itself reports",
        ),
        (f"{__name__}._Sideways", "its metric 'score' has direction 'up'"),
        ("torch.nn.Linear", "is not a hydra_ddp.tasks.Task: subclass it"),
    ],
)
def test_a_task_that_declares_what_cannot_work_is_one_line(target, message):
    cfg = {
        "_target_": target,
        **({"in_features": 1, "out_features": 1} if "Linear" in target else {}),
    }
    with pytest.raises(UserError, match=message) as refused:
        tasks.build(cfg)
    assert "\n" not in str(refused.value)


def _resolved(tmp_path: Path, *overrides: str) -> dict:
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base=None):
        return resolve.resolve(
            compose(config_name="config", overrides=list(overrides)), tmp_path, None
        )


def test_the_monitor_names_a_metric_of_the_task_and_takes_its_direction(tmp_path: Path):
    regression = ("task=regression", "data=diabetes", "model=mlp")
    with pytest.raises(
        UserError,
        match="trainer.monitor='val/accuracy' is not a metric of this task; choose one of "
        "val/loss, val/mse, val/mae, val/r2, train/loss",
    ):
        _resolved(tmp_path, *regression, "trainer.monitor=val/accuracy")
    assert _resolved(tmp_path, *regression, "trainer.monitor=val/r2").trainer.monitor_mode == "max"
    assert _resolved(tmp_path, *regression, "trainer.monitor=val/mae").trainer.monitor_mode == "min"
    # auto: the task's own choice, in its direction.
    for overrides, chosen in (
        (regression, ("val/loss", "min")),
        (("+experiment=shapes_segnet",), ("val/mean_iou", "max")),
        ((), ("val/accuracy", "max")),
        (("+experiment=text_gpt",), ("val/loss", "min")),
    ):
        trainer = _resolved(tmp_path, *overrides, "trainer.monitor=auto").trainer
        assert (trainer.monitor, trainer.monitor_mode) == chosen, overrides
