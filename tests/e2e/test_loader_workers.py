"""Loader workers as real processes: forked from their rank, they outlive a stop signal their rank
acts on, obey their rank's own end, and give their stacks to the hang watchdog (one that never ran
its init is named, not signalled). Moved from the unit layer, which starts no process."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from hydra_ddp.runtime import hangs


def test_loader_workers_outlive_a_stop_signal_that_their_rank_acts_on():
    """A job's SIGTERM (Slurm's pre-emption, a kill of the process group) reaches the loader workers
    too: they must not die of it (torch's would), or the rank fails before its checkpoint."""
    from types import SimpleNamespace

    from torch.utils.data import DataLoader, TensorDataset

    from hydra_ddp.data.loading import loader_options

    settings = SimpleNamespace(
        num_workers=2, pin_memory=False, persistent_workers=False, prefetch_factor=1
    )
    dataset = TensorDataset(torch.arange(64.0))
    loader = DataLoader(
        dataset, batch_size=4, **loader_options(settings, seed=0, device=torch.device("cpu"))
    )
    batches = iter(loader)
    # Batches come from the workers in turn: once two are back, both workers have run their init.
    seen = [next(batches)[0], next(batches)[0]]
    for worker in batches._workers:  # type: ignore[attr-defined]
        # Every thread of the worker blocks the stop signals (read from the kernel): a thread that
        # did not (one started before the worker's init, as OpenBLAS's pool in a forked child) would
        # take a job's SIGTERM and die of torch's handler: the suite's run of cef669e saw it, once.
        unblocked = [t for t in _threads_blocking(worker.pid) if not t[1]]
        assert not unblocked, f"worker {worker.pid}'s threads with SIGTERM unblocked: {unblocked}"
        for name in ("TERM", "INT"):  # sent by another process, as scancel or a terminal sends them
            subprocess.run(["kill", "-s", name, str(worker.pid)], check=True, timeout=30)
    seen += [batch[0] for batch in batches]
    assert torch.equal(torch.cat(seen), torch.arange(64.0))


def _threads_blocking(pid: int) -> list[tuple[str, bool]]:
    """(thread id, whether it blocks SIGTERM) for each thread of a process, from /proc; the thread
    waiting for the signals in sigtimedwait counts as blocking (the kernel unblocks them for it
    while it waits: it is the one that takes them)."""
    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        fields = dict(
            line.split(":\t", 1)
            for line in (task / "status").read_text().splitlines()
            if ":\t" in line
        )
        waiting = "sigtimedwait" in (task / "wchan").read_text()
        found.append((task.name, waiting or bool(int(fields["SigBlk"], 16) >> (15 - 1) & 1)))
    return found


def test_a_process_that_leaves_live_loader_workers_still_exits():
    """Its own end of its workers (multiprocessing's SIGTERM at exit) is one they obey."""
    script = (
        "import torch\nfrom types import SimpleNamespace\nfrom torch.utils.data "
        "import DataLoader, TensorDataset\nfrom hydra_ddp.data.loading import "
        "loader_options\nsettings = SimpleNamespace(num_workers=2, "
        "pin_memory=False, persistent_workers=True, prefetch_factor=1)\noptions "
        "= loader_options(settings, seed=0, device=torch.device('cpu'))\nbatches "
        "= iter(DataLoader(TensorDataset(torch.arange(64.0)), batch_size=4, "
        "**options))\nnext(batches), next(batches)\nprint('left', "
        "len(batches._workers), flush=True)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0 and done.stdout == "left 2\n", done.stderr


def _answers_then_waits() -> None:
    hangs.answer_stack_requests()  # a loader worker's init
    threading.Event().wait(60)


@pytest.mark.parametrize("temporary_directory", ["usable", "missing"])
def test_loader_workers_give_their_stacks_and_one_that_never_ran_its_init_is_named_not_signalled(
    temporary_directory: str, monkeypatch
):
    import multiprocessing
    import signal
    import tempfile

    # a host without a writable temporary directory: the stacks' file is in memory
    if temporary_directory == "missing":
        monkeypatch.setattr(tempfile, "tempdir", "/nonexistent/tmp")
    fork = multiprocessing.get_context("fork")
    answering = fork.Process(target=_answers_then_waits, daemon=True)
    # as a worker stuck in its fork
    unstarted = fork.Process(target=time.sleep, args=(60,), daemon=True)
    for process in (answering, unstarted):
        hangs.forking_loader_worker(process)
        process.start()
    try:
        deadline = time.monotonic() + 20
        while os.fstat(answering.stacks_file.fileno()).st_size == 0 and time.monotonic() < deadline:
            time.sleep(0.02)
        dumps = hangs.loader_stacks()
        assert set(dumps) >= {answering.pid, unstarted.pid}
        assert "line" in dumps[answering.pid] and "in _answers_then_waits" in dumps[answering.pid]
        assert dumps[unstarted.pid].startswith("never started: it did not reach its init")
        assert hangs.worker_place(dumps[unstarted.pid]) == "its fork (never started)"
        # the signal ends a process without the handler
        assert unstarted.is_alive() and answering.is_alive()
    finally:
        for process in (answering, unstarted):
            os.kill(process.pid, signal.SIGKILL)
            process.join(10)
