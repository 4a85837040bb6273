"""The schema and the parent's validation: bad input fails before any process starts, with one clear
line (composed and resolved in this process; tests/e2e/test_config.py: a tracker's missing package,
from train.py)."""

from __future__ import annotations

import pickle
import typing
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException
from omegaconf.errors import ValidationError

from hydra_ddp.config import run_config
from hydra_ddp.config.schema import register_schema
from hydra_ddp.config.strategy_settings import DDPSettings
from hydra_ddp.errors import UserError
from hydra_ddp.launch import resolve
from hydra_ddp.rundir import RunDir
from hydra_ddp.runtime.ranks import RankInfo

from support import REPO, compose_cfg, resolved

register_schema()


@pytest.mark.parametrize(
    "overrides",
    [
        ["backend=gloo", "init_method=tcp", "launcher=torchrun"],
        ["backend=auto", "init_method=file", "launcher=spawn"],
        ["model=mlp", "optim=adam", "scheduler=cosine"],
        ["model=resnet18", "optim=adamw", "scheduler=none", "data=synthetic"],
        ["model=torchvision", "model.name=mobilenet_v3_small"],
        ["debug=fast", "launcher=torchrun"],
        ["debug=overfit", "logger=[csv]"],
        ["debug=profile", "debug=anomaly"],
        ["+experiment=digits_cnn", "logger=[tensorboard]"],
    ],
)
def test_every_group_option_composes_and_validates(tmp_path: Path, overrides: list[str]):
    plain = resolved(tmp_path, *overrides)
    assert plain.backend.name == "gloo"  # no CUDA here
    assert plain.trainer.nproc == 2 and plain.trainer.device == "cpu"
    # the one form the launcher hands every worker
    frozen = run_config.freeze(run_config.thaw(plain))
    assert _holds(run_config.thaw(frozen), run_config.thaw(plain))  # every settled value, as it was


def _holds(whole: dict, part: dict) -> bool:
    """`whole` has every key of `part` with the same value (a frozen config adds the schema's
    defaults)."""
    return all(
        key in whole
        and (
            _holds(whole[key], value) if isinstance(value, dict) and value else whole[key] == value
        )
        for key, value in part.items()
    )


def test_the_requested_config_is_read_only_and_settling_computes_new_ones(tmp_path: Path):
    requested = run_config.requested(resolve.plain_config(compose_cfg("data.batch_size=16")))
    before = run_config.thaw(requested)
    with pytest.raises(AttributeError, match="read-only; make a new one"):
        requested.trainer.nproc = 2
    with pytest.raises(AttributeError, match="read-only"):
        requested.strategy.static_graph = True
    settled = resolve.settle(requested, tmp_path, None)
    assert run_config.thaw(requested) == before  # nothing was assigned into it
    assert (requested.trainer.nproc, settled.trainer.nproc) == ("auto", 2)
    assert (requested.trainer.accumulate, settled.trainer.accumulate) == (None, 1)
    assert settled.data.global_batch_size == 32 and requested.data.global_batch_size is None
    assert settled.strategy.static_graph is True and requested.strategy.static_graph == "auto"
    # a section the settling did not change is the same object, shared
    assert settled.optim is requested.optim and settled.profiler is requested.profiler


