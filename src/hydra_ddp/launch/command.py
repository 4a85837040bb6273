"""The command's side of a run: resolve the config, check it, launch (or join an outside launch),
and report the outcome in one line."""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import logging
import os
import sys
import threading
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, NoReturn, Optional

from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from hydra_ddp.config import from_checkpoint, run_config
from hydra_ddp.config.run_config import RunConfig
from hydra_ddp.errors import EVERY_RANK, UserError
from hydra_ddp.launch import (
    checks,
    composition,
    continuing,
    holding,
    resolve,
    startup,
    workers,
)
from hydra_ddp.launch.workers import Stopped, _again, say
from hydra_ddp.parallel import distributed
from hydra_ddp.rundir import RunDir, claimed_instead
from hydra_ddp.runtime import ranks

log = logging.getLogger(__name__)


def adopt_external_launch(argv: list[str]) -> None:
    """Prepare argv when this process is already a worker of torchrun, torch.distributed.launch or
    mpirun (a Kubernetes pod's train.py that launches the pod's workers itself has its settings
    from clusters/kubernetes.py first: cli.py).

    The legacy launcher appends `--local-rank=N`, which Hydra would reject: it becomes LOCAL_RANK.
    Ranks other than 0 then skip Hydra's output directory and log file: rank 0 decides the
    run directory and tells the others once the process group is up.
    """
    if ranks.launches_workers(os.environ):
        return  # this command launches the pod's workers (cli.py took the pod's settings)
    for arg in [a for a in argv[1:] if a.startswith(("--local-rank=", "--local_rank="))]:
        os.environ["LOCAL_RANK"] = arg.split("=", 1)[1]
        argv.remove(arg)
    found = ranks.external_launch()
    if found and not found[1].is_main:
        # Hydra's "disabled" logging would also disable every logger that exists by then (the
        # project's, created at import): this rank's lines would never reach the run's log file.
        argv += [
            "hydra.output_subdir=null",
            "hydra.run.dir=.",
            "hydra/job_logging=disabled",
            "hydra/hydra_logging=disabled",
            "hydra.job_logging.disable_existing_loggers=false",
            "hydra.hydra_logging.disable_existing_loggers=false",
        ]


def exit_after(entry: Callable[[], Any]) -> NoReturn:
    """Run train.py's entry point (Hydra's composition errors in one line: composition.py), then end
    the process without the interpreter's teardown.

    Exit handlers run and other threads are waited for, as at any exit; what is skipped is freeing
    torch's thousands of modules and objects one by one, which takes seconds after `import torch`
    alone, at the end of every command, with every output already closed.
    """
    composition.report_in_one_line()
    try:
        entry()
        code: Any = 0
    except SystemExit as stop:
        code = stop.code
    # What the interpreter does first at exit, in its order: threading's exit hooks (which stop
    # executors' threads, e.g. joblib's), then waiting for non-daemon threads, then atexit's
    # handlers.
    shutdown_threads = getattr(threading, "_shutdown", None)
    if shutdown_threads is None:  # not CPython: exit the usual way
        sys.exit(code)
    shutdown_threads()
    atexit._run_exitfuncs()
    if code is not None and not isinstance(code, int):
        say(str(code))  # as the interpreter prints a SystemExit's message
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code or 0)


def run(cfg: DictConfig, started_at: float, job: str = "train") -> Optional[dict[str, Any]]:
    """Resolve, check, launch, wait; the summary of a finished run, or eval.py's result
    (job="eval"). None on a non-zero node."""
    run_dir = Path(HydraConfig.get().runtime.output_dir)  # absolute
    # hydra.job.chdir=true moved this process into the run directory: relative paths (the data's, a
    # checkpoint's) are still read from where the command was started, here and in every worker.
    os.chdir(HydraConfig.get().runtime.cwd)
    distributed.adopt_launcher_environment()
    external = ranks.external_launch()
    if startup.checking():
        return _check_only(cfg, run_dir, external, job)
    asked = claimed_instead(run_dir)
    if asked:
        log.info(
            "%s was taken by another run started in the same second: this run's directory is %s",
            asked,
            run_dir,
        )
    resolved = _resolve(cfg, run_dir, external, job)
    if job == "train" and not external:
        # accepted: a continued run's record says how it runs now, once it has trained (a start
        # that fails in the workers leaves the record as it was)
        with continuing.recorded_once_it_trains(run_dir, cfg):
            return _launched(resolved, run_dir, external, started_at, job)
    return _launched(resolved, run_dir, external, started_at, job)


def _launched(
    resolved: RunConfig,
    run_dir: Path,
    external: Optional[tuple[str, Any]],
    started_at: float,
    job: str,
) -> Optional[dict[str, Any]]:
    """The run, launched here or, under an outside launcher, this rank of it."""
    # One live run per directory: held by the launching process (node 0's) or an outside launch's
    # rank 0.
    holds = external[1].is_main if external else resolved.launcher.node_rank == 0
    checkpoint_dir = resolved.checkpoint.dir if job == "train" else None
    with holding.held(run_dir, checkpoint_dir) if holds else contextlib.nullcontext():
        if external:
            # Only rank 0 knows the run directory: its verdict reaches every rank once the group is
            # up.
            problem = (
                _problem(resolved, run_dir) if external[1].is_main and job == "train" else None
            )
            return _unless_stopped(
                workers.worker_entry("main")(
                    resolved, str(run_dir), external[1], started_at, problem=problem
                ),
                run_dir,
                quiet=not external[1].is_main,
            )
        return _unless_stopped(workers.launch(resolved, run_dir, started_at), run_dir)


