"""The no-communication ceiling: what the project's ranks would reach if they did not communicate.

W independent processes, each training its own copy of the run's model on its own batches: the
config composed and settled exactly as `train.py OVERRIDES` settles it (batch size, threads per
rank, channels_last), and the same objects built from it (the rank's data loader, the model, the
optimizer with its parameter groups, the schedule, the task's loss), then a bare loop: no process
group, no DDP, no all-reduce, no waiting for a peer, none of the loop's own work (logging, checks,
checkpoints, the straggler timer). Whatever the project's run of the same config takes beyond this
is the cost of being one data-parallel job.

    python bench/ceiling.py result.json -- data=synthetic trainer.max_steps=200 ...

Two bounds on what any synchronous data-parallel loop can reach on the machine: `--lockstep` (the
processes meet after each backward, exchanging nothing: what moving in step costs by itself) and
`--exchange` (in lockstep, each gradient averaged through shared memory in two passes, as the
project's all-reduce does, with nothing else around it).

Each process writes its step times and its time per phase (data, forward, backward, optimizer);
rank 0 of the ceiling is only a name here. The result holds what bench/measure.py reads of a run
(the same fields as the project's summary.json), the throughput counted over the window in which
every process was training (the first `warm-up` steps of each left out), so a process that ends
first does not leave the others a faster machine for their last steps.
"""

import time

STARTED_AT = time.time()  # before the imports, as in train.py

import multiprocessing  # noqa: E402
import multiprocessing.forkserver  # noqa: E402

if __name__ == "__main__":  # the workers' imports overlap with this process's, as the project's do
    multiprocessing.set_forkserver_preload(["torch", "hydra_ddp.training.worker"])
    multiprocessing.forkserver.ensure_running()

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import resource  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

PHASES = ("data", "forward", "backward", "optimizer")
REPO = Path(__file__).resolve().parents[1]


def settled_config(overrides: list[str], run_dir: Path) -> Any:
    """The RunConfig train.py's workers would receive for these overrides (composed, resolved,
    settled)."""
    from hydra import compose, initialize_config_dir

    from hydra_ddp.config import schema
    from hydra_ddp.launch import resolve

    schema.register_schema()
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base=None):
        composed = compose(config_name="config", overrides=overrides)
    return resolve.resolve(composed, run_dir, external=None, checked=False)


def gradient_count(cfg: Any) -> int:
    """The model's trainable parameters (float32 gradients only: what --exchange sums)."""
    import torch
    from hydra.utils import instantiate

    params = [p for p in instantiate(cfg.model).parameters() if p.requires_grad]
    if any(p.dtype != torch.float32 for p in params):
        raise SystemExit("bench/ceiling.py --exchange: float32 parameters only")
    return sum(p.numel() for p in params)


def meet(counters: Any, process: int, world: int, step: int) -> None:
    """--lockstep: wait until every process has ended this step's backward (nothing exchanged), as
    the shared-memory all-reduce waits: spinning, then yielding the core."""
    counters[process * 8] = step
    checks = 0
    while any(counters[r * 8] < step for r in range(world)):
        checks += 1
        if checks > 200:
            os.sched_yield()


def exchange(params: list, slots: Any, counters: Any, process: int, world: int, step: int) -> None:
    """--exchange: the least a synchronous data-parallel step must add, without DDP or a loop: each
    gradient divided by the world size into this process's slot, a meeting, then the slots summed
    in process order into the gradient (two passes over the gradients, as the project's
    shared-memory all-reduce makes). Two turns of slots: a process one step ahead writes the
    other."""
    import torch

    turn, offset = slots[step % 2], 0
    for p in params:
        n = p.grad.numel()
        torch.div(p.grad, world, out=turn[process, offset : offset + n].view(p.grad.shape))
        offset += n
    meet(counters, process, world, step)
    offset = 0
    for p in params:
        n = p.grad.numel()
        shares = [turn[r, offset : offset + n].view(p.grad.shape) for r in range(world)]
        torch.add(shares[0], shares[1], out=p.grad)
        for share in shares[2:]:
            p.grad.add_(share)
        offset += n


