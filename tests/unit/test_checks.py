"""Config resolution and checks as pure functions: each bad setting of a composed config fails in
one line naming the key, with no process started: one composition, then plain dicts resolved."""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hydra import compose, initialize_config_dir

from hydra_ddp.blueprint import of
from hydra_ddp.config import run_config
from hydra_ddp.config.schema import register_schema
from hydra_ddp.errors import UserError
from hydra_ddp.hooks import Hook, wrong_events
from hydra_ddp.launch import resolve
from hydra_ddp.parallel import strategies

from support import REPO

register_schema()


@pytest.fixture(scope="module")
def base() -> dict[str, Any]:
    """The default config as composed, made plain (not yet settled), once."""
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base=None):
        return resolve.plain_config(compose(config_name="config"))


def setting(path: str, value: Any) -> Callable[[dict], None]:
    def apply(plain: dict) -> None:
        *parents, key = path.split(".")
        node = plain
        for part in parents:
            node = node[part]
        node[key] = value

    apply.__name__ = f"{path}={value!r}"
    return apply


def strategy(name: str) -> Callable[[dict], None]:
    """strategy=NAME as Hydra composes it: that strategy's own settings, their defaults."""

    def apply(plain: dict) -> None:
        plain["strategy"] = dataclasses.asdict(strategies.get(name).Settings())

    apply.__name__ = f"strategy={name}"
    return apply


def both(*changes: Callable[[dict], None]) -> Callable[[dict], None]:
    def apply(plain: dict) -> None:
        for change in changes:
            change(plain)

    apply.__name__ = " ".join(change.__name__ for change in changes)
    return apply


# An elastic run of one to two nodes of two ranks with a global batch of 64: fine as it stands.
ELASTIC = (
    setting("launcher.name", "torchrun"),
    setting("launcher.nnodes", "1:2"),
    setting("launcher.max_restarts", 2),
    setting("launcher.rdzv_endpoint", "node0:29400"),
    setting("launcher.rdzv_id", "job"),
    setting("data.global_batch_size", 64),
)

