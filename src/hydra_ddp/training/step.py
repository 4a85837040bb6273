"""One optimizer step's arithmetic: its micro-batches' forwards and backwards in the run's
precision, each loss weighed by what the task averages over, the gradient all-reduce on the last
micro-batch only, clipping, the optimizer step, the learning-rate schedule and the weights'
average."""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist

from hydra_ddp.config.schema import TrainerConf
from hydra_ddp.data import batches
from hydra_ddp.errors import EveryRankError, UserError
from hydra_ddp.recipe import schedules
from hydra_ddp.tasks import Task, first_loss, weighs_units
from hydra_ddp.training.meter import StepTimer
from hydra_ddp.training.parts import Optimization, Trained

# trainer.precision → autocast's dtype (None: fp32, no autocast).
AUTOCAST_DTYPES: dict[str, Optional[torch.dtype]] = {
    "32": None,
    "bf16": torch.bfloat16,
    "16": torch.float16,
}


@dataclass(frozen=True)
class StepPlan:
    """What the loop knows of an optimizer step before its batches arrive: each micro-batch's
    samples (an epoch's short last batch included: data.drop_last=false), and the batches
    themselves, taken one by one as the step runs, or all at once where the task must count them
    first (Task.units)."""

    sizes: list[int]
    batches: Iterable[Any]


def optimizer_steps(
    loader: Iterable, accumulate: int, done: int, length: Any, together: bool = False
) -> Iterator[StepPlan]:
    """An epoch's batches grouped by optimizer step: `accumulate` at a time, and the epoch's last
    step whatever is left (fewer when the batches do not divide). `done`: batches of the epoch
    already trained on (a resumed run's: a multiple of `accumulate`), which the loader skips;
    `length`: the run's (training.length: batches per epoch, samples per batch, the last batch's);
    `together`: each step's batches fetched before its first forward (else one by one, as the
    forwards take them)."""
    batches = iter(loader)
    while done < length.batches_per_epoch:
        count = min(accumulate, length.batches_per_epoch - done)
        sizes = [length.batch_samples] * count
        if done + count == length.batches_per_epoch:
            sizes[-1] = length.last_batch_samples
        group = (
            list(itertools.islice(batches, count)) if together else itertools.islice(batches, count)
        )
        yield StepPlan(sizes, group)
        done += count


def sample_weights(sizes: list[int]) -> Optional[list[float]]:
    """How each micro-batch's mean loss enters a step over samples: None where the micro-batches are
    alike (each its mean ÷ their number: the mean over every sample, as one batch of them all would
    give), else each its share of the step's samples (an epoch's short last batch weighs less).
    Every rank holds as many samples (data.even_shards=true; else one batch per step), so the shares
    are the global ones."""
    if len(set(sizes)) == 1:
        return None
    total = sum(sizes)
    return [size / total for size in sizes]


def build(config: Optional[dict[str, Any]], *parts: Any) -> Step:
    """The run's step: trainer.step's class (a Step subclass, given the parts then its own keys),
    or Step."""
    if config is None:
        return Step(*parts)
    from hydra.utils import instantiate

    return instantiate(config, _partial_=True, _convert_="all")(*parts)


