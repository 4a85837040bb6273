"""Train a model with DistributedDataParallel: compose the config, validate it, launch, summarise.

    python train.py                                   # 2 CPU workers (or one per GPU)
    python train.py backend=nccl launcher=torchrun trainer.nproc=8
    python train.py -m trainer.nproc=1,2,4            # a sweep over world sizes
    torchrun --standalone --nproc_per_node=2 train.py # launched from outside: no second launch
"""

import time

STARTED_AT = time.time()  # before the imports: wall time counts them too

import sys  # noqa: E402

from hydra_ddp import ranks, startup  # noqa: E402  (neither imports torch)

if __name__ == "__main__" and not ranks.external_launch():
    # The workers' imports (torch, the project) start now, in a forkserver, beside the parent's own.
    startup.preload(sys.argv)

import hydra  # noqa: E402
from omegaconf import DictConfig

from hydra_ddp import launch  # noqa: E402
from hydra_ddp.config import register_schema  # noqa: E402
from hydra_ddp.errors import UserError  # noqa: E402

register_schema()


@hydra.main(version_base=None, config_path="conf", config_name="config")
def main(cfg: DictConfig) -> float | None:
    try:
        summary = launch.run(cfg, STARTED_AT)
    except UserError as error:
        launch.fail(error)  # one line, no traceback; in a multirun the next job still runs
        return None
    # The value a Hydra sweeper (e.g. Optuna) would optimise.
    return summary["test_accuracy"] if summary else None


if __name__ == "__main__":
    launch.adopt_external_launch(sys.argv)
    launch.exit_after(main)  # without the interpreter's teardown: seconds, at the end of every command