BAD = [
    (setting("trainer.precision", "8"), "trainer.precision='8': choose one of 32, bf16, 16"),
    (setting("trainer.precision", "16"), "trainer.precision=16 needs a GPU"),
    (
        setting("trainer.channels_last", "yes"),
        "trainer.channels_last='yes': choose one of auto, true, false",
    ),
    (
        setting("strategy.static_graph", 2),
        "strategy.static_graph=2: choose one of auto, true, false",
    ),
    (
        setting("strategy.comm_hook", "int8"),
        "strategy.comm_hook='int8': choose one of none, fp16, bf16, powersgd",
    ),
    (
        both(setting("strategy.comm_hook", "fp16"), setting("data.even_shards", False)),
        "does not combine with data.even_shards=false",
    ),
    (
        both(setting("strategy.comm_hook", "powersgd"), setting("strategy.powersgd.rank", 0)),
        "strategy.powersgd.rank=0: give a whole number, at least 1",
    ),
    (
        both(setting("strategy.static_graph", True), setting("trainer.accumulate", 2)),
        "strategy.static_graph=true does not combine",
    ),
    (
        both(setting("strategy.shared_memory", True), setting("strategy.comm_hook", "bf16")),
        "strategy.shared_memory=true does not combine",
    ),
    (
        setting("strategy.sync_batchnorm", "maybe"),
        "strategy.sync_batchnorm='maybe': choose one of auto, true, false",
    ),
    (setting("strategy.sync_batchnorm", True), "strategy.sync_batchnorm=true needs GPUs"),
    (setting("trainer.epochs", 0), "trainer.epochs=0: give a whole number, at least 1"),
    (setting("trainer.log_every", 0), "trainer.log_every=0: give a whole number, at least 1"),
    (setting("trainer.accumulate", 0), "trainer.accumulate=0: give a whole number, at least 1"),
    (setting("trainer.max_steps", -3), "trainer.max_steps=-3: give a whole number, at least 1"),
    (setting("checkpoint.keep", 0), "checkpoint.keep=0: give a whole number, at least 1"),
    (
        setting("checkpoint.every_n_steps", 0),
        "checkpoint.every_n_steps=0: give a whole number, at least 1",
    ),
    (
        setting("trainer.early_stopping.patience", 0),
        "trainer.early_stopping.patience=0: give a whole number, at least 1",
    ),
    (
        both(setting("trainer.early_stopping.patience", 2), setting("trainer.monitor", None)),
        "needs a monitored metric",
    ),
    (
        both(
            setting("trainer.early_stopping.patience", 2),
            setting("trainer.eval_every_epoch", False),
        ),
        "needs a validation every epoch",
    ),
    (
        setting("trainer.early_stopping.min_delta", -1.0),
        "trainer.early_stopping.min_delta=-1.0: give a number, at least 0",
    ),
    (setting("trainer.grad_clip", 0.0), "trainer.grad_clip=0.0: give a number, above 0"),
    (
        both(setting("data.even_shards", False), setting("trainer.accumulate", 2)),
        "data.even_shards=false does not combine with trainer.accumulate",
    ),
    (
        both(setting("data.even_shards", False), setting("trainer.compile", True)),
        "data.even_shards=false does not combine with trainer.compile",
    ),
    (setting("model._target_", "hydra_ddp.models.Nope"), "model._target_='hydra_ddp.models.Nope'"),
    (
        setting("model.no_such_argument", 3),
        "takes no 'no_such_argument': remove it with '~model.no_such_argument'",
    ),
    (
        setting("optim._target_", "nowhere.at_all.SGD"),
        "optim._target_='nowhere.at_all.SGD': cannot import",
    ),
    (setting("optim", {"lr": 0.1}), "optim needs a _target_"),
    (
        setting("strategy.name", "zero3"),
        "strategy.name='zero3': choose one of ddp, fsdp, tp, fsdp_tp",
    ),
    (
        both(strategy("fsdp"), setting("strategy.param_dtype", "fp8")),
        "strategy.param_dtype='fp8': choose one of bf16, fp16, fp32",
    ),
    (
        both(strategy("fsdp"), setting("data.even_shards", False)),
        "strategy=fsdp: data.even_shards=false needs DDP's Join",
    ),
    # The CNN names no blocks: true compiles it whole, which only DDP takes.
    (
        both(strategy("fsdp"), setting("trainer.compile", True)),
        "strategy=fsdp: trainer.compile=model compiles",
    ),
    (setting("trainer.compile", "blocks"), "trainer.compile=blocks compiles the model's blocks"),
    (
        setting("trainer.compile", "yes"),
        "trainer.compile='yes': choose one of false, true, blocks, model",
    ),
    (
        both(strategy("fsdp"), setting("trainer.channels_last", True)),
        "strategy=fsdp: trainer.channels_last=true",
    ),
    (
        both(strategy("fsdp"), setting("strategy.cpu_offload", True)),
        "strategy=fsdp: strategy.cpu_offload=true",
    ),
    (
        both(strategy("fsdp"), setting("strategy.param_dtype", "fp16")),
        "strategy=fsdp: strategy.param_dtype=fp16",
    ),
    (
        both(strategy("fsdp"), setting("strategy.reduce_dtype", "fp16")),
        "strategy=fsdp: strategy.reduce_dtype=fp16",
    ),
    (
        both(strategy("fsdp"), setting("trainer.precision", "16")),
        "strategy=fsdp: trainer.precision=16",
    ),
    (
        both(strategy("fsdp"), setting("strategy.replicate", 3)),
        "strategy=fsdp: strategy.replicate=3 does not divide "
        "the 2 ranks (trainer.nproc × launcher.nnodes)",
    ),
    (
        both(strategy("fsdp"), setting("strategy.replicate", 0)),
        "strategy.replicate=0: give a whole number, at least 1",
    ),
    (strategy("tp"), "strategy=tp needs a model with a tensor-parallel plan"),
    (
        both(
            setting("launcher.name", "torchrun"),
            setting("launcher.nnodes", 2),
            setting("launcher.rdzv_endpoint", "node0:29400"),
            setting("launcher.rdzv_id", "job"),
            setting("init_method.name", "tcp"),
        ),
        "across nodes the ranks meet through torchrun",
    ),
    (setting("launcher.nnodes", 2), "launcher=spawn runs on one node"),
    (
        both(setting("init_method.name", "file"), setting("launcher.max_restarts", 2)),
        "cannot reuse a file:// store",
    ),
    # Elastic ranges (launcher.nnodes=MIN:MAX).
    (
        both(setting("launcher.name", "torchrun"), setting("launcher.nnodes", "3:2")),
        "launcher.nnodes=3:2: the range MIN:MAX needs 1 <= MIN <= MAX",
    ),
    (
        both(setting("launcher.name", "torchrun"), setting("launcher.nnodes", "two")),
        "launcher.nnodes='two': give a node count (2) or an elastic range",
    ),
    (setting("launcher.nnodes", "1:2"), "launcher=spawn runs on one node"),
    (
        both(*ELASTIC, setting("launcher.max_restarts", 0)),
        "(elastic): set launcher.max_restarts to 1 or more",
    ),
    (
        both(*ELASTIC, setting("data.global_batch_size", None)),
        "(elastic) needs data.global_batch_size",
    ),
    (
        both(*ELASTIC, setting("strategy.static_graph", True)),
        "strategy.static_graph=true does not combine with "
        "trainer.accumulate > 1 (an elastic run accumulates",
    ),
    (
        both(*ELASTIC, setting("launcher.nnodes", "2:3")),
        "data.global_batch_size=64 does not divide by trainer.accumulate=1 × 6 model replicas",
    ),
    (
        # Settled at the most nodes (a micro-batch of 8), the global batch does not divide at 3
        # replicas.
        both(*ELASTIC, setting("launcher.nnodes", "1:3"), setting("data.global_batch_size", 48)),
        "data.global_batch_size=48 does not divide into micro-batches of data.batch_size=8 "
        "on the 4 model replicas of world size 4, which launcher.nnodes=1:3 allows",
    ),
    (
        both(*ELASTIC, strategy("fsdp_tp"), setting("strategy.tp_size", 4)),
        "strategy.tp_size=4 does not divide the world size 2",
    ),
    # Tasks.
    (
        setting("trainer.monitor", "val/r2"),
        "trainer.monitor='val/r2' is not a metric of this "
        "task; choose one of val/loss, val/accuracy, train/loss",
    ),
    (setting("task._target_", "torch.nn.Identity"), "is not a hydra_ddp.tasks.Task: subclass it"),
    # Every group that builds an object by _target_: its name imports, its keys are the builder's.
    (
        setting("task._target_", "hydra_ddp.tasks.Nope"),
        "task._target_='hydra_ddp.tasks.Nope': 'hydra_ddp.tasks' has no 'Nope'",
    ),
    (
        setting("task._target_", "nowhere.Task"),
        "task._target_='nowhere.Task': cannot import 'nowhere'",
    ),
    (
        setting("task.no_such_argument", 1),
        "task (hydra_ddp.tasks.Classification) takes no 'no_such_argument'",
    ),
    (setting("task", {"ignore_index": 1}), "task needs a _target_"),
    (
        setting("data.dataset._target_", "hydra_ddp.data.nope"),
        "data.dataset._target_='hydra_ddp.data.nope'",
    ),
    (
        setting("scheduler._target_", "torch.optim.lr_scheduler.Nope"),
        "scheduler._target_='torch.optim.lr_scheduler.Nope'",
    ),
    (
        setting("scheduler.no_such_argument", 1),
        "scheduler (torch.optim.lr_scheduler.StepLR) takes no 'no_such_argument': "
        "remove it with '~scheduler.no_such_argument'",
    ),
    (setting("optim.no_such_argument", 1), "optim (torch.optim.SGD) takes no 'no_such_argument'"),
    (
        setting("logger.csv._target_", "hydra_ddp.reporting.loggers.Nope"),
        "logger.csv._target_='hydra_ddp.reporting.loggers.Nope'",
    ),
    (
        setting("logger.extra", {"_target_": "nowhere.Logger"}),
        "logger.extra._target_='nowhere.Logger': cannot import",
    ),
    (
        setting("logger.csv.no_such_argument", 1),
        "logger.csv (hydra_ddp.reporting.loggers.CSV) takes no 'no_such_argument'",
    ),
    (setting("param_groups.no_decay", "biases"), "param_groups.no_decay='biases': none, auto"),
    (
        setting("param_groups.no_decay", []),
        "param_groups.no_decay=[]: give one or more name patterns",
    ),
    (
        setting("param_groups.no_decay", ["*.bias", "*.gamma"]),
        "param_groups.no_decay: *.gamma names none of the model's parameters (conv1.weight,",
    ),
    (
        both(
            setting(
                "scheduler",
                {"_target_": "hydra_ddp.recipe.schedules.warmup_cosine", "_partial_": True},
            ),
            setting("scheduler.warmup_steps", 40),
            setting("trainer.max_steps", 30),
        ),
        "scheduler=warmup_cosine: a warmup of 40 steps "
        "is not shorter than the run's 30 optimizer steps",
    ),
    (
        setting("strategy.activation_checkpointing", "full"),
        "strategy.activation_checkpointing=full needs a model that names its blocks",
    ),
    (
        setting("strategy.activation_checkpointing", "half"),
        "strategy.activation_checkpointing='half': choose one",
    ),
    (
        setting("trainer.ema.decay", 1.0),
        "trainer.ema.decay=1.0: give a number, above 0 and below 1",
    ),
    (
        setting("trainer.hooks", [{"_target_": "collections.OrderedDict"}]),
        "trainer.hooks[0]: collections.OrderedDict is not a subclass of hydra_ddp.hooks.Hook",
    ),
    (
        setting("trainer.hooks", [{"_target_": "no_such_package.Hook"}]),
        "trainer.hooks[0]._target_='no_such_package",
    ),
    (setting("trainer.hooks", [{"every": 2}]), "trainer.hooks[0] needs a _target_"),
    (
        setting("trainer.step", {"_target_": "collections.OrderedDict"}),
        "trainer.step: collections.OrderedDict is not a subclass of hydra_ddp.training.step.Step",
    ),
    (
        setting("trainer.step", {"_target_": "hydra_ddp.training.step.Step", "head_lr": 0.1}),
        "trainer.step (hydra_ddp.training.step.Step) takes no 'head_lr'",
    ),
]


