"""Starting the workers: spawn, torchrun's machinery from Python, or none (an outside launcher did).

The parent resolves the config once (`validate.resolve`) and hands the plain result and the
run directory to every worker.
"""

from __future__ import annotations

import atexit
import contextlib
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
import threading
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, NoReturn, Optional

import torch.multiprocessing as mp
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from hydra_ddp import distributed, evaluation, reporting, scaling, startup, validate, worker
from hydra_ddp.signals import STOP_SIGNALS
from hydra_ddp.errors import EVERY_RANK, LOST_A_PEER, UserError
from hydra_ddp.rundir import RunDir

log = logging.getLogger(__name__)

SPAWN_GRACE_S = 5.0  # how long the other workers get to exit after one fails, before SIGTERM, then SIGKILL


def adopt_external_launch(argv: list[str]) -> None:
    """Prepare argv when this process is already a worker of torchrun, torch.distributed.launch or mpirun.

    The legacy launcher appends `--local-rank=N`, which Hydra would reject: it becomes LOCAL_RANK.
    Ranks other than 0 then skip Hydra's output directory and log file: rank 0 decides the
    run directory and tells the others once the process group is up.
    """
    for arg in [a for a in argv[1:] if a.startswith(("--local-rank=", "--local_rank="))]:
        os.environ["LOCAL_RANK"] = arg.split("=", 1)[1]
        argv.remove(arg)
    found = distributed.external_launch()
    if found and not found[1].is_main:
        # Hydra's "disabled" logging would also disable every logger that exists by then (the
        # project's, created at import): this rank's lines would never reach the run's log file.
        argv += ["hydra.output_subdir=null", "hydra.run.dir=.", "hydra/job_logging=disabled", "hydra/hydra_logging=disabled",
                 "hydra.job_logging.disable_existing_loggers=false", "hydra.hydra_logging.disable_existing_loggers=false"]


def exit_after(entry: Callable[[], Any]) -> NoReturn:
    """Run train.py's entry point, then end the process without the interpreter's teardown.

    Exit handlers run and other threads are waited for, as at any exit; what is skipped is freeing
    torch's thousands of modules and objects one by one, which takes seconds after `import torch`
    alone, at the end of every command, with every output already closed.
    """
    try:
        entry()
        code: Any = 0
    except SystemExit as stop:
        code = stop.code
    # What the interpreter does first at exit, in its order: threading's exit hooks (which stop
    # executors' threads, e.g. joblib's), then waiting for non-daemon threads, then atexit's handlers.
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


def run(cfg: DictConfig, started_at: float, task: str = "train") -> Optional[dict[str, Any]]:
    """Validate, launch, wait; the summary of a finished run, or eval.py's result (task="eval").
    None on a non-zero node."""
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    distributed.adopt_launcher_environment()
    external = distributed.external_launch()
    if startup.checking():
        return _check_only(cfg, run_dir, external, task)
    plain = _resolve(cfg, run_dir, external, task)
    if external:
        # Only rank 0 knows the run directory: its verdict reaches every rank once the group is up.
        problem = _problem(plain, run_dir) if external[1].is_main and task == "train" else None
        return _unless_stopped(worker.main(plain, str(run_dir), external[1], started_at, problem=problem), run_dir,
                               quiet=not external[1].is_main)
    return _unless_stopped(launch(plain, run_dir, started_at), run_dir)


def launch(plain: dict[str, Any], run_dir: Path, started_at: float) -> Optional[dict[str, Any]]:
    """Start the workers of a resolved config on this node and wait for them: the run's summary
    (eval.py's result), None if they ended without one. Also the tuner's way to time candidates."""
    # Inside a joblib (loky) job the default context is loky's, which cannot start our workers.
    multiprocessing.set_start_method("spawn", force=True)
    launcher, n = plain["launcher"], plain["trainer"]["nproc"]
    log.info(
        "launching %d worker(s) with %s, backend %s, init %s → %s",
        n * launcher["nnodes"], launcher["name"], plain["backend"]["name"], plain["init_method"]["name"], run_dir,
    )
    if plain["init_method"]["name"] == "file":  # created private, before any rank writes its address there
        os.close(os.open(plain["init_method"]["path"], os.O_WRONLY | os.O_CREAT, 0o600))
    # These would repeat each child's failure on the console; WorkerFailed reports it in one line.
    for name in ("torch.multiprocessing.spawn", "torch.distributed.elastic.multiprocessing.api"):
        logging.getLogger(name).setLevel(logging.CRITICAL)
    startup.quiet_resource_tracker()
    summary_file = RunDir(run_dir).result(plain["task"])
    summary_file.unlink(missing_ok=True)  # resuming in this directory: only this run's summary counts
    signum = None
    stores = _host_stores(plain)  # bound before any worker starts, held until the last one has ended
    parent = startup.worker_parent(launcher["start_method"])
    try:
        if launcher["name"] == "spawn":
            _spawn(plain, run_dir, started_at, parent)
        else:
            signum = _torchrun(plain, run_dir, started_at, parent)
    except WorkerFailed as failure:
        _completed_despite(failure, summary_file)
    finally:
        del stores  # stops their servers
        if plain["init_method"]["name"] == "file":  # made fresh for this run; stale, it could deadlock the next
            Path(plain["init_method"]["path"]).unlink(missing_ok=True)
    summary = json.loads(summary_file.read_text()) if summary_file.exists() else None
    if signum is not None and not (summary and summary["stopped_by"]):  # ended before their checkpoint
        raise Stopped({"stopped_by": signal.Signals(signum).name, "steps": None}, run_dir)
    return summary


