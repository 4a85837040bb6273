"""Checkpoints: atomic writes, exact-resume state, and loading that never runs pickled code.

A checkpoint holds the unwrapped model, optimizer, scheduler, the loop's position (epoch, batch
inside the epoch, global step) and every rank's RNG states. It loads with
`torch.load(weights_only=True)`: only tensors and plain containers, the config included.

Two layouts, one loading path (`read`, `model_weights`, `Checkpointer.restore`):
- ddp: one file, `step-N.pt`, written by rank 0. Off the critical path: at the step boundary
  rank 0 copies the state's tensors to host memory (the snapshot), and a background thread
  serialises it (checking first that the disk has room for it), writes, fsyncs and publishes it
  while training goes on. One write at a time: the next save, and the end of training or a stop
  (`finish`), wait for it first and learn how it went.
- fsdp, tp, fsdp_tp: a directory, `step-N/`, written by every rank at once with
  torch.distributed.checkpoint (DCP): each rank its own shards (`__R_0.distcp`), rank 0 the
  index (`.metadata`) and the rest of the state (`meta.pt`). Written as `.step-N.tmp/` and
  renamed when whole: a torn one is never taken for a checkpoint. No rank ever holds the full
  state, and loading reshards: to another world size, or another strategy (ddp included).
  Every rank writes into one directory, so multi-node runs need a file system the nodes share.
`last` and `best` (`last.pt` and `best.pt` for files) name the newest and the best; `keep` step
checkpoints are kept besides. A write that failed stops the run there, in one line.
"""

from __future__ import annotations

import errno
import io
import logging
import os
import queue
import random
import re
import shutil
import threading
import warnings
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from hydra_ddp.distributed import RankInfo, first_error, restart_count
from hydra_ddp.errors import EveryRankError, UserError
from hydra_ddp.reporting import FILE_ONLY
from hydra_ddp.rundir import RunDir

log = logging.getLogger(__name__)

LAST = "last.pt"
BEST = "best.pt"
META = "meta.pt"  # a sharded checkpoint's state besides the tensors DCP holds
_STEP = re.compile(r"^step-(\d+)(\.pt)?$")
# 2: the optimizer state keyed by parameter name (DCP's state_dict layout), so a
# checkpoint of either strategy loads into the other; 1: by position (still loaded).
FORMAT = 2


# RNG states travel as one float64 vector per rank (every value is an integer below 2**53, or a
# float): one all_gather collects them all, and a tensor is what weights_only loading accepts.
def _pack_rng(device: torch.device) -> torch.Tensor:
    _, keys, pos, has_gauss, cached = np.random.get_state()
    version, py_state, gauss_next = random.getstate()
    parts = [
        torch.get_rng_state().double(),
        torch.from_numpy(keys.astype(np.float64)),
        torch.tensor([pos, has_gauss, cached, version, np.nan if gauss_next is None else gauss_next], dtype=torch.float64),
        torch.tensor(py_state, dtype=torch.float64),
    ]
    if device.type == "cuda":
        parts.append(torch.cuda.get_rng_state(device).double())
    return torch.cat(parts)


def _unpack_rng(packed: torch.Tensor, device: torch.device) -> None:
    torch_size = torch.get_rng_state().numel()
    torch_state, rest = packed[:torch_size], packed[torch_size:]
    keys, (pos, has_gauss, cached, version, gauss_next), rest = rest[:624], rest[624:629].tolist(), rest[629:]
    py_state, cuda_state = rest[:625], rest[625:]
    torch.set_rng_state(torch_state.to(torch.uint8))
    np.random.set_state(("MT19937", keys.numpy().astype(np.uint32), int(pos), int(has_gauss), cached))
    random.setstate((int(version), tuple(int(v) for v in py_state.tolist()), None if np.isnan(gauss_next) else gauss_next))
    if device.type == "cuda" and cuda_state.numel():
        torch.cuda.set_rng_state(cuda_state.to(torch.uint8), device)


def _gather_rng(device: torch.device) -> list[torch.Tensor]:
    mine = _pack_rng(device).to(device)
    everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, mine)
    return [t.cpu() for t in everyone]