@pytest.mark.parametrize("change, message", BAD, ids=[change.__name__ for change, _ in BAD])
def test_a_bad_setting_is_one_line_naming_it(base: dict, tmp_path: Path, change, message: str):
    plain = copy.deepcopy(base)
    change(plain)
    with pytest.raises(UserError) as error:
        resolve.resolve(plain, tmp_path, None)
    assert message in str(error.value) and "\n" not in str(error.value)


def test_an_elastic_range_settles_its_bounds_and_resumes_at_each_restart(
    base: dict, tmp_path: Path
):
    plain = copy.deepcopy(base)
    both(*ELASTIC)(plain)
    resolved = resolve.resolve(plain, tmp_path, None)
    launcher = resolved.launcher
    assert (launcher.min_nodes, launcher.nnodes, resolved.trainer.resume) == (1, 2, "auto")
    # at the most nodes
    assert resolved.data.global_batch_size == 64 and resolved.data.batch_size == 16
    # At one node it accumulates 2 micro-batches of 16: no static graph (DDP's reducer asserts on
    # no_sync).
    assert (
        resolved.strategy.static_graph is False
        and resolved.settled["strategy.static_graph"] is False
    )
    fixed = resolve.resolve(copy.deepcopy(base), tmp_path, None).launcher
    assert (fixed.min_nodes, fixed.nnodes) == (1, 1)


