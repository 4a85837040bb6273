"""Test-only models that fail in chosen ranks, to exercise failure reporting through real
launchers."""

import os
import signal
import threading
from pathlib import Path
from typing import Optional

import torch.distributed as dist
from torch.utils.data import Dataset, get_worker_info

from hydra_ddp.data import digits, synthetic
from hydra_ddp.models import MnistCNN


class FailOnRank(MnistCNN):
    def __init__(self, fail_rank: int = 1, **kwargs):
        super().__init__(**kwargs)
        if dist.get_rank() == fail_rank:
            raise RuntimeError(f"injected failure in rank {fail_rank}")


class HangOnRank(MnistCNN):
    """Stops making progress in one rank after a few steps (as a deadlocked or stalled process
    would)."""

    def __init__(self, hang_rank: int = 1, after_steps: int = 3, **kwargs):
        super().__init__(**kwargs)
        self.hang_rank, self.after_steps, self.calls = hang_rank, after_steps, 0

    def forward(self, x):
        self.calls += 1
        if self.training and self.calls > self.after_steps and dist.get_rank() == self.hang_rank:
            threading.Event().wait()  # forever: only the collective timeout can end this run
        return super().forward(x)


class ChaosCNN(MnistCNN):
    """Kills its own rank with SIGKILL at a planned moment of a planned torchrun attempt.

    `chaos`: "attempt:kind:rank:n;…" — in restart attempt `attempt`, rank `rank` dies
      step  at its n-th training forward of the attempt,
      eval  at its first evaluation forward,
      ckpt  during the attempt's n-th checkpoint: rank 0 between writing the temp file and the
            rename that publishes it; another rank while rank 0 is writing.
    """

    def __init__(self, chaos: str = "", **kwargs):
        super().__init__(**kwargs)
        attempt, rank = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")), dist.get_rank()
        plans = [item.split(":") for item in chaos.split(";") if item]
        self.plan = next(
            ((kind, int(n)) for a, kind, r, n in plans if int(a) == attempt and int(r) == rank),
            None,
        )
        self.calls = 0
        if self.plan and self.plan[0] == "ckpt":
            self._die_in_checkpoint(rank, self.plan[1])

    def forward(self, x):
        if self.plan:
            kind, n = self.plan
            if kind == "step" and self.training:
                self.calls += 1
                if self.calls == n:
                    _die()
            elif kind == "eval" and not self.training:
                _die()
        return super().forward(x)

    @staticmethod
    def _die_in_checkpoint(rank: int, n: int) -> None:
        from hydra_ddp.checkpoint import checkpointer as checkpointing

        seen = [0]
        if rank == 0:
            real_replace = os.replace

            def replace(src, dst, *args, **kwargs):
                if str(src).endswith(".tmp") and Path(dst).name.startswith("step-"):
                    seen[0] += 1
                    if seen[0] == n:
                        _die()  # the new checkpoint is written, not yet published
                return real_replace(src, dst, *args, **kwargs)

            os.replace = replace
        else:
            real_first_error = checkpointing.first_error

            def first_error(problem, device):  # rank 0 is writing; this rank waits for its verdict
                seen[0] += 1
                if seen[0] == n:
                    _die()
                return real_first_error(problem, device)

            checkpointing.first_error = first_error


def _die():
    os.kill(os.getpid(), signal.SIGKILL)


class AbortAtExit(MnistCNN):
    """Trains normally; rank `abort_rank` then aborts (SIGABRT) as its interpreter starts to shut
    down: a non-daemon thread waits for the main thread to finish and kills the process."""

    def __init__(self, abort_rank: int = 1, **kwargs):
        super().__init__(**kwargs)
        if dist.get_rank() == abort_rank:
            threading.Thread(target=self._abort_after_main, name="abort-at-exit").start()

    @staticmethod
    def _abort_after_main():
        threading.main_thread().join()
        os.kill(os.getpid(), signal.SIGABRT)


class Recorder(MnistCNN):
    """Writes a checksum of this rank's weights at every forward, tagged train or eval
    (log_dir/params-rank<R>.txt): the evaluations separate the epochs."""

    def __init__(self, log_dir: str, **kwargs):
        super().__init__(**kwargs)
        self.log_dir = Path(log_dir)

    def forward(self, x):
        total = sum(p.detach().double().sum().item() for p in self.parameters())
        with open(self.log_dir / f"params-rank{dist.get_rank()}.txt", "a") as f:
            f.write(f"{'train' if self.training else 'eval'} {total!r}\n")
        return super().forward(x)


class _Counted(Dataset):
    """A dataset that appends each index it serves to log_dir/samples-rank<R>.txt."""

    def __init__(self, inner, log_dir: str):
        self.inner, self.log_dir = inner, Path(log_dir)

    def __len__(self):
        return len(self.inner)

    def __getitem__(self, index):
        with open(self.log_dir / f"samples-rank{dist.get_rank()}.txt", "a") as f:
            f.write(f"{index}\n")
        return self.inner[index]


