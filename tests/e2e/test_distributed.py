"""The process group with real gloo ranks: rank zero's text broadcast to every rank (rank discovery
and ports, in process: tests/unit/test_distributed.py)."""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.multiprocessing as mp

from hydra_ddp.config.run_config import RunInitMethodConf
from hydra_ddp.parallel import distributed
from hydra_ddp.runtime.ranks import RankInfo

from support import spawn_ranks


def _broadcast_worker(rank: int, port: int, results):
    info = RankInfo(rank, 2, rank, 2)
    init = RunInitMethodConf(name="tcp", host="127.0.0.1", ports=[port])  # held by the test
    with distributed.process_group("gloo", init, info, 30, torch.device("cpu")):
        results[rank] = distributed.broadcast_text(
            "outputs/runs/été" if rank == 0 else "other", torch.device("cpu")
        )
    assert not torch.distributed.is_initialized()  # torn down on exit


def test_broadcast_text_gives_every_rank_rank_zeros_string():
    with mp.Manager() as manager:
        results = manager.dict()
        # held by this process
        store = distributed.serve_store("127.0.0.1", 0, timedelta(seconds=30))
        spawn_ranks(_broadcast_worker, (store.port, results), nprocs=2)
        assert dict(results) == {0: "outputs/runs/été", 1: "outputs/runs/été"}
