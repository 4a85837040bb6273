"""Config checks: everything that would fail a run later, found before any worker starts, as one
line; and train.py --check's dry build on the meta device."""

from __future__ import annotations

import contextlib
import importlib.util
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import IterableDataset

from hydra_ddp import blueprint, data, hooks, tasks
from hydra_ddp.checkpoint import files as checkpoints
from hydra_ddp.checkpoint import remote
from hydra_ddp.config import groups, targets
from hydra_ddp.config.run_config import RunConfig
from hydra_ddp.config.schema import DataConf
from hydra_ddp.data import batches
from hydra_ddp.errors import UserError, first_line, root_cause
from hydra_ddp.launch import continuing
from hydra_ddp.parallel import elastic, strategies
from hydra_ddp.recipe import compiling, schedules
from hydra_ddp.recipe import optimizer as optimizers
from hydra_ddp.reporting.flops import run_shapes_only
from hydra_ddp.runtime.ranks import RankInfo

# What trainer.hooks' and trainer.step's targets must subclass (named: the launch side does not
# import the loop).
HOOK = "hydra_ddp.hooks.Hook"
STEP = "hydra_ddp.training.step.Step"


def check(cfg: RunConfig, run_dir: Path) -> None:
    """Everything else that would fail a run later: found before any worker starts."""
    trainer, launcher, data_cfg = cfg.trainer, cfg.launcher, cfg.data
    folder = _checkpoint_folder(cfg, run_dir)
    if trainer.resume is None and checkpoints.in_folder(folder):
        where = "checkpoint.dir" if cfg.checkpoint.dir else "hydra.run.dir"
        raise UserError(
            f"{cfg.checkpoint.dir or run_dir} holds checkpoints of an earlier run; continue it "
            f"with trainer.resume=auto, or start anew in another {where} (nothing was overwritten)"
        )
    source = targets.check(data_cfg.dataset, "data.dataset")
    if isinstance(source, type) and issubclass(source, IterableDataset):
        raise UserError(data.stream_refusal(data_cfg.dataset["_target_"], source.__name__))
    data.check_source(data_cfg)
    targets.check(cfg.model, "model")
    targets.check(cfg.optim, "optim")
    if cfg.scheduler is not None:  # null: a constant learning rate (scheduler=none)
        targets.check(cfg.scheduler, "scheduler")
    for i, hook in enumerate(trainer.hooks):
        _check_hook(hook, f"trainer.hooks[{i}]")
    if trainer.step is not None:
        _check_subclass(trainer.step, "trainer.step", STEP)
    resume = trainer.resume
    if resume not in (None, "auto") and remote.is_url(resume):
        _check_remote_checkpoint(str(resume), "trainer.resume")
    elif resume not in (None, "auto") and not Path(str(resume)).expanduser().exists():
        raise UserError(
            f"trainer.resume={resume}: no checkpoint at "
            f"{str(Path(str(resume)).expanduser().resolve())!r}; give a checkpoint "
            "(checkpoints/step-N.pt, or a sharded step-N directory), or auto"
        )
    _check_continued_length(cfg, folder)
    # torch._dynamo only when asked for
    if trainer.compile_backend != "inductor" or trainer.compile:
        import torch._dynamo

        backends = torch._dynamo.list_backends(exclude_tags=())
        if trainer.compile_backend not in backends:
            raise UserError(
                f"trainer.compile_backend={trainer.compile_backend!r}: choose "
                f"one of torch.compile's backends ({', '.join(backends)})"
            )
    strategies.get(cfg.strategy.name).check(cfg, blueprint.of(cfg.model, cfg.task).model)
    if str(trainer.precision) == "16" and trainer.device != "cuda":
        raise UserError(
            "trainer.precision=16 needs a GPU (fp16 autocast "
            "with a GradScaler); on the CPU use bf16"
        )
    _check_workflow(cfg)
    _check_loading(data_cfg)
    _check_recipe(cfg)
    _check_model_fits_data(cfg)
    world = trainer.nproc * launcher.nnodes
    ranks = cfg.profiler.ranks
    if ranks is not None and not all(isinstance(r, int) and 0 <= r < world for r in ranks):
        raise UserError(
            f"profiler.ranks={list(ranks)}: ranks of this "
            f"run, 0 to {world - 1} (or null: every rank)"
        )
    loggers = cfg.logger
    if loggers is not None and not isinstance(loggers, dict):
        raise UserError(
            f"logger={loggers!r}: name the loggers, e.g. "
            "logger=[tensorboard,csv] (options: conf/logger/)"
        )
    for name, logger in (loggers or {}).items():
        targets.check(logger, f"logger.{name}")
        _check_requires(logger["_target_"], f"logger.{name}", f"logger={name}")
    _check_requires(cfg.model["_target_"], "model", groups.chosen("model", cfg.model))
    data_target = cfg.data.dataset.get("_target_")
    if data_target:
        _check_requires(data_target, "data.dataset", groups.chosen("data", cfg.data.dataset))
    if not data_cfg.even_shards:
        task = blueprint.of(cfg.model, cfg.task).task
        if tasks.weighs_units(task):
            raise UserError(
                f"data.even_shards=false does not combine with task {type(task).__name__}, "
                "whose loss weighs tokens over the whole step (the ranks that run out of "
                "batches would miss its count); keep data.even_shards=true"
            )
        if elastic.most_accumulation(cfg, strategies.replicas_at(cfg)) > 1:
            raise UserError(
                "data.even_shards=false does not combine with trainer.accumulate "
                "> 1, an elastic run's at fewer nodes included (ranks end their "
                "epoch at different batches); use one or the other"
            )
        if trainer.compile == "model":
            raise UserError(
                "data.even_shards=false does not combine with trainer.compile=model (DDP's Join "
                "wraps the uncompiled model); use trainer.compile=blocks, or one or the other"
            )
    if launcher.nnodes > 1 and cfg.init_method.name != "env":
        raise UserError(
            "across nodes the ranks meet through torchrun's rendezvous: use init_method=env"
        )
    if cfg.init_method.name == "file" and launcher.max_restarts:
        raise UserError(
            "a restarted group cannot reuse a file:// "
            "store: use init_method=env or tcp with restarts"
        )


