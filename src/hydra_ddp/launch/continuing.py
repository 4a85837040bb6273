"""A run continued in its own directory (`hydra.run.dir=RUN trainer.resume=auto`, or a checkpoint
path): the run's own record first, this command's overrides on top.

The run's `.hydra/overrides.yaml` says how it was trained (`+experiment=documents_gpt`, its keys):
those overrides come first, then this command's, a key given now replacing the recorded one (a group
given now, its recorded keys too); where it resumed from and its time budget are each command's own
(trainer.resume, trainer.max_time). So the command composes the run's own config with what it
changes, as eval.py reads a checkpoint's, instead of the defaults. Hydra writes no record of its
own for the command (`hydra.output_subdir=null`): the run's is rewritten only once the continuation
has passed every check and trained (written a checkpoint or its summary: `recorded_once_it_trains`),
so a refused one, or one whose workers failed before that, leaves it as it was, byte for byte.

No torch here, nor Hydra: train.py's process reads the record before it composes anything.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

if TYPE_CHECKING:
    from omegaconf import DictConfig

    from hydra_ddp.config.run_config import RunConfig

RECORD = ".hydra"
# a command's own, not the run's (nor what a checkpoint compares: config/fingerprint.py): where it
# resumes from, and its own time budget
PER_COMMAND = ("trainer.resume", "trainer.max_time")
# this command continues a run in its directory: the run's overrides it adopted (record() reads it)
adopted: Optional[list[str]] = None


def _key(override: str) -> str:
    return override.split("=", 1)[0].lstrip("+~").split("@", 1)[0]


def _value(argv: list[str], key: str) -> Optional[str]:
    found = [a.split("=", 1)[1] for a in argv[1:] if "=" in a and _key(a) == key]
    return found[-1] if found else None


def adopt(argv: list[str]) -> None:
    """argv, for a run continued in its own directory: its record's overrides before this command's
    (`argv` changed in place, as Hydra reads it); nothing for any other command."""
    global adopted
    run_dir, resume = _value(argv, "hydra.run.dir"), _value(argv, "trainer.resume")
    if run_dir is None or resume in (None, "null") or any(a in ("-m", "--multirun") for a in argv):
        return
    recorded = Path(os.path.expanduser(run_dir)) / RECORD / "overrides.yaml"
    if not recorded.is_file():
        return  # a new run directory, or one Hydra did not make
    import yaml

    try:
        earlier = yaml.safe_load(recorded.read_text()) or []
    except (OSError, yaml.YAMLError):
        return  # not a record this can read: the command composes as it is given
    given = [a for a in argv[1:] if "=" in a and not a.startswith("-")]
    now = {_key(a) for a in given}
    kept = [
        o
        for o in earlier
        if isinstance(o, str)
        and _key(o) not in now
        and _key(o) not in PER_COMMAND
        and not any(_key(o).startswith(f"{key}.") for key in now)
    ]
    adopted = kept
    argv[1:1] = [*kept, "hydra.output_subdir=null"]


@contextlib.contextmanager
def recorded_once_it_trains(run_dir: Path, cfg: DictConfig) -> Iterator[None]:
    """Around a continuation's launch: its record is rewritten when the launch ends (finished,
    stopped, or failed), if it wrote a checkpoint or its summary by then; a start that failed before
    either leaves the earlier record as it was."""
    if adopted is None:  # not a continuation: Hydra wrote the run's record
        yield
        return
    before = _written(run_dir)
    try:
        yield
    finally:
        if _written(run_dir) != before:
            record(run_dir, cfg)


def _written(run_dir: Path) -> tuple:
    """What a run's progress changes: its checkpoints and its summary (names, sizes, times)."""
    found = [*sorted((run_dir / "checkpoints").glob("*")), run_dir / "summary.json"]
    stats = []
    for path in found:
        with contextlib.suppress(OSError):
            stat = path.stat()
            stats.append((path.name, stat.st_size, stat.st_mtime_ns))
    return tuple(stats)


def record(run_dir: Path, cfg: DictConfig) -> None:
    """The continuation accepted: the run's record says how it now runs (config.yaml, hydra.yaml
    and overrides.yaml, as Hydra writes them), in place of the earlier one."""
    if adopted is None:
        return
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import OmegaConf

    folder = run_dir / RECORD
    folder.mkdir(exist_ok=True)
    hydra_cfg = HydraConfig.get()
    for name, content in (
        ("config.yaml", cfg),
        ("hydra.yaml", OmegaConf.create({"hydra": hydra_cfg})),
        ("overrides.yaml", OmegaConf.create(list(hydra_cfg.overrides.task))),
    ):
        temporary = folder / f".{name}.tmp"
        OmegaConf.save(content, temporary)
        os.replace(temporary, folder / name)


def changed_length(saved: dict[str, Any], cfg: RunConfig) -> Optional[str]:
    """A continuation that changes the run's length (trainer.epochs, trainer.max_steps) under a
    schedule that spans the whole run: its learning rate would jump at the step it resumes from.
    The one line that refuses it, with what to do; None when the length is the checkpoint's, or
    the schedule does not depend on it."""
    from hydra_ddp.recipe import schedules

    trainer = saved.get("trainer", {})
    moved = [
        f"trainer.{key}: {trainer.get(key)} → {getattr(cfg.trainer, key)}"
        for key in ("epochs", "max_steps")
        if trainer.get(key) != getattr(cfg.trainer, key)
    ]
    if not moved:
        return None
    # a per-step schedule shaped by the run's length, or one by epochs whose settings follow it
    # (cosine's T_max: ${trainer.epochs})
    shaped = schedules.takes_length(cfg.scheduler) and not schedules.length_free(cfg.scheduler)
    if not shaped and saved.get("scheduler") == _plain(cfg.scheduler):
        return None
    name = str(cfg.scheduler.get("_target_", "")).rsplit(".", 1)[-1]
    return (
        f"{'; '.join(moved)} on resume: the schedule ({name}) spans the run's whole length, and "
        "a new length would move its learning rate at once; keep the run's length, or train on "
        "from its weights in a new run (trainer.init_from=RUN_DIR with the steps to add: a "
        "schedule of its own)"
    )


def _plain(value: Any) -> Any:
    from omegaconf import DictConfig, OmegaConf

    return OmegaConf.to_container(value, resolve=True) if isinstance(value, DictConfig) else value
