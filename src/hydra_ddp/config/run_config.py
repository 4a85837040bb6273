"""The run's config in its two forms: Requested, as composed (an `auto` still allowed), and
RunConfig, the resolved one: typed, read-only, every `auto` the launch settles settled.

The launch side composes (Hydra checks the composition against `schema.Config`), makes it a
Requested (`requested`: dataclasses, built without checking again, read-only), settles it
(`resolve.settle`: each step computes values, and `amended` makes a new config that holds them;
nothing is assigned), then `resolved` makes the RunConfig from it, checked against the resolved
types once (a world size is an int there, a time limit seconds, DDP's switches true or false). The
launcher hands the RunConfig to every worker as it is; the loop, the summary and the checkpoint
read its attributes; nothing assigns to it (an assignment raises).
"""

from __future__ import annotations

import copy
import functools
import typing
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any, Optional

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from hydra_ddp.config import schema, strategy_settings
from hydra_ddp.config.section import Section
from hydra_ddp.errors import UserError

# what the workers run: train.py's, eval.py's, the tuner's short runs
JOBS = ("train", "eval", "tune")


@dataclass
class RequestedLauncherConf(schema.LauncherConf):
    # Started by torchrun, Slurm or mpirun: this command launched nothing.
    external: bool = False
    # The fewest nodes (nnodes: the most); below nnodes: an elastic run (parallel.elastic).
    min_nodes: Optional[int] = None


@dataclass
class RunLauncherConf(RequestedLauncherConf):
    nnodes: int = 1  # the most nodes (an elastic range's MAX; min_nodes its MIN)


@dataclass
class RunBackendConf(schema.BackendConf):
    timeout_s: int = 1800  # seconds (auto settled: 600 with NCCL, else 1800)


@dataclass
class RunTrainerConf(schema.TrainerConf):
    # Settled: the workers per node, and the time limit in seconds. Left open: `compile`, false or
    # a mode's name (the schema's types take no union; its domain is checked), and channels_last,
    # which stays `auto` where only the workers can build the model that settles it.
    nproc: int = 1
    max_time: Optional[float] = None


@dataclass
class RunInitMethodConf(schema.InitMethodConf):
    # The setting that named the port (an exported MASTER_PORT, say), for the line when it is taken.
    port_from: str = "init_method.port"
    # The stores this command holds on a single node, one per torchrun attempt (launch.workers).
    ports: Optional[list[int]] = None


@dataclass
class SweepConf(Section):
    dir: str = ""  # the multirun's directory (loggers group a sweep's jobs by it)
    job: int = 0


@dataclass
class EvalJobConf(Section):
    """eval.py's job: what it evaluates, and where that checkpoint stood."""

    ckpt: str = ""
    split: str = "test"
    predict: bool = False
    step: int = 0
    epoch: int = 0


@dataclass
class Requested(Section):
    """The config as composed, with the launch's own fields, while `resolve.settle` settles it (an
    `auto` allowed; read-only like the RunConfig: each step of the settling makes a new one). The
    composition-time sections whose keys moved (dist, ddp) are gone."""

    backend: schema.BackendConf = field(default_factory=schema.BackendConf)
    init_method: RunInitMethodConf = field(default_factory=RunInitMethodConf)
    launcher: RequestedLauncherConf = field(default_factory=RequestedLauncherConf)
    trainer: schema.TrainerConf = field(default_factory=schema.TrainerConf)
    checkpoint: schema.CheckpointConf = field(default_factory=schema.CheckpointConf)
    # the chosen strategy's settings
    strategy: Any = field(default_factory=lambda: {"name": strategy_settings.DEFAULT})
    profiler: schema.ProfilerConf = field(default_factory=schema.ProfilerConf)
    data: schema.DataConf = field(default_factory=schema.DataConf)
    trial: schema.TrialConf = field(default_factory=schema.TrialConf)
    task: Any = None
    model: Any = None
    optim: Any = None
    param_groups: schema.ParamGroupsConf = field(default_factory=schema.ParamGroupsConf)
    scheduler: Any = None
    logger: Any = field(default_factory=dict)
    job: str = "train"  # one of JOBS
    # The fast settings that were `auto`, and what the launch side (or, for what needs the device,
    # the worker) settled them to.
    settled: dict[str, Any] = field(default_factory=dict)
    sweep: Optional[SweepConf] = None
    # Keys set on the command line (a sweep trial's) with their values as settled on this node:
    # every worker logs them beside the config's fingerprint.
    overridden: dict[str, Any] = field(default_factory=dict)
    eval: Optional[EvalJobConf] = None


@dataclass
class RunConfig(Requested):
    """The resolved config: the sections whose `auto` the launch settles, in their settled types
    (the strategy's: strategy_settings.resolved_of)."""

    backend: RunBackendConf = field(default_factory=RunBackendConf)
    launcher: RunLauncherConf = field(default_factory=RunLauncherConf)
    trainer: RunTrainerConf = field(default_factory=RunTrainerConf)


SECTIONS = tuple(f.name for f in fields(RunConfig))