def counted_synthetic(log_dir: str, **kwargs):
    """Synthetic data whose training samples are counted. The validation split is its own (the
    test samples), not carved from the training set: only training reads are counted."""
    train, test = synthetic(**kwargs)
    return _Counted(train, log_dir), test, test


class FailThenAbort(MnistCNN):
    """At its second training forward rank `fail_rank` raises (as a CUDA out-of-memory would), and
    every other rank, once that rank's process is gone, aborts (SIGABRT), as NCCL's watchdog ends
    the ranks left waiting for a dead peer: the launcher sees both kinds of failure at once."""

    def __init__(self, fail_rank: int = 1, **kwargs):
        super().__init__(**kwargs)
        self.fail_rank, self.calls = fail_rank, 0
        self.pids = [None] * dist.get_world_size()
        dist.all_gather_object(self.pids, os.getpid())

    def forward(self, x):
        if self.training:
            self.calls += 1
            if self.calls == 2:
                if dist.get_rank() == self.fail_rank:
                    raise RuntimeError("injected failure: out of memory on this rank")
                while _alive(self.pids[self.fail_rank]):
                    threading.Event().wait(0.001)
                os.abort()
        return super().forward(x)


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has exited


class _HangsInLoaderWorker(Dataset):
    """A dataset whose samples never come in one rank's loader workers: they wait in __getitem__
    for ever, as a deadlocked worker does (the rank's own reads, outside a worker, are served)."""

    def __init__(self, inner, hangs: bool):
        self.inner, self.hangs = inner, hangs

    def __len__(self):
        return len(self.inner)

    def __getitem__(self, index):
        if self.hangs and get_worker_info() is not None:
            threading.Event().wait()  # as a deadlocked loader worker
        return self.inner[index]


def digits_hanging_in_loader(hang_rank: int, **kwargs):
    """The default digits, their training samples never served by rank `hang_rank`'s loader
    workers."""
    train, test = digits(**kwargs)
    return _HangsInLoaderWorker(train, dist.get_rank() == hang_rank), test, test


class DiesUploading(MnistCNN):
    """Rank `rank` kills the whole run (SIGKILL to its process group, as a lost node would) halfway
    through uploading the `n`-th checkpoint to a bucket (checkpoint.dir=s3://…): half of the object
    (a file, or this rank's shard) sent as the first part of a multipart upload, which the store
    never shows as an object, and nothing more. Not in a continued run (`resume`: support.ONCE)."""

    def __init__(self, n: int, rank: int = 0, resume: Optional[str] = None, **kwargs):
        super().__init__(**kwargs)
        if resume is not None or dist.get_rank() != rank:
            return
        from hydra_ddp.checkpoint.remote import Bucket

        put, put_file, started = Bucket.put, Bucket.put_file, []

        def killed_halfway(bucket: Bucket, name: str, payload: bytes) -> None:
            checkpoint = name.split("/")[0]
            if checkpoint not in started:
                started.append(checkpoint)
            if len(started) == n:
                bucket_name, _, key = bucket._key(name).partition("/")
                upload = bucket.fs.call_s3("create_multipart_upload", Bucket=bucket_name, Key=key)
                bucket.fs.call_s3(
                    "upload_part",
                    Bucket=bucket_name,
                    Key=key,
                    PartNumber=1,
                    UploadId=upload["UploadId"],
                    Body=payload[: len(payload) // 2],
                )
                os.killpg(os.getpgrp(), signal.SIGKILL)

        def put_step(bucket: Bucket, name: str, payload) -> None:
            if name.startswith("step-") and "/" not in name:  # a whole-file checkpoint
                killed_halfway(bucket, name, bytes(payload))
            put(bucket, name, payload)

        def put_shard(bucket: Bucket, local, name: str) -> None:
            if name.startswith("step-") and name.endswith(".distcp"):  # this rank's shard
                killed_halfway(bucket, name, Path(local).read_bytes())
            put_file(bucket, local, name)

        Bucket.put, Bucket.put_file = put_step, put_shard


class DeletesBucket(MnistCNN):
    """At rank 0's `step`-th training forward, the S3 bucket `bucket` is emptied and deleted (an
    operator's mistake, a lifecycle rule): every later write there fails, and no retry helps."""

    def __init__(self, bucket: str, step: int, **kwargs):
        super().__init__(**kwargs)
        self.bucket, self.step, self.calls = bucket, step, 0

    def forward(self, x):
        if self.training and dist.get_rank() == 0:
            self.calls += 1
            if self.calls == self.step:
                import boto3

                bucket = boto3.resource("s3").Bucket(self.bucket)
                for _ in range(100):  # the run's writer may add an object between the two
                    bucket.objects.all().delete()
                    try:
                        bucket.delete()
                        break
                    except bucket.meta.client.exceptions.ClientError:
                        continue
        return super().forward(x)
