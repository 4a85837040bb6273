"""A run directory held by the run that writes into it, so that a second live run is refused there
instead of interleaving its log, checkpoints and metrics with the first's (an explicit
hydra.run.dir given twice; the default's names are new per run: rundir.claim_new).

The holder is the launching process (or rank 0 of an outside launch): a file in the run directory
names its pid, host and start time while it runs. It is taken before Hydra writes the command's
.hydra/ record (a Hydra callback), made whole in one step (linked from a file already written, so
no other run ever reads it half-written), and given up when the command ends. A holder that is
gone (killed without a word, its pid ended or reused) holds nothing: the next run takes the
directory over, as `trainer.resume` into it expects.

A checkpoint.dir elsewhere (a path, or a bucket's URL, which runs in other run directories may
name) is held alike, by the same record: a bucket's lock object is written only where none is (a
conditional write), and what a holder of another host left there is taken over with a warning.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import socket
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Optional

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from hydra_ddp.checkpoint import remote
from hydra_ddp.errors import UserError
from hydra_ddp.launch import startup
from hydra_ddp.runtime import processes, ranks

log = logging.getLogger(__name__)

LOCK = ".hydra-ddp.lock"


def _me() -> dict[str, Any]:
    """This command's process (a warm start's fork holds for its command: startup.command_pid)."""
    pid = startup.command_pid or os.getpid()
    return {"pid": pid, "host": socket.gethostname(), "started": _started(pid)}


def _started(pid: int) -> Optional[str]:
    """A process's start time (clock ticks since boot): a pid and its start time name one
    process."""
    fields = processes.proc_stat(pid)
    return fields[19] if fields and len(fields) > 19 else None


def _alive(holder: dict[str, Any]) -> bool:
    """Whether the process a lock names still runs (here: on this host)."""
    return _started(int(holder.get("pid", -1))) == holder.get("started") is not None


def _holder(path: Path) -> Optional[dict[str, Any]]:
    """What a lock file says of its holder; None where there is none ({} where it cannot be
    read)."""
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return {}


def in_use(run_dir: Path) -> Optional[str]:
    """Why `run_dir` may not take this run: another live run of this host holds it (else None)."""
    holder = _holder(Path(run_dir) / LOCK)
    if holder and holder != _me() and holder.get("host") == socket.gethostname() and _alive(holder):
        return (
            f"hydra.run.dir={run_dir} is in use by a live run (pid "
            f"{holder['pid']}): two runs in one directory would write into each "
            "other's log, checkpoints and metrics; choose another hydra.run.dir, "
            "or continue this one with trainer.resume=auto once that run has ended"
        )
    return None


def take(run_dir: Path) -> None:
    """Hold `run_dir` for this process (until release or its exit); one line where a live run holds
    it."""
    path, me = Path(run_dir) / LOCK, _me()
    if _holder(path) == me:
        return  # ours already (the callback took it before the run)
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    written = path.with_name(f"{LOCK}.{os.getpid()}")
    written.write_text(json.dumps(me))
    try:
        for _ in range(3):  # a lock found stale is removed, and the link tried again
            try:
                os.link(written, path)  # the whole lock appears at once, or not at all
                break
            except FileExistsError:
                _take_over(path, run_dir)
        else:
            raise UserError(
                f"hydra.run.dir={run_dir}: another run keeps taking {path}; start this one again"
            )
    finally:
        written.unlink(missing_ok=True)
    atexit.register(release, run_dir)  # a command that ends another way than through held()


def release(run_dir: Path) -> None:
    """Give `run_dir` up, if this process holds it."""
    path = Path(run_dir) / LOCK
    with contextlib.suppress(OSError):
        if _holder(path) == _me():
            path.unlink()


@contextlib.contextmanager
def held(run_dir: Path, checkpoint_dir: Optional[str] = None) -> Iterator[None]:
    """Hold `run_dir` while the run lasts (taking it, unless the callback already did), and
    checkpoint.dir where it names a folder of its own."""
    take(run_dir)
    try:
        if checkpoint_dir is None:
            yield
        elif remote.is_url(checkpoint_dir):
            with _bucket_held(remote.Bucket(checkpoint_dir)):
                yield
        else:
            folder = remote.local_path(checkpoint_dir)
            if folder != Path(run_dir).resolve():
                _take_folder(folder, checkpoint_dir)
            try:
                yield
            finally:
                release(folder)
    finally:
        release(run_dir)


def _take_folder(folder: Path, setting: str) -> None:
    try:
        take(folder)
    except UserError as e:
        message = str(e).replace(f"hydra.run.dir={folder}", f"checkpoint.dir={setting}")
        raise UserError(message) from None


@contextlib.contextmanager
def _bucket_held(bucket: remote.Bucket) -> Iterator[None]:
    me = json.dumps(_me(), sort_keys=True)
    for _ in range(3):
        if bucket.create(remote.LOCK, me.encode()):
            break
        _take_over_bucket(bucket)
    else:
        raise UserError(f"checkpoint.dir={bucket.url}: another run keeps taking it; start again")
    try:
        yield
    finally:
        with contextlib.suppress(Exception):  # a store gone by the end: its holder is gone too
            if bucket.read_text(remote.LOCK) == me:
                bucket.remove(remote.LOCK)


def _take_over_bucket(bucket: remote.Bucket) -> None:
    """Remove a bucket's lock whose holder is gone; refuse where a live run of this host holds
    it."""
    text = bucket.read_text(remote.LOCK)
    if text is None:
        return  # released meanwhile
    try:
        holder = json.loads(text)
    except ValueError:
        holder = {}
    if holder.get("host") == socket.gethostname() and _alive(holder):
        raise UserError(
            f"checkpoint.dir={bucket.url} is in use by a live run (pid {holder['pid']}): two runs "
            "would publish and prune each other's checkpoints there; give this run another "
            "checkpoint.dir, or continue that one with trainer.resume=auto once it has ended"
        )
    if holder.get("host") not in (None, socket.gethostname()):
        log.warning(
            "%s was held by a run on host %s, which this host cannot see: taking it over (two "
            "live runs would publish and prune each other's checkpoints)",
            bucket.url,
            holder["host"],
        )
    bucket.remove(remote.LOCK)


class RefuseHeld(Callback):
    """Hydra callback (conf/config.yaml): the run directory is taken before Hydra writes this
    command's .hydra/ record, so a second run is refused before it writes over the first's."""

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        found = ranks.external_launch()
        if (found and not found[1].is_main) or config.launcher.node_rank or startup.checking():
            return  # not the rank, nor the node, that holds it; --check launches nothing
        try:
            take(Path(str(config.hydra.run.dir)))
        except UserError as problem:
            print(f"hydra-ddp: error: {problem}", file=sys.stderr)
            sys.exit(2)


def _take_over(path: Path, run_dir: Path) -> None:
    """Remove a lock whose holder is gone; refuse where a live run on this host holds it."""
    problem = in_use(run_dir)
    if problem:
        raise UserError(problem)
    holder = _holder(path)
    if holder is None:
        return  # released meanwhile
    if holder.get("host") not in (None, socket.gethostname()):
        log.warning(
            "%s was held by a run on host %s, which this host cannot see: taking it "
            "over (two live runs in one directory would write into each other's files)",
            run_dir,
            holder["host"],
        )
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
