"""Imported by the forkserver (startup.PRELOAD), after its guard: what every worker imports (the
worker module brings the data, model, parallel and training modules, and torch), outside the garbage
collector's reach (startup.frozen_imports), so every worker forked from it shares them as they are.

Not torch.distributed.checkpoint: DDP's checkpoints do without it
(parallel.layouts.optimizer_state_by_name), and the sharded strategies import it while they build,
before the first step.
"""

import importlib

from hydra_ddp.launch import startup

with startup.frozen_imports():
    import torch._dynamo  # noqa: F401  (DDP's constructor and forward use it)

    from hydra_ddp.launch import workers

    # the worker side, by name: this process forks the workers
    importlib.import_module(workers.WORKER)
