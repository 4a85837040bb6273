"""hydra-ddp: Hydra-configured DistributedDataParallel training.

The package's layout is its architecture (docs/architecture.md): config/ (schema, resolution,
checks), launch/ (the command and the workers it starts), parallel/ (the process group and how the
model is spread), training/ (the worker: the loop and its collaborators), reporting/ (the run's
logs, loggers and summary); the extras around them: search/, tools/, sweeps/ (a multirun's
reports), trackers/ (W&B), clusters/ (Kubernetes), warm/.

A module that moved keeps its old name as an alias (MOVED): a `_target_` in a config or checkpoint
written before the move still imports, to the same module.
"""

import importlib
import importlib.abc
import importlib.util
import sys
from importlib.machinery import ModuleSpec
from types import ModuleType
from typing import Optional

# old module name → where it lives now
MOVED = {
    "hydra_ddp.reporting.scaling": "hydra_ddp.sweeps.scaling",
    "hydra_ddp.reporting.scaling_plot": "hydra_ddp.sweeps.scaling_plot",
    "hydra_ddp.reporting.trials": "hydra_ddp.sweeps.trials",
    "hydra_ddp.reporting.wandb_logger": "hydra_ddp.trackers.wandb_logger",
    "hydra_ddp.launch.kubernetes": "hydra_ddp.clusters.kubernetes",
    "hydra_ddp.config.reference": "hydra_ddp.tools.config_reference",
    "hydra_ddp.launch.preflight": "hydra_ddp.tools.preflight",
}


class _Moved(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports an old name (MOVED) as the module it names now: the same module object."""

    def find_spec(self, fullname: str, path: object, target: object = None) -> Optional[ModuleSpec]:
        if fullname not in MOVED:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec: ModuleSpec) -> ModuleType:
        return importlib.import_module(MOVED[spec.name])

    def exec_module(self, module: ModuleType) -> None:  # it ran as itself already
        return None


if not any(isinstance(finder, _Moved) for finder in sys.meta_path):
    sys.meta_path.append(_Moved())
