"""Evaluate a saved checkpoint on one split, through the same launchers as train.py.

    python eval.py ckpt=outputs/runs/DATE/TIME      # its best.pt (else last.pt), test split
    python eval.py ckpt=PATH/TO/step-00000120.pt split=val trainer.nproc=1
    python eval.py ckpt=RUN_DIR predict=true        # also predictions.csv, in dataset order
    torchrun --standalone --nproc_per_node=3 eval.py ckpt=RUN_DIR

The model, data, seed and memory format are the checkpoint's own unless overridden here, so the
metrics are the run's own, bit for bit, at any world size. Writes eval.json (and predictions.csv)
in its own run directory, outputs/eval/DATE/TIME.
"""

import time

STARTED_AT = time.time()  # before the imports: wall time counts them too

from pathlib import Path  # noqa: E402

from hydra_ddp import cli  # noqa: E402  (imports neither torch nor Hydra)

if __name__ == "__main__":
    cli.run_job("eval", str(Path(__file__).resolve().parent / "conf"), STARTED_AT)
else:
    cli.as_worker_main(__name__)  # a worker's main module (__mp_main__)