@functools.lru_cache(maxsize=1)
def _template() -> DictConfig:
    """The schema as a config, made once a process (half of typed's time)."""
    return OmegaConf.structured(RunConfig)


def requested(plain: dict[str, Any]) -> Requested:
    """The composed config made plain, as the Requested the launch settles, read-only from here:
    each step of the settling makes a new one (amended). Built field by field, not checked: Hydra
    checked the composition against the schema, and `resolved` checks what the settling made of
    it. A key the schema does not have is one line. `plain` itself is left as it was."""
    return _built(Requested, copy.deepcopy(plain), "").freeze()


def _built(cls: type, plain: Any, where: str) -> Any:
    """`plain` (a dict) as dataclass `cls`, its sections' dicts as theirs; other values as given."""
    if not isinstance(plain, dict):
        raise UserError(f"{where.rstrip('.') or 'the config'}: a section, not {plain!r}")
    unknown = sorted(set(plain) - {f.name for f in fields(cls)})
    if unknown:
        raise UserError(f"the config does not fit the schema: {where}{unknown[0]} is not a key")
    values = {}
    for name, value in plain.items():
        kind = _section_of(cls, name) if value is not None else None
        if name == "strategy" and cls is Requested:
            kind = strategy_settings.of(value.get("name", strategy_settings.DEFAULT))
        values[name] = _built(kind, value, f"{where}{name}.") if kind else value
    return cls(**values)


@functools.cache
def _section_of(cls: type, name: str) -> Optional[type]:
    """The Section class field `name` of `cls` holds (Optional[...] too), or None."""
    hint = typing.get_type_hints(cls)[name]
    for kind in (hint, *typing.get_args(hint)):
        if isinstance(kind, type) and issubclass(kind, Section):
            return kind
    return None


def resolved(cfg: Requested) -> RunConfig:
    """The settled Requested as the read-only RunConfig, checked against the resolved types: a
    setting still `auto` there is one line naming it."""
    return freeze(thaw(cfg))


def typed(plain: dict[str, Any]) -> RunConfig:
    """A resolved config made plain (the launch's, a checkpoint's) as a RunConfig, not yet frozen;
    its strategy section as the chosen strategy's resolved settings. A key or value the resolved
    schema does not take is one line (a checkpoint's config from another version, say)."""
    if plain.get("job", "train") not in JOBS:
        raise UserError(f"job={plain['job']!r}: one of {', '.join(JOBS)}")
    strategy = plain.get("strategy", {})
    settings = strategy_settings.resolved_of(strategy.get("name", strategy_settings.DEFAULT))
    run = _merged(_template(), {k: v for k, v in plain.items() if k != "strategy"}, "")
    return replace(run, strategy=_merged(OmegaConf.structured(settings), strategy, "strategy."))


def _merged(template: DictConfig, plain: dict[str, Any], where: str) -> Any:
    """`plain` on the schema `template`, as its dataclass; a key or value it does not take is one
    line naming it (`where`: the section's place in the whole config)."""
    try:
        return OmegaConf.to_object(OmegaConf.merge(template, plain))
    except OmegaConfBaseException as error:
        key = f"{where}{error.full_key}: " if getattr(error, "full_key", None) else where
        raise UserError(
            f"the resolved config does not fit the schema: {key}{str(error).splitlines()[0]}"
        ) from None


def freeze(plain: dict[str, Any]) -> RunConfig:
    """The settled plain config as the typed, read-only RunConfig the workers receive."""
    return typed(plain).freeze()


def amended(node: Section, values: dict[str, Any]) -> Any:
    """A new read-only config (or section): `node` with these dotted keys' values, sharing its
    sections that keep theirs. What the launch learns after resolving (the job, the sweep, the
    stores it holds) makes a new config this way: `node` itself never changes."""
    top: dict[str, Any] = {}
    deeper: dict[str, dict[str, Any]] = {}
    for key, value in values.items():
        head, _, rest = key.partition(".")
        if rest:
            deeper.setdefault(head, {})[rest] = value
        else:
            top[head] = value
    for head, inner in deeper.items():
        top[head] = amended(getattr(node, head), inner)
    return replace(node, **top).freeze()


def thaw(cfg: Requested) -> dict[str, Any]:
    """A plain copy of the config (what a checkpoint, a summary or a logger records)."""
    return asdict(cfg)


def lookup(cfg: RunConfig, key: str) -> Any:
    """The value at a dotted key (`data.batch_size`) of a typed config."""
    node = cfg
    for part in key.split("."):
        node = node[part] if isinstance(node, dict) else getattr(node, part)
    return node


def as_run(cfg: RunConfig, found: dict[str, Any]) -> dict[str, Any]:
    """The config made plain with what the workers found (dotted keys: the settings they settled,
    an elastic run's batch): what a checkpoint records, and eval.py and a resumed run read back."""
    plain = thaw(cfg)
    for key, value in found.items():
        *parents, last = key.split(".")
        node = plain
        for part in parents:
            node = node[part]
        node[last] = value
    return plain
