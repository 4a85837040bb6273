"""Files that a crash never leaves torn: rank 0's background writer, atomic writes, links and
directory swaps, fsync'd; the state snapshot a write takes."""

from __future__ import annotations

import errno
import io
import os
import queue
import shutil
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch


class Writer:
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


def snapshot(value: Any) -> Any:
    """The state with each tensor copied to host memory (a GPU's too: the writer thread never
    touches the device), containers rebuilt around the copies."""
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return {key: snapshot(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        items = [snapshot(item) for item in value]
        # a namedtuple's fields
        return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
    return value


def serialize(state: dict[str, Any], directory: Path) -> memoryview:
    """The state as bytes, in memory: its size is known before the disk is touched, and a disk that
    cannot hold it is named with the space needed instead of leaving a torn temp file."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    payload = buffer.getbuffer()
    free = shutil.disk_usage(directory).free
    if free < len(payload):
        raise OSError(
            errno.ENOSPC,
            f"not enough space: it needs {mb(len(payload))}, "
            f"{mb(free)} free on the file system of {directory}",
        )
    return payload


def atomic_write(payload: memoryview, target: Path) -> None:
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
            raise OSError(
                errno.ENOSPC, f"no space left writing {target.name}: it needs {mb(len(payload))}"
            ) from None
        raise
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(target.parent)


def mb(size: int) -> str:
    return f"{size / 2**20:.1f} MiB"


def atomic_symlink(name: str, link: Path) -> None:
    """`link` → `name` (relative: the folder may move), replacing what was there in one step."""
    tmp = link.with_name(f".{link.name}.{os.getpid()}.tmp")
    tmp.unlink(missing_ok=True)
    os.symlink(name, tmp)
    os.replace(tmp, link)
    fsync_dir(link.parent)


def replace_dir(source: Path, target: Path) -> None:
    """Rename a whole directory into place; one there already (the same step) is moved aside
    first."""
    if target.exists():
        aside = target.with_name(f".{target.name}.old")
        shutil.rmtree(aside, ignore_errors=True)
        os.replace(target, aside)
        os.replace(source, target)
        shutil.rmtree(aside)
    else:
        os.replace(source, target)
    fsync_dir(target)
    fsync_dir(target.parent)


def remove_leftovers(folder: Path) -> None:
    """What a writer killed mid-write left: temp files, and half-written shard directories."""
    for leftover in [*folder.glob(".*.tmp"), *folder.glob(".*.old")]:
        if leftover.is_dir() and not leftover.is_symlink():
            shutil.rmtree(leftover, ignore_errors=True)
        else:
            leftover.unlink(missing_ok=True)


def first_failure(error: BaseException) -> BaseException:
    """DCP's CheckpointException holds every rank's failure: the lowest rank's."""
    failures = getattr(error, "failures", None) or {}
    for rank in sorted(failures):
        failure = failures[rank]
        return failure[0] if isinstance(failure, tuple) else failure
    return error


def atomic_link(source: Path, link: Path) -> None:
    tmp = link.with_name(f".{link.name}.{os.getpid()}.tmp")
    tmp.unlink(missing_ok=True)
    os.link(source, tmp)
    os.replace(tmp, link)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def publish(folder: Path, target: Path, best: bool, keep: int) -> None:
    """`target` becomes last (and best); one kind of each at a time, then all but the newest `keep`
    step checkpoints go. best.pt and last.pt are hard links: removing an old step file never
    removes them. `best` is a symbolic link: the directory it names stays."""
    from hydra_ddp.checkpoint.files import step_checkpoints

    for name in ("last", "best") if best else ("last",):
        if target.is_dir():
            atomic_symlink(target.name, folder / name)
            (folder / f"{name}.pt").unlink(missing_ok=True)
        else:
            atomic_link(target, folder / f"{name}.pt")
            if (folder / name).is_symlink():
                (folder / name).unlink()
    kept_best = (folder / "best").resolve() if (folder / "best").is_symlink() else None
    for old in step_checkpoints(folder)[:-keep]:
        if old.is_dir():
            if old.resolve() != kept_best:
                shutil.rmtree(old)
        else:
            old.unlink()
