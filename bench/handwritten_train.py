"""The default run's baseline: `make train`'s work written by hand, in the style of \
pytorch/examples.

What `train.py` does with no overrides, in one plain script: mp.spawn of 2 workers, gloo on the
CPU, scikit-learn's digits resized to 28×28 (80 % train, of which 144 images validate, 20 % test),
the project's MNIST CNN under DDP, SGD (lr 0.02, momentum 0.9) with StepLR (5, 0.5), batch 32 per
rank, 12 epochs; each epoch a validation on both ranks and, on rank 0, TensorBoard scalars and a
checkpoint (torch.save, as pytorch/examples' imagenet script does); the test at the end. It reads
the digits from the file scikit-learn ships, as the project does (importing sklearn.datasets would
cost each worker another ~1.8 s). Nothing else: no config, no validation of it, no resume, no
failure handling. Rank 0 writes what bench/measure.py reads from the project's summary.json,
computed the same way (the training time is the sum of the steps' times), to the file named:

    python bench/handwritten_train.py result.json
"""

import time

STARTED_AT = time.time()  # before the imports, as in train.py

import argparse  # noqa: E402
import importlib.util  # noqa: E402
import os  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset  # noqa: E402

from hydra_ddp.models import MnistCNN  # noqa: E402  (the very network the project trains)

from handwritten import free_port, largest, peak_rss_mb, write_result  # noqa: E402  (the parity loop's, as it computes them)

LOG_INTERVAL = 10  # steps between two training-loss scalars (pytorch/examples' --log-interval)


def load_digits() -> tuple[TensorDataset, TensorDataset, TensorDataset]:
    """(train, validation, test): the 1,797 digits, bilinearly resized, standardised by the training
    set's statistics."""
    spec = importlib.util.find_spec("sklearn")
    table = np.loadtxt(
        Path(spec.submodule_search_locations[0]) / "datasets" / "data" / "digits.csv.gz",
        delimiter=",",
    )
    images = torch.from_numpy(table[:, :-1].reshape(-1, 1, 8, 8)).float() / 16.0
    images = F.interpolate(images, size=(28, 28), mode="bilinear", align_corners=False)
    labels = torch.from_numpy(table[:, -1]).long()
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(0))
    n_test = round(len(labels) * 0.2)
    train_idx, test_idx = order[n_test:], order[:n_test]
    mean, std = images[train_idx].mean(), images[train_idx].std()
    images = (images - mean) / std
    n_val = round(len(train_idx) * 0.1)
    val_idx, train_idx = train_idx[:n_val], train_idx[n_val:]
    return tuple(TensorDataset(images[idx], labels[idx]) for idx in (train_idx, val_idx, test_idx))


def evaluate(model: DDP, loader: DataLoader) -> tuple[float, float]:
    """(mean loss, accuracy) over every rank's shard."""
    model.eval()
    totals = torch.zeros(3, dtype=torch.float64)  # loss sum, correct, count
    with torch.no_grad():
        for x, y in loader:
            logits = model.module(x)
            totals += torch.tensor(
                [
                    F.cross_entropy(logits, y, reduction="sum").item(),
                    (logits.argmax(1) == y).sum().item(),
                    len(y),
                ],
                dtype=torch.float64,
            )
    dist.all_reduce(totals)
    model.train()
    return (totals[0] / totals[2]).item(), (totals[1] / totals[2]).item()


def main(rank: int, world_size: int, port: int, args: argparse.Namespace) -> None:
    # this worker's imports done (the spawned interpreter re-imports this file)
    entered_at = time.time()
    torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // world_size))
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    torch.manual_seed(0)
    train_set, val_set, test_set = load_digits()
    sampler = DistributedSampler(
        train_set, num_replicas=world_size, rank=rank, shuffle=True, seed=0
    )
    train_loader = DataLoader(train_set, batch_size=32, sampler=sampler)
    val_loader, test_loader = (
        DataLoader(
            s, batch_size=256, sampler=DistributedSampler(s, world_size, rank, shuffle=False)
        )
        for s in (val_set, test_set)
    )
    model = DDP(MnistCNN())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=5, gamma=0.5)
    writer = None
    if rank == 0:
        from torch.utils.tensorboard import SummaryWriter

        writer = SummaryWriter(os.path.join(args.run_dir, "tensorboard"))
        os.makedirs(os.path.join(args.run_dir, "checkpoints"), exist_ok=True)

    step_times, first_step_at, step = [], None, 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        last = time.perf_counter()
        for x, y in train_loader:
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()  # DDP all-reduces the gradients here
            optimizer.step()
            now = time.perf_counter()
            step_times.append(now - last)
            last, step = now, step + 1
            first_step_at = first_step_at or time.time()
            if writer is not None and step % LOG_INTERVAL == 0:
                writer.add_scalar("train/loss", loss.item(), step)
        scheduler.step()
        val_loss, val_acc = evaluate(model, val_loader)
        if writer is not None:
            writer.add_scalar("val/loss", val_loss, step)
            writer.add_scalar("val/accuracy", val_acc, step)
            torch.save(
                {
                    "epoch": epoch,
                    "model": model.module.state_dict(),
                    "optimizer": optimizer.state_dict(),
                    "scheduler": scheduler.state_dict(),
                },
                os.path.join(args.run_dir, "checkpoints", "last.pt"),
            )
    _, test_acc = evaluate(model, test_loader)

    device = torch.device("cpu")
    rss, workers_ready_at = peak_rss_mb(device), largest(entered_at, device)
    if rank == 0:
        writer.close()
        write_result(
            args.out,
            world_size,
            step,
            step_times,
            32 * world_size,
            first_step_at,
            STARTED_AT,
            train_time_s=sum(step_times),
            workers_ready_at=workers_ready_at,
            peak_rss_mb=rss,
            test_accuracy=test_acc,
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", help="the JSON file rank 0 writes the measurements to")
    parser.add_argument(
        "--run-dir", default=".", help="where TensorBoard's events and the checkpoint go"
    )
    parser.add_argument("--epochs", type=int, default=12)
    args = parser.parse_args()
    mp.spawn(main, args=(2, free_port(), args), nprocs=2)
