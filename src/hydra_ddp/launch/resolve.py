"""Config resolution: the composed config becomes the RunConfig every worker receives, with every
auto and null that launching depends on settled, once, before any worker starts."""

from __future__ import annotations

import multiprocessing as mp
import os
import uuid
from pathlib import Path
from typing import Any, Optional, Union

import torch
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import InterpolationResolutionError, MissingMandatoryValue
from torch import nn

from hydra_ddp import blueprint, monitor, performance, tasks
from hydra_ddp.checkpoint import files as checkpoints
from hydra_ddp.config import domains, from_checkpoint, groups, run_config, schema
from hydra_ddp.config.run_config import Requested, RequestedLauncherConf, RunConfig, amended
from hydra_ddp.errors import UserError
from hydra_ddp.launch import startup
from hydra_ddp.launch.checks import check
from hydra_ddp.parallel import distributed, elastic, strategies
from hydra_ddp.recipe import compiling
from hydra_ddp.rundir import RunDir
from hydra_ddp.runtime.ranks import RankInfo

DEFAULT_BATCH_SIZE = 32  # per rank, when neither data.batch_size nor data.global_batch_size is set


def resolve(
    composed: Union[DictConfig, dict[str, Any]],
    run_dir: Path,
    external: Optional[tuple[str, RankInfo]],
    checked: bool = True,
) -> RunConfig:
    """The config every worker receives, typed, settled and read-only, from the composed config (or
    it made plain: a test's, a tool's); then checked, unless `checked=False` (an outside launch's
    ranks other than 0: rank 0 checks what depends on its run directory)."""
    plain = plain_config(composed) if isinstance(composed, DictConfig) else composed
    # read-only from the start: each step below makes a new config, and so does the launch later
    cfg = run_config.resolved(settle(run_config.requested(plain), run_dir, external))
    if checked:
        check(cfg, run_dir)
    return cfg


def settle(cfg: Requested, run_dir: Path, external: Optional[tuple[str, RankInfo]]) -> Requested:
    """Every `auto` and null the run depends on (device, world size, backend, init method, batch
    sizes, the fast settings) settled, once: each step computes values from the config so far, and
    a new config holds them (nothing is assigned). Every rank of an outside launch runs this
    alike."""
    requested_global_batch, requested_compile = cfg.data.global_batch_size, cfg.trainer.compile
    cfg = settle_launch(cfg, run_dir, external)
    # Model replicas, each reading its own batches: every rank but under tensor parallel (one
    # replica).
    chosen, plan = strategies.get(cfg.strategy.name), blueprint.of(cfg.model, cfg.task)
    world = cfg.trainer.nproc * cfg.launcher.nnodes  # an elastic run's largest
    cfg = amended(cfg, batches(cfg.data, cfg.trainer, chosen.replicas(cfg.strategy, world)))
    trainer, resume = cfg.trainer, cfg.trainer.resume
    if elastic.is_elastic(cfg.launcher):
        elastic.check(  # at each world size in the range
            cfg,
            requested_global_batch,
            chosen.replicas_at(cfg),
            lambda at: chosen.check(at, plan.model),
        )
        resume = resume or "auto"  # each restart continues from the last checkpoint
    init_from = trainer.init_from and str(checkpoints.find(trainer.init_from, "trainer.init_from"))
    cfg = amended(
        cfg,
        {
            "trainer.resume": checkpoints.resume_setting(resume),
            "trainer.max_time": max_time_seconds(trainer.max_time),
            **_monitor(trainer, cfg.data, plan.task),
            "backend.name": chosen.backend(cfg.strategy, cfg.backend.name),
            "trainer.init_from": init_from,
            # the fast settings, settled here, alike on every rank of an outside launch
            "trainer.compile": compiling.mode(
                trainer.compile, plan.model_or_none() if trainer.compile is True else None
            ),
        },
    )
    # `settled` records which were auto (where the workers find a shared-memory segment cannot be
    # made, an auto falls back, a true fails).
    values, settled = chosen.settle(cfg, world, cfg.trainer.nproc)
    if requested_compile is True:  # the summary says which: the blocks or the whole model
        settled["trainer.compile"] = cfg.trainer.compile
    allowed = chosen.allows_channels_last()
    conv: Optional[bool] = False
    if performance.needs_model(trainer.channels_last, allowed):
        # None where the model does not build before launch (one that asks for its rank as it is
        # built): the workers settle channels_last from the model they build, and record it.
        model = plan.model_or_none()
        conv = None if model is None else performance.has_conv2d(model)
    value = performance.channels_last(trainer.channels_last, allowed, conv)
    if value is not None:  # else the workers' to settle, from the model they build
        if trainer.channels_last == performance.AUTO:
            settled["trainer.channels_last"] = value
        values["trainer.channels_last"] = value
    return amended(cfg, {**values, "settled": settled})


