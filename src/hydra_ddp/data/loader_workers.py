"""The processes a DataLoader starts for a rank (data.num_workers): forked with the stop signals
blocked, dying with their rank, leaving a job's stop signals to it, and giving their stacks when the
rank's watchdog asks (runtime/hangs.py)."""

from __future__ import annotations

import multiprocessing
import os
import signal
import sys
import threading
import time

from hydra_ddp.runtime import hangs, processes
from hydra_ddp.runtime.signals import STOP_SIGNALS


class _ForkedWithStopsBlocked(multiprocessing.context.ForkProcess):
    """A loader worker forked with the stop signals blocked: every thread it starts before its init
    (OpenBLAS's pool, made again in a forked child) inherits the block, so none can take a job's
    SIGTERM and die of it (stop_signals_are_the_ranks answers them)."""

    def start(self) -> None:
        # where its stacks go should its rank stall waiting for it
        hangs.forking_loader_worker(self)
        if not hangs.fork_safe_python():
            _settle_other_threads()
        before = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
        try:
            super().start()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, before)


def _settle_other_threads() -> None:
    """Before a fork, on a Python with CPython gh-112275 (before 3.11.10): a forked child deadlocks
    if another thread held the interpreter's thread-list lock at the fork. A C++ thread takes it,
    without the GIL, when it first needs the GIL (gloo's can, to release a tensor a collective
    held). Here such a thread gets the GIL (this one sleeps a moment), and the thread list is read,
    which waits for the lock to be free. This narrows the window; only a fixed Python closes it."""
    time.sleep(0.001)
    sys._current_frames()


class _ForkBlockingStops(multiprocessing.context.ForkContext):
    Process = _ForkedWithStopsBlocked


FORK_BLOCKING_STOPS = _ForkBlockingStops()


def loader_worker_init(worker_id: int) -> None:
    """Each loader worker's init: it ends with its rank, leaves stop signals to it, and gives its
    stacks when the rank's watchdog asks (runtime/hangs.py)."""
    _dies_with_its_rank()
    stop_signals_are_the_ranks()
    hangs.answer_stack_requests()


def _dies_with_its_rank() -> None:
    """The kernel kills this worker when its rank dies (killed, crashed): torch's own check that the
    rank lives runs between batches, so a worker stuck in a read that never returns would outlive
    the run, holding its output (and the launcher's helpers) open. Linux only."""
    rank = multiprocessing.parent_process()
    if rank is not None:
        processes.die_with_parent(rank.pid)


def stop_signals_are_the_ranks() -> None:
    """In each loader worker: a stop signal from anyone but its rank is the rank's to act
    on, not the worker's. torch's workers die on SIGTERM, and a job's SIGTERM reaches them with
    their rank (Slurm's pre-emption and scancel signal every process of the step, as does a kill of
    the process group; Ctrl-C sends SIGINT to all): a dead worker would fail the rank before it
    stops at a checkpoint. The signals are blocked and answered by a thread that knows the sender:
    the rank itself (its loader's shutdown, multiprocessing's end of its children at its exit) ends
    the worker; anyone else's is left to the rank."""
    # Already blocked where the worker was forked through FORK_BLOCKING_STOPS (Linux); a worker
    # started another way (another platform's default context) inherits no mask, and blocks here.
    signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    threading.Thread(
        target=_answer_stop_signals, args=(os.getppid(),), name="hydra-ddp-stop", daemon=True
    ).start()


def _answer_stop_signals(rank_pid: int) -> None:
    while True:
        if signal.sigwaitinfo(STOP_SIGNALS).si_pid == rank_pid:
            os._exit(0)
