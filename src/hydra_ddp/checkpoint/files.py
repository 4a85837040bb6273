"""Checkpoint files: where a run's are, reading them (a file, or a sharded step directory), and
checking that their weights fit a model. Shared by the launch side and the workers."""

from __future__ import annotations

import re
import warnings
from pathlib import Path
from typing import Any, Optional, Union

import torch
from torch import nn

from hydra_ddp.checkpoint import remote
from hydra_ddp.checkpoint.remote import Bucket, Remote
from hydra_ddp.data import batches
from hydra_ddp.errors import UserError
from hydra_ddp.parallel.distributed import restart_count
from hydra_ddp.rundir import RunDir

# A checkpoint: a local file or step directory, or one in object storage (remote.Remote: its URL).
Location = Union[Path, Remote]

LAST = "last.pt"


BEST = "best.pt"


META = "meta.pt"  # a sharded checkpoint's state besides the tensors DCP holds


_STEP = re.compile(r"^step-(\d+)(\.pt)?$")


# 2: the optimizer state keyed by parameter name (DCP's state_dict layout), so a
# checkpoint of either strategy loads into the other; 1: by position (still loaded).
FORMAT = 2


def resume_setting(configured: Optional[str]) -> Optional[str]:
    """A restarted job (torchrun's restart, Slurm's requeue) continues from its last checkpoint."""
    return "auto" if configured is None and restart_count() else configured


def folder(setting: Optional[str], run_dir: Path) -> Union[Path, Bucket]:
    """Where a run's checkpoints live: checkpoint.dir (a path, or a bucket's URL), else
    RUN_DIR/checkpoints."""
    if setting is None:
        return RunDir(run_dir).checkpoints
    return Bucket(setting) if remote.is_url(setting) else remote.local_path(setting)


def in_folder(where: Union[Path, Bucket]) -> list[Location]:
    """A checkpoint folder's step checkpoints, oldest first, local or in a bucket."""
    return where.steps() if isinstance(where, Bucket) else step_checkpoints(where)


def location(text: str) -> Location:
    """A checkpoint named by its path or URL (as rank 0 tells the others)."""
    return remote.located(text) if remote.is_url(text) else Path(text)


def step_checkpoints(folder: Path) -> list[Path]:
    """A checkpoint folder's step checkpoints, oldest first: `step-N.pt` files and whole `step-N/`
    directories (with their index: one a writer left half-done is still named `.step-N.tmp`)."""
    if not folder.is_dir():
        return []
    found = [
        (int(m.group(1)), p)
        for p in folder.iterdir()
        if (m := _STEP.match(p.name)) and (m.group(2) or (p / ".metadata").is_file())
    ]
    return [p for _, p in sorted(found)]


def read(path: Location, key: str, device: Optional[torch.device] = None) -> dict[str, Any]:
    """A hydra-ddp checkpoint, or one line naming the setting (`key`) and what is wrong with the
    file. No device: memory-mapped, on the CPU (a look at the config reads only what it touches). A
    sharded checkpoint (a directory): its state but the tensors, and the model as shapes only
    (`model_weights` reads them)."""
    if path.is_dir():
        return _read_sharded(path, key)
    if isinstance(path, Path) and not path.is_file():
        raise UserError(f"{key}: no checkpoint at {str(path)!r}")
    try:
        if isinstance(path, Remote):  # in memory: an object store has no file to map
            state = torch.load(
                remote.load_bytes(path), map_location=device or "cpu", weights_only=True
            )
        elif device is None:
            state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        else:
            state = torch.load(path, map_location=device, weights_only=True)
    except FileNotFoundError:
        raise UserError(f"{key}: no checkpoint at {str(path)!r}") from None
    except OSError as e:
        if isinstance(path, Remote):  # the store's error, not the file's
            raise UserError(f"{key}: {e}".splitlines()[0]) from None
        raise UserError(
            f"checkpoint {str(path)!r} is truncated or corrupt "
            f"({type(e).__name__}: {e})".splitlines()[0]
        ) from None
    except Exception as e:
        raise UserError(
            f"checkpoint {str(path)!r} is truncated or corrupt "
            f"({type(e).__name__}: {e})".splitlines()[0]
        ) from None
    if not isinstance(state, dict) or "format" not in state:
        raise UserError(f"{key}: {str(path)!r} is not a hydra-ddp checkpoint")
    if state["format"] != FORMAT or _of_0_1(state.get("config")):
        raise UserError(
            f"{key}: {str(path)!r} was written by hydra-ddp 0.1 (its config has keys "
            f"this version renamed: dist.*, ddp.*); this version ({version()}) reads "
            "the checkpoints it writes: train it again, or read it with hydra-ddp 0.1.0"
        )
    return state