def plain_config(cfg: DictConfig) -> dict[str, Any]:
    """The composed config with every interpolation resolved, or one line naming what is missing."""
    try:
        return OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)  # type: ignore[return-value]
    except MissingMandatoryValue as e:
        raise UserError(
            f"{e.full_key} must be set (it is ??? in the config); pass {e.full_key}=..."
        ) from None
    except InterpolationResolutionError as e:
        raise UserError(groups.mismatch(e)) from None


def settle_launch(
    cfg: Requested, run_dir: Path, external: Optional[tuple[str, RankInfo]]
) -> Requested:
    """How this command runs: device, world size, backend, init method (train.py's and eval.py's),
    in a new config. First, every key's value in its domain (the schema's annotations), or one line
    naming it."""
    domains.check(cfg, schema.Config)
    host = distributed.Host.here()
    device = _device(cfg.trainer.device, host)
    if external:
        launcher_name, rank = external
        nodes = rank.world_size // rank.local_world_size
        cfg = amended(
            cfg,
            {
                "launcher.name": launcher_name,
                "launcher.external": True,
                "launcher.nnodes": nodes,
                "launcher.min_nodes": nodes,
                "trainer.nproc": rank.local_world_size,
                "trainer.device": device,
            },
        )
    else:
        min_nodes, nnodes = elastic.node_range(cfg.launcher.nnodes)
        nproc = _nproc(cfg.trainer.nproc, device, host)
        cfg = amended(
            cfg,
            {
                "launcher.min_nodes": min_nodes,
                "launcher.nnodes": nnodes,
                "trainer.nproc": nproc,
                "trainer.device": device,
            },
        )
        cfg = amended(cfg, {"launcher.rdzv_id": _rendezvous_id(cfg.launcher)})
    nproc = cfg.trainer.nproc
    backend = distributed.resolve_backend(
        cfg.backend.name, device, nproc, host, outside_launch=external is not None
    )
    return amended(
        cfg,
        {
            **_init_method(cfg.init_method, run_dir, external is not None),
            "backend.name": backend,
            "backend.timeout_s": collective_timeout(cfg.backend.timeout_s, backend),
            # Decided here, so the checkpoint records it: the same thread count gives the same CPU
            # kernels, and eval.py evaluates with it (bit-equal metrics at any world size). N ranks
            # × all cores would thrash.
            "trainer.threads": cfg.trainer.threads or max(1, len(os.sched_getaffinity(0)) // nproc),
        },
    )


def oversubscribed(trainer: schema.TrainerConf) -> Optional[str]:
    """A note where this host's CPU workers outnumber its cores (they share them: slower than fewer
    workers would be), or None."""
    cores = len(os.sched_getaffinity(0))
    if trainer.device != "cpu" or trainer.nproc <= cores:
        return None
    return (
        f"{trainer.nproc} CPU workers on this host's {cores} core(s) "
        f"share them, {trainer.threads} thread(s) each: slower than "
        f"trainer.nproc={cores} would be (fine for trying a config)"
    )


def collective_timeout(value: Any, backend: str) -> int:
    """backend.timeout_s: auto is 600 s where NCCL runs (its ranks may wait for a dead peer until
    then), else 1800 s."""
    if value == "auto":
        return 600 if "nccl" in backend else 1800
    return int(value)


def _monitor(
    trainer: schema.TrainerConf, data_cfg: schema.DataConf, task: tasks.Task
) -> dict[str, Any]:
    """trainer.monitor and monitor_mode: a metric the task reports (auto: the task's choice; its
    direction settles monitor_mode=auto); without validation (data.val_fraction=0) a val/ metric
    has no values, and nothing is monitored."""
    name, mode = monitor.settle(trainer.monitor, trainer.monitor_mode, task.metrics, task.monitored)
    if name is not None and name not in monitor.names(task.metrics):
        raise UserError(
            f"trainer.monitor={name!r} is not a metric of this task; choose one of "
            f"{', '.join(monitor.names(task.metrics))} (or null, or auto)"
        )
    if data_cfg.val_fraction == 0 and name is not None and name.startswith("val/"):
        name = None
    return {"trainer.monitor": name, "trainer.monitor_mode": mode}


def max_time_seconds(value: Any) -> Optional[float]:
    """trainer.max_time: seconds, or "[D:]HH:MM:SS" (as Lightning and Slurm write a time limit)."""
    if value is None:
        return None
    try:
        if isinstance(value, str) and ":" in value:
            parts = [float(p) for p in value.split(":")]
            if not 3 <= len(parts) <= 4:
                raise ValueError
            seconds = sum(p * unit for p, unit in zip(reversed(parts), (1, 60, 3600, 86400)))
        else:
            seconds = float(value)
    except ValueError:
        seconds = -1.0
    if not seconds > 0:
        raise UserError(
            f"trainer.max_time={value!r}: give seconds "
            "(e.g. 3600) or [D:]HH:MM:SS (e.g. 00:12:00:00)"
        )
    return seconds


def batches(
    data_cfg: schema.DataConf, trainer: schema.TrainerConf, replicas: int
) -> dict[str, int]:
    """data.batch_size (samples per micro-batch per replica), trainer.accumulate (micro-batches per
    optimizer step) and data.global_batch_size (samples per optimizer step over every replica and
    micro-batch), settled so that global = batch_size × accumulate × replicas: any two of the three
    give the third, all three must agree, and what does not divide is one line."""
    micro, accumulate, total = data_cfg.batch_size, trainer.accumulate, data_cfg.global_batch_size
    over = f"{replicas} model replica{'s' if replicas > 1 else ''}"
    if total is None:
        micro, accumulate = micro or DEFAULT_BATCH_SIZE, accumulate or 1
    elif micro is not None and accumulate is not None:
        if micro * accumulate * replicas != total:
            raise UserError(
                f"data.global_batch_size={total} is not data.batch_size={micro} × "
                f"trainer.accumulate={accumulate} × {over} ({micro * accumulate * replicas}): "
                "set two of the three, and the third follows"
            )
    elif micro is not None:
        accumulate = _divided(
            total,
            micro * replicas,
            f"into micro-batches of data.batch_size={micro} on {over}",
            "trainer.accumulate instead of data.batch_size",
        )
    else:
        accumulate = accumulate or 1
        micro = _divided(
            total,
            accumulate * replicas,
            f"by trainer.accumulate={accumulate} × {over}",
            "data.batch_size instead",
        )
    return {
        "data.batch_size": micro,
        "trainer.accumulate": accumulate,
        "data.global_batch_size": micro * accumulate * replicas,
    }


def _divided(total: int, by: int, what: str, instead: str) -> int:
    """data.global_batch_size ÷ `by` (the settings given, multiplied), or one line saying what it
    does not divide by (`what`) and which setting to give `instead`."""
    if total % by:
        raise UserError(
            f"data.global_batch_size={total} does not divide {what}: choose a multiple of {by}, "
            f"or set {instead}"
        )
    return total // by


def _device(name: str, host: distributed.Host) -> str:
    if name == "auto":
        return "cuda" if host.cuda else "cpu"
    if name == "cuda" and not host.cuda:
        raise UserError(
            "trainer.device=cuda but CUDA is not available here; use trainer.device=cpu (or auto)"
        )
    return name


def _nproc(value: Any, device: str, host: distributed.Host) -> int:
    if value == "auto":
        return host.gpus if device == "cuda" else 2
    return int(value)


def _rendezvous_id(launcher: RequestedLauncherConf) -> Optional[str]:
    """The launcher's settings checked, and torchrun's rendezvous id (a fresh one on a single node,
    where the endpoint is the launching process's own store: launch/workers.py)."""
    if launcher.name == "spawn":
        if launcher.nnodes != 1:
            raise UserError(
                "launcher=spawn runs on one node; use launcher=torchrun for launcher.nnodes > 1"
            )
    elif launcher.name == "torchrun":
        if launcher.nnodes < 1 or not 0 <= launcher.node_rank < launcher.nnodes:
            raise UserError(
                f"launcher.node_rank={launcher.node_rank} must "
                f"be in [0, launcher.nnodes={launcher.nnodes})"
            )
        if launcher.nnodes > 1 and not (launcher.rdzv_endpoint and launcher.rdzv_id):
            raise UserError(
                "a multi-node launcher=torchrun needs launcher.rdzv_endpoint=HOST:PORT "
                "(node 0) and the same launcher.rdzv_id on every node"
            )
    available = [m for m in startup.START_METHODS if m in mp.get_all_start_methods()]
    if launcher.start_method not in available:
        raise UserError(
            f"launcher.start_method={launcher.start_method!r} is "
            f"not available here; choose {' or '.join(available)}"
        )
    if launcher.name == "torchrun":
        return launcher.rdzv_id or uuid.uuid4().hex[:12]
    return launcher.rdzv_id


def _init_method(init: Any, run_dir: Path, external: bool) -> dict[str, Any]:
    """Where the ranks meet. env: MASTER_ADDR and MASTER_PORT where exported (an outside launcher's,
    or the user's), else init_method.host and a port the launching process binds (port null: a free
    one); tcp: init_method.host and port; file: a fresh file in the run directory unless given."""
    name = init.name
    if name == "env" and "MASTER_PORT" in os.environ:
        port = os.environ["MASTER_PORT"]
        if not port.isdigit() or not 0 < int(port) < 65536:
            raise UserError(
                f"MASTER_PORT={port!r} (exported) is not a "
                "port; export a number in 1-65535, or unset it"
            )
        return {
            "init_method.host": os.environ.get("MASTER_ADDR") or init.host,
            "init_method.port": int(port),
            "init_method.port_from": "MASTER_PORT",
        }
    if name in ("env", "tcp") and init.port is None and external:
        needs = (
            "MASTER_ADDR and MASTER_PORT exported (rank 0's host, a free port), "
            "or init_method.port (and init_method.host), the same on every rank"
            if name == "env"
            else "init_method.port (and init_method.host: rank 0's host), the same on every rank"
        )
        raise UserError(f"init_method={name} under this launcher needs {needs}")
    if name != "file":
        return {}
    if init.path is None and external:
        raise UserError(
            "init_method=file under an outside launcher needs init_method.path, shared by all ranks"
        )
    path = Path(init.path or RunDir(run_dir).rendezvous_store).expanduser().resolve()
    if path.exists() and path.stat().st_size > 0:
        raise UserError(
            f"init_method.path {str(path)!r} is a leftover store from another run (not empty): "
            "reusing it can deadlock; delete it or point init_method.path at a new file"
        )
    if not path.parent.is_dir():
        raise UserError(f"init_method.path: directory {str(path.parent)!r} does not exist")
    return {"init_method.path": str(path)}


def eval_config(
    cfg: DictConfig, overrides: list[str], run_dir: Path, external: Optional[tuple[str, RankInfo]]
) -> RunConfig:
    """eval.py's config, typed, its launch settled, read-only: the checkpoint's own with the command
    line's overrides on top (config/from_checkpoint.py), its weights checked against the model it
    names."""
    path = checkpoints.find(str(cfg.ckpt), "ckpt")
    saved = checkpoints.read(path, "ckpt")
    composed = OmegaConf.to_container(cfg, resolve=True)
    plain = from_checkpoint.merged(
        saved["config"], saved["position"], composed, overrides, str(path)
    )
    requested = run_config.requested(plain)
    _check_model(blueprint.of(requested.model, requested.task).model(), saved["model"], path)
    return run_config.resolved(settle_launch(requested, run_dir, external))


def _check_model(model: nn.Module, saved: dict[str, torch.Tensor], path: Path) -> None:
    """The checkpoint's weights fit the model to evaluate (on the meta device: no memory)."""
    checkpoints.check_compatible(
        model,
        saved,
        path,
        fix="evaluate it with the model it was saved from "
        "(leave model= out: the checkpoint's is the default)",
    )
