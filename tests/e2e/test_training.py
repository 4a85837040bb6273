"""The loop's distributed pieces, on real gloo ranks: exact evaluation and global train losses (the
monitor and the straggler, in process: tests/unit/test_training.py)."""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.utils.data import DistributedSampler, TensorDataset

from hydra_ddp import data, tasks
from hydra_ddp.config.run_config import RunInitMethodConf
from hydra_ddp.parallel import distributed
from hydra_ddp.runtime.ranks import RankInfo
from hydra_ddp.training import evaluation
from hydra_ddp.training.meter import LossWindow

from support import spawn_ranks

SAMPLES = 11  # does not divide by 3 ranks: padding would count samples twice


def _dataset():
    gen = torch.Generator().manual_seed(0)
    return TensorDataset(
        torch.randn(SAMPLES, 4, generator=gen), torch.randint(0, 3, (SAMPLES,), generator=gen)
    )


def _model():
    torch.manual_seed(0)
    return torch.nn.Linear(4, 3)


def _worker(rank: int, world: int, port: int, results):
    info = RankInfo(rank, world, rank, world)
    init = RunInitMethodConf(name="tcp", host="127.0.0.1", ports=[port])  # held by the test
    with distributed.process_group("gloo", init, info, 30, torch.device("cpu")):
        split = data.EvalSplit(
            _dataset(), 2, info, torch.device("cpu"), preload=rank == 1, loader_options={}
        )
        results["eval", rank] = evaluation.evaluate(
            _model(), split, torch.device("cpu"), tasks.Classification(), predictions=True
        )
        # the control: a validator that drops the last, smaller batch (torchtitan #2636)
        dropped = TensorDataset(*(t[: SAMPLES - 1] for t in _dataset().tensors))
        results["dropped", rank] = evaluation.evaluate(
            _model(),
            data.EvalSplit(dropped, 2, info, torch.device("cpu"), preload=False, loader_options={}),
            torch.device("cpu"),
            tasks.Classification(),
        )
        window = LossWindow(size=2)
        window.add(1, torch.tensor(float(rank)))
        window.add(2, torch.tensor(float(10 * rank)))
        results["window", rank] = window.flush(
            stop=rank == 2, device=torch.device("cpu"), out_of_time=rank == 1
        )
        # Overlapped, as the loop does mid-epoch: sent at step 3, read after step 4 was added.
        window.add(3, torch.tensor(float(rank)))
        window.start(stop=rank == 0, device=torch.device("cpu"))
        window.add(4, torch.tensor(100.0 * rank))
        results["overlapped", rank] = (
            window.collect(),
            window.flush(stop=False, device=torch.device("cpu")),
        )


def test_evaluation_is_exact_and_train_losses_are_global():
    x, y = _dataset().tensors
    logits = _model()(x)
    expected_loss = F.cross_entropy(logits, y).item()
    expected_acc = (logits.argmax(1) == y).sum().item() / SAMPLES
    with mp.Manager() as manager:
        results = manager.dict()
        # held by this process
        store = distributed.serve_store("127.0.0.1", 0, timedelta(seconds=30))
        spawn_ranks(_worker, (3, store.port, results), nprocs=3)
        results = dict(results)
    for rank in range(3):
        metrics = results["eval", rank]
        assert metrics["test_samples"] == SAMPLES
        assert abs(metrics["test_loss"] - expected_loss) < 1e-6
        assert metrics["test_accuracy"] == expected_acc
        # Means of 0,1,2 and of 0,10,20; rank 2's stop request and rank 1's spent time reach every
        # rank.
        assert results["window", rank] == ([1, 2], [1.0, 10.0], True, True)
        assert results["overlapped", rank] == (
            ([3], [1.0], True, False),
            ([4], [100.0], False, False),
        )
    # The controls: what the assertions above would catch. torch's DistributedSampler pads 11
    # samples to 12 over 3 ranks, repeating one (pytorch #25162): an evaluation over its shards
    # counts 12. A validator that drops the last batch counts 10, and its loss moves.
    padded = sum(
        len(list(DistributedSampler(_dataset(), num_replicas=3, rank=r, shuffle=False)))
        for r in range(3)
    )
    assert padded == SAMPLES + 1
    dropped = results["dropped", 0]
    assert dropped["test_samples"] == SAMPLES - 1
    assert abs(dropped["test_loss"] - expected_loss) > 1e-6
    # Rank 0 gathers every sample's (label, prediction, probability), in dataset order.
    rows = results["eval", 0]["predictions"]
    assert torch.equal(rows[:, 0].long(), y) and torch.equal(rows[:, 1].long(), logits.argmax(1))
    assert torch.allclose(rows[:, 2].float(), logits.softmax(1).max(1).values)
