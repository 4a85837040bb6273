"""Workers that start with torch already imported.

A spawned worker is a fresh interpreter that imports torch and the project again, every rank at
once on the same cores, before it can join the group: most of a short run's start-up. Instead a
forkserver imports them once, started by train.py before it imports anything heavy itself, so
the imports overlap with the parent's composing and validating the config; every worker (and
every torchrun restart) is then a fork of it. The forkserver never touches CUDA: importing torch
does not create a context, so each worker still makes its own.

No torch here: train.py calls this before importing it.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import sys
from typing import Optional

# What every worker imports (launch brings the worker, data, model and training modules, and torch),
# after the guard that ties the forkserver's life to the launcher's; then all of it is frozen out
# of the garbage collector's reach. DCP's state_dict helpers (0.1 s) are imported by the first
# checkpoint: here, that is not a stall in the middle of training.
PRELOAD = ["hydra_ddp.forkserver_guard", "hydra_ddp.launch", "torch._dynamo", "torch.distributed.checkpoint.state_dict",
           "hydra_ddp.forkserver_frozen"]
START_METHODS = ("forkserver", "spawn")
_QUIET_TRACKER = "ignore:resource_tracker:UserWarning"

# Arguments after which train.py launches nothing (help, config printing, shell completion).
_NO_LAUNCH_HERE = ("-h", "--help", "--hydra-help", "-c", "--cfg", "-i", "--info", "-sc", "--shell-completion")
_MULTIRUN = ("-m", "--multirun")


def preload(argv: Optional[list[str]] = None) -> None:
    """Start the forkserver now, importing PRELOAD, when this command is going to launch workers."""
    if argv is not None:
        args = [arg.split("=", 1)[0] for arg in argv[1:]]
        if any(arg in _NO_LAUNCH_HERE for arg in args):
            return
        # A multirun's jobs launch from this process, one after another, and share the forkserver;
        # unless another Hydra launcher runs them (joblib's or submitit's jobs start their own).
        if any(arg in _MULTIRUN for arg in args) and any(arg.lstrip("+~") == "hydra/launcher" for arg in args):
            return
    if "forkserver" not in multiprocessing.get_all_start_methods():  # not on Windows
        return
    from multiprocessing import forkserver

    quiet_resource_tracker()  # started along with the forkserver
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(PRELOAD)
    forkserver.ensure_running()


def quiet_resource_tracker() -> None:
    """A killed worker leaves its semaphores to multiprocessing's resource tracker, which cleans them
    up and warns; it takes its -W options from ours when it starts."""
    if _QUIET_TRACKER not in sys.warnoptions:
        sys.warnoptions.append(_QUIET_TRACKER)


def worker_parent(start_method: str) -> Optional[int]:
    """The pid of the process that will be the workers' parent, which they die with: this process,
    or the forkserver (None if this Python does not say which pid it has)."""
    if start_method != "forkserver":
        return os.getpid()
    preload()  # started here if train.py did not (a multirun's job, or launch.run called from Python)
    from multiprocessing import forkserver

    return getattr(forkserver._forkserver, "_forkserver_pid", None)


def die_with_parent(expected_parent: Optional[int] = None) -> None:
    """SIGKILL this process when its parent dies (even by SIGKILL, with no chance to clean up).

    `expected_parent`: when given and no longer the parent, it died before this took effect."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if expected_parent is not None and os.getppid() != expected_parent:
        os._exit(1)
