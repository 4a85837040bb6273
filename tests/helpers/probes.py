"""Test-only models that write down what a worker saw (its process group, its batches, its random
numbers), read from torch itself, or signal the run at a planned step."""

import json
import os
import subprocess
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d

from hydra_ddp.models import MnistCNN


class RendezvousProbe(MnistCNN):
    """Writes probe_dir/rank{R}.json: the init_method init_process_group received, and the address
    of the TCP store the group's store wraps (none for a file store), as torch holds them."""

    def __init__(self, probe_dir: str, **kwargs):
        super().__init__(**kwargs)
        store = distributed_c10d._get_default_store()
        while isinstance(store, dist.PrefixStore):
            store = store.underlying_store
        tcp = isinstance(store, dist.TCPStore)
        seen = {
            "init_method": distributed_c10d._default_pg_init_method,
            "store": type(store).__name__,
            "host": store.host if tcp else None,
            "port": store.port if tcp else None,
        }
        Path(probe_dir, f"rank{dist.get_rank()}.json").write_text(json.dumps(seen))


class InputProbe(MnistCNN):
    """Appends to probe_dir/inputs-rank{R}.txt a digest of every training batch this rank's model is
    given, and once the first number this rank's model draws from torch's generator (dropout's)."""

    def __init__(self, probe_dir: str, **kwargs):
        super().__init__(**kwargs)
        self.path = Path(probe_dir, f"inputs-rank{dist.get_rank()}.txt")
        self.drew = False

    def forward(self, x):
        if self.training:
            import hashlib

            with open(self.path, "a") as f:
                if not self.drew:
                    f.write(f"draw {torch.rand(1).item()!r}\n")
                    self.drew = True
                digest = hashlib.sha256(x.detach().contiguous().numpy().tobytes()).hexdigest()
                f.write(f"batch {digest[:16]}\n")
        return super().forward(x)


# A probe that stops a run stops it once: a continuation of the run takes the run's own overrides
# (its record: launch/continuing.py), the probe's among them, and `resume` (support.ONCE gives it:
# `+model.resume=${trainer.resume}`) says the run is continued: the probe then does nothing.


class SignalAt(MnistCNN):
    """At rank 0's `step`-th training forward, SIGTERM to every process of the run (its process
    group), as Slurm's scancel signals a job step: the run stops, checkpointed, where it agrees
    to. Not in a continued run (`resume`: support.ONCE)."""

    def __init__(self, step: int, resume: Optional[str] = None, **kwargs):
        super().__init__(**kwargs)
        self.step, self.calls = (step if resume is None else 0), 0

    def forward(self, x):
        if self.training and dist.get_rank() == 0:
            self.calls += 1
            if self.calls == self.step:
                signal_the_run()
        return super().forward(x)


def signal_at(of: str, step: int, resume: Optional[str] = None, **kwargs) -> torch.nn.Module:
    """The model `of` (a dotted path to a class or a function) built with `kwargs`, SIGTERMing the
    run as SignalAt does at rank 0's `step`-th training forward: for models that are not MnistCNN (a
    Hugging Face model called with keyword inputs). Not in a continued run (`resume`:
    support.ONCE)."""
    from hydra.utils import get_object

    model = get_object(of)(**kwargs)
    if resume is not None:
        return model
    calls = [0]

    def hook(module, args):
        if module.training and dist.get_rank() == 0:
            calls[0] += 1
            if calls[0] == step:
                signal_the_run()

    model.register_forward_pre_hook(hook)
    return model


class DeterminismProbe(MnistCNN):
    """Writes probe_dir/rank{R}.json: the kernel settings trainer.deterministic governs, as torch
    holds them once the run has built its model."""

    def __init__(self, probe_dir: str, **kwargs):
        super().__init__(**kwargs)
        seen = {
            "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
            "cudnn_deterministic": torch.backends.cudnn.deterministic,
            "cudnn_benchmark": torch.backends.cudnn.benchmark,
            "cudnn_tf32": torch.backends.cudnn.allow_tf32,
            "matmul_tf32": torch.backends.cuda.matmul.allow_tf32,
            "cublas_workspace": os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
        }
        Path(probe_dir, f"rank{dist.get_rank()}.json").write_text(json.dumps(seen))


def float64(of: str, **kwargs) -> torch.nn.Module:
    """The model `of` (a dotted class path) built with `kwargs`, its parameters and floating inputs
    in float64: a test's model for comparing runs whose sums run in another order (another world
    size, another strategy). Summation order moves float64 losses by about 1e-16 relative, far from
    the flips (a ReLU or max-pool choice going the other way) that float32's 1e-7 meets within 20
    steps, so such runs agree to a bound that holds on any x86 host. Test-only: not a precision."""
    from hydra.utils import get_class

    model = get_class(of)(**kwargs).double()

    def cast(module, args):
        return tuple(
            a.double() if torch.is_tensor(a) and a.is_floating_point() else a for a in args
        )

    model.register_forward_pre_hook(cast)
    return model


def signal_the_run() -> None:
    """SIGTERM to every process of the run (its process group), sent by another process, as
    scancel is: a rank's loader workers take a signal from their own rank as their end."""
    group = os.getpgrp()  # the sender in a session of its own: not signalled itself
    subprocess.run(
        ["kill", "-s", "TERM", "--", f"-{group}"], check=True, timeout=30, start_new_session=True
    )
