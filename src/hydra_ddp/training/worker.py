"""One worker process, from the resolved config: process group → data → model → loop → outputs.

Workers never run Hydra: the launch side composed, settled and checked the config once and hands
it over as the read-only RunConfig (config.run_config), so a run has one output directory and one
config whatever started the workers.
"""

from __future__ import annotations

import atexit
import gc
import logging
import os
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist
from hydra.utils import instantiate
from torch import nn
from torch.distributed.elastic.multiprocessing.errors import record
from tqdm import tqdm

from hydra_ddp import blueprint, data, hooks, performance, tasks
from hydra_ddp.checkpoint import checkpointer as checkpointing
from hydra_ddp.checkpoint import files as checkpoints
from hydra_ddp.config import fingerprint, run_config
from hydra_ddp.config.run_config import RunConfig
from hydra_ddp.errors import (
    EVERY_RANK,
    LOST_A_PEER,
    PEER_GONE,
    EveryRankError,
    UserError,
    WorkerError,
    first_line,
    in_loader_worker,
    root_cause,
    say,
)
from hydra_ddp.parallel import distributed, elastic, shared_memory, strategies
from hydra_ddp.recipe import compiling, schedules
from hydra_ddp.recipe import ema as averaging
from hydra_ddp.recipe import optimizer as optimizers
from hydra_ddp.reporting import run_report
from hydra_ddp.reporting.progress import ProgressBar
from hydra_ddp.runtime import flight_recorder, hangs, processes, ranklog, ranks
from hydra_ddp.runtime.ranks import RankInfo
from hydra_ddp.training import evaluation, resuming, seeding
from hydra_ddp.training import length as run_length
from hydra_ddp.training import trainer as training
from hydra_ddp.training.parts import Optimization, Run, Trained
from hydra_ddp.training.profiling import Profiling
from hydra_ddp.training.state import StopRequest, resize_cause
from hydra_ddp.training.summary import how_it_ran

log = logging.getLogger(__name__)


def run(
    cfg: RunConfig,
    run_dir: str,
    rank: RankInfo,
    started_at: float,
    entered_at: float,
    problem: Optional[str] = None,
) -> Optional[dict[str, Any]]:
    """Train, and return the run's summary. `entered_at`: when this worker's own code began (its
    imports done); `problem`: what rank 0 of an outside launch found wrong."""
    stop = StopRequest()
    stop.install()
    tqdm.monitor_interval = 0  # no monitor thread: one less thread alive when the process exits
    external = cfg.launcher.external
    job = cfg.job
    if not external:
        ranklog.setup_logging(rank, Path(run_dir), job)
    device = _device(cfg.trainer.device, rank, external)
    torch.set_num_threads(cfg.trainer.threads)  # settled on the launch side (launch.resolve)
    if cfg.trainer.deterministic:  # before CUDA starts: cuBLAS reads its workspace setting once
        seeding.deterministic_kernels()
    if rank.is_main and job == "train":
        # while the other ranks start: it would hold them at the first collective
        run_report.preload_loggers(cfg)
    flight_recorder.enable(cfg.backend.name, None if external else Path(run_dir) / hangs.STACKS)
    with distributed.process_group(
        cfg.backend.name, cfg.init_method, rank, cfg.backend.timeout_s, device
    ):
        out = Path(run_dir)
        if external:  # every rank was started with its own idea of the run directory: rank 0's wins
            out = Path(distributed.broadcast_text(run_dir, device))
            ranklog.setup_logging(rank, out, job)
            problem = distributed.first_error(problem, device)
            if problem:
                # the same line on every rank, before anything is built
                raise EveryRankError(problem)
        # Until the last barrier: a rank that stops making progress leaves its stack
        # (reporting.hangs).
        with hangs.Watchdog(out, rank.rank, hangs.stall_after_s(cfg.backend.timeout_s)):
            _check_same_config(cfg, rank, device)
            # Everything the run builds lives in _train's frame and is gone when it returns, before
            # the group is destroyed. (gloo's threads still outlive destroy_process_group, held in
            # C++: workers end with os._exit for that reason, see _exit_after_teardown.)
            if job == "eval":
                summary = evaluation.run(cfg, out, rank, device, started_at)
            else:
                summary = _train(cfg, out, rank, device, stop, started_at, entered_at)
            _release(cfg)
            # No rank exits before rank 0 has written and closed every output: under srun
            # --kill-on-bad-exit a stopped run's other ranks (exit 128 + signal) would end it
            # mid-write.
            dist.barrier()
    return summary  # the same on every rank: global values only


