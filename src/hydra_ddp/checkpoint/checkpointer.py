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

import logging
import random
import shutil
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch
import torch.distributed as dist
from torch.optim import Optimizer

from hydra_ddp.checkpoint.atomic import (
    Writer,
    atomic_link,
    atomic_symlink,
    atomic_write,
    first_failure,
    remove_leftovers,
    replace_dir,
    serialize,
    snapshot,
)
from hydra_ddp.checkpoint.files import FORMAT, META, check_compatible, read, step_checkpoints
from hydra_ddp.config import run_config
from hydra_ddp.config.run_config import RunConfig
from hydra_ddp.errors import EveryRankError, UserError
from hydra_ddp.parallel.distributed import first_error
from hydra_ddp.parallel.strategies import Strategy
from hydra_ddp.rundir import RunDir
from hydra_ddp.runtime.ranklog import FILE_ONLY
from hydra_ddp.runtime.ranks import RankInfo

log = logging.getLogger(__name__)


# RNG states travel as one float64 vector per rank (every value is an integer below 2**53, or a
# float): one all_gather collects them all, and a tensor is what weights_only loading accepts.
def _pack_rng(device: torch.device) -> torch.Tensor:
    _, keys, pos, has_gauss, cached = np.random.get_state()
    version, py_state, gauss_next = random.getstate()
    parts = [
        torch.get_rng_state().double(),
        torch.from_numpy(keys.astype(np.float64)),
        torch.tensor(
            [pos, has_gauss, cached, version, np.nan if gauss_next is None else gauss_next],
            dtype=torch.float64,
        ),
        torch.tensor(py_state, dtype=torch.float64),
    ]
    if device.type == "cuda":
        parts.append(torch.cuda.get_rng_state(device).double())
    return torch.cat(parts)


def _unpack_rng(packed: torch.Tensor, device: torch.device) -> None:
    torch_size = torch.get_rng_state().numel()
    torch_state, rest = packed[:torch_size], packed[torch_size:]
    keys, (pos, has_gauss, cached, version, gauss_next), rest = (
        rest[:624],
        rest[624:629].tolist(),
        rest[629:],
    )
    py_state, cuda_state = rest[:625], rest[625:]
    torch.set_rng_state(torch_state.to(torch.uint8))
    np.random.set_state(
        ("MT19937", keys.numpy().astype(np.uint32), int(pos), int(has_gauss), cached)
    )
    random.setstate(
        (
            int(version),
            tuple(int(v) for v in py_state.tolist()),
            None if np.isnan(gauss_next) else gauss_next,
        )
    )
    if device.type == "cuda" and cuda_state.numel():
        torch.cuda.set_rng_state(cuda_state.to(torch.uint8), device)


def _gather_rng(device: torch.device) -> list[torch.Tensor]:
    mine = _pack_rng(device).to(device)
    everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, mine)
    return [t.cpu() for t in everyone]


# What each rank writes of a sharded checkpoint (DCP): the model, the optimizer, the weights'
# average.
SHARDED = ("model", "optimizer", "ema")


