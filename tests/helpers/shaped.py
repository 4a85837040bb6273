"""The digits with samples of other shapes (a dict with a string id, a triple, a dataclass), and the
tasks and a two-input model that read them: the batch seam's end-to-end tests
(tests/e2e/test_batches.py). Every shape holds the same images and labels in the same order, so a
run on any of them must give a run on plain (image, label) pairs' losses bit for bit."""

from __future__ import annotations

import dataclasses

import torch
from torch.utils.data import Dataset

from hydra_ddp.data import digits as plain_digits
from hydra_ddp.models import MnistCNN
from hydra_ddp.tasks.classification import Classification


@dataclasses.dataclass
class Sample:
    image: torch.Tensor
    label: torch.Tensor
    weight: torch.Tensor  # 1.0: read by the task, changes nothing


class Shaped(Dataset):
    def __init__(self, pairs: Dataset, shape: str):
        self.pairs, self.shape = pairs, shape

    def __len__(self) -> int:
        return len(self.pairs)

    def __getitem__(self, i: int):
        image, label = self.pairs[i]
        if self.shape == "pair":
            return image, label
        if self.shape == "dict":
            return {"image": image, "label": label, "id": f"digit-{i}"}
        if self.shape == "triple":
            return image, label, torch.tensor(i)
        if self.shape == "dataclass":
            return Sample(image, label, torch.tensor(1.0))
        raise ValueError(f"no shape {self.shape!r}")


def digits(shape: str, **kwargs) -> tuple[Dataset, Dataset]:
    train, test = plain_digits(**kwargs)
    return Shaped(train, shape), Shaped(test, shape)


class DictTask(Classification):
    """Reads {"image", "label", "id"} batches by key: only how a batch splits."""

    def split(self, batch):
        return batch["image"], batch["label"]


class TripleTask(Classification):
    """(image, label, index) batches: the index is carried, unused."""

    def forward(self, model, batch):
        image, label, _ = batch
        return model(image), label


class DataclassTask(Classification):
    """Sample batches, into a model of two inputs that returns a dict."""

    def forward(self, model, batch):
        return model(batch.image, weight=batch.weight), batch.label

    def loss(self, output, target):
        return super().loss(output["logits"], target)

    def state(self, output, target):
        return super().state(output["logits"], target)

    def predict(self, output, target):
        return super().predict(output["logits"], target)


class WeightedCNN(MnistCNN):
    """MnistCNN with a second input (a per-sample weight, all ones) and a dict for its output."""

    def forward(self, image, weight):
        return {"logits": super().forward(image) * weight[:, None]}


class MissingKeyTask(Classification):
    def forward(self, model, batch):
        return model(batch["pixels"]), batch["label"]


class DictOutputTask(Classification):
    """Takes the model's dict output as if it were logits."""

    def forward(self, model, batch):
        return model(batch.image, weight=batch.weight), batch.label


@dataclasses.dataclass
class Scores:
    logits: torch.Tensor


class ScoresCNN(MnistCNN):
    """MnistCNN whose output is a dataclass (which torch's pytree, and so DDP, does not look
    into)."""

    def forward(self, x):
        return Scores(super().forward(x))


class ScoresTask(Classification):
    def loss(self, output, target):
        return super().loss(output.logits, target)

    def state(self, output, target):
        return super().state(output.logits, target)