def _of_0_1(config: object) -> bool:
    """A checkpoint's config of hydra-ddp 0.1, whose sections dist and ddp are backend and strategy
    now."""
    return isinstance(config, dict) and bool({"dist", "ddp"} & set(config))


def version() -> str:
    """This package's version, as installed (or its source's, run from a clone)."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as installed

    try:
        return installed("hydra-ddp")
    except PackageNotFoundError:
        return "unknown"


def _read_sharded(path: Location, key: str) -> dict[str, Any]:
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    if isinstance(path, Path) and not ((path / ".metadata").is_file() and (path / META).is_file()):
        raise UserError(
            f"{key}: {str(path)!r} is not a hydra-ddp checkpoint (no .metadata and {META} in it)"
        )
    try:
        if isinstance(path, Remote):  # DCP's fsspec reader: the index, and no shard
            from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

            meta, reader = remote.load_bytes(path, META), FsspecReader(str(path))
        else:
            meta, reader = path / META, FileSystemReader(path)
        state = torch.load(meta, map_location="cpu", weights_only=True)
        index = reader.read_metadata().state_dict_metadata
    except Exception as e:
        raise UserError(
            f"checkpoint {str(path)!r} is truncated or corrupt "
            f"({type(e).__name__}: {e})".splitlines()[0]
        ) from None
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise UserError(f"{key}: {str(path)!r} is not a hydra-ddp checkpoint")
    for part in ("model", "ema"):  # the weights, and their moving average where the run kept one
        shapes = {
            name[len(part) + 1 :]: batches.shaped(item.size, item.properties.dtype)
            for name, item in index.items()
            if name.startswith(f"{part}.") and isinstance(item, TensorStorageMetadata)
        }
        if shapes or part == "model":
            state[part] = shapes
    return state


def evaluated(state: dict[str, Any]) -> str:
    """Which weights of a checkpoint its run evaluated: their moving average where it kept one
    (trainer.ema), else the trained weights."""
    return "ema" if state.get("ema") is not None else "model"


def model_weights(path: Location, state: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The full weights a checkpoint's run evaluated (`evaluated`: the average, where it kept one),
    of a checkpoint `read` gave `state` for, on the CPU. A directory's are read from every rank's
    shards by this process alone (no collective)."""
    part = evaluated(state)
    if not path.is_dir():
        return state[part]
    import torch.distributed.checkpoint as dcp

    weights = {
        name: torch.empty(shape.shape, dtype=shape.dtype) for name, shape in state[part].items()
    }
    try:
        # "assuming the intent is to load in a single process": it is
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            # a URL (str): DCP's fsspec reader, which reads each shard's part it needs
            dcp.load({part: weights}, checkpoint_id=path, no_dist=True)
    except Exception as e:
        raise UserError(
            f"checkpoint {str(path)!r} is truncated or corrupt "
            f"({type(e).__name__}: {e})".splitlines()[0]
        ) from None
    return weights


def find(where: str, key: str) -> Location:
    """A checkpoint (a file, or a sharded checkpoint's directory), or a run directory's best (else
    its last); in object storage, a checkpoint or a checkpoint.dir's best (else its last)."""
    if remote.is_url(where):
        return _find_remote(where, key)
    path = remote.local_path(where)
    if path.is_dir() and not (path / ".metadata").is_file():
        for folder in (RunDir(path).checkpoints, path):
            for name in ("best", "last"):
                found = _published(folder, name)
                if found is not None:
                    return found
        raise UserError(
            f"{key}={where}: {str(path)!r} holds no checkpoint (checkpoints/best "
            "or checkpoints/last, as .pt files or directories)"
        )
    if not path.exists():
        raise UserError(f"{key}={where}: no checkpoint file or run directory at {str(path)!r}")
    return path


