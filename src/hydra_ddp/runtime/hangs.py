"""Finding a hung rank: each worker's watchdog leaves its stack in the run directory when it stops
making progress, and a collective's timeout is reported as which rank was stuck where.

A rank is stalled when its main thread's Python call chain has not changed for `stall_after_s`
(half the collective timeout, at most 5 minutes): no heartbeat to place in the loop, so a stall
in training, validation, a checkpoint or a user's own code is caught alike. The watchdog then
writes RUN/stacks/rankR.txt (every thread's stack, for a person), rankR.json (where, since when:
for the report) and, where the backend keeps a flight recorder (gloo: torch's, in memory),
rankR.fr (its last collectives, torch's pickle). NCCL
dumps its own recorder on a timeout, to RUN/stacks/nccl_trace_rank_R. A rank that moves again
removes its files and logs the stall. The timeout's one line is then made from every rank's
files (`describe`): `rank 1 stuck for 60 s at faulty.py:42 in forward (time.sleep(60)) ...`.

A rank stalled waiting for a batch is stuck in a loader worker, another process: the watchdog asks
its live loader workers for their stacks too, and appends them to rankR.txt. Each worker dumps
every thread's stack with faulthandler, which takes no lock of the worker's (it works in a
deadlocked one), into a file its rank opened for it before forking it (unlinked: nothing is left
on disk).
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import linecache
import logging
import multiprocessing
import os
import platform
import re
import signal
import socket
import sys
import tempfile
import threading
import time
import traceback
import weakref
from pathlib import Path
from types import CodeType, FrameType
from typing import Any, Optional

from hydra_ddp.runtime import flight_recorder, processes

log = logging.getLogger(__name__)

STACKS = "stacks"  # the folder in the run directory
# Where a rank that waits for its peers is seen from Python: (file's path ends with, function or
# None for any, what it is called in the report).
_WAITS = (
    ("hydra_ddp/parallel/shared_memory.py", None, "the shared-memory all-reduce"),
    # named by its function: all_reduce, barrier…
    ("torch/distributed/distributed_c10d.py", None, None),
    ("torch/autograd/graph.py", "_engine_run_backward", "the backward (DDP's gradient all-reduce)"),
)
# Waits written as Python loops: what they call while polling (a comprehension, a liveness check)
# is not progress, so a call chain starts at the loop's frame (without this, a sample that lands in
# one restarts the stall's clock, and a rank waiting there may never leave its stack in time).
_POLLS = (
    ("hydra_ddp/parallel/shared_memory.py", "_wait_for_all"),
    # A DataLoader waiting for a batch: a new call to its get, with a timeout, every few seconds.
    ("torch/utils/data/dataloader.py", "_get_data"),
)
_LIBRARY = (f"{os.sep}site-packages{os.sep}", f"{os.sep}lib{os.sep}python3", "<frozen ")


# A loader worker dumps its threads' stacks on this signal (a real-time one: no library's, and
# blocked nowhere; STOP_SIGNALS are the rank's to act on).
LOADER_STACKS_SIGNAL = signal.SIGRTMIN + 5 if hasattr(signal, "SIGRTMIN") else None
LOADER_STACKS_WAIT_S = 2.0  # for the workers' dumps to be written
_loader_workers: weakref.WeakSet = weakref.WeakSet()  # this rank's loader worker processes


def stall_after_s(timeout_s: float) -> float:
    """How long without progress before a rank leaves its stack: well before the collective timeout
    fires (so the stuck rank's stack is there when the waiting ones fail), and not hours."""
    return max(1.0, min(timeout_s / 2, 300.0))


class Watchdog:
    """A daemon thread that samples the main thread's call chain and dumps it once it stops
    changing."""

    def __init__(self, run_dir: Path, rank: int, stall_after: float):
        self.folder, self.rank, self.stall_after = Path(run_dir) / STACKS, rank, stall_after
        self.every = min(1.0, stall_after / 4)
        self.main = threading.main_thread().ident
        self.stop = threading.Event()
        self.dumped = False
        self.last_collective: Optional[str] = None
        self.loader_stacks: dict[int, str] = {}  # pid: its stacks
        self.thread = threading.Thread(target=self._watch, name="hydra-ddp-watchdog", daemon=True)

    def __enter__(self) -> Watchdog:
        self.thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        # not joined: it wakes within `every` and ends; a failing run must not wait on it
        self.stop.set()

    def _watch(self) -> None:
        chain, since = None, time.time()
        while not self.stop.wait(self.every):
            chain, since = self._sample(chain, since)

    def _sample(
        self, chain: Optional[tuple[int, ...]], since: float
    ) -> tuple[Optional[tuple[int, ...]], float]:
        """One look at the main thread: (its call chain, since when it has been that). The frame is
        dropped on return: held across the wait it would keep the main thread's locals alive (the
        run's loaders, whose workers then outlive the rank) after their function returned."""
        frame = sys._current_frames().get(self.main)
        now_chain = _chain(frame)
        if now_chain != chain:
            if self.dumped:
                self._moved_on(since)
            return now_chain, time.time()
        if frame is not None and time.time() - since >= self.stall_after:
            self._dump(frame, since)
        return chain, since

    def _dump(self, frame: FrameType, since: float) -> None:
        """Write (again: the time stalled grows) this rank's stack, its place, its flight recorder,
        and its loader workers' stacks (asked for once per stall)."""
        self.folder.mkdir(parents=True, exist_ok=True)
        if not self.dumped:
            self.loader_stacks = loader_stacks()
        place = where(frame)
        stalled = time.time() - since
        name = self.folder / f"rank{self.rank}"
        header = (
            f"rank {self.rank} (pid {os.getpid()}, {socket.gethostname()}): no "
            f"progress for {stalled:.0f} s, at {place['at']} in {place['function']}"
            + (f", waiting in {place['waits_in']}" if place["waits_in"] else "")
            + "\n\n"
        )
        with open(f"{name}.txt.tmp", "w") as out:
            out.write(
                header
                + "The main thread (most recent call last):\n"
                + "".join(traceback.format_stack(frame))
            )
            out.write("\nEvery thread (most recent call first; 'Current' is the watchdog's):\n")
            out.flush()
            faulthandler.dump_traceback(out, all_threads=True)
            for pid, dump in self.loader_stacks.items():
                out.write(
                    f"\nIts loader worker, pid {pid}, every "
                    f"thread (most recent call first):\n{dump}"
                )
        os.replace(f"{name}.txt.tmp", f"{name}.txt")
        # the recorder's last collective does not change while the rank is stuck
        if not self.dumped:
            self.last_collective = flight_recorder.dump(Path(f"{name}.fr"))
        _write_json(
            {
                "rank": self.rank,
                "pid": os.getpid(),
                "since": since,
                "written": time.time(),
                **place,
                "last_collective": self.last_collective,
                "loader_workers": [
                    worker_place(dump) or f"pid {pid}" for pid, dump in self.loader_stacks.items()
                ],
            },
            Path(f"{name}.json"),
        )
        self.dumped = True

    def _moved_on(self, since: float) -> None:
        """The stall ended (a long checkpoint, say): its files go, a line in the log stays."""
        log.warning(
            "rank %d made no progress for %.0f s, then moved on", self.rank, time.time() - since
        )
        for suffix in (".txt", ".json", ".fr"):
            (self.folder / f"rank{self.rank}{suffix}").unlink(missing_ok=True)
        self.dumped = False


def forking_loader_worker(process: multiprocessing.process.BaseProcess) -> None:
    """In the rank, as it forks a loader worker: the file the worker's stacks go to when asked."""
    if LOADER_STACKS_SIGNAL is None:
        return
    stacks_file = _memory_file()
    if stacks_file is not None:  # else the hang report goes without this worker's stacks
        process.stacks_file = stacks_file  # type: ignore[attr-defined]
        _loader_workers.add(process)


def _memory_file() -> Optional[Any]:
    """A file in memory (memfd: no temporary directory, which a host may lack or have read-only),
    else a temporary file, else None: a place for stacks must never stop training."""
    with contextlib.suppress(AttributeError, OSError):
        return os.fdopen(os.memfd_create("hydra-ddp-loader-stacks"), "w+b")
    with contextlib.suppress(OSError):
        return tempfile.TemporaryFile()
    return None


READY = b"ready\n"  # a loader worker's first line in its file: it can answer (its init ran)
# Python before 3.11.10 (and 3.12) can deadlock a forked child in its own fork handling, before any
# of the worker's code runs, when another thread held the interpreter's thread-list lock at the fork
# (CPython gh-112275; a C++ thread taking the GIL for the first time takes that lock).
FORK_DEADLOCK_FIXED = (3, 11, 10)


def answer_stack_requests() -> None:
    """In a loader worker (its init): every thread's stack into its file on LOADER_STACKS_SIGNAL."""
    stacks_file = getattr(multiprocessing.current_process(), "stacks_file", None)
    if stacks_file is not None:
        faulthandler.register(LOADER_STACKS_SIGNAL, file=stacks_file, all_threads=True, chain=False)
        os.write(stacks_file.fileno(), READY)


def loader_stacks() -> dict[int, str]:
    """This rank's live loader workers' stacks by pid, each asked for them (empty: none alive). A
    worker that never ran its init is not signalled (it has no handler: the signal would end it)."""
    asked, unstarted = [], {}
    for worker in list(_loader_workers):
        popen = getattr(worker, "_popen", None)
        # Not yet reaped, and still this rank's child (its pid not another process's since).
        if popen is None or popen.returncode is not None or _parent(worker.pid) != os.getpid():
            continue
        if os.fstat(worker.stacks_file.fileno()).st_size == 0:
            unstarted[worker.pid] = _never_started()
            continue
        try:
            os.kill(worker.pid, LOADER_STACKS_SIGNAL)
        except OSError:
            continue
        asked.append(worker)
    deadline, sizes = time.monotonic() + LOADER_STACKS_WAIT_S, None
    while asked and time.monotonic() < deadline:  # each dump is written within its signal's handler
        time.sleep(0.1)
        now = [os.fstat(w.stacks_file.fileno()).st_size for w in asked]
        if now == sizes and all(size > len(READY) for size in now):
            break
        sizes = now
    dumps = {
        w.pid: os.pread(w.stacks_file.fileno(), 1 << 20, len(READY)).decode(errors="replace")
        for w in asked
    }
    return {**dumps, **unstarted}


def _never_started() -> str:
    """What the report says of a forked loader worker that never reached its init."""
    cause = (
        f"; Python {platform.python_version()} can deadlock "
        "there: CPython gh-112275, fixed in 3.11.10"
    )
    return (
        "never started: it did not reach its init (stuck in "
        f"its fork{'' if fork_safe_python() else cause})\n"
    )


def fork_safe_python() -> bool:
    """Whether this Python's forked children are safe from CPython gh-112275's deadlock."""
    return sys.version_info >= FORK_DEADLOCK_FIXED


def worker_place(dump: str) -> Optional[str]:
    """A loader worker's place in its dump: the innermost frame not a library's (else the innermost)
    of the thread that runs torch's worker loop. None: no such thread in it."""
    if dump.startswith("never started"):
        return "its fork (never started)"
    for thread in dump.split("\n\n"):
        frames = re.findall(r'File "(.+)", line (\d+) in (\S+)', thread)
        if not any(function == "_worker_loop" for _, _, function in frames):
            continue
        own = [
            f for f in frames if "hydra_ddp" in f[0] or not any(part in f[0] for part in _LIBRARY)
        ]
        path, line, function = (own or frames)[0]
        return f"{Path(path).name}:{line} in {function}"
    return None


def _parent(pid: int) -> Optional[int]:
    fields = processes.proc_stat(pid)
    return int(fields[1]) if fields else None


def _chain(frame: Optional[FrameType]) -> Optional[tuple[int, ...]]:
    """The call chain's identity: its frames and their code, not the line (a waiting loop moves
    between its lines without making progress), from a polling wait's frame outward."""
    ids: list[int] = []
    while frame is not None:
        code = frame.f_code
        if any(_is(code, ending, function) for ending, function in _POLLS):
            ids = []  # the polling loop's own calls
        ids += (id(frame), id(code))
        frame = frame.f_back
    return tuple(ids) or None


def where(frame: FrameType) -> dict[str, Any]:
    """A stack's place for the report: the innermost line of the user's or the project's code (not
    a library's), its function and source text, and the collective it waits in, if any."""
    frames = []
    while frame is not None:
        frames.append(frame)
        frame = frame.f_back
    waits = [i for i, f in enumerate(frames) if _wait_name(f)]
    waits_in = _wait_name(frames[waits[0]]) if waits else None
    # A waiting rank is placed where its code called the collective, past the machinery of the wait.
    outside = frames[waits[-1] + 1 :] if waits else frames
    own = next(
        (
            f
            for f in outside
            if "hydra_ddp" in f.f_code.co_filename
            or not any(part in f.f_code.co_filename for part in _LIBRARY)
        ),
        frames[0],
    )
    code = linecache.getline(own.f_code.co_filename, own.f_lineno).split("  #")[0].strip()
    return {
        "at": f"{Path(own.f_code.co_filename).name}:{own.f_lineno}",
        "function": own.f_code.co_name,
        "code": code,
        "waits_in": waits_in,
    }


def _wait_name(frame: FrameType) -> Optional[str]:
    for ending, function, name in _WAITS:
        if _is(frame.f_code, ending, function):
            return name or frame.f_code.co_name
    return None


def _is(code: CodeType, ending: str, function: Optional[str]) -> bool:
    """Whether `code` is `function` (None: any) of a file whose path ends with `ending`."""
    return code.co_filename.replace(os.sep, "/").endswith(ending) and function in (
        None,
        code.co_name,
    )


def _write_json(value: Any, path: Path) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(value))
    os.replace(tmp, path)


