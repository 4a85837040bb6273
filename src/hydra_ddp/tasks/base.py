"""The task interface, and building a task from its config with its declarations checked."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Optional

import torch
from omegaconf import DictConfig, OmegaConf
from torch import nn

from hydra_ddp import monitor
from hydra_ddp.data import batches
from hydra_ddp.errors import EveryRankError, UserError, first_line, root_cause

# What the project itself reports beside a task's metrics, per split (test_samples, test_passes):
# a task's metric may not take these names.
RESERVED = ("samples", "passes")
IGNORED = batches.IGNORED  # the target of a position that counts in no loss (padding)


def full_precision(output: torch.Tensor) -> torch.Tensor:
    """A model's output in float32 at least, for a loss or a metric: a bf16 or fp16 output
    (autocast, FSDP's mixed precision) would round the sums over a batch; float32 and float64 stay
    as they are."""
    return output if output.dtype in (torch.float32, torch.float64) else output.float()


class Task:
    """How a batch becomes the loss, which metrics an evaluation reports, what a prediction is.

    Subclass it for your own experiment and name it in conf/task/ (`_target_: my_package.MyTask`).

    Metrics are exact at any world size because they come from a *state of sums*: `state(output,
    target)` is one evaluation chunk's vector of `state_size` float64 sums (per-sample losses,
    counts, a confusion matrix...). The evaluation keeps each chunk's vector in its own slot and
    adds them in chunk order, which no world size changes, then `compute(total)` turns the total
    into the metrics. Counts are exact in float64 up to 2**53.
    """

    # Each metric's name and its better direction ("min" or "max"): what trainer.monitor=val/<name>
    # may name, and what monitor_mode=auto picks. The first is shown first.
    metrics: dict[str, str] = {"loss": "min"}
    # What trainer.monitor=auto monitors: val/<this> (one of `metrics`).
    monitored: str = "loss"
    state_size: int = 1
    # eval.py predict=true: predictions.csv's columns after the sample's index, one row per sample;
    # those in integer_columns are written as integers, the others with 6 decimals.
    prediction_columns: tuple[str, ...] = ()
    integer_columns: tuple[str, ...] = ()

    # --- how a batch meets the model (override these for dict batches, several inputs, a model that
    # computes its own loss: docs/tasks.md, "Batches and model calls") ---
    def split(self, batch: Any) -> tuple[Any, Any]:
        """(inputs, target) of a batch, or of one sample (the fit check reads the target). By
        default a batch is a pair (inputs, target), as a TensorDataset or a (image, label) dataset
        gives it."""
        if isinstance(batch, (tuple, list)) and len(batch) == 2:  # a named pair too: (image, label)
            return batch[0], batch[1]
        raise UserError(
            f"task {type(self).__name__} takes (inputs, target) pairs, and the data gives "
            f"{batches.describe(batch)}: give the task a split(batch) or a forward(model, batch) "
            "(docs/tasks.md: batches and model calls)"
        )

    def forward(self, model: nn.Module, batch: Any) -> tuple[Any, Any]:
        """(output, target) of a batch, on the device: what loss, state and predict take. By default
        model(inputs) on the split's inputs. Override it for model(**batch), several inputs, or a
        model that computes its own loss (return its output, e.g. a transformers ModelOutput)."""
        inputs, target = self.split(batch)
        return model(inputs), target

    def samples(self, batch: Any) -> int:
        """How many samples a batch holds (throughput, the evaluation's count): by default the
        leading dimension its tensors share. Say otherwise for per-batch metadata or packed
        sequences."""
        return batches.count(batch)

    def tokens(self, batch: Any) -> Optional[int]:
        """The tokens a batch trains on, for a throughput in tokens/s (None: the task counts
        none)."""
        return None

    # --- what the training loss averages over ---
    def units(self, batch: Any) -> Optional[torch.Tensor]:
        """How many units the training loss averages over in this batch, when they are not its
        samples: a 0-D integer tensor (a language model's tokens that are not ignored: padding, a
        document's boundary). None (the default): the batch's samples, each weighing alike.

        A task that counts units gives loss_sum() too: a step's gradient is then the sum of every
        unit's loss over all its micro-batches and ranks, divided by their count over all of them
        (one count all-reduced per step), not a mean of per-batch means, which would weigh a batch
        of 40 counted tokens as much as one of 400."""
        return None

    def loss_sum(self, output: Any, target: Any) -> torch.Tensor:
        """The batch's per-unit losses summed, as a scalar in float32 at least (for a task whose
        units() counts): a batch with no counted unit gives 0, not a mean of nothing."""
        raise NotImplementedError(
            f"{type(self).__name__} counts units() but gives no "
            "loss_sum(output, target): the per-unit losses summed"
        )

    # --- what an output means ---
    def loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """The batch's training loss, the mean over its samples (or its units(): loss_sum() over
        their count): a scalar, best in float32."""
        raise NotImplementedError

    def state(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """One evaluation chunk's sums: a float64 vector of `state_size` values."""
        raise NotImplementedError

    def compute(self, total: list[float]) -> dict[str, float]:
        """The metrics (every name in `metrics`) from the sums over the whole split."""
        raise NotImplementedError

    def predict(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """One row of `prediction_columns` per sample of the batch."""
        raise UserError(
            f"{type(self).__name__} writes no predictions (it names no prediction_columns); "
            "run eval.py without predict=true"
        )

    def check_target(self, target: torch.Tensor, outputs: int) -> Optional[str]:
        """What is wrong with one sample's target for this task (None: it fits). `outputs`:
        data.num_classes."""
        return None


def build(task_cfg: Mapping[str, Any]) -> Task:
    """The configured task, its declarations checked: one line for what does not fit."""
    from hydra.utils import instantiate

    from hydra_ddp.config import targets

    plain = (
        OmegaConf.to_container(task_cfg, resolve=True)
        if isinstance(task_cfg, DictConfig)
        else task_cfg
    )
    targets.check(plain, "task")  # the name imports and takes its keys: one line before it is built
    try:
        task = instantiate(task_cfg)
    except Exception as error:  # noqa: BLE001  (the task's own complaint about its arguments)
        raise UserError(
            f"task ({plain['_target_']}) does not build: {first_line(root_cause(error))}"
        ) from None
    if not isinstance(task, Task):
        raise UserError(
            f"task._target_={task_cfg['_target_']!r} is not a hydra_ddp.tasks.Task: subclass it"
        )
    problem = _declaration_problem(task)
    if problem:
        raise UserError(f"task {type(task).__name__}: {problem}")
    return task


def _declaration_problem(task: Task) -> Optional[str]:
    if not task.metrics:
        return "it names no metrics; give `metrics` ({name: 'min' or 'max'})"
    for name, direction in task.metrics.items():
        if name in RESERVED:
            return (
                f"its metric {name!r} is also what the evaluation itself reports (test_{name}); "
                f"rename it (these names are the project's: {', '.join(RESERVED)})"
            )
        if not name.isidentifier():
            return f"its metric name {name!r} is not a plain name (letters, digits, _)"
        if direction not in ("min", "max"):
            return f"its metric {name!r} has direction {direction!r}: say 'min' or 'max'"
    if task.monitored not in task.metrics:
        return f"monitored={task.monitored!r} is not one of its metrics ({', '.join(task.metrics)})"
    if task.state_size < 1:
        return f"state_size={task.state_size}: a state holds at least one sum"
    unknown = set(task.integer_columns) - set(task.prediction_columns)
    if unknown:
        return f"integer_columns names {sorted(unknown)}, which are not prediction_columns"
    return None


def highest_beyond(target: torch.Tensor, outputs: int) -> Optional[int]:
    """The target's highest index where the model has no output for it (of `outputs`; the ignored,
    negative ones aside), else None."""
    highest = int(target.max()) if target.numel() else -1
    return highest if highest >= outputs else None


def beyond_classes(target: torch.Tensor, outputs: int) -> Optional[str]:
    """A class index the model has no output for."""
    highest = highest_beyond(target, outputs)
    if highest is None:
        return None
    return (
        f"its class labels go up to {highest}, and the model makes data.num_classes={outputs} "
        f"output(s): set data.num_classes to the data's class count (at least {highest + 1})"
    )


def fit_targets(task: Task, samples: list[Any]) -> list[Any]:
    """The targets of a few samples, for the fit check: none where the task reads its batches in a
    forward of its own without saying how they split (its forward and loss judge them)."""
    if type(task).split is Task.split and type(task).forward is not Task.forward:
        return []
    return [task.split(sample)[1] for sample in samples]


def misfit(task: Task, targets: Any, outputs: int) -> Optional[str]:
    """Why the task cannot learn from data with these samples' targets (None: it fits): each target
    of a few samples (the first batch's), checked by the task."""
    for target in targets:
        try:
            target = torch.as_tensor(target)
        except (TypeError, ValueError, RuntimeError):
            continue  # a task's own kind of target (a dict, say): its forward and loss judge it
        problem = task.check_target(target, outputs)
        if problem:
            return f"task {type(task).__name__} does not fit the data: {problem}"
    return None


def weighs_units(task: Task) -> bool:
    """Whether the task's training loss averages over units of its own (tokens), not samples."""
    return type(task).units is not Task.units


def checked_loss(
    task: Task,
    model: nn.Module,
    batch: Any,
    check_target: Optional[Callable[[Any], None]] = None,
    error: type[UserError] = UserError,
    reduce: Optional[Callable[[Any, Any], torch.Tensor]] = None,
) -> torch.Tensor:
    """A batch's loss (`reduce(output, target)`: task.loss by default, or its loss_sum), where a
    task that cannot read the batch or the model's output says so in one line (an `error`) instead
    of a traceback: the first batch of a run, and train.py --check's."""
    name = type(task).__name__
    reduce = reduce or task.loss
    # The targets before the model runs where the task says how a batch splits (a language model's
    # labels are its inputs: an id beyond the vocabulary is one line, not an embedding's
    # IndexError).
    splits = type(task).split is not Task.split or type(task).forward is Task.forward
    before = check_target is not None and splits
    try:
        target = task.split(batch)[1] if before else None
    except UserError as problem:  # the default split's: the batch is not a pair
        raise error(str(problem)) from None
    if before:
        check_target(target)  # type: ignore[misc]
    try:
        output, target = task.forward(model, batch)
    except UserError as problem:
        raise error(str(problem)) from None
    except KeyError as missing:
        raise error(
            f"task {name} asks the batch for {missing.args[0]!r}, which it lacks: it is "
            f"{batches.describe(batch)} (docs/tasks.md: batches and model calls)"
        ) from None
    if check_target is not None and not before:
        check_target(target)
    try:
        return reduce(output, target)
    except (TypeError, AttributeError, KeyError, IndexError) as problem:
        raise error(
            f"task {name} cannot read the model's output, {batches.describe(output)}: "
            f"{first_line(problem)}; give the task a forward(model, batch) that "
            "returns what its loss takes (docs/tasks.md: batches and model calls)"
        ) from None


def first_loss(
    task: Task,
    model: nn.Module,
    batch: Any,
    outputs: int,
    reduce: Callable[[Any, Any], torch.Tensor],
) -> torch.Tensor:
    """The run's first loss (`reduce`: task.loss or its loss_sum), checked: the task reads the
    batch and the model's output, fits the data (`outputs`: data.num_classes) and reduces to a
    scalar. What every rank judges alike (the first target, the loss's shape) fails on every rank
    (EveryRankError), the rest of this rank's first batch (a class label beyond the outputs, say)
    on this rank."""

    def check_fit(y: Any) -> None:
        if not isinstance(y, torch.Tensor) or y.dim() == 0:
            return  # a target that is not one tensor is the task's own to judge
        problem = misfit(task, y[:1], outputs)
        if problem:
            raise EveryRankError(problem)
        problem = misfit(task, y[1:], outputs)
        if problem:
            raise UserError(problem)

    loss = checked_loss(task, model, batch, check_fit, EveryRankError, reduce)
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
        shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise EveryRankError(
            f"task {type(task).__name__}: its loss is {shape}, not a scalar; reduce it "
            "(e.g. .mean()) in the task's loss()"
        )
    return loss


def monitor_of(cfg: DictConfig) -> tuple[Optional[str], str]:
    """monitor.settle() for a composed config: the monitored metric and its mode, by its task (built
    here; a task that does not build settles by the names alone, and the run then says what is
    wrong)."""
    try:
        task = build(cfg.task)
        directions, default = dict(task.metrics), task.monitored
    except Exception:  # noqa: BLE001
        directions, default = {}, "loss"
    return monitor.settle(cfg.trainer.monitor, cfg.trainer.monitor_mode, directions, default)


def worst_for(cfg: DictConfig) -> Optional[float]:
    """monitor.worst() for a composed config, in its task's direction: what a failed trial
    returns."""
    return monitor.worst(*monitor_of(cfg))