def _resolve(
    cfg: DictConfig, run_dir: Path, external: Optional[tuple[str, Any]], job: str
) -> RunConfig:
    """The settled config, typed and read-only, with its job, its sweep and the keys the command
    line set. Under an outside launcher every rank settles it alike and rank 0 alone checks what
    depends on its run directory (_problem)."""
    overrides = list(HydraConfig.get().overrides.task)
    if job == "eval":
        resolved = resolve.eval_config(cfg, overrides, run_dir, external)
    else:
        resolved = resolve.resolve(cfg, run_dir, external, checked=not external)
    hydra_cfg = HydraConfig.get()
    sweep = None
    if hydra_cfg.mode == RunMode.MULTIRUN:  # loggers group a sweep's jobs
        sweep = run_config.SweepConf(
            dir=str(Path(hydra_cfg.sweep.dir).resolve()), job=hydra_cfg.job.num
        ).freeze()
    # The keys set on the command line (a sweep trial's): every worker logs its own values of them.
    keys = (from_checkpoint.override_key(o) for o in overrides if "=" in o)
    return run_config.amended(
        resolved, {"job": job, "sweep": sweep, "overridden": _values(resolved, keys)}
    )


def _check_only(
    cfg: DictConfig, run_dir: Path, external: Optional[tuple[str, Any]], job: str
) -> None:
    """train.py --check: everything a run checks before its first step, and nothing launched; one
    line that says what would run (or the UserError's one line)."""
    try:
        resolved = _resolve(cfg, run_dir, external, job)
        if job == "train":
            if external:
                checks.check(resolved, run_dir)
            checks.dry_build(resolved)
    finally:
        with contextlib.suppress(OSError):
            # Hydra made it for this command; nothing was written there (only if empty)
            run_dir.rmdir()
    launcher, trainer = resolved.launcher, resolved.trainer
    what = (
        f"{resolved.strategy.name}, global batch {resolved.data.global_batch_size}"
        if job == "train"
        else f"eval of {resolved.eval.ckpt} on {resolved.eval.split}"
    )
    workers = trainer.nproc * launcher.nnodes
    # elastic: as many as are present
    if (launcher.min_nodes or launcher.nnodes) != launcher.nnodes:
        workers = f"{trainer.nproc * launcher.min_nodes}-{workers}"
    print(
        f"hydra-ddp: config OK: {workers} worker(s) on {trainer.device} "
        f"({launcher.name}, backend {resolved.backend.name}, init "
        f"{resolved.init_method.name}), {what}; nothing launched",
        flush=True,
    )
    crowded = resolve.oversubscribed(trainer)
    if crowded:
        print(f"hydra-ddp: note: {crowded}", flush=True)


def _values(cfg: RunConfig, keys: Iterable[str]) -> dict[str, Any]:
    """Each key's settled value, where it names a single value (not a section, a list or a
    `_target_` group's whole node)."""
    absent = object()
    found = {}
    for key in keys:
        node: Any = cfg
        for part in key.split("."):
            node = node.get(part, absent) if isinstance(node, dict) else getattr(node, part, absent)
        if (
            node is not absent
            and not isinstance(node, (dict, list))
            and not dataclasses.is_dataclass(node)
        ):
            found[key] = node
    return found


def _problem(resolved: RunConfig, run_dir: Path) -> Optional[str]:
    try:
        checks.check(resolved, run_dir)
    except UserError as error:
        return str(error)
    return None


def _unless_stopped(
    summary: Optional[dict[str, Any]], run_dir: Path, quiet: bool = False
) -> Optional[dict[str, Any]]:
    """The summary of a finished run; a run that stopped early on a signal is a Stopped error
    (`quiet`: an outside launch's other ranks, which know no run directory: rank 0 says it)."""
    if summary and summary["stopped_by"]:
        raise Stopped(summary, run_dir, quiet)
    if summary and summary.get("ended_by") == "max_time":
        say(
            f"hydra-ddp: trainer.max_time spent at step {summary['steps']}: "
            f"tested and checkpointed; continue with: {_again(run_dir)}"
        )
    return summary


def fail(error: UserError) -> None:
    """One line on stderr and a non-zero exit: the user's problem needs no traceback.

    In a multirun the job's directory keeps the line (error.txt, read by the scaling report)
    and the sweep goes on; the report's callback exits non-zero at the end.
    """
    message = str(error)
    # an outside launch's rank
    message = message[len(EVERY_RANK) :] if message.startswith(EVERY_RANK) else message
    if not getattr(error, "quiet", False):
        say(f"hydra-ddp: error: {message}")
    hydra_cfg = HydraConfig.get()
    # a stop ends the sweep too
    if hydra_cfg.mode == RunMode.MULTIRUN and not isinstance(error, Stopped):
        RunDir(hydra_cfg.runtime.output_dir).error.write_text(f"{message}\n")
        return
    # Refused: no run left behind (the directory given up first: the callback took it before the
    # run).
    holding.release(Path(hydra_cfg.runtime.output_dir))
    RunDir(hydra_cfg.runtime.output_dir).discard_if_untouched(hydra_cfg.job.name)
    sys.exit(error.exit_code)
