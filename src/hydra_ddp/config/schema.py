"""The config schema: the single source of truth for keys and types.

Hydra merges `conf/*.yaml` onto these dataclasses, so a misspelt key or a value of the
wrong type fails at composition time, before anything is launched. Groups whose objects
are built with `_target_` (model, data.dataset, optim, scheduler) stay open (`Any`) so a
user can add their own in YAML; `hydra_ddp.launch.checks` checks those before launch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Annotated, Any, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, OmegaConf

from hydra_ddp import rundir
from hydra_ddp.config import strategy_settings
from hydra_ddp.config.domains import (
    AUTO_BOOL,
    AtLeast,
    Checked,
    Chosen,
    Free,
    Number,
    OneOf,
    Pattern,
    Positive,
)
from hydra_ddp.config.section import Section


@dataclass
class BackendConf(Section):
    # The process group's backend. auto: nccl when CUDA is available, else gloo.
    name: Annotated[str, OneOf("auto", "gloo", "nccl", "mpi")] = "auto"
    # Collective timeout (seconds): a hung peer fails the others after this long. auto: 600 with
    # NCCL, whose ranks often do not see a dead peer and wait for it until then (torch's own NCCL
    # default; it bounds how long a crashed job holds its GPUs), 1800 with gloo (torch's default: a
    # dead peer is seen at once; only a hung one waits). Raise it for rank-0-only work longer than
    # that between collectives (a download, a huge checkpoint).
    timeout_s: Annotated[Any, AtLeast(1, "auto")] = "auto"


@dataclass
class InitMethodConf(Section):
    # env: the launcher's rendezvous (torchrun's MASTER_ADDR/PORT) where there is one, else a store
    # at host:port, as tcp (on loopback: reachable from this machine only); file: file://path.
    name: Annotated[str, OneOf("env", "tcp", "file")] = "env"
    # tcp and env without a launcher's: the store's address (node 0's, for several nodes)
    host: Annotated[str, Free("a host name or address")] = "127.0.0.1"
    # null: a free port picked at launch, never a fixed one that collides with another job.
    port: Annotated[Optional[int], Number(low=1, high=65535, whole=True)] = None
    # null: a fresh file inside the run directory (a reused file store can deadlock).
    path: Annotated[
        Optional[str], Checked("launch.resolve: its folder exists, the file is empty")
    ] = None


@dataclass
class LauncherConf(Section):
    # spawn: torch.multiprocessing; torchrun: torch.distributed.launcher (elastic, c10d).
    name: Annotated[str, OneOf("spawn", "torchrun")] = "spawn"
    # Nodes: N, or an elastic range "MIN:MAX" (torchrun's form): the run trains with the nodes
    # present between the bounds, restarting the group (from the last checkpoint) when one is lost
    # or joins.
    nnodes: Annotated[Any, Checked("parallel.elastic: a node count or MIN:MAX")] = 1
    # this node's index, 0 to nnodes − 1 (node 0 holds the rendezvous)
    node_rank: Annotated[int, AtLeast(0)] = 0
    # torchrun's rendezvous backend (c10d: torch's own TCP store)
    rdzv_backend: Annotated[str, OneOf("c10d", "static", "etcd", "etcd-v2")] = "c10d"
    # null: 127.0.0.1 with a free port (single node). Multi-node: "host:port" of node 0.
    rdzv_endpoint: Annotated[Optional[str], Pattern(r"[^\s:]+(:\d{1,5})?", "HOST or HOST:PORT")] = (
        None
    )
    # the job's id, the same on every node (null: one made for the run)
    rdzv_id: Annotated[Optional[str], Free("any word, the same on every node")] = None
    # This node's address as the other nodes reach it (null: its hostname's).
    local_addr: Annotated[Optional[str], Free("a host name or address")] = None
    # torchrun: restarts of the whole group after a failure (elastic needs at least 1)
    max_restarts: Annotated[int, AtLeast(0)] = 0
    # torchrun's --rdzv-conf: the rendezvous' own settings (join_timeout, last_call_timeout, ...).
    rdzv_conf: Annotated[dict[str, Any], Free("torchrun's own settings")] = field(
        default_factory=dict
    )
    # torchrun's agent: seconds between its checks of the workers
    monitor_interval: Annotated[float, Positive()] = 0.1
    # forkserver: workers are forks of a process that imported torch while the config was composed
    # (startup.py); spawn: each worker a fresh interpreter that imports everything itself.
    start_method: Annotated[str, OneOf("forkserver", "spawn")] = "forkserver"


@dataclass
class DataConf(Section):
    # Shape of one sample and the label count: models read these through interpolation.
    in_channels: Annotated[int, AtLeast(1)] = 1
    image_size: Annotated[int, AtLeast(1)] = 28  # a sample's height and width
    num_classes: Annotated[int, AtLeast(1)] = 10  # classes (or outputs a sample) the model predicts
    # `_target_` returning (train, test), or (train, val, test) where the source has a validation
    # split.
    dataset: Annotated[Any, Checked("config.targets: a _target_ config")] = MISSING
    # Without a validation split of the source's own: this share of the training set, chosen by
    # trainer.seed (the same on every rank). 0: no validation, nothing is monitored.
    val_fraction: Annotated[float, Number(low=0, high=1, below=True)] = 0.1
    # Samples per micro-batch per rank (per model replica: tensor parallel's ranks share one). With
    # global_batch_size and trainer.accumulate, any two of the three give the third (all three: they
    # must agree; none: 32 per rank, no accumulation).
    batch_size: Annotated[Optional[int], AtLeast(1)] = None
    # Samples per optimizer step over all ranks and micro-batches: batch_size × trainer.accumulate ×
    # model replicas. Set it, and runs at any world size take the same steps; an elastic run keeps
    # it and the micro-batch, and changes the accumulation.
    global_batch_size: Annotated[Optional[int], AtLeast(1)] = None
    eval_batch_size: Annotated[int, AtLeast(1)] = 256  # per rank
    # DataLoader worker processes per rank (0: the rank's own process loads)
    num_workers: Annotated[int, AtLeast(0)] = 0
    pin_memory: bool = False  # DataLoader's pinned host memory, for faster copies to a GPU
    persistent_workers: bool = False  # DataLoader workers kept alive between epochs
    # batches each DataLoader worker loads ahead (null: DataLoader's default)
    prefetch_factor: Annotated[Optional[int], AtLeast(1)] = None
    drop_last: bool = False  # drop each rank's last, smaller training batch
    # Sort training samples by length within windows of this many optimizer steps (each step then
    # holds samples of similar lengths: less padding), the steps of a window in a seeded order; the
    # same at any world size. null: off. For data whose samples know their lengths (data=documents).
    group_by_length: Annotated[Optional[int], AtLeast(1)] = None
    # true: DistributedSampler pads each rank's shard to the same length by repeating samples.
    # false: disjoint shards, every sample once per epoch; DDP's Join matches the collectives of
    # ranks that run out of batches first.
    even_shards: bool = True
    # Keep an in-memory TensorDataset as whole tensors on the training device and slice each
    # batch from them: no per-sample Python work (and no host→device copy per batch on a GPU).
    preload: bool = False
    # Train on this many fixed batches only (the first samples; also the validation split): a
    # pipeline that works must drive their loss to about zero (debug=overfit). null: all data.
    overfit_batches: Annotated[Optional[int], AtLeast(1)] = None


@dataclass
class CheckpointConf(Section):
    # Checkpoints go to <run dir>/checkpoints: step-N.pt, last.pt and best.pt (hard links); under
    # the sharded strategies step-N/ directories of every rank's shards (DCP), last and best
    # (links).
    # Elsewhere: a local path, or object storage's URL (s3://BUCKET/PATH, gs://, az://; its
    # credentials from the store's own variables, never here: docs/storage.md). A run in a new
    # directory with trainer.resume=auto continues from the newest complete checkpoint there.
    dir: Annotated[
        Optional[str], Checked("launch.checks: a folder, or a bucket reachable before launch")
    ] = None
    every_epoch: bool = True  # a checkpoint at the end of every epoch
    # also one every N optimizer steps, mid-epoch too (null: none)
    every_n_steps: Annotated[Optional[int], AtLeast(1)] = None
    keep: Annotated[int, AtLeast(1)] = 3  # step checkpoints kept (last and best are kept besides)
    # best.pt: the checkpoint with the best trainer.monitor value (written whenever it improves).


@dataclass
class ParamGroupsConf(Section):
    # The parameters that get no weight decay (the optimizer's weight_decay goes to the others):
    # none (every parameter decays, as torch's optimizers do); auto (biases, every norm layer's
    # weights and embeddings: the field's default, as nanoGPT's and timm's); or a list of name
    # patterns of the model's own parameter names (fnmatch: ["*.bias", "*norm*"]).
    no_decay: Annotated[Any, Checked("recipe.optimizer: none, auto or a list of name patterns")] = (
        "none"
    )


@dataclass
class EarlyStoppingConf(Section):
    # Stop after this many validations in a row without an improvement of trainer.monitor by more
    # than min_delta (null: never). All ranks stop at the same step: the metric is global.
    patience: Annotated[Optional[int], AtLeast(1)] = None
    # the least change of the monitored value that counts as an improvement
    min_delta: Annotated[float, AtLeast(0, whole=False)] = 0.0


@dataclass
class EmaConf(Section):
    # An exponential moving average of the weights, updated after every optimizer step: ema ←
    # decay·ema + (1 − decay)·weights (e.g. 0.999: about the last 1,000 steps). Validation, best,
    # the test, eval.py and the export use it. null: off.
    decay: Annotated[Optional[float], Number(low=0, high=1, above=True, below=True)] = None


# strategy.*: the settings of the strategy the config names (conf/strategy/NAME.yaml extends them).
CHOSEN_STRATEGY = Chosen("strategy", strategy_settings.SETTINGS)
# The groups that build an object: a `_target_` config (config.targets checks it before launch).
TARGET = Checked("config.targets: a _target_ config")
# trial.pruner and the Optuna sweeper's: Optuna's pruners by name (search/study.py builds them).
PRUNERS = ("median", "hyperband", "none")
# trainer.precision: 32, bf16 (autocast, CPU or GPU) or 16 (GPU autocast with a GradScaler).
PRECISIONS = ("32", "bf16", "16")


@dataclass
class TrainerConf(Section):
    # int, or "auto": the GPU count with CUDA, else 2 (a real 2-process run on any laptop).
    nproc: Annotated[Any, AtLeast(1, "auto")] = "auto"
    # passes over the training set (trainer.max_steps may stop earlier)
    epochs: Annotated[int, AtLeast(1)] = 12
    # Stop after this many optimizer steps (null: run all epochs). For smoke tests and benchmarks.
    max_steps: Annotated[Optional[int], AtLeast(1)] = None
    # the run's seed: the initial weights, the data order, every random stream
    seed: Annotated[int, Number(low=0, high=2**63 - 1, whole=True)] = 0
    # auto: cuda when available, else cpu.
    device: Annotated[str, OneOf("auto", "cpu", "cuda")] = "auto"
    # Intra-op threads per worker; null: cores / local world size.
    threads: Annotated[Optional[int], AtLeast(1)] = None
    # Train loss reaches TensorBoard every step, all-reduced in groups of this many steps.
    log_every: Annotated[int, AtLeast(1)] = 10
    # Validate at the end of every epoch (else once, at the end of training).
    eval_every_epoch: bool = True
    # The one metric that selects best.pt, drives early stopping and is what train.py returns to a
    # Hydra sweeper: val/<a metric of the task> or train/loss. auto: the task's choice (val/accuracy
    # for classification); null: none (the test then uses the last weights).
    monitor: Annotated[Optional[str], Checked("launch.resolve: a metric of the task, or auto")] = (
        "auto"
    )
    # min or max; auto: the metric's direction, as the task declares it.
    monitor_mode: Annotated[str, OneOf("auto", "min", "max")] = "auto"
    early_stopping: EarlyStoppingConf = field(default_factory=EarlyStoppingConf)
    # null: a progress bar when rank 0's stderr is a terminal.
    progress: Optional[bool] = None
    # null: start fresh; a checkpoint path; or auto: the newest good checkpoint in the run
    # directory.
    resume: Annotated[
        Optional[str], Checked("checkpoints: a checkpoint, a run directory, or auto")
    ] = None
    # "32", "bf16" (autocast, CPU or GPU) or "16" (GPU autocast with a GradScaler).
    precision: Annotated[str, OneOf(*PRECISIONS)] = "32"
    # Micro-batches per optimizer step (DDP skips the gradient all-reduce, no_sync, on all but the
    # last). null: 1, or what data.global_batch_size ÷ (data.batch_size × replicas) gives.
    accumulate: Annotated[Optional[int], AtLeast(1)] = None
    # torch.compile (off: compiling takes time a short run does not win back). blocks: each of the
    # model's blocks (any strategy); model: the whole DDP model; true: blocks where the model names
    # them, else the whole model (recipe/compiling.py).
    compile: Annotated[Any, OneOf(False, True, "blocks", "model")] = False
    # torch.compile's backend when trainer.compile is on
    compile_backend: Annotated[str, Checked("launch.checks: one of torch.compile's backends")] = (
        "inductor"
    )
    # channels_last memory format; auto: for models with 2-D convolutions (performance.py).
    channels_last: Annotated[Any, AUTO_BOOL] = "auto"
    ema: EmaConf = field(default_factory=EmaConf)
    # Clip the global gradient norm to this (null: no clipping); logged as train/grad_norm.
    grad_clip: Annotated[Optional[float], Positive()] = None
    # A wall-clock budget (seconds, or "[D:]HH:MM:SS") counted from the command's start: checkpoint,
    # test, and stop; trainer.resume=auto continues. null: none.
    max_time: Annotated[Optional[Any], Checked("launch.resolve: seconds or [D:]HH:MM:SS")] = None
    # Fine-tuning: the model weights of this checkpoint (a file, or a run directory: its best.pt,
    # else last.pt) in a fresh run: new optimizer, schedule and step 0. A resumed run ignores it.
    init_from: Annotated[Optional[str], Checked("checkpoints: a checkpoint or a run directory")] = (
        None
    )
    # Parameters not taken from init_from (names or prefixes, e.g. [fc2]; "head": the last Linear).
    init_ignore: Annotated[
        list[str], Checked("checkpoints.check_init: names or prefixes of the model's")
    ] = field(default_factory=list)
    # torch.profiler on the schedule in `profiler`: one trace per rank in run_dir/profile/
    # (debug=profile).
    profile: bool = False
    # Side jobs on the loop's events, each a `_target_` config of a hydra_ddp.hooks.Hook subclass
    # (docs/extending.md): called on every rank, in this order, after the built-in ones.
    hooks: Annotated[list[Any], Checked("launch.checks: _target_ configs of Hook subclasses")] = (
        field(default_factory=list)
    )
    # The optimizer step's own class: a `_target_` config of a hydra_ddp.training.step.Step subclass
    # (docs/extending.md: two optimizers, say); null: Step.
    step: Annotated[
        Optional[Any], Checked("launch.checks: a _target_ config of a Step subclass")
    ] = None
    # Autograd anomaly detection (slow: finds the op that made a nan), with the loss checked every
    # step.
    detect_anomaly: bool = False
    # Per-rank time by phase and the straggler report (training/meter.py); false: none (for
    # measuring its cost).
    timing: bool = True
    # GPUs: the same bits run after run, at some cost in speed: deterministic cuDNN and torch
    # kernels (torch.use_deterministic_algorithms), TF32 off, cuBLAS's fixed workspace. The CPU
    # needs none of it.
    deterministic: bool = False
    # One device's peak FLOP/s for the model FLOP utilisation (MFU) in the summary; null: the GPU
    # table in reporting/flops.py, or on the CPU a short matmul measured at the run's threads.
    peak_flops: Annotated[Optional[float], Positive()] = None


@dataclass
class ProfilerConf(Section):
    # Steps skipped, warmed up, then recorded (torch.profiler.schedule, once).
    wait: Annotated[int, AtLeast(0)] = 1
    # steps profiled but not recorded, after the skipped ones
    warmup: Annotated[int, AtLeast(0)] = 1
    active: Annotated[int, AtLeast(1)] = 3  # steps recorded
    # null: every rank
    ranks: Annotated[Optional[list[int]], Checked("launch.checks: ranks of the run")] = None
    row_limit: Annotated[int, AtLeast(1)] = 15  # rows of the top-operators table in the log


@dataclass
class TrialConf(Section):
    # Set by the search's sweeper (hydra/sweeper=optuna) on each trial's job: which trial of which
    # study, where the study lives, and the pruner that may stop it after a validation. null: no
    # search.
    number: Annotated[Optional[int], AtLeast(0)] = None
    # the Optuna study's name
    study: Annotated[Optional[str], Free("the sweeper's: any name")] = None
    # where the study lives (a journal file or a database URL)
    storage: Annotated[Optional[str], Free("the sweeper's: a journal file or a database URL")] = (
        None
    )
    # median, hyperband or none: may stop the trial after a validation (a hook: search/pruning.py)
    pruner: Annotated[str, OneOf(*PRUNERS)] = "none"
    # The pruner's own keyword arguments.
    pruner_args: Annotated[
        dict[str, Any], Checked("search.study.pruner_of: the pruner's own arguments")
    ] = field(default_factory=dict)
    # The hook that asks the pruner after each validation (its _target_), named by the sweeper: the
    # core names no extra.
    hook: Annotated[Optional[str], Free("the sweeper's: a hydra_ddp.hooks.Hook subclass")] = None


@dataclass
class Config(Section):
    backend: BackendConf = field(default_factory=BackendConf)
    init_method: InitMethodConf = field(default_factory=InitMethodConf)
    launcher: LauncherConf = field(default_factory=LauncherConf)
    trainer: TrainerConf = field(default_factory=TrainerConf)
    checkpoint: CheckpointConf = field(default_factory=CheckpointConf)
    # How the model is spread over the ranks (conf/strategy/): each strategy's own settings, its
    # dataclass in its module (parallel/strategies/), chosen by name.
    strategy: Annotated[Any, CHOSEN_STRATEGY] = MISSING
    profiler: ProfilerConf = field(default_factory=ProfilerConf)
    data: DataConf = field(default_factory=DataConf)
    trial: TrialConf = field(default_factory=TrialConf)
    # What is learnt (conf/task/): the loss, the metrics, the predictions; a `_target_` class.
    task: Annotated[Any, TARGET] = MISSING
    model: Annotated[Any, TARGET] = MISSING
    optim: Annotated[Any, TARGET] = MISSING
    # How the optimizer groups the model's parameters (its config is `optim`'s constructor
    # arguments).
    param_groups: ParamGroupsConf = field(default_factory=ParamGroupsConf)
    scheduler: Annotated[Any, TARGET] = None
    # Rank 0's loggers, by name (conf/logger/: tensorboard, csv, mlflow, wandb), each a `_target_`
    # class.
    logger: Annotated[
        Any, Checked("launch.checks: names of conf/logger/ options, each a _target_ config")
    ] = field(default_factory=dict)


@dataclass
class EvalConfig(Config):
    """eval.py's: the run's groups (the checkpoint's model and data are used unless overridden)."""

    # A checkpoint (a file or a sharded step-N directory), or a run directory (its best, else last).
    ckpt: Annotated[str, Checked("checkpoints: a checkpoint or a run directory")] = MISSING
    split: Annotated[str, OneOf("test", "val", "train")] = "test"  # test, val or train
    # Also write predictions.csv: sample index, label, predicted class, its probability.
    predict: bool = False


def register_schema(main_module: str = "__main__") -> None:
    """Make the schema (`schema` in conf/config.yaml's defaults) and the YAML resolvers known.

    `main_module`: the calling script's __name__. Every worker multiprocessing starts runs the
    script again, as __mp_main__, to find its main module; a worker composes nothing, and a joblib
    job's is given its parent's ConfigStore (Hydra's Singleton state), so there only the resolvers
    are made: building the schema would cost every worker time before its first step."""
    if main_module != "__mp_main__":
        store = ConfigStore.instance()
        store.store(name="schema", node=Config)
        store.store(name="eval_schema", node=EvalConfig)
        # conf/strategy/NAME.yaml: defaults [NAME_schema]
        for name, settings in CHOSEN_STRATEGY.options().items():
            store.store(group="strategy", name=f"{name}_schema", node=settings)
    OmegaConf.register_new_resolver("mul", lambda *xs: math.prod(xs), replace=True)
    OmegaConf.register_new_resolver("hydra_ddp.new_dir", rundir.claim_new, replace=True)
    OmegaConf.register_new_resolver("eq", lambda a, b: a == b, replace=True)