def _find_remote(where: str, key: str) -> Location:
    try:
        if remote.STEP.match(where.rstrip("/").rsplit("/", 1)[-1]):
            return remote.located(where)
        bucket = Bucket(where)
        found = bucket.pointed("best") or bucket.pointed("last")
    except (ImportError, ValueError, OSError) as e:
        raise UserError(f"{key}={where}: {e}") from None
    if found is None:
        raise UserError(
            f"{key}={where}: no checkpoint there (a step-N.pt object, a step-N/ prefix, or a "
            "checkpoint.dir whose best or last names one)"
        )
    return found


def _published(folder: Path, name: str) -> Optional[Path]:
    """`name` (best, last) in `folder`: a file `name.pt` or a link `name` to a directory. Both
    (a crash between publishing one and removing the other): the newer."""
    found = [p for p in (folder / f"{name}.pt", folder / name) if p.exists()]
    if not found:
        return None
    return max(found, key=lambda p: p.lstat().st_mtime_ns).resolve()


def check_compatible(
    model: nn.Module, saved: dict[str, torch.Tensor], path: Path, fix: str
) -> None:
    """A checkpoint of another model is one error listing the keys, not a wall of size errors."""
    check_compatible_keys(model.state_dict(), saved, path, fix)


def check_compatible_keys(
    own: dict[str, torch.Tensor], saved: dict[str, torch.Tensor], path: Path, fix: str
) -> None:
    missing = sorted(own.keys() - saved.keys())
    unexpected = sorted(saved.keys() - own.keys())
    reshaped = sorted(
        f"{k} {tuple(saved[k].shape)}→{tuple(own[k].shape)}"
        for k in own.keys() & saved.keys()
        if saved[k].shape != own[k].shape
    )
    problems = [
        f"{label}: {', '.join(keys[:6])}{' …' if len(keys) > 6 else ''}"
        for label, keys in (
            ("missing", missing),
            ("unexpected", unexpected),
            ("shape differs", reshaped),
        )
        if keys
    ]
    if problems:
        raise UserError(
            f"checkpoint {str(path)!r} is of another model ({'; '.join(problems)}); {fix}"
        )


# --- fine-tuning: trainer.init_from --------------------------------------------------------------
def load_weights(model: nn.Module, path: Path, ignore: list[str]) -> list[str]:
    """The checkpoint's weights into `model`, but for the ignored parameters (names or prefixes;
    "head": the last Linear layer). Returns the names left at their fresh values."""
    saved = model_weights(path, read(path, "trainer.init_from"))
    skipped = ignored_keys(model, saved.keys() | model.state_dict().keys(), ignore)
    model.load_state_dict({k: v for k, v in saved.items() if k not in skipped}, strict=False)
    return sorted(skipped)


def check_init(model: nn.Module, path: Path, ignore: list[str]) -> None:
    """Before launch: trainer.init_from's weights fit the model (the blueprint's, on the meta
    device: shapes, no memory), but for the ignored ones, or one line."""
    saved = read(path, "trainer.init_from")["model"]
    skipped = ignored_keys(model, saved.keys() | model.state_dict().keys(), ignore)
    check_compatible_keys(
        {k: v for k, v in model.state_dict().items() if k not in skipped},
        {k: v for k, v in saved.items() if k not in skipped},
        path,
        fix="leave those out with trainer.init_ignore=[NAME,…] "
        "(e.g. [head]: the last Linear layer)",
    )


def ignored_keys(model: nn.Module, keys: Any, ignore: list[str]) -> set[str]:
    prefixes = [_head(model) if name == "head" else name for name in ignore]
    return {k for k in keys if any(k == p or k.startswith(p + ".") for p in prefixes)}


def _head(model: nn.Module) -> str:
    linear = [name for name, module in model.named_modules() if isinstance(module, nn.Linear)]
    if not linear:
        raise UserError(
            "trainer.init_ignore=[head]: the model has no Linear layer; name its parameters instead"
        )
    return linear[-1]
