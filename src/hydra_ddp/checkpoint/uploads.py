"""What a Checkpointer does for a checkpoint.dir in object storage (checkpointer.py's other half):
a file uploaded from memory by rank 0's thread; a sharded checkpoint written by DCP to local disk,
every rank's shards uploaded by its own thread while training goes on, and made a checkpoint by
rank 0's index, uploaded last once every rank's upload is known done."""

from __future__ import annotations

import io
import logging
import shutil
from pathlib import Path
from typing import Any

import torch

from hydra_ddp.checkpoint.atomic import Writer, atomic_write, first_failure, serialize
from hydra_ddp.checkpoint.files import META, Location
from hydra_ddp.checkpoint.remote import INDEX, Remote
from hydra_ddp.runtime.ranklog import FILE_ONLY

log = logging.getLogger(__name__)

# What each rank writes of a sharded checkpoint (DCP): the model, the optimizer, the weights'
# average.
SHARDED = ("model", "optimizer", "ema")


class Uploads:
    """The bucket's side of a Checkpointer, which holds the state these methods use."""

    def _upload_file(self, state: dict[str, Any], step: int, best: bool) -> None:
        """In rank 0's thread: one object, whole or absent (a PUT, or a multipart upload, appears
        when complete), then the pointers."""
        target = self._at(step)
        self.bucket.put(target.name, _bytes(state))
        self._point(target, best)
        log.info("checkpoint: step %d → %s", step, target, extra=FILE_ONLY)

    def _stage_sharded(
        self, state: dict[str, Any], step: int, best: bool
    ) -> list[tuple[int, Location]]:
        """The checkpoint before made complete (_complete_upload); this one written by DCP to
        local disk (its collectives run now, on the training's group), then uploaded by every
        rank's thread while training goes on."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.api import CheckpointException

        complete = self._complete_upload()
        target = self._at(step)
        staged = self.staging / target.name
        rest = {k: v for k, v in state.items() if k not in SHARDED}
        problem = None
        if complete and complete[-1][0] == step:  # the same step again, now as best: the rest
            if self.rank.is_main:
                try:
                    self.bucket.put(f"{target.name}/{META}", _bytes(rest))
                    self._point(target, best)
                except Exception as e:  # noqa: BLE001  (the store's errors: reported on every rank)
                    problem = self._failed(step, e)
            self._agree(problem)
            return complete
        if self.rank.is_main:
            try:
                shutil.rmtree(self.staging, ignore_errors=True)
                staged.mkdir(parents=True)
                for torn in self.bucket.incomplete():  # a writer killed mid-upload left it
                    self.bucket.remove(torn)
            except OSError as e:
                problem = self._failed(step, e)
        self._agree(problem)
        try:
            dcp.save(
                {k: state[k] for k in SHARDED if k in state},
                storage_writer=dcp.FileSystemWriter(staged),
            )
            if self.rank.is_main:
                atomic_write(serialize(rest, staged), staged / META)
        except CheckpointException as e:
            problem = self._failed(step, first_failure(e))
        except OSError as e:
            problem = self._failed(step, e)
        self._agree(problem)
        own = sorted(p for p in staged.glob(f"__{self.rank.rank}_*"))  # DCP's name for a rank's
        self.writer = self.writer or Writer()
        self.writer.submit(self._upload_own, own, target, step)
        self.uploading, self.written_step = (step, target, best), step
        return complete

    def _upload_own(self, files: list[Path], target: Remote, step: int) -> None:
        """In the background (every rank's thread): this rank's shards, each removed once up."""
        try:
            for file in files:
                self.bucket.put_file(file, f"{target.name}/{file.name}")
                file.unlink()
        except Exception as e:  # noqa: BLE001  (reported at the next save, on every rank)
            self.write_error = self._failed(step, e)

    def _complete_upload(self) -> list[tuple[int, Location]]:
        """Every rank's shards of the checkpoint in flight known uploaded: rank 0 adds its meta.pt
        and, last, the index that makes it a checkpoint, then publishes it. Every rank calls it."""
        self._agree(self._wait())
        if self.uploading is None:
            return []
        (step, target, best), self.uploading = self.uploading, None
        problem = None
        if self.rank.is_main:
            staged = self.staging / target.name
            try:
                self.bucket.put_file(staged / META, f"{target.name}/{META}")
                self.bucket.put_file(staged / INDEX, f"{target.name}/{INDEX}")
                self._point(target, best)
                shutil.rmtree(self.staging, ignore_errors=True)  # the only one staged
                log.info("checkpoint: step %d → %s", step, target, extra=FILE_ONLY)
            except Exception as e:  # noqa: BLE001  (the store's errors: reported on every rank)
                problem = self._failed(step, e)
        self._agree(problem)
        return [(step, target)]

    def _point(self, target: Remote, best: bool) -> None:
        """In a bucket, `last` (and `best`) name `target`, now complete; the old ones go."""
        for name in ("last", "best") if best else ("last",):
            self.bucket.point(name, target)
        self.bucket.prune(keep=self.cfg.checkpoint.keep)


def _bytes(state: dict[str, Any]) -> bytes:
    buffer = io.BytesIO()
    torch.save(state, buffer)
    return buffer.getvalue()
