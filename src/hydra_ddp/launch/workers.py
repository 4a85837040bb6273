"""Starting the workers on this node (spawn, or torchrun's machinery from Python), holding the
rendezvous store, and naming the first failure."""

from __future__ import annotations

import importlib
import inspect
import json
import logging
import multiprocessing
import os
import pickle
import shlex
import shutil
import signal
import sys
import tempfile
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any, Optional

import torch.multiprocessing as mp
from hydra.core.hydra_config import HydraConfig

from hydra_ddp.config import run_config
from hydra_ddp.config.run_config import RunConfig
from hydra_ddp.errors import EVERY_RANK, LOST_A_PEER, UserError, say
from hydra_ddp.launch import resolve, startup
from hydra_ddp.parallel import distributed
from hydra_ddp.rundir import RunDir
from hydra_ddp.runtime.signals import STOP_SIGNALS

log = logging.getLogger(__name__)


# how long the other workers get to exit after one fails, before SIGTERM, then SIGKILL
SPAWN_GRACE_S = 5.0


# The workers' entry points, by name: the launch side never imports the worker side. A worker
# process imports it as it starts (under forkserver, the forkserver has: startup.PRELOAD), and so
# does an outside launch's rank, which is a worker itself.
WORKER = "hydra_ddp.training.worker"


def worker_entry(name: str) -> Callable[..., Any]:
    return getattr(importlib.import_module(WORKER), name)


def _spawned(local_rank: int, *args: Any) -> None:
    """torch.multiprocessing's target (pickled by name): the worker's spawn entry."""
    worker_entry("spawn_entry")(local_rank, *args)


def _elastic(*args: Any) -> Any:
    """torchelastic's entry point (pickled by name): the worker's elastic entry."""
    return worker_entry("elastic_entry")(*args)


def launch(cfg: RunConfig, run_dir: Path, started_at: float) -> Optional[dict[str, Any]]:
    """Start the workers of a resolved config on this node and wait for them: the run's summary
    (eval.py's result), None if they ended without one. Also the tuner's way to time candidates.
    `cfg` is resolved (read-only); what the workers receive is it amended with the stores this
    process holds."""
    # Inside a joblib (loky) job the default context is loky's, which cannot start our workers.
    multiprocessing.set_start_method("spawn", force=True)
    launcher, n = cfg.launcher, cfg.trainer.nproc
    log.info(
        "launching %d worker(s) with %s, backend %s, init %s → %s",
        n * launcher.nnodes,
        launcher.name,
        cfg.backend.name,
        cfg.init_method.name,
        run_dir,
    )
    # the node of global rank 0 shows the run: the others would say nothing more
    if launcher.nnodes > 1:
        log.info(
            "node %d of %d: %d of the run's workers; the node "
            "that holds rank 0 shows its progress, log and summary",
            launcher.node_rank,
            launcher.nnodes,
            n,
        )
    crowded = resolve.oversubscribed(cfg.trainer)
    if crowded:
        log.warning(crowded)
    if cfg.init_method.name == "file":  # created private, before any rank writes its address there
        os.close(os.open(cfg.init_method.path, os.O_WRONLY | os.O_CREAT, 0o600))
    # These would repeat each child's failure on the console; WorkerFailed reports it in one line.
    for name in ("torch.multiprocessing.spawn", "torch.distributed.elastic.multiprocessing.api"):
        logging.getLogger(name).setLevel(logging.CRITICAL)
    startup.quiet_resource_tracker()
    summary_file = RunDir(run_dir).result(cfg.job)
    # Continuing in this directory: only this run's summary counts. The earlier one is set aside
    # (the workers read it: a run found complete trains nothing) and put back if this run writes
    # none.
    earlier = RunDir(run_dir).earlier_summary
    set_aside = cfg.job == "train" and launcher.node_rank == 0 and summary_file.exists()
    if set_aside:
        os.replace(summary_file, earlier)
    summary_file.unlink(missing_ok=True)
    signum = None
    # bound before any worker starts, held until the last one has ended; the config that says where
    stores, cfg = _host_stores(cfg)
    parent = startup.worker_parent(launcher.start_method)
    try:
        if launcher.name == "spawn":
            _spawn(cfg, run_dir, started_at, parent)
        else:
            signum = _torchrun(cfg, run_dir, started_at, parent)
    except WorkerFailed as failure:
        _completed_despite(failure, summary_file)
    finally:
        del stores  # stops their servers
        # made fresh for this run; stale, it could deadlock the next
        if cfg.init_method.name == "file":
            Path(cfg.init_method.path).unlink(missing_ok=True)
        summary = json.loads(summary_file.read_text()) if summary_file.exists() else None
        if set_aside:
            os.replace(earlier, summary_file) if summary is None else earlier.unlink()
    # ended before their checkpoint
    if signum is not None and not (summary and summary["stopped_by"]):
        raise Stopped({"stopped_by": signal.Signals(signum).name, "steps": None}, run_dir)
    if launcher.nnodes > 1 and summary is None:
        log.info(
            "node %d: its workers are done; the run's summary is with rank 0's node",
            launcher.node_rank,
        )
    return summary


