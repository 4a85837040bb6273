"""The expert's baseline: bench/handwritten.py's DDP loop, tuned by hand with stock PyTorch.

The same workload, model, optimizer, threads (cores ÷ ranks per rank) and measurements as
handwritten.py, plus the one-liners an expert turns on, each marked below:
- the model and its inputs in the channels_last memory format;
- DDP(gradient_as_bucket_view=True, static_graph=True);
- workers forked from a forkserver that imported torch and torch._dynamo once, started before
  this process imports torch, so the two imports overlap.
No hydra_ddp machinery: what the project adds beyond these is what bench/report.py sets against it.

    python bench/expert.py --steps 200 result.json
"""

import time

STARTED_AT = time.time()  # before the imports, as in train.py

import multiprocessing  # noqa: E402
import multiprocessing.forkserver  # noqa: E402

if __name__ == "__main__":  # tuned: the forkserver imports torch while this process does too
    multiprocessing.set_forkserver_preload(["torch", "torch._dynamo"])
    multiprocessing.forkserver.ensure_running()

import argparse  # noqa: E402
import os  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from handwritten import (  # noqa: E402  (the plain loop's pieces, so only the tuning differs)
    MnistCNN,
    ddp_setup,
    free_port,
    largest,
    parse_args,
    peak_rss_mb,
    prepare_dataloader,
    write_result,
)


def train(
    model: nn.Module, loader: DataLoader, optimizer: torch.optim.Optimizer, steps: int
) -> tuple[list[float], float]:
    """handwritten.train on the CPU: `steps` steps; each step's duration, and when the first
    ended."""
    step_times, first_step_at = [], 0.0
    model.train()
    last = time.perf_counter()
    # as many epochs as the steps need (one, unless --train-size is small)
    for epoch in range(steps):
        loader.sampler.set_epoch(epoch)
        for x, y in loader:
            x = x.to(memory_format=torch.channels_last)  # tuned
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()  # DDP all-reduces the gradients here, straight into their buckets
            optimizer.step()
            now = time.perf_counter()
            step_times.append(now - last)
            last = now
            if len(step_times) == 1:
                first_step_at = time.time()
            if len(step_times) == steps:
                return step_times, first_step_at
    raise ValueError("no batch in an epoch: raise --train-size")


def main(rank: int, world_size: int, port: int, args: argparse.Namespace) -> None:
    # this worker's own code begins (forked: the forkserver's imports done)
    entered_at = time.time()
    torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // world_size))
    device = torch.device("cpu")
    ddp_setup(rank, world_size, port, device)
    torch.manual_seed(0)
    loader = prepare_dataloader(args.train_size, args.batch_size, rank, world_size)
    model = MnistCNN().to(memory_format=torch.channels_last)  # tuned
    model = DDP(model, gradient_as_bucket_view=True, static_graph=True)  # tuned
    optimizer = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9)

    step_times, first_step_at = train(model, loader, optimizer, args.steps)
    rss = peak_rss_mb(device)
    workers_ready_at = largest(entered_at, device)
    if rank == 0:
        write_result(
            args.out,
            world_size,
            len(step_times),
            step_times,
            args.batch_size * world_size,
            first_step_at,
            STARTED_AT,
            workers_ready_at=workers_ready_at,
            peak_rss_mb=rss,
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    args = parse_args()
    if (args.device, args.parallel, args.model, args.precision) != ("cpu", "ddp", "cnn", "32"):
        raise SystemExit(
            "bench/expert.py: the CNN's DDP loop on the CPU "
            "in fp32 only (the rest is handwritten.py's)"
        )
    mp.start_processes(
        main, args=(args.nproc, free_port(), args), nprocs=args.nproc, start_method="forkserver"
    )
