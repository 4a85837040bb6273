"""DDP's gradient all-reduce through shared memory, for CPU ranks on one host
(`strategy.shared_memory`).

gloo sends a CPU all-reduce through loopback TCP: beside training ranks its threads and theirs wake
each other through the scheduler, and the wait is a large share of a small model's step. Ranks that
share a host can instead meet in one shared segment: each writes its share of the gradients into its
own slot, says so in its own counter, and once every counter has moved, sums the slots itself. That
is two copies of the gradients in memory and no socket (its speed-up: bench/results/REPORT.md).

- The sum is rank 0's share + rank 1's + … in that order on every rank, each share divided by the
  world size first, as DDP's own all-reduce does: at 2 ranks bit-identical to gloo's
  (a + b == b + a), at more ranks within float tolerance of gloo's ring, and the same under every
  launcher.
- DDP hands over its buckets one by one during the backward; they are summed together when the
  last arrives (one meeting per step: on a busy CPU, overlapping the all-reduce with the backward
  gains nothing, and each meeting waits for the slowest rank).
- The segment holds two slots per rank, used in turn, so a rank may write the next share while a
  slower one still reads the last; gradients larger than a slot go through in slot-sized chunks.
- Rank 0 makes it once every rank has come to the set-up, and unlinks it from its tmpfs as soon as
  every rank has mapped it (or failed to): the memory goes back when the last rank exits. A rank 0
  killed within that fraction of a second leaves one behind, removed by a later run's rank 0.
- A rank waits spinning, then yielding its core, then sleeping in short naps; it stops with an
  error when a peer exits while it waits, or after backend.timeout_s.
- x86-64 only: its stores are seen by other cores in the order they were made, so a counter never
  moves before the data it announces is visible.
"""

from __future__ import annotations

import mmap
import os
import platform
import secrets
import time
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist

from hydra_ddp.errors import UserError
from hydra_ddp.runtime import processes

PREFIX = "hydra-ddp-"  # then rank 0's pid and a random part
STALE_S = 60
SLOT_BYTES = 8 << 20  # per rank and half: a larger gradient goes through in chunks of this size


def shm_dir() -> Path:
    """Where the segment lives: a tmpfs. HYDRA_DDP_SHM_DIR names another where /dev/shm is small
    (Docker's default is 64 MB; the segment is 2 × world size × the gradients' bytes, at most 8 MB
    each). Read when a segment is made, not at import: a process forked from one that imported
    this module (a warm start's fork) lives with its own command's environment."""
    return Path(os.environ.get("HYDRA_DDP_SHM_DIR", "/dev/shm"))


LINE = 64  # bytes: each rank's counter on its own cache line
TOKEN_BYTES = 16
SPINS = 200  # checks before yielding the core
YIELDS = 2000  # then yields before napping
NAP_S = 50e-6
LIVENESS_EVERY_S = 0.5  # while waiting: are the ranks we wait for still alive?


def unavailable(backend: str, device: str, world_size: int, local_world_size: int) -> list[str]:
    """Why the shared-memory all-reduce cannot serve this run (empty: it can). The config-level
    conditions (DDP, no comm hook, even shards, no compile) are checked by
    parallel/strategies/ddp.py."""
    reasons = []
    if device != "cpu":
        reasons.append(f"it sums CPU tensors (this run is on {device})")
    if local_world_size != world_size:
        reasons.append(f"not every rank is on this host ({local_world_size} of {world_size})")
    if platform.machine().lower() not in ("x86_64", "amd64"):
        reasons.append(f"it relies on x86-64's store order (this is {platform.machine()})")
    if not shm_dir().is_dir():
        reasons.append(f"{shm_dir()} does not exist")
    if backend not in ("gloo", "mpi"):
        reasons.append(f"backend {backend} (gloo or mpi only)")
    return reasons