def test_the_default_config_passes_every_check(base: dict, tmp_path: Path):
    resolved = resolve.resolve(copy.deepcopy(base), tmp_path, None)
    assert "auto" not in [
        resolved.trainer.nproc,
        resolved.trainer.device,
        resolved.backend.timeout_s,
        resolved.trainer.channels_last,
        resolved.strategy.sync_batchnorm,
    ]
    assert set(resolved.settled) == {
        "trainer.channels_last",
        "strategy.gradient_as_bucket_view",
        "strategy.static_graph",
        "strategy.shared_memory",
    }  # the defaults' autos, each settled once, here


def test_the_resolved_config_is_typed_and_read_only_as_resolve_returns_it(
    base: dict, tmp_path: Path
):
    frozen = resolve.resolve(copy.deepcopy(base), tmp_path, None)
    assert isinstance(frozen, run_config.RunConfig)
    # the chosen strategy's own settings
    assert isinstance(frozen.strategy, strategies.get("ddp").Settings)
    for section, key in (("trainer", "epochs"), ("strategy", "comm_hook"), ("data", "batch_size")):
        with pytest.raises(AttributeError, match="read-only"):
            setattr(getattr(frozen, section), key, 1)
    with pytest.raises(AttributeError, match="read-only"):
        frozen.job = "eval"
    # What the launch learns later (the stores it holds, the job) makes a new config, read-only
    # too, sharing the sections that keep their values; the resolved one stays as it was.
    later = run_config.amended(
        frozen, {"job": "tune", "init_method.ports": [29500], "strategy.powersgd.start_step": 0}
    )
    assert (later.job, later.init_method.ports, later.strategy.powersgd.start_step) == (
        "tune",
        [29500],
        0,
    )
    assert (frozen.job, frozen.init_method.ports) == ("train", None)
    assert later.trainer is frozen.trainer and later.init_method is not frozen.init_method
    with pytest.raises(AttributeError, match="read-only"):
        later.init_method.port = 1
    # a checkpoint's copy reads back the same
    assert run_config.freeze(run_config.thaw(frozen)) == frozen


