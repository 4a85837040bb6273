"""hydra-ddp's Slurm launcher (conf/hydra/launcher/slurm.yaml): hydra-submitit-launcher's, except
that a job Slurm ended before it wrote a result (cancelled, timed out, its node failed) is a row of
the sweep report instead of an exception that ends the whole sweep, or a wait that never ends.

submitit learns a job's state from `sacct` alone. Without job accounting (slurmdbd) sacct fails, and
even with it an array task cancelled while the whole array still waited leaves no record (Slurm
22.05): submitit would wait for either forever. So the wait also asks `squeue`, every few seconds at
first and every minute at most: a job that left the queue without a result has ended.

A Hydra plugin (Hydra takes launchers only from the hydra_plugins package, and imports every module
there at each start): nothing heavy at import.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Optional

from hydra.core.utils import JobReturn, JobStatus
from omegaconf import OmegaConf, open_dict

from hydra_ddp.rundir import RunDir
from hydra_plugins.hydra_submitit_launcher.submitit_launcher import (
    SlurmLauncher as SubmititSlurmLauncher,
)

QUEUE_CHECK_S = (2.0, 60.0)  # the first and the longest interval between two squeue calls


class SlurmLauncher(SubmititSlurmLauncher):
    def launch(
        self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int
    ) -> Sequence[JobReturn]:
        import submitit

        jobs: list[Job] = []
        submit = submitit.AutoExecutor.map_array

        def map_array(executor: Any, *args: Any, **kwargs: Any) -> list[Job]:
            jobs.extend(Job(job) for job in submit(executor, *args, **kwargs))
            return jobs

        # The parent's launch builds the executor from the config, submits and waits for each job's
        # results(): only the jobs it waits on are ours.
        submitit.AutoExecutor.map_array = map_array  # type: ignore[method-assign]
        try:
            returns = super().launch(job_overrides, initial_job_idx)
        finally:
            submitit.AutoExecutor.map_array = submit  # type: ignore[method-assign]
        return [
            ret
            if job.ended is None
            else self._unfinished(job, list(overrides), initial_job_idx + i)
            for i, (ret, job, overrides) in enumerate(zip(returns, jobs, job_overrides))
        ]

    def _unfinished(self, job: Job, overrides: list[str], num: int) -> JobReturn:
        """Leave in the job's directory what the sweep report reads; return what a failed trial
        returns."""
        from hydra_ddp import tasks

        assert self.config is not None and self.hydra_context is not None
        config = self.hydra_context.config_loader.load_sweep_config(self.config, overrides)
        with open_dict(config.hydra.job):
            config.hydra.job.num = num
        job_dir = Path(str(self.config.hydra.sweep.dir)) / str(config.hydra.sweep.subdir)
        (job_dir / ".hydra").mkdir(parents=True, exist_ok=True)
        if not (job_dir / ".hydra" / "overrides.yaml").exists():  # it never started
            OmegaConf.save(OmegaConf.create(overrides), job_dir / ".hydra" / "overrides.yaml")
        message = f"Slurm job {job.job_id} ended {job.ended} without a result" + (
            f" ({job.why})" if job.why else ""
        )
        if Path(job.paths.stderr).exists():
            message += f"; its log: {job.paths.stderr}"
        RunDir(job_dir).error.write_text(f"{message}\n")
        RunDir(job_dir).slurm_state.write_text(f"{job.ended.lower()}\n")
        print(
            f"hydra-ddp: warning: job #{num} ({' '.join(overrides) or 'no overrides'}): {message}",
            file=sys.stderr,
        )
        return JobReturn(
            overrides=overrides,
            cfg=config,
            working_dir=str(job_dir),
            status=JobStatus.COMPLETED,
            _return_value=tasks.worst_for(config),
        )


class Job:
    """A submitted submitit job whose results() also end when the job left Slurm's queue without a
    result: then `ended` is its final state (CANCELLED, TIMEOUT, NODE_FAIL…) and results()
    [None]."""

    def __init__(self, job: Any) -> None:
        self.job = job
        self.job_id: str = job.job_id
        self.paths = job.paths
        self.ended: Optional[str] = None
        self.why = ""

    def results(self) -> list[Any]:
        from submitit.core.utils import UncompletedJobError

        interval, next_check = QUEUE_CHECK_S[0], time.monotonic()
        while not self.job.done():
            if time.monotonic() >= next_check:
                if not self._queued() and not self.job.done(force_check=True):
                    self.ended, self.why = self._accounted_state()
                    return [None]
                interval = min(2 * interval, QUEUE_CHECK_S[1])
                next_check = time.monotonic() + interval
            time.sleep(1)
        try:
            return self.job.results()
        except UncompletedJobError:  # sacct has a final state, and the job wrote nothing
            self.ended = self.job.state.split()[0]  # "CANCELLED by 0" → CANCELLED
            return [None]

    def _queued(self) -> bool:
        """Pending, running or completing; True too when squeue cannot say (the wait goes on)."""
        try:
            listed = subprocess.run(
                ["squeue", "-h", "-r", "-j", self.job_id, "-o", "%T"],
                capture_output=True,
                text=True,
                timeout=60,
            )
        except (OSError, subprocess.TimeoutExpired):
            return True
        return listed.returncode != 0 or bool(listed.stdout.strip())

    def _accounted_state(self) -> tuple[str, str]:
        """A job that left the queue with neither a result nor a final state that submitit saw."""
        try:
            sacct = subprocess.run(
                ["sacct", "-n", "-X", "-P", "-j", self.job_id, "-o", "State"],
                capture_output=True,
                text=True,
                timeout=60,
            )
        except (OSError, subprocess.TimeoutExpired):
            sacct = None
        if sacct is None or sacct.returncode != 0:
            return (
                "UNKNOWN",
                "it left the queue; without job accounting (sacct) Slurm keeps no reason",
            )
        states = sacct.stdout.split("\n")
        if states[0].strip():
            return states[0].split()[0], ""  # "CANCELLED by 0" → CANCELLED
        # Accounting works and has no record: removed before it ever ran, as a cancelled array task
        # is.
        return "CANCELLED", "it left the queue before it ran and has no accounting record"
