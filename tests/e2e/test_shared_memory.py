"""The shared-memory all-reduce (strategy.shared_memory): real processes meeting in a real segment,
checked against gloo's all-reduce of the same tensors (where it cannot serve, in process:
tests/unit/test_shared_memory.py)."""

from __future__ import annotations

import multiprocessing
import os
import socket
import time
from pathlib import Path

import pytest
import torch

from hydra_ddp.parallel import shared_memory

from support import QUICK, check_ok, run_train, spawn_ranks, summary, tmpfs

SIZES = (1537, 10, 4099, 1)  # floats: odd sizes, each larger or smaller than the test's slot
SLOT_BYTES = 1024  # 256 floats: most tensors go through in several chunks, over both turns


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _group(rank: int, world: int, port: int) -> None:
    import torch.distributed as dist

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )


def _leftovers(pid: int) -> list[str]:
    """Segments made by this process (as rank 0) still in /dev/shm."""
    return sorted(p.name for p in shared_memory.shm_dir().glob(f"{shared_memory.PREFIX}{pid}-*"))


def _sums(rank: int, world: int, port: int) -> None:
    import torch.distributed as dist

    _group(rank, world, port)
    shared_memory.SLOT_BYTES = SLOT_BYTES
    summing = shared_memory.SharedMemoryAllReduce(None, 4 * sum(SIZES), timeout_s=60)
    assert not _leftovers(os.getpid())  # rank 0's: unlinked once every rank has mapped it
    generator = torch.Generator().manual_seed(rank)
    for _ in range(3):  # several steps: the slots are reused, turn by turn
        for size in SIZES:
            share = torch.randn(size, generator=generator)
            expected = share / world  # each share divided first, as DDP's own all-reduce does
            dist.all_reduce(expected)  # gloo's
            summing._all_reduce(share)
            if world == 2:
                assert torch.equal(share, expected)  # a + b == b + a: bit-identical
            else:
                torch.testing.assert_close(share, expected, rtol=1e-6, atol=1e-7)
            everyone = [torch.empty_like(share) for _ in range(world)]
            dist.all_gather(everyone, share)
            # the same bits on every rank
            assert all(torch.equal(share, other) for other in everyone)
    dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 3])
def test_sums_equal_gloos_in_chunks_on_every_rank(world: int):
    spawn_ranks(_sums, (world, _port()), nprocs=world)


def _peer_exits(rank: int, port: int, report: str) -> None:
    _group(rank, 2, port)
    summing = shared_memory.SharedMemoryAllReduce(None, 4096, timeout_s=120)
    ready = Path(report).with_suffix(".ready")
    if rank == 1:
        # Gone before the meeting, as a killed rank would be; but only once rank 0 is done with gloo
        # (a peer gone in the middle of gloo's last set-up exchange is gloo's affair, not this
        # test's).
        while not ready.exists():
            os.sched_yield()
        os._exit(3)
    ready.touch()
    started = time.monotonic()
    try:
        summing._all_reduce(torch.ones(1024))
        message = "no error"
    except RuntimeError as e:
        message = str(e)
    Path(report).write_text(f"{time.monotonic() - started:.1f}\n{message}")
    os._exit(0)


def test_a_peer_that_exits_fails_the_waiting_rank_long_before_the_timeout(tmp_path: Path):
    # Plain processes: mp.spawn's join would stop rank 0 itself as soon as rank 1 exits.
    context, report, port = multiprocessing.get_context("spawn"), tmp_path / "report", _port()
    ranks = [context.Process(target=_peer_exits, args=(r, port, str(report))) for r in (0, 1)]
    for p in ranks:
        p.start()
    for p in ranks:
        p.join(timeout=90)
    assert [p.exitcode for p in ranks] == [0, 3]
    waited, message = report.read_text().split("\n", 1)
    assert "rank 1 (pid " in message and "exited during the gradient all-reduce" in message, message
    assert float(waited) < 30  # found by its liveness checks, not the 120 s timeout


def test_a_full_tmpfs_falls_back_to_gloo_with_a_warning_or_fails_in_one_line_when_asked(
    tmp_path: Path,
):
    # 1 MB: no room for the CNN's segment (2 turns × 2 ranks × its 1.7 MB of gradients).
    with tmpfs(tmp_path / "shm", "1m") as shm:
        env = {"HYDRA_DDP_SHM_DIR": str(shm)}
        run_dir = tmp_path / "auto"
        check_ok(run_train(run_dir, *QUICK, env=env))
        assert summary(run_dir)["settings"]["strategy.shared_memory"] is False
        assert "not shared memory: cannot create" in (run_dir / "train.log").read_text()

        asked = run_train(tmp_path / "asked", *QUICK, "strategy.shared_memory=true", env=env)
        assert asked.returncode != 0
        lines = asked.stderr.strip().splitlines()
        assert len(lines) == 1 and "strategy.shared_memory=true: cannot create" in lines[0], (
            asked.stderr
        )
        assert not list(shm.iterdir())  # nothing left in it
