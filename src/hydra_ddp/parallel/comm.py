"""DDP's gradient communication hooks as a config choice (`strategy.comm_hook`).

- none: the fp32 all-reduce of DDP's built-in hook (divided by the world size, then summed).

Every hook counts the bytes it hands to its collective (Traffic): the summary's
allreduce_bytes_per_step is that measurement, the last step's.
- fp16 / bf16: gradients cast to 16 bits for the all-reduce, and back: half the bytes on the
  wire, and the sums lose precision (bf16 keeps fp32's range, fp16 three more digits). Neither
  keeps state between steps, so resume stays exact.
- powersgd: each weight matrix's gradient all-reduced as a rank-r approximation P·Qᵀ (PowerSGD,
  Vogels et al. 2019, the algorithm of torch's powerSGD_hook): (rows + columns) × r numbers
  instead of rows × columns, with error feedback (what the approximation left out is added to
  the next step's gradient) and warm start (last step's Q). Vectors (biases, norms) and matrices
  too small to gain are all-reduced whole. Before `strategy.powersgd.start_step` every step is a
  plain all-reduce.

They pay off where the network is the bottleneck (many nodes, slow links); on one machine,
where the all-reduce is a memory copy, their compute can cost more than they save (bench/).

PowerSGD is ours rather than torch's hook, for exact resume: torch's keeps its state per DDP
bucket, and DDP lays buckets out anew after a process's first step (so a resumed run's first step
would read another layout than the checkpoint's); it runs its maths in the callbacks of gloo's
threads, whose thread count is not the rank's (the result changed from run to run, measured with
torch 2.14); and on gloo two buckets' chained all-reduces can interleave differently on two
ranks. Here the state is per parameter, saved in the checkpoint (each rank's error feedback),
and each bucket is compressed synchronously on the thread DDP calls the hook from.
"""

from __future__ import annotations

import zlib
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn

# a matrix is approximated only where that sends at most half its numbers (torch's default)
MIN_COMPRESSION = 2
_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


class Traffic:
    """The bytes this rank hands to the gradient all-reduce in an optimizer step: counted on the
    very tensors each hook passes to its collective, not computed from the model (the summary's
    allreduce_bytes_per_step). A step ends with DDP's last bucket."""

    def __init__(self) -> None:
        self.current = 0
        self.last_step: Optional[int] = None  # the last complete step's bytes

    def count(self, *tensors: torch.Tensor, step_done: bool = False) -> None:
        self.current += sum(t.numel() * t.element_size() for t in tensors)
        if step_done:
            self.last_step, self.current = self.current, 0

    def all_reduce(self, tensor: torch.Tensor, group: Any) -> None:
        """A summing all-reduce, counted."""
        self.count(tensor)
        dist.all_reduce(tensor, group=group)


def register(
    model: nn.parallel.DistributedDataParallel, name: str, traffic: Traffic, powersgd: Any = None
) -> Optional[PowerSGD]:
    """Register the configured hook on the DDP model, before its first step; every hook counts what
    it sends in `traffic` (none: the same fp32 all-reduce as DDP's built-in one, divided first).
    PowerSGD's object is returned: its state goes into checkpoints."""
    if name == "powersgd":
        hook = PowerSGD(
            model.module, model.process_group, powersgd.rank, powersgd.start_step, traffic=traffic
        )
        model.register_comm_hook(None, hook.hook)
        return hook
    model.register_comm_hook(None, _AllReduce(model.process_group, traffic, _DTYPES.get(name)).hook)
    return None


class _AllReduce:
    """The bucket averaged over the ranks in one all-reduce, sent as it is or cast to 16 bits and
    back (torch's default_hooks.allreduce_hook and fp16/bf16_compress_hook, counted)."""

    def __init__(self, group: Any, traffic: Traffic, dtype: Optional[torch.dtype]):
        self.group, self.traffic, self.dtype = group, traffic, dtype

    # DDP checks the hook's annotations against its own types: none here (this module's are
    # strings).
    def hook(self, state, bucket):  # noqa: ANN001, ANN201
        buffer = bucket.buffer()
        world = dist.get_world_size(self.group)
        sent = (buffer if self.dtype is None else buffer.to(self.dtype)).div_(world)
        self.traffic.count(sent, step_done=bucket.is_last())
        future = dist.all_reduce(sent, group=self.group, async_op=True).get_future()

        def received(done: torch.futures.Future) -> torch.Tensor:
            if self.dtype is None:
                return done.value()[0]
            return buffer.copy_(done.value()[0])

        return future.then(received)


def _low_rank_size(param: torch.Tensor, rank: int) -> Optional[int]:
    """How many numbers P and Q of this parameter's gradient hold; None where it is sent whole."""
    if param.dim() < 2:
        return None
    rows, columns = param.shape[0], param.numel() // param.shape[0]
    r = min(rows, columns, rank)
    return (
        (rows + columns) * r if (rows + columns) * r * MIN_COMPRESSION <= rows * columns else None
    )