def _resolve(cfg: DictConfig, run_dir: Path, external: Optional[tuple[str, Any]], task: str) -> dict[str, Any]:
    """The plain config for the workers. Under an outside launcher every rank fills it in alike and
    rank 0 alone checks what depends on its run directory (_problem)."""
    overrides = list(HydraConfig.get().overrides.task)
    if task == "eval":
        plain = evaluation.resolve(cfg, overrides)
        validate.fill_in_launch(plain, run_dir, external)
    elif external:
        plain = validate.fill_in(cfg, run_dir, external)
    else:
        plain = validate.resolve(cfg, run_dir, external)
    plain["task"] = task
    hydra_cfg = HydraConfig.get()
    plain["sweep"] = ({"dir": str(Path(hydra_cfg.sweep.dir).resolve()), "job": hydra_cfg.job.num}
                      if hydra_cfg.mode == RunMode.MULTIRUN else None)  # loggers group a sweep's jobs
    # The keys set on the command line (a sweep trial's): every worker logs its own values of them.
    keys = (evaluation.override_key(o) for o in overrides if "=" in o)
    plain["overridden"] = [k for k in keys if _is_value(plain, k.split("."))]
    return plain


def _check_only(cfg: DictConfig, run_dir: Path, external: Optional[tuple[str, Any]], task: str) -> None:
    """train.py --check: everything a run checks before its first step, and nothing launched; one
    line that says what would run (or the UserError's one line)."""
    try:
        plain = _resolve(cfg, run_dir, external, task)
        if task == "train":
            if external:
                validate.check(plain, run_dir)
            validate.dry_build(plain)
    finally:
        with contextlib.suppress(OSError):
            run_dir.rmdir()  # Hydra made it for this command; nothing was written there (only if empty)
    launcher, trainer = plain["launcher"], plain["trainer"]
    what = (f"{plain['strategy']['name']}, global batch {plain['data']['global_batch_size']}" if task == "train"
            else f"eval of {plain['eval']['ckpt']} on {plain['eval']['split']}")
    print(f"hydra-ddp: config OK: {trainer['nproc'] * launcher['nnodes']} worker(s) on {trainer['device']} "
          f"({launcher['name']}, backend {plain['backend']['name']}, init {plain['init_method']['name']}), {what}; "
          "nothing launched", flush=True)


def _is_value(plain: dict[str, Any], path: list[str]) -> bool:
    node: Any = plain
    for part in path:
        if not isinstance(node, dict) or part not in node:
            return False
        node = node[part]
    return not isinstance(node, (dict, list))


def _problem(plain: dict[str, Any], run_dir: Path) -> Optional[str]:
    try:
        validate.check(plain, run_dir)
    except UserError as error:
        return str(error)
    return None


def _host_stores(plain: dict[str, Any]) -> list[Any]:
    """On a single node this process serves the rendezvous store itself, on a port it binds (port 0:
    a free one) before any worker starts and holds for the whole run: no other job can take the
    port in between. One store per torchrun attempt, so a restarted group meets on a fresh one.
    The workers reach them through torch's own env:// or tcp:// handler, as clients
    (distributed.process_group); torchrun's agents meet on the first."""
    init, launcher = plain["init_method"], plain["launcher"]
    if launcher["nnodes"] > 1:
        return []  # torchrun's rendezvous on node 0 brings the workers together
    torchrun = launcher["name"] == "torchrun"
    timeout = timedelta(seconds=plain["dist"]["timeout_s"])
    if init["name"] in ("env", "tcp"):
        setting = init.get("port_from", "init_method.port")
        stores = [distributed.serve_store(init["host"], init["port"] or 0, timeout, setting)]
        stores += [distributed.serve_store(init["host"], 0, timeout) for _ in range(launcher["max_restarts"] if torchrun else 0)]
        init["ports"] = [store.port for store in stores]
    elif torchrun:  # init_method=file: the agents still meet somewhere
        stores = [distributed.serve_store("127.0.0.1", 0, timeout)]
    else:
        return []
    if torchrun:
        launcher["rdzv_endpoint"] = f"{init['host'] if init['name'] != 'file' else '127.0.0.1'}:{stores[0].port}"
    return stores