class Checkpointer:
    """Saves every rank's state (through rank 0, or each rank its shards); loads it back on every rank."""

    def __init__(self, cfg: Any, run_dir: Path, rank: RankInfo, device: torch.device, config: dict[str, Any],
                 sharded: bool = False):
        self.cfg = cfg
        self.dir = RunDir(run_dir).checkpoints
        self.rank = rank
        self.device = device
        self.config = config
        self.sharded = sharded  # every rank writes its shards (DCP), else rank 0 the whole state
        self.writer: Optional[_Writer] = None  # rank 0's, from the first save to finish()
        self.write_error: Optional[str] = None
        self.written_step = -1  # the step of this run's last sharded save

    def published(self, which: str) -> Path:
        """Where this run publishes `last` or `best`: a link to a directory, or a file (.pt)."""
        return self.dir / (which if self.sharded else f"{which}.pt")

    # --- saving -------------------------------------------------------------------------------
    def save(self, state: dict[str, Any], step: int, best: bool = False) -> None:
        """Called by every rank at the same step; rank 0 writes, everyone waits for it. `best`: these
        are the best weights by trainer.monitor so far (best.pt)."""
        state = {**state, "rng": _gather_rng(self.device), "config": self.config, "format": FORMAT}
        if self.sharded:
            return self._save_sharded(state, step, best)
        # The previous write first: one at a time (so the free space it checks is real), and every
        # rank learns whether it failed before this one starts.
        self._agree(self._wait() if self.rank.is_main else None)
        if self.rank.is_main:
            # Training may change the tensors once this returns: the writer gets copies. It starts
            # after the collective above, which it would slow down on a busy CPU.
            self.writer = self.writer or _Writer()
            self.writer.submit(self._write, _snapshot(state), step, best)

    def finish(self) -> None:
        """Wait for the write in flight (end of training, a stop): every rank calls it, and learns how it went."""
        problem = self._wait() if self.rank.is_main else None
        if self.writer is not None:
            self.writer.retire()  # no thread outlives the run (a later save starts another)
            self.writer = None
        self._agree(problem)

    def _agree(self, problem: Optional[str]) -> None:
        # Not a barrier inside `if rank == 0`: every rank learns whether the write worked, and how not.
        problem = first_error(problem, self.device)
        if problem:
            raise EveryRankError(f"{problem}; the previous checkpoint is intact: make room, then continue with "
                            "trainer.resume=auto")

    def _wait(self) -> Optional[str]:
        if self.writer is not None:
            self.writer.wait()
        problem, self.write_error = self.write_error, None
        return problem

    def _failed(self, step: int, error: BaseException) -> str:
        reason = error.strerror if isinstance(error, OSError) and error.strerror else error
        problem = f"could not write the checkpoint for step {step} in {self.dir}: {reason}"
        log.error("%s", problem)
        return problem

    def _write(self, state: dict[str, Any], step: int, best: bool) -> None:
        """In the background: serialise, write, publish as last (and best), prune. The only writer:
        rank 0's one thread."""
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            payload = _serialize(state, self.dir)
            _remove_leftovers(self.dir)
            target = self.dir / f"step-{step:08d}.pt"
            _atomic_write(payload, target)
            self._publish(target, best)
            log.info("checkpoint: step %d → %s", step, target, extra=FILE_ONLY)  # the epoch's line says enough
        except Exception as e:  # noqa: BLE001  (a full disk, or a state that does not serialise: reported, not lost in a thread)
            self.write_error = self._failed(step, e)

    def _save_sharded(self, state: dict[str, Any], step: int, best: bool) -> None:
        """Every rank writes its shards into `.step-N.tmp/` (DCP); rank 0 adds the rest of the
        state, renames it `step-N/` and publishes it. Synchronous: DCP's own collectives run on
        the training's process group, so nothing else may run beside them."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.api import CheckpointException

        target = self.dir / f"step-{step:08d}"
        tmp = self.dir / f".{target.name}.tmp"
        problem = None
        if self.rank.is_main:
            try:
                self.dir.mkdir(parents=True, exist_ok=True)
                _remove_leftovers(self.dir)
            except OSError as e:
                problem = self._failed(step, e)
        self._agree(problem)  # nobody writes into the directory before rank 0 has cleared it
        if self.written_step < 0:  # the first save: every rank must see the directory rank 0 made
            unseen = None if self.dir.is_dir() else (
                f"rank {self.rank.rank} does not see rank 0's checkpoint directory {self.dir}: sharded checkpoints "
                "need a file system every node shares (set hydra.run.dir to one)")
            unseen = first_error(unseen, self.device)
            if unseen:
                raise EveryRankError(unseen)
        # The same step again (now as best too): the shards are on disk already, the rest changes.
        again = self.written_step == step and target.is_dir()
        if not again:
            try:
                dcp.save({"model": state["model"], "optimizer": state["optimizer"]},
                         storage_writer=dcp.FileSystemWriter(tmp))
            except CheckpointException as e:  # raised on every rank, with every rank's failure
                problem = self._failed(step, _first_failure(e))
        if self.rank.is_main:
            rest = {k: v for k, v in state.items() if k not in ("model", "optimizer")}
            try:
                if problem is None:
                    _atomic_write(_serialize(rest, self.dir), (target if again else tmp) / META)
                    if not again:
                        _replace_dir(tmp, target)
                    self._publish(target, best)
                    log.info("checkpoint: step %d → %s", step, target, extra=FILE_ONLY)
                else:
                    shutil.rmtree(tmp, ignore_errors=True)
            except OSError as e:
                problem = self._failed(step, e)
                shutil.rmtree(tmp, ignore_errors=True)
        self.written_step = step
        self._agree(problem)

    def _publish(self, target: Path, best: bool) -> None:
        """`target` becomes last (and best); one kind of each at a time, then the old ones go."""
        names = ("last", "best") if best else ("last",)
        for name in names:
            if target.is_dir():
                _atomic_symlink(target.name, self.dir / name)
                (self.dir / f"{name}.pt").unlink(missing_ok=True)
            else:
                _atomic_link(target, self.dir / f"{name}.pt")
                if (self.dir / name).is_symlink():
                    (self.dir / name).unlink()
        self._prune(keep=self.cfg.keep)

    def _prune(self, keep: int) -> None:
        # best.pt and last.pt are hard links: removing an old step file never removes them. `best`
        # is a symbolic link: the directory it names stays.
        best = (self.dir / "best").resolve() if (self.dir / "best").is_symlink() else None
        for old in self.step_files()[:-keep]:
            if old.is_dir():
                if old.resolve() != best:
                    shutil.rmtree(old)
            else:
                old.unlink()

    def step_files(self) -> list[Path]:
        """The step checkpoints, oldest first: files, and whole directories."""
        return step_checkpoints(self.dir)

    # --- loading ------------------------------------------------------------------------------
    def choose(self, resume: Optional[str]) -> Optional[tuple[Path, dict[str, Any]]]:
        """The checkpoint to resume from, loaded: null → none; a path → that one; auto → the newest good one."""
        if resume is None:
            return None
        if resume != "auto":
            path = Path(resume).expanduser().resolve()
            return path, self.load(path)  # a bad explicit checkpoint stops the run here, with its path
        for path in reversed(self.step_files()):
            try:
                return path, self.load(path)
            except UserError as e:
                log.warning("skipping %s", e)
        return None

    def load(self, path: Path) -> dict[str, Any]:
        return read(path, "trainer.resume", self.device)

    def restore(self, state: dict[str, Any], path: Path, strategy: Any, optimizer, scheduler) -> None:
        """Every rank read the checkpoint: each takes its part. Either layout reshards to any world
        size and any strategy (a directory: DCP reads each rank's part of the shards; a file: the
        full state, of which FSDP keeps its shards)."""
        check_compatible(strategy.module, state["model"], path, fix="resume with the model it was saved from")
        self._check_same_batches(state, path)
        if path.is_dir():
            strategy.load_sharded(path, optimizer)
        elif state.get("format", 1) >= 2:  # optimizer state keyed by parameter name
            strategy.load_model_state(state["model"], everywhere=True)
            strategy.load_optimizer_state(optimizer, state["optimizer"])
        else:  # by position in the optimizer (format 1: DDP runs before strategies)
            strategy.load_model_state(state["model"], everywhere=True)
            optimizer.load_state_dict(state["optimizer"])
        if scheduler is not None and state.get("scheduler") is not None:
            scheduler.load_state_dict(state["scheduler"])
        rng = state["rng"]
        if len(rng) != self.rank.world_size:
            log.warning("checkpoint saved with %d ranks, resuming with %d: RNG streams restart from rank 0's",
                        len(rng), self.rank.world_size)
        _unpack_rng(rng[self.rank.rank % len(rng)].cpu(), self.device)


    def _check_same_batches(self, state: dict[str, Any], path: Path) -> None:
        """Mid-epoch, the position counts batches: they must be the batches the checkpoint counted."""
        if not state["position"]["batch"]:
            return
        saved = state["config"]
        then = (saved["data"]["batch_size"], saved["trainer"]["accumulate"], len(state["rng"]))
        now = (self.config["data"]["batch_size"], self.config["trainer"]["accumulate"], self.rank.world_size)
        if then != now:
            raise UserError(
                f"checkpoint {str(path)!r} stopped mid-epoch with data.batch_size, trainer.accumulate and world "
                f"size {then}, this run has {now}: resume with the same ones (or from an epoch-end checkpoint)"
            )


def resume_setting(configured: Optional[str]) -> Optional[str]:
    """A restarted job (torchrun's restart, Slurm's requeue) continues from its last checkpoint."""
    return "auto" if configured is None and restart_count() else configured


def step_checkpoints(folder: Path) -> list[Path]:
    """A checkpoint folder's step checkpoints, oldest first: `step-N.pt` files and whole `step-N/`
    directories (with their index: one a writer left half-done is still named `.step-N.tmp`)."""
    if not folder.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in folder.iterdir()
             if (m := _STEP.match(p.name)) and (m.group(2) or (p / ".metadata").is_file())]
    return [p for _, p in sorted(found)]


def read(path: Path, key: str, device: Optional[torch.device] = None) -> dict[str, Any]:
    """A hydra-ddp checkpoint, or one line naming the setting (`key`) and what is wrong with the file.
    No device: memory-mapped, on the CPU (a look at the config reads only what it touches).
    A sharded checkpoint (a directory): its state but the tensors, and the model as shapes only
    (`model_weights` reads them)."""
    if path.is_dir():
        return _read_sharded(path, key)
    if not path.is_file():
        raise UserError(f"{key}: no checkpoint at {str(path)!r}")
    try:
        if device is None:
            state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        else:
            state = torch.load(path, map_location=device, weights_only=True)
    except Exception as e:
        raise UserError(f"checkpoint {str(path)!r} is truncated or corrupt ({type(e).__name__}: {e})".splitlines()[0]) from None
    if not isinstance(state, dict) or state.get("format") not in (1, FORMAT):
        raise UserError(f"{key}: {str(path)!r} is not a hydra-ddp checkpoint")
    return state


def _read_sharded(path: Path, key: str) -> dict[str, Any]:
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    if not (path / ".metadata").is_file() or not (path / META).is_file():
        raise UserError(f"{key}: {str(path)!r} is not a hydra-ddp checkpoint (no .metadata and {META} in it)")
    try:
        state = torch.load(path / META, map_location="cpu", weights_only=True)
        index = FileSystemReader(path).read_metadata().state_dict_metadata
    except Exception as e:
        raise UserError(f"checkpoint {str(path)!r} is truncated or corrupt ({type(e).__name__}: {e})".splitlines()[0]) from None
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise UserError(f"{key}: {str(path)!r} is not a hydra-ddp checkpoint")
    state["model"] = {name[len("model."):]: torch.empty(item.size, dtype=item.properties.dtype, device="meta")
                      for name, item in index.items()
                      if name.startswith("model.") and isinstance(item, TensorStorageMetadata)}
    return state


def model_weights(path: Path, state: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The full model weights of a checkpoint `read` gave `state` for, on the CPU. A directory's
    are read from every rank's shards by this process alone (no collective)."""
    if not path.is_dir():
        return state["model"]
    import torch.distributed.checkpoint as dcp

    weights = {name: torch.empty(shape.shape, dtype=shape.dtype) for name, shape in state["model"].items()}
    try:
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load({"model": weights}, checkpoint_id=path, no_dist=True)
    except Exception as e:
        raise UserError(f"checkpoint {str(path)!r} is truncated or corrupt ({type(e).__name__}: {e})".splitlines()[0]) from None
    return weights