@pytest.mark.parametrize(
    "name, world, tp_size, replicas, tp",
    [
        ("ddp", 8, 2, 8, 1),
        ("fsdp", 8, 2, 8, 1),
        ("tp", 8, 2, 1, 8),
        ("fsdp_tp", 8, 2, 4, 2),
        ("fsdp_tp", 6, 3, 2, 3),
    ],
)
def test_each_strategy_says_how_many_replicas_it_makes(name, world, tp_size, replicas, tp):
    chosen = strategies.get(name)
    settings = chosen.Settings(**({"tp_size": tp_size} if name == "fsdp_tp" else {}))
    assert chosen.replicas(settings, world) == replicas
    assert chosen.tp_size(settings, world) == tp


def test_a_tp_size_that_does_not_divide_the_world_is_refused():
    chosen = strategies.get("fsdp_tp")
    with pytest.raises(UserError, match="strategy.tp_size=3 does not divide the world size 8"):
        chosen.replicas(chosen.Settings(tp_size=3), 8)


@pytest.mark.parametrize("device, expected", [("cuda", True), ("cpu", False)])
def test_sync_batchnorm_auto_is_ddps_to_settle_and_no_other_strategy_has_it(
    base: dict, device: str, expected: bool
):
    cfg = run_config.requested(base)
    cfg = run_config.amended(cfg, {"trainer.device": device, "strategy.sync_batchnorm": "auto"})
    values, settled = strategies.get("ddp").settle(cfg, world=2, local_world=2)
    assert (
        values["strategy.sync_batchnorm"] is expected and "strategy.sync_batchnorm" not in settled
    )
    assert cfg.strategy.sync_batchnorm == "auto"  # a value computed, the config as it was
    for name in ("fsdp", "tp", "fsdp_tp"):
        assert "sync_batchnorm" not in {
            f.name for f in dataclasses.fields(strategies.get(name).Settings)
        }


def test_each_strategy_refuses_only_what_it_cannot_do(base: dict):
    cfg = run_config.amended(run_config.requested(base), {"trainer.compile": "model"})
    strategies.get("ddp").check(cfg, of(cfg.model, cfg.task).model)  # DDP compiles it whole
    fsdp = run_config.requested({**base, "strategy": {"name": "fsdp"}})
    fsdp = run_config.amended(fsdp, {"trainer.compile": "model"})
    with pytest.raises(
        UserError, match="strategy=fsdp: trainer.compile=model compiles the DDP model whole"
    ):
        strategies.get("fsdp").check(fsdp, of(fsdp.model, fsdp.task).model)
    # each block's forward: any strategy
    fsdp = run_config.amended(fsdp, {"trainer.compile": "blocks"})
    strategies.get("fsdp").check(fsdp, of(fsdp.model, fsdp.task).model)


