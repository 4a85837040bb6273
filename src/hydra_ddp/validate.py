"""The parent's checks: the composed config becomes a plain, fully resolved one, or one clear error.

Everything decided here (world size, backend, ports, file-store path) is decided once, before
any worker starts, and written into the config the workers receive.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import inspect
import os
import multiprocessing as mp
import uuid
from pathlib import Path
from typing import Any, Iterator, Optional

import torch
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import InterpolationResolutionError, MissingMandatoryValue

from hydra_ddp import checkpoint, comm, data, distributed, groups, monitor, performance, startup
from hydra_ddp.parallel import plans
from hydra_ddp.distributed import RankInfo
from hydra_ddp.errors import UserError
from hydra_ddp.rundir import RunDir

DEFAULT_BATCH_SIZE = 32  # per rank, when neither data.batch_size nor data.global_batch_size is set


def resolve(cfg: DictConfig, run_dir: Path, external: Optional[tuple[str, RankInfo]]) -> dict[str, Any]:
    """The plain config every worker receives: filled in, then checked."""
    plain = fill_in(cfg, run_dir, external)
    check(plain, run_dir)
    return plain


def fill_in(cfg: DictConfig, run_dir: Path, external: Optional[tuple[str, RankInfo]]) -> dict[str, Any]:
    """Resolve the `auto`s and nulls that launching and forming the group depend on (device, world
    size, backend, init method, batch sizes). Every rank of an outside launch runs this alike."""
    plain = plain_config(cfg)
    fill_in_launch(plain, run_dir, external)
    trainer = plain["trainer"]
    # Decided here, so the checkpoint records it: the same thread count gives the same CPU kernels,
    # and eval.py evaluates with it (bit-equal metrics at any world size).
    trainer["threads"] = trainer["threads"] or max(1, len(os.sched_getaffinity(0)) // trainer["nproc"])
    # Model replicas, each reading its own batches: every rank but under tensor parallel (one replica).
    chosen = plans.plan(plain["strategy"]["name"])
    replicas = chosen.replicas(plain["strategy"], trainer["nproc"] * plain["launcher"]["nnodes"])
    _resolve_batch_size(plain["data"], replicas)
    trainer["resume"] = checkpoint.resume_setting(trainer["resume"])
    trainer["max_time"] = max_time_seconds(trainer["max_time"])
    _resolve_monitor(trainer, plain["data"])
    plain["backend"]["name"] = distributed.group_backend(plain["backend"]["name"], plain["strategy"]["cpu_offload"])
    # Settled here, alike on every rank of an outside launch.
    plain["ddp"]["sync_batchnorm"] = chosen.sync_batchnorm(plain["ddp"]["sync_batchnorm"], trainer["device"])
    if trainer["init_from"]:
        trainer["init_from"] = str(checkpoint.find(trainer["init_from"], "trainer.init_from"))
    return plain


def plain_config(cfg: DictConfig) -> dict[str, Any]:
    """The composed config with every interpolation resolved, or one line naming what is missing."""
    try:
        return OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)  # type: ignore[return-value]
    except MissingMandatoryValue as e:
        raise UserError(f"{e.full_key} must be set (it is ??? in the config); pass {e.full_key}=...") from None
    except InterpolationResolutionError as e:
        raise UserError(groups.mismatch(e)) from None


def fill_in_launch(plain: dict[str, Any], run_dir: Path, external: Optional[tuple[str, RankInfo]]) -> None:
    """How this command runs: device, world size, backend, init method (train.py's and eval.py's)."""
    trainer, launcher = plain["trainer"], plain["launcher"]
    host = distributed.Host.here()
    trainer["device"] = _device(trainer["device"], host)
    if external:
        launcher_name, rank = external
        launcher.update(name=launcher_name, external=True, nnodes=rank.world_size // rank.local_world_size)
        trainer["nproc"] = rank.local_world_size
    else:
        trainer["nproc"] = _nproc(trainer["nproc"], trainer["device"], host)
        _check_launcher(launcher)
    plain["backend"]["name"] = distributed.resolve_backend(plain["backend"]["name"], trainer["device"], trainer["nproc"],
                                                           host, outside_launch=external is not None)
    _resolve_init_method(plain["init_method"], run_dir, external is not None)
    plain["dist"]["timeout_s"] = collective_timeout(plain["dist"]["timeout_s"], plain["backend"]["name"])


def check(plain: dict[str, Any], run_dir: Path) -> None:
    """Everything else that would fail a run later: found before any worker starts."""
    trainer, launcher, data_cfg = plain["trainer"], plain["launcher"], plain["data"]
    if trainer["resume"] is None and checkpoint.step_checkpoints(RunDir(run_dir).checkpoints):
        raise UserError(
            f"{run_dir} holds checkpoints of an earlier run; continue it with trainer.resume=auto, "
            "or start anew in another hydra.run.dir (nothing was overwritten)"
        )
    data.check_source(data_cfg["dataset"], data_cfg["num_classes"])
    _check_target(data_cfg["dataset"], "data.dataset")
    _check_target(plain["model"], "model")
    _check_target(plain["optim"], "optim")
    if plain["scheduler"]:
        _check_target(plain["scheduler"], "scheduler")
    if str(trainer["precision"]) not in ("32", "bf16", "16"):
        raise UserError(f"trainer.precision must be 32, bf16 or 16, got {trainer['precision']!r}")
    wrong = performance.check(plain)
    if wrong:
        raise UserError(f"{', '.join(wrong)}: expected true, false or auto")
    ddp = plain["ddp"]
    if ddp["comm_hook"] not in comm.HOOKS:
        raise UserError(f"unknown ddp.comm_hook {ddp['comm_hook']!r}; choose {', '.join(comm.HOOKS)}")
    if ddp["comm_hook"] != "none" and not data_cfg["even_shards"]:
        raise UserError(f"ddp.comm_hook={ddp['comm_hook']} does not combine with data.even_shards=false (Join's "
                        "shadow all-reduces bypass the hook); use one or the other")
    powersgd = ddp["powersgd"]
    if ddp["comm_hook"] == "powersgd" and (powersgd["rank"] < 1 or powersgd["start_step"] < 0):
        raise UserError(f"ddp.powersgd.rank must be 1 or more and ddp.powersgd.start_step 0 or more, got "
                        f"{powersgd['rank']} and {powersgd['start_step']}")
    if plain["ddp"]["static_graph"] is True and trainer["accumulate"] > 1:
        raise UserError("ddp.static_graph=true does not combine with trainer.accumulate > 1 (DDP's reducer fails "
                        "on a no_sync step in a static graph); set ddp.static_graph=auto or false")
    blockers = performance.config_blockers(plain) + ([f"trainer.device={trainer['device']} (it sums CPU tensors)"]
                                                     if trainer["device"] != "cpu" else [])
    if plain["ddp"]["shared_memory"] is True and blockers:
        raise UserError(f"ddp.shared_memory=true does not combine with {'; '.join(blockers)}; "
                        "set ddp.shared_memory=auto or false")
    plans.check(plain)
    if plain["ddp"]["sync_batchnorm"] not in (True, False):
        raise UserError(f"ddp.sync_batchnorm: expected true, false or auto, got {plain['ddp']['sync_batchnorm']!r}")
    if plain["ddp"]["sync_batchnorm"] and trainer["device"] != "cuda":
        raise UserError("ddp.sync_batchnorm=true needs GPUs (this torch's DDP refuses SyncBatchNorm on the CPU); "
                        "set it false, or train with trainer.device=cuda")
    if str(trainer["precision"]) == "16" and trainer["device"] != "cuda":
        raise UserError("trainer.precision=16 needs a GPU (fp16 autocast with a GradScaler); on the CPU use bf16")
    for key, value in [(f"trainer.{k}", trainer[k]) for k in ("epochs", "log_every", "accumulate", "max_steps")] + [
        ("checkpoint.keep", plain["checkpoint"]["keep"]), ("checkpoint.every_n_steps", plain["checkpoint"]["every_n_steps"])
    ]:
        if value is not None and value < 1:
            raise UserError(f"{key} must be at least 1 (or null where allowed), got {value}")
    _check_workflow(plain)
    for name, logger in (plain.get("logger") or {}).items():
        if logger and "mlflow" in str(logger.get("_target_", "")).lower() and importlib.util.find_spec("mlflow") is None:
            raise UserError(f"logger={name} needs MLflow, which is not installed: pip install -e '.[mlflow]'")
    if not data_cfg["even_shards"]:
        if trainer["accumulate"] > 1:
            raise UserError("data.even_shards=false does not combine with trainer.accumulate > 1 "
                            "(ranks end their epoch at different batches); use one or the other")
        if trainer["compile"]:
            raise UserError("data.even_shards=false does not combine with trainer.compile=true (DDP's Join "
                            "wraps the uncompiled model); use one or the other")
        if plain["ddp"]["sync_batchnorm"]:
            raise UserError("data.even_shards=false does not combine with ddp.sync_batchnorm=true (Join cannot "
                            "stand in for SyncBatchNorm's collectives); use one or the other")
    if launcher["nnodes"] > 1 and plain["init_method"]["name"] != "env":
        raise UserError("across nodes the ranks meet through torchrun's rendezvous: use init_method=env")
    if plain["init_method"]["name"] == "file" and launcher.get("max_restarts"):
        raise UserError("a restarted group cannot reuse a file:// store: use init_method=env or tcp with restarts")


def collective_timeout(value: Any, backend: str) -> int:
    """dist.timeout_s: auto is 600 s where NCCL runs (its ranks may wait for a dead peer until then), else 1800 s."""
    if value == "auto":
        return 600 if "nccl" in backend else 1800
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise UserError(f"dist.timeout_s must be a whole number of seconds (or auto), got {value!r}")
    return value


def _resolve_monitor(trainer: dict[str, Any], data_cfg: dict[str, Any]) -> None:
    """The monitored metric must exist; without validation (data.val_fraction=0) a val/ metric has no
    values, and nothing is monitored."""
    name = trainer["monitor"]
    if name is not None and name not in monitor.METRICS:
        raise UserError(f"trainer.monitor={name!r} is not a metric of this run; choose one of "
                        f"{', '.join(monitor.METRICS)} (or null)")
    if trainer["monitor_mode"] not in ("auto", "min", "max"):
        raise UserError(f"trainer.monitor_mode must be auto, min or max, got {trainer['monitor_mode']!r}")
    fraction = data_cfg["val_fraction"]
    if not 0 <= fraction < 1:
        raise UserError(f"data.val_fraction must be in [0, 1), got {fraction}")
    if fraction == 0 and name is not None and name.startswith("val/"):
        trainer["monitor"] = None


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
        raise UserError(f"trainer.max_time={value!r}: give seconds (e.g. 3600) or [D:]HH:MM:SS (e.g. 00:12:00:00)")
    return seconds


def _check_workflow(plain: dict[str, Any]) -> None:
    """Validation, selection, early stopping, clipping and fine-tuning settings."""
    trainer = plain["trainer"]
    stopping = trainer["early_stopping"]
    if stopping["patience"] is not None:
        if stopping["patience"] < 1:
            raise UserError(f"trainer.early_stopping.patience must be at least 1 (or null: off), got {stopping['patience']}")
        if trainer["monitor"] is None:
            raise UserError("trainer.early_stopping needs a monitored metric: set trainer.monitor (without validation, "
                            "data.val_fraction=0, only train/loss has values)")
        if not trainer["eval_every_epoch"]:
            raise UserError("trainer.early_stopping needs a validation every epoch: set trainer.eval_every_epoch=true")
    if stopping["min_delta"] < 0:
        raise UserError(f"trainer.early_stopping.min_delta must be 0 or more, got {stopping['min_delta']}")
    if trainer["grad_clip"] is not None and not trainer["grad_clip"] > 0:
        raise UserError(f"trainer.grad_clip must be positive (or null: no clipping), got {trainer['grad_clip']}")
    if trainer["init_from"]:
        checkpoint.check_init(plain["model"], Path(trainer["init_from"]), list(trainer["init_ignore"]))


def _resolve_batch_size(data_cfg: dict[str, Any], world_size: int) -> None:
    """Per-rank batch from data.batch_size, or data.global_batch_size ÷ world size (one or the other)."""
    per_rank, total = data_cfg["batch_size"], data_cfg["global_batch_size"]
    if per_rank is not None and total is not None:
        raise UserError(
            f"data.batch_size={per_rank} (per rank) and data.global_batch_size={total} exclude each other: "
            "set one and leave the other null"
        )
    if total is not None:
        if total < 1 or total % world_size:
            raise UserError(
                f"data.global_batch_size={total} does not divide by the world size {world_size}: "
                f"choose a multiple of {world_size}, or set the per-rank data.batch_size instead"
            )
        per_rank = total // world_size
    per_rank = DEFAULT_BATCH_SIZE if per_rank is None else per_rank
    if per_rank < 1:
        raise UserError(f"data.batch_size must be at least 1, got {per_rank}")
    data_cfg.update(batch_size=per_rank, global_batch_size=per_rank * world_size)


def _device(name: str, host: distributed.Host) -> str:
    if name == "auto":
        return "cuda" if host.cuda else "cpu"
    if name == "cuda" and not host.cuda:
        raise UserError("trainer.device=cuda but CUDA is not available here; use trainer.device=cpu (or auto)")
    if name not in ("cpu", "cuda"):
        raise UserError(f"trainer.device must be auto, cpu or cuda, got {name!r}")
    return name


def _nproc(value: Any, device: str, host: distributed.Host) -> int:
    if value == "auto":
        return host.gpus if device == "cuda" else 2
    if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
        return value
    raise UserError(f"trainer.nproc must be a positive integer or auto, got {value!r}")


def _check_launcher(launcher: dict[str, Any]) -> None:
    name = launcher["name"]
    if name == "spawn":
        if launcher["nnodes"] != 1:
            raise UserError("launcher=spawn runs on one node; use launcher=torchrun for launcher.nnodes > 1")
    elif name == "torchrun":
        if launcher["nnodes"] < 1 or not 0 <= launcher["node_rank"] < launcher["nnodes"]:
            raise UserError(
                f"launcher.node_rank={launcher['node_rank']} must be in [0, launcher.nnodes={launcher['nnodes']})"
            )
        if launcher["nnodes"] > 1 and not (launcher["rdzv_endpoint"] and launcher["rdzv_id"]):
            raise UserError(
                "a multi-node launcher=torchrun needs launcher.rdzv_endpoint=HOST:PORT (node 0) and the same "
                "launcher.rdzv_id on every node"
            )
        # A single node's rendezvous endpoint is the launching process's own store (launch.py).
        launcher["rdzv_id"] = launcher["rdzv_id"] or uuid.uuid4().hex[:12]
    else:
        raise UserError(f"unknown launcher {name!r}; choose spawn or torchrun")
    method, available = launcher["start_method"], [m for m in startup.START_METHODS if m in mp.get_all_start_methods()]
    if method not in available:
        raise UserError(f"launcher.start_method={method!r} is not available here; choose {' or '.join(available)}")


def _resolve_init_method(init: dict[str, Any], run_dir: Path, external: bool) -> None:
    """Where the ranks meet. env: MASTER_ADDR and MASTER_PORT where exported (an outside launcher's,
    or the user's), else init_method.host and a port the launching process binds (port null: a free
    one); tcp: init_method.host and port; file: a fresh file in the run directory unless given."""
    name = init["name"]
    if name not in distributed.INIT_METHODS:
        raise UserError(f"unknown init_method {name!r}; choose {', '.join(distributed.INIT_METHODS)}")
    if name == "env" and "MASTER_PORT" in os.environ:
        port = os.environ["MASTER_PORT"]
        if not port.isdigit() or not 0 < int(port) < 65536:
            raise UserError(f"MASTER_PORT={port!r} (exported) is not a port; export a number in 1-65535, or unset it")
        init.update(host=os.environ.get("MASTER_ADDR") or init["host"], port=int(port), port_from="MASTER_PORT")
    elif name in ("env", "tcp") and init["port"] is None and external:
        needs = ("MASTER_ADDR and MASTER_PORT exported (rank 0's host, a free port), or init_method.port (and "
                 "init_method.host), the same on every rank" if name == "env" else
                 "init_method.port (and init_method.host: rank 0's host), the same on every rank")
        raise UserError(f"init_method={name} under this launcher needs {needs}")
    elif name == "file":
        if init["path"] is None:
            if external:
                raise UserError("init_method=file under an outside launcher needs init_method.path, shared by all ranks")
            init["path"] = str(RunDir(run_dir).rendezvous_store)
        path = Path(init["path"]).expanduser().resolve()
        if path.exists() and path.stat().st_size > 0:
            raise UserError(
                f"init_method.path {str(path)!r} is a leftover store from another run (not empty): "
                "reusing it can deadlock; delete it or point init_method.path at a new file"
            )
        if not path.parent.is_dir():
            raise UserError(f"init_method.path: directory {str(path.parent)!r} does not exist")
        init["path"] = str(path)


def _check_target(node: Any, key: str) -> None:
    """The `_target_` imports and takes the configured arguments (the object is not built)."""
    if not isinstance(node, dict) or "_target_" not in node:
        raise UserError(f"{key} needs a _target_ (the class or function that builds it)")
    target = _locate(node["_target_"], key)
    kwargs = {k: v for k, v in node.items() if not k.startswith("_")}
    try:
        signature = inspect.signature(target)
    except (TypeError, ValueError):
        return  # some builtins have no signature: they are checked when built
    try:
        signature.bind_partial(**kwargs)
    except TypeError as e:
        raise UserError(f"{key} ({node['_target_']}): {e}; fix the key in conf/{key}/ or on the command line") from None


def _locate(path: str, key: str) -> Any:
    """The object named by a dotted path, or a UserError naming the part that fails."""
    parts = path.split(".")
    for split in range(len(parts) - 1, 0, -1):
        module_name = ".".join(parts[:split])
        try:
            obj = importlib.import_module(module_name)
        except ModuleNotFoundError as e:
            if e.name and module_name.startswith(e.name) and split > 1:
                continue  # maybe a class attribute path; try a shorter module
            raise UserError(f"{key}._target_={path!r}: cannot import {module_name!r} ({e})") from None
        try:
            for attr in parts[split:]:
                obj = getattr(obj, attr)
            return obj
        except AttributeError:
            raise UserError(f"{key}._target_={path!r}: {module_name!r} has no {'.'.join(parts[split:])!r}") from None
    raise UserError(f"{key}._target_={path!r} is not a dotted path such as package.module.Name")


def dry_build(plain: dict[str, Any]) -> None:
    """train.py --check: what a worker builds before its first step, without a process group: the
    datasets, the model on the meta device (no memory, any size), one batch of two samples through
    it and the loss, the optimizer and the schedule. What fails is one line."""
    import torch.nn.functional as F
    from hydra.utils import instantiate
    from torch.utils.data import default_collate

    cfg = OmegaConf.create(plain)
    model_and_data = f"{groups.chosen('model', cfg.model)} with {groups.chosen('data', cfg.data.dataset)}"
    with _one_line(f"{model_and_data} does not build and run one batch (checked on the meta device)"):
        with torch.device("meta"):
            model = instantiate(cfg.model)
        if not cfg.data.dataset.get("download", False):  # a download is the run's to make
            train = data.build_datasets(cfg.data, RankInfo(0, 1, 0, 1), cfg.trainer.seed)["train"]
            x, y = default_collate([train[i] for i in range(min(2, len(train)))])
            loss = F.cross_entropy(model(x.to("meta")), y.to("meta"))
            if loss.dim() != 0:
                raise UserError(f"{model_and_data}: the loss of one batch has shape {tuple(loss.shape)}, not a scalar")
    with _one_line(f"{groups.chosen('optim', cfg.optim)} does not build on the model's parameters"):
        optimizer = instantiate(cfg.optim)(model.parameters())
    if cfg.scheduler:
        with _one_line(f"{groups.chosen('scheduler', cfg.scheduler)} does not build on the optimizer"):
            instantiate(cfg.scheduler)(optimizer)


@contextlib.contextmanager
def _one_line(what: str) -> Iterator[None]:
    """What a worker would fail with inside, as one UserError line that says `what` failed."""
    try:
        yield
    except UserError:
        raise
    except Exception as error:  # noqa: BLE001
        while error.__cause__ is not None:  # Hydra's InstantiationException wraps the real cause
            error = error.__cause__  # type: ignore[assignment]
        raise UserError(f"{what}: {type(error).__name__}: {str(error).strip().splitlines()[0] if str(error).strip() else ''}") from None
