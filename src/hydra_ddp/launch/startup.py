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

import contextlib
import gc
import multiprocessing
import os
import sys
from collections.abc import Iterator

# The guard that ties the forkserver's life to the launcher's, then what every worker imports.
PRELOAD = ["hydra_ddp.launch.forkserver_guard", "hydra_ddp.launch.forkserver_imports"]
START_METHODS = ("forkserver", "spawn")
_QUIET_TRACKER = "ignore:resource_tracker:UserWarning"

# Arguments after which train.py launches nothing (help, config printing, shell completion).
_NO_LAUNCH_HERE = (
    "-h",
    "--help",
    "--hydra-help",
    "-c",
    "--cfg",
    "-i",
    "--info",
    "-sc",
    "--shell-completion",
)
_MULTIRUN = ("-m", "--multirun")
CHECK_ENV = "HYDRA_DDP_CHECK"  # train.py --check: compose, resolve and check, launch nothing
# --gpus=N with it: check for a host of N GPUs (distributed.Host)
_CHECK_GPUS_ENV = "HYDRA_DDP_CHECK_GPUS"


def take_check_flags(argv: list[str]) -> bool:
    """`--check` (and `--gpus=N`) taken out of argv, where Hydra would refuse them: the command then
    composes, resolves and checks the config as a run would, builds the model on the meta device
    and puts one batch through it, prints one line and launches nothing. In the environment, so a
    multirun's jobs check too. Hydra's own outputs (a .hydra folder, a log file) are left out."""
    gpus = [a for a in argv[1:] if a.startswith("--gpus=")]
    if "--check" not in argv[1:]:
        if gpus:
            raise SystemExit(
                "hydra-ddp: error: --gpus=N goes with --check (a config checked for a GPU host); "
                "without it, trainer.nproc sets the workers"
            )
        return False
    for arg in ["--check", *gpus]:
        argv.remove(arg)
    os.environ[CHECK_ENV] = "1"
    if gpus:
        count = gpus[-1].split("=", 1)[1]
        if not count.isdigit() or int(count) < 1:
            raise SystemExit(
                f"hydra-ddp: error: --gpus={count}: give the GPUs per node, a positive integer"
            )
        os.environ[_CHECK_GPUS_ENV] = count
    keys = [a.lstrip("+~").split("=", 1)[0] for a in argv[1:]]
    argv += [
        o
        for o in ("hydra.output_subdir=null", "hydra/job_logging=disabled")
        if o.split("=")[0] not in keys
    ]
    return True


def checking() -> bool:
    return os.environ.get(CHECK_ENV) == "1"


def preload(argv: list[str] | None = None) -> None:
    """Start the forkserver now, importing PRELOAD, when this command is going to launch workers."""
    if argv is not None:
        args = [arg.split("=", 1)[0] for arg in argv[1:]]
        if any(arg in _NO_LAUNCH_HERE for arg in args):
            return
        # A multirun's jobs launch from this process, one after another, and share the forkserver;
        # unless another Hydra launcher runs them (joblib's or submitit's jobs start their own).
        if any(arg in _MULTIRUN for arg in args) and any(
            arg.lstrip("+~") == "hydra/launcher" for arg in args
        ):
            return
    if "forkserver" not in multiprocessing.get_all_start_methods():  # not on Windows
        return
    from multiprocessing import forkserver

    quiet_resource_tracker()  # started along with the forkserver
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(PRELOAD)
    if warm_fork and _FORKSERVER_MAIN_TAKES == _forkserver_main_parameters():
        _fork_forkserver()
    else:
        forkserver.ensure_running()


# Set in a warm process's fork (hydra_ddp.warm), which has imported everything a worker needs:
# its forkserver is a fork of it rather than a new interpreter importing it all again, and does not
# keep these descriptors of the fork's (its connection to its command).
warm_fork = False
close_in_forkserver: list[int] = []
command_pid: int | None = None  # the command's own process, which the fork runs for
# multiprocessing.forkserver.main's parameters, as CPython 3.11 to 3.13 have them
_FORKSERVER_MAIN_TAKES = ("listener_fd", "alive_r", "preload", "main_path", "sys_path")


def _forkserver_main_parameters() -> tuple[str, ...]:
    import inspect
    from multiprocessing import forkserver

    return tuple(inspect.signature(forkserver.main).parameters)


def _fork_forkserver() -> None:
    """multiprocessing's forkserver, started as ForkServer.ensure_running starts it, but forked from
    this process instead of executed anew: the same listener, the same pipe whose end ends it, the
    same guard (it dies with this process), and workers forked from it as from any forkserver."""
    import socket
    from multiprocessing import connection, forkserver, resource_tracker

    from hydra_ddp.runtime import processes

    server = forkserver._forkserver
    if server._forkserver_pid is not None:
        return
    resource_tracker.ensure_running()
    listener = socket.socket(socket.AF_UNIX)
    address = connection.arbitrary_address("AF_UNIX")
    listener.bind(address)
    os.chmod(address, 0o600)
    listener.listen()
    alive_r, alive_w = os.pipe()
    launcher = os.getpid()
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        try:
            for fd in (alive_w, *close_in_forkserver):
                os.close(fd)
            processes.guard_forkserver(launcher)
            forkserver.main(listener.fileno(), alive_r, [])
        finally:
            os._exit(0)
    os.close(alive_r)
    listener.close()
    server._forkserver_address = address
    server._forkserver_alive_fd = alive_w
    server._forkserver_pid = pid


@contextlib.contextmanager
def frozen_imports() -> Iterator[None]:
    """Imports whose objects live as long as the process: the garbage collector is off while they
    load, then they go to its permanent generation (gc.freeze), out of every later collection.

    Importing torch and torch._dynamo creates half a million objects, and the collector's full
    passes over them while they load are a large share of the import's time. Frozen, a full
    collection later (as at the end of every run) takes milliseconds, and a worker forked from this
    process does not copy its pages by touching them: Python's documented recipe for processes that
    fork (gc.freeze). The garbage
    the imports leave is frozen with them, about 7 MB, once per process.
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        if was_enabled:
            gc.enable()


def quiet_resource_tracker() -> None:
    """A killed worker leaves its semaphores to multiprocessing's resource tracker, which cleans
    them up and warns; it takes its -W options from ours when it starts."""
    if _QUIET_TRACKER not in sys.warnoptions:
        sys.warnoptions.append(_QUIET_TRACKER)


def worker_parent(start_method: str) -> int | None:
    """The pid of the process that will be the workers' parent, which they die with: this process,
    or the forkserver (None if this Python does not say which pid it has)."""
    if start_method != "forkserver":
        return os.getpid()
    # started here if train.py did not (a multirun's job, or command.run called from Python)
    preload()
    from multiprocessing import forkserver

    return getattr(forkserver._forkserver, "_forkserver_pid", None)
