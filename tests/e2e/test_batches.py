"""Batches of any shape in real runs (tests/helpers/shaped.py): the digits as dicts with a string
id, as (image, label, index) triples and as dataclasses read by a two-input model with a dict output
train at 2 ranks, stop and resume, and evaluate at 1 and 2 ranks with the losses and test metrics of
plain (image, label) pairs, bit for bit; a task that cannot read its batch or its model's output
stops in one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from support import check_ok, csv_step_losses, run_eval, run_train, summary

FULL, HALF = 8, 4
METRICS = ("test_loss", "test_accuracy", "test_samples")
SHAPES = {  # shape: (task, model)
    "dict": ("shaped.DictTask", None),
    "triple": ("shaped.TripleTask", None),
    "dataclass": ("shaped.DataclassTask", "shaped.WeightedCNN"),
}


def shaped(shape: str, task: str | None = None, model: str | None = None) -> tuple[str, ...]:
    return (
        "data.dataset._target_=shaped.digits",
        f"+data.dataset.shape={shape}",
        *((f"task._target_={task}",) if task else ()),
        *((f"model._target_={model}",) if model else ()),
        "trainer.log_every=1",
    )


@pytest.fixture(scope="module")
def pairs(tmp_path_factory) -> Path:
    """The reference: the same wrapper giving plain (image, label) pairs, FULL steps straight."""
    run_dir = tmp_path_factory.mktemp("pairs")
    check_ok(run_train(run_dir, *shaped("pair"), f"trainer.max_steps={FULL}"))
    return run_dir


@pytest.mark.timeout(400)
@pytest.mark.parametrize("shape", list(SHAPES))
def test_a_batch_of_any_shape_trains_resumes_and_evaluates_as_pairs_do(
    pairs: Path, tmp_path: Path, shape: str
):
    overrides = shaped(shape, *SHAPES[shape])
    run_dir = tmp_path / "run"
    check_ok(run_train(run_dir, *overrides, f"trainer.max_steps={HALF}"))
    check_ok(run_train(run_dir, *overrides, f"trainer.max_steps={FULL}", "trainer.resume=auto"))
    s, reference = summary(run_dir), summary(pairs)
    assert s["steps"] == FULL and s["resumed_from"].endswith(f"step-{HALF:08d}.pt")
    assert csv_step_losses(run_dir) == csv_step_losses(pairs)  # every digit, every step
    assert {k: s[k] for k in METRICS} == {k: reference[k] for k in METRICS}
    assert (
        s["samples_per_sec"] > 0
        and s["flops"]["per_sample"] == reference["flops"]["per_sample"]
        or (
            shape == "dataclass"  # the two-input model's one extra multiply per logit
        )
    )
    for ranks in (1, 2):
        out = tmp_path / f"eval{ranks}"
        check_ok(run_eval(out, f"ckpt={run_dir}", f"trainer.nproc={ranks}"))
        result = json.loads((out / "eval.json").read_text())
        assert {k: result[k] for k in METRICS} == {k: s[k] for k in METRICS}, ranks


@pytest.mark.timeout(200)
@pytest.mark.parametrize(
    "overrides, line",
    [
        (
            shaped("dict"),  # the default task takes pairs
            "task Classification takes (inputs, target) pairs, "
            "and the data gives a dict with keys image, label, id",
        ),
        (
            shaped("dict", "shaped.MissingKeyTask"),
            "task MissingKeyTask asks the batch for 'pixels', which "
            "it lacks: it is a dict with keys image, label, id",
        ),
        (
            shaped("dataclass", "shaped.DictOutputTask", "shaped.WeightedCNN"),
            "task DictOutputTask cannot read the model's output, a dict with keys logits",
        ),
    ],
    ids=["pairs-only", "missing-key", "unread-output"],
)
def test_a_task_that_cannot_read_its_batch_or_output_stops_in_one_line(
    tmp_path: Path, overrides, line: str
):
    for check in (("--check",), ()):  # before launch, and in the workers' first step
        done = run_train(tmp_path / f"run{len(check)}", *check, *overrides, "trainer.max_steps=2")
        assert done.returncode == 2, done.stderr
        assert line in done.stderr and "Traceback" not in done.stderr, done.stderr


def test_an_output_ddp_cannot_look_into_is_one_line_under_a_static_graph(tmp_path: Path):
    # A dataclass output hides its tensors from DDP: under a static graph the first step's gradients
    # would not be averaged and the replicas would part. Refused at the first step; without the
    # static graph (DDP's autograd hooks average every step) it trains.
    scores = (
        "model._target_=shaped.ScoresCNN",
        "task._target_=shaped.ScoresTask",
        "trainer.max_steps=2",
    )
    done = run_train(tmp_path / "static", *scores)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert "the model returns a Scores, in which DDP finds no tensor" in done.stderr, done.stderr
    check_ok(run_train(tmp_path / "dynamic", *scores, "strategy.static_graph=false"))