def _check_subclass(node: Any, key: str, base: str) -> None:
    """A `_target_` config (checked as every one is) of a subclass of `base`, a dotted name."""
    target = targets.check(node, key)
    if base not in {f"{c.__module__}.{c.__qualname__}" for c in getattr(target, "__mro__", ())}:
        raise UserError(
            f"{key}: {node['_target_']} is not a subclass of {base} (docs/extending.md)"
        )


def _check_hook(node: Any, key: str) -> None:
    """A Hook subclass whose events each take one event record (hooks.py)."""
    _check_subclass(node, key, HOOK)
    wrong = hooks.wrong_events(targets.check(node, key))
    if wrong:
        raise UserError(
            f"{key}: {node['_target_']}.{wrong[0]} does not take one event: a hook's events "
            f"receive a record (def {wrong[0]}(self, event); hydra_ddp.hooks), not the trainer "
            "(docs/extending.md)"
        )


def _check_model_fits_data(cfg: RunConfig) -> None:
    """A model of the project's own that does not build (a transformers config it refuses, heads
    that do not divide the width) is one line here, not a traceback from every worker; and a
    language model has positions for the data's longest sequence and a row of its embedding for
    every id."""
    target = str(cfg.model.get("_target_", ""))
    try:
        model = blueprint.of(cfg.model, cfg.task).model()
    except UserError:
        raise
    except Exception as error:  # noqa: BLE001
        if target.startswith("hydra_ddp."):
            raise UserError(
                f"{groups.chosen('model', cfg.model)} does "
                f"not build: {first_line(root_cause(error))}"
            ) from None
        # a model of yours that builds only in a worker (it asks for its rank, say): the workers
        # report it
        return
    length, ids = data.text_shape(cfg.data)
    positions = _positions(model)
    if length is not None and positions is not None and length > positions:
        raise UserError(
            f"the data's sequences are up to {length} tokens "
            f"(data.dataset's), and the model has {positions} positions: "
            "shorten the data's sequences, or give the model more positions"
        )
    rows = (
        model.get_input_embeddings().num_embeddings
        if hasattr(model, "get_input_embeddings")
        else None
    )
    if ids is not None and rows is not None and ids > rows:
        raise UserError(
            f"the data's token ids go up to {ids - 1} (a vocabulary of {ids}), "
            f"and the model's embedding has {rows} rows: set the model's "
            f"vocabulary to data.num_classes, and data.num_classes={ids}"
        )