def test_the_resolved_config_is_typed_and_read_only(tmp_path: Path):
    cfg = resolved(tmp_path).freeze()
    assert isinstance(cfg, run_config.RunConfig) and isinstance(cfg.strategy, DDPSettings)
    assert cfg.trainer.nproc == 2 and cfg.job == "train"
    with pytest.raises(AttributeError, match="read-only"):
        cfg.trainer.epochs = 3
    with pytest.raises(AttributeError, match="read-only"):
        cfg.data.batch_size = 3
    with pytest.raises(AttributeError, match="read-only"):
        cfg.strategy.static_graph = True
    assert pickle.loads(pickle.dumps(cfg)) == cfg  # as the launcher sends it to every worker
    with pytest.raises(AttributeError, match="read-only"):
        pickle.loads(pickle.dumps(cfg)).trainer.epochs = 3
    # What the workers found is recorded beside it (a checkpoint's config as run), not set in it.
    recorded = run_config.as_run(cfg, {"data.batch_size": 16, "trainer.channels_last": False})
    assert recorded["data"]["batch_size"] == 16 and recorded["trainer"]["channels_last"] is False
    assert cfg.data.batch_size == 32 and cfg.trainer.channels_last is not False
    plain = run_config.thaw(resolved(tmp_path))
    plain["trainer"]["epochs"] = "many"  # a value of the wrong type: one line, not a traceback
    with pytest.raises(UserError, match="does not fit the schema.*epochs"):
        run_config.freeze(plain)
    with pytest.raises(UserError, match="does not fit the schema"):
        run_config.freeze({**run_config.thaw(resolved(tmp_path)), "surprise": 1})
    with pytest.raises(UserError, match="job='fit'"):
        run_config.freeze({**run_config.thaw(resolved(tmp_path)), "job": "fit"})


@pytest.mark.parametrize(
    "overrides",
    [[], ["trainer.max_time=00:01:30", "backend.timeout_s=90", "launcher=torchrun"]],
    ids=["defaults", "given"],
)
def test_what_the_launch_settles_has_its_type_in_the_resolved_config(
    tmp_path: Path, overrides: list[str]
):
    """Requested → resolved: a setting that may say `auto` (or a time as text) in the schema has
    its one type once resolved, and the resolved types refuse what the settling would have left."""
    cfg = resolved(tmp_path, *overrides)
    assert type(cfg) is run_config.RunConfig
    concrete = {
        "trainer.nproc": int,
        "launcher.nnodes": int,
        "backend.timeout_s": int,
        "trainer.max_time": (float, type(None)),
        "strategy.gradient_as_bucket_view": bool,
        "strategy.static_graph": bool,
        "strategy.shared_memory": bool,
        "strategy.sync_batchnorm": bool,
    }
    for key, kind in concrete.items():
        value = run_config.lookup(cfg, key)
        assert isinstance(value, kind), f"{key}={value!r}"
        section, name = key.split(".")
        hint = typing.get_type_hints(type(getattr(cfg, section)))[name]
        assert hint is not typing.Any, f"{key} is typed Any in the resolved config"
    if overrides:
        assert cfg.trainer.max_time == 90.0 and cfg.backend.timeout_s == 90
    for key in ("trainer.nproc", "backend.timeout_s", "strategy.static_graph"):
        plain = run_config.thaw(cfg)
        section, name = key.split(".")
        plain[section][name] = "auto"  # what a settling that forgot one would leave
        with pytest.raises(UserError, match=f"does not fit the schema: {key}"):
            run_config.freeze(plain)
    # The requested form takes what composing gives, `auto` included, and no unknown key.
    with pytest.raises(UserError, match="does not fit the schema: trainer.surprise is not a key"):
        run_config.requested({"trainer": {"nproc": "auto", "surprise": 1}})
    with pytest.raises(UserError, match="trainer: a section, not 5"):
        run_config.requested({"trainer": 5})
    composed = {"trainer": {"nproc": "auto", "hooks": []}}
    assert run_config.requested(composed).trainer.nproc == "auto"
    assert run_config.requested(composed).trainer.hooks is not composed["trainer"]["hooks"]


def test_defaults_leave_ports_to_the_launch_and_make_a_fresh_store(tmp_path: Path):
    # No port is picked here: the launching process binds port 0 itself and holds it (race-free).
    env = resolved(tmp_path).init_method
    assert env.name == "env" and env.port is None
    store = resolved(tmp_path, "init_method=file").init_method
    assert store.path == str(RunDir(tmp_path).rendezvous_store)
    torchrun = resolved(tmp_path, "launcher=torchrun").launcher
    assert torchrun.rdzv_endpoint is None and torchrun.rdzv_id