class Checkpointer:
    """Saves every rank's state (through rank 0, or each its shards); loads it on every rank."""

    def __init__(
        self,
        cfg: RunConfig,
        run_dir: Path,
        rank: RankInfo,
        device: torch.device,
        found: dict[str, Any],
        sharded: bool = False,
    ):
        """`found`: the values the workers settled (dotted keys), in every checkpoint's config."""
        self.cfg = cfg
        self.dir = RunDir(run_dir).checkpoints
        self.rank = rank
        self.device = device
        # as every checkpoint holds it (plain: weights_only loads it)
        self.recorded = run_config.as_run(cfg, found)
        self.sharded = sharded  # every rank writes its shards (DCP), else rank 0 the whole state
        self.writer: Optional[Writer] = None  # rank 0's, from the first save to finish()
        self.write_error: Optional[str] = None
        self.written_step = -1  # the step of this run's last sharded save
        self.in_flight: list[tuple[int, Path]] = []  # a whole-file write not yet known complete

    def published(self, which: str) -> Path:
        """Where this run publishes `last` or `best`: a link to a directory, or a file (.pt)."""
        return self.dir / (which if self.sharded else f"{which}.pt")

    # --- saving -------------------------------------------------------------------------------
    def save(self, state: dict[str, Any], step: int, best: bool = False) -> list[tuple[int, Path]]:
        """Called by every rank at the same step; rank 0 writes, everyone waits for it. `best`:
        the best weights by trainer.monitor so far (best.pt). Returns the (step, path) now known
        complete on every rank: a sharded one at once, a file once the next save or finish()."""
        state = {
            **state,
            "rng": _gather_rng(self.device),
            "config": self.recorded,
            "format": FORMAT,
        }
        if self.sharded:
            self._save_sharded(state, step, best)
            return [(step, self.dir / f"step-{step:08d}")]
        # The previous write first: one at a time (so the free space it checks is real), and every
        # rank learns whether it failed before this one starts.
        self._agree(self._wait() if self.rank.is_main else None)
        complete, self.in_flight = self.in_flight, [(step, self.dir / f"step-{step:08d}.pt")]
        if self.rank.is_main:
            # Training may change the tensors once this returns: the writer gets copies. It starts
            # after the collective above, which it would slow down on a busy CPU.
            self.writer = self.writer or Writer()
            self.writer.submit(self._write, snapshot(state), step, best)
        return complete

    def finish(self) -> list[tuple[int, Path]]:
        """The write in flight awaited (the end, a stop), returned; every rank learns its fate."""
        problem = self._wait() if self.rank.is_main else None
        if self.writer is not None:
            self.writer.retire()  # no thread outlives the run (a later save starts another)
            self.writer = None
        self._agree(problem)
        complete, self.in_flight = self.in_flight, []
        return complete

    def _agree(self, problem: Optional[str]) -> None:
        # Not a barrier inside `if rank == 0`: every rank learns whether the write worked, and how
        # not.
        problem = first_error(problem, self.device)
        if problem:
            raise EveryRankError(
                f"{problem}; the previous checkpoint is intact: "
                "make room, then continue with trainer.resume=auto"
            )

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
        """In the background (rank 0's one thread): serialise, write, publish as last, prune."""
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            payload = serialize(state, self.dir)
            remove_leftovers(self.dir)
            target = self.dir / f"step-{step:08d}.pt"
            atomic_write(payload, target)
            self._publish(target, best)
            # the epoch's line says enough
            log.info("checkpoint: step %d → %s", step, target, extra=FILE_ONLY)
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
                remove_leftovers(self.dir)
            except OSError as e:
                problem = self._failed(step, e)
        self._agree(problem)  # nobody writes into the directory before rank 0 has cleared it
        if self.written_step < 0:  # the first save: every rank must see the directory rank 0 made
            unseen = (
                None
                if self.dir.is_dir()
                else (
                    f"rank {self.rank.rank} does not see rank 0's checkpoint "
                    f"directory {self.dir}: sharded checkpoints need a file "
                    "system every node shares (set hydra.run.dir to one)"
                )
            )
            unseen = first_error(unseen, self.device)
            if unseen:
                raise EveryRankError(unseen)
        # The same step again (now as best too): the shards are on disk already, the rest changes.
        again = self.written_step == step and target.is_dir()
        if not again:
            try:
                dcp.save(
                    {k: state[k] for k in SHARDED if k in state},
                    storage_writer=dcp.FileSystemWriter(tmp),
                )
            except CheckpointException as e:  # raised on every rank, with every rank's failure
                problem = self._failed(step, first_failure(e))
        if self.rank.is_main:
            rest = {k: v for k, v in state.items() if k not in SHARDED}
            try:
                if problem is None:
                    atomic_write(serialize(rest, self.dir), (target if again else tmp) / META)
                    if not again:
                        replace_dir(tmp, target)
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
                atomic_symlink(target.name, self.dir / name)
                (self.dir / f"{name}.pt").unlink(missing_ok=True)
            else:
                atomic_link(target, self.dir / f"{name}.pt")
                if (self.dir / name).is_symlink():
                    (self.dir / name).unlink()
        self._prune(keep=self.cfg.checkpoint.keep)

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
        """The checkpoint to resume from, loaded: null → none; a path → that one; auto → the newest
        good one."""
        if resume is None:
            return None
        if resume != "auto":
            path = Path(resume).expanduser().resolve()
            # a bad explicit checkpoint stops the run here, with its path
            return path, self.load(path)
        for path in reversed(self.step_files()):
            try:
                return path, self.load(path)
            except UserError as e:
                log.warning("skipping %s", e)
        return None

    def load(self, path: Path) -> dict[str, Any]:
        return read(path, "trainer.resume", self.device)

    def restore(
        self, state: dict, path: Path, strategy: Strategy, optimizer: Optimizer, scheduler: object
    ) -> None:
        """Every rank read the checkpoint: each takes its part. Either layout reshards to any world
        size and any strategy (a directory: DCP reads each rank's part of the shards; a file: the
        full state, of which FSDP keeps its shards)."""
        check_compatible(
            strategy.module, state["model"], path, fix="resume with the model it was saved from"
        )
        self._check_same_batches(state, path)
        if path.is_dir():
            strategy.load_sharded(path, optimizer)
        else:
            strategy.load_model_state(state["model"], everywhere=True)
            strategy.load_optimizer_state(optimizer, state["optimizer"])
        if scheduler is not None and state.get("scheduler") is not None:
            scheduler.load_state_dict(state["scheduler"])
        rng = state["rng"]
        if len(rng) != self.rank.world_size:
            log.warning(
                "checkpoint saved with %d ranks, resuming "
                "with %d: RNG streams restart from rank 0's",
                len(rng),
                self.rank.world_size,
            )
        _unpack_rng(rng[self.rank.rank % len(rng)].cpu(), self.device)

    def _check_same_batches(self, state: dict[str, Any], path: Path) -> None:
        """Mid-epoch, the position counts optimizer steps of global batches: this run's global batch
        must be the checkpoint's. The s-th global batch of an epoch is the same samples at any world
        size and any split into micro-batches (DistributedSampler's interleave makes the ranks' b-th
        micro-batches one contiguous slice of the epoch's permutation, and a step's micro-batches
        consecutive slices), so a run may continue at another world size with the same global
        batch."""
        if not state["position"]["batch"]:
            return
        then = global_batch(run_config.typed(state["config"]), len(state["rng"]))
        now = self.cfg.data.global_batch_size
        if then != now:
            raise UserError(
                f"checkpoint {str(path)!r} stopped mid-epoch with a global batch of "
                f"{then} samples per optimizer step, this run has {now}: resume with "
                f"data.global_batch_size={then} (the micro-batch or the accumulation "
                "follows the world size), or from an epoch-end checkpoint"
            )


def saved_accumulation(state: dict[str, Any]) -> int:
    """The micro-batches per optimizer step of the run that saved `state`."""
    return run_config.typed(state["config"]).trainer.accumulate or 1


def global_batch(saved: RunConfig, ranks: int) -> int:
    """A checkpoint's samples per optimizer step: its micro-batch × accumulation × model replicas at
    the `ranks` that saved it (checkpoints before 0.2 recorded a global batch without the
    accumulation)."""
    from hydra_ddp.parallel import strategies

    replicas = strategies.get(saved.strategy.name).replicas(saved.strategy, ranks)
    return saved.data.batch_size * (saved.trainer.accumulate or 1) * replicas