def _completed_despite(failure: "WorkerFailed", summary_file: Path) -> None:
    """A worker that fails after rank 0 wrote this run's summary failed in its teardown: the summary
    is written after the last collective, so every rank had finished its work. Warn, and keep the run."""
    if not summary_file.exists():
        raise failure
    json.loads(summary_file.read_text())  # whole (written atomically), or this fails loudly
    say(f"hydra-ddp: warning: worker rank {failure.rank} ended badly ({failure.cause}) while exiting, after the run "
        f"completed ({summary_file} written): the results are complete")


def _unless_stopped(summary: Optional[dict[str, Any]], run_dir: Path, quiet: bool = False) -> Optional[dict[str, Any]]:
    """The summary of a finished run; a run that stopped early on a signal is a Stopped error
    (`quiet`: an outside launch's other ranks, which know no run directory: rank 0 says it)."""
    if summary and summary["stopped_by"]:
        raise Stopped(summary, run_dir, quiet)
    if summary and summary.get("ended_by") == "max_time":
        say(f"hydra-ddp: trainer.max_time spent at step {summary['steps']}: tested and checkpointed; continue "
            f"with: {_again(run_dir)}")
    return summary


def _spawn(plain: dict[str, Any], run_dir: Path, started_at: float, parent: Optional[int]) -> None:
    log_file = RunDir(run_dir).log(plain["task"])
    context = mp.start_processes(
        worker.spawn_entry, args=(plain, str(run_dir), started_at, parent), nprocs=plain["trainer"]["nproc"],
        join=False, start_method=plain["launcher"]["start_method"],
    )

    def forward(signum: int, frame: Any) -> None:
        # Pre-emption reaches the launcher: pass it on, and the workers checkpoint and stop together.
        for process in context.processes:
            if process.is_alive():
                os.kill(process.pid, signum)

    previous = {sig: signal.signal(sig, forward) for sig in STOP_SIGNALS}
    # A rank that fails makes its peers fail within a second; a hung one is killed after the grace
    # period (torch < 2.5 has no grace period: SIGTERM at once, then SIGKILL after 30 s).
    grace = {"grace_period": SPAWN_GRACE_S} if "grace_period" in inspect.signature(context.join).parameters else {}
    try:
        while not context.join(**grace):
            pass
    except mp.ProcessRaisedException as e:
        raise WorkerFailed(*_first_spawned_cause(context, e.error_index, _last_line(str(e))), log_file) from None
    except mp.ProcessExitedException as e:
        cause = f"killed by {e.signal_name}" if e.signal_name else f"exit code {e.exit_code}"
        raise WorkerFailed(*_first_spawned_cause(context, e.error_index, cause), log_file) from None
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _torchrun(plain: dict[str, Any], run_dir: Path, started_at: float, parent: Optional[int]) -> Optional[int]:
    """Run the agent; the signal that stopped it, if one did."""
    from torch.distributed.elastic.multiprocessing.api import DefaultLogsSpecs, SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    launcher = plain["launcher"]
    logs = Path(tempfile.mkdtemp(prefix="hydra-ddp-elastic-"))
    single_node = launcher["nnodes"] == 1
    if single_node:
        # The agent joins the rendezvous on our loopback store (_host_stores) as a client: its own
        # would listen on every interface. Nor may it open a second, shared store for the workers:
        # they meet on ours (distributed.process_group).
        os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    config = LaunchConfig(
        min_nodes=launcher["nnodes"],
        max_nodes=launcher["nnodes"],
        nproc_per_node=plain["trainer"]["nproc"],
        run_id=launcher["rdzv_id"],
        role="trainer",
        rdzv_endpoint=launcher["rdzv_endpoint"],
        rdzv_backend=launcher["rdzv_backend"],
        rdzv_configs={"is_host": False if single_node else launcher["node_rank"] == 0},
        max_restarts=launcher["max_restarts"],
        monitor_interval=launcher["monitor_interval"],
        start_method=launcher["start_method"],
        local_addr=launcher["local_addr"],
        # The workers' error files where the failure report can read them all, removed after the run.
        logs_specs=DefaultLogsSpecs(log_dir=str(logs)),
    )
    # The agent passes on SIGTERM and SIGINT only: Slurm's pre-emption signals become a SIGTERM.
    as_sigterm = {sig: signal.signal(sig, lambda *_: os.kill(os.getpid(), signal.SIGTERM))
                  for sig in (signal.SIGUSR1, signal.SIGUSR2)}
    try:
        elastic_launch(config, worker.elastic_entry)(plain, str(run_dir), started_at, parent)
        return None
    except SignalException as e:
        return e.sigval  # the agent has passed the signal on and waited for the workers to stop
    except ChildFailedError as e:
        rank, cause = _first_cause(e.failures, logs)
        raise WorkerFailed(rank, cause, RunDir(run_dir).log(plain["task"])) from None
    finally:
        shutil.rmtree(logs, ignore_errors=True)
        for sig, handler in as_sigterm.items():
            signal.signal(sig, handler)
        if single_node:
            os.environ.pop("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", None)


