"""The strategies (conf/strategy/): one module each, behind one protocol (base.Strategy). Adding one
is its module, its conf/strategy/NAME.yaml and a line here."""

from __future__ import annotations

from collections.abc import Callable

import torch

from hydra_ddp.config import strategy_settings
from hydra_ddp.config.run_config import Requested, RunConfig
from hydra_ddp.parallel.strategies.base import Strategy, local_state_bytes  # noqa: F401
from hydra_ddp.parallel.strategies.ddp import DDP
from hydra_ddp.parallel.strategies.fsdp import FSDP
from hydra_ddp.parallel.strategies.fsdp_tp import FSDPWithTP
from hydra_ddp.parallel.strategies.tp import TensorParallel

REGISTRY: dict[str, type[Strategy]] = {
    strategy.name: strategy for strategy in (DDP, FSDP, TensorParallel, FSDPWithTP)
}


def get(name: str) -> type[Strategy]:
    strategy_settings.of(name)  # a name no strategy has: one line
    return REGISTRY[name]


def replicas_at(cfg: Requested) -> Callable[[int], int]:
    """The run's model replicas at a world size (its strategy's: elastic.py's arithmetic)."""
    return get(cfg.strategy.name).replicas_at(cfg)


def build(cfg: RunConfig, device: torch.device) -> Strategy:
    """The run's strategy, in a worker whose process group is up."""
    return get(cfg.strategy.name)(cfg, device)
