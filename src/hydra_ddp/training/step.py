"""One optimizer step's work: each batch's forward and backward in the run's precision, the
gradient all-reduce on the group's last batch only, clipping, and the optimizer step."""

from __future__ import annotations

import contextlib
from typing import Any, Optional

import torch
import torch.distributed as dist

from hydra_ddp.data import batches
from hydra_ddp.errors import EveryRankError, UserError
from hydra_ddp.tasks import checked_loss, misfit
from hydra_ddp.training.timing import StepTimer

# trainer.precision → autocast's dtype (None: fp32, no autocast).
AUTOCAST_DTYPES: dict[str, Optional[torch.dtype]] = {"32": None, "bf16": torch.bfloat16, "16": torch.float16}


def accumulation_group(batch: int, accumulate: int, batches_per_epoch: int) -> int:
    """How many batches the optimizer step of the epoch's `batch`-th (from 1) batch takes: `accumulate`,
    but fewer for the epoch's last step when the batches do not divide (divided by its own size, it
    takes the mean gradient of its batches, as every other step does)."""
    first = (batch - 1) // accumulate * accumulate + 1
    return min(accumulate, batches_per_epoch - first + 1)


class Step:
    """Forward, backward and (on a group's last batch) the optimizer step, for one batch."""

    def __init__(self, settings: Any, parts: Any, timer: StepTimer, outputs: int):
        """`settings`: the trainer section; `parts`: the worker's (training.parts); `outputs`:
        data.num_classes, what the model makes per sample."""
        self.model, self.task, self.optimizer, self.strategy = parts.model, parts.task, parts.optimizer, parts.strategy
        self.ema = parts.ema  # the weights' moving average, updated after each optimizer step (or None)
        self.device, self.timer, self.memory_format = parts.device, timer, parts.memory_format
        self.outputs = outputs
        self.checked = False  # the first batch: the task fits the data, its loss is a scalar
        self.amp_dtype = AUTOCAST_DTYPES[str(settings.precision)]
        self.scaler = torch.amp.GradScaler(self.device.type, enabled=str(settings.precision) == "16")  # fp16 only
        self.grad_clip = settings.grad_clip
        self.grad_norms: list[tuple[int, torch.Tensor]] = []  # (step, global norm before clipping), until logged
        # For the FLOP count (reporting/flops.py): the first batch on the meta device, and its first
        # sample for real (for a model that cannot run on the meta device).
        self.first_batch: Any = None
        self.first_sample: Any = None

    def run(self, batch: Any, sync: bool, group: int, step: int) -> torch.Tensor:
        """Forward and backward of one batch; the optimizer makes step `step` on `sync` batches only.
        `group`: the batches of this optimizer step, whose mean loss its gradient is."""
        if not self.checked:
            self.first_batch, self.first_sample = batches.on_meta(batch), batches.first_sample(batch)
        batch = batches.to_device(batch, self.device, self.memory_format)
        with contextlib.nullcontext() if sync else self.strategy.no_sync():  # no all-reduce mid-accumulation
            with torch.autocast(self.device.type, dtype=self.amp_dtype, enabled=self.amp_dtype is not None):
                if self.checked:
                    loss = self.task.loss(*self.task.forward(self.model, batch))
                else:
                    # A task that cannot read the batch or the output: one line, on every rank alike.
                    loss = checked_loss(self.task, self.model, batch, self._check_fit, EveryRankError)
            if not self.checked:
                self._check_loss(loss)
            self.timer.lap("forward")
            scaled = loss / group if group > 1 else loss  # no extra op in the graph for 1
            self.scaler.scale(scaled).backward()  # DDP all-reduces here on sync
            self.timer.lap("backward")
        if sync:
            if self.grad_clip:
                self.scaler.unscale_(self.optimizer)  # fp16: clip the true gradients, not the scaled ones
                # The gradients are all-reduced already: the same norm, and the same clipping, on every rank.
                norm = self.strategy.clip_grad_norm(self.grad_clip)  # FSDP, TP: over the shards
                self.grad_norms.append((step, norm.detach()))
            self.scaler.step(self.optimizer)
            self.scaler.update()
            self.optimizer.zero_grad(set_to_none=True)
            if self.ema is not None:
                self.ema.update()
            self.timer.lap("optimizer")
        return loss.detach()

    def _check_fit(self, y: Any) -> None:
        """The task fits the data, before the first loss: judged on the first batch's first target
        on every rank alike (the same kind of data: the run's failure), then on the rest of this
        rank's first batch (a class label beyond data.num_classes, say: this rank's failure). A target
        that is not one tensor is the task's own to judge."""
        if not isinstance(y, torch.Tensor) or y.dim() == 0:
            return
        problem = misfit(self.task, y[:1], self.outputs)
        if problem:
            raise EveryRankError(problem)
        problem = misfit(self.task, y[1:], self.outputs)
        if problem:
            raise UserError(problem)

    def _check_loss(self, loss: Any) -> None:
        """The task's loss, once: a scalar tensor, or one line on every rank (each computes the same
        first batch's shape)."""
        if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
            shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
            raise EveryRankError(
                f"task {type(self.task).__name__}: its loss is {shape}, not a scalar; reduce it "
                "(e.g. .mean()) in the task's loss()"
            )
        self.checked = True

    def take_grad_norms(self, up_to: int) -> dict[int, float]:
        """The norms of the steps up to `up_to` not taken yet: {step: value}."""
        taken = [(step, norm) for step, norm in self.grad_norms if step <= up_to]
        self.grad_norms = self.grad_norms[len(taken) :]  # appended in step order
        if not taken:
            return {}
        return dict(zip((step for step, _ in taken), torch.stack([norm for _, norm in taken]).tolist()))

    def scaler_state(self) -> Optional[dict[str, Any]]:
        return self.scaler.state_dict() if self.scaler.is_enabled() else None

    def load_scaler_state(self, saved: Optional[dict[str, Any]]) -> None:
        if saved and self.scaler.is_enabled():
            self.scaler.load_state_dict(saved)

    def sync_optimizer_state(self) -> None:
        """After an uneven epoch, Join has given every rank the weights of the ranks that ran longest
        (rank 0 among them); their optimizer state (momentum, Adam's moments) and the weights'
        average follow from rank 0."""
        tensors = [v for state in self.optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)]
        if self.scaler.is_enabled():
            tensors += [v for v in (self.scaler._scale, self.scaler._growth_tracker) if v is not None]
        if self.ema is not None:
            tensors += self.ema.tensors()
        for value in tensors:
            on_device = value.to(self.device)  # e.g. Adam's step counter lives on the CPU; nccl needs the GPU
            dist.broadcast(on_device, src=0)
            value.copy_(on_device)