def test_fsdp_tp_is_fsdp_with_a_tensor_parallel_size_and_eval_composes_without_an_optimizer():
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base=None):
        fsdp = resolve.plain_config(compose(config_name="config", overrides=["strategy=fsdp"]))[
            "strategy"
        ]
        both = resolve.plain_config(
            compose(
                config_name="config", overrides=["strategy=fsdp_tp", "strategy.cpu_offload=true"]
            )
        )["strategy"]
        evaluation = compose(config_name="eval", overrides=["ckpt=somewhere"])
    assert both == {**fsdp, "name": "fsdp_tp", "tp_size": 2, "cpu_offload": True}
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base=None):
        # another strategy's knob: one line naming this one's settings
        with pytest.raises(Exception) as other:
            compose(config_name="config", overrides=["strategy=fsdp", "strategy.comm_hook=fp16"])
    from hydra_ddp.launch import composition

    assert composition.one_line(other.value) == (
        "strategy.comm_hook: strategy=fsdp has no such setting (its settings: "
        "replicate, reshard_after_forward, param_dtype, reduce_dtype, output_dtype, "
        "cpu_offload, activation_checkpointing, activation_checkpointing_every); "
        "another strategy's knob does not apply to this one"
    )
    assert (
        "optim" not in evaluation and "scheduler" not in evaluation or evaluation.scheduler is None
    )


def test_a_model_built_only_in_the_workers_leaves_channels_last_to_them_and_they_record_it(
    base: dict, tmp_path: Path, monkeypatch
):
    from torch import nn

    from hydra_ddp import performance

    from support import HELPERS

    monkeypatch.syspath_prepend(str(HELPERS))
    plain = copy.deepcopy(base)
    # asks for its rank as it is built
    plain["model"] = {**plain["model"], "_target_": "faulty.ChaosCNN"}
    resolved = resolve.resolve(plain, tmp_path, None)
    assert (
        resolved.trainer.channels_last == "auto" and "trainer.channels_last" not in resolved.settled
    )
    assert resolve.resolve(copy.deepcopy(base), tmp_path, None).trainer.channels_last is True
    conv, dense = nn.Sequential(nn.Conv2d(1, 2, 3)), nn.Sequential(nn.Linear(2, 2))
    ddp = strategies.get("ddp")
    assert (
        performance.settings(resolved, ddp.fast_settings, conv, allowed=True)[
            "trainer.channels_last"
        ]
        is True
    )
    assert (
        performance.settings(resolved, ddp.fast_settings, dense, allowed=True)[
            "trainer.channels_last"
        ]
        is False
    )
    as_run = run_config.as_run(
        resolved, performance.settings(resolved, ddp.fast_settings, conv, True)
    )  # what the worker's checkpoints record: the value used; the config itself says auto
    assert as_run["trainer"]["channels_last"] is True and resolved.trainer.channels_last == "auto"


class TakesTheLoop(Hook):
    """A hook written for the loop's earlier events: the trainer, then values."""

    def step_ended(self, loop: Any, step: int) -> None:
        return None


class TakesOneEvent(Hook):
    def validated(self, event: Any, *rest: Any) -> None:
        return None


def test_a_hook_whose_event_takes_other_than_one_record_is_one_line(base: dict, tmp_path: Path):
    assert wrong_events(TakesTheLoop) == ["step_ended"] and wrong_events(TakesOneEvent) == []
    plain = copy.deepcopy(base)
    setting("trainer.hooks", [{"_target_": f"{__name__}.TakesTheLoop"}])(plain)
    with pytest.raises(UserError) as error:
        resolve.resolve(plain, tmp_path, None)
    assert str(error.value).startswith(
        f"trainer.hooks[0]: {__name__}.TakesTheLoop.step_ended does not take one event"
    ), error.value