def _first_cause(failures: dict[int, Any], logs: Path) -> tuple[int, str]:
    """(rank, one line) of the failure that started it. A rank whose peer died fails too (at once, or
    aborted later), and may be the one the agent reports: it reports one failed worker of its last
    look. Every local rank's error file of the latest attempt is read (under `logs`, the agent's
    log folder), beside the reported one's, and a failure of a rank's own is named before one
    that followed it."""
    causes = {}
    attempts = sorted(logs.glob("*/attempt_*"), key=lambda path: int(path.name.rsplit("_", 1)[1]))
    for rank, failure in failures.items():
        message = failure.message  # the error file's {"message": ..., "extraInfo": ...}, or a plain string
        causes[rank] = _last_line(message.get("message", str(message)) if isinstance(message, dict) else str(message))
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
    dist.timeout_s): the launcher names the peer's own failure first when it has both."""
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
            super().__init__(f"{cause[len(EVERY_RANK):]} (log: {log_file})")
            return
        super().__init__(f"worker rank {rank} failed: {cause} (full traceback: {log_file})")


class Stopped(UserError):
    """The workers stopped early on a signal, after writing a checkpoint."""

    def __init__(self, summary: dict[str, Any], run_dir: Path, quiet: bool = False):
        signum = getattr(signal, summary["stopped_by"], None)
        self.exit_code = 128 + signum if signum else 1
        self.quiet = quiet
        again = _again(run_dir)
        where = (f"at step {summary['steps']}; checkpoint saved in {run_dir / 'checkpoints'}" if summary["steps"]
                 else "before the workers wrote a checkpoint; the last one is kept")
        super().__init__(f"stopped by {summary['stopped_by']} {where}; continue with: {again}")


def _again(run_dir: Path) -> str:
    """The command that continues this run where it stopped."""
    kept = [o for o in HydraConfig.get().overrides.task if not o.startswith(("hydra.run.dir=", "trainer.resume="))]
    return shlex.join(["python", "train.py", *kept, f"hydra.run.dir={run_dir}", "trainer.resume=auto"])


def _last_line(text: str) -> str:
    """The worker's one-line WorkerError from the end of a traceback (or torchelastic's message)."""
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return lines[-1].split("WorkerError: ", 1)[-1] if lines else "unknown error"


def say(line: str) -> None:
    """One line on stderr in one write: the ranks of an outside launch share the stream, and a line
    written in pieces (print writes the text, then the newline) can land inside another rank's."""
    sys.stderr.flush()
    os.write(sys.stderr.fileno(), f"{line}\n".encode())


def fail(error: UserError) -> None:
    """One line on stderr and a non-zero exit: the user's problem needs no traceback.

    In a multirun the job's directory keeps the line (error.txt, read by the scaling report)
    and the sweep goes on; the report's callback exits non-zero at the end.
    """
    message = str(error)
    message = message[len(EVERY_RANK):] if message.startswith(EVERY_RANK) else message  # an outside launch's rank
    if not getattr(error, "quiet", False):
        say(f"hydra-ddp: error: {message}")
    hydra_cfg = HydraConfig.get()
    if hydra_cfg.mode == RunMode.MULTIRUN and not isinstance(error, Stopped):  # a stop ends the sweep too
        RunDir(hydra_cfg.runtime.output_dir).error.write_text(f"{message}\n")
        return
    sys.exit(error.exit_code)