@pytest.mark.parametrize(
    "overrides, world, micro, accumulate",
    [
        ([], 2, resolve.DEFAULT_BATCH_SIZE, 1),
        (["data.batch_size=16"], 2, 16, 1),
        (["trainer.accumulate=3"], 2, resolve.DEFAULT_BATCH_SIZE, 3),
        (["data.global_batch_size=128"], 1, 128, 1),
        (["data.global_batch_size=128"], 2, 64, 1),
        (["data.global_batch_size=128"], 4, 32, 1),
        # The global batch includes the accumulation: given with the micro-batch, it settles the
        # accumulation; given with the accumulation, the micro-batch.
        (["data.global_batch_size=128", "data.batch_size=16"], 2, 16, 4),
        (["data.global_batch_size=128", "data.batch_size=16"], 4, 16, 2),
        (["data.global_batch_size=128", "trainer.accumulate=2"], 2, 32, 2),
        (["data.global_batch_size=128", "data.batch_size=32", "trainer.accumulate=2"], 2, 32, 2),
    ],
)
def test_the_global_batch_is_micro_batch_times_accumulation_times_replicas(
    tmp_path: Path, overrides, world: int, micro: int, accumulate: int
):
    cfg = resolved(tmp_path, f"trainer.nproc={world}", *overrides)
    assert (cfg.data.batch_size, cfg.trainer.accumulate) == (micro, accumulate)
    assert cfg.data.global_batch_size == micro * accumulate * world


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["trainer.nproc=3", "data.global_batch_size=128"],
            r"data.global_batch_size=128 does not divide by trainer.accumulate=1 × 3 "
            r"model replicas: choose a multiple of 3, or set data.batch_size instead",
        ),
        (
            ["data.batch_size=24", "data.global_batch_size=64"],
            r"data.global_batch_size=64 does not divide into micro-batches "
            r"of data.batch_size=24 on 2 model replicas: choose a multiple "
            r"of 48, or set trainer.accumulate instead of data.batch_size",
        ),
        (
            ["data.batch_size=32", "data.global_batch_size=64", "trainer.accumulate=2"],
            r"data.global_batch_size=64 is not data.batch_size=32 × trainer.accumulate=2 "
            r"× 2 model replicas \(128\): set two of the three, and the third follows",
        ),
        (["data.batch_size=0"], "at least 1"),
        (["trainer.accumulate=0"], "at least 1"),
    ],
)
def test_bad_batch_sizes_are_refused_before_launch(tmp_path: Path, overrides, message: str):
    with pytest.raises(UserError, match=message):
        resolved(tmp_path, *overrides)


def test_self_comes_after_the_groups_and_before_the_presets():
    # conf/config.yaml lists _self_ after the groups it chooses and before the presets: a group's
    # option gives its values, a preset (debug=) or an experiment (+experiment=) overrides them, and
    # the command line overrides everything (Hydra #346 and 1.1's change of _self_'s default place).
    assert compose_cfg().trainer.max_steps is None and compose_cfg().optim.lr == 0.02  # optim=sgd's
    assert compose_cfg("debug=fast").trainer.max_steps == 6  # the preset over the schema's default
    # the experiment over optim=adamw's
    assert compose_cfg("+experiment=text_gpt").optim.lr == 0.006
    # the command line over both
    assert compose_cfg("+experiment=text_gpt", "optim.lr=0.1").optim.lr == 0.1
    assert compose_cfg("debug=fast", "trainer.max_steps=9").trainer.max_steps == 9


def test_misspelt_key_fails_at_composition():
    with pytest.raises(ConfigCompositionException, match="nprocs"):
        compose_cfg("trainer.nprocs=2")


@pytest.mark.parametrize(
    "override, line",
    [
        (
            "trainer.epoch=3",
            "trainer.epoch: no such key in the config; did you mean trainer.epochs?",
        ),
        ("optim.lrr=0.1", "optim.lrr: no such key in the config; did you mean optim.lr?"),
        (
            "trainer.nprocs=2",
            "trainer.nprocs: no such key in the config; did you mean trainer.nproc?",
        ),
        # nothing near: the general line, which says how to add a key
        ("trainer.colour=red", "trainer.colour: no such key in the config (misspelt?); "),
    ],
)
def test_a_misspelt_key_is_one_line_naming_the_nearest_key(override, line):
    from hydra_ddp.launch import composition

    with pytest.raises(ConfigCompositionException) as raised:
        compose_cfg(override)
    assert composition.one_line(raised.value).startswith(line)


