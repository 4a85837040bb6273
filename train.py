"""Train a model with DistributedDataParallel: compose the config, validate it, launch, summarise.

python train.py                                   # 2 CPU workers (or one per GPU)
python train.py backend=nccl launcher=torchrun trainer.nproc=8
python train.py -m trainer.nproc=1,2,4            # a sweep over world sizes
torchrun --standalone --nproc_per_node=2 train.py # launched from outside: no second launch
"""

import time

STARTED_AT = time.time()  # before the imports: wall time counts them too

import sys  # noqa: E402

from hydra_ddp.launch import ranks, startup  # noqa: E402  (neither imports torch)

CHECK_ONLY = __name__ == "__main__" and startup.take_check_flags(sys.argv)  # --check: launch nothing
if __name__ == "__main__" and not CHECK_ONLY and not ranks.external_launch():
    # The workers' imports (torch, the project) start now, in a forkserver, beside the parent's own.
    startup.preload(sys.argv)

with startup.frozen_imports():  # half a million objects that live as long as the process
    import hydra
    from omegaconf import DictConfig

    from hydra_ddp import monitor
    from hydra_ddp.config.schema import register_schema
    from hydra_ddp.errors import UserError
    from hydra_ddp.launch import command

register_schema(__name__)
_START = [STARTED_AT]


@hydra.main(version_base=None, config_path="conf", config_name="config")
def main(cfg: DictConfig) -> float | None:
    """Returns what a Hydra sweeper (e.g. Optuna) optimises: the best value of trainer.monitor
    (a validation metric: never the test set's)."""
    worst = monitor.worst_for(cfg)  # a value every finished run beats
    started_at = _START.pop() if _START else time.time()  # a multirun's later jobs in this process: now
    try:
        summary = command.run(cfg, started_at)
    except UserError as error:
        command.fail(error)  # one line, no traceback; in a multirun the next job still runs
        return worst  # a failed or diverged trial ranks last instead of ending the sweep
    if CHECK_ONLY:
        return worst if worst is not None else 0.0  # a sweeper asks each checked trial for a number
    if not summary:
        return None  # not node 0
    return summary["objective"] if summary["objective"] is not None else worst


if __name__ == "__main__":
    command.adopt_external_launch(sys.argv)
    command.exit_after(main)  # without the interpreter's teardown: seconds, at the end of every command