def _device(kind: str, rank: RankInfo, outside_launch: bool) -> torch.device:
    """This rank's device: the CPU, or the GPU its local rank maps to among those it sees."""
    if kind != "cuda":
        return torch.device("cpu")
    return torch.device(
        "cuda",
        distributed.gpu_index(
            rank.local_rank, rank.local_world_size, torch.cuda.device_count(), outside_launch
        ),
    )


def _check_same_config(cfg: RunConfig, rank: RankInfo, device: torch.device) -> None:
    """Every rank trains with the same values (one sweep trial's, say), or none starts: the config's
    fingerprint, compared in one all-reduce. Each rank logs it, with the values set on the command
    line."""
    digest = fingerprint.config_fingerprint(cfg)
    mine = int(digest[:15], 16)  # fits an int64
    extremes = torch.tensor([mine, -mine], dtype=torch.int64, device=device)
    dist.all_reduce(extremes, op=dist.ReduceOp.MAX)
    overridden = " ".join(f"{key}={value}" for key, value in cfg.overridden.items())
    log.info("rank %d config %s%s", rank.rank, digest[:12], f": {overridden}" if overridden else "")
    if extremes[0].item() != -extremes[1].item():
        raise EveryRankError(
            "the ranks were given different configs (see each rank's 'config' line in the log); "
            "launch them with the same overrides"
        )


