"""The study: Optuna's journal file in the sweep directory (or a storage URL), opened again by a
rerun of the same command, which marks the trials a crash left running as failed and continues to
n_trials; and what each trial's job directory says of how it ended.

Why a journal file and not SQLite: every trial's rank 0 writes to the study (its intermediate
values, for pruning) while sweeper processes ask and tell, all at once. The journal is an
append-only log behind a file lock, which Optuna recommends for several processes on one file
system; SQLite allows one writer at a time and fails the others with "database is locked" under
that load. `optuna.load_study` and optuna-dashboard read the journal file as they read a database.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Optional

from hydra_ddp.rundir import RunDir

JOURNAL = "optuna.journal"


def storage_of(location: str) -> Any:
    """An Optuna storage: a URL as Optuna takes it (sqlite:///..., postgresql://...), else a journal
    file."""
    if "://" in location:
        return location
    from optuna.storages import JournalStorage
    from optuna.storages.journal import JournalFileBackend

    return JournalStorage(JournalFileBackend(location))


def trial_seed(seed: int, stream: int) -> int:
    """A sampler seed of the search's `seed` for one trial: independent streams for 0, 1, 2, ...
    (numpy's SeedSequence), the same for the same pair."""
    import numpy as np

    return int(np.random.SeedSequence([int(seed), stream]).generate_state(1)[0])


def pruner_of(name: str, args: Any = None) -> Any:
    """Optuna's pruner by name, with its own arguments (e.g. MedianPruner's n_startup_trials)."""
    import optuna

    from hydra_ddp.errors import UserError

    kind = {
        "median": optuna.pruners.MedianPruner,
        "hyperband": optuna.pruners.HyperbandPruner,
        "none": optuna.pruners.NopPruner,
    }[name]
    try:
        return kind(**dict(args or {}))
    except TypeError as error:
        raise UserError(f"hydra.sweeper.pruner_args: {error}") from None


def started(study: Any) -> int:
    """Trials begun (running or ended), not those queued (enqueue_trial) and not yet asked for."""
    from optuna.trial import TrialState

    return len(
        study.get_trials(
            deepcopy=False,
            states=(TrialState.RUNNING, TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL),
        )
    )


def recover(study: Any, sweep_dir: Path) -> list[int]:
    """Trials a dead sweep left running: told how their jobs ended where a job finished before the
    sweep died (its summary written), else failed (the job died with it). The failed ones'
    numbers."""
    from optuna.trial import TrialState

    failed = []
    for trial in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        state, value = outcome(sweep_dir / str(trial.number), None)
        if state == "complete":
            study.tell(trial.number, value)
        else:
            study.tell(
                trial.number, state=TrialState.PRUNED if state == "pruned" else TrialState.FAIL
            )
            failed.append(trial.number)
    return failed


@contextlib.contextmanager
def exclusive(sweep_dir: Path) -> Iterator[None]:
    """Across the sweeper processes of one search: counting the trials and asking for the next is
    one step, so that together they start n_trials and not one more."""
    with open(sweep_dir / ".optuna.lock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def outcome(job_dir: Path, returned: Any) -> tuple[str, Optional[float]]:
    """How a trial's job ended, from its directory: ("pruned" | "complete", value) or ("fail",
    None)."""
    run = RunDir(job_dir)
    if run.error.exists() or not run.summary.exists():
        return "fail", None
    summary = json.loads(run.summary.read_text())
    value = summary.get("objective")
    if value is None or not math.isfinite(value):
        value = (
            float(returned)
            if isinstance(returned, (int, float)) and math.isfinite(returned)
            else None
        )
    if summary.get("ended_by") == "pruned":
        return "pruned", value
    return ("complete", value) if value is not None else ("fail", None)
