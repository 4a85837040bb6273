"""A run continued in its directory (trainer.resume=auto) that had already ended: found before
anything of it is touched."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

from hydra_ddp.config.schema import TrainerConf
from hydra_ddp.monitor import Monitor
from hydra_ddp.rundir import RunDir
from hydra_ddp.training import length as run_length


def already_complete(
    out: Path,
    resume: Optional[tuple[Path, dict[str, Any]]],
    length: run_length.RunLength,
    settings: TrainerConf,
) -> str:
    """The line that says a continued run had already ended, or "" (rank 0: the earlier summary,
    set aside by the launcher, says its run ended there, not stopped on a signal)."""
    if resume is None:
        return ""
    found = [p for p in (RunDir(out).earlier_summary, RunDir(out).summary) if p.exists()]
    earlier = json.loads(found[0].read_text()) if found else {}
    position = resume[1]["position"]
    if not earlier or earlier.get("stopped_by") or earlier.get("steps") != position["step"]:
        return ""
    monitor = Monitor.from_config(settings)
    monitor.load(resume[1].get("monitor"))
    why = run_length.ended_by(length, position, monitor.should_stop)
    if why is None:
        return ""
    more = (
        "trainer.early_stopping.patience"
        if why == "early_stopping"
        else "trainer.epochs or trainer.max_steps"
    )
    return (
        f"hydra-ddp: the run in {out} is complete (step {position['step']}, "
        f"ended by {why}): nothing to train; its summary, checkpoints and "
        f"logs are as they were (raise {more} to train on)"
    )
