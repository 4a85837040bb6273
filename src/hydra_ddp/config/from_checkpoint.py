"""eval.py's config: the checkpoint's own config, the command line's overrides on top, this
command's launch settings (plain dicts; launch/resolve.py reads the checkpoint and checks its
weights)."""

from __future__ import annotations

import copy
from typing import Any

from hydra_ddp.config import domains, schema
from hydra_ddp.errors import UserError


# --- eval.py: the parent's half ------------------------------------------------------------------
def merged(
    saved: dict[str, Any],
    position: dict[str, Any],
    composed: dict[str, Any],
    overrides: list[str],
    ckpt: str,
) -> dict[str, Any]:
    """eval.py's config: the checkpoint's own (`saved`: model, data, seed, precision: what it was
    trained with; `position`: where it stopped), the command line's overrides on top, and this
    command's launch settings (`composed`: the composed eval config, plain)."""
    plain = copy.deepcopy(saved)
    # a checkpoint from before tasks
    plain.setdefault("task", {"_target_": "hydra_ddp.tasks.Classification"})
    for group in ("backend", "init_method", "launcher"):
        plain[group] = composed[group]
    # The run's CPU threads per rank stay (the same kernels, the same bits) unless set on the
    # command line.
    for key in ("nproc", "device", "progress"):
        plain["trainer"][key] = composed["trainer"][key]
    for override in overrides:
        _apply(plain, composed, override)
    domains.check(composed, schema.EvalConfig)  # the command line's values, in their domains
    split = composed["split"]
    if split == "val" and not plain["data"]["val_fraction"]:
        raise UserError(
            "split=val: this run had no validation split "
            "(data.val_fraction=0); choose split=test or train"
        )
    plain["eval"] = {
        "ckpt": ckpt,
        "split": split,
        "predict": bool(composed["predict"]),
        "step": position["step"],
        "epoch": position["epoch"],
    }
    return plain


def override_key(override: str) -> str:
    """The config key a Hydra command-line override sets: `+a.b@pkg=v` → `a.b`."""
    return override.split("=", 1)[0].lstrip("+~").split("@", 1)[0]


def _apply(plain: dict[str, Any], composed: dict[str, Any], override: str) -> None:
    """One command-line override onto the checkpoint's config: a group (model=mlp) replaces the
    section; a key (data.eval_batch_size=64) takes the composed value."""
    key = override_key(override)
    if key in ("ckpt", "split", "predict") or key.startswith("hydra"):
        return
    parts = key.split(".")
    source, target = composed, plain
    for part in parts[:-1]:
        source, target = source[part], target.setdefault(part, {})
    if parts[-1] in source:
        target[parts[-1]] = copy.deepcopy(source[parts[-1]])
    else:
        target.pop(parts[-1], None)  # ~key