def _positions(model: torch.nn.Module) -> Any:
    """The longest sequence a language model takes: the built-in GPT's context, a transformers
    config's positions; None where the model does not say."""
    config = getattr(model, "config", None)
    for owner, name in (
        (model, "context"),
        (config, "max_position_embeddings"),
        (config, "n_positions"),
    ):
        value = getattr(owner, name, None)
        if isinstance(value, int):
            return value
    return None


def _check_loading(data_cfg: DataConf) -> None:
    """DataLoader settings that only its worker processes use: with none they would do nothing."""
    if data_cfg.num_workers == 0:
        for key, inert in (
            ("persistent_workers", data_cfg.persistent_workers),
            ("prefetch_factor", data_cfg.prefetch_factor is not None),
        ):
            if inert:
                raise UserError(
                    f"data.{key} is for DataLoader worker processes, and data.num_workers=0 "
                    f"starts none: set data.num_workers (e.g. 2), or leave data.{key} unset"
                )


def _check_workflow(cfg: RunConfig) -> None:
    """Validation, selection, early stopping, clipping and fine-tuning settings."""
    trainer = cfg.trainer
    stopping = trainer.early_stopping
    if stopping.patience is not None:
        if trainer.monitor is None:
            raise UserError(
                "trainer.early_stopping needs a monitored metric: set trainer.monitor "
                "(without validation, data.val_fraction=0, only train/loss has values)"
            )
        if not trainer.eval_every_epoch:
            raise UserError(
                "trainer.early_stopping needs a validation "
                "every epoch: set trainer.eval_every_epoch=true"
            )
    if trainer.init_from:
        model = blueprint.of(cfg.model, cfg.task).model()
        checkpoints.check_init(model, Path(trainer.init_from), list(trainer.init_ignore))


def _check_recipe(cfg: RunConfig) -> None:
    """The optimizer's groups and the schedule: settings that name the model's parameters, or a
    length the run must have."""
    no_decay = cfg.param_groups.no_decay
    patterns = no_decay if isinstance(no_decay, (list, tuple)) else None
    if patterns is None and no_decay not in (optimizers.NONE, optimizers.AUTO):
        raise UserError(
            f"param_groups.no_decay={no_decay!r}: none, auto "
            "(biases, norms, embeddings), or a list of the "
            'model\'s parameter-name patterns, e.g. param_groups.no_decay=["*.bias","*norm*"]'
        )
    if patterns is not None:
        if not patterns or not all(isinstance(p, str) and p for p in patterns):
            raise UserError(
                f"param_groups.no_decay={list(patterns)}: give "
                "one or more name patterns (or none, auto)"
            )
        try:
            model = blueprint.of(cfg.model, cfg.task).model()
        except Exception:  # noqa: BLE001  (a model that does not build is the dry build's, or the run's, to report)
            return
        missing = optimizers.unmatched(model, list(patterns))
        if missing:
            names = [name for name, _ in model.named_parameters()]
            raise UserError(
                f"param_groups.no_decay: {', '.join(missing)} names none of the model's "
                f"parameters ({', '.join(names[:4])}{', ...' if len(names) > 4 else ''}); "
                "use its parameters' names"
            )
    if cfg.trainer.compile == "blocks":
        try:
            model = blueprint.of(cfg.model, cfg.task).model()
        except Exception:  # noqa: BLE001  (the dry build's, or the run's, to report)
            model = None
        compiling.check("blocks", model, cfg.model["_target_"])
    if cfg.trainer.max_steps and schedules.takes_length(cfg.scheduler):
        # The run's full length needs its data; trainer.max_steps bounds it now (the workers check
        # the rest).
        optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
        schedules.build(cfg.scheduler, optimizer, cfg.trainer.max_steps)