def _host_stores(cfg: RunConfig) -> tuple[list[Any], RunConfig]:
    """On a single node this process serves the rendezvous store itself, on a port it binds (port 0:
    a free one) before any worker starts and holds for the whole run: no other job can take the
    port in between. One store per torchrun attempt, so a restarted group meets on a fresh one.
    The workers reach them through torch's own env:// or tcp:// handler, as clients
    (distributed.process_group); torchrun's agents meet on the first. The stores, and the config
    amended to say where (init_method.ports, launcher.rdzv_endpoint)."""
    init, launcher = cfg.init_method, cfg.launcher
    if launcher.nnodes > 1:
        return [], cfg  # torchrun's rendezvous on node 0 brings the workers together
    torchrun = launcher.name == "torchrun"
    timeout = timedelta(seconds=cfg.backend.timeout_s)
    where: dict[str, Any] = {}
    if init.name in ("env", "tcp"):
        setting = init.port_from
        stores = [distributed.serve_store(init.host, init.port or 0, timeout, setting)]
        stores += [
            distributed.serve_store(init.host, 0, timeout)
            for _ in range(launcher.max_restarts if torchrun else 0)
        ]
        where["init_method.ports"] = [store.port for store in stores]
    elif torchrun:  # init_method=file: the agents still meet somewhere
        stores = [distributed.serve_store("127.0.0.1", 0, timeout)]
    else:
        return [], cfg
    if torchrun:
        where["launcher.rdzv_endpoint"] = (
            f"{init.host if init.name != 'file' else '127.0.0.1'}:{stores[0].port}"
        )
    return stores, run_config.amended(cfg, where)


def _completed_despite(failure: WorkerFailed, summary_file: Path) -> None:
    """A worker that fails after rank 0 wrote this run's summary failed in its teardown: the summary
    is written after the last collective, so every rank had finished its work. Warn, and keep the
    run."""
    if not summary_file.exists():
        raise failure
    json.loads(summary_file.read_text())  # whole (written atomically), or this fails loudly
    say(
        f"hydra-ddp: warning: worker rank {failure.rank} ended badly ({failure.cause}) while "
        f"exiting, after the run completed ({summary_file} written): the results are complete"
    )