def train_alone(
    process: int, cfg: Any, out_dir: str, counters: Any = None, shared: Any = None
) -> None:
    """One process of the ceiling: the run's objects for rank `process` of W, trained with no peer
    (with `counters`: meeting the others after each backward, --lockstep; and `shared`, the slots
    the gradients are summed through, --exchange)."""
    entered_at = time.time()
    import torch
    from hydra.utils import instantiate

    from hydra_ddp import data, performance, tasks
    from hydra_ddp.data import batches
    from hydra_ddp.recipe import optimizer as optimizers
    from hydra_ddp.recipe import schedules
    from hydra_ddp.runtime.ranks import RankInfo
    from hydra_ddp.training import seeding

    trainer, world = cfg.trainer, cfg.trainer.nproc
    torch.set_num_threads(trainer.threads)
    rank = RankInfo(process, world, process, world)
    device = torch.device("cpu")
    seeding.seed_everything(trainer.seed)  # the project's initial weights
    loaders = data.build_loaders(cfg.data, rank, trainer.seed, device)
    model = instantiate(cfg.model)
    channels_last = trainer.channels_last
    # a model only the workers build: settled as the project's workers do
    if channels_last == performance.AUTO:
        channels_last = performance.has_conv2d(model)
    memory_format = performance.memory_format(bool(channels_last))
    model = model.to(device, memory_format=memory_format)
    task = tasks.build(cfg.task)
    optimizer = optimizers.build(cfg.optim, cfg.param_groups.no_decay, model, model)
    steps = trainer.max_steps
    scheduler = schedules.build(cfg.scheduler, optimizer, steps)
    per_step = schedules.per_step(scheduler)
    params = [p for p in model.parameters() if p.requires_grad]
    slots = None
    if shared is not None:
        total = sum(p.numel() for p in params)
        slots = torch.frombuffer(shared, dtype=torch.float32).view(2, world, total)
    model.train()

    ends, phases = [], dict.fromkeys(PHASES, 0.0)
    clock = time.perf_counter
    epoch = 0
    while len(ends) < steps:
        loaders.train_sampler.set_epoch(epoch)
        mark = clock()
        for batch in loaders.train:
            batch = batches.to_device(batch, device, memory_format)
            now = clock()
            phases["data"] += now - mark
            mark = now
            loss = task.loss(*task.forward(model, batch))
            now = clock()
            phases["forward"] += now - mark
            mark = now
            loss.backward()
            if slots is not None:
                exchange(params, slots, counters, process, world, len(ends) + 1)
            elif counters is not None:
                meet(counters, process, world, len(ends) + 1)
            now = clock()
            phases["backward"] += now - mark
            mark = now
            if trainer.grad_clip:
                torch.nn.utils.clip_grad_norm_(model.parameters(), trainer.grad_clip)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if per_step:
                # the rate of the coming step, as the project's loop sets it
                scheduler.at(len(ends) + 1)
            now = clock()
            phases["optimizer"] += now - mark
            ends.append(time.time())
            mark = now
            if len(ends) == steps:
                break
        epoch += 1
        if scheduler is not None and not per_step:
            scheduler.step()
    result = {
        "entered_at": entered_at,
        "ends": ends,
        "phases": phases,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "batch_size": loaders.batch_size,
        # With --exchange every process holds the same weights at the end: main() checks it.
        "weights": sum(float(p.detach().double().sum()) for p in params),
    }
    Path(out_dir, f"{process}.json").write_text(json.dumps(result))
    os._exit(0)  # as the project's workers end: no interpreter teardown of torch's threads


def combine(results: list[dict[str, Any]], warmup: int) -> dict[str, Any]:
    """The processes' figures as one run's: samples/s over the window every process was in its
    steady steps, the median step of process 0, the mean time per phase over every step."""
    batch = results[0]["batch_size"]
    starts = [r["ends"][warmup - 1] if warmup else r["ends"][0] for r in results]
    window = (max(starts), min(r["ends"][-1] for r in results))
    if window[1] <= window[0]:
        raise SystemExit(
            "bench/ceiling.py: the processes' steady steps did not overlap: raise --steps"
        )
    inside = sum(1 for r in results for end in r["ends"] if window[0] < end <= window[1])
    gaps = [b - a for a, b in zip(results[0]["ends"], results[0]["ends"][1:])][max(warmup - 1, 0) :]
    steps = len(results[0]["ends"])
    return {
        "world_size": len(results),
        "steps": steps,
        "steady_samples_per_sec": inside * batch / (window[1] - window[0]),
        "median_step_time_s": statistics.median(gaps),
        "first_step_at": min(r["ends"][0] for r in results),
        "workers_ready_at": max(r["entered_at"] for r in results),
        "peak_rss_mb": max(r["peak_rss_mb"] for r in results),
        # As the project's summary has them (`ranks`): seconds per step by phase, per process.
        "ranks": [
            {
                "rank": i,
                **{f"{p}_s": r["phases"][p] / steps for p in PHASES},
                "sync_wait_s": 0.0,
                "other_s": 0.0,
            }
            for i, r in enumerate(results)
        ],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", help="the JSON file to write the result to")
    parser.add_argument(
        "--warmup", type=int, default=10, help="each process's first steps, left out of samples/s"
    )
    parser.add_argument(
        "--lockstep",
        action="store_true",
        help="the processes meet after each backward, exchanging "
        "nothing: what moving in step alone costs",
    )
    parser.add_argument(
        "--exchange",
        action="store_true",
        help="in lockstep, and the gradients averaged through shared memory in two passes: the "
        "least a synchronous data-parallel step adds, without DDP or the project's loop",
    )
    parser.add_argument(
        "overrides",
        nargs="*",
        help="train.py's overrides (after --): the run whose ceiling this is",
    )
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="hydra-ddp-ceiling-") as tmp:
        cfg = settled_config(args.overrides, Path(tmp))
        if cfg.trainer.device != "cpu" or cfg.launcher.nnodes != 1 or not cfg.trainer.max_steps:
            raise SystemExit("bench/ceiling.py: one CPU host and trainer.max_steps only")
        context = multiprocessing.get_context("forkserver")
        world = cfg.trainer.nproc
        counters = (
            context.Array("q", 8 * world, lock=False) if args.lockstep or args.exchange else None
        )
        shared = (
            context.Array("f", 2 * world * gradient_count(cfg), lock=False)
            if args.exchange
            else None
        )
        processes = [
            context.Process(
                target=train_alone, args=(i, cfg, tmp, counters, shared), name=f"ceiling-{i}"
            )
            for i in range(cfg.trainer.nproc)
        ]
        for process in processes:
            process.start()
        for process in processes:
            process.join()
        failed = [p.name for p in processes if p.exitcode != 0]
        if failed:
            raise SystemExit(f"bench/ceiling.py: {', '.join(failed)} failed")
        results = [json.loads(Path(tmp, f"{i}.json").read_text()) for i in range(len(processes))]
    if args.exchange and len({r["weights"] for r in results}) != 1:
        raise SystemExit(
            "bench/ceiling.py --exchange: the processes' "
            "weights differ after averaging their gradients"
        )
    combined = combine(results, min(args.warmup, cfg.trainer.max_steps // 10))
    Path(args.out).write_text(
        json.dumps({**combined, "time_to_first_step_s": combined["first_step_at"] - STARTED_AT})
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