def test_wrong_type_fails_at_composition():
    with pytest.raises((ConfigCompositionException, ValidationError), match="epochs"):
        compose_cfg("trainer.epochs=many")


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["trainer.nproc=0"], "trainer.nproc"),
        (["strategy=tp"], "tensor-parallel plan"),  # the CNN has none
        (["strategy=tp", "data=text", "model=gpt", "trainer.nproc=3"], "do not split over 3"),
        (["strategy=fsdp", "strategy.comm_hook=bf16"], "strategy=fsdp has no such setting"),
        (["strategy=fsdp", "data.even_shards=false"], "Join"),
        (["strategy=fsdp", "trainer.channels_last=true"], "non-contiguous"),
        (["strategy=fsdp", "strategy.cpu_offload=true"], "cpu_offload"),
        (["trainer.precision=16"], "bf16"),
        (["trainer.precision=8"], "precision"),
        (["trainer.accumulate=0"], "accumulate"),
        (["trainer.nproc=two"], "trainer.nproc"),
        (["backend=nccl"], "nccl"),
        (["backend=mpi"], "MPI"),
        (["backend=nccl", "trainer.device=cuda"], "CUDA"),
        (["model._target_=nowhere.Model"], "nowhere"),
        (["optim.lr=0.1", "+optim.lrr=3"], "lrr"),
        (["data=imagefolder"], "must be set"),
        (["data=mnist", "data.dataset.root=/no/such/dir"], "/no/such/dir"),
        (["launcher=spawn", "launcher.nnodes=2"], "torchrun"),
        (["launcher=torchrun", "launcher.nnodes=2"], "rdzv_endpoint"),
        (["data.even_shards=false", "trainer.accumulate=2"], "even_shards"),
        (["data.even_shards=false", "trainer.compile=true"], "even_shards"),
        (["strategy.sync_batchnorm=true", "trainer.device=cpu"], "needs GPUs"),
        (["strategy.static_graph=true", "trainer.accumulate=2"], "static_graph=auto or false"),
        (
            ["trainer.channels_last=sometimes"],
            "trainer.channels_last='sometimes': choose one of auto, true, false",
        ),
        (
            ["launcher.start_method=fork"],
            "launcher.start_method='fork': choose one of forkserver, spawn",
        ),
        (["strategy.comm_hook=topk"], "choose one of none, fp16, bf16, powersgd"),
        (
            ["strategy.comm_hook=powersgd", "strategy.powersgd.rank=0"],
            "strategy.powersgd.rank=0: give a whole number, at least 1",
        ),
        (["strategy.comm_hook=fp16", "data.even_shards=false"], "even_shards"),
        (
            ["strategy.shared_memory=true", "strategy.comm_hook=bf16"],
            "shared_memory=true does not combine with strategy.comm_hook",
        ),
        (["strategy.shared_memory=true", "strategy=fsdp"], "strategy=fsdp"),
        (["strategy.shared_memory=maybe"], "choose one of auto, true, false"),
        (["trainer.monitor=val/acc"], "val/loss, val/accuracy, train/loss"),
        (["trainer.monitor_mode=maximum"], "choose one of auto, min, max"),
        (["data.val_fraction=1.0"], "data.val_fraction=1.0: give a number, at least 0 and below 1"),
        (["trainer.early_stopping.patience=0"], "at least 1"),
        (["trainer.early_stopping.patience=3", "trainer.monitor=null"], "needs a monitored metric"),
        (["trainer.early_stopping.patience=3", "data.val_fraction=0"], "only train/loss"),
        (
            ["trainer.early_stopping.patience=3", "trainer.eval_every_epoch=false"],
            "validation every epoch",
        ),
        (["trainer.grad_clip=0"], "trainer.grad_clip=0.0: give a number, above 0"),
        (["trainer.max_time=soon"], "HH:MM:SS"),
        (["trainer.init_from=/no/such/run"], "no checkpoint file or run directory"),
        (["strategy.sync_batchnorm=maybe"], "choose one of auto, true, false"),
        (["data=cifar10", "data.dataset.root=/tmp"], "lacks data_batch_1"),
    ],
)
def test_bad_config_is_one_clear_error(tmp_path: Path, overrides: list[str], message: str):
    if "backend=nccl" in overrides and torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    if "backend=mpi" in overrides and dist.is_mpi_available():
        pytest.skip("this torch has MPI")
    with pytest.raises(UserError, match=message) as info:
        resolved(tmp_path, *overrides)
    assert "\n" not in str(info.value)