def _train(
    cfg: RunConfig,
    out: Path,
    rank: RankInfo,
    device: torch.device,
    stop: StopRequest,
    started_at: float,
    entered_at: float,
) -> dict[str, Any]:
    log.info(
        "rank %d/%d on %s, %d CPU thread(s), pid %d",
        rank.rank,
        rank.world_size,
        device,
        torch.get_num_threads(),
        os.getpid(),
    )
    # An elastic run: the accumulation that keeps the global batch, with the same micro-batch, at
    # the world size its rendezvous gave. The run's config at this size, recorded in the summary and
    # the checkpoint.
    at_size = elastic.at_world_size(cfg, rank.world_size, strategies.replicas_at(cfg))
    if at_size:
        cfg = run_config.amended(cfg, at_size)  # a new read-only config: the launch's unchanged
        log.info(
            "world size %d: %s", rank.world_size, " ".join(f"{k}={v}" for k, v in at_size.items())
        )
    data_cfg = cfg.data
    seeding.seed_everything(cfg.trainer.seed)  # alike on every rank: the model's initial weights
    # DDP's replicas, FSDP's shards or tensor parallel (parallel/)
    spread = strategies.build(cfg, device)
    # which batches this rank reads: its own, but under tensor parallel
    replica = spread.data_shard(rank)
    loaders = data.build_loaders(data_cfg, rank, cfg.trainer.seed, device, shard=replica)
    kept = data.save_with_run(data_cfg, out) if rank.is_main and cfg.job == "train" else None
    if kept:  # data=documents: its tokenizer, for export and inspection
        log.info("the data's tokenizer is saved with the run: %s", kept)
    read = data.about(data_cfg, loaders) if rank.is_main and cfg.job == "train" else None
    if read:  # how much text, and how much of a batch is text
        log.info(data.about_line(read))
    task = blueprint.of(cfg.model, cfg.task).task
    model = instantiate(cfg.model)
    # From here a stream per model replica (dropout's masks differ between ranks that read different
    # batches; the ranks of a tensor-parallel replica draw alike), saved in every checkpoint. The
    # data's randomness is per sample (data.SeededSamples), of no rank.
    seeding.seed_everything(data.sample_seed(cfg.trainer.seed, -2, replica.rank))
    # Settled on the launch side (channels_last for a model only the workers build): the summary
    # names them.
    fast = performance.settings(cfg, spread.fast_settings, model, spread.allows_channels_last())
    memory_format = performance.memory_format(fast["trainer.channels_last"])
    if cfg.trainer.init_from and rank.is_main:
        # Rank 0's weights: the strategy starts every rank from them (a resumed run's then replace
        # them).
        skipped = checkpoints.load_weights(
            model, checkpoints.location(cfg.trainer.init_from), list(cfg.trainer.init_ignore)
        )
        log.info(
            "weights from %s%s",
            cfg.trainer.init_from,
            f" (fresh: {', '.join(skipped)})" if skipped else "",
        )
    model = model.to(device, memory_format=memory_format)
    warning = (
        tasks.packing_warning(task, model, loaders.train_sampler.dataset) if rank.is_main else None
    )
    if warning:  # packed documents, and a model that attends across them
        log.warning(warning)
    dynamic = False  # the compiled blocks' shapes: static, but for batches padded per batch
    # inductor's caches in the run (the ranks share them, a resume finds them)
    if cfg.trainer.compile:
        compiling.use_run_cache(out)
        dynamic = compiling.dynamic(loaders.train_sampler.dataset)
    try:
        train_model = spread.wrap(model, dynamic)
    # on every rank alike: the one setting a worker settles
    except shared_memory.SharedMemoryUnavailable as e:
        if "strategy.shared_memory" not in cfg.settled:  # asked for, not chosen
            raise EveryRankError(
                f"strategy.shared_memory=true: {e}; set strategy.shared_memory=auto or false"
            ) from None
        log.warning("gradients all-reduce through %s, not shared memory: %s", dist.get_backend(), e)
        fast["strategy.shared_memory"] = False  # recorded in the summary
        train_model = spread.wrap(model, dynamic, shared=False)
    optimizer = optimizers.build(cfg.optim, cfg.param_groups.no_decay, spread.module, train_model)
    # the blocks' compile is the strategy's (recipe/compiling.py)
    if cfg.trainer.compile == "model":
        train_model = _compiled(train_model, cfg.trainer.compile_backend)
    ema = averaging.build(spread.module, cfg.trainer.ema.decay)  # resumed below, with the weights
    length = run_length.measure(cfg.trainer, loaders, device)
    try:
        scheduler = schedules.build(cfg.scheduler, optimizer, length.total_steps)
    except UserError as e:  # a warmup longer than the run: every rank measured the same length
        raise EveryRankError(str(e)) from None
    # What checkpoints record beside the config: the settings this worker settled.
    found = dict(fast)
    checkpointer = checkpointing.Checkpointer(
        cfg, out, rank, device, found, sharded=spread.sharded_checkpoints
    )
    # Rank 0 picks the checkpoint (on every node the same file: checkpoints live with rank 0).
    resume_setting = checkpoints.resume_setting(cfg.trainer.resume)
    resume = checkpointer.choose(resume_setting) if rank.is_main else None
    changed = (
        fingerprint.config_changes(resume[1]["config"], checkpointer.recorded) if resume else []
    )
    if elastic.is_elastic(cfg.launcher):  # a resize changes the accumulation by design
        changed = [change for change in changed if not change.startswith("trainer.accumulate:")]
    for change in changed:  # not the checkpoint's value: the run goes on with this command's
        log.warning("resuming %s: %s differs from the checkpoint's", resume[0].name, change)
    if rank.is_main and resume is None and resume_setting == "auto":
        log.info(
            "trainer.resume=auto: no checkpoint in %s; training from the start", checkpointer.where
        )
    # A run continued that had ended (its summary written; nothing to train under these settings):
    # one line, and nothing of it touched.
    complete = resuming.already_complete(out, resume, length, cfg.trainer) if rank.is_main else ""
    complete = distributed.broadcast_text(complete, device)
    if complete:
        if rank.is_main:
            say(complete)
        return None
    chosen = distributed.broadcast_text(str(resume[0]) if resume else "", device)
    if chosen and not rank.is_main:
        where = checkpoints.location(chosen)
        resume = where, checkpointer.load(where)

    # Resuming: the loggers drop what the earlier run logged after the checkpoint's step. Asked to
    # resume with no checkpoint yet (a restart before the first one): all of it, the run starts
    # over.
    resume_step = resume[1]["position"]["step"] if resume else None
    if resume is None and resume_setting == "auto":
        resume_step = 0
    reporter = run_report.Reporter(rank, out, cfg, resume_step=resume_step)
    try:
        trained = Trained(task, train_model, spread, device, memory_format)
        optimization = Optimization(optimizer, scheduler, ema)
        run = Run(reporter, checkpointer, stop, started_at, _hooks(cfg, rank))
        trainer = training.Trainer(cfg, trained, optimization, loaders, length, run)
        if resume:
            trainer.resume_from(*resume, cause=resize_cause(elastic.is_elastic(cfg.launcher)))
        trainer.fit()
        ran = how_it_ran(trainer, rank, out, fast, resume, started_at, entered_at)
        if read:
            ran["data"] = read
        reporter.finish(ran, hparams=run_report.hparams(cfg, rank.world_size))
    finally:
        reporter.close()
    return ran