class SharedMemoryAllReduce:
    """A DDP communication hook summing the buckets through one shared segment."""

    def __init__(
        self, group: Any, gradient_bytes: int, timeout_s: float, traffic: Optional[Any] = None
    ):
        self.group, self.traffic = group, traffic  # comm.Traffic: the bytes summed, counted
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        self.timeout_s = timeout_s
        self.slot = min(SLOT_BYTES, -(-max(gradient_bytes, 1) // LINE) * LINE)
        self.head = LINE * (self.world + 1)  # the counters, then rank 0's token
        self.size = self.head + 2 * self.world * self.slot
        self.memory, self.pids = self._map()
        # 8 per line: rank r's at r·8
        self.counters = memoryview(self.memory)[: LINE * self.world].cast("q")
        data = torch.frombuffer(
            self.memory, dtype=torch.uint8, offset=self.head, count=2 * self.world * self.slot
        )
        self.slots = data.view(2, self.world, self.slot)  # [turn, rank, bytes]
        self.meetings = 0
        self.pending: list[tuple[torch.Tensor, torch.futures.Future]] = []

    # --- set-up: one segment, mapped by every rank, or an error on every rank -------------------
    def _map(self) -> tuple[mmap.mmap, dict[int, tuple[int, str]]]:
        """The mapped segment, and the other ranks' (pid, start time) where this rank can see their
        /proc entries (its liveness checks)."""
        # Every rank is here before rank 0 creates anything: a rank that failed earlier leaves no
        # segment.
        named = [
            str(shm_dir() / f"{PREFIX}{os.getpid()}-{secrets.token_hex(6)}"),
            secrets.token_bytes(TOKEN_BYTES),
        ]
        dist.broadcast_object_list(named, src=0, group=self.group)
        name, token = named
        created = self.rank == 0
        try:
            problem, memory = self._create(name, token) if created else ("", None)
            shared = [problem]
            # the others wait until it exists
            dist.broadcast_object_list(shared, src=0, group=self.group)
            problem = shared[0]
            if not problem and not created:
                problem, memory = self._open(name, token)
            everyone: list[Any] = [None] * self.world
            dist.all_gather_object(
                everyone, (problem, os.getpid(), _started(os.getpid())), group=self.group
            )
        finally:
            if created:
                Path(name).unlink(missing_ok=True)  # every rank has mapped it, or never will
        problems = [p for p, _, _ in everyone if p]
        if problems:
            raise SharedMemoryUnavailable(problems[0])
        assert memory is not None
        peers = {
            r: (pid, started)
            for r, (_, pid, started) in enumerate(everyone)
            if r != self.rank and started and _started(pid) == started
        }
        return memory, peers

    def _create(self, name: str, token: bytes) -> tuple[str, Optional[mmap.mmap]]:
        _remove_stale()
        fd = -1
        try:
            fd = os.open(name, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            # tmpfs reserves the pages now: ENOSPC here, not SIGBUS later
            os.posix_fallocate(fd, 0, self.size)
            memory = mmap.mmap(fd, self.size)
        except OSError as e:
            return f"cannot create {self.size} bytes in {shm_dir()}: {e.strerror or e}", None
        finally:
            if fd >= 0:
                os.close(fd)
        memory[self.head - LINE : self.head - LINE + TOKEN_BYTES] = token
        return "", memory

    def _open(self, name: str, token: bytes) -> tuple[str, Optional[mmap.mmap]]:
        try:
            fd = os.open(name, os.O_RDWR)
        except OSError as e:
            return (
                f"rank {self.rank} cannot open {name}: {e.strerror or e} "
                "(its own /dev/shm: another host or container?)",
                None,
            )
        try:
            memory = mmap.mmap(fd, self.size)
        except OSError as e:
            return f"rank {self.rank} cannot map {name}: {e.strerror or e}", None
        finally:
            os.close(fd)
        if memory[self.head - LINE : self.head - LINE + TOKEN_BYTES] != token:
            return (
                f"rank {self.rank} opened another {name} (its own /dev/shm: another container?)",
                None,
            )
        return "", memory

    # --- the hook ---------------------------------------------------------------------------------
    # DDP checks the hook's annotations against its own types: none here (this module's are
    # strings).
    def hook(self, state, bucket):  # noqa: ANN001, ANN201
        buffer = bucket.buffer()
        if buffer.is_sparse or not buffer.is_contiguous():
            raise UserError(
                "strategy.shared_memory sums dense gradients only (this model has sparse ones); "
                "set strategy.shared_memory=false"
            )
        if self.traffic is not None:
            self.traffic.count(buffer, step_done=bucket.is_last())
        done: torch.futures.Future = torch.futures.Future()
        self.pending.append((buffer, done))
        if bucket.is_last():
            pending, self.pending = self.pending, []
            for buffer_, _ in pending:
                self._all_reduce(buffer_)
            for buffer_, future in pending:
                future.set_result(buffer_)
        return done

    def _all_reduce(self, tensor: torch.Tensor) -> None:
        flat = tensor.view(-1)
        per_chunk = self.slot // flat.element_size()
        for start in range(0, flat.numel(), per_chunk):
            chunk = flat[start : start + per_chunk]
            self.meetings += 1
            slots = self.slots[self.meetings % 2, :, : chunk.numel() * chunk.element_size()].view(
                chunk.dtype
            )
            # Each share divided first, as DDP's own all-reduce does, straight into this rank's
            # slot; then the slots summed in rank order straight into the bucket: two passes over
            # the gradients, where a divide in place, a copy in, a copy out and an add took four.
            torch.div(chunk, self.world, out=slots[self.rank])
            self.counters[self.rank * 8] = self.meetings  # after the data: x86-64 keeps the order
            self._wait_for_all(self.meetings)
            if self.world == 1:
                chunk.copy_(slots[0])
            else:
                torch.add(slots[0], slots[1], out=chunk)
            for other in range(2, self.world):
                chunk.add_(slots[other])

    def _wait_for_all(self, meeting: int) -> None:
        counters, world = self.counters, self.world
        checks, since, check_liveness_at = 0, 0.0, 0.0
        while True:
            behind = [r for r in range(world) if counters[r * 8] < meeting]
            if not behind:
                return
            checks += 1
            if checks <= SPINS:
                continue
            now = time.monotonic()
            if not since:
                since, check_liveness_at = now, now + LIVENESS_EVERY_S
            elif now >= check_liveness_at:
                self._check_alive(behind)
                check_liveness_at = now + LIVENESS_EVERY_S
                if now - since > self.timeout_s:
                    names = ", ".join(str(r) for r in behind)
                    raise RuntimeError(
                        f"timed out after {self.timeout_s:g} s (backend.timeout_s) "
                        f"waiting for rank(s) {names} at the gradient all-reduce"
                    )
            if checks <= SPINS + YIELDS:
                os.sched_yield()
            else:
                time.sleep(NAP_S)

    def _check_alive(self, ranks: list[int]) -> None:
        for r in ranks:
            if r in self.pids and _started(self.pids[r][0]) != self.pids[r][1]:
                raise RuntimeError(
                    f"rank {r} (pid {self.pids[r][0]}) exited during the gradient all-reduce"
                )


class SharedMemoryUnavailable(RuntimeError):
    pass


def _remove_stale() -> None:
    """Segments left by a rank 0 killed while the others were still mapping (a fraction of a second
    after it made them): their creator is gone, and they are older than any set-up in progress."""
    for path in shm_dir().glob(f"{PREFIX}*"):
        try:
            pid = int(path.name[len(PREFIX) :].split("-", 1)[0])
            if not Path(f"/proc/{pid}").exists() and time.time() - path.stat().st_mtime > STALE_S:
                path.unlink()
        except (ValueError, OSError):
            continue


def _started(pid: int) -> str:
    """A process's start time (/proc/PID/stat, field 22); "" when it is gone, a zombie, or not
    visible."""
    fields = processes.proc_stat(pid)
    return "" if not fields or fields[0] in ("Z", "X") else fields[19]