class PowerSGD:
    """PowerSGD as a DDP communication hook, with its state by parameter name."""

    def __init__(
        self,
        module: nn.Module,
        group: Any,
        rank: int,
        start_step: int,
        seed: int = 0,
        traffic: Optional[Traffic] = None,
    ):
        self.traffic = traffic or Traffic()
        self.names = {id(p): name for name, p in module.named_parameters()}
        self.shapes = {
            name: (p.shape[0], p.numel() // p.shape[0])
            for name, p in module.named_parameters()
            if p.dim() > 1
        }
        self.group, self.rank, self.start_step, self.seed = group, rank, start_step, seed
        self.step = 0  # optimizer steps seen (the hook runs once per bucket and step)
        self.errors: dict[str, torch.Tensor] = {}  # this rank's: what the approximations left out
        # the last step's Q (all-reduced: the same on every rank)
        self.qs: dict[str, torch.Tensor] = {}

    # DDP checks the hook's annotations against its own types: none here (this module's are
    # strings).
    def hook(self, state, bucket):  # noqa: ANN001, ANN201
        buffer = bucket.buffer()
        world = dist.get_world_size(self.group)
        if self.step < self.start_step:
            buffer.div_(world)
            self.traffic.all_reduce(buffer, self.group)  # as DDP's own
        else:
            self._compress(bucket, world)
        if bucket.is_last():
            self.step += 1
            self.traffic.count(step_done=True)
        done: torch.futures.Future = torch.futures.Future()
        done.set_result(buffer)
        return done

    def _compress(self, bucket: dist.GradBucket, world: int) -> None:
        whole, low_rank = [], []
        for param, grad in zip(bucket.parameters(), bucket.gradients()):  # views into the bucket
            name = self.names[id(param)]
            if _low_rank_size(grad, self.rank) is None:
                whole.append(grad)
                continue
            # by logical index: any memory format (channels_last)
            matrix = grad.reshape(grad.shape[0], -1)
            if name in self.errors:
                matrix = matrix + self.errors[name]  # error feedback
            low_rank.append((name, grad, matrix))
        if whole:
            flat = torch.cat([g.reshape(-1) for g in whole]).div_(world)
            self.traffic.all_reduce(flat, self.group)
            for grad, part in zip(whole, flat.split([g.numel() for g in whole])):
                grad.copy_(part.view_as(grad))
        if not low_rank:
            return
        # P = M·Q summed over ranks and orthogonalised, then Q = Mᵀ·P averaged: M ≈ P·Qᵀ.
        qs = [
            _orthogonal(self.qs[name]) if name in self.qs else self._first_q(name, m)
            for name, _, m in low_rank
        ]
        ps = _all_reduced([m @ q for (_, _, m), q in zip(low_rank, qs)], self.group, self.traffic)
        ps = [_orthogonal(p) for p in ps]
        qs = _all_reduced(
            [m.t() @ p for (_, _, m), p in zip(low_rank, ps)], self.group, self.traffic
        )
        for (name, grad, matrix), p, q in zip(low_rank, ps, qs):
            approximation = p @ q.div_(world).t()
            self.errors[name] = matrix - approximation
            self.qs[name] = q
            grad.copy_(approximation.view(grad.shape))

    def _first_q(self, name: str, matrix: torch.Tensor) -> torch.Tensor:
        """A random start, the same on every rank and in any bucket layout: seeded by the name."""
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + zlib.crc32(name.encode()))
        q = torch.randn(matrix.shape[1], min(*matrix.shape, self.rank), generator=generator)
        return _orthogonal(q.to(matrix.device, matrix.dtype))

    # --- checkpoints ----------------------------------------------------------------------------
    def state(self) -> dict[str, Any]:
        """Every rank calls it at the same step: the error feedback is each rank's own
        (gathered)."""
        names = sorted(self.errors)
        errors: list[torch.Tensor] = []
        if names:  # the same names on every rank: they compress in lockstep
            mine = torch.cat([self.errors[n].reshape(-1) for n in names])
            errors = [torch.empty_like(mine) for _ in range(dist.get_world_size(self.group))]
            dist.all_gather(errors, mine, group=self.group)
        return {
            "hook": "powersgd",
            "rank": self.rank,
            "step": self.step,
            "q": dict(self.qs),
            "error_names": names,
            "errors": errors,
        }

    def load(self, saved: Optional[dict[str, Any]], step: int) -> Optional[str]:
        """Continue from a checkpoint's state, or without one from its step; a warning where part
        of it cannot be taken (the run goes on, no longer exactly as the uninterrupted one)."""
        self.step = step
        if not saved or saved.get("hook") != "powersgd" or saved["rank"] != self.rank:
            return (
                "the checkpoint holds no PowerSGD state of rank "
                f"{self.rank}: warm start and error feedback begin afresh"
                if step > self.start_step
                else None
            )
        self.qs = {name: q.clone() for name, q in saved["q"].items()}
        errors, world = saved["errors"], dist.get_world_size(self.group)
        if errors and len(errors) != world:
            return (
                "PowerSGD's error feedback was saved by "
                f"{len(errors)} ranks, not {world}: it begins afresh"
            )
        if errors:
            names = saved["error_names"]
            parts = errors[dist.get_rank(self.group)].split(
                [self.shapes[n][0] * self.shapes[n][1] for n in names]
            )
            self.errors = {n: part.view(self.shapes[n]).clone() for n, part in zip(names, parts)}
        return None


def _orthogonal(matrix: torch.Tensor) -> torch.Tensor:
    """Orthonormal columns spanning the matrix's (reduced QR)."""
    return torch.linalg.qr(matrix).Q


def _all_reduced(tensors: list[torch.Tensor], group: Any, traffic: Traffic) -> list[torch.Tensor]:
    """The tensors summed over the ranks, in one all-reduce."""
    flat = torch.cat([t.reshape(-1) for t in tensors])
    traffic.all_reduce(flat, group)
    return [part.view_as(t) for t, part in zip(tensors, flat.split([t.numel() for t in tensors]))]