def find(where: str, key: str) -> Path:
    """A checkpoint (a file, or a sharded checkpoint's directory), or a run directory's best (else its last)."""
    path = Path(where).expanduser().resolve()
    if path.is_dir() and not (path / ".metadata").is_file():
        for folder in (RunDir(path).checkpoints, path):
            for name in ("best", "last"):
                found = _published(folder, name)
                if found is not None:
                    return found
        raise UserError(f"{key}={where}: {str(path)!r} holds no checkpoint (checkpoints/best or checkpoints/last, "
                        "as .pt files or directories)")
    if not path.exists():
        raise UserError(f"{key}={where}: no checkpoint file or run directory at {str(path)!r}")
    return path


def _published(folder: Path, name: str) -> Optional[Path]:
    """`name` (best, last) in `folder`: a file `name.pt` or a link `name` to a directory. Both
    (a crash between publishing one and removing the other): the newer."""
    found = [p for p in (folder / f"{name}.pt", folder / name) if p.exists()]
    if not found:
        return None
    return max(found, key=lambda p: p.lstat().st_mtime_ns).resolve()


def check_compatible(model: nn.Module, saved: dict[str, torch.Tensor], path: Path, fix: str) -> None:
    """A checkpoint of another model is one error listing the keys, not a wall of size errors."""
    check_compatible_keys(model.state_dict(), saved, path, fix)


