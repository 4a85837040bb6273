"""Imported by the forkserver (startup.PRELOAD), after its guard: what every worker imports (launch
brings the worker, data, model and training modules, and torch), outside the garbage collector's
reach (startup.frozen_imports), so every worker forked from it shares them as they are.

Not torch.distributed.checkpoint: DDP's checkpoints do without it (parallel.state.optimizer_state_by_name),
and the sharded strategies import it while they build, before the first step.
"""

from hydra_ddp import startup

with startup.frozen_imports():
    import torch._dynamo  # noqa: F401  (DDP's constructor and forward use it)

    import hydra_ddp.launch  # noqa: F401
