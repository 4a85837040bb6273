"""Tools beside training: the tuner of the fast settings (tune) and of the data loader
(tune_loader), the writer of shard directories (shards), the config reference's generator
(config_reference: docs/reference/config.md from the schema), and train.py --check from Python
(preflight: for tests and the GPU check's dry run)."""

from __future__ import annotations

import sys


def measuring(schema: type) -> None:
    """A tool's command line: the training schema with the tool's own section (`schema`), and no
    output directory or log file (a measurement, not a run)."""
    from hydra.core.config_store import ConfigStore

    from hydra_ddp.config.schema import register_schema

    register_schema()
    ConfigStore.instance().store(name="schema", node=schema)
    sys.argv += ["hydra.run.dir=.", "hydra.output_subdir=null", "hydra/job_logging=disabled"]