def describe(run_dir: Path, timeout_s: float) -> Optional[str]:
    """A collective's timeout as one line from the ranks' stall files: the rank(s) not waiting for
    a peer, stuck where and for how long, then where the others wait. None when no rank left one
    (another node's, on storage this one does not share)."""
    folder = Path(run_dir) / STACKS
    stalls = []
    for path in sorted(
        folder.glob("rank*.json"), key=lambda p: int(p.stem[4:]) if p.stem[4:].isdigit() else -1
    ):
        try:
            stalls.append(json.loads(path.read_text()))
        except (OSError, ValueError):
            continue
    if not stalls:
        return None
    now = time.time()
    stuck = [s for s in stalls if not s.get("waits_in")]
    waiting = [s for s in stalls if s.get("waits_in")]
    parts = [
        f"rank {s['rank']} stuck for {now - s['since']:.0f} s at {s['at']} in {s['function']}"
        + (f" ({s['code']})" if s.get("code") else "")
        + (f" after collective {s['last_collective']}" if s.get("last_collective") else "")
        + (
            f", its loader worker{'s' if len(s['loader_workers']) > 1 else ''} "
            f"at {', '.join(s['loader_workers'])}"
            if s.get("loader_workers")
            else ""
        )
        + f", its stack: {folder / ('rank' + str(s['rank']) + '.txt')}"
        for s in stuck
    ]
    if waiting:
        places: dict[str, list[str]] = {}
        for s in waiting:
            at = f"{s['waits_in']} at {s['at']}" + (
                f" (collective {s['last_collective']})" if s.get("last_collective") else ""
            )
            places.setdefault(at, []).append(str(s["rank"]))
        said = "; ".join(
            f"rank{'s' if len(r) > 1 else ''} {', '.join(r)} wait{'' if len(r) > 1 else 's'} in {p}"
            for p, r in places.items()
        )
        parts.append(("the others: " if stuck else "") + said)
    return f"a collective timed out after {timeout_s:g} s (backend.timeout_s): " + "; ".join(parts)
