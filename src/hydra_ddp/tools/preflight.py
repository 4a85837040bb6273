"""`train.py --check` from Python: compose a config with Hydra's compose API and check it exactly as
the command would (the same resolve, checks and meta-device build), launching nothing. For tests
and for bench/gpu_check.py --dry-run, which check many configs in one process."""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Optional

from hydra import compose, initialize_config_dir
from hydra.core.hydra_config import HydraConfig
from omegaconf import open_dict, read_write

from hydra_ddp.config.schema import register_schema
from hydra_ddp.errors import UserError
from hydra_ddp.launch import command, composition, startup
from hydra_ddp.parallel import distributed


def check(
    conf_dir: Path,
    overrides: list[str],
    run_dir: Path,
    gpus: Optional[int] = None,
    config_name: str = "config",
) -> None:
    """Raise the UserError `train.py --check OVERRIDES` would print (nothing: the config is good).
    `gpus`: check it for a host of that many GPUs (`--gpus=N`). Hydra's own composition errors
    (an unknown group option, a misspelt key) are the UserError train.py prints for them."""
    _register_schema()
    with (
        initialize_config_dir(config_dir=str(Path(conf_dir).resolve()), version_base=None),
        _one_line(),
    ):
        # One job's config: a search preset's sweep (hydra.mode=MULTIRUN) is checked as its base
        # run.
        cfg = compose(
            config_name=config_name,
            overrides=[*overrides, f"hydra.run.dir={run_dir}", "hydra.mode=RUN"],
            return_hydra_config=True,
        )
    with read_write(cfg.hydra.runtime), open_dict(cfg.hydra.runtime):
        cfg.hydra.runtime.output_dir = str(run_dir)  # what Hydra's run sets before the job starts
    HydraConfig.instance().set_config(cfg)
    with read_write(cfg), open_dict(cfg):
        del cfg["hydra"]
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    with _environment(
        {startup.CHECK_ENV: "1", distributed.CHECK_GPUS_ENV: str(gpus) if gpus else None}
    ):
        command.run(cfg, 0.0, job="eval" if config_name == "eval" else "train")


@contextlib.contextmanager
def _one_line() -> Iterator[None]:
    """A composition error as train.py reports it (launch.composition)."""
    try:
        yield
    except Exception as error:
        line = composition.one_line(error)
        if line is None:
            raise
        raise UserError(line) from None


@functools.lru_cache(maxsize=1)
def _register_schema() -> None:
    """Once a process: the ConfigStore keeps it across Hydra's initialisations (many checks, one
    process)."""
    register_schema()


@contextlib.contextmanager
def _environment(values: dict[str, Optional[str]]) -> Iterator[None]:
    saved = {key: os.environ.get(key) for key in values}
    try:
        _set_environment(values)
        yield
    finally:
        _set_environment(saved)


def _set_environment(values: dict[str, Optional[str]]) -> None:
    """Each variable set, or unset where its value is None."""
    for key, value in values.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
