"""torch.profiler on its schedule (the `profiler` section) on the chosen ranks: a Chrome/Perfetto
trace per rank in run_dir/profile/, and the top operators by self time in the log."""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from hydra_ddp.rundir import RunDir

log = logging.getLogger(__name__)


def profiling(
    enabled: bool, settings: Any, device: torch.device, run_dir: Path
) -> contextlib.AbstractContextManager:
    """The profiler (its step() called once per optimizer step), or a context that does nothing."""
    rank = dist.get_rank()
    if not enabled or (settings.ranks is not None and rank not in settings.ranks):
        return contextlib.nullcontext()
    from torch.profiler import ProfilerActivity, profile, schedule

    cuda = device.type == "cuda"
    out = RunDir(run_dir).profile
    out.mkdir(exist_ok=True)

    def ready(prof: Any) -> None:
        trace = out / f"rank{rank}.json"
        prof.export_chrome_trace(str(trace))
        table = prof.key_averages().table(
            sort_by="self_cuda_time_total" if cuda else "self_cpu_time_total",
            row_limit=settings.row_limit,
        )
        log.info(
            "profile of rank %d (steps %d…%d): %s\n%s",
            rank,
            settings.wait + settings.warmup + 1,
            settings.wait + settings.warmup + settings.active,
            trace,
            table,
        )

    return profile(
        activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else []),
        schedule=schedule(
            wait=settings.wait, warmup=settings.warmup, active=settings.active, repeat=1
        ),
        on_trace_ready=ready,
    )
