"""Every rank's log: the console (rank 0, one line per failure) and the run's log file (every rank,
tracebacks included), and a crashed rank's stack."""

from __future__ import annotations

import faulthandler
import logging
import sys
from pathlib import Path
from typing import Any

from hydra_ddp.rundir import RunDir
from hydra_ddp.runtime.ranks import RankInfo

_FORMAT = "[%(asctime)s][rank {rank}][%(name)s][%(levelname)s] - %(message)s"


# `extra=` for records that belong in the log file only (tracebacks: the console gets one line).
FILE_ONLY = {"file_only": True}


class _Console(logging.StreamHandler):
    """Console records written through tqdm: a progress bar on the terminal is cleared first and
    drawn again below the line, so bar and record never share a line."""

    def emit(self, record: logging.LogRecord) -> None:
        from tqdm import tqdm

        try:
            tqdm.write(self.format(record), file=self.stream)
        except Exception:
            self.handleError(record)


def setup_logging(rank: RankInfo, run_dir: Path, job: str = "train") -> None:
    """All ranks append to run_dir/train.log (eval.log; tagged with the rank); rank 0 also prints,
    but for the tuner's short runs (job "tune"), whose figures the tuner prints."""
    root = logging.getLogger()
    for handler in root.handlers[:]:  # an externally launched rank 0 still holds Hydra's handlers
        root.removeHandler(handler)
        handler.close()
    formatter = logging.Formatter(_FORMAT.format(rank=rank.rank))
    _crash_dumps_to(RunDir(run_dir).log(job))
    handlers: list[logging.Handler] = [logging.FileHandler(RunDir(run_dir).log(job), mode="a")]
    # Python warnings (e.g. anomaly mode's forward traceback) become records: every rank's go to
    # the log file, none to the console, which keeps to one line per event.
    logging.captureWarnings(True)
    if rank.is_main and job != "tune":
        console = _Console(sys.stdout)
        console.addFilter(
            lambda record: not getattr(record, "file_only", False) and record.name != "py.warnings"
        )
        handlers.append(console)
    for handler in handlers:
        handler.setFormatter(formatter)
        root.addHandler(handler)
    root.setLevel(logging.INFO)


_crash_log: list[Any] = []  # the file faulthandler writes to: open for as long as it may


def _crash_dumps_to(path: Path) -> None:
    """A fatal signal's Python stacks (a segfault; NCCL's watchdog aborting a rank left waiting) go
    to the log file, not to the console, which keeps to the launcher's one line."""
    crash_log = open(path, "a")  # noqa: SIM115  (kept open: faulthandler writes to its descriptor)
    faulthandler.enable(file=crash_log, all_threads=True)
    for old in _crash_log:
        old.close()
    _crash_log[:] = [crash_log]
