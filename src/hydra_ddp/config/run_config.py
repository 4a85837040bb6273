"""The run's config in its one final form: a typed, read-only RunConfig, every `auto` settled.

The launch side composes (Hydra, onto `schema.Config`), settles and checks once (`resolve`), then
`freeze` makes this object: dataclasses all the way down (the strategy's section its own settings
class). The launcher hands it to every worker as it is; the loop, the summary and the checkpoint
read its attributes; nothing assigns to it (an assignment raises).
"""

from __future__ import annotations

import functools
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
class RunLauncherConf(schema.LauncherConf):
    # Started by torchrun, Slurm or mpirun: this command launched nothing.
    external: bool = False
    # The fewest nodes (nnodes: the most); below nnodes: an elastic run (parallel.elastic).
    min_nodes: Optional[int] = None


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
class RunConfig(Section):
    """The resolved config. The composition-time sections whose keys moved (dist, ddp) are gone."""

    backend: schema.BackendConf = field(default_factory=schema.BackendConf)
    init_method: RunInitMethodConf = field(default_factory=RunInitMethodConf)
    launcher: RunLauncherConf = field(default_factory=RunLauncherConf)
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


SECTIONS = tuple(f.name for f in fields(RunConfig))


@functools.lru_cache(maxsize=1)
def _template() -> DictConfig:
    """The schema as a config, made once a process (half of typed's time)."""
    return OmegaConf.structured(RunConfig)


def typed(plain: dict[str, Any]) -> RunConfig:
    """A plain config (the resolved one, a checkpoint's) as a RunConfig, not yet frozen; its
    strategy section as the chosen strategy's settings. A key or value the schema does not take is
    one line (a checkpoint's config from another version, say)."""
    if plain.get("job", "train") not in JOBS:
        raise UserError(f"job={plain['job']!r}: one of {', '.join(JOBS)}")
    try:
        cfg = OmegaConf.merge(_template(), {k: v for k, v in plain.items() if k != "strategy"})
        settings = strategy_settings.of(
            plain.get("strategy", {}).get("name", strategy_settings.DEFAULT)
        )
        strategy = OmegaConf.merge(OmegaConf.structured(settings), plain.get("strategy", {}))
    except OmegaConfBaseException as error:
        where = f"{error.full_key}: " if getattr(error, "full_key", None) else ""
        raise UserError(
            f"the resolved config does not fit the schema: {where}{str(error).splitlines()[0]}"
        ) from None
    run = OmegaConf.to_object(cfg)
    run.strategy = OmegaConf.to_object(strategy)
    return run  # type: ignore[return-value]


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


def thaw(cfg: RunConfig) -> dict[str, Any]:
    """A plain copy of the resolved config (what a checkpoint, a summary or a logger records)."""
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
