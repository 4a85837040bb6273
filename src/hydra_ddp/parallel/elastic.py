"""Elastic runs (launcher.nnodes=MIN:MAX, torchrun's form): the node range, what must hold at every
world size in it, and the per-rank batch at the world size a rendezvous gives."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Optional

from hydra_ddp.config.run_config import Requested, RequestedLauncherConf
from hydra_ddp.errors import UserError


def node_range(value: Any) -> tuple[int, int]:
    """launcher.nnodes: N, or "MIN:MAX" (torchrun's elastic form)."""
    text = str(value).strip()
    low, sep, high = text.partition(":")
    try:
        bounds = (int(low), int(high)) if sep else (int(text), int(text))
    except ValueError:
        raise UserError(
            f"launcher.nnodes={value!r}: give a node count (2) or an elastic range MIN:MAX (1:4)"
        ) from None
    if bounds[0] < 1 or bounds[0] > bounds[1]:
        raise UserError(f"launcher.nnodes={value}: the range MIN:MAX needs 1 <= MIN <= MAX")
    return bounds


def is_elastic(launcher: RequestedLauncherConf) -> bool:
    return launcher.min_nodes is not None and launcher.min_nodes != launcher.nnodes


def world_sizes(cfg: Requested) -> list[int]:
    """Every world size the run may train at, smallest first."""
    return [
        cfg.trainer.nproc * nodes
        for nodes in range(cfg.launcher.min_nodes, cfg.launcher.nnodes + 1)
    ]


# The model replicas at a world size (the strategy's: every rank but under tensor parallel), given
# by the caller: this module's arithmetic needs no strategy, and no strategy imports back.
Replicas = Callable[[int], int]


def check(
    cfg: Requested, global_batch: Optional[int], replicas_at: Replicas, fits: Callable[[Any], None]
) -> None:
    """What an elastic run needs before launch: torchrun with restarts to spend, a global batch (the
    configured one) that each allowed world size takes in whole micro-batches of data.batch_size
    (the accumulation makes up the rest), a strategy that fits each (`fits`: its check of the
    config at that many nodes). Resolve makes each restart resume from the last checkpoint.
    `global_batch`: data.global_batch_size as configured; `cfg`'s batches settled at the largest
    world size (launch.resolve)."""
    launcher = cfg.launcher
    span = f"launcher.nnodes={launcher.min_nodes}:{launcher.nnodes}"
    if launcher.name != "torchrun":
        raise UserError(f"{span} (elastic) needs launcher=torchrun")
    if launcher.max_restarts < 1:
        raise UserError(
            f"{span} (elastic): set launcher.max_restarts to 1 or more; a "
            "lost node costs the group a restart (a joining one does not)"
        )
    if global_batch is None:
        raise UserError(
            f"{span} (elastic) needs data.global_batch_size (not the "
            "per-rank data.batch_size): a resized run then keeps its "
            "batches, and continues mid-epoch at the sample where it stopped"
        )
    micro = cfg.data.batch_size
    for nodes, world in zip(range(launcher.min_nodes, launcher.nnodes + 1), world_sizes(cfg)):
        # tensor parallel that does not fit: one line
        replicas = replicas_at(world)
        # e.g. its plan
        fits(dataclasses.replace(cfg, launcher=dataclasses.replace(launcher, nnodes=nodes)))
        if global_batch % (micro * replicas):
            raise UserError(
                f"data.global_batch_size={global_batch} does not divide into micro-batches "
                f"of data.batch_size={micro} on the {replicas} model replicas of world size "
                f"{world}, which {span} allows: choose a global batch that every one takes "
                f"whole (a multiple of {micro * replicas}), or a smaller data.batch_size"
            )


def at_world_size(cfg: Requested, world: int, replicas_at: Replicas) -> Optional[dict[str, Any]]:
    """The values an elastic run's workers settle at the world size the rendezvous gave: the
    accumulation that keeps the global batch with the same micro-batch; None where there is
    nothing to settle."""
    if not is_elastic(cfg.launcher):
        return None
    replicas = replicas_at(world)
    accumulate = cfg.data.global_batch_size // (cfg.data.batch_size * replicas)
    return None if accumulate == cfg.trainer.accumulate else {"trainer.accumulate": accumulate}


def most_accumulation(cfg: Requested, replicas_at: Replicas) -> int:
    """The micro-batches per optimizer step at the fewest ranks the run may train at: an elastic run
    keeps its global batch and micro-batch at fewer nodes by accumulating more (at_world_size)."""
    accumulate = cfg.trainer.accumulate or 1
    if not is_elastic(cfg.launcher):
        return accumulate
    replicas = replicas_at(world_sizes(cfg)[0])
    return max(accumulate, cfg.data.global_batch_size // (cfg.data.batch_size * replicas))
