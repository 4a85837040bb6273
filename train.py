"""Train a model with DistributedDataParallel: compose the config, validate it, launch, summarise.

python train.py                                   # 2 CPU workers (or one per GPU)
python train.py backend=nccl launcher=torchrun trainer.nproc=8
python train.py -m trainer.nproc=1,2,4            # a sweep over world sizes
torchrun --standalone --nproc_per_node=2 train.py # launched from outside: no second launch

The job itself is the package's (hydra_ddp.cli.run_job, also `hydra-ddp train`), composed from conf/
here."""

import time

STARTED_AT = time.time()  # before the imports: wall time counts them too

from pathlib import Path  # noqa: E402

from hydra_ddp import cli  # noqa: E402  (imports neither torch nor Hydra)

if __name__ == "__main__":
    cli.run_job("train", str(Path(__file__).resolve().parent / "conf"), STARTED_AT)
else:
    cli.as_worker_main(__name__)  # a worker's main module (__mp_main__)
