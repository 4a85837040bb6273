"""Evaluate a saved checkpoint on one split, through the same launchers as train.py.

    python eval.py ckpt=outputs/runs/DATE/TIME               # its best.pt (else last.pt), test split
    python eval.py ckpt=PATH/TO/step-00000120.pt split=val trainer.nproc=1
    python eval.py ckpt=RUN_DIR predict=true                 # also predictions.csv, in dataset order
    torchrun --standalone --nproc_per_node=3 eval.py ckpt=RUN_DIR

The model, data, seed and memory format are the checkpoint's own unless overridden here, so the
metrics are the run's own, bit for bit, at any world size. Writes eval.json (and predictions.csv)
in its own run directory, outputs/eval/DATE/TIME.
"""

import time

STARTED_AT = time.time()  # before the imports: wall time counts them too

import sys  # noqa: E402

from hydra_ddp.launch import ranks, startup  # noqa: E402  (neither imports torch)

CHECK_ONLY = __name__ == "__main__" and startup.take_check_flags(sys.argv)  # --check: launch nothing
if __name__ == "__main__" and not CHECK_ONLY and not ranks.external_launch():
    startup.preload(sys.argv)  # the workers' imports start now, beside the parent's (train.py's reason)

with startup.frozen_imports():  # train.py's reason
    import hydra
    from omegaconf import DictConfig

    from hydra_ddp.config.schema import register_schema
    from hydra_ddp.errors import UserError
    from hydra_ddp.launch import command

register_schema(__name__)


@hydra.main(version_base=None, config_path="conf", config_name="eval")
def main(cfg: DictConfig) -> float | None:
    """Returns the task's first metric on the split (its loss, for the built-in tasks)."""
    try:
        result = command.run(cfg, STARTED_AT, job="eval")
    except UserError as error:
        command.fail(error)
        return None
    return result[f"{cfg.split}_{result['metrics'][0]}"] if result else None


if __name__ == "__main__":
    command.adopt_external_launch(sys.argv)
    command.exit_after(main)
