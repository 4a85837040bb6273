"""The baseline: a minimal hand-written DDP training loop, in the style of pytorch/examples.

mp.spawn, a process group, DistributedSampler, DDP, SGD (lr 0.02, momentum 0.9) — nothing else.
It trains the project's MNIST CNN on random 1×28×28 images held in memory, batch 64 per rank,
gloo on the CPU, cores ÷ ranks intra-op threads per rank. Rank 0 writes the measurements that
the project's summary.json holds, computed the same way, to the JSON file named on the command line:

    python bench/handwritten.py --steps 200 result.json

For bench/gpu_check.py's DataParallel comparison, the same loop also runs
- `--parallel dp`: one process, nn.DataParallel over --nproc GPUs, one loader of the same global
  batch (batch size × nproc): what the seeds compare DDP with;
- `--model resnet18 --precision bf16`: torchvision's ResNet-18 on random 3×224×224 images, in bf16
  autocast.
On CUDA the result also holds every GPU's peak allocated memory (`peak_memory_mb`, in GPU order).
A --train-size smaller than --steps needs is reused, epoch after epoch.
"""

import time

STARTED_AT = time.time()  # before the imports, as in train.py

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import resource  # noqa: E402
import socket  # noqa: E402
import statistics  # noqa: E402
from typing import Any, Optional  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset  # noqa: E402

from hydra_ddp.models import MnistCNN  # noqa: E402  (the very network the project trains)

IMAGE_SHAPE = {"cnn": (1, 28, 28), "resnet18": (3, 224, 224)}


def build_model(name: str) -> nn.Module:
    if name == "resnet18":
        import torchvision

        return torchvision.models.resnet18(num_classes=10)
    return MnistCNN()


def ddp_setup(rank: int, world_size: int, port: int, device: torch.device) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(
        "nccl" if device.type == "cuda" else "gloo", rank=rank, world_size=world_size
    )


def prepare_dataloader(
    size: int, batch_size: int, rank: int, world_size: int, shape=IMAGE_SHAPE["cnn"]
) -> DataLoader:
    gen = torch.Generator().manual_seed(0)  # the same images on every rank
    dataset = TensorDataset(
        torch.randn(size, *shape, generator=gen), torch.randint(0, 10, (size,), generator=gen)
    )
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=0)
    return DataLoader(dataset, batch_size=batch_size, sampler=sampler)


def train(
    model: nn.Module,
    loader: DataLoader,
    optimizer: torch.optim.Optimizer,
    steps: int,
    device: torch.device,
    precision: str = "32",
) -> tuple[list[float], float]:
    """Run `steps` steps; each step's duration (from the previous step's end), and when the first
    ended."""
    if len(loader) == 0:
        raise ValueError("no batch in an epoch: raise --train-size")
    step_times, first_step_at = [], 0.0
    model.train()
    last = time.perf_counter()
    # as many epochs as the steps need (one, unless --train-size is small)
    for epoch in range(steps):
        loader.sampler.set_epoch(epoch)
        for x, y in loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            optimizer.zero_grad()
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=precision == "bf16"):
                loss = F.cross_entropy(model(x), y)
            loss.backward()  # DDP all-reduces the gradients here
            optimizer.step()
            if device.type == "cuda" and len(step_times) == steps - 1:
                # the last step waits for the GPU's queue: the total is then true
                torch.cuda.synchronize()
            now = time.perf_counter()
            step_times.append(now - last)
            last = now
            if len(step_times) == 1:
                first_step_at = time.time()
            if len(step_times) == steps:
                return step_times, first_step_at
    raise AssertionError("unreachable: every epoch has a batch")