def _spawn(cfg: RunConfig, run_dir: Path, started_at: float, parent: Optional[int]) -> None:
    log_file = RunDir(run_dir).log(cfg.job)
    context = mp.start_processes(
        _spawned,
        args=(cfg, str(run_dir), started_at, parent),
        nprocs=cfg.trainer.nproc,
        join=False,
        start_method=cfg.launcher.start_method,
    )

    def forward(signum: int, frame: Any) -> None:
        # Pre-emption reaches the launcher: pass it on, and the workers checkpoint and stop
        # together.
        for process in context.processes:
            if process.is_alive():
                os.kill(process.pid, signum)

    previous = {sig: signal.signal(sig, forward) for sig in STOP_SIGNALS}
    # A rank that fails makes its peers fail within a second; a hung one is killed after the grace
    # period (torch < 2.5 has no grace period: SIGTERM at once, then SIGKILL after 30 s).
    grace = (
        {"grace_period": SPAWN_GRACE_S}
        if "grace_period" in inspect.signature(context.join).parameters
        else {}
    )
    try:
        while not context.join(**grace):
            pass
    except mp.ProcessRaisedException as e:
        raise WorkerFailed(
            *_first_spawned_cause(context, e.error_index, _last_line(str(e))), log_file
        ) from None
    except mp.ProcessExitedException as e:
        cause = f"killed by {e.signal_name}" if e.signal_name else f"exit code {e.exit_code}"
        raise WorkerFailed(*_first_spawned_cause(context, e.error_index, cause), log_file) from None
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _torchrun(
    cfg: RunConfig, run_dir: Path, started_at: float, parent: Optional[int]
) -> Optional[int]:
    """Run the agent; the signal that stopped it, if one did."""
    from torch.distributed.elastic.multiprocessing.api import (
        DefaultLogsSpecs,
        SignalException,
    )
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    launcher = cfg.launcher
    logs = Path(tempfile.mkdtemp(prefix="hydra-ddp-elastic-"))
    single_node = launcher.nnodes == 1
    if single_node:
        # The agent joins the rendezvous on our loopback store (_host_stores) as a client: its own
        # would listen on every interface. Nor may it open a second, shared store for the workers:
        # they meet on ours (distributed.process_group).
        os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    elif (launcher.min_nodes or launcher.nnodes) != launcher.nnodes:
        # Elastic: rank 0's agent keeps the workers' store of its first round when it shares the
        # rendezvous store, and never announces it to a node that joins later, which then waits for
        # it until the rendezvous times out (torch 2.14). Each round's rank 0 announces a fresh one.
        os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    config = LaunchConfig(
        min_nodes=launcher.min_nodes or launcher.nnodes,  # below nnodes: elastic (parallel.elastic)
        max_nodes=launcher.nnodes,
        nproc_per_node=cfg.trainer.nproc,
        run_id=launcher.rdzv_id,
        role="trainer",
        rdzv_endpoint=launcher.rdzv_endpoint,
        rdzv_backend=launcher.rdzv_backend,
        rdzv_configs={
            **launcher.rdzv_conf,
            "is_host": False if single_node else launcher.node_rank == 0,
        },
        max_restarts=launcher.max_restarts,
        monitor_interval=launcher.monitor_interval,
        start_method=launcher.start_method,
        local_addr=launcher.local_addr,
        # The workers' error files where the failure report can read them all, removed after the
        # run.
        logs_specs=DefaultLogsSpecs(log_dir=str(logs)),
    )
    # The agent passes on SIGTERM and SIGINT only: Slurm's pre-emption signals become a SIGTERM.
    as_sigterm = {
        sig: signal.signal(sig, lambda *_: os.kill(os.getpid(), signal.SIGTERM))
        for sig in (signal.SIGUSR1, signal.SIGUSR2)
    }
    try:
        elastic_launch(config, _elastic)(cfg, str(run_dir), started_at, parent)
        return None
    except SignalException as e:
        return e.sigval  # the agent has passed the signal on and waited for the workers to stop
    except ChildFailedError as e:
        rank, cause = _first_cause(e.failures, logs)
        raise WorkerFailed(rank, cause, RunDir(run_dir).log(cfg.job)) from None
    finally:
        shutil.rmtree(logs, ignore_errors=True)
        for sig, handler in as_sigterm.items():
            signal.signal(sig, handler)
        if single_node:
            os.environ.pop("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", None)


def _first_cause(failures: dict[int, Any], logs: Path) -> tuple[int, str]:
    """(rank, one line) of the failure that started it. A rank whose peer died fails too (at once,
    or aborted later), and may be the one the agent reports: it reports one failed worker of its
    last look. Every local rank's error file of the latest attempt is read (under `logs`, the
    agent's log folder), beside the reported one's, and a failure of a rank's own is named before
    one that followed it."""
    causes = {}
    attempts = sorted(logs.glob("*/attempt_*"), key=lambda path: int(path.name.rsplit("_", 1)[1]))
    for rank, failure in failures.items():
        # the error file's {"message": ..., "extraInfo": ...}, or a plain string
        message = failure.message
        causes[rank] = _last_line(
            message.get("message", str(message)) if isinstance(message, dict) else str(message)
        )
        for error_file in attempts[-1].glob("*/error.json") if attempts else ():
            local_rank = int(error_file.parent.name) if error_file.parent.name.isdigit() else None
            try:
                data = json.loads(error_file.read_text())["message"]
                text = data["message"] if isinstance(data, dict) else data
            except (OSError, ValueError, KeyError, TypeError):
                continue
            if local_rank is not None and isinstance(text, str):
                causes.setdefault(rank - failure.local_rank + local_rank, _last_line(text))
    rank = min(causes, key=lambda r: (_follows_another(causes[r]), r))
    return rank, causes[rank]


