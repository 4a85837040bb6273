"""reporting.hangs in one process: the watchdog leaves the main thread's stack when it stalls and
removes it when it moves on; a stack's place; the timeout's line from the ranks' files."""

from __future__ import annotations

import json
import os
import sys
import threading
import time
import types
from pathlib import Path

import pytest

from hydra_ddp.parallel.shared_memory import SharedMemoryAllReduce, _started
from hydra_ddp.runtime import hangs


def _stalled_here(seconds: float) -> None:
    threading.Event().wait(seconds)  # the main thread makes no progress, as a hung rank's


def test_the_watchdog_dumps_a_stalled_main_thread_and_clears_it_when_it_moves_on(tmp_path: Path):
    stacks = tmp_path / hangs.STACKS
    seen: dict[str, str] = {}

    def read_while_stalled() -> None:  # the main thread cannot: it is the one stalled
        while not (stacks / "rank3.json").exists():
            time.sleep(0.02)
        seen.update(
            json=(stacks / "rank3.json").read_text(), text=(stacks / "rank3.txt").read_text()
        )

    reader = threading.Thread(target=read_while_stalled, daemon=True)
    with hangs.Watchdog(tmp_path, 3, stall_after=0.4) as dog:
        reader.start()
        _stalled_here(1.5)
        reader.join(timeout=5)
        place, text = json.loads(seen["json"]), seen["text"]
        # Moving on again (this loop's calls change the chain), the files go.
        deadline = time.monotonic() + 5
        while (stacks / "rank3.json").exists() and time.monotonic() < deadline:
            sum(range(1000))
    assert not (stacks / "rank3.json").exists() and not (stacks / "rank3.txt").exists()
    assert place["rank"] == 3 and place["function"] == "_stalled_here" and place["waits_in"] is None
    assert place["at"] == f"test_hangs.py:{_stalled_here.__code__.co_firstlineno + 1}"
    # no group here
    assert place["code"] == "threading.Event().wait(seconds)" and place["last_collective"] is None
    assert text.startswith("rank 3 (pid ") and "The main thread (most recent call last):" in text
    assert "in _stalled_here" in text and "Every thread" in text
    assert dog.stop.is_set()


def _descend(depth: int, until: float) -> None:
    """Busy, and progressing: each level a call deeper than the last, so two samples a moment apart
    see different chains (a loop calling one function does not: its new frame may reuse the old
    one's address, and samples land alike at the loop's own line, the same chain each time)."""
    sum(range(2000))  # a moment of work at this level
    if depth < 400 and time.monotonic() < until:
        _descend(depth + 1, until)


def test_a_busy_main_thread_is_not_stalled(tmp_path: Path):
    # A second without progress is a stall here: longer than a busy machine keeps a thread off its
    # core.
    with hangs.Watchdog(tmp_path, 0, stall_after=1.0):
        end = time.monotonic() + 3
        while time.monotonic() < end:
            _descend(0, end)
    assert not (tmp_path / hangs.STACKS).exists()


def _polling_wait(timeout_s: float, on_liveness_check=None) -> types.SimpleNamespace:
    """The shared-memory all-reduce's own wait loop (rank 0 of 2; rank 1 never comes), run here, on
    this thread. Its liveness check reads this process's /proc entry, as a rank's reads its
    peers'."""
    me = types.SimpleNamespace(
        counters=[0] * 16,
        world=2,
        timeout_s=timeout_s,
        pids={1: (os.getpid(), _started(os.getpid()))},
    )

    def check_alive(ranks: list[int]) -> None:
        SharedMemoryAllReduce._check_alive(me, ranks)
        if on_liveness_check:
            on_liveness_check(me)

    me._check_alive = check_alive
    me.counters[0] = 1  # rank 0 has written its share
    return me


def test_a_polling_waits_own_calls_are_the_same_chain_as_its_loop():
    """What the shared-memory wait calls while it polls (its comprehension, the liveness check) is
    not progress: a sample that lands there is the same call chain as one in the loop itself (else a
    rank waiting there restarts its stall clock, and may not leave its stack before the timeout)."""
    seen = []

    def look(me: types.SimpleNamespace) -> None:
        inner, loop = sys._getframe(0), sys._getframe(2)  # look ← check_alive ← _wait_for_all
        assert loop.f_code is SharedMemoryAllReduce._wait_for_all.__code__
        seen.append((hangs._chain(inner), hangs._chain(loop)))
        me.counters[8] = 1  # rank 1 arrives: the wait ends

    me = _polling_wait(timeout_s=30, on_liveness_check=look)
    SharedMemoryAllReduce._wait_for_all(me, 1)
    assert len(seen) == 1 and seen[0][0] == seen[0][1]


def test_a_rank_in_the_shared_memory_wait_leaves_its_stack_before_the_timeout(tmp_path: Path):
    stacks = tmp_path / hangs.STACKS
    places = []

    def read_while_waiting() -> None:
        while not (stacks / "rank0.json").exists():
            time.sleep(0.02)
        places.append(json.loads((stacks / "rank0.json").read_text()))

    reader = threading.Thread(target=read_while_waiting, daemon=True)
    with hangs.Watchdog(tmp_path, 0, stall_after=0.4):
        reader.start()
        with pytest.raises(RuntimeError, match="timed out after 2 s"):
            SharedMemoryAllReduce._wait_for_all(_polling_wait(timeout_s=2), 1)
        reader.join(timeout=5)
    assert places and places[0]["waits_in"] == "the shared-memory all-reduce", places