def measurements(step_times: list[float], samples_per_step: int) -> dict[str, float]:
    """As the project computes them: the first 10 steps (a tenth of a shorter run) are warm-up."""
    steady = step_times[min(10, len(step_times) // 10) :]
    return {
        "samples_per_sec": len(step_times) * samples_per_step / sum(step_times),
        "steady_samples_per_sec": len(steady) * samples_per_step / sum(steady),
        "median_step_time_s": statistics.median(steady),
    }


def write_result(
    out: str,
    world_size: int,
    steps: int,
    step_times: list[float],
    samples_per_step: int,
    first_step_at: float,
    started_at: float,
    **more: Any,
) -> None:
    """Rank 0's measurements, as bench/measure.py reads them (more: the loop's own figures)."""
    result = {
        "world_size": world_size,
        "steps": steps,
        **measurements(step_times, samples_per_step),
        "first_step_at": first_step_at,
        "time_to_first_step_s": first_step_at - started_at,
        **more,
    }
    with open(out, "w") as f:
        json.dump(result, f, indent=2)


def peak_rss_mb(device: torch.device) -> float:
    """The largest peak resident set size over the ranks (ru_maxrss is in KiB on Linux)."""
    return largest(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, device)


def largest(value: float, device: torch.device) -> float:
    """The largest of the ranks' values (on the device: NCCL reduces nothing else)."""
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def peak_memory_mb(device: torch.device) -> Optional[list[float]]:
    """Every rank's peak allocated GPU memory, in rank (= GPU) order; None on the CPU."""
    if device.type != "cuda":
        return None
    mine = torch.tensor(
        [torch.cuda.max_memory_allocated(device) / 2**20], dtype=torch.float64, device=device
    )
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    return [t.item() for t in every]


def main(rank: int, world_size: int, port: int, args: argparse.Namespace) -> None:
    # this worker's imports done (the spawned interpreter re-imports this file)
    entered_at = time.time()
    torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // world_size))
    device = torch.device(f"cuda:{rank}" if args.device == "cuda" else "cpu")
    ddp_setup(rank, world_size, port, device)
    torch.manual_seed(0)
    loader = prepare_dataloader(
        args.train_size, args.batch_size, rank, world_size, IMAGE_SHAPE[args.model]
    )
    model = DDP(
        build_model(args.model).to(device), device_ids=[rank] if device.type == "cuda" else None
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9)

    step_times, first_step_at = train(model, loader, optimizer, args.steps, device, args.precision)
    rss, memory = peak_rss_mb(device), peak_memory_mb(device)
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
            peak_memory_mb=memory,
        )
    dist.destroy_process_group()


def main_dataparallel(args: argparse.Namespace) -> None:
    """One process: nn.DataParallel scatters each global batch from GPU 0 to --nproc GPUs, runs a
    replica on each in threads and gathers the outputs (and the loss) back on GPU 0."""
    cuda = args.device == "cuda"
    device = torch.device("cuda:0" if cuda else "cpu")
    torch.manual_seed(0)
    loader = prepare_dataloader(
        args.train_size, args.batch_size * args.nproc, 0, 1, IMAGE_SHAPE[args.model]
    )
    model = nn.DataParallel(
        build_model(args.model).to(device), device_ids=list(range(args.nproc)) if cuda else None
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9)

    step_times, first_step_at = train(model, loader, optimizer, args.steps, device, args.precision)
    write_result(
        args.out,
        args.nproc,
        len(step_times),
        step_times,
        args.batch_size * args.nproc,
        first_step_at,
        STARTED_AT,
        peak_rss_mb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        peak_memory_mb=[torch.cuda.max_memory_allocated(i) / 2**20 for i in range(args.nproc)]
        if cuda
        else None,
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawned(worker: Any, nprocs: int, *args: Any) -> dict[str, Any]:
    """`worker(rank, port, *args, out)` on `nprocs` ranks started by mp.spawn, meeting at a free
    port: the JSON rank 0 wrote to `out` (a file in a folder of its own)."""
    import tempfile
    from pathlib import Path

    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        mp.spawn(worker, args=(free_port(), *args, out), nprocs=nprocs)
        return json.loads(Path(out).read_text())


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", help="the JSON file rank 0 writes the measurements to")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--nproc", type=int, default=2, help="ranks (DDP) or GPUs (dp)")
    parser.add_argument("--batch-size", type=int, default=64, help="per rank (DDP) or per GPU (dp)")
    parser.add_argument(
        "--device", choices=["cpu", "cuda"], default="cpu", help="cuda: one GPU per rank, nccl"
    )
    parser.add_argument(
        "--train-size", type=int, help="images (default: just enough for --steps in one epoch)"
    )
    parser.add_argument(
        "--parallel", choices=["ddp", "dp"], default="ddp", help="dp: nn.DataParallel, one process"
    )
    parser.add_argument("--model", choices=sorted(IMAGE_SHAPE), default="cnn")
    parser.add_argument("--precision", choices=["32", "bf16"], default="32")
    args = parser.parse_args(argv)
    args.train_size = args.train_size or args.steps * args.batch_size * args.nproc
    return args


if __name__ == "__main__":
    args = parse_args()
    if args.parallel == "dp":
        main_dataparallel(args)
    else:
        mp.spawn(main, args=(args.nproc, free_port(), args), nprocs=args.nproc)
