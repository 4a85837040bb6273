"""Imported by the forkserver (startup.PRELOAD), after its guard: what every worker imports (launch
brings the worker, data, model and training modules, and torch), outside the garbage collector's
reach (startup.frozen_imports), so every worker forked from it shares them as they are.

DCP's state_dict helpers are imported by the first checkpoint: here, that is not a stall in the
middle of training.
"""

from hydra_ddp import startup

with startup.frozen_imports():
    import torch._dynamo  # noqa: F401  (DDP's constructor and forward use it)
    import torch.distributed.checkpoint.state_dict  # noqa: F401

    import hydra_ddp.launch  # noqa: F401