def check_compatible_keys(own: dict[str, torch.Tensor], saved: dict[str, torch.Tensor], path: Path, fix: str) -> None:
    missing = sorted(own.keys() - saved.keys())
    unexpected = sorted(saved.keys() - own.keys())
    reshaped = sorted(
        f"{k} {tuple(saved[k].shape)}→{tuple(own[k].shape)}" for k in own.keys() & saved.keys()
        if saved[k].shape != own[k].shape
    )
    problems = [
        f"{label}: {', '.join(keys[:6])}{' …' if len(keys) > 6 else ''}"
        for label, keys in (("missing", missing), ("unexpected", unexpected), ("shape differs", reshaped))
        if keys
    ]
    if problems:
        raise UserError(f"checkpoint {str(path)!r} is of another model ({'; '.join(problems)}); {fix}")


# --- fine-tuning: trainer.init_from --------------------------------------------------------------
def load_weights(model: nn.Module, path: Path, ignore: list[str]) -> list[str]:
    """The checkpoint's weights into `model`, but for the ignored parameters (names or prefixes;
    "head": the last Linear layer). Returns the names left at their fresh values."""
    saved = model_weights(path, read(path, "trainer.init_from"))
    skipped = ignored_keys(model, saved.keys() | model.state_dict().keys(), ignore)
    model.load_state_dict({k: v for k, v in saved.items() if k not in skipped}, strict=False)
    return sorted(skipped)


