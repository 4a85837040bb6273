"""hydra-ddp: Hydra-configured DistributedDataParallel training.

The package's layout is its architecture: config/ (schema, resolution, checks), launch/ (the
command and the workers it starts), parallel/ (the process group and how the model is spread),
training/ (the worker: the loop and its collaborators), reporting/ (logs, loggers, reports),
tools/ (tuners); data, models and checkpoints are shared by both sides.
"""

import importlib
import sys
from types import ModuleType

# Modules that moved into subpackages. A `_target_` in a user's own config (hydra_ddp.loggers.CSV,
# hydra_ddp.scaling.SweepReport) still resolves, for one release, with one line naming the new path.
_MOVED = {"loggers": "hydra_ddp.reporting.loggers", "scaling": "hydra_ddp.reporting.scaling",
          "tune": "hydra_ddp.tools.tune", "tune_loader": "hydra_ddp.tools.tune_loader",
          "strategy": "hydra_ddp.parallel.strategy", "distributed": "hydra_ddp.parallel.distributed"}
_warned: set[str] = set()


def __getattr__(name: str) -> ModuleType:
    if name not in _MOVED:
        raise AttributeError(f"module 'hydra_ddp' has no attribute {name!r}")
    if name not in _warned:
        _warned.add(name)
        sys.stderr.write(f"hydra-ddp: deprecated: hydra_ddp.{name} is now {_MOVED[name]}; "
                         "the old path goes in the next release\n")
    return importlib.import_module(_MOVED[name])
