"""What a config trains, apart from how each node launches it: its fingerprint (every rank of a run
must hold the same) and the values in which a checkpoint's config differs from a run's."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, is_dataclass
from typing import Any

from hydra_ddp.config.run_config import RunConfig


def what_is_trained(plain: dict[str, Any]) -> dict[str, Any]:
    """The config without how each node launches (node_rank, addresses, threads differ by
    design)."""
    what = {
        k: v
        for k, v in plain.items()
        if k not in ("launcher", "init_method", "backend", "overridden")
    }
    what["trainer"] = {
        k: v for k, v in plain["trainer"].items() if k not in ("nproc", "threads", "progress")
    }
    return what


def config_fingerprint(cfg: RunConfig) -> str:
    """The digest of what `cfg` (a RunConfig, or one made plain) trains."""
    plain = asdict(cfg) if is_dataclass(cfg) else cfg
    return hashlib.sha256(
        json.dumps(what_is_trained(plain), sort_keys=True, default=str).encode()
    ).hexdigest()


def config_changes(saved: dict[str, Any], now: Any) -> list[str]:
    """`key: then → now` for each value of what is trained that differs between a checkpoint's
    config and this run's (the resume setting and the job's own bookkeeping aside)."""

    def flat(node: Any, prefix: str = "") -> dict[str, Any]:
        if not isinstance(node, dict) or not node:
            return {prefix.rstrip("."): node}
        return {
            k: v for key, value in node.items() for k, v in flat(value, f"{prefix}{key}.").items()
        }

    ignored = ("trainer.resume", "trainer.max_time", "sweep", "job", "trial", "eval")
    now = asdict(now) if is_dataclass(now) else now
    then, current = flat(what_is_trained(saved)), flat(what_is_trained(now))
    return [
        f"{key}: {then.get(key)!r} → {current.get(key)!r}"
        for key in sorted(set(then) | set(current))
        if then.get(key) != current.get(key) and not key.startswith(ignored)
    ]