def check_init(model_cfg: dict[str, Any], path: Path, ignore: list[str]) -> None:
    """Before launch: trainer.init_from's weights fit the model (but for the ignored ones), or one line.
    The model is built on the meta device: shapes, no memory."""
    from hydra.utils import instantiate

    saved = read(path, "trainer.init_from")["model"]
    with torch.device("meta"):
        model = instantiate(model_cfg)
    skipped = ignored_keys(model, saved.keys() | model.state_dict().keys(), ignore)
    check_compatible_keys({k: v for k, v in model.state_dict().items() if k not in skipped},
                          {k: v for k, v in saved.items() if k not in skipped}, path,
                          fix="leave those out with trainer.init_ignore=[NAME,…] (e.g. [head]: the last Linear layer)")


def ignored_keys(model: nn.Module, keys: Any, ignore: list[str]) -> set[str]:
    prefixes = [_head(model) if name == "head" else name for name in ignore]
    return {k for k in keys if any(k == p or k.startswith(p + ".") for p in prefixes)}


def _head(model: nn.Module) -> str:
    linear = [name for name, module in model.named_modules() if isinstance(module, nn.Linear)]
    if not linear:
        raise UserError("trainer.init_ignore=[head]: the model has no Linear layer; name its parameters instead")
    return linear[-1]


