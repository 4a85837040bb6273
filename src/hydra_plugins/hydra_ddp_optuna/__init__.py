"""hydra-ddp's Optuna sweeper (hydra/sweeper=optuna): a search over whole DDP jobs on Optuna's
ask/tell API, with pruning, trials that start as soon as a slot is free, and a study that a rerun
continues. Thin glue: the search space, the study and the pruning are hydra_ddp.search's and
hydra_ddp.search.pruning's.

A Hydra plugin (Hydra takes sweepers only from the hydra_plugins package, and imports every module
there at each start): nothing heavy at import.
"""