def _checkpoint_folder(cfg: RunConfig, run_dir: Path) -> Any:
    """checkpoint.dir's folder, a bucket's reachable (its package installed, the bucket there, the
    credentials found), or one line."""
    setting = cfg.checkpoint.dir
    problem = remote.reachable(setting, "checkpoint.dir") if remote.is_url(setting) else None
    if problem:
        raise UserError(problem)
    return checkpoints.folder(setting, run_dir)


def _check_remote_checkpoint(where: str, key: str) -> None:
    problem = remote.reachable(where, key)
    if problem:
        raise UserError(problem)
    checkpoints.read(checkpoints.find(where, key), key)


def _check_continued_length(cfg: RunConfig, folder: Any) -> None:
    """A run continued in its directory (trainer.resume=auto) keeps the length its schedule spans
    (launch/continuing.py says why); the checkpoint it would resume from is the newest that reads,
    as the run's own choice is. A new run from a checkpoint (trainer.resume=PATH elsewhere) has
    the length this command gives it."""
    if cfg.trainer.resume != "auto":
        return
    for path in reversed(checkpoints.in_folder(folder)):
        try:
            saved = checkpoints.read(path, "trainer.resume")["config"]
        except UserError:
            continue  # a damaged one: the run skips it too
        problem = continuing.changed_length(saved, cfg)
        if problem:
            raise UserError(problem)
        return


def _check_requires(target: str, key: str, choice: str) -> None:
    """The packages a target declares it needs (its `requires`: (package, title, install line)s),
    installed: else one line before launch that says how to install them."""
    for package, title, install in getattr(targets.locate(target, key), "requires", ()):
        if importlib.util.find_spec(package) is None:
            raise UserError(
                f"{choice} needs {title} ({package}), which is not installed: {install}"
            )


def dry_build(cfg: RunConfig) -> None:
    """train.py --check: what a worker builds before its first step, without a process group: the
    datasets, the model on the meta device (no memory, any size), one batch of two samples through
    it and the task's loss, the optimizer and the schedule. What fails is one line."""
    model_and_data = (
        f"{groups.chosen('model', cfg.model)} with {groups.chosen('data', cfg.data.dataset)}"
    )
    task = blueprint.of(cfg.model, cfg.task).task
    with _one_line(
        f"{model_and_data} does not build and run one batch (checked on the meta device)"
    ):
        model = blueprint.of(cfg.model, cfg.task).model()
        if not cfg.data.dataset.get("download", False):  # a download is the run's to make
            train = data.build_datasets(cfg.data, RankInfo(0, 1, 0, 1), cfg.trainer.seed)["train"]
            samples = [train[i] for i in range(min(64, len(train)))]
            problem = tasks.misfit(task, tasks.fit_targets(task, samples), cfg.data.num_classes)
            if problem:
                raise UserError(problem)
            batch = batches.collate_for(train)(samples[:2])
            # tensors that disagree on the batch size: one line here, not in a worker
            task.samples(batch)
            # on the CPU, for real, where the model reads its inputs' values
            loss = run_shapes_only(
                blueprint.of(cfg.model, cfg.task),
                lambda built, inputs: tasks.checked_loss(task, built, inputs),
                batches.on_meta(batch),
                batch,
            )
            if loss.dim() != 0:
                raise UserError(
                    f"{model_and_data}: the loss of one batch "
                    f"has shape {tuple(loss.shape)}, not a scalar"
                )
    with _one_line(f"{groups.chosen('optim', cfg.optim)} does not build on the model's parameters"):
        optimizer = optimizers.build(cfg.optim, cfg.param_groups.no_decay, model, model)
    if cfg.scheduler is not None:
        with _one_line(
            f"{groups.chosen('scheduler', cfg.scheduler)} does not build on the optimizer"
        ):
            # the workers' length
            schedules.build(cfg.scheduler, optimizer, cfg.trainer.max_steps or 1_000_000)


@contextlib.contextmanager
def _one_line(what: str) -> Iterator[None]:
    """What a worker would fail with inside, as one UserError line that says `what` failed."""
    try:
        yield
    except UserError:
        raise
    except Exception as error:  # noqa: BLE001
        raise UserError(f"{what}: {first_line(root_cause(error))}") from None