def test_leftover_file_store_is_refused(tmp_path: Path):
    store = tmp_path / "old.store"
    store.write_bytes(b"leftover")
    with pytest.raises(UserError, match="leftover"):
        resolved(tmp_path, "init_method=file", f"init_method.path={store}")
    assert store.read_bytes() == b"leftover"  # refused, not deleted
    (tmp_path / "empty.store").touch()  # an empty file is a fine place to meet
    resolved(tmp_path, "init_method=file", f"init_method.path={tmp_path / 'empty.store'}")


def test_external_launch_takes_world_size_from_the_launcher(tmp_path: Path, monkeypatch):
    monkeypatch.setenv("MASTER_PORT", "29999")  # as torchrun sets it
    plain = resolved(
        tmp_path,
        external=("torchrun", RankInfo(rank=1, world_size=4, local_rank=1, local_world_size=2)),
    )
    assert plain.launcher.name == "torchrun" and plain.launcher.external
    assert plain.trainer.nproc == 2 and plain.launcher.nnodes == 2
    with pytest.raises(UserError, match="same on every rank"):
        resolved(tmp_path, "init_method=tcp", external=("torchrun", RankInfo(0, 2, 0, 2)))
    monkeypatch.delenv("MASTER_PORT")
    # mpirun sets no MASTER_PORT: env:// has nothing to read, and the line says what to export (or
    # use tcp).
    with pytest.raises(
        UserError, match="MASTER_ADDR and MASTER_PORT exported .*, or init_method.port"
    ):
        resolved(tmp_path, external=("mpirun", RankInfo(0, 2, 0, 2)))


def test_validation_settings_resolve(tmp_path: Path):
    plain = resolved(tmp_path, "trainer.max_time=00:01:30:00")
    assert plain.trainer.max_time == 5400 and plain.trainer.monitor == "val/accuracy"
    assert resolved(tmp_path, "trainer.max_time=90").trainer.max_time == 90
    assert resolved(tmp_path, "data.val_fraction=0").trainer.monitor is None  # nothing to monitor
    assert (
        resolved(tmp_path, "data.val_fraction=0", "trainer.monitor=train/loss").trainer.monitor
        == "train/loss"
    )


def test_an_optuna_search_must_optimise_the_monitor_in_its_direction():
    from hydra_ddp.sweeps import trials

    def search(*overrides):
        with initialize_config_dir(config_dir=str(REPO / "conf"), version_base=None):
            return compose(
                config_name="config",
                overrides=["hparams_search=digits", *overrides],
                return_hydra_config=True,
            )

    assert trials.check_search(search()) is None
    assert (
        trials.check_search(search("trainer.monitor=val/loss", "hydra.sweeper.direction=minimize"))
        is None
    )
    assert "set hydra.sweeper.direction=minimize" in trials.check_search(
        search("trainer.monitor=val/loss")
    )
    assert "set it" in trials.check_search(search("trainer.monitor=null"))


def test_an_error_of_ours_is_its_message_and_anothers_keeps_its_type():
    from hydra_ddp.errors import UserError, first_line

    assert first_line(UserError("data=documents needs tokenizers\nmore")) == (
        "data=documents needs tokenizers"
    )
    assert first_line(ValueError("dim (30) must be a multiple")) == (
        "ValueError: dim (30) must be a multiple"
    )
    assert first_line(UserError("")) == "UserError: "