def test_the_stall_threshold_comes_well_before_the_timeout():
    assert (
        hangs.stall_after_s(5) == 2.5
        and hangs.stall_after_s(1800) == 300
        and hangs.stall_after_s(1) == 1
    )


def _write(folder: Path, rank: int, **place) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"rank{rank}.json").write_text(
        json.dumps({"rank": rank, "since": time.time() - 61, **place})
    )


def test_the_timeout_names_the_stuck_rank_first_then_where_the_others_wait(tmp_path: Path):
    stacks = tmp_path / hangs.STACKS
    wait = {
        "at": "step.py:59",
        "function": "run",
        "code": "loss.backward()",
        "waits_in": "all_reduce",
        "last_collective": "#13 gloo:all_reduce",
    }
    for rank in (0, 2, 10):
        _write(stacks, rank, **wait)
    _write(
        stacks,
        1,
        at="faulty.py:42",
        function="forward",
        code="time.sleep(60)",
        waits_in=None,
        last_collective="#12 gloo:all_reduce",
    )
    assert hangs.describe(tmp_path, 60) == (
        "a collective timed out after 60 s (backend.timeout_s): rank 1 stuck for "
        "61 s at faulty.py:42 in forward (time.sleep(60)) after collective #12 "
        f"gloo:all_reduce, its stack: {stacks / 'rank1.txt'}; the others: ranks 0, "
        "2, 10 wait in all_reduce at step.py:59 (collective #13 gloo:all_reduce)"
    )


def test_ranks_all_waiting_in_different_collectives_are_each_placed(tmp_path: Path):
    stacks = tmp_path / hangs.STACKS
    _write(
        stacks, 0, at="trainer.py:80", function="_epoch_complete", code="", waits_in="all_reduce"
    )
    _write(stacks, 1, at="saving.py:40", function="save", code="", waits_in="barrier")
    assert hangs.describe(tmp_path, 5).endswith(
        "rank 0 waits in all_reduce at trainer.py:80; rank 1 waits in barrier at saving.py:40"
    )
    assert hangs.describe(tmp_path / "elsewhere", 5) is None  # no rank left a file here


class _OnCue:
    """A watchdog's stop event that lets it take one sample per cue: no timing in the test."""

    def __init__(self):
        self.cue, self.sampled, self.stopped = threading.Semaphore(0), threading.Semaphore(0), False

    def wait(self, timeout: float) -> bool:
        self.sampled.release()  # the sample before (or the start) is done
        self.cue.acquire()
        return self.stopped

    def sample(self) -> None:
        self.cue.release()
        self.sampled.acquire()

    def set(self) -> None:
        self.stopped = True
        self.cue.release()


def test_the_watchdog_holds_no_frame_of_a_function_that_returned(tmp_path: Path):
    """Its samples must not keep the main thread's locals alive: the worker's _train frame held the
    run's loaders, whose persistent loader workers then outlived the rank (and found the run's
    temporary directory gone at their exit)."""
    import gc
    import weakref

    class Held:
        pass

    dog = hangs.Watchdog(tmp_path, 0, stall_after=60)
    dog.stop = cue = _OnCue()
    dog.thread.start()
    cue.sampled.acquire()  # started, waiting for its first cue

    def work() -> weakref.ref:
        held = Held()
        cue.sample()  # a sample while `held` is a local of this frame
        return weakref.ref(held)

    ref = work()
    gc.collect()
    try:
        assert ref() is None, (
            "the watchdog keeps a returned function's frame (and its locals) alive"
        )
    finally:
        cue.set()
        dog.thread.join(timeout=10)


def test_a_loader_workers_place_is_its_worker_loops_innermost_own_frame():
    dump = (
        "Thread 0x00007f486affd6c0 (most recent call first):\n"
        '  File "/src/hydra_ddp/data/loader_workers.py", line 87 in _answer_stop_signals\n'
        '  File "/usr/lib/python3.11/threading.py", line 982 in run\n'
        "\n"
        "Current thread 0x00007f4940419b80 (most recent call first):\n"
        '  File "/usr/lib/python3.11/threading.py", line 327 in wait\n'
        '  File "/work/mine/datasets.py", line 193 in __getitem__\n'
        '  File "/venv/lib/python3.11/site-packages/torch/utils/data/_utils/fetch.py", '
        "line 54 in fetch\n"
        '  File "/venv/lib/python3.11/site-packages/torch/utils/data/_utils/worker.py", '
        "line 375 in _worker_loop\n"
    )
    # not the other thread's, nor the library's
    assert hangs.worker_place(dump) == "datasets.py:193 in __getitem__"
    library_only = dump.replace(
        "/work/mine/datasets.py", "/venv/lib/python3.11/site-packages/x/datasets.py"
    )
    assert hangs.worker_place(library_only) == "threading.py:327 in wait"  # then its innermost
    assert (
        hangs.worker_place('Thread 0x1 (most recent call first):\n  File "a.py", line 1 in f\n')
        is None
    )
