"""A batch as a tree (data/batches.py) and how a task meets it (Task.split, forward, samples)."""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from typing import NamedTuple

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import default_collate

from hydra_ddp.blueprint import Building
from hydra_ddp.data import batches
from hydra_ddp.errors import UserError
from hydra_ddp.reporting import flops
from hydra_ddp.tasks import Task, fit_targets
from hydra_ddp.tasks.classification import Classification


@dataclasses.dataclass
class Sample:
    image: torch.Tensor
    label: torch.Tensor
    name: str = "x"


class Pair(NamedTuple):
    image: torch.Tensor
    label: torch.Tensor


def test_map_keeps_every_container_type_and_passes_other_leaves_through():
    tree = {
        "pair": Pair(torch.zeros(2, 3), torch.ones(2)),
        "sample": Sample(torch.zeros(2, 1), torch.ones(2), name="kept"),
        "list": [torch.zeros(2), "a string", 7],
        "ordered": OrderedDict(ids=torch.arange(2)),
        "tuple": (torch.zeros(2), None),
    }
    doubled = batches.map_tensors(lambda t: t + 1, tree)
    assert isinstance(doubled["pair"], Pair) and torch.equal(
        doubled["pair"].label, torch.full((2,), 2.0)
    )
    assert isinstance(doubled["sample"], Sample) and doubled["sample"].name == "kept"
    assert doubled["list"][1:] == ["a string", 7] and isinstance(doubled["list"], list)
    assert isinstance(doubled["ordered"], OrderedDict) and torch.equal(
        doubled["ordered"]["ids"], torch.arange(1, 3)
    )
    assert isinstance(doubled["tuple"], tuple) and doubled["tuple"][1] is None
    assert torch.equal(tree["pair"].label, torch.ones(2))  # the input is not changed


def test_the_count_is_the_common_leading_dimension():
    assert batches.count((torch.zeros(5, 3), torch.zeros(5))) == 5
    assert (
        batches.count({"ids": torch.zeros(4, 9), "scale": torch.tensor(2.0), "names": ["a"] * 4})
        == 4
    )


def test_tensors_that_disagree_on_the_batch_size_are_one_line_naming_both():
    with pytest.raises(UserError, match=r"batch\['ids'\] has 4 samples, batch\['mask'\] has 3"):
        batches.count({"ids": torch.zeros(4, 9), "mask": torch.zeros(3, 9)})
    with pytest.raises(UserError, match="holds no tensor with a batch dimension"):
        batches.count({"names": ["a", "b"]})


def test_only_floating_point_images_take_the_memory_format():
    image, mask = torch.randn(2, 3, 4, 4), torch.zeros(2, 1, 4, 4, dtype=torch.long)
    moved = batches.to_device(
        {"image": image, "mask": mask}, torch.device("cpu"), torch.channels_last
    )
    assert moved["image"].is_contiguous(memory_format=torch.channels_last)
    assert moved["mask"].is_contiguous() and torch.equal(moved["image"], image)


def test_collate_is_default_collates_and_batches_dataclasses_by_field():
    pairs = [(torch.full((2,), float(i)), torch.tensor(i)) for i in range(3)]
    ours, theirs = batches.collate(pairs), default_collate(pairs)
    assert type(ours) is type(theirs) and all(torch.equal(a, b) for a, b in zip(ours, theirs))
    collated = batches.collate(
        [Sample(torch.full((2,), float(i)), torch.tensor(i), f"s{i}") for i in range(3)]
    )
    assert (
        isinstance(collated, Sample)
        and collated.image.shape == (3, 2)
        and collated.name == ["s0", "s1", "s2"]
    )
    nested = batches.collate([{"s": Sample(torch.zeros(1), torch.tensor(0))}] * 2)
    assert isinstance(nested["s"], Sample) and nested["s"].label.shape == (2,)


def test_a_batch_on_the_meta_device_keeps_shapes_and_dtypes_only():
    meta = batches.on_meta({"ids": torch.zeros(4, 9, dtype=torch.long)})
    assert (
        meta["ids"].device.type == "meta"
        and meta["ids"].shape == (4, 9)
        and meta["ids"].dtype == torch.long
    )


def test_the_default_task_takes_pairs_and_names_what_it_got_otherwise():
    task, model = Classification(), torch.nn.Linear(3, 2)
    x, y = torch.randn(4, 3), torch.tensor([0, 1, 0, 1])
    # DataLoader gives a tuple sample's batch as a list
    output, target = task.forward(model, [x, y])
    assert torch.equal(output, model(x)) and target is y
    assert task.samples((x, y)) == 4
    with pytest.raises(
        UserError,
        match="takes \\(inputs, target\\) pairs, and the data gives a dict with keys x, y",
    ):
        task.forward(model, {"x": x, "y": y})
    assert task.split(Pair(x, y)) == (x, y)  # a named pair is a pair
    with pytest.raises(UserError, match="an? Sample of image, label, name"):
        task.split(Sample(x, y))
    with pytest.raises(UserError, match="a tuple of 3"):
        task.split((x, y, y))


class KeyedTask(Classification):
    def forward(self, model, batch):
        return model(batch["x"]), batch["y"]


class SplitTask(KeyedTask):
    def split(self, batch):
        return batch["x"], batch["y"]


def test_the_fit_check_reads_targets_through_the_tasks_split():
    samples = [{"x": torch.zeros(3), "y": torch.tensor(1)}]
    assert fit_targets(Classification(), [(torch.zeros(3), 1)]) == [1]
    assert fit_targets(KeyedTask(), samples) == []  # its own forward, no split: its loss judges
    assert torch.equal(fit_targets(SplitTask(), samples)[0], torch.tensor(1))


class TwoInputs(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(8, 4, bias=False), torch.nn.Linear(6, 4, bias=False)

    def forward(self, first, second):
        return {"logits": self.a(first) + self.b(second)}


class TwoInputTask(Task):
    def forward(self, model, batch):
        return model(batch["first"], second=batch["second"]), batch["label"]

    def loss(self, output, target):
        return F.cross_entropy(output["logits"], target)


def test_the_flop_count_runs_the_tasks_forward_on_the_batch_as_it_is():
    batch = batches.on_meta(
        {
            "first": torch.zeros(5, 8),
            "second": torch.zeros(5, 6),
            "label": torch.zeros(5, dtype=torch.long),
        }
    )
    task = TwoInputTask()
    counted = flops.count(
        Building(TwoInputs), lambda model, b: task.loss(*task.forward(model, b)), batch
    )
    forward = 2 * 5 * (8 * 4 + 6 * 4)
    # backward: the weights' gradients only (the inputs need none)
    assert counted == forward + forward
