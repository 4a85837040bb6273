"""torch.profiler on its schedule (the `profiler` section) on the chosen ranks, as a hook of the
loop: a Chrome/Perfetto trace per rank in run_dir/profile/, and the top operators by self time in
the log."""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Optional

import torch.distributed as dist

from hydra_ddp import hooks
from hydra_ddp.config.schema import ProfilerConf
from hydra_ddp.rundir import RunDir

log = logging.getLogger(__name__)


class Profiling(hooks.Hook):
    """The profiler around the fit, its step() called once per optimizer step."""

    def __init__(self, settings: ProfilerConf):
        self.settings = settings  # the profiler section
        self.profiler: Optional[Any] = None

    @classmethod
    def of(cls, enabled: bool, settings: ProfilerConf) -> Optional[Profiling]:
        """The hook where trainer.profile is on and this rank is one of profiler.ranks; else
        None."""
        if not enabled or (settings.ranks is not None and dist.get_rank() not in settings.ranks):
            return None
        return cls(settings)

    def running(self, fit: hooks.Fit) -> contextlib.AbstractContextManager:
        from torch.profiler import ProfilerActivity, profile, schedule

        settings, rank = self.settings, fit.rank
        cuda = fit.device.type == "cuda"
        out = RunDir(fit.run_dir).profile
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

        self.profiler = profile(
            activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else []),
            schedule=schedule(
                wait=settings.wait, warmup=settings.warmup, active=settings.active, repeat=1
            ),
            on_trace_ready=ready,
        )
        return self.profiler

    def step_ended(self, event: hooks.StepEnded) -> None:
        self.profiler.step()