def _follows_another(cause: str) -> bool:
    """A failure that follows a peer's: it lost its peer (gloo sees the dead one at once), or it was
    aborted (NCCL's watchdog ends every rank still waiting on a dead peer with SIGABRT, after
    backend.timeout_s): the launcher names the peer's own failure first when it has both."""
    return cause.startswith(LOST_A_PEER) or "SIGABRT" in cause


def _first_spawned_cause(context: Any, rank: int, cause: str) -> tuple[int, str]:
    """As _first_cause, under spawn: join reports the first worker it finds failed, which may be
    one that followed a peer's failure (lost it, or was aborted waiting for it). Every worker that
    raised has left its traceback in torch's error file (a pickled string, in a private temporary
    file: torch's join reads it the same way); one that died otherwise, its exit code."""
    if not _follows_another(cause):
        return rank, cause
    for index, path in enumerate(getattr(context, "error_files", [])):
        try:
            with open(path, "rb") as file:
                line = _last_line(pickle.load(file))
        except (OSError, EOFError, pickle.UnpicklingError, AttributeError):
            continue  # this worker did not fail, or not with an exception
        if not _follows_another(line):
            return index, line
    for index, process in enumerate(context.processes):  # killed by something other than an abort
        code = process.exitcode
        if code and code < 0 and -code != signal.SIGABRT:
            return index, f"killed by {signal.Signals(-code).name}"
    return rank, cause


class WorkerFailed(UserError):
    def __init__(self, rank: int, cause: str, log_file: Path):
        self.rank, self.cause = rank, cause
        if cause.startswith(EVERY_RANK):  # the run's failure, not one rank's
            super().__init__(f"{cause[len(EVERY_RANK) :]} (log: {log_file})")
            return
        super().__init__(f"worker rank {rank} failed: {cause} (full traceback: {log_file})")


def _last_line(text: str) -> str:
    """The worker's one-line WorkerError from the end of a traceback (or torchelastic's message)."""
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return lines[-1].split("WorkerError: ", 1)[-1] if lines else "unknown error"


class Stopped(UserError):
    """The workers stopped early on a signal, after writing a checkpoint."""

    def __init__(self, summary: dict[str, Any], run_dir: Path, quiet: bool = False):
        signum = getattr(signal, summary["stopped_by"], None)
        self.exit_code = 128 + signum if signum else 1
        self.quiet = quiet
        again = _again(run_dir)
        where = (
            f"at step {summary['steps']}; checkpoint saved in {run_dir / 'checkpoints'}"
            if summary["steps"]
            else "before the workers wrote a checkpoint; the last one is kept"
        )
        super().__init__(f"stopped by {summary['stopped_by']} {where}; continue with: {again}")


def _again(run_dir: Path) -> str:
    """The command that continues this run where it stopped."""
    kept = [
        o
        for o in HydraConfig.get().overrides.task
        if not o.startswith(("hydra.run.dir=", "trainer.resume="))
    ]
    return shlex.join(
        [_this_python(), "train.py", *kept, f"hydra.run.dir={run_dir}", "trainer.resume=auto"]
    )


def _this_python() -> str:
    """The interpreter that ran this, as the user can type it: a bare `python` where that is the one
    on PATH, else its path (relative under the current directory, as .venv/bin/python), as a bare
    `python` outside the venv has no hydra_ddp."""
    here = Path(sys.executable)
    on_path = shutil.which("python")
    if (
        on_path
        and Path(on_path).resolve() == here.resolve()
        and Path(on_path).parent == here.parent
    ):
        return "python"
    try:
        return str(here.relative_to(Path.cwd()))
    except ValueError:
        return str(here)
