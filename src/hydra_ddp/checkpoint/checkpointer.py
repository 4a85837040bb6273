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
- in object storage (checkpoint.dir=s3://…; remote.py): a file is uploaded from memory by rank
  0's thread; a sharded one is written by DCP to local disk (RUN_DIR/.staging), then every rank
  uploads its own shards in the background, and rank 0 the index last, once every rank's upload
  is known done (at the next save, or finish). Nodes need share nothing.
`last` and `best` (`last.pt` and `best.pt` for files) name the newest and the best; `keep` step
checkpoints are kept besides. A write that failed stops the run there, in one line.
"""

from __future__ import annotations

import logging
import shutil
import time
from pathlib import Path
from typing import Any, Optional

import torch
from torch.optim import Optimizer

from hydra_ddp.checkpoint import files as checkpoints
from hydra_ddp.checkpoint import rng as rng_streams
from hydra_ddp.checkpoint.atomic import (
    Writer,
    atomic_write,
    first_failure,
    publish,
    remove_leftovers,
    replace_dir,
    serialize,
    snapshot,
)
from hydra_ddp.checkpoint.files import FORMAT, META, Location, check_compatible, read
from hydra_ddp.checkpoint.remote import Bucket, Remote, is_url
from hydra_ddp.checkpoint.uploads import SHARDED, Uploads
from hydra_ddp.config import run_config
from hydra_ddp.config.run_config import RunConfig
from hydra_ddp.errors import EveryRankError, UserError
from hydra_ddp.parallel.distributed import first_error
from hydra_ddp.parallel.strategies import Strategy
from hydra_ddp.rundir import RunDir
from hydra_ddp.runtime.ranklog import FILE_ONLY
from hydra_ddp.runtime.ranks import RankInfo

log = logging.getLogger(__name__)


class Checkpointer(Uploads):
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
        place = checkpoints.folder(cfg.checkpoint.dir, run_dir)
        self.bucket = place if isinstance(place, Bucket) else None  # checkpoint.dir=URL
        self.dir = RunDir(run_dir).checkpoints if self.bucket else place
        self.where = self.bucket.url if self.bucket else str(self.dir)
        self.staging = RunDir(run_dir).staging  # sharded checkpoints on their way to the bucket
        self.rank = rank
        self.device = device
        # as every checkpoint holds it (plain: weights_only loads it)
        self.recorded = run_config.as_run(cfg, found)
        self.sharded = sharded  # every rank writes its shards (DCP), else rank 0 the whole state
        # rank 0's (every rank's, uploading shards), from the first save to finish()
        self.writer: Optional[Writer] = None
        self.write_error: Optional[str] = None
        self.written_step = -1  # the step of this run's last sharded save
        self.in_flight: list[tuple[int, Location]] = []  # a whole-file write not yet known complete
        self.uploading: Optional[tuple[int, Remote, bool]] = (
            None  # shards on their way (step, best)
        )
        self.waited_s = 0.0  # how long saves and the end waited for the write before

    def published(self, which: str) -> Location:
        """Where this run publishes `last` or `best`: a link to a directory, or a file (.pt); in a
        bucket, the checkpoint its pointer names."""
        if self.bucket:
            return self.bucket.pointed(which) or Remote(self.bucket.at(which), self.sharded)
        return self.dir / (which if self.sharded else f"{which}.pt")

    def _at(self, step: int) -> Location:
        name = f"step-{step:08d}" if self.sharded else f"step-{step:08d}.pt"
        return Remote(self.bucket.at(name), self.sharded) if self.bucket else self.dir / name

    # --- saving -------------------------------------------------------------------------------
    def save(
        self, state: dict[str, Any], step: int, best: bool = False
    ) -> list[tuple[int, Location]]:
        """Called by every rank at the same step; rank 0 writes, everyone waits for it. `best`:
        the best weights by trainer.monitor so far (best.pt). Returns the (step, path) now known
        complete on every rank: a sharded one at once, a file once the next save or finish()."""
        state = {
            **state,
            "rng": rng_streams.gather(self.device),
            "config": self.recorded,
            "format": FORMAT,
        }
        if self.sharded and self.bucket:
            return self._stage_sharded(state, step, best)
        if self.sharded:
            self._save_sharded(state, step, best)
            return [(step, self._at(step))]
        # The previous write first: one at a time (so the free space it checks is real), and every
        # rank learns whether it failed before this one starts.
        self._agree(self._wait() if self.rank.is_main else None)
        complete, self.in_flight = self.in_flight, [(step, self._at(step))]
        if self.rank.is_main:
            # Training may change the tensors once this returns: the writer gets copies. It starts
            # after the collective above, which it would slow down on a busy CPU.
            self.writer = self.writer or Writer()
            self.writer.submit(self._write, snapshot(state), step, best)
        return complete

    def finish(self) -> list[tuple[int, Location]]:
        """The write in flight awaited (the end, a stop), returned; every rank learns its fate."""
        try:
            if self.sharded and self.bucket:
                return self._complete_upload()
            problem = self._wait() if self.rank.is_main else None
        finally:
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
            fix = "once the store takes writes," if self.bucket else "make room, then"
            raise EveryRankError(
                f"{problem}; the previous checkpoint is intact: "
                f"{fix} continue with trainer.resume=auto"
            )

    def _wait(self) -> Optional[str]:
        if self.writer is not None:
            started = time.perf_counter()
            self.writer.wait()
            self.waited_s += time.perf_counter() - started
        problem, self.write_error = self.write_error, None
        return problem

    def _failed(self, step: int, error: BaseException) -> str:
        reason = error.strerror if isinstance(error, OSError) and error.strerror else error
        problem = f"could not write the checkpoint for step {step} in {self.where}: {reason}"
        log.error("%s", problem)
        return problem

    def _write(self, state: dict[str, Any], step: int, best: bool) -> None:
        """In the background (rank 0's one thread): serialise, write, publish as last, prune."""
        try:
            if self.bucket:
                self._upload_file(state, step, best)
                return
            self.dir.mkdir(parents=True, exist_ok=True)
            payload = serialize(state, self.dir)
            remove_leftovers(self.dir)
            target = self.dir / f"step-{step:08d}.pt"
            atomic_write(payload, target)
            publish(self.dir, target, best, self.cfg.checkpoint.keep)
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
                    publish(self.dir, target, best, self.cfg.checkpoint.keep)
                    log.info("checkpoint: step %d → %s", step, target, extra=FILE_ONLY)
                else:
                    shutil.rmtree(tmp, ignore_errors=True)
            except OSError as e:
                problem = self._failed(step, e)
                shutil.rmtree(tmp, ignore_errors=True)
        self.written_step = step
        self._agree(problem)

    def step_files(self) -> list[Location]:
        """The step checkpoints, oldest first: files, and whole directories (or a bucket's)."""
        return checkpoints.in_folder(self.bucket or self.dir)

    # --- loading ------------------------------------------------------------------------------
    def choose(self, resume: Optional[str]) -> Optional[tuple[Location, dict[str, Any]]]:
        """The checkpoint to resume from, loaded: null → none; a path → that one; auto → the newest
        good one."""
        if resume is None:
            return None
        if resume != "auto":
            path = (
                checkpoints.location(resume)
                if is_url(resume)
                else Path(resume).expanduser().resolve()
            )
            # a bad explicit checkpoint stops the run here, with its path
            return path, self.load(path)
        for path in reversed(self.step_files()):
            try:
                return path, self.load(path)
            except UserError as e:
                log.warning("skipping %s", e)
        return None

    def load(self, path: Location) -> dict[str, Any]:
        return read(path, "trainer.resume", self.device)

    def restore(
        self,
        state: dict,
        path: Location,
        strategy: Strategy,
        optimizer: Optimizer,
        scheduler: object,
    ) -> None:
        """Every rank read the checkpoint: each takes its part. Either layout reshards to any world
        size and any strategy (a directory: DCP reads each rank's part of the shards; a file: the
        full state, of which FSDP keeps its shards)."""
        check_compatible(
            strategy.module, state["model"], path, fix="resume with the model it was saved from"
        )
        check_same_batches(state, path, self.cfg.data.global_batch_size)
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
        rng_streams.unpack(rng[self.rank.rank % len(rng)].cpu(), self.device)


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


def check_same_batches(state: dict[str, Any], path: Location, now: int) -> None:
    """Mid-epoch, the position counts optimizer steps of global batches: this run's global batch
    must be the checkpoint's. The s-th global batch of an epoch is the same samples at any world
    size and any split into micro-batches (DistributedSampler's interleave makes the ranks' b-th
    micro-batches one contiguous slice of the epoch's permutation, and a step's micro-batches
    consecutive slices), so a run may continue at another world size with the same global
    batch."""
    if not state["position"]["batch"]:
        return
    then = global_batch(run_config.typed(state["config"]), len(state["rng"]))
    if then != now:
        raise UserError(
            f"checkpoint {str(path)!r} stopped mid-epoch with a global batch of "
            f"{then} samples per optimizer step, this run has {now}: resume with "
            f"data.global_batch_size={then} (the micro-batch or the accumulation "
            "follows the world size), or from an epoch-end checkpoint"
        )
