"""The loop's distributed pieces, on real gloo ranks: exact evaluation and global train losses."""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.utils.data import TensorDataset

from hydra_ddp import data, tasks
from hydra_ddp.parallel import distributed
from hydra_ddp.parallel.distributed import RankInfo
from hydra_ddp.training import evaluation
from hydra_ddp.training import window as training

SAMPLES = 11  # does not divide by 3 ranks: padding would count samples twice


def _dataset():
    gen = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(SAMPLES, 4, generator=gen), torch.randint(0, 3, (SAMPLES,), generator=gen))


def _model():
    torch.manual_seed(0)
    return torch.nn.Linear(4, 3)


def _worker(rank: int, world: int, port: int, results):
    info = RankInfo(rank, world, rank, world)
    init = {"name": "tcp", "host": "127.0.0.1", "port": None, "path": None, "ports": [port]}  # held by the test
    with distributed.process_group("gloo", init, info, 30, torch.device("cpu")):
        split = data.EvalSplit(_dataset(), 2, info, torch.device("cpu"), preload=rank == 1, loader_options={})
        results["eval", rank] = evaluation.evaluate(
            _model(), split, torch.device("cpu"), tasks.Classification(), predictions=True
        )
        window = training.LossWindow(size=2)
        window.add(1, torch.tensor(float(rank)))
        window.add(2, torch.tensor(float(10 * rank)))
        results["window", rank] = window.flush(stop=rank == 2, device=torch.device("cpu"), out_of_time=rank == 1)
        # Overlapped, as the loop does mid-epoch: sent at step 3, read after step 4 was added.
        window.add(3, torch.tensor(float(rank)))
        window.start(stop=rank == 0, device=torch.device("cpu"))
        window.add(4, torch.tensor(100.0 * rank))
        results["overlapped", rank] = window.collect(), window.flush(stop=False, device=torch.device("cpu"))


def test_evaluation_is_exact_and_train_losses_are_global():
    x, y = _dataset().tensors
    logits = _model()(x)
    expected_loss = F.cross_entropy(logits, y).item()
    expected_acc = (logits.argmax(1) == y).sum().item() / SAMPLES
    with mp.Manager() as manager:
        results = manager.dict()
        store = distributed.serve_store("127.0.0.1", 0, timedelta(seconds=30))  # held by this process
        mp.spawn(_worker, args=(3, store.port, results), nprocs=3)
        results = dict(results)
    for rank in range(3):
        metrics = results["eval", rank]
        assert metrics["test_samples"] == SAMPLES
        assert abs(metrics["test_loss"] - expected_loss) < 1e-6
        assert metrics["test_accuracy"] == expected_acc
        # Means of 0,1,2 and of 0,10,20; rank 2's stop request and rank 1's spent time reach every rank.
        assert results["window", rank] == ([1, 2], [1.0, 10.0], True, True)
        assert results["overlapped", rank] == (([3], [1.0], True, False), ([4], [100.0], False, False))
    # Rank 0 gathers every sample's (label, prediction, probability), in dataset order.
    rows = results["eval", 0]["predictions"]
    assert torch.equal(rows[:, 0].long(), y) and torch.equal(rows[:, 1].long(), logits.argmax(1))
    assert torch.allclose(rows[:, 2].float(), logits.softmax(1).max(1).values)


def test_monitor_selects_the_best_and_counts_patience_with_min_delta():
    from hydra_ddp.monitor import Monitor

    loss = Monitor("val/loss", "min", patience=2, min_delta=0.05)
    seen = [loss.update({"val_loss": v}, step, step) for step, v in enumerate([float("nan"), 1.0, 0.98, 0.9, 0.95], 1)]
    assert seen == [False, True, True, True, False]  # any improvement is the best; nan never is
    assert (loss.best, loss.best_step) == (0.9, 4)
    assert loss.stale == 1 and not loss.should_stop  # 0.98 was better, but not by min_delta; 0.9 was
    loss.update({"val_loss": 0.91}, 6, 6)
    assert loss.should_stop
    accuracy = Monitor("val/accuracy", "max")
    assert accuracy.update({"val_accuracy": 0.5}, 1, 1) and not accuracy.update({"val_accuracy": 0.4}, 2, 2)
    restored = Monitor("val/accuracy", "max")
    restored.load(accuracy.state())
    assert restored == accuracy
    other = Monitor("val/loss", "min")
    other.load(accuracy.state())  # another metric's record says nothing about this one
    assert other.best is None


def test_the_straggler_is_the_rank_that_waits_least_named_with_its_extra_cost():
    from hydra_ddp.training.timing import per_rank, straggler

    def rank(data, forward, backward, steps=10):  # seconds per step → totals
        return {
            "steps": steps,
            "data": data * steps,
            "forward": forward * steps,
            "backward": backward * steps,
            "optimizer": 0.001 * steps,
            "other": 0.001 * steps,
        }

    # Rank 2 waits 60 ms per step for data; the others wait for it inside their backward.
    rows = per_rank([rank(0.001, 0.02, 0.09), rank(0.001, 0.02, 0.09), rank(0.061, 0.02, 0.03)])
    assert [round(r["sync_wait_s"], 6) for r in rows] == [0.06, 0.06, 0.0]
    found = straggler(rows)
    assert found["rank"] == 2 and found["cause"] == "data" and "rank 2: data wait" in found["message"]
    # Waiting that no phase of one rank explains, or that is small, names nobody.
    assert straggler(per_rank([rank(0.001, 0.02, 0.035), rank(0.001, 0.02, 0.03)])) is None
    assert straggler(per_rank([rank(0.001, 0.02, 0.09), rank(0.001, 0.021, 0.03)])) is None
    assert per_rank([]) == [] and straggler([]) is None
