"""Config checks: everything that would fail a run later, found before any worker starts, as one line; and train.py --check's dry build on the meta device."""

from __future__ import annotations

import contextlib
import importlib.util
from pathlib import Path
from typing import Any, Iterator

import torch
from omegaconf import OmegaConf

from hydra_ddp import checkpoints, data, performance, tasks
from hydra_ddp.config import groups, targets
from hydra_ddp.config.schema import PRECISIONS
from hydra_ddp.errors import UserError, first_line, root_cause
from hydra_ddp.parallel import comm, plans
from hydra_ddp.parallel.distributed import RankInfo
from hydra_ddp.rundir import RunDir


def check(plain: dict[str, Any], run_dir: Path) -> None:
    """Everything else that would fail a run later: found before any worker starts."""
    trainer, launcher, data_cfg = plain["trainer"], plain["launcher"], plain["data"]
    if trainer["resume"] is None and checkpoints.step_checkpoints(RunDir(run_dir).checkpoints):
        raise UserError(
            f"{run_dir} holds checkpoints of an earlier run; continue it with trainer.resume=auto, "
            "or start anew in another hydra.run.dir (nothing was overwritten)"
        )
    data.check_source(data_cfg["dataset"], data_cfg["num_classes"])
    targets.check(data_cfg["dataset"], "data.dataset")
    targets.check(plain["model"], "model")
    targets.check(plain["optim"], "optim")
    if plain["scheduler"]:
        targets.check(plain["scheduler"], "scheduler")
    if str(trainer["precision"]) not in PRECISIONS:
        raise UserError(f"trainer.precision must be 32, bf16 or 16, got {trainer['precision']!r}")
    ddp = plain["strategy"]  # DDP's knobs are the ddp strategy's
    if ddp["comm_hook"] not in comm.HOOKS:
        raise UserError(f"unknown strategy.comm_hook {ddp['comm_hook']!r}; choose {', '.join(comm.HOOKS)}")
    if ddp["comm_hook"] != "none" and not data_cfg["even_shards"]:
        raise UserError(f"strategy.comm_hook={ddp['comm_hook']} does not combine with data.even_shards=false (Join's "
                        "shadow all-reduces bypass the hook); use one or the other")
    powersgd = ddp["powersgd"]
    if ddp["comm_hook"] == "powersgd" and (powersgd["rank"] < 1 or powersgd["start_step"] < 0):
        raise UserError(f"strategy.powersgd.rank must be 1 or more and strategy.powersgd.start_step 0 or more, got "
                        f"{powersgd['rank']} and {powersgd['start_step']}")
    if plain["strategy"]["static_graph"] is True and trainer["accumulate"] > 1:
        raise UserError("strategy.static_graph=true does not combine with trainer.accumulate > 1 (DDP's reducer fails "
                        "on a no_sync step in a static graph); set strategy.static_graph=auto or false")
    blockers = performance.config_blockers(plain) + ([f"trainer.device={trainer['device']} (it sums CPU tensors)"]
                                                     if trainer["device"] != "cpu" else [])
    if plain["strategy"]["shared_memory"] is True and blockers:
        raise UserError(f"strategy.shared_memory=true does not combine with {'; '.join(blockers)}; "
                        "set strategy.shared_memory=auto or false")
    plans.check(plain)
    if plain["strategy"]["sync_batchnorm"] not in (True, False):
        raise UserError(f"strategy.sync_batchnorm: expected true, false or auto, got {plain['strategy']['sync_batchnorm']!r}")
    if plain["strategy"]["sync_batchnorm"] and trainer["device"] != "cuda":
        raise UserError("strategy.sync_batchnorm=true needs GPUs (this torch's DDP refuses SyncBatchNorm on the CPU); "
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
        target = str((logger or {}).get("_target_", "")).lower()
        targets.check(logger, f"logger.{name}")
        for package, extra, title in (("mlflow", "mlflow", "MLflow"), ("wandb", "wandb", "Weights & Biases")):
            if package in target and importlib.util.find_spec(package) is None:
                raise UserError(f"logger={name} needs {title} ({package}), which is not installed: pip install -e '.[{extra}]'")
    if not data_cfg["even_shards"]:
        if trainer["accumulate"] > 1:
            raise UserError("data.even_shards=false does not combine with trainer.accumulate > 1 "
                            "(ranks end their epoch at different batches); use one or the other")
        if trainer["compile"]:
            raise UserError("data.even_shards=false does not combine with trainer.compile=true (DDP's Join "
                            "wraps the uncompiled model); use one or the other")
        if plain["strategy"]["sync_batchnorm"]:
            raise UserError("data.even_shards=false does not combine with strategy.sync_batchnorm=true (Join cannot "
                            "stand in for SyncBatchNorm's collectives); use one or the other")
    if launcher["nnodes"] > 1 and plain["init_method"]["name"] != "env":
        raise UserError("across nodes the ranks meet through torchrun's rendezvous: use init_method=env")
    if plain["init_method"]["name"] == "file" and launcher.get("max_restarts"):
        raise UserError("a restarted group cannot reuse a file:// store: use init_method=env or tcp with restarts")


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
        checkpoints.check_init(plain["model"], Path(trainer["init_from"]), list(trainer["init_ignore"]))


def dry_build(plain: dict[str, Any]) -> None:
    """train.py --check: what a worker builds before its first step, without a process group: the
    datasets, the model on the meta device (no memory, any size), one batch of two samples through
    it and the task's loss, the optimizer and the schedule. What fails is one line."""
    from hydra.utils import instantiate
    from torch.utils.data import default_collate

    cfg = OmegaConf.create(plain)
    model_and_data = f"{groups.chosen('model', cfg.model)} with {groups.chosen('data', cfg.data.dataset)}"
    task = tasks.build(cfg.task)
    with _one_line(f"{model_and_data} does not build and run one batch (checked on the meta device)"):
        with torch.device("meta"):
            model = instantiate(cfg.model)
        if not cfg.data.dataset.get("download", False):  # a download is the run's to make
            train = data.build_datasets(cfg.data, RankInfo(0, 1, 0, 1), cfg.trainer.seed)["train"]
            problem = tasks.misfit(task, train[0][1], cfg.data.num_classes)
            if problem:
                raise UserError(problem)
            x, y = default_collate([train[i] for i in range(min(2, len(train)))])
            loss = task.loss(model(x.to("meta")), y.to("meta"))
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
        raise UserError(f"{what}: {first_line(root_cause(error))}") from None