def _hooks(cfg: RunConfig, rank: RankInfo) -> list[hooks.Hook]:
    """The run's side jobs (hooks.py): the bar, the profiler, a trial's pruner, trainer.hooks'."""
    trial, pruning = cfg.trial, []
    if trial.hook and trial.number is not None and trial.pruner != "none":
        given = {key: value for key, value in asdict(trial).items() if key != "hook"}
        pruning = [{"_target_": trial.hook, **given, "metric": cfg.trainer.monitor}]
    return hooks.build(
        [*pruning, *cfg.trainer.hooks],
        ProgressBar.of(run_report.show_progress(cfg.trainer.progress, rank)),
        Profiling.of(bool(cfg.trainer.profile), cfg.profiler),
    )


def _release(cfg: RunConfig) -> None:
    """Drop the Python references to the run before the group is destroyed: compiled graphs keep
    the DDP module, reference cycles the rest."""
    if cfg.trainer.compile:
        import torch._dynamo

        torch._dynamo.reset()
    gc.collect()


def _compiled(model: nn.Module, backend: str) -> nn.Module:
    """torch.compile'd, falling back to eager (with a warning) where compiling fails on this
    machine."""
    import torch._dynamo

    torch._dynamo.config.suppress_errors = True
    log.info("compiling the model with torch.compile(backend=%r)", backend)
    return torch.compile(model, backend=backend)  # type: ignore[return-value]


def main(
    cfg: RunConfig, run_dir: str, rank: RankInfo, started_at: float, problem: Optional[str] = None
) -> Optional[dict[str, Any]]:
    """Every worker's entry, whatever started it: the traceback to the log, one line to the
    launcher."""
    entered_at = time.time()
    try:
        return run(cfg, run_dir, rank, started_at, entered_at, problem)
    except Exception as error:
        log.exception("rank %d failed", rank.rank, extra=ranklog.FILE_ONLY)
        if isinstance(error, EveryRankError):
            raise WorkerError(EVERY_RANK + str(error)) from None
        if isinstance(error, UserError):
            # already one line that says what to do
            raise WorkerError(in_loader_worker(str(error))) from None
        line = first_line(root_cause(error))
        if any(sign in line.lower() for sign in PEER_GONE):
            line = LOST_A_PEER + line
        elif "timed out" in line.lower() or "timeout" in line.lower():
            # who was stuck where: the run's failure
            hung = hangs.describe(Path(run_dir), cfg.backend.timeout_s)
            line = EVERY_RANK + hung if hung else line
        raise WorkerError(line) from None


def spawn_entry(
    local_rank: int, cfg: RunConfig, run_dir: str, started_at: float, parent_pid: Optional[int]
) -> None:
    """torch.multiprocessing.spawn target: single node, rank = local rank."""
    n = cfg.trainer.nproc
    # No orphan keeps training, or holding a GPU, after its launcher is gone. The parent is the
    # launcher, or the forkserver that forked this worker, which dies with it (forkserver_guard).
    processes.die_with_parent(parent_pid)
    main(cfg, run_dir, RankInfo(local_rank, n, local_rank, n), started_at)
    _exit_after_teardown()


def _exit_after_teardown() -> None:
    """End a worker whose outputs are written and closed and whose group is destroyed, without
    interpreter finalization.

    Native threads outlive destroy_process_group (gloo's, while C++ still holds the group),
    torch.compile's tracing starts the autograd engine's device threads, and CPython 3.11 ends
    daemon threads that wake during finalization with pthread_exit, unwinding through C++ frames.
    Static destructors racing them aborted a finished worker now and then ("terminate called
    without an active exception"). A forked multiprocessing child ends the same way (os._exit).
    """
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


@record  # writes the exception to torchelastic's error file, so the parent can name it
def elastic_entry(
    cfg: RunConfig, run_dir: str, started_at: float, parent_pid: Optional[int]
) -> Optional[dict[str, Any]]:
    """elastic_launch target: torchelastic has set RANK, WORLD_SIZE, LOCAL_RANK,
    MASTER_ADDR/PORT."""
    _, rank = ranks.external_launch()
    processes.die_with_parent(parent_pid)  # as spawn_entry's
    summary = main(cfg, run_dir, rank, started_at)
    if summary and summary["stopped_by"]:
        # The agent, shutting down on the signal, waits for this process to end, while the process
        # waits to hand over its return value: end now, not after the agent's 30 s grace period.
        # (record() turns SystemExit(0) back into a return.) Every output is written and closed.
        _exit_after_teardown()
    # The agent takes the return value before the interpreter shuts down; the first exit handler
    # to run (they run last-registered first) then ends the process as spawn's workers end.
    atexit.register(_exit_after_teardown)
    return summary