class _Writer:
    """Rank 0's background writer: one daemon thread that runs one write at a time.

    Started once, not once per save: starting a thread waits until the new thread runs, and with
    every core training that took milliseconds of each save's stall.
    A daemon, as a hung write (a stalled network file system) must not keep the process alive.
    """

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._idle = threading.Event()
        self._idle.set()
        threading.Thread(target=self._run, name="checkpoint-writer", daemon=True).start()

    def submit(self, write: Callable[..., None], *args: Any) -> None:
        """Queue a write; the caller has waited for the one before (`wait`)."""
        self._idle.clear()
        self._jobs.put((write, args))

    def wait(self) -> None:
        self._idle.wait()

    def retire(self) -> None:
        """End the thread once the queue is done."""
        self._jobs.put(None)

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            write, args = job
            try:
                write(*args)  # reports its own failure (Checkpointer._write)
            finally:
                self._idle.set()


def _snapshot(value: Any) -> Any:
    """The state with each tensor copied to host memory (a GPU's too: the writer thread never
    touches the device), containers rebuilt around the copies."""
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return {key: _snapshot(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        items = [_snapshot(item) for item in value]
        return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)  # a namedtuple's fields
    return value


def _serialize(state: dict[str, Any], directory: Path) -> memoryview:
    """The state as bytes, in memory: its size is known before the disk is touched, and a disk that
    cannot hold it is named with the space needed instead of leaving a torn temp file."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    payload = buffer.getbuffer()
    free = shutil.disk_usage(directory).free
    if free < len(payload):
        raise OSError(errno.ENOSPC, f"not enough space: it needs {_mb(len(payload))}, "
                                    f"{_mb(free)} free on the file system of {directory}")
    return payload


def _atomic_write(payload: memoryview, target: Path) -> None:
    """Temp file beside the target, fsync, rename: a crash leaves the old file or the new one."""
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(payload)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        if e.errno == errno.ENOSPC:
            raise OSError(errno.ENOSPC, f"no space left writing {target.name}: it needs {_mb(len(payload))}") from None
        raise
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(target.parent)


def _mb(size: int) -> str:
    return f"{size / 2**20:.1f} MiB"


def _atomic_symlink(name: str, link: Path) -> None:
    """`link` → `name` (relative: the folder may move), replacing what was there in one step."""
    tmp = link.with_name(f".{link.name}.{os.getpid()}.tmp")
    tmp.unlink(missing_ok=True)
    os.symlink(name, tmp)
    os.replace(tmp, link)
    _fsync_dir(link.parent)


def _replace_dir(source: Path, target: Path) -> None:
    """Rename a whole directory into place; one there already (the same step) is moved aside first."""
    if target.exists():
        aside = target.with_name(f".{target.name}.old")
        shutil.rmtree(aside, ignore_errors=True)
        os.replace(target, aside)
        os.replace(source, target)
        shutil.rmtree(aside)
    else:
        os.replace(source, target)
    _fsync_dir(target)
    _fsync_dir(target.parent)


def _remove_leftovers(folder: Path) -> None:
    """What a writer killed mid-write left: temp files, and half-written shard directories."""
    for leftover in [*folder.glob(".*.tmp"), *folder.glob(".*.old")]:
        if leftover.is_dir() and not leftover.is_symlink():
            shutil.rmtree(leftover, ignore_errors=True)
        else:
            leftover.unlink(missing_ok=True)


def _first_failure(error: BaseException) -> BaseException:
    """DCP's CheckpointException holds every rank's failure: the lowest rank's."""
    failures = getattr(error, "failures", None) or {}
    for rank in sorted(failures):
        failure = failures[rank]
        return failure[0] if isinstance(failure, tuple) else failure
    return error


def _atomic_link(source: Path, link: Path) -> None:
    tmp = link.with_name(f".{link.name}.{os.getpid()}.tmp")
    tmp.unlink(missing_ok=True)
    os.link(source, tmp)
    os.replace(tmp, link)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