class Step:
    """An optimizer step over a group of micro-batches: the forward and backward of each, then the
    optimizer step, the schedule's next rate and the average's update.

    The step's gradient is the mean over every unit of the step, on every rank: samples, or the
    task's own units (Task.units: tokens that are not padding). Over units, each rank counts its
    micro-batches' units and one all-reduce, started before the first forward, adds the counts of
    all replicas; each micro-batch's loss_sum is then divided by that total ÷ replicas (the gradient
    all-reduce averages over replicas). A micro-batch with no counted unit adds nothing, and no
    nan."""

    def __init__(
        self,
        settings: TrainerConf,
        trained: Trained,
        optimization: Optimization,
        timer: StepTimer,
        outputs: int,
    ):
        """`settings`: the trainer section; `outputs`: data.num_classes, what the model makes per
        sample."""
        self.model, self.task, self.strategy = trained.model, trained.task, trained.strategy
        self.optimization = optimization  # the optimizer's, the schedule's and the average's states
        # when the schedule steps: after each optimizer step, or (torch's) at an epoch's end
        self.schedule = schedules.Stepping(optimization.scheduler, optimization.optimizer)
        # the weights' moving average, updated after each optimizer step (or None)
        self.optimizer, self.ema = optimization.optimizer, optimization.ema
        self.device, self.timer, self.memory_format = trained.device, timer, trained.memory_format
        self.outputs = outputs
        # what the gradient all-reduce averages over
        self.replicas = trained.strategy.data_parallel_size()
        # the loss averages over the task's units (tokens), not samples
        self.over_units = weighs_units(self.task)
        # tokens/s
        self.counts_tokens = self.over_units or type(self.task).tokens is not Task.tokens
        self.checked = False  # the first batch: the task fits the data, its loss is a scalar
        self.amp_dtype = AUTOCAST_DTYPES[str(settings.precision)]
        # fp16 only
        self.scaler = torch.amp.GradScaler(
            self.device.type, enabled=str(settings.precision) == "16"
        )
        self.grad_clip = settings.grad_clip
        # (step, global norm before clipping), until logged
        self.grad_norms: list[tuple[int, torch.Tensor]] = []
        # For the FLOP count (reporting/flops.py): the first batch on the meta device, and its first
        # sample for real (for a model that cannot run on the meta device).
        self.first_batch: Any = None
        self.first_sample: Any = None

    def run(self, plan: StepPlan, step: int) -> tuple[torch.Tensor, int, Any]:
        """Forward and backward of each micro-batch of the plan, then optimizer step `step`. Returns
        this rank's part of the step's loss (its mean over the ranks, the loss window's, is the
        step's loss over every unit), its samples, and its tokens (a tensor where the task counts
        units, read when needed: no wait for the device each step; None where it counts none)."""
        weigh, tokens = self._weighing(plan)
        parts, samples, last = [], 0, len(plan.sizes) - 1
        for i, batch in enumerate(plan.batches):
            # samples, not targets (a sequence's tokens, an image's pixels)
            samples += self.task.samples(batch)
            if tokens is not None and not self.over_units:
                tokens += self.task.tokens(batch)
            # DDP's all-reduce in the last micro-batch's backward only.
            parts.append(self._micro_batch(batch, i == last, lambda loss, i=i: weigh(i, loss)))
        if self.grad_clip:
            # fp16: clip the true gradients, not the scaled ones
            self.scaler.unscale_(self.optimizer)
            # The gradients are all-reduced already: the same norm, and the same clipping, on every
            # rank.
            norm = self.strategy.clip_grad_norm(self.grad_clip)  # FSDP, TP: over the shards
            self.grad_norms.append((step, norm.detach()))
        self.update()
        self.scaler.update()
        if self.ema is not None:
            self.ema.update()
        self.schedule.optimizer_stepped(step)
        self.timer.lap("optimizer")
        loss = parts[0] if len(parts) == 1 else torch.stack(parts).sum()
        return loss, samples, tokens

    def update(self) -> None:
        """The optimizer step on the step's gradients (all-reduced, unscaled where clipped), then
        their reset. A custom step overrides this, and extra_state with it (docs/extending.md)."""
        self.scaler.step(self.optimizer)
        self.optimizer.zero_grad(set_to_none=True)

    def extra_state(self) -> dict[str, Any]:
        """A custom step's own state (a second optimizer's), saved in each checkpoint: {} saves
        nothing."""
        return {}

    def load_extra_state(self, state: dict[str, Any]) -> None:
        """What extra_state saved, when the run resumes."""

    def _weighing(self, plan: StepPlan) -> tuple[Callable[[int, torch.Tensor], torch.Tensor], Any]:
        """weigh(i, loss): micro-batch i's loss as its share of the step's gradient; and the step's
        tokens so far (this rank's units where the task counts them; 0 where it counts tokens only
        for throughput, added as the batches pass; None where it counts none)."""
        if self.over_units:
            divisor, units = self._unit_divisor(plan.batches)  # type: ignore[arg-type]  (a list: together)
            return (lambda i, total: total / divisor(total.dtype)), units
        counts = 0 if self.counts_tokens else None
        weights = sample_weights(plan.sizes)
        if weights is not None:
            return (lambda i, loss: loss * weights[i]), counts
        if len(plan.sizes) > 1:
            count = len(plan.sizes)
            return (lambda i, loss: loss / count), counts
        return (lambda i, loss: loss), counts  # one micro-batch: no extra op in the graph

    def _unit_divisor(
        self, group: list[Any]
    ) -> tuple[Callable[[torch.dtype], torch.Tensor], torch.Tensor]:
        """Count the group's units, start adding them over the replicas, and give what each
        micro-batch's loss_sum is divided by: the step's units ÷ replicas (at least one unit in
        all), in the loss's dtype, read when the first micro-batch needs it (its forward hides the
        sum); and this rank's units."""
        try:
            counts = [self.task.units(batch) for batch in group]
        except UserError as problem:  # a batch the task cannot read: one line, on every rank alike
            raise (EveryRankError(str(problem)) if not self.checked else problem) from None
        local = torch.stack(
            [torch.as_tensor(c).to(self.device, torch.int64, non_blocking=True) for c in counts]
        ).sum()
        total = local.clone()
        work = self.strategy.sum_over_replicas(total)
        divisors: dict[torch.dtype, torch.Tensor] = {}

        def divisor(dtype: torch.dtype) -> torch.Tensor:
            nonlocal work
            if work is not None:
                work.wait()
                work = None
            if dtype not in divisors:
                divisors[dtype] = (total.clamp(min=1).double() / self.replicas).to(dtype)
            return divisors[dtype]

        return divisor, local

    def _micro_batch(
        self, batch: Any, sync: bool, weigh: Callable[[torch.Tensor], torch.Tensor]
    ) -> torch.Tensor:
        """Forward and backward of one micro-batch, its loss weighed by `weigh` (its share of the
        step's gradient); DDP all-reduces the gradients in the backward of a `sync` one."""
        if not self.checked:
            self.first_batch, self.first_sample = (
                batches.on_meta(batch),
                batches.first_sample(batch),
            )
        batch = batches.to_device(batch, self.device, self.memory_format)
        reduce = self.task.loss_sum if self.over_units else self.task.loss
        # no all-reduce mid-accumulation
        with contextlib.nullcontext() if sync else self.strategy.no_sync():
            with torch.autocast(
                self.device.type, dtype=self.amp_dtype, enabled=self.amp_dtype is not None
            ):
                if self.checked:
                    loss = reduce(*self.task.forward(self.model, batch))
                else:  # a task that cannot read the batch, the output or the data: one line
                    loss = first_loss(self.task, self.model, batch, self.outputs, reduce)
                    self.checked = True
            self.timer.lap("forward")
            weighed = weigh(loss)
            self.scaler.scale(weighed).backward()  # DDP all-reduces here on sync
            self.timer.lap("backward")
        return weighed.detach()

    def take_logged(self, up_to: int) -> tuple[dict[int, float], dict[int, float]]:
        """The gradient norms and the per-step rates of the steps up to `up_to` not taken yet:
        {step: value} each."""
        taken = [(step, norm) for step, norm in self.grad_norms if step <= up_to]
        self.grad_norms = self.grad_norms[len(taken) :]  # appended in step order
        rates = self.schedule.take_rates(up_to)
        if not taken:
            return {}, rates
        norms = torch.stack([norm for _, norm in taken]).tolist()
        return dict(zip((step for step, _ in taken), norms)), rates

    def scaler_state(self) -> Optional[dict[str, Any]]:
        return self.scaler.state_dict() if self.scaler.is_enabled() else None

    def load_scaler_state(self, saved: Optional[dict[str, Any]]) -> None:
        if saved and self.scaler.is_enabled():
            self.scaler.load_state_dict(saved)

    def sync_optimizer_state(self) -> None:
        """After an uneven epoch, Join has given every rank the weights of the ranks that ran
        longest (rank 0 among them); their optimizer state (momentum, Adam's moments) and the
        weights' average follow from rank 0."""
        tensors = [
            v
            for state in self.optimizer.state.values()
            for v in state.values()
            if isinstance(v, torch.Tensor)
        ]
        if self.scaler.is_enabled():
            tensors += [
                v for v in (self.scaler._scale, self.scaler._growth_tracker) if v is not None
            ]
        if self.ema is not None:
            tensors += self.ema.tensors()
        for value in tensors:
            # e.g. Adam's step counter lives on the CPU; nccl needs the GPU
            on_device = value.to(self.device)
            dist.broadcast(on_device, src=0)
            value.copy_(on_device)
